"""Pinned downloads for the bootstrap recipes.

The pin of a downloaded file is the recipe's own `source: {path, sha256}` entry under
.sm7x/inputs/: one place to change a version. The file name says what to fetch: a
wheel's name carries its package name, version and tags, so pip (the ordinary PyPI
client) fetches exactly that file with --require-hashes; a Debian file name
(<package>_<version>_<arch>.deb) is fetched with `apt-get download` from Debian trixie
through a private sources list, leaving the machine's apt configuration alone. Either
way we check the sha256 ourselves before the file enters the cache.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import yaml
from packaging.utils import parse_wheel_filename

from .. import REPO, STATE
from ..channel import BuildFailed
from ..hashing import file_digest

INPUTS = STATE / "inputs"
# Debian packages come from the suite below, through the Debian mirror this machine's
# apt is already configured with (its own sources list names it; we do not).
DEBIAN_SUITE = "trixie main contrib non-free non-free-firmware"
APT_SOURCES = [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]


def debian_mirror() -> str:
    """The first Debian archive URI in the machine's apt configuration."""
    for path in APT_SOURCES:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] == ["URIs:"] or words[:1] == ["deb"]:
                uri = words[1] if words[0] == "URIs:" else next((w for w in words[1:] if "://" in w), "")
                if uri.rstrip("/").endswith("/debian"):
                    return uri
    raise BuildFailed("no Debian archive found in this machine's apt sources "
                      f"({', '.join(map(str, APT_SOURCES))}); the CUDA toolchain's .deb inputs come from there")


def debian_source() -> str:
    return f"{debian_mirror()} {DEBIAN_SUITE}"

# Debian policy: name [a-z0-9+.-], version [A-Za-z0-9.+~:-] with ':' written %3a in file names
_DEB = re.compile(r"(?P<name>[a-z0-9][a-z0-9+.-]+)_(?P<version>[0-9][A-Za-z0-9.+~%-]*)_(?P<arch>[a-z0-9-]+)\.deb")


@dataclass(frozen=True)
class Pin:
    path: Path  # absolute path the recipe reads
    sha256: str
    recipe: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def where(self) -> str:
        return str(self.recipe.relative_to(REPO)) if REPO in self.recipe.parents else str(self.recipe)


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


def deb_request(filename: str) -> tuple[str, str, str]:
    """(package, version, arch) of a Debian file name; the epoch's ':' is written %3a."""
    m = _DEB.fullmatch(filename)
    if not m:
        raise ValueError(f"{filename} is not <package>_<version>_<arch>.deb")
    return m["name"], unquote(m["version"]), m["arch"]


def _pip_request(pin: Pin) -> tuple[str, list[str]]:
    """The requirement line and pip options that select exactly this wheel."""
    try:
        name, version, _build, tags = parse_wheel_filename(pin.name)
    except Exception as exc:  # packaging raises InvalidWheelFilename
        raise BuildFailed(f"{pin.where}: {pin.name} is not a wheel file name ({exc})") from exc
    opts = ["--only-binary", ":all:", "--no-deps"]
    for tag in sorted(tags, key=str):
        if tag.platform != "any":
            opts += ["--platform", tag.platform]
        if tag.interpreter.startswith("cp"):
            opts += ["--python-version", tag.interpreter[2:], "--implementation", "cp", "--abi", tag.abi]
    return f"{name}=={version} --hash=sha256:{pin.sha256}", opts


def _failed(pin: Pin, proc, fix: str) -> BuildFailed:
    detail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
    return BuildFailed(f"could not fetch {pin.name} pinned in {pin.where}:\n  " + "\n  ".join(detail) + f"\n{fix}")


def _pip_download(pin: Pin, tmp: Path) -> None:
    requirement, opts = _pip_request(pin)
    req = tmp / "requirement.txt"
    req.write_text(requirement + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--require-hashes",
                           "--dest", str(tmp), "-r", str(req), *opts], capture_output=True, text=True)
    if proc.returncode != 0 or not (tmp / pin.name).exists():
        raise _failed(pin, proc, "If the sha256 in the recipe is wrong, fix it; if the file is gone from PyPI, pin another version.")


def _apt(tmp: Path, arch: str, *args) -> subprocess.CompletedProcess:
    """apt-get with a private sources list and index under tmp: the machine's apt setup stays as it is."""
    root = tmp / "apt"
    for d in ("lists/partial", "cache/archives/partial"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "sources.list").write_text(f"deb {debian_source()}\n")
    opts = [f"Dir::Etc::SourceList={root / 'sources.list'}", "Dir::Etc::SourceParts=/dev/null",
            f"Dir::State::Lists={root / 'lists'}", f"Dir::Cache={root / 'cache'}",
            f"APT::Architecture={arch}", f"APT::Architectures={arch}"]
    return subprocess.run(["apt-get", "-q", *(x for o in opts for x in ("-o", o)), *args],
                          capture_output=True, text=True, cwd=tmp)


def _apt_download(pin: Pin, tmp: Path) -> None:
    if shutil.which("apt-get") is None:
        raise BuildFailed(f"{pin.name} (pinned in {pin.where}) is a Debian package and this machine has no apt-get; "
                          f"download it on a Debian/Ubuntu machine and put it in {INPUTS}")
    name, version, arch = deb_request(pin.name)
    arch = "amd64" if arch == "all" else arch  # arch:all packages are in every arch's index
    updated = tmp / "apt" / f"updated-{arch}"  # one index download for all .debs of a fetch
    if not updated.exists():
        proc = _apt(tmp, arch, "update")
        if proc.returncode != 0:
            raise _failed(pin, proc, f"apt-get update for '{debian_source()}' failed; check the network or proxy.")
        updated.touch()
    proc = _apt(tmp, arch, "download", f"{name}={version}")
    if proc.returncode != 0 or not (tmp / pin.name).exists():
        raise _failed(pin, proc, f"If Debian trixie no longer has {name} {version}, pin the version it has now "
                      f"(Debian's package search, suite trixie, package {name}) with its sha256, "
                      f"or put the file from Debian's snapshot archive in {INPUTS}.")


def fetch(pins: list[Pin], log=print) -> None:
    """Make every pinned file present and verified; raise BuildFailed otherwise."""
    INPUTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=INPUTS) as tmp:
        tmp = Path(tmp)
        for pin in pins:
            if pin.path.exists():
                got = file_digest(pin.path).sha256
                if got == pin.sha256:
                    continue
                log(f"[yellow]{pin.name}: cached file has sha256 {got}, not the pinned {pin.sha256}; fetching again")
                pin.path.unlink()
            log(f"fetching {pin.name}")
            if pin.name.endswith(".whl"):
                _pip_download(pin, tmp)
            elif _DEB.fullmatch(pin.name):
                _apt_download(pin, tmp)
            else:
                raise BuildFailed(f"{pin.where}: {pin.name} is not a wheel file name nor a Debian file name "
                                  "(<package>_<version>_<arch>.deb); only PyPI wheels and Debian packages can be fetched")
            _accept(tmp / pin.name, pin)


def _accept(got: Path, pin: Pin) -> None:
    """Check the sha256 (pip and apt check theirs; we pin by file) and move the file in atomically."""
    digest = file_digest(got).sha256
    if digest != pin.sha256:
        raise BuildFailed(f"{pin.name}: downloaded sha256 {digest} != pinned {pin.sha256} in {pin.where}; "
                          "if the new file is the one you want, put its sha256 in the recipe")
    os.replace(got, pin.path)  # same filesystem: tmp lies under INPUTS
