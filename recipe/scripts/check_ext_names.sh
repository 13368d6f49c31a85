#!/usr/bin/env bash
# Fail the package build when a pybind11 module is not named with the host Python's
# SOABI (a module declared limited-API gets .abi3.so, which it is not).
set -euo pipefail
suffix=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
found=0
for so in "$SP_DIR"/sm7x/*.so; do
  case "$so" in
    *"$suffix") found=1 ;;
    *) echo "error: $so is not named with this Python's suffix $suffix" >&2; exit 1 ;;
  esac
done
[[ $found == 1 ]] || { echo "error: no pybind11 module in $SP_DIR/sm7x" >&2; exit 1; }
