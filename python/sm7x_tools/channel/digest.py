"""What the packages are built from: the source digest each package records, and the
stamp that says whether a channel directory is up to date."""

from __future__ import annotations

from pathlib import Path

from rattler_build import rattler_build_version

from .. import REPO
from ..hashing import tree_digest

# Everything the product recipe builds from, and nothing else: of the site tooling only
# the ABI audit, which recipe/scripts/audit_libs.sh runs from the source tree (with the
# package __init__ it imports); editing the rest of python/sm7x_tools changes no package.
# README.md: pyproject.toml's readme, which the sm7x package carries as its dist-info
# METADATA (two builds of different READMEs must not claim one source).
SOURCES = ["recipe/recipe.yaml", "recipe/scripts", "csrc", "python/sm7x", "patches", "pyproject.toml", "LICENSE",
           "README.md", "python/sm7x_tools/__init__.py", "python/sm7x_tools/audit"]
# what drives the build besides the sources (and repacks its packages: repro/): a change
# here rebuilds ./channel, but is not recorded in the packages
DRIVER = ["python/sm7x_tools/channel", "python/sm7x_tools/repro", "python/sm7x_tools/requirements.txt"]


def source_digest(toolchain: list[str], root: Path = REPO) -> str:
    """The `sm7x-source-digest` in every package's about.json (`airgap.sh merge` reads it).

    The same on every machine that builds this source with the same rattler-build against
    the same toolchain (`toolchain`: the channel URLs given, or the bootstrap channel's
    stamp; never a local path).
    """
    return tree_digest([root / s for s in SOURCES], root, extra=[rattler_build_version(), *toolchain])


def channel_stamp(source: str, variant_files: list[Path], channels: list[str], root: Path = REPO) -> str:
    """The channel is up to date when this is the stamp it was published with."""
    return tree_digest([root / s for s in DRIVER] + list(variant_files), root, extra=[source, *channels])
