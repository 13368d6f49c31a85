#!/usr/bin/env bash
# Repack the runtime library $LIB of the machine's compiler $SYSTEM_BIN (the file that
# compiler links against) into $PREFIX/lib, after checking the compiler's version and
# that the library needs no glibc newer than the __glibc the package declares.
set -euo pipefail
found=$("$SYSTEM_BIN" -dumpfullversion)
if [[ "$found" != "$EXPECTED" ]]; then
  echo "error: $SYSTEM_BIN is $found but this package repacks $EXPECTED's $LIB; update gcc_version in compilers/recipe.yaml" >&2
  exit 1
fi
real=$(readlink -f "$("$SYSTEM_BIN" -print-file-name="$LIB")")
[[ -f "$real" ]] || { echo "error: $SYSTEM_BIN has no $LIB" >&2; exit 1; }
need=$(readelf -VW "$real" | grep -oE 'GLIBC_[0-9.]+' | sed 's/GLIBC_//' | sort -V | tail -1)
if [[ "$(printf '%s\n%s\n' "$need" "$MACHINE_GLIBC" | sort -V | tail -1)" != "$MACHINE_GLIBC" ]]; then
  echo "error: $real needs GLIBC_$need, more than the declared __glibc >=$MACHINE_GLIBC; update machine_glibc in compilers/recipe.yaml" >&2
  exit 1
fi
mkdir -p "$PREFIX/lib"
install -m755 "$real" "$PREFIX/lib/$(basename "$real")"
[[ "$(basename "$real")" == "$LIB" ]] || ln -s "$(basename "$real")" "$PREFIX/lib/$LIB"
