"""patches/: every distribution patch is listed in the recipe with a comment, says why
in its header, and applies (in order) to the current tree."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from sourcetree import copy_tree

from sm7x_tools import REPO

PATCHES = sorted((REPO / "patches").glob("*.patch"))
RECIPE = REPO / "recipe" / "recipe.yaml"


def test_there_is_a_patch_series():
    assert PATCHES, "patches/ holds no patch"
    for p in PATCHES:
        assert re.fullmatch(r"\d{4}-[a-z0-9-]+\.patch", p.name), f"{p.name}: name it NNNN-what.patch"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_header_says_why(patch):
    text = patch.read_text()
    assert text.startswith("From "), "use git format-patch form"
    header, _, _ = text.partition("\n---\n")
    subject = re.search(r"^Subject: (.+)$", header, re.M)
    assert subject, "no Subject line"
    body = header[subject.end():].strip()
    assert len(body.split()) >= 10, "the header must say why the patch exists"


def test_recipe_lists_every_patch_with_a_comment():
    listed = yaml.safe_load(RECIPE.read_text())["source"]["patches"]
    assert [(RECIPE.parent / p).resolve() for p in listed] == PATCHES
    lines = RECIPE.read_text().splitlines()
    for p in listed:
        i = next(n for n, line in enumerate(lines) if line.strip() == f"- {p}")
        assert lines[i - 1].strip().startswith("#"), f"{p}: add a comment saying why above it"


def test_series_applies_to_current_tree(tmp_path):
    tree = copy_tree(tmp_path / "tree")
    for p in PATCHES:
        proc = subprocess.run(["git", "apply", "--check", "-v", str(p)], cwd=tree, capture_output=True, text=True)
        assert proc.returncode == 0, f"{p.name} no longer applies:\n{proc.stderr}"
        subprocess.run(["git", "apply", str(p)], cwd=tree, check=True)
