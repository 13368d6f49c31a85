"""./build.sh: build the sm7x channel (bootstrap channel first when needed).

    ./build.sh                      default variants (variants/default.yaml)
    ./build.sh --variants sm75      a site-specific variant file, by name or path
    ./build.sh --channel URL        build against a conda-forge mirror, no bootstrap
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from rich.table import Table

from .. import REPO, STATE, bootstrap
from ..ui import console
from . import BuildFailed, publish, read_stamp, records, rattler_build, variants
from .digest import channel_stamp, source_digest

RECIPE = REPO / "recipe" / "recipe.yaml"
OUTPUT = REPO / "channel"


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
    try:
        variant_files = variants.resolve(args.variants or ["default"])
        variants.check(variant_files, bootstrap=not args.channel)
        if args.channel:
            channels = args.channel
        else:
            channels = [bootstrap.ensure(force=args.force).as_uri()]
        if args.bootstrap_only:
            return 0
        out = (REPO / args.output).resolve()
        source = source_digest(args.channel or [read_stamp(bootstrap.CHANNEL) or ""])
        os.environ["SM7X_SOURCE_DIGEST"] = source  # recorded in each package's about.json
        want = channel_stamp(source, variant_files, channels)
        if not args.force and read_stamp(out) == want:
            console.print(f"[green]sm7x channel up to date[/] ({out})")
        else:
            build_main(variant_files, channels, out, want, test=not args.no_test)
        summary(out, channels, time.monotonic() - start)
        return 0
    except BuildFailed as exc:
        console.print(f"[bold red]build failed:[/] {exc}")
        console.print("[red]the channel was left as it was before this build[/]")
        return 1
    except KeyboardInterrupt:
        console.print("[red]interrupted; the channel was left as it was before this build[/]")
        return 130


def build_main(variant_files, channels, out, stamp, test=True):
    console.rule("sm7x packages")
    work = STATE / "build" / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = STATE / "build" / "build.log"  # kept after the build, for reading what ran
    log.unlink(missing_ok=True)
    rattler_build.build(RECIPE, output_dir=work, channels=[work.as_uri(), *channels],
                        variant_files=variant_files, logfile=log, test=test)
    publish(work, out, stamp)
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
                  f"  pixi init --channel {out.as_uri()} " + " ".join(f"--channel {c}" for c in channels) + " && pixi add sm7x")


if __name__ == "__main__":
    sys.exit(main())
