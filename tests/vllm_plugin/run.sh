#!/usr/bin/env bash
# CPU tests of sm7x's vLLM plugin (tests/vllm_plugin/) against each pinned vLLM, real vLLM Python
# without a GPU. ./test.sh runs it after the other tests; alone:
#
#     tests/vllm_plugin/run.sh                 # every version with a tests/vllm_plugin/requirements-*.txt
#     tests/vllm_plugin/run.sh 0.33 -- -k cache   # one version, extra pytest arguments
#
# Each version gets a venv .sm7x/vllm-VERSION layered on .sm7x/test-env (a .pth adds the
# test env's site-packages: torch, pytest, the editable sm7x with its CPU core library),
# with vLLM and the pure-Python modules it imports installed --no-deps from the pinned
# list, so nothing else (CUDA libraries, another torch) comes in. Rebuilt when the list
# changes.
set -euo pipefail
cd "$(dirname "$0")/../.."
source python/sm7x_tools/venv.sh

versions=() pytest_args=()
while (($#)); do
  if [[ $1 == -- ]]; then shift; pytest_args=("$@"); break; fi
  versions+=("$1"); shift
done
if ((${#versions[@]} == 0)); then
  for f in tests/vllm_plugin/requirements-*.txt; do versions+=("$(basename "$f" .txt | sed 's/^requirements-//')"); done
fi

ensure_venv .sm7x/test-env python/sm7x_tools/requirements.txt tests/requirements.txt
# the editable sm7x: its CPU core library (the cache-write tests run it) and its entry
# points, which vLLM reads from the installed metadata (./test.sh has just done this)
if [[ -z ${SM7X_EDITABLE_INSTALLED:-} ]]; then
  "$VENV_PY" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
fi
test_env_site=$("$VENV_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

status=0
for v in "${versions[@]}"; do
  req=tests/vllm_plugin/requirements-$v.txt
  [[ -f $req ]] || { echo "no $req" >&2; exit 2; }
  venv=.sm7x/vllm-$v
  stamp="$venv/.requirements-$(cat "$req" <(echo "$test_env_site") | sha256sum | cut -d' ' -f1)"
  if [[ ! -e $stamp ]]; then
    echo "installing vLLM $v (pinned, --no-deps) into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "import site; site.addsitedir('$test_env_site')" > "$site/zz-sm7x-test-env.pth"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$req"
    touch "$stamp"
  fi
  echo "== sm7x vLLM plugin tests, vLLM $v" >&2
  "$venv/bin/python" -m pytest -p no:cacheprovider tests/vllm_plugin "${pytest_args[@]}" || status=1
done
exit $status
