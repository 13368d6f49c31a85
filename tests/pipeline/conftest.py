"""Fixtures of the pipeline tests: a private inputs cache and one-source recipes."""

from __future__ import annotations

import pytest
import yaml

from sm7x_tools.bootstrap import inputs


@pytest.fixture
def inputs_dir(tmp_path, monkeypatch):
    """An empty .sm7x/inputs stand-in; the fetcher reads and writes only there."""
    d = tmp_path / "inputs"
    monkeypatch.setattr(inputs, "INPUTS", d)
    # trixie's non-free index is 100 kB; main's is 10 MB and these tests need none of it
    monkeypatch.setattr(inputs, "DEBIAN_SUITE", "trixie non-free")
    return d


@pytest.fixture
def pin_recipe(tmp_path, inputs_dir):
    """pin_recipe(file_name, sha256 or None) -> a recipe whose one source is that input."""
    def make(name: str, sha: str | None):
        src = {"path": str(inputs_dir / name), **({"sha256": sha} if sha else {})}
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump({"package": {"name": "x", "version": "1"}, "source": src}))
        return path
    return make
