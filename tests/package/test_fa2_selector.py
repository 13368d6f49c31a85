"""The sm7x-fa2 selector (CEP 46 __cuda_arch), solved and installed by py-rattler (the
engine of pixi) from ./channel: exactly which FA2 packages and libraries land per node.

The node kind is faked the way users fake it on login nodes: CONDA_OVERRIDE_CUDA_ARCH
(with CONDA_OVERRIDE_CUDA, without which rattler-based tools ignore the arch override).
"""

from __future__ import annotations

import json

import pytest
from pkgtest import CHANNELS, run

from sm7x._select import selector_pick
from sm7x_tools import envs

BOTH = {"sm7x-fa2-sm70", "sm7x-fa2-sm75"}
ALWAYS = {"sm7x", "sm7x-ext", "sm7x-core", "sm7x-fa2"}
LIBS = {"sm7x-fa2-sm70": "_fa2_sm70.abi3.so", "sm7x-fa2-sm75": "_fa2_sm75.abi3.so"}

# CONDA_OVERRIDE_CUDA_ARCH (None: unset) -> (sm7x-fa2 build, FA2 packages installed)
CASES = {
    # V100, and a V100 + RTX 8000 node (min is 7.0): the Turing library comes too
    "7.0": ("sm70", BOTH),
    "7.5": ("sm75", {"sm7x-fa2-sm75"}),  # T4, RTX 8000
    # Ampere+: the documented choice (README): the sm75 library, refused at run time
    # unless forced; it is the one whose PTX runs fast there and it serves Turing too.
    "8.0": ("sm75", {"sm7x-fa2-sm75"}),
    None: ("all", BOTH),  # login node without GPUs
    "": ("all", BOTH),  # override set but empty: no __cuda_arch even with __cuda present
}


def _has_driver() -> bool:
    from rattler import VirtualPackage

    return any(str(v).startswith("Cuda") for v in VirtualPackage.detect())


def _override(monkeypatch, arch):
    if arch is None:
        if _has_driver():
            pytest.skip("this machine has a CUDA driver: __cuda_arch cannot be absent here")
        monkeypatch.delenv("CONDA_OVERRIDE_CUDA_ARCH", raising=False)
        monkeypatch.delenv("CONDA_OVERRIDE_CUDA", raising=False)
    else:
        monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", arch)
        monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "12.4")


@pytest.mark.parametrize("arch", list(CASES), ids=lambda a: "absent" if a is None else a or "empty")
def test_install_per_node_kind(tmp_path, monkeypatch, arch):
    build, fa2 = CASES[arch]
    _override(monkeypatch, arch)
    env = envs.create(tmp_path / "env", ["sm7x", "python 3.11.*"], CHANNELS)
    sm7x = {r.name.normalized: r for r in env.records if r.name.normalized.startswith("sm7x")}
    assert set(sm7x) == ALWAYS | fa2
    assert str(sm7x["sm7x-fa2"].build).startswith(build + "_")

    # exactly the selected libraries are on disk, nothing of the other arch
    site = next(env.prefix.glob("lib/python3.11/site-packages"))
    libs = {p.name for p in (site / "sm7x" / "fa2").glob("*.so")}
    assert libs == {LIBS[p] for p in fa2}

    # the doctor in that environment predicts the same pick and sees it installed
    info = json.loads(run(env, "-m", "sm7x", "doctor", "--json"))
    assert info["solver"]["variant"] == build
    assert info["solver"]["installed_variant"] == build
    assert set(info["solver"]["packages"]) == fa2


def test_mixed_node_gets_a_native_library_per_gpu(tmp_path, monkeypatch):
    """3x V100 + 2x Quadro RTX 8000 (the seeds' host): __cuda_arch is 7.0, and every GPU
    loads its own arch's library from what that solve installed; the doctor says so."""
    _override(monkeypatch, "7.0")
    env = envs.create(tmp_path / "env", ["sm7x", "python 3.11.*"], CHANNELS)
    code = (
        "import json; from sm7x import doctor; from sm7x._select import Device\n"
        "gpus = [Device(i, 'Tesla V100-SXM2-32GB', (7, 0)) for i in range(3)]"
        " + [Device(i, 'Quadro RTX 8000', (7, 5)) for i in (3, 4)]\n"
        "info = doctor.collect(gpus); print(json.dumps(info)); print(doctor.render(info))"
    )
    out = run(env, "-c", code)
    info = json.loads(out.splitlines()[0])
    loads = {g["index"]: (g["fa2"]["arch"], g["fa2"]["installed"], g["fa2"]["path"].rsplit("/", 1)[-1])
             for g in info["gpus"]}
    assert loads == {**{i: ("sm70", True, LIBS["sm7x-fa2-sm70"]) for i in range(3)},
                     **{i: ("sm75", True, LIBS["sm7x-fa2-sm75"]) for i in (3, 4)}}
    assert info["node"]["mixed"] and info["node"]["uncovered_gpus"] == []
    assert info["solver"]["variant"] == "sm70" and set(info["solver"]["packages"]) == BOTH
    assert "a mixed node: its lowest GPU sets __cuda_arch" in out
    assert not [w for w in info["warnings"] if "sm7x-fa2-" in w], info["warnings"]


@pytest.mark.parametrize("arch", [None, "7.0", "7.2", "7.5", "8.0", "8.6", "9.0", "12.0"])
def test_solver_matches_the_doctors_rules(arch):
    """sm7x._select.selector_pick (what the doctor reports) is what the solver does."""
    records = envs.solve(CHANNELS, ["sm7x-fa2"], envs.node_packages(arch))
    pick = selector_pick(arch)
    got = {r.name.normalized: r for r in records}
    assert str(got["sm7x-fa2"].build).startswith(pick.variant + "_")
    assert got["sm7x-fa2"].build_number == pick.build_number
    assert {n for n in got if n.startswith("sm7x-fa2-")} == set(pick.packages)


def test_pascal_node_is_refused_by_the_solver():
    """Below 7.0 nothing runs: the solve fails and says __cuda_arch is why."""
    assert selector_pick("6.1").variant is None
    with pytest.raises(Exception, match="__cuda_arch"):
        envs.solve(CHANNELS, ["sm7x", "python 3.11.*"], envs.node_packages("6.1"))


def test_core_is_constrained_to_its_oldest_arch():
    """sm7x-core refuses GPUs its code cannot run on, but not nodes without __cuda_arch."""
    from pkgtest import CHANNEL

    data = json.loads((CHANNEL / "linux-64" / "repodata.json").read_text())
    cores = [r for r in data["packages.conda"].values() if r["name"] == "sm7x-core"]
    assert cores and all(any(c.startswith("__cuda_arch >=7.") for c in r["constrains"]) for r in cores)
    assert not any(d.startswith("__cuda_arch") for r in cores for d in r["depends"])
