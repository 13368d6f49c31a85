"""Make the source tree's sm7x importable when no installed sm7x is.

An installed sm7x (a conda env, a wheel) is tested as it is; otherwise python/ goes first
on sys.path, and on PYTHONPATH so subprocesses started by tests see the same package.
"""

import importlib.util
import os
import sys
from pathlib import Path

if importlib.util.find_spec("sm7x") is None:
    _src = str(Path(__file__).resolve().parents[1] / "python")
    sys.path.insert(0, _src)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_src, os.environ.get("PYTHONPATH")) if p
    )
