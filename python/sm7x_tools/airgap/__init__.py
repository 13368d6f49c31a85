"""Air-gapped installs: bundle solved environments, verify channels, merge channels.

Our users' GPU nodes cannot reach any channel. `bundle` solves here, for the target node's
virtual packages (CEP 46 `__cuda_arch` differs between a login node and a GPU node), and
writes a self-contained channel subset with a pixi lock, conda explicit files and a
manifest. `verify` checks a bundle or any channel directory against every independent
record of its hashes before it is carried across the gap. `merge` joins the channels that
a CI matrix built on several machines into one.

This module holds what the three share: user errors, channel directories, and the atomic
output directory (OUT.partial, renamed into place only when everything worked). Solving
and virtual packages are sm7x_tools.envs', hashing is sm7x_tools.hashing's.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from urllib.parse import unquote, urlparse

import yaml

from .. import REPO, ToolError
from ..channel import SUBDIRS, index_dir, is_channel, replace_dir
from ..envs import RATTLER_ERRORS

FORMAT = "sm7x-airgap-bundle"
FORMAT_VERSION = 1
PACKAGE_SUFFIXES = (".conda", ".tar.bz2")
SHA256SUMS = "SHA256SUMS"  # coreutils format, for the air-gapped side
# what reading a damaged file raises
READ_ERRORS = (*RATTLER_ERRORS, OSError, ValueError)


class AirgapError(ToolError):
    """A user-facing failure: the message says what was wrong and how to fix it."""


def short(sha: str | None) -> str:
    return f"{sha[:12]}…" if sha else "(none)"


def is_package(path: Path) -> bool:
    return path.is_file() and path.name.endswith(PACKAGE_SUFFIXES)


def subdirs(channel: Path) -> list[Path]:
    """The subdirs of a channel directory: the standard ones and any other with a repodata.json."""
    found = {channel / s for s in SUBDIRS if (channel / s).is_dir()}
    found |= {p.parent for p in channel.glob("*/repodata.json")}
    return sorted(found)


def url_to_path(url: str) -> Path:
    parsed = urlparse(url)
    if parsed.scheme != "file":
        raise AirgapError(f"{url} is not a local file:// URL; pass channel directories, not remote channels")
    return Path(unquote(parsed.path))


def index(channel: Path) -> None:
    """Index with rattler (monolithic repodata.json in every subdir) and drop its empty scratch dir."""
    index_dir(channel)
    scratch = channel / ".tmp"
    if scratch.is_dir() and not any(scratch.iterdir()):
        scratch.rmdir()


def tool_versions() -> dict:
    """sm7x's version (the product recipe's context) and the py-rattler versions, for the manifest."""
    sm7x = yaml.safe_load((REPO / "recipe" / "recipe.yaml").read_text())["context"]["version"]
    return {"sm7x": sm7x, "py-rattler": version("py-rattler"), "py-rattler-build": version("py-rattler-build")}


# --- atomic output -----------------------------------------------------------------------

def _replaceable(out: Path, marker) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise AirgapError(f"{out} exists and is not a directory; choose another output path")
    if any(out.iterdir()) and not marker(out):
        raise AirgapError(f"{out} exists and is not one this tool wrote; refusing to replace it. "
                          "Choose a new output path or remove it first")


@contextmanager
def staged(out: Path, marker):
    """Yield OUT.partial; on success replace OUT with it, on any failure remove it.

    `marker(path)` says whether an existing OUT is ours to replace (never someone's home).
    """
    _replaceable(out, marker)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_dir(tmp, out)
    finally:  # failed or interrupted: the partial output goes
        shutil.rmtree(tmp, ignore_errors=True)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
