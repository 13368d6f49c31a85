"""Helpers of the package tests: where the channel is, running an env's python."""

from __future__ import annotations

import os
import subprocess

from sm7x_tools import REPO
from sm7x_tools.bootstrap import CHANNEL as BOOTSTRAP

CHANNEL = REPO / "channel"
CHANNELS = [CHANNEL, BOOTSTRAP]


def run(env, *args, timeout=300):
    """Run the env's python with args, away from the source tree; return stdout."""
    proc = subprocess.run([str(env.python), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=env.prefix, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout
