#!/usr/bin/env bash
# audit_libs.sh stable|no-torch FILE...: fail the package build when a shipped library is
# not what it is declared to be. `stable`: it may use torch only through stable-ABI C
# shims that torch 2.10 has; `no-torch`: it must not use torch at all. Always: its name
# (.abi3.so or this Python's SOABI) must match what it is. The audit runs from the
# (patched) source tree with the host Python.
set -euo pipefail
require=$1
shift
extra=()
[[ "$require" == stable ]] && extra=(--torch-target 2.10)
PYTHONPATH="$SRC_DIR/python" "$PYTHON" -m sm7x.audit --plain --no-abi3audit \
  --require "$require" "${extra[@]}" "$@"
