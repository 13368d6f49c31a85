"""abi3audit's library API for one standalone .abi3.so (ImportError when it is missing).

abi3audit (pinned 0.0.26 in tests/requirements.txt) exposes no public Python API; its
modules ``_audit``, ``_extract`` and ``_object`` are what its CLI uses. If a later release
moves them, this falls back to ``python -m abi3audit --json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .tables import Version

try:
    import abi3audit
except ImportError as exc:
    raise ImportError("abi3audit is not installed") from exc

_VERSION = getattr(abi3audit, "__version__", "?")


def run_abi3audit(path: Path, python_min: Version) -> tuple[str, list[str], dict[str, str]]:
    """(checker, non-abi3 symbols, {limited symbol: version} newer than python_min)."""
    try:
        from abi3audit._audit import audit
        from abi3audit._extract import SharedObjectExtractor, SharedObjectSpec
        from abi3info.models import PyVersion
    except ImportError:
        return _run_cli(path, python_min)
    non_abi3: set[str] = set()
    newer: dict[str, str] = {}
    for so in SharedObjectExtractor(SharedObjectSpec(str(path))):
        result = audit(so, assume_minimum_abi3=PyVersion(*python_min))
        non_abi3 |= {s.name for s in result.non_abi3_symbols}
        newer |= {o.symbol.name: str(o.added) for o in result.future_abi3_objects}
    return f"abi3audit {_VERSION}", sorted(non_abi3), dict(sorted(newer.items()))


def _run_cli(path: Path, python_min: Version) -> tuple[str, list[str], dict[str, str]]:
    proc = subprocess.run(
        [sys.executable, "-m", "abi3audit", "--json", "--assume-minimum-abi3",
         f"{python_min[0]}.{python_min[1]}", str(path)],
        capture_output=True, text=True, timeout=300)
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise RuntimeError(f"abi3audit CLI failed: {proc.stderr.strip()[-500:]}") from exc
    non_abi3: set[str] = set()
    newer: dict[str, str] = {}

    def walk(obj):
        if isinstance(obj, dict):
            if "non_abi3_symbols" in obj:
                non_abi3.update(obj["non_abi3_symbols"])
                newer.update(obj.get("future_abi3_objects", {}))
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk(data)
    return f"abi3audit {_VERSION} (CLI)", sorted(non_abi3), dict(sorted(newer.items()))
