"""sm7x-fa2-sm75 from ./channel: one abi3 build, the flash-attn API behind `sm7x`, and
static checks of the shipped SASS with the channel's own CUDA tools (no GPU needed)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from builder import envs
from pkgtest import CHANNEL, CHANNELS, run

pytestmark = pytest.mark.package

LIB = "lib/python3.11/site-packages/sm7x/fa2/_fa2_sm75.abi3.so"
TURING_SHARED = 64 * 1024   # bytes per block
TURING_REGS = 255           # per thread (65536 per SM, 1024 threads)

CPU_CALL = r"""
import torch, sm7x
q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
try:
    sm7x.flash_attn_func(q, q, q)
except Exception as exc:
    print(type(exc).__name__, exc)
else:
    raise SystemExit("a CPU tensor must be refused")
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return envs.create(tmp_path_factory.mktemp("fa2") / "env",
                       ["sm7x", "sm7x-fa2-sm75", "python 3.11.*", "pytorch 2.13.*",
                        "cuda-nvcc_linux-64", "cuda-nvdisasm"], CHANNELS)


def test_one_abi3_build():
    data = json.loads((CHANNEL / "linux-64" / "repodata.json").read_text())["packages.conda"]
    (rec,) = [r for r in data.values() if r["name"] == "sm7x-fa2-sm75"]
    assert rec.get("noarch") == "python" and rec["build"].startswith("cuda124_")
    assert {"pytorch >=2.10", "__cuda >=12"} <= set(rec.get("constrains", []))
    assert not any(d.startswith(("python_abi", "pytorch", "libtorch")) for d in rec["depends"])


def test_api_refuses_cpu_tensors_with_a_clear_error(env):
    out = run(env, "-c", CPU_CALL)
    assert "CUDA" in out, out


def _res_usage(env) -> list[dict]:
    text = subprocess.run([str(env.prefix / "bin" / "cuobjdump"), "-res-usage", str(env.prefix / LIB)],
                          capture_output=True, text=True, check=True).stdout
    kernels, name = [], None
    for line in text.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and name:
            reg, stack, shared, local = map(int, m.groups())
            kernels.append({"name": name, "reg": reg, "stack": stack, "shared": shared, "local": local})
    return kernels


def test_sass_targets_sm75_with_ptx_for_compute_75(env):
    out = subprocess.run([str(env.prefix / "bin" / "cuobjdump"), "--list-elf", "--list-ptx", str(env.prefix / LIB)],
                         capture_output=True, text=True, check=True).stdout
    assert re.findall(r"sm_\d+", out) and set(re.findall(r"\.(sm_\d+)\.(?:cubin|ptx)", out)) == {"sm_75"}, out
    assert ".ptx" in out and ".cubin" in out


def test_tensor_cores_ldmatrix_and_wide_loads_in_every_attention_kernel(env):
    sass = subprocess.run([str(env.prefix / "bin" / "cuobjdump"), "-sass", str(env.prefix / LIB)],
                          capture_output=True, text=True, check=True).stdout
    bodies = re.split(r"\n\s*Function : ", sass)[1:]
    attention = [b for b in bodies if "HMMA" in b or "fwd" in b.split("\n", 1)[0].lower()]
    assert attention, "no attention kernel found"
    for body in attention:
        head = body.split("\n", 1)[0]
        assert "HMMA.1688" in body, f"{head}: no m16n8k8 tensor-core instruction"
        assert "LDSM" in body, f"{head}: no ldmatrix"
        assert "LDG.E.128" in body, f"{head}: no 128-bit global loads"


def test_no_spills_and_resources_within_turing_limits(env):
    """Per kernel: no local memory (spills), registers and static shared memory within
    Turing's limits. The kernels' dynamic shared memory is fixed per head dim and checked
    against the 64 KB at compile time (static_assert in csrc/fa2), so it cannot grow here."""
    kernels = _res_usage(env)
    assert kernels, "cuobjdump reported no kernels"
    for k in kernels:
        assert k["local"] == 0 and k["stack"] == 0, f"{k['name']} spills to local memory: {k}"
        assert k["reg"] <= TURING_REGS, k
        assert k["shared"] <= TURING_SHARED, k
