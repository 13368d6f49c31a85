#!/usr/bin/env bash
# The pure-Python package: the (patched) sources of python/sm7x, without native files.
set -euo pipefail
mkdir -p "$SP_DIR"
cp -r python/sm7x "$SP_DIR/"
find "$SP_DIR/sm7x" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
# the version, said once in recipe.yaml's context, as the wheel build also writes it
printf '__version__ = "%s"\n' "$PKG_VERSION" > "$SP_DIR/sm7x/_version.py"
