"""Reproducible packages: two builds of one commit, in any directory and at any time, give
the same bytes for every .conda (`python -m sm7x_tools.repro`: check, compare).

What makes the bytes the same:
- the compilers (csrc/CMakeLists.txt, recipe/scripts/build_*.sh): source and conda prefix
  paths mapped away (-ffile-prefix-map), nvcc's anonymous-namespace names derived from the
  repository-relative path instead of the build directory, its temporaries named after the
  object instead of its process id;
- the packaging (normalize.py, run on every package that ./build.sh publishes, bootstrap
  included): rattler-build 0.73 as py-rattler-build drives it takes the wall clock for the
  archive member times and index.json, and records the build machine's directories, channel
  URLs, kernel and CPU in the metadata. Each package is repacked once, with the time
  SOURCE_DATE_EPOCH and those paths replaced by fixed names.

SOURCE_DATE_EPOCH is the commit time of the last commit that changed what the packages are
built from (so a commit that only edits the README changes no package), or the
environment's SOURCE_DATE_EPOCH when set.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .. import REPO, ToolError

# 1980-01-01: the earliest time a zip member can carry
ZIP_EPOCH = 315532800


def source_date_epoch(paths: list[Path], root: Path = REPO) -> int:
    """SOURCE_DATE_EPOCH for packages built from `paths`: the environment's, else the commit
    time of the last commit touching them, else (a tree without git, e.g. `git archive`,
    which stamps every file with the commit time) their newest modification time."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").strip():
        try:
            return int(os.environ["SOURCE_DATE_EPOCH"])
        except ValueError:
            raise ToolError(f"SOURCE_DATE_EPOCH={os.environ['SOURCE_DATE_EPOCH']!r} is not a number of "
                            f"seconds") from None
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct", "--", *map(str, paths)], cwd=root,
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0 and out.stdout.strip():
            return int(out.stdout.strip())
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    return max([int(f.stat().st_mtime) for f in files] + [ZIP_EPOCH])


def machine_paths(output_dir: Path, *trees: Path) -> dict[str, str]:
    """The build machine's directories that reach package metadata (channel URLs, rendered
    recipe), and the fixed names they are replaced by: the build's output directory, and
    the source trees (this one, where the bootstrap channel lives, and the one built)."""
    names = {}
    for path, name in [(output_dir, "${SM7X_OUTPUT}")] + [(t, "${SM7X_TREE}") for t in (REPO, *trees)]:
        for form in (Path(os.path.abspath(path)), Path(path).resolve()):  # as given, and without symlinks
            names.setdefault(str(form), name)
    return names
