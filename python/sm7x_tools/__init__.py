"""sm7x site tooling: builds, carries and checks channels of the sm7x recipe.

Not part of the sm7x packages (the runtime never imports it): the entry scripts run it
from the source tree, `PYTHONPATH=python python -m sm7x_tools.<job>`, in the pinned
tools venv (requirements.txt, venv.sh). It only consumes recipe/recipe.yaml, variants/
and channel directories. One subpackage per job:

    channel     ./build.sh: variant checks, rattler-build, publish + index, source digest
    bootstrap   the offline bootstrap channel: pinned input downloads + repack recipes
    airgap      ./airgap.sh: bundle, verify, merge
    envs        solve/install environments with py-rattler; the env benchmark (envs.bench)
    repro       reproducible packages: the repack ./build.sh publishes with, the rebuild
                check (build twice, compare) and package comparison
    audit       the ABI audit of native libraries; the recipe runs it while packaging, so
                it and this file are in the packages' source digest (channel/digest.py):
                keep this file small and stdlib-only

and what they share: hashing (the one file hasher), ui (the console).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STATE = REPO / ".sm7x"  # everything the tools cache; safe to delete


class ToolError(Exception):
    """A user-facing failure: the message names the problem and how to fix it."""
