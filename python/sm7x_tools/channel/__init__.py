"""./build.sh's package: the sm7x channel (run it as `python -m sm7x_tools.channel`).

This module holds channel directories: atomic publication, indexing and a summary.

A channel is only ever replaced whole: packages are copied into a sibling temporary
directory, indexed there (monolithic repodata.json in every subdir, noarch included),
then swapped in by rename. A failed build leaves the previous channel untouched.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

from rattler import index

from .. import ToolError


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


def publish(built: Path, channel: Path, stamp: str) -> list[Path]:
    """Copy the .conda files under `built` into a fresh channel at `channel`."""
    pkgs = packages(built)
    if not pkgs:
        raise BuildFailed(f"no packages were produced under {built}")
    tmp = channel.with_name(channel.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    for sub in SUBDIRS:
        (tmp / sub).mkdir(parents=True)
    for pkg in pkgs:
        shutil.copy2(pkg, tmp / pkg.parent.name / pkg.name)
    index_dir(tmp)
    (tmp / STAMP).write_text(stamp + "\n")
    replace_dir(tmp, channel)
    return packages(channel)


def replace_dir(tmp: Path, target: Path) -> None:
    """Put the finished directory `tmp` in place of `target` by renames; the old one goes last."""
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def index_dir(directory: Path) -> None:
    """Index a channel directory in place: a monolithic repodata.json in every subdir."""
    for sub in SUBDIRS:
        (directory / sub).mkdir(parents=True, exist_ok=True)
    asyncio.run(index.index_fs(directory, write_zst=False, write_shards=False, force=True))
    for sub in SUBDIRS:
        data = json.loads((directory / sub / "repodata.json").read_text())
        if "packages.conda" not in data:
            raise BuildFailed(f"indexing {directory / sub} wrote no monolithic repodata.json")


def records(channel: Path) -> list[dict]:
    """name, version, build, subdir, size of every package in an indexed channel."""
    rows = []
    for sub in SUBDIRS:
        data = json.loads((channel / sub / "repodata.json").read_text())
        for fn, rec in data.get("packages.conda", {}).items():
            rows.append({"file": fn, "subdir": sub, **{k: rec[k] for k in ("name", "version", "build", "size")}})
    return sorted(rows, key=lambda r: (r["name"], r["version"], r["build"]))
