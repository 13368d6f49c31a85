"""The vLLM plugin's packaging, without vLLM: the entry points are declared once, in
pyproject.toml (the conda package is installed from it with pip), and name functions that
exist; the recipe's console-script entry point (the noarch launcher) is pyproject's;
importing the entry-point module stays free of torch and vLLM (vLLM imports it at every
start, on any machine)."""

from __future__ import annotations

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


def recipe_console_scripts() -> dict[str, str]:
    recipe = (ROOT / "recipe/recipe.yaml").read_text()
    block = re.search(r"\n      python:\n        entry_points:\n((?:          - .*\n)+)", recipe)
    assert block, "recipe.yaml's sm7x output no longer declares entry_points"
    pairs = re.findall(r"- (\S+) = (\S+)", block.group(1))
    return dict(pairs)


def test_conda_package_installs_from_pyproject():
    script = (ROOT / "recipe/scripts/install_python.sh").read_text()
    assert re.search(r'pip" install \. .*--no-deps', script) or "-m pip install . --no-deps" in script
    assert "entry_points.txt" not in script, "the dist-info must come from pip, not be written by hand"


def test_wheel_and_conda_package_declare_the_same_entry_points():
    wheel = pyproject_entry_points()
    assert recipe_console_scripts() == wheel["console_scripts"]
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
