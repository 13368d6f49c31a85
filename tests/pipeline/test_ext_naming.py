"""pybind11 modules are named with the SOABI of their Python, never .abi3.so, in wheel
and editable installs (a module declared limited-API made setuptools
expect <name>.abi3.so that CMake never wrote, and editable installs broke)."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata

import pytest
from sourcetree import run_tool

from sm7x_tools import REPO

SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


@pytest.mark.slow
def test_wheel_carries_soabi_named_module(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
                    "-w", str(tmp_path), str(REPO)], check=True, timeout=600)
    (wheel,) = tmp_path.glob("sm7x-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    native = sorted(n for n in names if n.endswith(".so"))
    assert f"sm7x/_sched{SUFFIX}" in native, native
    # the only other native file may be the stable-ABI core (built when torch is there)
    assert set(native) - {f"sm7x/_sched{SUFFIX}"} <= {"sm7x/_core.abi3.so"}, native
    # and the audit agrees that every file is what its name declares
    audit = run_tool("sm7x_tools.audit", wheel)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert f"-{tag}-{tag}-" in wheel.name and "abi3" not in wheel.name, wheel.name
    assert "sm7x/__init__.py" in names and "sm7x/_install_hints.py" in names


def test_editable_install_imports_soabi_module():
    dist = metadata.distribution("sm7x")
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if not direct.get("dir_info", {}).get("editable"):
        pytest.skip("sm7x is not editable-installed here (./test.sh does that)")
    proc = subprocess.run([sys.executable, "-c", "import sm7x._sched as m; print(m.__file__)"],
                          capture_output=True, text=True, cwd="/", check=True)
    path = proc.stdout.strip()
    assert path.endswith(f"_sched{SUFFIX}") and ".abi3." not in path, path
