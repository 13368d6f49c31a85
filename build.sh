#!/usr/bin/env bash
# Build the sm7x conda channel into ./channel (see README.md; ./build.sh --help).
set -euo pipefail
cd "$(dirname "$0")"
source builder/venv.sh
ensure_tools_venv builder/requirements.txt
exec "$TOOLS_PY" -m builder "$@"
