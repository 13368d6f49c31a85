"""The GPU targets are written once (python/sm7x/targets.json) and the version once (the
recipe's context). Where a language cannot read them (rattler-build's Jinja reads no
file without --experimental), these tests fail as soon as the two places disagree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

import sm7x
from sm7x import _select, _targets

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipe" / "recipe.yaml"
VARIANT_SETS = {
    "default": ["variants/default.yaml"],
    "sm70": ["variants/default.yaml", "variants/sm70.yaml"],
    "sm75": ["variants/default.yaml", "variants/sm75.yaml"],
}


def recipe_version() -> str:
    # ${{ ... }} expressions are plain strings to YAML; the context's version is a literal
    return yaml.safe_load(RECIPE.read_text())["context"]["version"]


def test_version_is_the_recipes():
    assert sm7x.__version__ == recipe_version()


@pytest.fixture(scope="module")
def rendered():
    rattler_build = pytest.importorskip("rattler_build")
    out = {}
    for name, files in VARIANT_SETS.items():
        variants = rattler_build.VariantConfig.from_files([str(REPO / f) for f in files])
        outputs = {}
        for v in rattler_build.Stage0Recipe.from_file(RECIPE).render(variants):
            d = v.recipe.to_dict()
            outputs.setdefault((d["package"]["name"], d["build"]["string"]), (d, dict(v.variant)))
        out[name] = list(outputs.values())
    return out


@pytest.mark.parametrize("variant_set", VARIANT_SETS)
def test_recipe_agrees_with_targets(rendered, variant_set):
    outputs = rendered[variant_set]
    arch_lists = {v["sm7x_cuda_archs"] for _, v in outputs if "sm7x_cuda_archs" in v}
    assert len(arch_lists) == 1, arch_lists
    in_variant = set(arch_lists.pop().split(";"))
    built = tuple(a for a in _targets.archs() if _targets.arch_number(a) in in_variant)
    assert built, f"{variant_set}: the variant builds no arch sm7x knows"
    oldest = _targets.load()["archs"][built[0]]["capability"]

    # one FA2 library output per built arch, none for the others (the recipe's skips)
    libs = {d["package"]["name"] for d, _ in outputs if d["package"]["name"].startswith("sm7x-fa2-")}
    assert libs == {_select.package_name(a) for a in built}

    # the core refuses nodes older than its oldest arch
    (core,) = [d for d, _ in outputs if d["package"]["name"] == "sm7x-core"]
    assert f"__cuda_arch >={oldest}" in core["requirements"]["run_constraints"]

    # the selector builds: numbers and ranges as targets.json says, one per built arch
    # plus the fallback; and what sm7x._select (the doctor) predicts from the same file
    selector = {v["sm7x_fa2_select"]: d for d, v in outputs if d["package"]["name"] == "sm7x-fa2"}
    assert set(selector) == {*built, "all"}
    # ranks sit on top of build.number x 4 (the recipe's context build_num)
    base = 4 * yaml.safe_load(RECIPE.read_text())["context"]["build_num"]

    def pin(arch):  # the exact build of the same variant (pin_subpackage, exact=True)
        return {"pin_subpackage": {"name": _select.package_name(arch), "exact": True}}

    for arch in built:
        d = selector[arch]
        assert d["build"]["number"] == base + _targets.selector_build(arch)
        # the node's arch and the newer ones a node of that lowest GPU may also hold
        installs = [a for a in _targets.selector_installs(arch) if a in built]
        assert installs[0] == arch
        assert d["requirements"]["run"] == [f"__cuda_arch {_targets.selector_cuda_arch(arch)}", *map(pin, installs)]
        assert _select.selector_pick(_targets.load()["archs"][arch]["capability"], built).packages == \
            tuple(map(_select.package_name, installs))
    fallback = selector["all"]
    assert fallback["build"]["number"] == base + _targets.fallback_build(every_arch=built == _targets.archs())
    assert sorted(map(str, fallback["requirements"]["run"])) == sorted(str(pin(a)) for a in built)
    assert fallback["requirements"]["run_constraints"] == [f"__cuda_arch >={oldest}"]
    pick = _select.selector_pick(None, built)
    assert (pick.variant, base + pick.build_number) == ("all", fallback["build"]["number"])


def test_torch_floor_is_the_recipes(rendered):
    """targets.json torch.min (CMake's TORCH_TARGET_VERSION, the audit, the runtime's
    messages) is the floor every recipe output asks torch for."""
    floor = _targets.torch_min()
    assert yaml.safe_load(RECIPE.read_text())["context"]["torch_min"] == floor
    specs = [str(spec) for d, _ in rendered["default"]
             for key in ("host", "run", "run_constraints") for spec in d["requirements"].get(key, [])
             if re.match(r"(py|lib)torch\b", str(spec))]
    assert specs and set(specs) <= {f"pytorch >={floor}", f"libtorch >={floor}"}, specs


def test_targets_are_consistent():
    t = _targets.load()
    archs = _targets.archs()
    builds = [_targets.selector_build(a) for a in archs]
    fallbacks = [_targets.fallback_build(True), _targets.fallback_build(False)]
    # a node-specific build must outrank every fallback, and no two builds share a number
    assert min(builds) > max(fallbacks) and len(set(builds + fallbacks)) == len(builds) + 2
    # the selector ranges partition [oldest, inf): exactly one arch build per capability
    for cap in [(7, 0), (7, 2), (7, 5), (8, 0), (9, 0)]:
        hits = [a for a in archs if _select._satisfies(cap, _targets.selector_cuda_arch(a))]
        assert len(hits) == 1, (cap, hits)
    assert not any(_select._satisfies((6, 1), _targets.selector_cuda_arch(a)) for a in archs)
    # sm7x.fa2.COMPILED_HEAD_DIMS is one list: both libraries must compile the same dims
    assert len({_targets.fa2_head_dims(a) for a in archs}) == 1
    for arch in archs:
        dims = _targets.fa2_head_dims(arch)
        assert dims and max(dims) == t["fa2"]["max_head_dim"]
        assert all(d % 16 == 0 for d in dims), dims
        # the serving kernels cover the same head dims (the dispatch walks one list)
        serving = sorted(k["head_dim"] for k in t["fa2"]["serving_kernels"][arch])
        assert serving == list(dims), (arch, serving, dims)
        # the narrow serving tiles never have more rows than the prefill ones, which the
        # library's serving_tile picks above serving_wide_rows where they have more
        # (tests/gpu/fa2_reference.py check_serving_tile)
        assert isinstance(t["fa2"]["serving_wide_rows"], int) and t["fa2"]["serving_wide_rows"] > 0
        for d in dims:
            assert (_targets.fa2_kernel(arch, d, serving=True)["block_m"]
                    <= _targets.fa2_kernel(arch, d)["block_m"]), (arch, d)


# A list written out again somewhere in code is a second place that can go stale.
_RESTATED = [
    (re.compile(r"32,\s*64,\s*96,\s*128,\s*256"), "the FA2 head-dim list"),
    (re.compile(r"""__version__\s*=\s*["']\d+\.\d+"""), "the version"),
    (re.compile(r"""version\s*=\s*["']\d+\.\d+\.\d+["']"""), "the version"),
    (re.compile(r"(?:pytorch|libtorch|PyTorch|torch) \(?>=\s*2\.\d|TORCH_TARGET_VERSION=0x"),
     "the torch floor"),
]


def test_no_fact_is_written_twice_in_code():
    files = subprocess.run(["git", "ls-files", "csrc", "python", "recipe", "variants", "tests",
                            "pyproject.toml"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    code = [f for f in files if Path(f).suffix in {".py", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".txt",
                                                   ".cmake", ".sh", ".yaml", ".toml", ".in"}]
    assert code, "git ls-files found no code: run from a checkout"
    # the audit's tests use torch 2.10 as data (a stable-ABI target), not as sm7x's floor;
    # the bootstrap sysroot's comment says why glibc 2.28 suffices (built before any table)
    data = ("tests/unit/test_targets.py", "tests/unit/test_audit.py", "tests/audit_fixtures/",
            "python/sm7x_tools/bootstrap/recipes/sysroot/")
    code = [f for f in code if not f.startswith(data)]
    hits = [f"{f}: {what}" for f in code for rx, what in _RESTATED
            if rx.search((REPO / f).read_text(errors="replace"))]
    assert not hits, "written again outside its one place:\n" + "\n".join(hits)
