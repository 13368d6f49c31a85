"""sm7x-core from ./channel: one abi3 build that installs into every Python, loads in a
CPU-only torch 2.13, works without torch for metadata, and passes the ABI audit."""

from __future__ import annotations

import json
import subprocess

import pytest
from pkgtest import CHANNEL, CHANNELS, run
from sourcetree import run_tool

from sm7x import _targets
from sm7x_tools import envs

pytestmark = pytest.mark.package


OPS = r"""
import torch, sm7x.ops as o
torch.manual_seed(0)
x = torch.randn(7, 96, dtype=torch.float16); w = torch.rand(96, dtype=torch.float16)
ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float())
torch.testing.assert_close(o.rms_norm(x, w, 1e-6).float(), ref, atol=2e-3, rtol=2e-3)
g = torch.randn(3, 2 * 40)
torch.testing.assert_close(o.silu_and_mul(g), torch.nn.functional.silu(g[:, :40]) * g[:, 40:])
names = ("fused_add_rms_norm", "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul")
print([n for n in names if hasattr(torch.ops.sm7x, n)])
"""


def core_records():
    data = json.loads((CHANNEL / "linux-64" / "repodata.json").read_text())["packages.conda"]
    return [r for r in data.values() if r["name"] == "sm7x-core"]



def test_one_abi3_build_for_every_python_and_torch():
    (rec,) = core_records()
    assert rec.get("noarch") == "python", "a version-independent (CEP 20 abi3) package"
    assert not any(d.startswith(("python_abi", "pytorch", "libtorch")) for d in rec["depends"]), rec["depends"]
    assert "python >=3.10" in rec["depends"]
    assert {f"pytorch >={_targets.torch_min()}", "__cuda >=12"} <= set(rec.get("constrains", [])), rec.get("constrains")


@pytest.mark.parametrize("python", ["3.10", "3.12", "3.13"])
def test_installs_without_torch(tmp_path, python):
    env = envs.create(tmp_path / "env", ["sm7x", f"python {python}.*"], CHANNELS)
    assert "sm7x-core" in env.names and "pytorch" not in env.names
    lib = env.prefix / "lib" / f"python{python}" / "site-packages" / "sm7x" / "_core.abi3.so"
    assert lib.is_file()
    info = json.loads(run(env, "-m", "sm7x", "doctor", "--json"))
    assert any(entry["file"] == "_core.abi3.so" for entry in info["libraries"]), info["libraries"]
    # without torch the ops module explains itself instead of crashing the process
    proc = subprocess.run([str(env.python), "-c", "import sm7x.ops"], capture_output=True, text=True)
    assert proc.returncode == 1 and f"needs PyTorch >= {_targets.torch_min()}" in proc.stderr, proc.stderr


def test_ops_run_in_a_cpu_torch_environment(tmp_path):
    env = envs.create(tmp_path / "env", ["sm7x", "python 3.11.*", "pytorch 2.13.*", "pip"], CHANNELS)
    # every Python dependency torch's metadata declares is there (setuptools included)
    assert "No broken requirements found" in run(env, "-m", "pip", "check")
    out = run(env, "-c", OPS)
    for op in ("fused_add_rms_norm", "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul"):
        assert op in out
    # the shipped file passes the audit: stable ABI for the torch floor, abi3 name and API
    lib = env.prefix / "lib" / "python3.11" / "site-packages" / "sm7x" / "_core.abi3.so"
    proc = run_tool("sm7x_tools.audit", "--json", "--require", "stable", "--torch-target", _targets.torch_min(), lib)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = json.loads(proc.stdout)["files"]
    assert record["torch"]["verdict"] == "STABLE", record["torch"]
