"""The offline bootstrap channel: conda-forge's names, repacked from what is reachable.

Rebuilt only when its inputs change: the digest of recipe/bootstrap/ and the tool
versions is stored in the channel, and a matching channel is reused as it is.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from rattler_build import rattler_build_version

from . import REPO, STATE, channel, inputs, rattler
from .digest import tree_digest
from .ui import console

RECIPES = REPO / "recipe" / "bootstrap"
CHANNEL = STATE / "bootstrap" / "channel"
# build order: later recipes solve against packages of earlier ones
BOOTSTRAP_RECIPES = ["build-tools", "compilers", "cuda", "python", "pybind11", "torch-deps", "pytorch"]


def digest() -> str:
    return tree_digest([RECIPES, Path(__file__)], extra=[rattler_build_version()])


def ensure(force: bool = False) -> Path:
    want = digest()
    if not force and channel.read_stamp(CHANNEL) == want:
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
    for recipe in recipes:
        rattler.build(recipe, output_dir=work, channels=[work.as_uri()], variant_files=[], logfile=logfile)
    channel.publish(work, CHANNEL, want)
    shutil.rmtree(work, ignore_errors=True)
    console.print(f"[green]bootstrap channel built[/] in {time.monotonic() - start:.0f} s: {CHANNEL}")
    return CHANNEL
