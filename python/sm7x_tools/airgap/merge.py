"""`merge`: one indexed channel from channels built on several machines.

A CI matrix builds each variant on its own machine (`./build.sh --variants sm70 --output
ch70`, `--variants sm75 --output ch75`, ...); a site mirrors one channel. Packages that
every machine builds (the noarch `sm7x`, the per-Python `sm7x-ext`) then arrive more than
once under the same file name:

- same bytes (sha256): one copy;
- different bytes but the same content (info/index.json apart from its build `timestamp`,
  and every file of info/paths.json with the same sha256): the same package, built twice;
  the first channel's file is kept and the table says so. rattler-build does not write
  byte-identical archives for the same build (see REPRODUCIBILITY below);
- different content, but the same info/index.json (apart from `timestamp`) and the same
  source digest in info/about.json (`extra: sm7x-source-digest`, which ./build.sh sets
  from the source tree, the toolchain channel and rattler-build): one recipe variant built
  from the same source on two machines; the first channel's file is kept;
- anything else is a conflict: two different packages under one name (e.g. the same
  version built from two commits), and a mirror can hold one. The merge refuses and lists
  them all. With `--keep-first` it keeps the first channel's file instead, where
  info/index.json agrees, and says so in the table.

REPRODUCIBILITY (rattler-build 0.73, measured by building the default variants twice from
one source tree): no archive came out byte-identical. The noarch `sm7x` differed only in
index.json's `timestamp`; each sm7x-ext .so in 19-20 bytes of its GNU build-id; the CUDA
libraries in nvcc's per-file anonymous-namespace hash (`_GLOBAL__N__<hash>_...`), which
follows the timestamped build directory. Hence the source digest.

The result is written atomically (OUT.partial, renamed into place), indexed by rattler and
verified before the rename; a failed merge leaves an existing OUT as it was.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rattler.package_streaming import PackageArchive

from ..channel import is_channel
from ..hashing import Digest, file_digest
from . import (
    READ_ERRORS,
    AirgapError,
    index,
    is_package,
    short,
    staged,
    subdirs,
)
from .verify import Report, verify

# the build time: the one field of index.json that differs between two builds of one package
IGNORED_INDEX_KEYS = ("timestamp",)


@dataclass
class Entry:
    channel: int  # 1-based position on the command line
    path: Path
    digest: Digest
    notes: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return self.path.parent.name, self.path.name


@dataclass
class MergeResult:
    out: Path
    channels: list[Path]
    entries: list[Entry]
    report: Report
    seconds: float


def _content(path: Path) -> tuple[dict, dict]:
    """info/index.json (without its build time) and {file: (sha256, size, type)} of info/paths.json."""

    async def read():
        pkg = await PackageArchive.from_path(path)
        raw = await pkg.read_file("info/index.json")
        return raw, await pkg.paths_json()

    raw, paths = asyncio.run(read())
    index_json = {k: v for k, v in json.loads(raw).items() if k not in IGNORED_INDEX_KEYS}
    files = {str(p.relative_path): (p.sha256.hex() if p.sha256 else None, p.size_in_bytes, str(p.path_type))
             for p in paths.paths}
    return index_json, files


SOURCE_DIGEST_KEY = "sm7x-source-digest"  # recipe.yaml `extra:`, set by ./build.sh


def _identity(path: Path) -> tuple[dict, str | None]:
    """info/index.json without its build time, and the source digest in info/about.json."""

    async def read():
        pkg = await PackageArchive.from_path(path)
        return await pkg.read_file("info/index.json"), await pkg.read_file("info/about.json")

    raw_index, raw_about = asyncio.run(read())
    index_json = {k: v for k, v in json.loads(raw_index).items() if k not in IGNORED_INDEX_KEYS}
    extra = json.loads(raw_about or b"{}").get("extra") or {}
    digest_ = extra.get(SOURCE_DIGEST_KEY)
    return index_json, None if digest_ in (None, "", "unknown") else str(digest_)


def same_build(a: Path, b: Path) -> str | None:
    """The source digest when a and b are one recipe variant built from the same source and
    toolchain on two machines (their bytes differ: GNU build-ids, nvcc's per-build-dir
    names); None otherwise."""
    try:
        (ia, da), (ib, db) = _identity(a), _identity(b)
    except READ_ERRORS:
        return None
    return da if da is not None and da == db and ia == ib else None


def compare_content(a: Path, b: Path) -> list[str]:
    """What differs between two package archives' content; [] when they are the same package."""
    try:
        (ia, fa), (ib, fb) = _content(a), _content(b)
    except READ_ERRORS as exc:
        return [f"cannot read both archives ({str(exc).strip()})"]
    diffs = [f"index.json {k}: {ia.get(k)!r} vs {ib.get(k)!r}"
             for k in sorted(set(ia) | set(ib)) if ia.get(k) != ib.get(k)]
    changed = sorted(p for p in set(fa) | set(fb) if fa.get(p) != fb.get(p))
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        diffs.append(f"{len(changed)} file(s) of paths.json differ: {shown}")
    return diffs


