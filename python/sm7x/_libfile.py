"""Finding sm7x's native libraries on disk and checking a file before it is loaded.

Why check before loading: ``dlopen`` maps a shared library's segments straight from the
file, and a file cut short (an interrupted copy onto a shared filesystem) kills the process
with SIGBUS when the loader touches a page past its end, before any Python error can be
raised. Reading the ELF header and program headers (a few hundred bytes) and checking that
every PT_LOAD segment, and the section header table, lie inside the file turns that into an
error naming the file and the cause. Plain ``struct`` on purpose: this runs in every
process that loads a library and keeps ``import sm7x`` free of dependencies.

Searching a list of directories skips one that cannot be read (as a shell's PATH lookup
does) and reports it, instead of letting a bare PermissionError out of the ops.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from . import _targets

_ELF_MAGIC = b"\x7fELF"
_ET_DYN, _PT_LOAD, _SHT_STRTAB = 3, 1, 3


def search(dirs: list[Path], name: str) -> tuple[Path | None, list[str]]:
    """(the first ``dir/name`` that is a file, or None; the directories that could not be
    searched, each as "DIR: why")."""
    skipped = []
    for d in dirs:
        candidate = d / name
        try:
            if candidate.is_file():
                return candidate, skipped
        except OSError as exc:  # e.g. a directory without search (x) permission
            skipped.append(f"{d}: {exc.strerror or exc}")
    return None, skipped


def problem(path: Path) -> str | None:
    """Why ``path`` cannot be loaded safely as a shared library, or None: unreadable,
    empty, not a 64-bit ELF shared object, or truncated."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(64)
            if size == 0:
                return "the file is empty (0 bytes)"
            if head[:4] != _ELF_MAGIC:
                return "the file is not a shared library (no ELF header)"
            if len(head) < 64:
                return f"the file is truncated ({size} bytes: not even a whole ELF header)"
            if head[4] != 2 or head[5] != 1:
                return "the file is not a 64-bit little-endian ELF library"
            e_type = struct.unpack_from("<H", head, 16)[0]
            if e_type != _ET_DYN:
                return f"the file is an ELF file of type {e_type}, not a shared library"
            phoff, shoff = struct.unpack_from("<QQ", head, 32)
            phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", head, 54)
            if phoff + phnum * phentsize > size:
                return _truncated(size, phoff + phnum * phentsize, "its program headers")
            f.seek(phoff)
            table = f.read(phnum * phentsize)
            names_type = None
            if shoff and shstrndx < shnum and shoff + shnum * shentsize <= size:
                f.seek(shoff + shstrndx * shentsize + 4)
                names_type = struct.unpack("<I", f.read(4))[0]
    except OSError as exc:
        return f"the file cannot be read ({exc.strerror or exc})"
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if p_type == _PT_LOAD and p_offset + p_filesz > size:
            return _truncated(size, p_offset + p_filesz, f"its loadable segment {i}")
    if shoff and shoff + shnum * shentsize > size:
        return _truncated(size, shoff + shnum * shentsize, "its section header table")
    if names_type is not None and names_type != _SHT_STRTAB:
        # the file has its full size but its end is not what was written: a copy that
        # reserved the space (preallocated, sparse) and stopped before filling it
        return ("the file's end is not an ELF section table (it reads as zeros or other "
                "bytes): an interrupted copy that had already set the file's size?")
    return None


def _truncated(size: int, needed: int, what: str) -> str:
    return (f"the file is truncated: {what} ends at byte {needed:,} but the file has "
            f"{size:,} bytes (an interrupted copy?)")


def load_failure(exc: OSError, torch_version: str) -> str:
    """Why dlopen refused a library that passed :func:`problem`: torch's stable-ABI shims
    missing (torch older than the floor, targets.json torch.min), or the loader's own words."""
    why = str(exc)
    if "undefined symbol" in why and "torch" in why:
        return (f"{why}. The library needs torch >= {_targets.torch_min()} (it uses torch's "
                f"stable ABI; this torch is {torch_version}): upgrade torch")
    return why
