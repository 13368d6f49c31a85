"""The torch version that introduced each stable-ABI C shim.

The data is torch-abi-audit's (PyPI, MIT; pinned in tests/requirements.txt): PyTorch's own
manifest ``torch/csrc/stable/c/shim_function_versions.txt`` (shims added in 2.10 and
later) plus the shims present at v2.9.0, when the stable ABI shipped. The recipe audits
offline with only pyelftools, so ``torch_shims.json`` keeps a snapshot of it, refreshed
with ``python -m sm7x_tools.audit --update-shims write`` and compared with the installed
torch-abi-audit by tests/unit/test_audit.py. A shim in neither is "unknown" (newer than
the data): a --torch-target check fails it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TABLE = Path(__file__).resolve().parent / "torch_shims.json"

Version = tuple[int, int]

# the device library a shim lives in (libtorch_cuda.so ...), from its name
_DEVICE = re.compile(r"_(cuda|xpu|mps|sycl)(?=_|$)")


def parse_version(s: str) -> Version:
    parts = s.strip().lstrip("<=>v").split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


def device_of(name: str) -> str | None:
    m = None if name.startswith("aoti_torch_device_type_") else _DEVICE.search(name)
    return None if m is None else {"sycl": "xpu"}.get(m[1], m[1])


@dataclass(frozen=True)
class ShimTable:
    since_of: dict[str, Version]
    baseline: Version
    source: str

    def since(self, name: str) -> Version | None:
        return self.since_of.get(name)

    def label(self, v: Version | None) -> str:
        """'2.10', or '<=2.9' for the baseline (the release the stable ABI shipped in)."""
        if v is None:
            return "?"
        text = f"{v[0]}.{v[1]}"
        return f"<={text}" if v == self.baseline else text


@lru_cache(maxsize=None)
def shim_table() -> ShimTable:
    d = json.loads(TABLE.read_text())
    since = {n: parse_version(v) for v, names in d["since"].items() for n in names}
    return ShimTable(since, parse_version(d["baseline"]), f"{TABLE.name} ({d['source']})")


def from_torch_abi_audit() -> dict:
    """The table as torch_shims.json stores it, from the installed torch-abi-audit."""
    from importlib.metadata import version

    from torch_abi_audit import BASELINE_VERSION
    from torch_abi_audit.torch_versions import stable_shim_versions

    by: dict[str, list[str]] = {}
    for name, v in stable_shim_versions().items():
        by.setdefault(f"{v[0]}.{v[1]}", []).append(name)
    return {
        "source": f"torch-abi-audit {version('torch-abi-audit')}",
        "update": "python -m sm7x_tools.audit --update-shims write",
        "baseline": f"{BASELINE_VERSION[0]}.{BASELINE_VERSION[1]}",
        "since": {k: sorted(by[k]) for k in sorted(by, key=parse_version)},
    }


def dump(d: dict) -> str:
    """One line per version, so updates diff well."""
    since = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in d["since"].items())
    head = "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in d.items() if k != "since")
    return "{\n" + head + ' "since": {\n' + since + "\n }\n}\n"


def update(check: bool = False) -> int:
    """Rewrite torch_shims.json from the installed torch-abi-audit (or only compare)."""
    text = dump(from_torch_abi_audit())
    if check:
        same = TABLE.read_text() == text
        print(f"{TABLE.name}: {'up to date' if same else 'out of date'}")
        return 0 if same else 1
    TABLE.write_text(text)
    print(f"wrote {TABLE}")
    return 0
