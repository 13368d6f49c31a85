"""Air-gapped installs: bundle solved environments, verify channels, merge channels.

Our users' GPU nodes cannot reach any channel. `bundle` solves here, for the target node's
virtual packages (CEP 46 `__cuda_arch` differs between a login node and a GPU node), and
writes a self-contained channel subset with a pixi lock, conda explicit files and a
manifest. `verify` checks a bundle or any channel directory against every independent
record of its hashes before it is carried across the gap. `merge` joins the channels that
a CI matrix built on several machines into one.

This module holds what the three share: user errors, hashing, virtual packages, and the
atomic output directory (OUT.partial, renamed into place only when everything worked).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from urllib.parse import unquote, urlparse

import rattler.exceptions
from rattler import (
    BuildString,
    GenericVirtualPackage,
    PackageName,
    Version,
    VirtualPackage,
)

from .. import BuildFailed
from ..channel import SUBDIRS, index_dir, replace_dir

FORMAT = "sm7x-airgap-bundle"
FORMAT_VERSION = 1
PACKAGE_SUFFIXES = (".conda", ".tar.bz2")
SHA256SUMS = "SHA256SUMS"  # coreutils format, for the air-gapped side
# what py-rattler raises (its errors share no base class but Exception), and reading a damaged file
RATTLER_ERRORS = tuple(v for v in vars(rattler.exceptions).values() if isinstance(v, type) and issubclass(v, Exception))
READ_ERRORS = (*RATTLER_ERRORS, OSError, ValueError)


class AirgapError(BuildFailed):
    """A user-facing failure: the message says what was wrong and how to fix it."""


@dataclass(frozen=True)
class Digest:
    sha256: str
    md5: str
    size: int


def digest(path: Path) -> Digest:
    """sha256, md5 and size of a file, in one read."""
    sha, md5, size = hashlib.sha256(), hashlib.md5(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            md5.update(chunk)
            size += len(chunk)
    return Digest(sha.hexdigest(), md5.hexdigest(), size)


def short(sha: str | None) -> str:
    return f"{sha[:12]}…" if sha else "(none)"


def is_package(path: Path) -> bool:
    return path.is_file() and path.name.endswith(PACKAGE_SUFFIXES)


def subdirs(channel: Path) -> list[Path]:
    """The subdirs of a channel directory: the standard ones and any other with a repodata.json."""
    found = {channel / s for s in SUBDIRS if (channel / s).is_dir()}
    found |= {p.parent for p in channel.glob("*/repodata.json")}
    return sorted(found)


def is_channel(path: Path) -> bool:
    return any((path / s / "repodata.json").is_file() for s in SUBDIRS)


def require_channel(path: Path, what: str = "channel") -> Path:
    path = Path(path).resolve()
    if not is_channel(path):
        hint = " (build it with ./build.sh)" if path.name == "channel" else ""
        raise AirgapError(f"{what} {path} is not an indexed channel: it has no linux-64/ or noarch/ "
                          f"repodata.json{hint}")
    return path


def url_to_path(url: str) -> Path:
    parsed = urlparse(url)
    if parsed.scheme != "file":
        raise AirgapError(f"{url} is not a local file:// URL; pass channel directories, not remote channels")
    return Path(unquote(parsed.path))


def index(channel: Path) -> None:
    """Index with rattler (monolithic repodata.json in every subdir) and drop its empty scratch dir."""
    index_dir(channel)
    scratch = channel / ".tmp"
    if scratch.is_dir() and not any(scratch.iterdir()):
        scratch.rmdir()


def tool_versions() -> dict:
    import tomllib

    from .. import REPO

    sm7x = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return {"sm7x": sm7x, "py-rattler": version("py-rattler"), "py-rattler-build": version("py-rattler-build")}


# --- virtual packages --------------------------------------------------------------------

_CUDA_ARCH = re.compile(r"^\d+(\.\d+)?$")


def target_virtual_packages(cuda_arch: str | None, cuda: str = "12.4", glibc: str | None = None) -> list[str]:
    """The target node's virtual packages as `name=version=build` strings.

    Not this machine's: __unix, __linux (this kernel), __glibc (this one or `glibc`), a
    generic x86_64 __archspec, and with a CUDA arch also __cuda and __cuda_arch (CEP 46).
    Without one the solve is a login node's: no __cuda, so __cuda_arch selectors take their
    fallback.
    """
    here = {str(g.name.normalized): g for g in (v.into_generic() for v in VirtualPackage.detect())}
    linux = str(here["__linux"].version) if "__linux" in here else "5.14"
    glibc = glibc or (str(here["__glibc"].version) if "__glibc" in here else "2.28")
    out = ["__unix=0=0", f"__linux={linux}=0", f"__glibc={glibc}=0", "__archspec=1=x86_64"]
    if cuda_arch is not None:
        if not _CUDA_ARCH.match(cuda_arch):
            raise AirgapError(f"CUDA arch {cuda_arch!r} is not a compute capability like 7.0 or 7.5")
        out += [f"__cuda={cuda}=0", f"__cuda_arch={cuda_arch}=0"]
    return out


def generic(vpkgs: list[str]) -> list[GenericVirtualPackage]:
    out = []
    for item in vpkgs:
        name, ver, build = (item.split("=") + ["0"])[:3]
        out.append(GenericVirtualPackage(PackageName(name), Version(ver), BuildString(build)))
    return out


# --- atomic output -----------------------------------------------------------------------

def _replaceable(out: Path, marker) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise AirgapError(f"{out} exists and is not a directory; choose another output path")
    if any(out.iterdir()) and not marker(out):
        raise AirgapError(f"{out} exists and is not one this tool wrote; refusing to replace it. "
                          "Choose a new output path or remove it first")


@contextmanager
def staged(out: Path, marker):
    """Yield OUT.partial; on success replace OUT with it, on any failure remove it.

    `marker(path)` says whether an existing OUT is ours to replace (never someone's home).
    """
    _replaceable(out, marker)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
