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
mkdir -p "$PREFIX/bin" "$PREFIX/etc/conda/activate.d"
for alias in $ALIASES; do
  printf '#!/bin/sh\nexec %s "$@"\n' "$SYSTEM_BIN" > "$PREFIX/bin/$TRIPLET-$alias"
  chmod 755 "$PREFIX/bin/$TRIPLET-$alias"
done
main="$TRIPLET-${ALIASES%% *}"
printf 'export %s="${CONDA_PREFIX}/bin/%s"\n' "$VAR" "$main" \
  > "$PREFIX/etc/conda/activate.d/activate-$PKG_NAME.sh"
