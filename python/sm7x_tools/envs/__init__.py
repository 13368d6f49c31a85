"""Solve and install environments from channel directories with py-rattler (pixi's engine):
the one wrapper every tool and test uses.

Channels are always explicit (py-rattler's default is conda-forge) and virtual packages
are always given: a node's (`node_packages`, for solving on behalf of other machines) or
this machine's, detected honouring CONDA_OVERRIDE_* like pixi (CONDA_OVERRIDE_CUDA_ARCH
only counts together with CONDA_OVERRIDE_CUDA).

    python -m sm7x_tools.envs PREFIX SPEC... [--channel DIR]...   create an environment
    python -m sm7x_tools.envs.bench ...                            time solve + install per node kind
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import rattler.exceptions
from rattler import (
    BuildString,
    GenericVirtualPackage,
    PackageName,
    Version,
    VirtualPackage,
    VirtualPackageOverrides,
    install as _install,
    solve as _solve,
)

from .. import REPO, ToolError
from ..channel import require_channel

PLATFORMS = ["linux-64", "noarch"]
# what py-rattler raises (its errors share no base class but Exception)
RATTLER_ERRORS = tuple(v for v in vars(rattler.exceptions).values() if isinstance(v, type) and issubclass(v, Exception))


def exit_now(code: int) -> None:
    """Leave a command that used py-rattler: its runtime can abort while the interpreter
    shuts down right after a solve (seen with py-rattler 0.28), so flush and skip the finalizers."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- virtual packages ----------------------------------------------------------------------

_CUDA_ARCH = re.compile(r"^\d+(\.\d+)?$")


def node_packages(cuda_arch: str | None, cuda: str = "12.4", glibc: str | None = None) -> list[str]:
    """A target node's virtual packages as `name=version=build` strings.

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
            raise ToolError(f"CUDA arch {cuda_arch!r} is not a compute capability like 7.0 or 7.5")
        out += [f"__cuda={cuda}=0", f"__cuda_arch={cuda_arch}=0"]
    return out


def _generic(item: str) -> GenericVirtualPackage:
    """A `name=version=build` string as the solver takes it."""
    name, ver, build = (item.split("=") + ["0"])[:3]
    return GenericVirtualPackage(PackageName(name), Version(ver), BuildString(build))


def detected() -> list:
    """This machine's virtual packages, with the CONDA_OVERRIDE_* variables applied."""
    return VirtualPackage.detect(VirtualPackageOverrides.from_env())


def channel_dirs(given: list[Path] | None = None) -> list[Path]:
    """The channel directories given, else ./channel and the bootstrap channel; each must be indexed."""
    from ..bootstrap import CHANNEL as BOOTSTRAP

    return [require_channel(c) for c in given or [REPO / "channel", BOOTSTRAP]]


# --- solve and install ---------------------------------------------------------------------

def solve(channels: list[Path | str], specs: list[str], virtual_packages=None) -> list:
    """Records of the solution for linux-64 (+ noarch); channels are directories or URLs,
    virtual_packages `name=version=build` strings (`node_packages`) or rattler's objects,
    by default this machine's (`detected()`)."""
    urls = [Path(c).resolve().as_uri() if isinstance(c, Path) else c for c in channels]
    vpkgs = detected() if virtual_packages is None else virtual_packages
    vpkgs = [_generic(v) if isinstance(v, str) else v for v in vpkgs]
    return asyncio.run(_solve(urls, specs, platforms=PLATFORMS, virtual_packages=vpkgs))


def install(records: list, prefix: Path, cache_dir: Path | None = None) -> None:
    asyncio.run(_install(records, target_prefix=Path(prefix), cache_dir=cache_dir, show_progress=False))


@dataclass
class Env:
    prefix: Path
    records: list
    solve_s: float
    install_s: float

    @property
    def names(self) -> set[str]:
        return {r.name.normalized for r in self.records}

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"


def create(prefix: Path, specs: list[str], channels: list[Path | str], virtual_packages=None) -> Env:
    """Solve and install into `prefix`, timing each."""
    prefix = Path(prefix).resolve()
    t0 = time.monotonic()
    records = solve(channels, specs, virtual_packages)
    t1 = time.monotonic()
    install(records, prefix)
    return Env(prefix, records, t1 - t0, time.monotonic() - t1)
