"""Regenerate the audit's data files from an installed torch (and abi3info).

    python -m sm7x.audit.gen_tables [--torch-include DIR] [--check]

- ``torch_shims.json``: every C shim torch declares in its shim headers
  (``torch/csrc/stable/c/*.h``, ``torch/csrc/inductor/aoti_torch/c/*.h``,
  ``torch/csrc/inductor/aoti_torch/generated/c_shim_*.h``) with the torch version that
  introduced it, read from the ``#if TORCH_FEATURE_VERSION >= TORCH_VERSION_X_Y_Z`` guards
  around it. Declarations outside any version guard predate the guards (torch added them
  in 2.10 and guards every later addition): they get the *baseline*, one minor below the
  lowest ``TORCH_VERSION_*`` macro in ``torch/csrc/stable/version.h`` (2.9: "2.9 or
  older"). ``#ifdef USE_CUDA`` / ``USE_XPU`` and device-specific headers mark the device
  library a shim lives in (libtorch_cuda.so ...). When torch's libraries lie next to the
  headers, the C shim names they export without declaring them are recorded too.
- ``py_limited_api.json``: the CPython limited API / stable ABI symbols with the Python
  version that added them, from abi3info (a dependency of abi3audit), so the audit can
  tell limited from non-limited imports without abi3audit installed.

The audit reads these files (``sm7x.audit.tables``); ``--torch-shims-header DIR`` makes
it parse headers at run time with the same code instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TORCH_TABLE = HERE / "torch_shims.json"
PY_TABLE = HERE / "py_limited_api.json"

# Relative to the include root (the directory holding torch/).
HEADER_GLOBS = (
    "torch/csrc/stable/c/*.h",
    "torch/csrc/inductor/aoti_torch/c/*.h",
    "torch/csrc/inductor/aoti_torch/generated/c_shim_*.h",
)
# The libtorch stable ABI proper (torch/csrc/stable builds on these); the other headers
# hold AOTInductor's device and fallback-op shims, C functions as well but outside it.
STABLE_SURFACE = {
    "torch/csrc/stable/c/shim.h",
    "torch/csrc/inductor/aoti_torch/c/shim.h",
    "torch/csrc/inductor/aoti_torch/c/shim_deprecated.h",
    "torch/csrc/inductor/aoti_torch/generated/c_shim_aten.h",
}
DEVICE_OF_HEADER = {"cuda": "cuda", "xpu": "xpu", "mps": "mps"}
DEVICE_OF_MACRO = {"USE_CUDA": "cuda", "USE_ROCM": "cuda", "USE_XPU": "xpu", "USE_MPS": "mps"}

_VERSION_GUARD = re.compile(
    r"^TORCH_FEATURE_VERSION\s*>=\s*TORCH_VERSION_(\d+)_(\d+)_(\d+)$")
_VERSION_MACRO = re.compile(r"#\s*define\s+TORCH_VERSION_(\d+)_(\d+)_(\d+)\b")
_DIRECTIVE = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif|else|endif|define)\b\s*(.*)$")
_DECL = re.compile(r"AOTI_TORCH_EXPORT\s+[\w\s:*&<>,]*?\b([A-Za-z_]\w*)\s*\(")
_IGNORED_CONDS = {"__cplusplus", "defined(__cplusplus)"}


def find_include_root(start: str | Path | None = None) -> Path:
    """The directory holding torch/csrc/... for DIR (torch's package dir, its include/
    dir, or the include root itself); without DIR, the installed torch, found without
    importing it."""
    if start is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("torch is not installed here; pass its include directory")
        start = Path(list(spec.submodule_search_locations)[0])
    start = Path(start)
    for cand in (start, start / "include", start / "torch" / "include", start.parent):
        if (cand / "torch/csrc/inductor/aoti_torch/c/shim.h").is_file():
            return cand
    raise FileNotFoundError(
        f"no torch/csrc/inductor/aoti_torch/c/shim.h under {start} (or its include/)")


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def parse_header(text: str, rel: str) -> dict[str, dict]:
    """Shim name -> {since: (maj, min) or None, device, conditions, deprecated} for one
    header's ``AOTI_TORCH_EXPORT`` declarations, tracking the #if stack around each."""
    lines = _strip_comments(text).replace("\\\n", " ").split("\n")
    stack: list[dict] = []  # {cond, negated, version, device, ignore}
    header_device = next((d for k, d in DEVICE_OF_HEADER.items()
                          if Path(rel).stem.endswith("_" + k)), None)
    out: dict[str, dict] = {}
    chunk: list[str] = []

    def flush():
        body = "\n".join(chunk)
        chunk.clear()
        version = max((e["version"] for e in stack if e["version"] and not e["negated"]),
                      default=None)
        device = next((e["device"] for e in stack if e["device"] and not e["negated"]),
                      header_device)
        conds = [("!" if e["negated"] else "") + e["cond"] for e in stack
                 if not e["ignore"] and not (e["version"] and not e["negated"])
                 and not (e["device"] and not e["negated"])]
        for m in _DECL.finditer(body):
            before = body[:m.start()]
            tail = before[before.rfind(";") + 1:]
            out.setdefault(m.group(1), {
                "since": version, "device": device, "conditions": conds,
                "deprecated": "[[deprecated" in tail,
            })

    pending_guard: str | None = None
    for line in lines:
        d = _DIRECTIVE.match(line)
        if not d:
            chunk.append(line)
            continue
        flush()
        kind, arg = d.group(1), d.group(2).strip()
        if kind == "define":
            # `#ifndef X` directly followed by `#define X` is an include guard
            if pending_guard and arg.split()[:1] == [pending_guard] and stack:
                stack[-1]["ignore"] = True
            pending_guard = None
            continue
        pending_guard = None
        if kind == "if":
            stack.append(_entry(arg, negated=False))
        elif kind in ("ifdef", "ifndef"):
            stack.append(_entry(f"defined({arg})", negated=kind == "ifndef", macro=arg))
            pending_guard = arg if kind == "ifndef" else None
        elif kind == "elif" and stack:
            stack[-1] = _entry(arg, negated=False)
        elif kind == "else" and stack:
            stack[-1]["negated"] = not stack[-1]["negated"]
        elif kind == "endif" and stack:
            stack.pop()
    flush()
    return out


