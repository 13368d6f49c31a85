"""The source digest every package records (`airgap.sh merge` trusts it to say "the same
variant built from the same source") covers what the product recipe builds from and
nothing else: editing the site tooling must not change it, editing the product must."""

from __future__ import annotations

import shutil
import tomllib

import pytest

from sm7x_tools import REPO
from sm7x_tools.channel.digest import SOURCES, source_digest

TOOLS = "python/sm7x_tools"


# what recipe/scripts/audit_libs.sh runs from the source tree: `python -m sm7x_tools.audit`
AUDIT = {f"{TOOLS}/__init__.py", f"{TOOLS}/audit"}


def test_sources_leave_out_the_site_tooling():
    for src in SOURCES:
        assert (REPO / src).exists(), src
        assert not src.startswith(TOOLS + "/") or src in AUDIT, src
        assert not TOOLS.startswith(src + "/"), f"{src} would include {TOOLS}"
    assert "sm7x_tools.audit" in (REPO / "recipe" / "scripts" / "audit_libs.sh").read_text(), \
        "the recipe no longer runs the audit from the source tree: drop it from SOURCES"


@pytest.fixture
def tree(tmp_path):
    """The digested sources and the tooling, copied."""
    for rel in [*SOURCES, TOOLS]:
        src, dst = REPO / rel, tmp_path / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return tmp_path


def _append(path, text="\n# edited\n"):
    path.write_text(path.read_text() + text)


@pytest.mark.parametrize("edit", ["airgap/merge.py", "bootstrap/recipes/python/variants.yaml", "envs/bench.py",
                                  "channel/__main__.py"])
def test_a_tooling_edit_keeps_the_digest(tree, edit):
    before = source_digest(["toolchain"], root=tree)
    _append(tree / TOOLS / edit)
    (tree / TOOLS / "airgap" / "new_module.py").write_text("x = 1\n")
    assert source_digest(["toolchain"], root=tree) == before


def test_what_the_python_build_reads_is_a_source():
    """pyproject.toml's readme and license files end up in the sm7x package (dist-info)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    named = [project["readme"]] if isinstance(project.get("readme"), str) else []
    named += [v for k, v in project.get("license", {}).items() if k == "file"]
    named += project.get("license-files", [])
    assert named, "pyproject.toml names no readme or license file: update this test"
    for rel in named:
        assert rel in SOURCES or any(rel.startswith(s + "/") for s in SOURCES), rel


@pytest.mark.parametrize("edit", ["recipe/recipe.yaml", "python/sm7x/__init__.py", "csrc/CMakeLists.txt",
                                  "README.md"])
def test_a_product_edit_changes_the_digest(tree, edit):
    before = source_digest(["toolchain"], root=tree)
    _append(tree / edit)
    assert source_digest(["toolchain"], root=tree) != before


def test_another_toolchain_changes_the_digest(tree):
    assert source_digest(["toolchain"], root=tree) != source_digest(["other toolchain"], root=tree)
