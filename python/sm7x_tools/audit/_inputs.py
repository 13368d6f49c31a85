"""Turn command-line paths into shared objects: a .so, a directory, a .whl, a .conda
(zip holding pkg-*.tar.zst) or a .tar.bz2 conda package."""

from __future__ import annotations

import contextlib
import io
import os
import re
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

SO_NAME = re.compile(r"\.so(?:\.\d+)*$")


class InputError(Exception):
    pass


def is_shared_object_name(name: str) -> bool:
    return bool(SO_NAME.search(name))


def _scan_dir(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", ".git"))
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            # symlinks (libfoo.so -> libfoo.so.1) would list one file twice
            if is_shared_object_name(fn) and not p.is_symlink() and p.is_file():
                yield p


def _safe_member(name: str) -> PurePosixPath | None:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        return None
    return p


def _zstd_reader(raw: io.BufferedIOBase):
    try:
        from compression import zstd  # Python >= 3.14

        return zstd.ZstdFile(raw)
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        raise InputError(
            "reading a .conda package needs a zstd decompressor: Python >= 3.14 "
            "(compression.zstd) or the zstandard module (pip install zstandard / "
            "conda install zstandard); or audit the installed files (a directory) instead"
        ) from None
    return zstandard.ZstdDecompressor().stream_reader(raw)


def _extract_tar(tf: tarfile.TarFile, dest: Path) -> int:
    n = 0
    for m in tf:
        rel = _safe_member(m.name)
        if rel is None or not m.isfile() or not is_shared_object_name(rel.name):
            continue
        out = dest.joinpath(*rel.parts)
        out.parent.mkdir(parents=True, exist_ok=True)
        src = tf.extractfile(m)
        if src is None:
            continue
        with src, open(out, "wb") as f:
            while chunk := src.read(1 << 20):
                f.write(chunk)
        n += 1
    return n


def _extract_conda(pkg: Path, dest: Path) -> None:
    with zipfile.ZipFile(pkg) as zf:
        inner = [n for n in zf.namelist() if n.startswith("pkg-") and n.endswith(".tar.zst")]
        if not inner:
            raise InputError(f"{pkg}: no pkg-*.tar.zst inside: not a .conda package")
        for name in inner:
            with zf.open(name) as raw, _zstd_reader(raw) as plain, \
                    tarfile.open(fileobj=plain, mode="r|") as tf:
                _extract_tar(tf, dest)


def _extract_wheel(whl: Path, dest: Path) -> None:
    with zipfile.ZipFile(whl) as zf:
        for info in zf.infolist():
            rel = _safe_member(info.filename)
            if rel is None or info.is_dir() or not is_shared_object_name(rel.name):
                continue
            out = dest.joinpath(*rel.parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(out, "wb") as f:
                while chunk := src.read(1 << 20):
                    f.write(chunk)


@contextlib.contextmanager
def expand(arg: str) -> Iterator[list[tuple[Path, str]]]:
    """(real path, display name) of each shared object under arg; archives are unpacked
    into a temporary directory that lives until the context ends."""
    p = Path(arg)
    if not p.exists():
        raise InputError(f"{arg}: no such file or directory")
    if p.is_dir():
        yield [(f, os.path.join(arg, f.relative_to(p).as_posix())) for f in _scan_dir(p)]
        return
    kind = ("conda" if p.name.endswith(".conda") else
            "tar.bz2" if p.name.endswith(".tar.bz2") else
            "whl" if p.name.endswith(".whl") else None)
    if kind is None:
        yield [(p, arg)]
        return
    with tempfile.TemporaryDirectory(prefix="sm7x-audit-") as tmp:
        dest = Path(tmp)
        try:
            if kind == "conda":
                _extract_conda(p, dest)
            elif kind == "whl":
                _extract_wheel(p, dest)
            else:
                with tarfile.open(p, "r:bz2") as tf:
                    _extract_tar(tf, dest)
        except (zipfile.BadZipFile, tarfile.TarError, OSError) as exc:
            raise InputError(f"{arg}: cannot unpack: {exc}") from exc
        yield [(f, f"{p.name}!{f.relative_to(dest).as_posix()}") for f in _scan_dir(dest)]
