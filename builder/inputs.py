"""Pinned downloads for the bootstrap recipes.

The pin of a downloaded file is the recipe's own `source: {path, sha256}` entry under
.sm7x/inputs/: one place to change a version. A wheel's file name carries its package
name, version and tags, so pip (the ordinary PyPI client) can fetch exactly that file
with --require-hashes; we check the sha256 again before the file enters the cache.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from packaging.utils import parse_wheel_filename

from . import STATE, BuildFailed

INPUTS = STATE / "inputs"


@dataclass(frozen=True)
class Pin:
    path: Path  # absolute path the recipe reads
    sha256: str
    recipe: Path

    @property
    def name(self) -> str:
        return self.path.name


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sources(node):
    """Every `source` mapping anywhere in a parsed recipe (top level and outputs)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "source":
                yield from value if isinstance(value, list) else [value]
            else:
                yield from _sources(value)
    elif isinstance(node, list):
        for item in node:
            yield from _sources(item)


def collect_pins(recipes: list[Path]) -> list[Pin]:
    pins = []
    for recipe in recipes:
        for src in _sources(yaml.safe_load(recipe.read_text())):
            if not isinstance(src, dict) or "path" not in src:
                continue
            path = (recipe.parent / src["path"]).resolve()
            if INPUTS not in path.parents:
                continue
            if "sha256" not in src:
                raise BuildFailed(f"{recipe}: source {src['path']} has no sha256; every downloaded input must be pinned")
            pins.append(Pin(path, src["sha256"].lower(), recipe))
    return pins


def _pip_request(pin: Pin) -> tuple[str, list[str]]:
    """The requirement line and pip options that select exactly this wheel."""
    try:
        name, version, _build, tags = parse_wheel_filename(pin.name)
    except Exception as exc:  # packaging raises InvalidWheelFilename
        raise BuildFailed(f"{pin.recipe}: {pin.name} is not a wheel file name ({exc}); only PyPI wheels can be fetched") from exc
    opts = ["--only-binary", ":all:", "--no-deps"]
    for tag in sorted(tags, key=str):
        if tag.platform != "any":
            opts += ["--platform", tag.platform]
        if tag.interpreter.startswith("cp"):
            opts += ["--python-version", tag.interpreter[2:], "--implementation", "cp", "--abi", tag.abi]
    return f"{name}=={version} --hash=sha256:{pin.sha256}", opts


def fetch(pins: list[Pin], log=print) -> None:
    """Make every pinned file present and verified; raise BuildFailed otherwise."""
    INPUTS.mkdir(parents=True, exist_ok=True)
    for pin in pins:
        if pin.path.exists():
            got = sha256_of(pin.path)
            if got == pin.sha256:
                continue
            log(f"[yellow]{pin.name}: cached file has sha256 {got}, not the pinned {pin.sha256}; fetching again")
            pin.path.unlink()
        log(f"fetching {pin.name}")
        requirement, opts = _pip_request(pin)
        with tempfile.TemporaryDirectory(dir=INPUTS) as tmp:
            req = Path(tmp) / "requirement.txt"
            req.write_text(requirement + "\n")
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--require-hashes",
                   "--dest", tmp, "-r", str(req), *opts]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / pin.name
            if proc.returncode != 0 or not got.exists():
                detail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
                raise BuildFailed(
                    f"could not fetch {pin.name} pinned in {pin.recipe.relative_to(pin.recipe.parents[2])}:\n  "
                    + "\n  ".join(detail)
                    + "\nIf the sha256 in the recipe is wrong, fix it; if the file is gone from PyPI, pin another version."
                )
            digest = sha256_of(got)
            if digest != pin.sha256:  # pip checked it too; never trust one check
                raise BuildFailed(f"{pin.name}: downloaded sha256 {digest} != pinned {pin.sha256}")
            shutil.move(got, pin.path)
