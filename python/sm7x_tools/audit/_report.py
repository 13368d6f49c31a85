"""Render records: aligned plain text (one row per file, details below it) or JSON."""

from __future__ import annotations

import json
from typing import TextIO

from ._core import ERROR, Record


def cells(rec: Record) -> dict[str, str]:
    if rec.skipped:
        return {"torch": "-", "min": "-", "abi3": "-", "name": "-",
                "detail": f"skipped: {rec.skipped}"}
    if rec.error:
        return {"torch": ERROR, "min": "-", "abi3": "-", "name": "-", "detail": rec.error}
    t, py, a3 = rec.torch, rec.python, rec.abi3
    detail = []
    if t.uses_torch:
        detail.append(f"stable_shim={len(t.stable_shims)} unstable={len(t.unstable)}")
    if t.unstable:
        detail.append("e.g. " + "; ".join(_short(d) for d in t.unstable_demangled[:3]))
    if py.is_extension:
        kind = "pybind11 " if py.pybind11 else ""
        nl = py.non_limited
        api = ("API not checked" if nl is None else "limited API" if not nl else
               f"non-limited API ({', '.join(nl[:3])}{', ...' if len(nl) > 3 else ''})")
        detail.append(f"{kind}module {', '.join(py.init)}: {api}")
    if a3.status == "violations" and a3.newer_than_min:
        detail.append("abi3 newer than target: " + ", ".join(
            f"{k} ({v})" for k, v in list(a3.newer_than_min.items())[:3]))
    detail += t.notes + rec.name["notes"] + [f"FAIL: {f}" for f in rec.failures]
    abi3 = {"ok": "ok", "n/a": "n/a", "violations": "VIOLATIONS", "error": "ERROR"}[a3.status]
    return {"torch": t.verdict, "min": t.min_torch or ("build's" if t.verdict == "UNSTABLE" else "-"),
            "abi3": abi3, "name": "ok" if rec.name["ok"] else "MISNAMED",
            "detail": "\n".join(detail)}


def _short(s: str, n: int = 90) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def summary(records: list[Record]) -> str:
    bad = [r for r in records if not r.ok]
    counted = [r for r in records if not r.skipped]
    return (f"{len(counted)} file(s) audited, {len(bad)} failing"
            + (f", {len(records) - len(counted)} skipped" if len(counted) != len(records)
               else ""))


def render_json(records: list[Record], out: TextIO, meta: dict) -> None:
    json.dump({**meta, "ok": all(r.ok for r in records),
               "files": [r.to_dict() for r in records]}, out, indent=2)
    out.write("\n")


def render_text(records: list[Record], out: TextIO) -> None:
    print(f"{'TORCH':9} {'MIN':11} {'ABI3':10} {'NAME':8} FILE", file=out)
    for r in records:
        c = cells(r)
        mark = "  " if r.ok else "! "
        print(f"{c['torch']:9} {c['min']:11} {c['abi3']:10} {c['name']:8} {mark}{r.file}",
              file=out)
        for line in c["detail"].splitlines():
            print(f"{'':42}  - {line}", file=out)
    print(summary(records), file=out)
