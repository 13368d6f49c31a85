"""`merge`: one indexed channel from channels built on several machines.

A CI matrix builds each variant on its own machine (`./build.sh --variants sm70 --output
ch70`, `--variants sm75 --output ch75`, ...); a site mirrors one channel. Packages that
every machine builds (the noarch `sm7x`, the per-Python `sm7x-ext`) then arrive more than
once under the same file name:

- same bytes (sha256): one copy;
- different bytes but the same payload: the same package, recompressed or rebuilt
  reproducibly; the first channel's file is kept and the table says so. The payload is
  what installing the package writes and is told, read from each archive itself (never
  from what it declares about itself): every file outside info/ (sha256 of its bytes, the
  executable bit, a symlink's target), info/index.json apart from its build `timestamp`
  (depends and constrains compared as sets),
  the install instructions of info/paths.json (type, sha256, size, prefix placeholder,
  no_link of every path) and info/link.json;
- any other difference under one file name is refused, whatever the packages declare
  (a source digest in info/about.json, equal metadata): a mirror can hold one file of that
  name, and a copy with an added file and unchanged metadata is exactly what an attacker
  would bring. The merge lists every conflict. `--keep-first` is the explicit override:
  it takes the first channel's copy where info/index.json agrees, and the table says so
  for each package it decided.

REPRODUCIBILITY: before sm7x_tools.repro, no archive of two builds of one source tree came
out byte-identical (rattler-build 0.73 stamps the build time and directories; the sm7x-ext
.so differed in its GNU build-id, the CUDA libraries in nvcc's anonymous-namespace hash).
Now two builds of one commit give the same bytes, and the outputs that two machines build
from other variant files have the same payload (their rendered recipes list other sibling
builds), so merging their channels needs no --keep-first.

The result is written atomically (OUT.partial, renamed into place), indexed by rattler and
verified before the rename; a failed merge leaves an existing OUT as it was.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rattler.package_streaming import PackageArchive, extract

from ..channel import is_channel
from ..hashing import Digest, file_digest
from . import (
    READ_ERRORS,
    AirgapError,
    index,
    is_package,
    read_json,
    short,
    staged,
    subdirs,
)
from .verify import Report, verify

# the build time: the one field of index.json that differs between two builds of one package
IGNORED_INDEX_KEYS = ("timestamp",)
# lists a solver reads as sets: rattler-build writes the run exports of several build
# dependencies (the sysroot's __glibc, the compilers' libstdcxx/libgcc) in no fixed order
ORDERLESS_INDEX_KEYS = ("depends", "constrains")


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


def _payload(path: Path) -> tuple[dict, dict]:
    """info/index.json (without its build time) and {entry: what installing writes or is told},
    read from the archive's own bytes: the files outside info/ as they are (not as its
    paths.json says they are), info/paths.json's install instructions and info/link.json."""
    with tempfile.TemporaryDirectory(prefix="sm7x-merge-") as tmp:
        root = Path(tmp)
        extract(path, root)
        index_json = {k: sorted(v) if k in ORDERLESS_INDEX_KEYS and isinstance(v, list) else v
                      for k, v in read_json(root / "info" / "index.json").items() if k not in IGNORED_INDEX_KEYS}
        files: dict[str, tuple] = {}
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root).as_posix()
            if rel.startswith("info/"):
                continue
            if p.is_symlink():
                files[rel] = ("symlink", os.readlink(p))
            elif p.is_file():
                files[rel] = ("file", file_digest(p).sha256, bool(p.stat().st_mode & 0o111))
        paths = root / "info" / "paths.json"
        for entry in (read_json(paths).get("paths", []) if paths.exists() else []):
            files[f"info/paths.json:{entry.get('_path')}"] = tuple(
                json.dumps(entry.get(k), sort_keys=True) for k in INSTALL_KEYS)
        link = root / "info" / "link.json"
        if link.exists():
            files["info/link.json"] = ("json", json.dumps(read_json(link), sort_keys=True))
    return index_json, files


# what info/paths.json tells the installer about each path (the rest is informational)
INSTALL_KEYS = ("path_type", "sha256", "size_in_bytes", "prefix_placeholder", "file_mode", "no_link")
SOURCE_DIGEST_KEY = "sm7x-source-digest"  # recipe.yaml `extra:`, set by ./build.sh


def declared_source(path: Path) -> str | None:
    """The source digest a package declares in info/about.json: shown in a conflict, never
    a reason to accept one (an altered copy declares whatever its original did)."""

    async def read():
        return await (await PackageArchive.from_path(path)).read_file("info/about.json")

    try:
        extra = json.loads(asyncio.run(read()) or b"{}").get("extra") or {}
    except (*READ_ERRORS, AttributeError):
        return None
    digest_ = extra.get(SOURCE_DIGEST_KEY)
    return None if digest_ in (None, "", "unknown") else str(digest_)


def compare_content(a: Path, b: Path) -> list[str]:
    """What differs between two package archives' payloads; [] when they install the same."""
    try:
        (ia, fa), (ib, fb) = _payload(a), _payload(b)
    except READ_ERRORS as exc:
        return [f"cannot read both archives ({str(exc).strip()})"]
    diffs = [f"index.json {k}: {ia.get(k)!r} vs {ib.get(k)!r}"
             for k in sorted(set(ia) | set(ib)) if ia.get(k) != ib.get(k)]
    changed = sorted(p for p in set(fa) | set(fb) if fa.get(p) != fb.get(p))
    if changed:
        only = {p: "only in the first" if p not in fb else "only in the second" if p not in fa else ""
                for p in changed}
        shown = ", ".join(f"{p} ({only[p]})" if only[p] else p for p in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        diffs.append(f"payload: {len(changed)} {'entry differs' if len(changed) == 1 else 'entries differ'}: "
                     f"{shown}{more}")
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
                first.notes.append(f"{number} has the same payload in other bytes (recompressed or rebuilt): "
                                   f"kept {first.channel}'s")
            elif keep_first and not any(d.startswith("index.json") for d in diffs):
                first.notes.append(f"--keep-first: {number} has another payload ({'; '.join(diffs)}); "
                                   f"kept {first.channel}'s")
            else:
                sources = {declared_source(first.path), declared_source(entry.path)}
                said = (f"    both declare source digest {short(sources.pop())}: the same source built twice into "
                        "other bytes (not reproducible) or one of them altered; the declaration proves neither\n"
                        if len(sources) == 1 and None not in sources else "")
                conflicts.append(f"  {entry.key[0]}/{entry.key[1]}:\n"
                                 f"    {first.channel}: {first.path} (sha256 {short(first.digest.sha256)})\n"
                                 f"    {number}: {entry.path} (sha256 {short(entry.digest.sha256)})\n"
                                 + "".join(f"    differs: {d}\n" for d in diffs) + said)
    if damaged:
        raise AirgapError("source channel(s) damaged; check them with ./airgap.sh verify DIR and rebuild or "
                          "copy them again:\n  " + "\n  ".join(damaged))
    if conflicts:
        raise AirgapError(f"{len(conflicts)} package(s) have the same file name but a different payload in two "
                          "channels; a mirror can hold only one, and merge never picks one by what the packages "
                          "declare. Build each package on one machine only, drop a channel, or, when you know "
                          "which copy is right, list its channel first and pass --keep-first (it takes the first "
                          "channel's copy where info/index.json agrees):\n" + "".join(conflicts).rstrip())
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
