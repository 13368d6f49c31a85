"""Where two .conda files differ: the first differing archive member, and in it what.

Reads both archives side by side (zip members, then the tar members of each tar.zst in
order), so it names e.g. `pkg-…tar.zst: lib/…/_sched.so: contents differ from byte 4096
(sha256 1a2b… vs 3c4d…)` or `info-…tar.zst: info/about.json: line 3: … vs …`.
"""

from __future__ import annotations

import hashlib
import tarfile
import zipfile
from pathlib import Path

from ..hashing import file_digest
from .normalize import _decompress

_HEADER = ("type", "mode", "mtime", "uid", "gid", "uname", "gname", "linkname", "size")


def differences(a: Path, b: Path) -> list[str]:
    """[] when the files are the same bytes; else what differs, the first differing member first."""
    if file_digest(a).sha256 == file_digest(b).sha256:
        return []
    try:
        with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
            return _zips(za, zb) or ["the archives differ but none of their members does (zip layout)"]
    except (zipfile.BadZipFile, OSError, tarfile.TarError, ValueError) as exc:
        return [f"cannot read both as .conda archives ({exc})"]


def _zips(za: zipfile.ZipFile, zb: zipfile.ZipFile) -> list[str]:
    na, nb = za.namelist(), zb.namelist()
    if na != nb:
        return [f"zip members {na} vs {nb}"]
    out = []
    for name in na:
        ia, ib = za.getinfo(name), zb.getinfo(name)
        if ia.CRC == ib.CRC and ia.file_size == ib.file_size:
            if (ia.date_time, ia.external_attr) != (ib.date_time, ib.external_attr):
                out.append(f"{name}: zip entry time/mode {ia.date_time} {ia.external_attr:o} vs "
                           f"{ib.date_time} {ib.external_attr:o}")
            continue
        if name.endswith(".tar.zst"):
            with za.open(name) as ra, zb.open(name) as rb:
                found = _tars(ra, rb)
            out += [f"{name}: {d}" for d in found] or [f"{name}: same tar members, other compressed bytes"]
        else:
            out.append(f"{name}: contents differ")
    return out


def _tars(ra, rb) -> list[str]:
    out = []
    with _decompress(ra) as sa, _decompress(rb) as sb, \
            tarfile.open(fileobj=sa, mode="r|") as ta, tarfile.open(fileobj=sb, mode="r|") as tb:
        ita, itb = iter(ta), iter(tb)
        while True:
            ma, mb = next(ita, None), next(itb, None)
            if ma is None and mb is None:
                return out
            if ma is None or mb is None or ma.name != mb.name:
                out.append(f"member {ma.name if ma else '(end)'} vs {mb.name if mb else '(end)'}: "
                           f"the members differ from here on")
                return out
            header = [f"{k} {getattr(ma, k)!r} vs {getattr(mb, k)!r}" for k in _HEADER
                      if getattr(ma, k) != getattr(mb, k)]
            if ma.isfile() and mb.isfile():
                what = _contents(ta.extractfile(ma), tb.extractfile(mb), ma.name)
                if what:
                    header.insert(0, what)
            if header:
                out.append(f"{ma.name}: {'; '.join(header)}")


def _contents(fa, fb, name: str) -> str | None:
    """None when equal; else where they first differ (the line, for a small text file)."""
    da, db = fa.read(), fb.read()
    if da == db:
        return None
    if len(da) < 1 << 20 and len(db) < 1 << 20 and b"\0" not in da + db:  # text
        try:
            la, lb = da.decode().splitlines(), db.decode().splitlines()
        except UnicodeDecodeError:
            pass
        else:
            for i, (x, y) in enumerate(zip(la, lb), 1):
                if x != y:
                    return f"line {i}: {_cut(x)!r} vs {_cut(y)!r}"
            return f"{len(la)} vs {len(lb)} lines"
    at = next((i for i in range(0, min(len(da), len(db)), 4096) if da[i:i + 4096] != db[i:i + 4096]),
              min(len(da), len(db)))
    at += next((i for i, (x, y) in enumerate(zip(da[at:at + 4096], db[at:at + 4096])) if x != y), 0)
    return (f"contents differ from byte {at} (sha256 {hashlib.sha256(da).hexdigest()[:12]}… vs "
            f"{hashlib.sha256(db).hexdigest()[:12]}…)")


def _cut(s: str, n: int = 100) -> str:
    return s if len(s) <= n else s[:n] + "…"
