"""A CI matrix for real: this tree built a second time with `--variants sm75` (as a second
machine would), merged with ./channel by `./airgap.sh merge`, and solved per node kind.

Both builds make sm7x-ext for every Python and the noarch packages. The builds are
reproducible (sm7x_tools.repro), so these have the same payload in both (their bytes may
differ in info/recipe, whose rendered recipe lists the variant set's other builds), and
merge keeps one copy of each without --keep-first. The CUDA outputs differ in their hash
(arch list) and both stay; the solver must then never give a Volta node the Turing-only
core.
"""

from __future__ import annotations

import json

import pytest
from pkgtest import CHANNEL
from sourcetree import run_tool

import sm7x
from sm7x._select import selector_pick
from sm7x_tools import bootstrap, envs
from sm7x_tools.airgap import merge as merge_mod
from sm7x_tools.airgap.merge import merge
from sm7x_tools.airgap.verify import verify


def _repodata(channel):
    return {f"{sub}/{fn}": rec for sub in ("linux-64", "noarch")
            for fn, rec in json.loads((channel / sub / "repodata.json").read_text())["packages.conda"].items()}


@pytest.fixture(scope="module")
def sm75_channel(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix") / "ch-sm75"
    proc = run_tool("sm7x_tools.channel", "--variants", "sm75", "--no-test", "--output", out, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def merged(sm75_channel, tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix") / "merged"
    result = merge(out, [CHANNEL, sm75_channel], [bootstrap.CHANNEL], keep_first=True)
    print(f"merge of the default and sm75 channels: {len(result.entries)} packages in {result.seconds:.2f} s")
    return out, result


def test_sm75_variant_builds_only_turing_outputs(sm75_channel):
    """The recipe's skip conditions hold (a skip expression that fails to evaluate is
    silently false in rattler-build 0.73: this is what caught `.split(';')`)."""
    files = _repodata(sm75_channel)
    names = {rec["name"] for rec in files.values()}
    assert "sm7x-fa2-sm75" in names and "sm7x-fa2-sm70" not in names
    selectors = sorted(rec["build"].split("_")[0] for rec in files.values() if rec["name"] == "sm7x-fa2")
    assert selectors == ["all", "sm75"]
    [fallback] = [rec for rec in files.values() if rec["name"] == "sm7x-fa2" and rec["build"].startswith("all")]
    # pin_subpackage(exact=True): the sm75 library of this very build (version and build string)
    [(name, version, build)] = [d.split() for d in fallback["depends"]]
    assert (name, version) == ("sm7x-fa2-sm75", f"=={sm7x.__version__}") and build.startswith("cuda")
    assert fallback["constrains"] == ["__cuda_arch >=7.5"]
    assert fallback["build_number"] == 0  # below the both-archs fallback of a merged channel


def test_single_arch_channel_matches_the_doctors_rules(sm75_channel):
    for arch in (None, "7.0", "7.5", "8.0"):
        pick = selector_pick(arch, ["sm75"])
        try:
            records = _solve([sm75_channel], ["sm7x-fa2"], arch)
        except Exception as exc:  # a Volta node on a Turing-only channel: no solution
            assert pick.variant is None and "__cuda_arch" in str(exc), (arch, exc)
            continue
        [sel] = [r for r in records if r.name.normalized == "sm7x-fa2"]
        assert (str(sel.build).split("_")[0], sel.build_number) == (pick.variant, pick.build_number)


def test_shared_outputs_are_rebuilt_bytes_with_one_source(sm75_channel, merged):
    default, sm75 = _repodata(CHANNEL), _repodata(sm75_channel)
    shared = sorted(set(default) & set(sm75))
    assert any("sm7x-ext" in f for f in shared) and f"noarch/sm7x-{sm7x.__version__}-pyh7511447_0.conda" in shared
    # rebuilt on "another machine": the same payload, read from both archives
    for f in shared:
        assert merge_mod.compare_content(CHANNEL / f, sm75_channel / f) == [], f
    # one package each in the merge, with a note that says which copy and why
    _, result = merged
    notes = {e.path.name: " ".join(e.notes) for e in result.entries}
    for f in shared:
        name = f.split("/")[1]
        assert "2 " in notes[name] and ("--keep-first" in notes[name] or "same payload" in notes[name]
                                        or "identical" in notes[name]), (name, notes[name])


def test_merged_channel_has_both_cuda_builds_and_verifies(merged):
    out, _ = merged
    files = _repodata(out)
    cores = {rec["build"]: rec for rec in files.values() if rec["name"] == "sm7x-core"}
    assert len(cores) == 2
    constrains = sorted(c for rec in cores.values() for c in rec["constrains"] if c.startswith("__cuda_arch"))
    assert constrains == ["__cuda_arch >=7.0", "__cuda_arch >=7.5"]
    assert verify(out, [bootstrap.CHANNEL]).ok


def _solve(channels, specs, arch):
    return envs.solve([*channels, bootstrap.CHANNEL], specs, envs.node_packages(arch))


@pytest.mark.parametrize("arch", ["7.0", "7.5", None])
def test_solves_on_the_merged_channel(merged, arch):
    """The merged channel solves as the doctor predicts: a Volta minimum (maybe a mixed node)
    gets both libraries, a Turing node the Turing one, no __cuda_arch the fallback."""
    out, _ = merged
    records = _solve([out], ["sm7x", "python 3.11.*"], arch)
    got = {r.name.normalized: r for r in records}
    assert {n for n in got if n.startswith("sm7x-fa2-")} == set(selector_pick(arch).packages)
    if arch == "7.0":  # the Turing-only core (constrains __cuda_arch >=7.5) is never picked
        core = json.loads((out / "linux-64" / "repodata.json").read_text())["packages.conda"][got["sm7x-core"].file_name]
        assert "__cuda_arch >=7.0" in core["constrains"]


def test_rebuilt_outputs_merge_without_keep_first(sm75_channel, tmp_path):
    """The README's CI-matrix merge needs no override now that the shared outputs rebuild
    with the same payload (a payload that differs is still refused: test_airgap.py)."""
    result = merge(tmp_path / "out", [CHANNEL, sm75_channel], [bootstrap.CHANNEL])
    notes = {e.path.name: " ".join(e.notes) for e in result.entries}
    assert notes[f"sm7x-{sm7x.__version__}-pyh7511447_0.conda"].startswith(("identical in 2", "2 has the same payload"))
    assert verify(tmp_path / "out", [bootstrap.CHANNEL]).ok
