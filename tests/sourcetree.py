"""The source tree in tests: a copy of it, and the site tooling run in it as ./build.sh and
./airgap.sh run it (`python -m sm7x_tools.<job>` with PYTHONPATH=<tree>/python)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from sm7x_tools import REPO


def copy_tree(dest: Path) -> Path:
    """The files a build would see (tracked, and new ones git does not ignore) copied to dest."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    return dest


def run_tool(module: str, *args, tree: Path = REPO, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    """`module` (e.g. sm7x_tools.airgap) with args, in `tree` (the repository or a copy_tree)."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=tree, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(tree / "python"), **env})
