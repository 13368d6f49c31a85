"""Bad input to the build ends it with a message naming the problem, and a failed build
never leaves a half-written channel behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sourcetree import copy_tree, run_tool

from sm7x_tools import REPO, bootstrap
from sm7x_tools.bootstrap import inputs
from sm7x_tools.channel import BuildFailed, publish, read_stamp, variants
from sm7x_tools.hashing import file_digest


def test_unpinned_input_is_refused(inputs_dir, pin_recipe):
    with pytest.raises(BuildFailed, match="no sha256"):
        inputs.collect_pins([pin_recipe("ninja-1.13.0-py3-none-any.whl", None)])


def test_every_bootstrap_download_is_pinned():
    recipes = [bootstrap.RECIPES / n / "recipe.yaml" for n in bootstrap.BOOTSTRAP_RECIPES]
    pins = inputs.collect_pins(recipes)
    assert len(pins) >= 12
    assert all(len(p.sha256) == 64 for p in pins)


def test_wrong_sha256_fails_the_fetch(inputs_dir, pin_recipe):
    name = "ninja-1.13.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
    pins = inputs.collect_pins([pin_recipe(name, "0" * 64)])
    with pytest.raises(BuildFailed, match="could not fetch ninja"):
        inputs.fetch(pins, log=lambda *_: None)
    assert not (inputs_dir / name).exists()


def test_tampered_cached_input_is_replaced(inputs_dir, pin_recipe):
    name = "ninja-1.13.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
    sha = "fb46acf6b93b8dd0322adc3a4945452a4e774b75b91293bafcc7b7f8e6517dfa"
    inputs_dir.mkdir()
    (inputs_dir / name).write_bytes(b"not the wheel")
    said = []
    inputs.fetch(inputs.collect_pins([pin_recipe(name, sha)]), log=said.append)
    assert file_digest(inputs_dir / name).sha256 == sha
    assert any("not the pinned" in s for s in said)


def test_non_wheel_input_is_named(inputs_dir, pin_recipe):
    pins = inputs.collect_pins([pin_recipe("cuda.deb", "1" * 64)])
    with pytest.raises(BuildFailed, match="not a wheel file name"):
        inputs.fetch(pins, log=lambda *_: None)


def test_unknown_variant_file_lists_the_known_ones():
    with pytest.raises(BuildFailed, match="unknown variant file 'sm99'.*default"):
        variants.resolve(["sm99"])


@pytest.mark.parametrize("text, message", [
    ("python: ['3.9']\n", r"Python \['3.9'\]"),
    ("pyhton: ['3.11']\n", "unknown variant key"),
    ("python: '3.11'\n", "must be a list"),
    ("python: [3.11\n", "not valid YAML"),
    ("cuda_compiler_version: ['13.0']\nsm7x_cuda_archs: ['70;75']\n", "sm_70 cannot be compiled by CUDA 13.0"),
    ("cuda_compiler_version: ['12.4', '13.0']\nsm7x_cuda_archs: ['70;75']\n", "same length"),
    ("cuda_compiler_version: ['12.4']\nsm7x_cuda_archs: ['sm75']\n", "archs are numbers"),
    ("cuda_compiler_version: ['12.4']\nsm7x_cuda_archs: ['75;86']\n", "sm7x builds for 70 and 75"),
    ("sm7x_fa2_select: ['sm75', 'sm80']\n", "the sm7x-fa2 builds are"),
    ("sm7x_fa2_select: ['sm75']\n", "must stay"),
])
def test_bad_variant_files(tmp_path, text, message):
    """A site file (read after default.yaml) that cannot build is refused before building."""
    f = tmp_path / "site.yaml"
    f.write_text(text)
    with pytest.raises(BuildFailed, match=message):
        variants.check(variants.resolve([str(f)]), bootstrap=True)


@pytest.mark.parametrize("what, message", [
    ("directory", "not a file"), ("binary", "not a text file"), ("ls", "not a text file")])
def test_variants_that_are_no_yaml_file_give_one_line(tmp_path, what, message):
    """Before: a traceback (IsADirectoryError, UnicodeDecodeError)."""
    if what == "directory":
        f = tmp_path
    elif what == "binary":
        f = tmp_path / "x.yaml"
        f.write_bytes(b"\x00\xff\xfe\x80" * 16)
    else:
        f = Path(shutil.which("ls"))
    with pytest.raises(BuildFailed, match=message):
        variants.check(variants.resolve([str(f)]), bootstrap=True)


def test_default_variants_are_valid():
    merged = variants.check(variants.resolve(["default"]), bootstrap=True)
    assert merged["python"] == ["3.10", "3.11", "3.12", "3.13"]
    assert merged["sm7x_cuda_archs"] == ["70;75"]


@pytest.mark.parametrize("site, archs", [("sm70", "70"), ("sm75", "75")])
def test_site_variant_files_override_the_cuda_archs(site, archs):
    files = variants.resolve([site])
    assert files[0] == variants.DEFAULT and files[1].stem == site
    merged = variants.check(files, bootstrap=True)
    assert merged["sm7x_cuda_archs"] == [archs] and merged["python"] == ["3.10", "3.11", "3.12", "3.13"]


def test_cuda_13_may_build_sm75_only(tmp_path):
    f = tmp_path / "site.yaml"
    f.write_text("cuda_compiler_version: ['13.0']\nsm7x_cuda_archs: ['75']\n")
    assert variants.check(variants.resolve([str(f)]), bootstrap=True)["sm7x_cuda_archs"] == ["75"]


def test_failed_publish_keeps_the_old_channel(tmp_path):
    old = tmp_path / "channel"
    (old / "noarch").mkdir(parents=True)
    (old / "noarch" / "repodata.json").write_text("{}")
    empty = tmp_path / "built"
    empty.mkdir()
    with pytest.raises(BuildFailed, match="no packages"):
        publish(empty, old, "stamp", 0)
    assert (old / "noarch" / "repodata.json").read_text() == "{}"
    assert not (tmp_path / "channel.partial").exists() or not any((tmp_path / "channel.partial").iterdir())


def _build(tree: Path, *args):
    return run_tool("sm7x_tools.channel", *args, tree=tree, timeout=900)


def test_unknown_variant_ends_the_build_with_a_message(tmp_path):
    tree = copy_tree(tmp_path / "tree")
    proc = _build(tree, "--variants", "nonexistent", "--output", str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "unknown variant file 'nonexistent'" in " ".join(proc.stdout.split())
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_broken_patch_fails_the_build_and_keeps_the_channel(tmp_path):
    if read_stamp(bootstrap.CHANNEL) is None:
        pytest.skip("bootstrap channel not built (run ./build.sh)")
    tree = copy_tree(tmp_path / "tree")
    patch = next((tree / "patches").glob("0001-*.patch"))
    patch.write_text(patch.read_text().replace("-PACKAGED_BY = None", "-PACKAGED_BY = 42"))
    out = tmp_path / "out"
    (out / "noarch").mkdir(parents=True)
    (out / "noarch" / "repodata.json").write_text("{}")
    proc = _build(tree, "--channel", bootstrap.CHANNEL.as_uri(), "--output", str(out), "--no-test")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 1, text
    assert "build failed" in text and "patch" in text.lower()
    assert (out / "noarch" / "repodata.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tree"]
