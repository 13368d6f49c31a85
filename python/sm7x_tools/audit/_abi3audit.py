"""abi3audit on one shared object (ImportError when it is not installed).

abi3audit (pinned 0.0.26 in tests/requirements.txt) has no public Python API; these are
the modules its CLI uses. It reads .symtab as well as .dynsym and knows the version that
added each limited-API symbol (abi3info), so the audit has no limited-API list of its own.
"""

from __future__ import annotations

from pathlib import Path

try:
    import abi3audit
    from abi3audit._audit import audit
    from abi3audit._extract import SharedObjectExtractor, SharedObjectSpec
    from abi3info.models import PyVersion
except ImportError as exc:
    raise ImportError(f"abi3audit is not installed or not usable: {exc}") from exc

_VERSION = getattr(abi3audit, "__version__", "?")


def run_abi3audit(path: Path, python_min: tuple[int, int]) -> tuple[str, list[str], dict[str, str]]:
    """(checker, non-limited symbols, {limited symbol: version} newer than python_min)."""
    non_abi3: set[str] = set()
    newer: dict[str, str] = {}
    for so in SharedObjectExtractor(SharedObjectSpec(str(path))):
        result = audit(so, assume_minimum_abi3=PyVersion(*python_min))
        non_abi3 |= {s.name for s in result.non_abi3_symbols}
        newer |= {o.symbol.name: str(o.added) for o in result.future_abi3_objects}
    return f"abi3audit {_VERSION}", sorted(non_abi3), dict(sorted(newer.items()))
