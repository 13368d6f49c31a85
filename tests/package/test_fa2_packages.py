"""sm7x-fa2-sm70 and sm7x-fa2-sm75 from ./channel: one abi3 build each, both in one
environment behind the flash-attn API of `sm7x`, and static checks of the shipped SASS
with the channel's own CUDA tools (no GPU needed)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from builder import envs
from pkgtest import CHANNEL, CHANNELS, run

pytestmark = pytest.mark.package

SITE = "lib/python3.11/site-packages/sm7x/fa2"
REGS = 255  # per thread, both archs
# per arch: shared memory per block, and the tensor-core / load instructions every
# attention kernel must use (Turing: m16n8k8 MMAs fed by ldmatrix; Volta: the HMMA.884
# steps WMMA compiles to, no ldmatrix there)
ARCHS = {
    "sm75": {"shared": 64 * 1024, "sass": ("HMMA.1688", "LDSM", "LDG.E.128")},
    "sm70": {"shared": 96 * 1024, "sass": ("HMMA.884", "LDG.E.128")},
}


def lib(env, arch):
    return env.prefix / SITE / f"_fa2_{arch}.abi3.so"

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
                       ["sm7x", "sm7x-fa2-sm70", "sm7x-fa2-sm75", "python 3.11.*", "pytorch 2.13.*",
                        "cuda-nvcc_linux-64", "cuda-nvdisasm"], CHANNELS)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_abi3_build(arch):
    data = json.loads((CHANNEL / "linux-64" / "repodata.json").read_text())["packages.conda"]
    (rec,) = [r for r in data.values() if r["name"] == f"sm7x-fa2-{arch}"]
    assert rec.get("noarch") == "python" and rec["build"].startswith("cuda124_")
    assert {"pytorch >=2.10", "__cuda >=12"} <= set(rec.get("constrains", []))
    assert not any(d.startswith(("python_abi", "pytorch", "libtorch")) for d in rec["depends"])


def test_api_refuses_cpu_tensors_with_a_clear_error(env):
    out = run(env, "-c", CPU_CALL)
    assert "CUDA" in out, out


def _res_usage(env, arch) -> list[dict]:
    text = subprocess.run([str(env.prefix / "bin" / "cuobjdump"), "-res-usage", str(lib(env, arch))],
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


@pytest.mark.parametrize("arch", ARCHS)
def test_sass_and_ptx_for_its_own_arch_only(env, arch):
    out = subprocess.run([str(env.prefix / "bin" / "cuobjdump"), "--list-elf", "--list-ptx", str(lib(env, arch))],
                         capture_output=True, text=True, check=True).stdout
    want = "sm_" + arch[2:]
    assert set(re.findall(r"\.(sm_\d+)\.(?:cubin|ptx)", out)) == {want}, out
    assert ".ptx" in out and ".cubin" in out


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_cores_and_wide_loads_in_every_attention_kernel(env, arch):
    sass = subprocess.run([str(env.prefix / "bin" / "cuobjdump"), "-sass", str(lib(env, arch))],
                          capture_output=True, text=True, check=True).stdout
    bodies = re.split(r"\n\s*Function : ", sass)[1:]
    attention = [b for b in bodies if "HMMA" in b or "fwd" in b.split("\n", 1)[0].lower()]
    assert attention, "no attention kernel found"
    for body in attention:
        head = body.split("\n", 1)[0]
        for instruction in ARCHS[arch]["sass"]:
            assert instruction in body, f"{head}: no {instruction}"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_spills_and_resources_within_the_cards_limits(env, arch):
    """Per kernel: no local memory (spills), registers and static shared memory within
    Turing's limits. The kernels' dynamic shared memory is fixed per head dim and checked
    against the card's limit at compile time (static_assert in csrc/fa2)."""
    kernels = _res_usage(env, arch)
    assert kernels, "cuobjdump reported no kernels"
    for k in kernels:
        assert k["local"] == 0 and k["stack"] == 0, f"{k['name']} spills to local memory: {k}"
        assert k["reg"] <= REGS, k
        assert k["shared"] <= ARCHS[arch]["shared"], k
