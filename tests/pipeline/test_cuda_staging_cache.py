"""recipe/scripts/build_cuda.sh compiles once per build: rattler-build runs the CUDA staging
script once per inheriting output (sm7x-core, sm7x-fa2-sm70, sm7x-fa2-sm75), each in its
own build directory under <output dir>/bld, and each run compiled the same 92 steps again.
Tested with a stand-in cmake that records each compile and installs a file, in the layout
and environment rattler-build gives a build script (SRC_DIR as the working directory,
PREFIX, BUILD_PREFIX, SP_DIR)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from sm7x_tools import REPO

SCRIPT = REPO / "recipe" / "scripts" / "build_cuda.sh"
FAKE_CMAKE = """#!/usr/bin/env bash
case "$1" in
  --build) echo compiled >> "$COMPILE_LOG" ;;
  --install) mkdir -p "$SP_DIR/sm7x/fa2" && cat "$SRC_DIR/csrc/k.cu" > "$SP_DIR/sm7x/fa2/_fa2_sm75.abi3.so" \\
               && echo core > "$SP_DIR/sm7x/_core.abi3.so" ;;
esac
"""


def _output_dir(tmp: Path) -> Path:
    out = tmp / "out"
    (out / "bld").mkdir(parents=True)
    (out / ".condapackageignore").write_text("*\n")  # rattler-build writes it into every output dir
    return out


def _source(bld_dir: Path) -> Path:
    """One output's build directory as rattler-build lays it out, with the recipe's source."""
    src = bld_dir / "work"
    (src / "csrc").mkdir(parents=True)
    (src / "csrc" / "k.cu").write_text("kernel v1\n")
    (src / "python" / "sm7x").mkdir(parents=True)
    (src / "python" / "sm7x" / "targets.json").write_text("{}\n")
    for env, pkgs in (("build_env", ["cuda-nvcc_linux-64-12.4.131-h0_0.json"]),
                      ("host_env", ["libtorch-2.13.0-cpu_h0_0.json"])):
        (bld_dir / env / "conda-meta").mkdir(parents=True)
        for p in pkgs:
            (bld_dir / env / "conda-meta" / p).write_text("{}")
    return src


def _run(tmp: Path, bld_dir: Path, want_log: bool = False, **extra):
    """Run the staging script in bld_dir (its source made if missing); return its SP_DIR
    (or, with want_log, what it printed)."""
    src = bld_dir / "work"
    if not src.exists():
        _source(bld_dir)
    bin_dir = tmp / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "cmake").write_text(FAKE_CMAKE)
        (bin_dir / "cmake").chmod(0o755)
    sp_dir = bld_dir / "host_env" / "lib" / "python3.10" / "site-packages"
    env = {"SRC_DIR": str(src), "BUILD_PREFIX": str(bld_dir / "build_env"), "PREFIX": str(bld_dir / "host_env"),
           "SP_DIR": str(sp_dir), "PYTHON": "python3", "SM7X_CUDA_ARCHS": "70;75",
           "COMPILE_LOG": str(tmp / "compiles"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **extra}
    # as rattler-build runs a build script: a copy in the work directory, with this
    # output's own environment written in front of it, and RECIPE_DIR set
    wrapper = src / "conda_build.sh"
    wrapper.write_text(f"export PKG_NAME={bld_dir.name}\n" + SCRIPT.read_text())
    env["RECIPE_DIR"] = str(SCRIPT.parents[1])
    proc = subprocess.run(["bash", str(wrapper)], cwd=src, env=env, check=True, capture_output=True, text=True)
    return proc.stdout + proc.stderr if want_log else sp_dir


def _compiles(tmp: Path) -> int:
    log = tmp / "compiles"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_three_outputs_compile_once_and_install_the_same_files(tmp_path):
    out = _output_dir(tmp_path)
    sp = [_run(tmp_path, out / "bld" / f"rattler-build_{name}_1764900000")
          for name in ("sm7x-core", "sm7x-fa2-sm70", "sm7x-fa2-sm75")]
    assert _compiles(tmp_path) == 1
    for other in sp[1:]:
        for f in ("sm7x/_core.abi3.so", "sm7x/fa2/_fa2_sm75.abi3.so"):
            assert (other / f).read_bytes() == (sp[0] / f).read_bytes()
    entries = sorted(p.name for p in (out / "bld" / "sm7x-cuda-staging").iterdir())
    # one entry and the inputs that made its key; nothing partial or temporary is left
    assert len(entries) == 2 and entries[0].endswith(".inputs") and entries[1] == entries[0][:-7] + ".tar"


def test_any_changed_input_compiles_again(tmp_path):
    out = _output_dir(tmp_path)
    first = out / "bld" / "rattler-build_a_1"
    _run(tmp_path, first)
    second = out / "bld" / "rattler-build_b_1"
    _source(second)
    (second / "work" / "csrc" / "k.cu").write_text("kernel v2\n")
    assert (_run(tmp_path, second) / "sm7x/fa2/_fa2_sm75.abi3.so").read_text() == "kernel v2\n"
    _run(tmp_path, out / "bld" / "rattler-build_c_1", SM7X_CUDA_ARCHS="75")
    fourth = out / "bld" / "rattler-build_d_1"
    _source(fourth)
    (fourth / "host_env" / "conda-meta" / "libtorch-2.14.0-cpu_h0_0.json").write_text("{}")
    _run(tmp_path, fourth)
    assert _compiles(tmp_path) == 4
    _run(tmp_path, out / "bld" / "rattler-build_e_1")  # the first one's inputs again
    assert _compiles(tmp_path) == 4


def test_a_miss_says_which_input_changed(tmp_path):
    out = _output_dir(tmp_path)
    _run(tmp_path, out / "bld" / "rattler-build_a_1")
    second = out / "bld" / "rattler-build_b_1"
    _source(second)
    (second / "work" / "csrc" / "k.cu").write_text("kernel v2\n")
    log = _run(tmp_path, second, want_log=True)
    assert "the inputs differ from" in log and "csrc/k.cu" in log


def test_an_interrupted_entry_is_never_read(tmp_path):
    """A run killed while writing its entry leaves only a .partial file: the next compiles."""
    out = _output_dir(tmp_path)
    _run(tmp_path, out / "bld" / "rattler-build_a_1")
    (entry,) = (out / "bld" / "sm7x-cuda-staging").glob("*.tar")
    entry.rename(entry.with_name(entry.name + ".partial"))
    sp = _run(tmp_path, out / "bld" / "rattler-build_b_1")
    assert _compiles(tmp_path) == 2 and (sp / "sm7x/_core.abi3.so").exists()


def test_outside_rattler_builds_layout_every_run_compiles(tmp_path):
    """A script run by hand, or any layout without rattler-build's output directory (conda-build
    also has it, under --output-folder): nothing is recognized, nothing is kept."""
    out = _output_dir(tmp_path)
    (out / ".condapackageignore").unlink()
    _run(tmp_path, out / "bld" / "rattler-build_a_1")
    _run(tmp_path, out / "bld" / "rattler-build_b_1")
    plain = tmp_path / "elsewhere" / "x"
    _run(tmp_path, plain)
    assert _compiles(tmp_path) == 3
    assert not (out / "bld" / "sm7x-cuda-staging").exists()
    shutil.rmtree(plain)
