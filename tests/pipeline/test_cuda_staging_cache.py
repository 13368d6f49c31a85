"""recipe/scripts/build_cuda.sh compiles once per build: rattler-build runs the CUDA staging
script once per inheriting output (sm7x-core, sm7x-fa2-sm70, sm7x-fa2-sm75), and each run
compiled the same 92 steps again. With $SM7X_STAGING_CACHE (set by ./build.sh) a run with
the same inputs installs what the first one built. Tested with a stand-in cmake that
records each compile and installs a file, in the environment rattler-build gives a build
script (SRC_DIR as the working directory, PREFIX, BUILD_PREFIX, SP_DIR)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sm7x_tools import REPO

SCRIPT = REPO / "recipe" / "scripts" / "build_cuda.sh"
FAKE_CMAKE = """#!/usr/bin/env bash
case "$1" in
  --build) echo compiled >> "$COMPILE_LOG" ;;
  --install) mkdir -p "$SP_DIR/sm7x/fa2" && cat "$SRC_DIR/csrc/k.cu" > "$SP_DIR/sm7x/fa2/_fa2_sm75.abi3.so" \
               && echo core > "$SP_DIR/sm7x/_core.abi3.so" ;;
esac
"""


def _tree(tmp: Path) -> dict:
    src = tmp / "src"
    (src / "csrc").mkdir(parents=True)
    (src / "csrc" / "k.cu").write_text("kernel v1\n")
    (src / "python" / "sm7x").mkdir(parents=True)
    (src / "python" / "sm7x" / "targets.json").write_text("{}\n")
    for env, pkgs in (("build", ["cuda-nvcc_linux-64-12.4.131-h0_0.json"]),
                      ("host", ["libtorch-2.13.0-cpu_h0_0.json"])):
        (tmp / env / "conda-meta").mkdir(parents=True)
        for p in pkgs:
            (tmp / env / "conda-meta" / p).write_text("{}")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text(FAKE_CMAKE)
    (bin_dir / "cmake").chmod(0o755)
    return {"SRC_DIR": str(src), "BUILD_PREFIX": str(tmp / "build"), "PREFIX": str(tmp / "host"),
            "PYTHON": "python3", "SM7X_CUDA_ARCHS": "70;75", "COMPILE_LOG": str(tmp / "compiles"),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _run(env: dict, sp_dir: Path, cache: Path | None) -> None:
    env = {**env, "SP_DIR": str(sp_dir)}
    if cache is not None:
        env["SM7X_STAGING_CACHE"] = str(cache)
    subprocess.run(["bash", str(SCRIPT)], cwd=env["SRC_DIR"], env=env, check=True,
                   capture_output=True, text=True)


def _compiles(env: dict) -> int:
    log = Path(env["COMPILE_LOG"])
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_three_outputs_compile_once_and_install_the_same_files(tmp_path):
    env, cache = _tree(tmp_path), tmp_path / "cache"
    for n in range(3):  # sm7x-core, sm7x-fa2-sm70, sm7x-fa2-sm75
        _run(env, tmp_path / f"sp{n}", cache)
    assert _compiles(env) == 1
    for n in (1, 2):
        for f in ("sm7x/_core.abi3.so", "sm7x/fa2/_fa2_sm75.abi3.so"):
            assert (tmp_path / f"sp{n}" / f).read_bytes() == (tmp_path / "sp0" / f).read_bytes()
    assert not list(cache.glob("*.partial"))


def test_any_changed_input_compiles_again(tmp_path):
    env, cache = _tree(tmp_path), tmp_path / "cache"
    _run(env, tmp_path / "a", cache)
    (Path(env["SRC_DIR"]) / "csrc" / "k.cu").write_text("kernel v2\n")
    _run(env, tmp_path / "b", cache)
    assert (tmp_path / "b" / "sm7x/fa2/_fa2_sm75.abi3.so").read_text() == "kernel v2\n"
    _run({**env, "SM7X_CUDA_ARCHS": "75"}, tmp_path / "c", cache)
    (Path(env["PREFIX"]) / "conda-meta" / "libtorch-2.14.0-cpu_h0_0.json").write_text("{}")
    _run(env, tmp_path / "d", cache)
    assert _compiles(env) == 4


def test_without_the_cache_every_run_compiles(tmp_path):
    """Plain rattler-build and conda-build set no cache: nothing changes for them."""
    env = _tree(tmp_path)
    _run(env, tmp_path / "a", None)
    _run(env, tmp_path / "b", None)
    assert _compiles(env) == 2
