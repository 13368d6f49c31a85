#!/usr/bin/env bash
# Install $TRIPLET-<alias> wrappers that exec the machine's compiler, and an activation
# script that exports $VAR like conda-forge's compiler activation does.
set -euo pipefail
if [[ ! -x "$SYSTEM_BIN" ]]; then
  echo "error: $SYSTEM_BIN not found; install it (apt-get install ${TOOL}-12) or build against conda-forge" >&2
  exit 1
fi
found=$("$SYSTEM_BIN" -dumpfullversion)
if [[ "$found" != "$EXPECTED" ]]; then
  echo "error: $SYSTEM_BIN is $found but this package wraps $EXPECTED; update gcc_version in compilers/recipe.yaml" >&2
  exit 1
fi
mkdir -p "$PREFIX/bin" "$PREFIX/etc/conda/activate.d" "$PREFIX/share/$PKG_NAME"
# With sysroot_linux-64 installed next to the wrapper (conda-forge's layout: conda-forge's
# gcc finds its sysroot there too), compile and link against it: its glibc headers, its
# link stubs ahead of the machine's libraries (-L; -rpath-link for the libraries'
# own dependencies). libstdc++ and libgcc stay the compiler's (run dependencies).
extra=""
if [[ "$TOOL" == g++ ]]; then
  install -Dm644 "$RECIPE_DIR/include/bits/c++config.h" "$PREFIX/share/$PKG_NAME/include/bits/c++config.h"
  extra=" -isystem \"\$here/../share/$PKG_NAME/include\""
fi
for alias in $ALIASES; do
  cat > "$PREFIX/bin/$TRIPLET-$alias" <<WRAPPER
#!/bin/sh
here=\$(dirname "\$0")
sysroot="\$here/../x86_64-conda-linux-gnu/sysroot"
if [ -d "\$sysroot" ]; then
  exec $SYSTEM_BIN --sysroot="\$sysroot"$extra "\$@" -L"\$sysroot/usr/lib" -Wl,-rpath-link,"\$sysroot/usr/lib"
fi
exec $SYSTEM_BIN "\$@"
WRAPPER
  chmod 755 "$PREFIX/bin/$TRIPLET-$alias"
done
main="$TRIPLET-${ALIASES%% *}"
printf 'export %s="${CONDA_PREFIX}/bin/%s"\n' "$VAR" "$main" \
  > "$PREFIX/etc/conda/activate.d/activate-$PKG_NAME.sh"
