"""Content digests that decide whether a channel must be rebuilt."""

from __future__ import annotations

import hashlib
from pathlib import Path

from . import REPO

_SKIP = {"__pycache__", ".pytest_cache", ".hypothesis"}


def tree_digest(paths: list[Path], extra: list[str] = ()) -> str:
    """sha256 over the relative names and contents of every file under `paths`."""
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
        h.update(str(f.relative_to(REPO)).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()
