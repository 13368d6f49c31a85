"""The vLLM plugin's packaging, without vLLM: the entry points the wheel (pyproject.toml)
and the conda package (recipe/scripts/install_python.sh writes its dist-info) declare must
be the same, and name functions that exist; importing the entry-point module stays free of
torch and vLLM (vLLM imports it at every start, on any machine)."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ("vllm.general_plugins", "vllm.platform_plugins")


def pyproject_entry_points() -> dict[str, dict[str, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    eps = {g: dict(project.get("entry-points", {}).get(g, {})) for g in GROUPS}
    eps["console_scripts"] = dict(project["scripts"])
    return eps


def conda_entry_points() -> dict[str, dict[str, str]]:
    script = (ROOT / "recipe/scripts/install_python.sh").read_text()
    body = re.search(r"<<'ENTRY_POINTS'\n(.*?)\nENTRY_POINTS\n", script, re.S)
    assert body, "install_python.sh no longer writes entry_points.txt"
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    parser.read_string(body.group(1))
    return {s: dict(parser[s]) for s in parser.sections()}


def test_wheel_and_conda_package_declare_the_same_entry_points():
    wheel, conda = pyproject_entry_points(), conda_entry_points()
    assert wheel == conda
    assert wheel["vllm.general_plugins"] == {"sm7x": "sm7x.integrations.vllm:register"}
    assert wheel["vllm.platform_plugins"] == {"sm7x": "sm7x.integrations.vllm:platform_plugin"}


def test_entry_points_name_existing_functions():
    for group in GROUPS:
        for value in pyproject_entry_points()[group].values():
            module, func = value.split(":")
            assert callable(getattr(import_module(module), func)), value


def test_entry_point_module_imports_neither_torch_nor_vllm():
    code = ("import sys, sm7x.integrations.vllm as v; "
            "assert not {'torch', 'vllm'} & set(sys.modules), 'heavy import'; "
            "print(v.platform_plugin())")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    # without vLLM (or without an NVIDIA GPU) the platform hook answers None, never raises
    assert out.stdout.strip() == "None"
