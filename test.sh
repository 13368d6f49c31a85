#!/usr/bin/env bash
# Run the sm7x tests (see README.md). Installs the pinned test tools, builds the native
# modules in place with an editable install, then runs pytest with any arguments given.
# Package tests install from ./channel (made by ./build.sh) and skip when it is absent,
# except under CI, where a missing channel is an error.
set -euo pipefail
cd "$(dirname "$0")"
source python/sm7x_tools/venv.sh
ensure_venv .sm7x/test-env python/sm7x_tools/requirements.txt tests/requirements.txt
"$VENV_PY" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
exec "$VENV_PY" -m pytest "$@"
