"""The one file hasher (sha256, md5 and size in one read) and the tree digest built on it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

_SKIP = {"__pycache__", ".pytest_cache", ".hypothesis"}


@dataclass(frozen=True)
class Digest:
    sha256: str
    md5: str
    size: int


def file_digest(path: Path) -> Digest:
    """sha256, md5 and size of a file, in one read."""
    sha, md5, size = hashlib.sha256(), hashlib.md5(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            md5.update(chunk)
            size += len(chunk)
    return Digest(sha.hexdigest(), md5.hexdigest(), size)


def tree_digest(paths: list[Path], root: Path, extra: list[str] = ()) -> str:
    """sha256 over `extra` and the names (relative to `root`) and contents of every file under `paths`."""
    h = hashlib.sha256()
    for item in extra:
        h.update(item.encode() + b"\0")
    files = []
    for p in paths:
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += [f for f in p.rglob("*") if f.is_file() and not _SKIP & set(f.parts)]
    for f in sorted(set(files)):
        name = f.relative_to(root) if f.is_relative_to(root) else f  # a site variant file may lie elsewhere
        h.update(f"{name}\0{file_digest(f).sha256}\0".encode())
    return h.hexdigest()
