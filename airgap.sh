#!/usr/bin/env bash
# Carry sm7x environments across an air gap: bundle, verify, merge (./airgap.sh --help).
set -euo pipefail
cd "$(dirname "$0")"
source builder/venv.sh
ensure_venv .sm7x/tools builder/requirements.txt
exec "$VENV_PY" -m builder.airgap "$@"
