"""A rebuilt package keeps its file name, and rattler's package cache keys its extracted
copy by that name: the build's own test environment was served the previous build's
sm7x-ext (its test ran a function the new module no longer had). The build evicts the
extracted copies of the packages it is about to make, and nothing else."""

from __future__ import annotations

from sm7x_tools.channel.rattler_build import evict_cached


def _entry(cache, name):
    (cache / name / "info").mkdir(parents=True)
    (cache / f"{name}.lock").write_bytes(b"\0")


def test_evicts_every_build_of_the_rebuilt_packages_only(tmp_path):
    cache = tmp_path / "pkgs"
    for name in ("sm7x-ext-0.1.0-py310h3c71f56_0", "sm7x-ext-0.1.0-py311h97ff56c_0",
                 "sm7x-fa2-0.1.0-all_ha42a45c_1", "sm7x-fa2-sm75-0.1.0-cuda124_hd48f0ba_0",
                 "sm7x-ext-0.0.9-py310h3c71f56_0", "python-3.11.7-h97ebb7b_0_cpython"):
        _entry(cache, name)
    removed = evict_cached({("sm7x-ext", "0.1.0"), ("sm7x-fa2", "0.1.0")}, cache)
    assert removed == sorted(f"{n}{s}" for n in ("sm7x-ext-0.1.0-py310h3c71f56_0", "sm7x-ext-0.1.0-py311h97ff56c_0",
                                                  "sm7x-fa2-0.1.0-all_ha42a45c_1") for s in ("", ".lock"))
    # another version, a package whose name only starts alike, and the toolchain stay
    assert sorted(p.name for p in cache.iterdir()) == [
        "python-3.11.7-h97ebb7b_0_cpython", "python-3.11.7-h97ebb7b_0_cpython.lock",
        "sm7x-ext-0.0.9-py310h3c71f56_0", "sm7x-ext-0.0.9-py310h3c71f56_0.lock",
        "sm7x-fa2-sm75-0.1.0-cuda124_hd48f0ba_0", "sm7x-fa2-sm75-0.1.0-cuda124_hd48f0ba_0.lock"]


def test_no_cache_yet(tmp_path):
    assert evict_cached({("sm7x", "0.1.0")}, tmp_path / "absent") == []
