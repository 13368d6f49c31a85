"""Package tests: install the built outputs from ./channel into fresh environments with
py-rattler, for every Python the default variants build, and use them there."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from pkgtest import CHANNEL, CHANNELS, run

from sm7x_tools import REPO, envs
from sm7x_tools.channel import SUBDIRS, records

pytestmark = pytest.mark.package

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]



PLAN = """
import array, sm7x, sm7x._sched as s
plan = s.split_kv_plan(array.array('i', [1, 4096, 70000]), 8, 80)
assert plan.total_splits >= 3
print(s.__file__)
"""


def channels():
    return CHANNELS



def test_repodata_is_monolithic_in_every_subdir():
    for sub in SUBDIRS:
        data = json.loads((CHANNEL / sub / "repodata.json").read_text())
        assert data["info"]["subdir"] == sub
        assert "packages.conda" in data


def test_index_is_repeatable_and_leaves_no_scratch(tmp_path):
    """Before: each record's indexed_timestamp was the time of indexing (two indexings of the
    same packages differed) and the indexer's empty .tmp/ was published with the channel."""
    import shutil
    import time

    from sm7x_tools.channel import index_dir

    assert not (CHANNEL / ".tmp").exists()
    copy = tmp_path / "ch"
    for sub in SUBDIRS:
        (copy / sub).mkdir(parents=True)
        for pkg in sorted((CHANNEL / sub).glob("*.conda"))[:3]:
            shutil.copyfile(pkg, copy / sub / pkg.name)
    index_dir(copy)
    first = {sub: (copy / sub / "repodata.json").read_bytes() for sub in SUBDIRS}
    time.sleep(1.1)
    index_dir(copy)
    assert first == {sub: (copy / sub / "repodata.json").read_bytes() for sub in SUBDIRS}
    assert sorted(p.name for p in copy.iterdir()) == sorted(SUBDIRS)


def test_channel_holds_one_ext_per_python_and_one_noarch_sm7x():
    rows = records(CHANNEL)
    ext = [r for r in rows if r["name"] == "sm7x-ext"]
    assert len(ext) == len(PYTHONS) and all(r["subdir"] == "linux-64" for r in ext)
    pure = [r for r in rows if r["name"] == "sm7x"]
    assert len(pure) == 1 and pure[0]["subdir"] == "noarch"
    for sub in ("linux-64",):
        data = json.loads((CHANNEL / sub / "repodata.json").read_text())["packages.conda"]
        abis = sorted(dep for rec in data.values() if rec["name"] == "sm7x-ext"
                      for dep in rec["depends"] if dep.startswith("python_abi"))
        assert abis == sorted(f"python_abi {p}.* *_cp{p.replace('.', '')}" for p in PYTHONS)
        assert not any("pytorch" in d for rec in data.values() if rec["name"] == "sm7x-ext" for d in rec["depends"])


@pytest.mark.parametrize("python", PYTHONS)
def test_install_and_use(tmp_path, python):
    env = envs.create(tmp_path / "env", ["sm7x", f"python {python}.*"], CHANNELS)
    assert {"sm7x", "sm7x-ext", "python", "python_abi"} <= env.names
    assert "pytorch" not in env.names, "sm7x must not pull torch"
    ext_file = run(env, "-c", PLAN).strip()
    suffix = run(env, "-c", "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))").strip()
    assert ext_file.endswith("/sm7x/_sched" + suffix) and ".abi3." not in ext_file
    assert f"cpython-{python.replace('.', '')}" in suffix
    out = run(env, "-m", "sm7x", "doctor")
    assert f"Python {python}" in out or python in out
    info = json.loads(subprocess.run([str(env.prefix / "bin" / "sm7x"), "doctor", "--json"], capture_output=True,
                                     text=True, check=True, timeout=120).stdout)
    names = {p["name"] for p in info["packages"]["conda"]}
    assert {"sm7x", "sm7x-ext"} <= names
    # the distribution patch is applied in the packaged sources
    assert run(env, "-c", "import sm7x._install_hints as h; print(h.PACKAGED_BY)").strip() == "conda"
    # the version the recipe says, and an import that pulls in neither torch nor native code
    version = yaml.safe_load((REPO / "recipe" / "recipe.yaml").read_text())["context"]["version"]
    assert run(env, "-c", "import sys, sm7x; assert 'torch' not in sys.modules; print(sm7x.__version__)").strip() == version
