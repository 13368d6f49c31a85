"""`import sm7x` is cheap: no torch, no native library (README, "The loader")."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sm7x

# Runs in a fresh interpreter: the test process may already have torch loaded.
PROBE = r"""
import importlib, os, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
pkg = os.path.dirname(os.path.realpath(sys.modules["sm7x"].__file__))
assert "torch" not in sys.modules, "torch was imported"
assert "sm7x._sched" not in sys.modules, "sm7x._sched was imported"
native = [n for n, m in list(sys.modules.items())
          if n.startswith("sm7x") and str(getattr(m, "__file__", "")).endswith(".so")]
assert not native, f"native sm7x modules imported: {native}"
with open("/proc/self/maps") as f:
    mapped = {line.split()[-1] for line in f if len(line.split()) >= 6}
ours = sorted(p for p in mapped if os.path.realpath(p).startswith(pkg + os.sep))
assert not ours, f"files from the sm7x package mapped: {ours}"
print("OK", pkg)
"""

MODULES = ["sm7x", "sm7x._select", "sm7x._install_hints", "sm7x.doctor", "sm7x.__main__"]


def _probe(modules, env=None, flags=()):
    proc = subprocess.run([sys.executable, *flags, "-c", PROBE, *modules], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("module", MODULES)
def test_import_loads_nothing_native(module):
    assert _probe([module]).startswith("OK")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_import_ignores_native_files_in_package(tmp_path):
    # A copy of the package next to (fake) native modules: importing must not touch them,
    # so any attempt to load one would fail or show up in the memory map.
    pkg = tmp_path / "sm7x"
    shutil.copytree(Path(sm7x.__file__).parent, pkg,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (pkg / "fa2").mkdir(exist_ok=True)
    for name in ("_core.abi3.so", "_sched.cpython-311-x86_64-linux-gnu.so",
                 "fa2/_fa2_sm70.abi3.so", "fa2/_fa2_sm75.abi3.so"):
        (pkg / name).write_bytes(b"not an ELF file")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    # -S: an editable install's import hook (a .pth in site-packages) would win over
    # PYTHONPATH and import the real package instead of this copy.
    out = _probe(["sm7x", "sm7x.doctor"], env=env, flags=("-S",))
    assert out.strip() == f"OK {os.path.realpath(pkg)}"


# What sm7x's torch-facing modules import on top of torch itself, in a fresh interpreter.
# torch._dynamo is what once made `import sm7x.ops` take about 3 s more than torch (the
# torch.compiler.assume_constant_result decorator imports it): none of these may need it.
TORCH_PROBE = r"""
import sys
import torch
before = set(sys.modules)
for name in sys.argv[1:]:
    __import__(name)
heavy = sorted(n for n in set(sys.modules) - before
               if n.startswith(("torch._dynamo", "torch._inductor", "numpy", "sympy")))
assert not heavy, f"imported on top of torch: {heavy[:8]}"
print("OK")
"""


@pytest.mark.parametrize("module", ["sm7x.ops", "sm7x.fa2", "sm7x.bench"])
def test_torch_modules_import_nothing_heavy_beyond_torch(module):
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", TORCH_PROBE, module],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]
