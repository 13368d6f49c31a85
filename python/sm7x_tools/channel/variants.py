"""Checks on variant files before anything is built (a typo should not cost a build).

The arch facts (which archs sm7x builds, the last CUDA major that compiles each, the
sm7x-fa2 selector builds) come from python/sm7x/targets.json, where they are written once,
through the runtime's reader sm7x._targets (the tools run with python/ on sys.path).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from sm7x import _targets

from .. import REPO
from ..bootstrap import RECIPES as BOOTSTRAP_RECIPES
from . import BuildFailed

VARIANTS = REPO / "variants"
BOOTSTRAP_PYTHONS = BOOTSTRAP_RECIPES / "python" / "variants.yaml"
KNOWN_KEYS = {"python", "python_min", "c_compiler", "c_compiler_version", "cxx_compiler",
              "cxx_compiler_version", "cuda_compiler", "cuda_compiler_version", "sm7x_cuda_archs",
              "c_stdlib", "c_stdlib_version",  # ${{ stdlib('c') }}: the glibc floor
              "sm7x_fa2_select",
              "target_platform", "zip_keys"}
DEFAULT = VARIANTS / "default.yaml"
# "70" -> "sm70": sm7x_cuda_archs names archs by number, targets.json by library name
ARCHS = {_targets.arch_number(a): a for a in _targets.archs()}
SUPPORTED_ARCHS = tuple(ARCHS)
SELECTOR_BUILDS = (*_targets.archs(), "all")  # the sm7x-fa2 output of recipe.yaml


def resolve(names: list[str]) -> list[Path]:
    """Variant file arguments -> paths; `sm75` means variants/sm75.yaml.

    default.yaml always comes first; the files named after it override its keys.
    """
    out = [DEFAULT]
    for name in names:
        path = Path(name)
        if not path.exists():
            path = VARIANTS / (name if name.endswith(".yaml") else f"{name}.yaml")
        if not path.exists():
            known = ", ".join(sorted(p.stem for p in VARIANTS.glob("*.yaml")))
            raise BuildFailed(f"unknown variant file {name!r}; known: {known} (or give a path to a YAML file)")
        if path.resolve() != DEFAULT:
            out.append(path.resolve())
    return out


def check(files: list[Path], bootstrap: bool) -> dict:
    merged: dict = {}
    for f in files:
        if not f.is_file():
            raise BuildFailed(f"{f}: not a file; --variants takes a variant name "
                              f"(variants/NAME.yaml) or the path of a YAML file")
        try:
            data = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError:
            raise BuildFailed(f"{f}: not a text file (not UTF-8); --variants takes a YAML "
                              f"variant file") from None
        except OSError as exc:
            raise BuildFailed(f"{f}: cannot read it ({exc.strerror or exc})") from None
        except yaml.YAMLError as exc:
            raise BuildFailed(f"{f}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise BuildFailed(f"{f}: a variant file maps keys to lists of values")
        unknown = set(data) - KNOWN_KEYS
        if unknown:
            raise BuildFailed(f"{f}: unknown variant key(s) {sorted(unknown)}; the recipe uses {sorted(KNOWN_KEYS)}")
        for key, values in data.items():
            if key != "zip_keys" and not isinstance(values, list):
                raise BuildFailed(f"{f}: {key} must be a list, e.g. {key}: [{values!r}]")
        merged.update(data)
    _check_cuda(merged)
    _check_selector(merged)
    if bootstrap:
        available = {".".join(str(v).split(".")[:2]) for v in yaml.safe_load(BOOTSTRAP_PYTHONS.read_text())["cpython"]}
        wanted = {str(v) for v in merged.get("python", [])} | {str(v) for v in merged.get("python_min", [])}
        missing = wanted - available
        if missing:
            raise BuildFailed(
                f"the variants ask for Python {sorted(missing)} but the bootstrap channel has {sorted(available)}; "
                f"add the interpreter to {BOOTSTRAP_PYTHONS.relative_to(REPO)} or build against a conda-forge mirror (--channel)"
            )
    return merged


def _check_selector(merged: dict) -> None:
    values = [str(v) for v in merged.get("sm7x_fa2_select", [])]
    unknown = sorted(set(values) - set(SELECTOR_BUILDS))
    if unknown or "all" not in values:
        raise BuildFailed(f"sm7x_fa2_select {values}: the sm7x-fa2 builds are {list(SELECTOR_BUILDS)}, and "
                          "'all' (the fallback for nodes without __cuda_arch) must stay")


def _check_cuda(merged: dict) -> None:
    versions = [str(v) for v in merged.get("cuda_compiler_version", [])]
    archs = [str(a) for a in merged.get("sm7x_cuda_archs", [])]
    if len(versions) != len(archs):
        raise BuildFailed(
            f"cuda_compiler_version {versions} and sm7x_cuda_archs {archs} are zipped: give them the same length"
        )
    for version, arch_list in zip(versions, archs):
        for arch in filter(None, arch_list.split(";")):
            if not arch.isdigit():
                raise BuildFailed(f"sm7x_cuda_archs entry {arch_list!r}: archs are numbers like 70;75")
            if arch not in SUPPORTED_ARCHS:
                # the recipe's skip conditions and __cuda_arch constraints know these only
                families = ", ".join(_targets.family(a).split()[0] for a in ARCHS.values())
                raise BuildFailed(f"sm7x_cuda_archs entry {arch_list!r}: sm7x builds for "
                                  f"{' and '.join(SUPPORTED_ARCHS)} ({families}; "
                                  f"{_targets.PATH.relative_to(REPO)}), not {arch}")
            limit = _targets.cuda_max_major(ARCHS[arch])
            if limit is not None and int(version.split(".")[0]) > limit:
                raise BuildFailed(
                    f"sm_{arch} cannot be compiled by CUDA {version} (CUDA {limit + 1} dropped it); "
                    f"pair sm7x_cuda_archs {arch_list!r} with cuda_compiler_version <= {limit}.x"
                )
