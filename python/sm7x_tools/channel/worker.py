"""The build tool's process: rattler-build for one recipe (rattler_build.build_here), run by
the driver as the leader of its own process group (lifecycle.run_group).

    python -m sm7x_tools.channel.worker SPEC.json   (writes {"ok": true} or {"error": ...} to spec["result"])

Should the driver die without ending the group (SIGKILL), the kernel sends this process
SIGTERM (PR_SET_PDEATHSIG), and it ends its whole group: build scripts, cmake, nvcc.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_group(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)  # the build scripts and compilers: a chance to exit cleanly ...
    time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)  # ... then nothing of the group is left, this process included


def main(spec_path: str) -> int:
    # rattler-build hands its environment to the recipes' scripts: no source-tree sm7x there
    os.environ.pop("PYTHONPATH", None)
    signal.signal(signal.SIGTERM, _end_group)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.environ.get("SM7X_BUILD_DRIVER") not in (None, str(os.getppid())):
        _end_group(signal.SIGTERM, None)  # the driver died before prctl took effect
    from . import BuildFailed
    from .rattler_build import build_here

    spec = json.loads(Path(spec_path).read_text())
    outcome: dict = {}

    def run() -> None:
        try:
            build_here(Path(spec["recipe"]), output_dir=Path(spec["output_dir"]), channels=spec["channels"],
                       variant_files=[Path(f) for f in spec["variant_files"]], logfile=Path(spec["logfile"]),
                       test=spec["test"], outputs=spec.get("outputs"), variant=spec.get("variant"))
            outcome["ok"] = True
        except BuildFailed as exc:
            outcome["error"] = str(exc)
        except BaseException as exc:  # reported to the driver, which says it
            outcome["error"] = f"the build process failed: {type(exc).__name__}: {exc}"

    # rattler-build blocks in native code; the main thread stays in Python so that the
    # SIGTERM handler above runs at once
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    Path(spec["result"]).write_text(json.dumps(outcome))
    return 0 if outcome.get("ok") else 1


if __name__ == "__main__":
    from ..envs import exit_now

    exit_now(main(sys.argv[1]))
