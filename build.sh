#!/usr/bin/env bash
# Build the sm7x conda channel into ./channel (see README.md; ./build.sh --help).
set -euo pipefail
cd "$(dirname "$0")"
source python/sm7x_tools/venv.sh
ensure_venv .sm7x/tools python/sm7x_tools/requirements.txt
PYTHONPATH=python exec "$VENV_PY" -m sm7x_tools.channel "$@"
