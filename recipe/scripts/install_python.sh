#!/usr/bin/env bash
# The pure-Python package, installed with pip from pyproject.toml as conda-forge installs
# Python packages: the sources of python/sm7x (patched), sm7x/_version.py from the
# recipe's version, and a dist-info (importlib.metadata, pip list, and the entry points
# vLLM discovers). CMake is off (wheel.cmake=false): the native modules are other outputs.
set -euo pipefail
"$PYTHON" -m pip install . --no-deps --no-build-isolation --no-index -vv \
  --config-settings=wheel.cmake=false
dist=("$SP_DIR"/sm7x-"$PKG_VERSION".dist-info)
# the console script is the recipe's entry point (a noarch launcher), not pip's; its RECORD
# line goes too (pip's script holds the build prefix in its shebang: its hash differed per
# build directory, so the package was not reproducible)
rm -f "$PREFIX/bin/sm7x"
sed -i '/^\(\.\.\/\)*bin\/sm7x,/d' "${dist[0]}/RECORD"
# pip records where it installed from (the build's work directory): not the user's business
rm -f "${dist[0]}/direct_url.json"
sed -i '/^sm7x-[^/]*\.dist-info\/direct_url\.json,/d' "${dist[0]}/RECORD"
if find "$SP_DIR/sm7x" -name '*.so' | grep -q .; then
  echo "error: native modules ended up in the pure-Python sm7x package" >&2
  exit 1
fi
