#!/usr/bin/env bash
# Run the sm7x tests (see README.md). Installs the pinned test tools, builds the native
# modules in place with an editable install, then runs pytest with any arguments given;
# without arguments, then also the vLLM plugin's tests (tests/vllm_plugin/run.sh).
# Package tests install from ./channel (made by ./build.sh) and skip when it is absent,
# except under CI, where a missing channel is an error.
set -euo pipefail
cd "$(dirname "$0")"
source python/sm7x_tools/venv.sh
ensure_venv .sm7x/test-env python/sm7x_tools/requirements.txt tests/requirements.txt
"$VENV_PY" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
"$VENV_PY" -m pytest "$@"
# With no arguments (CI): also the vLLM plugin's CPU tests against each pinned vLLM, in
# their own venvs (tests/vllm_plugin/run.sh; vLLM cannot share the test env's packages).
if (($# == 0)); then
  SM7X_EDITABLE_INSTALLED=1 tests/vllm_plugin/run.sh
fi