def _entry(cond: str, negated: bool, macro: str | None = None) -> dict:
    v = _VERSION_GUARD.match(cond)
    name = macro or (re.fullmatch(r"defined\s*\(?\s*(\w+)\s*\)?", cond) or [None, None])[1]
    return {
        "cond": cond,
        "negated": negated,
        "version": (int(v.group(1)), int(v.group(2))) if v else None,
        "device": DEVICE_OF_MACRO.get(name or ""),
        "ignore": cond in _IGNORED_CONDS or name == "__cplusplus",
    }


def known_versions(root: Path) -> list[tuple[int, int]]:
    vh = root / "torch/csrc/stable/version.h"
    text = vh.read_text() if vh.is_file() else ""
    return sorted({(int(a), int(b)) for a, b, _ in _VERSION_MACRO.findall(text)})


def torch_version_of(root: Path) -> str | None:
    for cand in (root.parent / "version.py", root / "torch/version.py"):
        if cand.is_file():
            m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", cand.read_text(), re.M)
            if m:
                return m.group(1)
    return None


def _exported_shims(lib: Path) -> set[str]:
    from ._elf import ElfError, read_elf

    try:
        return {s for s in read_elf(lib).exports if re.match(r"(aoti_torch|torch)_", s)}
    except ElfError:
        return set()


