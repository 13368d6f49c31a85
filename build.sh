#!/usr/bin/env bash
# Build the sm7x conda channel into ./channel (see README.md; ./build.sh --help).
set -euo pipefail
cd "$(dirname "$0")"
source builder/venv.sh
ensure_venv .sm7x/tools builder/requirements.txt
exec "$VENV_PY" -m builder "$@"
