"""./build.sh: build the sm7x channel (bootstrap channel first when needed).

    ./build.sh                      default variants (variants/default.yaml)
    ./build.sh --variants sm75      a site-specific variant file, by name or path
    ./build.sh --channel URL        build against a conda-forge mirror, no bootstrap

./channel is replaced only whole and is complete at every instant (publish in
channel/__init__.py). A build that is killed leaves no process running and the previous
channel in place; the next start removes what it left and says so (lifecycle.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from rich.table import Table

from .. import REPO, STATE, bootstrap
from ..ui import console
from . import STAMP, BuildFailed, lifecycle, publish, read_stamp, records, rattler_build, variants
from ..repro import source_date_epoch
from .digest import SOURCES, channel_stamp, source_digest

RECIPE = REPO / "recipe" / "recipe.yaml"
OUTPUT = REPO / "channel"
LOCK = STATE / "build.lock"
# the work trees of the two builds, removed when a build ends (a failed bootstrap build keeps
# its work tree, where its log is, until the next start)
WORK_DIRS = [STATE / "build" / "work", STATE / "bootstrap" / "work"]


def parse(argv):
    ap = argparse.ArgumentParser(prog="./build.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", action="append", default=[], metavar="FILE",
                    help="variant file under variants/ (name or path); repeatable; default: default")
    ap.add_argument("--channel", action="append", default=[], metavar="URL",
                    help="build against this channel (e.g. a conda-forge mirror) instead of the bootstrap channel")
    ap.add_argument("--output", default=str(OUTPUT), help="channel directory to (re)write (default: ./channel)")
    ap.add_argument("--force", action="store_true", help="rebuild even if nothing changed")
    ap.add_argument("--bootstrap-only", action="store_true", help="only build the bootstrap channel")
    ap.add_argument("--no-test", action="store_true", help="skip the recipe's package tests")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    start = time.monotonic()
    # rattler-build hands its environment to the recipes' build and test scripts: the
    # tools' own path (./build.sh sets it) must not put the source tree's sm7x there
    os.environ.pop("PYTHONPATH", None)
    # not resolve(): a symlinked channel is flipped in place, never followed
    out = Path(os.path.abspath(REPO / args.output))
    before = read_stamp(out)
    try:
        with lifecycle.interruptible(), lifecycle.build_lock(LOCK):
            lifecycle.clean_leftovers(WORK_DIRS, [out, bootstrap.CHANNEL], rattler_build.GROUP_FILE,
                                      say=lambda text: console.print(f"[yellow]{text}[/]"))
            variant_files = variants.resolve(args.variants or ["default"])
            variants.check(variant_files, bootstrap=not args.channel)
            if args.channel:
                channels = args.channel
            else:
                try:
                    channels = [bootstrap.ensure(force=args.force).as_uri()]
                except (KeyboardInterrupt, lifecycle.Interrupted):
                    shutil.rmtree(WORK_DIRS[1], ignore_errors=True)  # its own code only cleans up on success
                    raise
            if args.bootstrap_only:
                return 0
            source = source_digest(args.channel or [read_stamp(bootstrap.CHANNEL) or ""])
            os.environ["SM7X_SOURCE_DIGEST"] = source  # recorded in each package's about.json
            want = channel_stamp(source, variant_files, channels)
            if not args.force and read_stamp(out) == want:
                console.print(f"[green]sm7x channel up to date[/] ({out})")
            else:
                epoch = source_date_epoch([REPO / s for s in SOURCES])  # the packages' time (sm7x_tools.repro)
                build_main(variant_files, channels, out, want, epoch, test=not args.no_test)
        summary(out, channels, time.monotonic() - start)
        return 0
    except BuildFailed as exc:
        console.print(f"[bold red]build failed:[/] {exc}")
        console.print(f"[red]{left_as_it_was(out, before)}[/]")
        return 1
    except (KeyboardInterrupt, lifecycle.Interrupted) as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        console.print(f"[red]interrupted ({signal.Signals(signum).name}): {left_as_it_was(out, before)}[/]")
        return 128 + signum


def left_as_it_was(out: Path, before: str | None) -> str:
    """What a build that did not finish left, said from what is on disk (never assumed)."""
    now = read_stamp(out)
    name = os.path.relpath(out) if out.is_relative_to(Path.cwd()) else str(out)
    if now is None:
        state = f"no channel at {name}, as before" if before is None else f"{name} is MISSING (it had stamp {before[:12]}…)"
    elif now == before:
        when = datetime.datetime.fromtimestamp((out / STAMP).stat().st_mtime).strftime("%Y-%m-%d %H:%M")
        state = f"{name} unchanged (the build published {when}, stamp {now[:12]}…)"
    else:
        state = f"{name} was already replaced by this build, complete (stamp {now[:12]}…)"
    rest = lifecycle.leftovers(WORK_DIRS, [out, bootstrap.CHANNEL])
    return state + ("; partial output removed" if not rest else
                    f"; left for the next start to remove: {', '.join(map(str, rest))}")


def build_main(variant_files, channels, out, stamp, epoch, test=True):
    console.rule("sm7x packages")
    work = WORK_DIRS[0]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = STATE / "build" / "build.log"  # kept after the build, for reading what ran
    log.unlink(missing_ok=True)
    try:
        rattler_build.build(RECIPE, output_dir=work, channels=[work.as_uri(), *channels],
                            variant_files=variant_files, logfile=log, test=test)
        publish(work, out, stamp, epoch)
    finally:  # done, failed or interrupted: the work tree (up to about 1 GB) goes
        shutil.rmtree(work, ignore_errors=True)


def summary(out, channels, seconds):
    table = Table(title=f"sm7x channel: {out}")
    for col, just in (("package", "left"), ("version", "left"), ("build", "left"), ("subdir", "left"), ("size", "right")):
        table.add_column(col, justify=just)
    for r in records(out):
        table.add_row(r["name"], r["version"], r["build"], r["subdir"], f"{r['size'] / 1e6:.2f} MB")
    console.print(table)
    chans = " ".join(f"-c {c}" for c in [out.as_uri(), *channels])
    console.print(f"done in {seconds:.0f} s. Install with:\n"
                  f"  conda create -n sm7x --override-channels {chans} sm7x python=3.11\n"
                  f"  pixi init --channel {out.as_uri()} " + " ".join(f"--channel {c}" for c in channels) + " && pixi add sm7x\n"
                  "conda sees __cuda_arch only with the nvidia-virtual-packages plugin (conda install -n base "
                  "nvidia-virtual-packages); without it every node gets sm7x-fa2's fallback with both FA2 libraries.")


if __name__ == "__main__":
    sys.exit(main())
