"""Debian packages as pinned inputs (the CUDA toolchain of the bootstrap channel): file
names parse, every pin has a sha256, and a bad pin ends the fetch with a message that
names the file, the recipe and the fix. Network tests fetch about 150 kB."""

from __future__ import annotations

import shutil

import pytest

from sm7x_tools import bootstrap
from sm7x_tools.bootstrap import inputs
from sm7x_tools.channel import BuildFailed
from sm7x_tools.hashing import file_digest

SMALL_DEB = "nvidia-cuda-toolkit-gcc_12.4.1-2_amd64.deb"  # 25 kB, in trixie non-free
needs_apt = pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get")


@pytest.mark.parametrize("filename, want", [
    ("nvidia-cuda-toolkit_12.4.131~12.4.1-2_amd64.deb", ("nvidia-cuda-toolkit", "12.4.131~12.4.1-2", "amd64")),
    ("libstdc++6_14.2.0-19_amd64.deb", ("libstdc++6", "14.2.0-19", "amd64")),
    ("python3-six_1.17.0-1_all.deb", ("python3-six", "1.17.0-1", "all")),
    ("libfoo_1%3a2.0+dfsg-1~bpo12+1_arm64.deb", ("libfoo", "1:2.0+dfsg-1~bpo12+1", "arm64")),
    ("libfoo_1%3A2.0-1_amd64.deb", ("libfoo", "1:2.0-1", "amd64")),
])
def test_deb_file_names(filename, want):
    assert inputs.deb_request(filename) == want


@pytest.mark.parametrize("filename", ["cuda.deb", "Foo_1.0_amd64.deb", "foo_1.0.deb", "foo_1.0_amd64.whl", "foo__amd64.deb"])
def test_not_deb_file_names(filename):
    with pytest.raises(ValueError):
        inputs.deb_request(filename)


def test_every_deb_pin_is_pinned_and_parses():
    # the cuda recipe's tests compile with the wrapped compilers, built before it
    assert bootstrap.BOOTSTRAP_RECIPES.index("cuda") > bootstrap.BOOTSTRAP_RECIPES.index("compilers")
    pins = inputs.collect_pins([bootstrap.RECIPES / n / "recipe.yaml" for n in bootstrap.BOOTSTRAP_RECIPES])
    debs = [p for p in pins if p.name.endswith(".deb")]
    assert debs, "the cuda recipe pins Debian's nvidia-cuda-toolkit"
    for pin in debs:
        assert len(pin.sha256) == 64 and int(pin.sha256, 16) >= 0, pin
        inputs.deb_request(pin.name)




def test_unpinned_deb_is_refused(tmp_path, inputs_dir, pin_recipe):
    with pytest.raises(BuildFailed, match="no sha256"):
        inputs.collect_pins([pin_recipe(SMALL_DEB, None)])


def test_cached_deb_is_not_fetched_again(tmp_path, inputs_dir, monkeypatch, pin_recipe):
    inputs_dir.mkdir()
    (inputs_dir / SMALL_DEB).write_bytes(b"cached")
    monkeypatch.setattr(inputs.subprocess, "run", lambda *a, **k: pytest.fail("fetched a cached file"))
    inputs.fetch(inputs.collect_pins([pin_recipe(SMALL_DEB, file_digest(inputs_dir / SMALL_DEB).sha256)]))


def test_no_apt_get_is_named(tmp_path, inputs_dir, monkeypatch, pin_recipe):
    monkeypatch.setattr(inputs.shutil, "which", lambda _: None)
    with pytest.raises(BuildFailed, match=f"{SMALL_DEB} .*no apt-get"):
        inputs.fetch(inputs.collect_pins([pin_recipe(SMALL_DEB, "0" * 64)]), log=lambda *_: None)


@needs_apt
def test_unknown_deb_version_names_file_recipe_and_fix(tmp_path, inputs_dir, pin_recipe):
    name = "nvidia-cuda-toolkit-gcc_0.0-0_amd64.deb"
    pins = inputs.collect_pins([pin_recipe(name, "0" * 64)])
    with pytest.raises(BuildFailed) as info:
        inputs.fetch(pins, log=lambda *_: None)
    text = str(info.value)
    assert f"could not fetch {name} pinned in {tmp_path / 'recipe.yaml'}" in text
    assert "'0.0-0' for 'nvidia-cuda-toolkit-gcc' was not found" in text
    assert "suite trixie, package nvidia-cuda-toolkit-gcc" in text and "snapshot archive" in text
    assert not (inputs_dir / name).exists()


@needs_apt
def test_wrong_deb_sha256_fails_and_leaves_no_file(tmp_path, inputs_dir, pin_recipe):
    pins = inputs.collect_pins([pin_recipe(SMALL_DEB, "0" * 64)])
    with pytest.raises(BuildFailed, match=f"{SMALL_DEB}: downloaded sha256 [0-9a-f]{{64}} != pinned 0{{64}}"):
        inputs.fetch(pins, log=lambda *_: None)
    assert list(inputs_dir.iterdir()) == []
