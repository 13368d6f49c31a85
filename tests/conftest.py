"""Make the source tree's sm7x importable when no installed sm7x is, and the site tooling
(python/sm7x_tools, which is never installed) always.

An installed sm7x (a conda env, a wheel) is tested as it is; otherwise python/ goes first
on sys.path, and on PYTHONPATH so subprocesses started by tests see the same package.
With sm7x installed, python/ goes last, where only sm7x_tools is found in it; tests run
the tools in subprocesses through toolrun.py, as the entry scripts do.
"""

import importlib.util
import os
import sys
from pathlib import Path

_src = str(Path(__file__).resolve().parents[1] / "python")
if importlib.util.find_spec("sm7x") is None:
    sys.path.insert(0, _src)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_src, os.environ.get("PYTHONPATH")) if p
    )
elif _src not in sys.path:
    sys.path.append(_src)
