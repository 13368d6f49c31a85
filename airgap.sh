#!/usr/bin/env bash
# Carry sm7x environments across an air gap: bundle, verify, merge (./airgap.sh --help).
set -euo pipefail
cd "$(dirname "$0")"
source python/sm7x_tools/venv.sh
ensure_venv .sm7x/tools python/sm7x_tools/requirements.txt
PYTHONPATH=python exec "$VENV_PY" -m sm7x_tools.airgap "$@"