def _scan(channel: Path, number: int, damaged: list[str]) -> list[Entry]:
    entries = []
    for sub in subdirs(channel):
        listed = {}
        if (sub / "repodata.json").is_file():
            try:
                data = json.loads((sub / "repodata.json").read_text())
                listed = {**data.get("packages", {}), **data.get("packages.conda", {})}
            except ValueError as exc:
                damaged.append(f"{sub / 'repodata.json'} does not parse ({exc})")
        for path in sorted(p for p in sub.iterdir() if is_package(p)):
            entry = Entry(number, path, file_digest(path))
            want = listed.get(path.name, {}).get("sha256")
            if want and want != entry.digest.sha256:
                damaged.append(f"{path}: sha256 {short(entry.digest.sha256)} but its repodata.json says {short(want)}")
            entries.append(entry)
    return entries


def plan(channels: list[Path], keep_first: bool = False) -> list[Entry]:
    """The packages to keep, first channel first; raises AirgapError listing every conflict."""
    chosen: dict[tuple[str, str], Entry] = {}
    conflicts, damaged = [], []
    for number, channel in enumerate(channels, 1):
        for entry in _scan(channel, number, damaged):
            first = chosen.get(entry.key)
            if first is None:
                chosen[entry.key] = entry
            elif first.digest.sha256 == entry.digest.sha256:
                first.notes.append(f"identical in {number}")
            elif not (diffs := compare_content(first.path, entry.path)):
                first.notes.append(f"{number} has the same content in other bytes (rebuilt): kept {first.channel}'s")
            elif source := same_build(first.path, entry.path):
                first.notes.append(f"{number} built the same variant from the same source ({source[:12]}…) "
                                   f"into other bytes: kept {first.channel}'s")
            elif keep_first and not any(d.startswith("index.json") for d in diffs):
                first.notes.append(f"--keep-first: {number} has other content ({'; '.join(diffs)}); "
                                   f"kept {first.channel}'s")
            else:
                conflicts.append(f"  {entry.key[0]}/{entry.key[1]}:\n"
                                 f"    {first.channel}: {first.path} (sha256 {short(first.digest.sha256)})\n"
                                 f"    {number}: {entry.path} (sha256 {short(entry.digest.sha256)})\n"
                                 + "".join(f"    differs: {d}\n" for d in diffs))
    if damaged:
        raise AirgapError("source channel(s) damaged; check them with ./airgap.sh verify DIR and rebuild or "
                          "copy them again:\n  " + "\n  ".join(damaged))
    if conflicts:
        raise AirgapError(f"{len(conflicts)} package(s) have the same file name but different content in two "
                          "channels; a mirror can hold only one. rattler-build does not rebuild byte for byte, "
                          "so build each package on one machine only, drop a channel, or pass --keep-first to "
                          "keep the first channel's copy where the metadata agree:\n" + "".join(conflicts).rstrip())
    return sorted(chosen.values(), key=lambda e: e.key)


def merge(out: Path, channels: list[Path], with_channels: list[Path] = (), keep_first: bool = False) -> MergeResult:
    start = time.monotonic()
    out = Path(out).resolve()
    channels = [Path(c).resolve() for c in channels]
    for ch in channels:
        if not ch.is_dir() or not any(is_package(p) for sub in subdirs(ch) for p in sub.iterdir()):
            raise AirgapError(f"{ch} is not a channel directory with packages in linux-64/ or noarch/")
        if ch == out:
            raise AirgapError(f"the output {out} is also an input; merge into a new directory")
    entries = plan(channels, keep_first)
    with staged(out, is_channel) as tmp:
        for entry in entries:
            dst = tmp / entry.key[0] / entry.key[1]
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(entry.path, dst)
            os.chmod(dst, 0o644)
        index(tmp)
        report = verify(tmp, with_channels, resolve=False)
        if not report.ok:
            from .verify import print_report

            print_report(report)
            raise AirgapError(f"the merged channel does not verify ({len(report.problems)} problem(s) above); "
                              f"{out} was not written")
    report.root = out
    return MergeResult(out, channels, entries, report, time.monotonic() - start)


def print_summary(result: MergeResult) -> None:
    from rich.table import Table

    from ..ui import console

    for number, ch in enumerate(result.channels, 1):
        n = sum(1 for e in result.entries if e.channel == number)
        console.print(f"  {number} = {ch}  ({n} package(s) taken from it)")
    table = Table(title=f"merged channel: {result.out}")
    for col in ("package file", "subdir", "from", "note"):
        table.add_column(col)
    for e in result.entries:
        table.add_row(e.key[1], e.key[0], str(e.channel), "; ".join(e.notes))
    console.print(table)
    size = sum(e.digest.size for e in result.entries)
    console.print(f"[green]merged[/] {len(result.entries)} packages ({size / 1e6:.1f} MB) in {result.seconds:.1f} s; "
                  f"indexed and verified. Use it with -c {result.out.as_uri()}")
