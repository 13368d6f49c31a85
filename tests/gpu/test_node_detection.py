"""On a real GPU node: the doctor's __cuda_arch is the one rattler (pixi's engine) detects,
and a solve of ./channel with the detected virtual packages takes the build the doctor
predicts."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
rattler = pytest.importorskip("rattler")

from sm7x import doctor  # noqa: E402
from sm7x._select import node_cuda_arch  # noqa: E402

pytestmark = pytest.mark.gpu
CHANNELS = [p for p in os.environ.get("SM7X_TEST_CHANNELS", "").split(os.pathsep) if p]


def _detected_cuda_arch():
    for vp in rattler.VirtualPackage.detect():
        generic = vp.into_generic()
        if generic.name.normalized == "__cuda_arch":
            return str(generic.version)
    return None


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    for name in ("CONDA_OVERRIDE_CUDA_ARCH", "CONDA_OVERRIDE_CUDA"):
        monkeypatch.delenv(name, raising=False)


def test_doctor_cuda_arch_is_rattlers():
    info = doctor.collect()
    assert info["gpus"], "torch sees a GPU, the doctor must too"
    detected = _detected_cuda_arch()
    print("rattler __cuda_arch", detected, "| doctor", info["solver"]["cuda_arch"],
          info["solver"]["cuda_arch_source"], "->", info["solver"]["variant"])
    assert detected == info["solver"]["cuda_arch"]
    assert node_cuda_arch(doctor._torch_info()[1])[0] == detected


@pytest.mark.skipif(not CHANNELS, reason="set SM7X_TEST_CHANNELS to the channel dirs to solve")
def test_solve_on_this_node_takes_the_doctors_pick():
    sources = [os.path.abspath(c) for c in CHANNELS]
    records = asyncio.run(rattler.solve(
        [f"file://{s}" for s in sources], ["sm7x", "python 3.11.*"],
        platforms=["linux-64", "noarch"], virtual_packages=rattler.VirtualPackage.detect()))
    pick = doctor.collect()["solver"]
    build = {r.name.normalized: str(r.build) for r in records}["sm7x-fa2"]
    print(json.dumps({"solved": build, "doctor": pick["variant"]}))
    assert build.startswith(pick["variant"] + "_")
    assert {r.name.normalized for r in records if r.name.normalized.startswith("sm7x-fa2-")} \
        == set(pick["packages"])
