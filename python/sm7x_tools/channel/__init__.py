"""./build.sh's package: the sm7x channel (run it as `python -m sm7x_tools.channel`).

This module holds channel directories: atomic publication, indexing and a summary.

A channel is only ever replaced whole: packages are copied into a sibling temporary
directory (CHANNEL.partial), indexed there (monolithic repodata.json in every subdir, noarch
included), then swapped in so that CHANNEL is a complete channel at every instant: one
renameat2(RENAME_EXCHANGE) of the two directories (CHANNEL stays a plain directory), or,
on a filesystem without it (NFS), CHANNEL is a symlink to a versioned sibling
(.CHANNEL.N) flipped by renaming a new symlink over it. A failed or killed build leaves
the previous channel as it was; what it left beside it, the next start removes
(lifecycle.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import re
import shutil
from pathlib import Path

from rattler import index

from .. import ToolError
from ..repro import machine_paths
from ..repro.normalize import normalize


class BuildFailed(ToolError):
    """A build step failed; the message names the problem and how to fix it."""


SUBDIRS = ("linux-64", "noarch")
STAMP = ".sm7x-stamp"


def packages(directory: Path) -> list[Path]:
    return sorted(p for sub in SUBDIRS for p in (directory / sub).glob("*.conda"))


def is_channel(path: Path) -> bool:
    return any((path / s / "repodata.json").is_file() for s in SUBDIRS)


def require_channel(path: Path, what: str = "channel") -> Path:
    path = Path(path).resolve()
    if not is_channel(path):
        hint = " (build it with ./build.sh)" if path.name == "channel" else ""
        raise BuildFailed(f"{what} {path} is not an indexed channel: it has no linux-64/ or noarch/ "
                          f"repodata.json{hint}")
    return path


def read_stamp(channel: Path) -> str | None:
    stamp = channel / STAMP
    return stamp.read_text().strip() if stamp.exists() else None


def publish(built: Path, channel: Path, stamp: str, epoch: int) -> list[Path]:
    """Copy the .conda files under `built` into a fresh channel at `channel`, each repacked
    reproducibly (time `epoch`, no build paths: sm7x_tools.repro)."""
    pkgs = packages(built)
    if not pkgs:
        raise BuildFailed(f"no packages were produced under {built}")
    tmp = partial(channel)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for sub in SUBDIRS:
            (tmp / sub).mkdir(parents=True)
        for pkg in pkgs:
            shutil.copy2(pkg, tmp / pkg.parent.name / pkg.name)
            normalize(tmp / pkg.parent.name / pkg.name, epoch=epoch, paths=machine_paths(built))
        index_dir(tmp)
        (tmp / STAMP).write_text(stamp + "\n")
        replace_dir(tmp, channel, versioned=True)
    finally:  # failed or interrupted: the partial copy goes (a finished swap left nothing here)
        shutil.rmtree(tmp, ignore_errors=True)
    return packages(channel)


def partial(target: Path) -> Path:
    return target.with_name(target.name + ".partial")


RENAME_EXCHANGE = 2  # linux/fs.h
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}  # what a filesystem without it says


def exchange(a: Path, b: Path) -> None:
    """Swap two directory entries in one step (renameat2 RENAME_EXCHANGE, Linux >= 3.15)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "this C library has no renameat2", str(a))
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def exchange_supported(directory: Path) -> bool:
    """Whether the filesystem of `directory` swaps entries atomically (NFS, for one, does not)."""
    a, b = directory / ".sm7x-exchange-probe-a", directory / ".sm7x-exchange-probe-b"
    try:
        a.write_text("a")
        b.write_text("b")
        exchange(a, b)
        return a.read_text() == "b"
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


def versions(target: Path) -> list[Path]:
    """The versioned directories of a symlinked channel (.NAME.1, .NAME.2, ...), oldest first."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)")
    found = [(int(m.group(1)), p) for p in target.parent.glob(f".{target.name}.*") if (m := pattern.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def replace_dir(tmp: Path, target: Path, versioned: bool = False) -> None:
    """Put the finished directory `tmp` in place of `target`; `target` is complete at every instant.

    A plain directory is exchanged with `tmp` in one step, after which `tmp` holds the old
    one, removed last. A symlinked target (versioned=True: ./build.sh's channels,
    where the filesystem cannot exchange) points at .NAME.N, and a new link is renamed over
    it. Where neither applies (an airgap output on NFS) the old one is renamed aside first.
    """
    if target.is_symlink():
        _flip_link(tmp, target)
    elif not target.exists():
        if versioned and not exchange_supported(target.parent):
            _flip_link(tmp, target)  # start symlinked: later swaps cannot exchange either
        else:
            tmp.rename(target)
    else:
        try:
            exchange(tmp, target)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            if versioned:
                raise BuildFailed(
                    f"{target.parent} cannot exchange two directories in one step ({exc.strerror}), so {target} "
                    f"cannot be replaced without an instant where it is missing. Move it away once "
                    f"(mv {target} {target}.previous); the next build publishes it as a symlink to a "
                    f"versioned directory, which is flipped atomically from then on") from None
            old = target.with_name(target.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)  # the one non-atomic case: not a ./build.sh channel, no exchange
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            shutil.rmtree(tmp)  # now the old one


def _flip_link(tmp: Path, target: Path) -> None:
    old = target.resolve() if target.is_symlink() else None
    number = max([int(p.name.rsplit(".", 1)[1]) for p in versions(target)] + [0]) + 1
    version = target.with_name(f".{target.name}.{number}")
    tmp.rename(version)
    link = target.with_name(f".{target.name}.link")
    link.unlink(missing_ok=True)
    link.symlink_to(version.name)  # relative: the tree may move
    os.rename(link, target)  # the flip: one rename of a symlink over a symlink
    if old is not None and old.parent == target.parent and old.name.startswith(f".{target.name}."):
        shutil.rmtree(old, ignore_errors=True)


def index_dir(directory: Path) -> None:
    """Index a channel directory in place: a monolithic repodata.json in every subdir."""
    for sub in SUBDIRS:
        (directory / sub).mkdir(parents=True, exist_ok=True)
    asyncio.run(index.index_fs(directory, write_zst=False, write_shards=False, force=True))
    for sub in SUBDIRS:
        path = directory / sub / "repodata.json"
        data = json.loads(path.read_text())
        if "packages.conda" not in data:
            raise BuildFailed(f"indexing {directory / sub} wrote no monolithic repodata.json")
        # rattler stamps each record with the time of indexing: the package's own
        # (normalized) timestamp instead, so that the same packages index to the same bytes
        for group in ("packages", "packages.conda"):
            for rec in data.get(group, {}).values():
                if "indexed_timestamp" in rec:
                    rec["indexed_timestamp"] = rec.get("timestamp", 0)
        path.write_text(json.dumps(data, separators=(",", ":")))
    # the indexer's scratch directory, left empty behind: not part of a channel
    shutil.rmtree(directory / ".tmp", ignore_errors=True)


def records(channel: Path) -> list[dict]:
    """name, version, build, subdir, size of every package in an indexed channel."""
    rows = []
    for sub in SUBDIRS:
        data = json.loads((channel / sub / "repodata.json").read_text())
        for fn, rec in data.get("packages.conda", {}).items():
            rows.append({"file": fn, "subdir": sub, **{k: rec[k] for k in ("name", "version", "build", "size")}})
    return sorted(rows, key=lambda r: (r["name"], r["version"], r["build"]))
