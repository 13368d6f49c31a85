#!/usr/bin/env bash
# audit_libs.sh stable|no-torch FILE...: fail the package build when a shipped library is
# not what it is declared to be. `stable`: it may use torch only through stable-ABI C
# shims that the torch floor (targets.json torch.min) has; `no-torch`: it must not use torch at all. Always: its name
# (.abi3.so or this Python's SOABI) must match what it is, and an .abi3.so must use no
# Python C API (abi3audit is not in the offline build env). The audit is a build tool:
# it runs from the (patched) source tree, python/sm7x_tools/audit, with the host Python
# and pyelftools; it is not in any package.
set -euo pipefail
require=$1
shift
extra=()
[[ "$require" == stable ]] && extra=(--torch-target floor)
PYTHONPATH="$SRC_DIR/python" "$PYTHON" -m sm7x_tools.audit --no-abi3audit \
  --require "$require" "${extra[@]}" "$@"
