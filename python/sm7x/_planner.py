"""``sm7x._sched``, the split-KV planner of the serving calls: a pybind11 module built once
per Python (conda package sm7x-ext; ``pip install .`` builds it), so an environment can
have sm7x without it (another Python's sm7x-ext, or a source tree on PYTHONPATH that was
never built). Torch-free, so that ``python -m sm7x doctor`` can ask too."""

from __future__ import annotations

import sys

from ._install_hints import install_hint

PACKAGE = "sm7x-ext"


def sched_module():
    """sm7x._sched, or an ImportError that says what is missing and how to get it."""
    try:
        from . import _sched
    except ImportError as e:
        raise ImportError(
            f"sm7x's serving calls (paged KV, split-KV decode, the vLLM backend) plan with "
            f"sm7x._sched, which is not importable for this Python "
            f"({sys.version_info.major}.{sys.version_info.minor}): {e}; {install_hint(PACKAGE)}"
        ) from e
    return _sched
