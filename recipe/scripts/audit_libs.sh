#!/usr/bin/env bash
# Fail the package build when a shipped library is unstable or mis-declared: every
# torch-using file must import only stable-ABI C shims available in torch 2.10, and its
# name (.abi3.so) must match what it is. The audit runs from the (patched) source tree.
set -euo pipefail
PYTHONPATH="$SRC_DIR/python" "$PYTHON" -m sm7x.audit --plain --no-abi3audit \
  --require stable --torch-target 2.10 "$@"
