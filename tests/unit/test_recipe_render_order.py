"""The recipe's package tests do not depend on the order in which a build tool walks the
variants. conda-build (which builds v1 recipes through py-rattler-build) builds and tests
the rendered outputs one after the other in render order, without sorting them by
dependency: a test that installs a sibling package from a variant rendered later fails
(the noarch sm7x's test on Python 3.13 once needed the py313 sm7x-ext, built later). This
walks the render order as such a tool does and checks that every test's sibling packages
(run dependencies, transitively) were rendered, and so built, before it. conda-build is
not installable here (not on PyPI); this is the CI-able part of that check."""

from __future__ import annotations

import pytest
from test_targets import RECIPE, REPO, VARIANT_SETS  # the variant sets the recipe is rendered with


def _dep_name(dep) -> str:
    if isinstance(dep, dict):  # pin_subpackage / pin_compatible, resolved at build time
        return next(iter(dep.values()))["name"]
    return str(dep).split()[0]


def _test_pythons(d: dict, variant: dict) -> set[str]:
    """The Pythons the output's tests ask for: python tests' python_version, script tests'
    `python X.*` requirement (tests are rendered at build time: substitute the variant)."""
    found = set()
    for test in d.get("tests") or []:
        specs = []
        if "python" in test:
            pv = test["python"].get("python_version")
            specs += [pv] if isinstance(pv, str) else list(pv or [])
        for dep in ((test.get("requirements") or {}).get("run") or []):
            if isinstance(dep, str) and dep.split()[0] == "python" and len(dep.split()) > 1:
                specs.append(dep.split()[1])
        for spec in specs:
            for key, value in variant.items():
                spec = spec.replace("${{ %s }}" % key, str(value))
            found.add(".".join(spec.strip("=<>~ ").rstrip(".*").split(".")[:2]))
    return found


def _fits(name: str, variant: dict, python: str | None) -> bool:
    """Whether a rendered sibling can serve a test (at `python`) on a node without a GPU."""
    if name == "sm7x-ext" and python:
        return variant.get("python") == python
    if name == "sm7x-fa2":  # no __cuda_arch where the tests run: only the fallback installs
        return variant.get("sm7x_fa2_select") == "all"
    return True


@pytest.mark.parametrize("variant_set", VARIANT_SETS)
def test_tests_need_only_what_render_order_built_before(variant_set):
    rattler_build = pytest.importorskip("rattler_build")
    variants = rattler_build.VariantConfig.from_files([str(REPO / f) for f in VARIANT_SETS[variant_set]])
    rendered = [(v.recipe.to_dict(), dict(v.variant))
                for v in rattler_build.Stage0Recipe.from_file(str(RECIPE)).render(variants)]
    names = {d["package"]["name"] for d, _ in rendered}
    late = []
    for i, (d, variant) in enumerate(rendered):
        if not d.get("tests"):
            continue
        for python in _test_pythons(d, variant) or {None}:
            wanted = [_dep_name(x) for x in (d.get("requirements") or {}).get("run") or []]
            seen: set[str] = set()
            while wanted:
                name = wanted.pop()
                if name not in names or name in seen or name == d["package"]["name"]:
                    continue
                seen.add(name)
                earlier = [(e, v) for e, v in rendered[:i]
                           if e["package"]["name"] == name and _fits(name, v, python)]
                if not earlier:
                    late.append(f"#{i} {d['package']['name']} ({d['build']['string']}) tested at "
                                f"python {python} needs {name}, rendered only later")
                    continue
                e, _ = earlier[-1]
                wanted += [_dep_name(x) for x in (e.get("requirements") or {}).get("run") or []]
    assert not late, "\n".join(late)