def build_torch_table(include: str | Path | None = None, check_libs: bool = True) -> dict:
    root = find_include_root(include)
    versions = known_versions(root)
    lowest = versions[0] if versions else (2, 10)
    baseline = (lowest[0], lowest[1] - 1)
    symbols: dict[str, dict] = {}
    headers = []
    for pattern in HEADER_GLOBS:
        for h in sorted(root.glob(pattern)):
            rel = h.relative_to(root).as_posix()
            parsed = parse_header(h.read_text(errors="replace"), rel)
            if not parsed:
                continue
            headers.append(rel)
            for name, info in parsed.items():
                since = info["since"] or baseline
                rec = {
                    "since": f"{since[0]}.{since[1]}",
                    "guarded": info["since"] is not None,
                    "header": rel,
                    "surface": "stable" if rel in STABLE_SURFACE else "aoti",
                }
                if info["device"]:
                    rec["device"] = info["device"]
                if info["conditions"]:
                    rec["conditions"] = info["conditions"]
                if info["deprecated"]:
                    rec["deprecated"] = True
                old = symbols.get(name)
                if old is None or _v(rec["since"]) < _v(old["since"]):
                    symbols[name] = rec
    table = {
        "generated_by": "python -m sm7x.audit.gen_tables",
        "torch": torch_version_of(root),
        "headers": headers,
        "versions": [f"{a}.{b}" for a, b in versions],
        "baseline": f"{baseline[0]}.{baseline[1]}",
        "baseline_meaning": (
            f"declared outside any TORCH_VERSION guard: present in torch "
            f"{baseline[0]}.{baseline[1]} or older"),
        "symbols": dict(sorted(symbols.items())),
        "undeclared_exports": [],
    }
    if check_libs:
        libdir = root.parent / "lib"
        exported: set[str] = set()
        checked = {}
        for lib in ("libtorch_cpu.so", "libtorch_cuda.so", "libtorch_xpu.so"):
            if (libdir / lib).is_file():
                names = _exported_shims(libdir / lib)
                checked[lib] = len(names)
                exported |= names
        if checked:
            table["libs_checked"] = checked
            table["undeclared_exports"] = sorted(exported - symbols.keys())
    return table


def _v(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split("."))


def build_py_table() -> dict:
    try:
        import abi3info
    except ImportError as exc:
        raise SystemExit("gen_tables needs abi3info (pip install abi3audit)") from exc
    by_version: dict[str, list[str]] = {}
    for obj in list(abi3info.FUNCTIONS.values()) + list(abi3info.DATAS.values()):
        by_version.setdefault(str(obj.added), []).append(obj.symbol.name)
    from importlib.metadata import version

    return {
        "generated_by": "python -m sm7x.audit.gen_tables",
        "source": f"abi3info {version('abi3info')}",
        "added": {k: sorted(set(v)) for k, v in sorted(by_version.items(), key=lambda kv: _v(kv[0]))},
    }


def coverage(table: dict) -> str:
    syms = table["symbols"]
    by = {}
    for rec in syms.values():
        key = (rec["since"], rec["surface"])
        by[key] = by.get(key, 0) + 1
    lines = [f"torch {table['torch']}: {len(syms)} shims from {len(table['headers'])} headers"]
    for (since, surface), n in sorted(by.items(), key=lambda kv: (_v(kv[0][0]), kv[0][1])):
        label = f"<={since}" if since == table["baseline"] else since
        lines.append(f"  {label:>6} {surface:6} {n}")
    if table.get("libs_checked"):
        libs = ", ".join(f"{k} ({v})" for k, v in table["libs_checked"].items())
        lines.append(f"  C shims exported by {libs}; exported but declared in no shim "
                     f"header: {len(table['undeclared_exports'])}")
    return "\n".join(lines)


def _dump(obj: dict) -> str:
    """JSON with one line per symbol (or per version), so regenerations diff well."""
    parts = []
    for key, val in obj.items():
        if key in ("symbols", "added") and isinstance(val, dict):
            inner = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in val.items())
            parts.append(f" {json.dumps(key)}: {{\n{inner}\n }}")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(val)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sm7x.audit.gen_tables", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-include", metavar="DIR",
                    help="torch's package or include directory (default: the installed torch)")
    ap.add_argument("--check", action="store_true",
                    help="compare with the committed files instead of writing them")
    ap.add_argument("--only", choices=("torch", "python"), help="regenerate one file only")
    args = ap.parse_args(argv)
    outputs = []
    if args.only in (None, "torch"):
        table = build_torch_table(args.torch_include)
        print(coverage(table))
        outputs.append((TORCH_TABLE, _dump(table)))
    if args.only in (None, "python"):
        py = build_py_table()
        print(f"python limited API: {sum(map(len, py['added'].values()))} symbols "
              f"({py['source']})")
        outputs.append((PY_TABLE, _dump(py)))
    stale = []
    for path, text in outputs:
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)} (run python -m sm7x.audit.gen_tables)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
