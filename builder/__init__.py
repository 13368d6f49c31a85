"""The sm7x channel builder: bootstrap channel, rattler-build, channel publishing.

Run it through ./build.sh, which installs the pinned tools (requirements.txt) first.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE = REPO / ".sm7x"  # everything the build caches; safe to delete


class BuildFailed(Exception):
    """A build step failed; the message names the problem and how to fix it."""


def exit_now(code: int) -> None:
    """Leave a command that used py-rattler: its runtime can abort while the interpreter
    shuts down right after a solve (DESIGN.md), so flush and skip the finalizers."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
