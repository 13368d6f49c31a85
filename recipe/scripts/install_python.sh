#!/usr/bin/env bash
# The pure-Python package: the (patched) sources of python/sm7x, without native files.
set -euo pipefail
mkdir -p "$SP_DIR"
cp -r python/sm7x "$SP_DIR/"
find "$SP_DIR/sm7x" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
# the version, said once in recipe.yaml's context, as the wheel build also writes it
printf '__version__ = "%s"\n' "$PKG_VERSION" > "$SP_DIR/sm7x/_version.py"
# Distribution metadata, for the entry points vLLM discovers with importlib.metadata
# (README, "Use it with vLLM"). Written here rather than by `pip install .`, which would
# run scikit-build-core's CMake build of the native modules (other outputs ship those).
# The entry points restate pyproject.toml's; tests/unit/test_vllm_plugin_metadata.py
# compares the two.
dist="$SP_DIR/sm7x-$PKG_VERSION.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: sm7x\nVersion: %s\nRequires-Python: >=3.10\n' \
  "$PKG_VERSION" > "$dist/METADATA"
printf 'conda\n' > "$dist/INSTALLER"
cat > "$dist/entry_points.txt" <<'ENTRY_POINTS'
[console_scripts]
sm7x = sm7x.__main__:main

[vllm.general_plugins]
sm7x = sm7x.integrations.vllm:register

[vllm.platform_plugins]
sm7x = sm7x.integrations.vllm:platform_plugin
ENTRY_POINTS
