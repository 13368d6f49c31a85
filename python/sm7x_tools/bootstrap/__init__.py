"""The offline bootstrap channel: conda-forge's names, repacked from what is reachable
(README.md here; the repack recipes are under recipes/, their pinned downloads are
fetched by inputs.py).

Rebuilt only when its inputs change: the digest of recipes/, this module, the repack of
its packages (sm7x_tools.repro; file names relative to sm7x_tools/, so the tree may move)
and rattler-build's version is stored in the channel, and a matching channel is reused as
it is.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from rattler_build import rattler_build_version

from .. import STATE
from ..channel import publish, rattler_build, read_stamp
from ..hashing import tree_digest
from ..repro import machine_paths, source_date_epoch
from ..repro.normalize import normalize_channel
from ..ui import console
from . import inputs

RECIPES = Path(__file__).resolve().parent / "recipes"
# not "channel": conda names a file:// channel after its last path part, and its plans
# would show ./channel's packages and these alike as channel/...
CHANNEL = STATE / "bootstrap" / "sm7x-bootstrap"
OLD_CHANNEL = STATE / "bootstrap" / "channel"  # the name before: removed once this one is built
# build order: later recipes solve against packages of earlier ones
BOOTSTRAP_RECIPES = ["build-tools", "compilers", "sysroot", "cuda", "python", "python-build", "pybind11",
                     "torch-deps", "pytorch"]


REPRO = Path(__file__).resolve().parents[1] / "repro"  # how its packages are repacked


def digest() -> str:
    # names relative to sm7x_tools/, which holds all three: no checkout's path in it
    return tree_digest([RECIPES, Path(__file__), REPRO], REPRO.parent, extra=[rattler_build_version()])


def ensure(force: bool = False) -> Path:
    want = digest()
    if not force and read_stamp(CHANNEL) == want:
        console.print(f"[green]bootstrap channel up to date[/] ({CHANNEL})")
        return CHANNEL
    start = time.monotonic()
    console.rule("bootstrap channel")
    recipes = [RECIPES / name / "recipe.yaml" for name in BOOTSTRAP_RECIPES]
    inputs.fetch(inputs.collect_pins(recipes), log=console.print)
    work = STATE / "bootstrap" / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    logfile = work / "build.log"
    epoch = source_date_epoch([RECIPES, Path(__file__), REPRO])
    for recipe in recipes:
        rattler_build.build(recipe, output_dir=work, channels=[work.as_uri()], variant_files=[], logfile=logfile)
        # repacked before the next recipes install them: their rendered recipes record the
        # packages they were built with (sha256, md5, time), which must be the published ones
        normalize_channel(work, epoch=epoch, paths=machine_paths(work))
    publish(work, CHANNEL, want, epoch)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(OLD_CHANNEL, ignore_errors=True)
    console.print(f"[green]bootstrap channel built[/] in {time.monotonic() - start:.0f} s: {CHANNEL}")
    return CHANNEL
