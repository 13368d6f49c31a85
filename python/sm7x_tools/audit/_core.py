"""Per-file verdicts: torch ABI, lowest torch version, abi3, file name."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import shims
from ._elf import ElfError, ElfInfo, demangle, read_elf
from .shims import Version, device_of, parse_version

STABLE, UNSTABLE, NO_TORCH = "STABLE", "UNSTABLE", "NO-TORCH"
ERROR = "ERROR"

# --- torch -------------------------------------------------------------------------------

TORCH_LIB = re.compile(r"^lib(?:torch|c10)\w*\.so(?:\.[\w.]+)?$")
SHIM_NAME = re.compile(r"^(?:aoti_torch|torch)_\w+$")
# Itanium-mangled entities whose outermost namespace is c10, at, torch or caffe2
# (functions, data, vtables/typeinfo, thunks, guard variables, static locals).
MANGLED_TORCH = re.compile(
    r"^_Z(?:T[VIST]|GV|GR|Thn?\d+_|Tvn?\d+_n?\d+_|Z)?N[rVK]*[RO]?"
    r"(?:3c10|2at|5torch|6caffe2)(?=[0-9A-Z])")
DEMANGLED_TORCH = re.compile(
    r"^(?:(?:vtable|typeinfo|typeinfo name|VTT|guard variable|construction vtable|"
    r"(?:non-)?virtual thunk|covariant return thunk) (?:for|to) )?(?:c10|at|torch|caffe2)::")
# torch's Python bindings (libtorch_python.so): THPVariable_Wrap, THPVariableClass, ...
TORCH_PYTHON = re.compile(r"^(?:_Z\d+)?THP[A-Z]")
# C++ runtime names that are not torch's even when unversioned: std::, operator new/delete,
# __gnu_cxx::, __cxxabiv1::
CXX_RUNTIME = re.compile(
    r"^_Z(?:N[rVK]*|T[VIST]|GV)?(?:St|Sa|Sb|Ss|Si|So|Sd|9__gnu_cxx|10__cxxabiv1)|^_Z[nd][wal]")


@dataclass
class TorchResult:
    verdict: str
    stable_shims: list[str] = field(default_factory=list)
    unstable: list[str] = field(default_factory=list)
    unstable_demangled: list[str] = field(default_factory=list)
    min_torch: str | None = None
    by_version: dict[str, list[str]] = field(default_factory=dict)
    unknown_shims: list[str] = field(default_factory=list)
    dlsym_shims: list[str] = field(default_factory=list)
    device_shims: dict[str, list[str]] = field(default_factory=dict)
    needed_torch: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def uses_torch(self) -> bool:
        return self.verdict in (STABLE, UNSTABLE)


def torch_check(elf: ElfInfo, table: shims.ShimTable) -> TorchResult:
    needed_torch = [n for n in elf.needed if TORCH_LIB.match(n)]
    names = [i.name for i in elf.imports]
    dem = demangle(names)
    unstable: list[str] = []
    found: list[str] = []  # stable shims imported
    maybe_torch: list[str] = []
    # DT_NEEDED libraries that could provide unversioned symbols, other than torch's: when
    # there are none, an unversioned C import can only come from libtorch (or libc10)
    unversioned_others = [n for n in elf.needed
                          if n not in elf.versioned_needed and not TORCH_LIB.match(n)]
    for imp in elf.imports:
        n = imp.name
        if n.startswith("_Z"):
            d = dem.get(n, "")
            from_torch_file = bool(imp.version_file and TORCH_LIB.match(imp.version_file))
            if (MANGLED_TORCH.match(n) or DEMANGLED_TORCH.match(d) or TORCH_PYTHON.match(n)
                    or from_torch_file
                    or (needed_torch and imp.version is None and not CXX_RUNTIME.match(n))):
                unstable.append(n)
        elif n in table.since_of or SHIM_NAME.match(n):
            found.append(n)
        elif TORCH_PYTHON.match(n):
            unstable.append(n)
        elif (needed_torch and imp.version is None and not imp.weak
              and not n.startswith(("Py", "_Py"))):
            (maybe_torch if unversioned_others else unstable).append(n)

    res = TorchResult(verdict=NO_TORCH, needed_torch=needed_torch)
    res.stable_shims = sorted(found)
    res.unstable = sorted(unstable)
    res.unstable_demangled = [dem.get(n, n) for n in res.unstable]
    res.dlsym_shims = sorted(s for s in elf.rodata_strings
                             if s in table.since_of and s not in found)
    if unstable:
        res.verdict = UNSTABLE
    elif found:
        res.verdict = STABLE

    versions: list[Version] = []
    for n in res.stable_shims + res.dlsym_shims:
        v = table.since(n)
        if v is None:
            res.unknown_shims.append(n)
            continue
        versions.append(v)
        res.by_version.setdefault(table.label(v), []).append(n)
        if n in found and (dev := device_of(n)):
            res.device_shims.setdefault(dev, []).append(n)
    res.by_version = dict(sorted(res.by_version.items(), key=lambda kv: parse_version(kv[0])))
    if versions and res.verdict != UNSTABLE:
        res.min_torch = table.label(max(versions))
    if res.verdict == UNSTABLE:
        res.notes.append("uses libtorch outside the stable C shims: loads only in the "
                         "torch release it was built against")

    if res.uses_torch or needed_torch or res.dlsym_shims:
        if maybe_torch:
            res.notes.append("unversioned C imports, maybe from "
                             + ", ".join(needed_torch) + ": " + ", ".join(maybe_torch[:5]))
        if res.unknown_shims:
            res.notes.append(f"shims not in the table ({table.source}): "
                             + ", ".join(res.unknown_shims[:5]))
        if res.dlsym_shims:
            res.notes.append("looks up by name (dlsym): " + ", ".join(res.dlsym_shims[:5]))
        for dev, syms in res.device_shims.items():
            lib = f"libtorch_{dev}.so"
            res.notes.append(f"imports {dev}-only shims directly ({', '.join(syms[:3])}): "
                             f"will not load in a torch without {lib}; resolve them with "
                             f"dlopen({lib}, RTLD_NOLOAD) + dlsym")
        for lib in needed_torch:
            if "cuda" in lib:
                res.notes.append(f"DT_NEEDED {lib}: will not load in a CPU-only torch")
            elif "python" in lib:
                res.notes.append(f"DT_NEEDED {lib}: tied to torch's Python bindings")
        if res.verdict == NO_TORCH and needed_torch:
            res.notes.append("DT_NEEDED on " + ", ".join(needed_torch)
                             + " but imports nothing from torch")
    return res


# --- Python extension naming -------------------------------------------------------------

_ABI3 = re.compile(r"^(?P<stem>[^.]+)\.abi3\.so$")
_SOABI = re.compile(r"^(?P<stem>[^.]+)\.cpython-(?P<ver>3\d+)(?P<flags>[a-z]*)-"
                    r"(?P<plat>[A-Za-z0-9_]+)-(?P<os>[A-Za-z0-9_-]+)\.so$")
_PLAIN = re.compile(r"^(?P<stem>[^.]+)\.so$")
_TAGGED = re.compile(r"^(?P<stem>[^.]+)\.(?P<tag>[^/]+)\.so$")


@dataclass
class NameInfo:
    kind: str            # abi3 | soabi | plain | tagged | library
    stem: str
    python: str | None = None   # "3.12" for a SOABI name
    platform: str | None = None


def parse_name(filename: str) -> NameInfo:
    if m := _ABI3.match(filename):
        return NameInfo("abi3", m["stem"])
    if m := _SOABI.match(filename):
        v = m["ver"]
        return NameInfo("soabi", m["stem"], python=f"{v[0]}.{v[1:]}", platform=m["plat"])
    if m := _PLAIN.match(filename):
        return NameInfo("plain", m["stem"])
    if m := _TAGGED.match(filename):
        return NameInfo("tagged", m["stem"])
    return NameInfo("library", filename.split(".", 1)[0])


@dataclass
class PythonResult:
    init: list[str] = field(default_factory=list)       # X of each exported PyInit_X
    imports: int = 0                                    # Py*/_Py* symbols imported
    pybind11: bool = False
    # from abi3audit, when it ran: symbols outside the limited API, and limited-API
    # symbols newer than --python-min ({name: version}); None: not checked
    non_limited: list[str] | None = None
    newer_than_min: dict[str, str] | None = None
    checker: str | None = None
    message: str | None = None   # why abi3audit did not run

    @property
    def is_extension(self) -> bool:
        return bool(self.init)

    @property
    def uses_python(self) -> bool:
        return self.is_extension or self.imports > 0

    @property
    def version_specific(self) -> bool:
        """Cannot be abi3: uses non-limited API (pybind11 always does)."""
        return bool(self.non_limited) or self.pybind11


def python_check(elf: ElfInfo, path: Path, python_min: Version,
                 use_abi3audit: bool | None = None) -> PythonResult:
    """PyInit_ exports, Python imports, pybind11; and abi3audit's verdict on the file's
    Python API use when abi3audit is installed (use_abi3audit None) or required (True)."""
    res = PythonResult()
    res.init = sorted(n[len("PyInit_"):] for n in elf.exports if n.startswith("PyInit_"))
    res.imports = sum(1 for i in elf.imports
                      if i.name.startswith(("Py", "_Py")) and not i.name.startswith("PyInit_"))
    res.pybind11 = elf.has_pybind11_marker and res.uses_python
    if not res.uses_python:
        res.non_limited, res.newer_than_min = [], {}
        return res
    if use_abi3audit is False:
        res.message = "abi3audit not used (--no-abi3audit)"
        return res
    try:
        from ._abi3audit import run_abi3audit
    except ImportError as exc:
        res.message = f"{exc} (pip install abi3audit==0.0.26)"
        return res
    try:
        res.checker, res.non_limited, res.newer_than_min = run_abi3audit(path, python_min)
    except Exception as exc:  # abi3audit's own failure, reported not raised
        res.message = f"abi3audit failed: {exc}"
    return res


@dataclass
class Abi3Result:
    status: str                 # ok | violations | n/a | error
    checker: str | None = None  # abi3audit X.Y | "no Python API"
    non_abi3: list[str] = field(default_factory=list)
    newer_than_min: dict[str, str] = field(default_factory=dict)
    message: str | None = None


def abi3_check(name: NameInfo, py: PythonResult) -> Abi3Result:
    """For .abi3.so names: abi3audit's verdict, or ok when the file uses no Python API at
    all (sm7x's torch libraries). Without abi3audit a file that uses it is not checked,
    and fails."""
    if name.kind != "abi3":
        return Abi3Result("n/a")
    if not py.uses_python:
        return Abi3Result("ok", checker="no Python API")
    if py.non_limited is None:
        return Abi3Result("error", message="uses the Python C API: checking it against the "
                          f"limited API needs abi3audit: {py.message}")
    bad = bool(py.non_limited or py.newer_than_min)
    return Abi3Result("violations" if bad else "ok", py.checker, list(py.non_limited),
                      dict(py.newer_than_min))


def name_check(name: NameInfo, py: PythonResult, elf: ElfInfo) -> tuple[list[str], list[str]]:
    """(problems, notes) for the file name against what the file is."""
    problems, notes = [], []
    if py.is_extension and name.kind != "library" and name.stem not in py.init:
        inits = ", ".join(f"PyInit_{i}" for i in py.init)
        problems.append(f"exports {inits} but its name says module {name.stem!r}: "
                        f"`import {name.stem}` fails")
    if py.is_extension and py.version_specific and name.kind != "soabi":
        why = "a pybind11 module" if py.pybind11 else "uses the non-limited API"
        mod = py.init[0] if len(py.init) == 1 else name.stem
        problems.append(f"{why}: must be SOABI-named ({mod}.cpython-3XY-"
                        f"{elf.platform or '<arch>'}-linux-gnu.so), not {elf.path.name}")
    if name.kind == "soabi" and elf.platform and name.platform != elf.platform:
        problems.append(f"named for {name.platform} but the ELF is {elf.platform}")
    if name.kind == "soabi" and py.is_extension and py.non_limited == [] and not py.pybind11:
        notes.append("uses only the limited API, some of it newer than the abi3 target"
                     if py.newer_than_min else "uses only the limited API: could ship as .abi3.so")
    if name.kind == "abi3" and not py.is_extension:
        notes.append("no PyInit_*: a plain library (torch.ops.load_library / ctypes), "
                     "not an importable module")
    return problems, notes


# --- the record --------------------------------------------------------------------------

@dataclass
class Options:
    require: str = "any"                 # stable | no-torch | any
    torch_target: str | None = None      # fail when a file needs a newer torch
    python_min: str = "3.10"
    use_abi3audit: bool | None = None    # None: when installed


@dataclass
class Record:
    file: str
    path: str
    soname: str | None = None
    needed: list[str] = field(default_factory=list)
    torch: TorchResult | None = None
    python: PythonResult | None = None
    name: dict | None = None
    abi3: Abi3Result | None = None
    failures: list[str] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def audit_file(path: str | Path, display: str | None = None,
               opts: Options | None = None) -> Record:
    opts = opts or Options()
    path = Path(path)
    rec = Record(file=display or str(path), path=str(path))
    try:
        elf = read_elf(path)
    except ElfError as exc:
        rec.error = str(exc)
        rec.failures.append(str(exc))
        return rec
    rec.soname, rec.needed = elf.soname, elf.needed
    rec.torch = t = torch_check(elf, shims.shim_table())
    rec.python = python_check(elf, path, parse_version(opts.python_min), opts.use_abi3audit)
    name = parse_name(path.name)
    problems, notes = name_check(name, rec.python, elf)
    rec.name = {"kind": name.kind, "module": name.stem, "ok": not problems,
                "problems": problems, "notes": notes}
    rec.abi3 = abi3_check(name, rec.python)

    if opts.require == "stable" and t.verdict == UNSTABLE:
        rec.failures.append("UNSTABLE: imports libtorch symbols outside the stable C shims "
                            "(--require stable)")
    if opts.require == "no-torch" and t.verdict != NO_TORCH:
        rec.failures.append(f"{t.verdict}: uses torch (--require no-torch)")
    if opts.torch_target and t.uses_torch:
        target = parse_version(opts.torch_target)
        if t.min_torch and parse_version(t.min_torch) > target:
            newer = [n for lbl, ns in t.by_version.items() if parse_version(lbl) > target
                     for n in ns]
            rec.failures.append(f"needs torch {t.min_torch} shims, target is "
                                f"{opts.torch_target}: {', '.join(newer[:5])}")
        if t.unknown_shims:
            rec.failures.append("shims of unknown version (target "
                                f"{opts.torch_target}): {', '.join(t.unknown_shims[:5])}")
    rec.failures.extend(problems)
    if rec.abi3.status == "violations":
        parts = []
        if rec.abi3.non_abi3:
            parts.append("non-limited: " + ", ".join(rec.abi3.non_abi3[:6]))
        if rec.abi3.newer_than_min:
            parts.append(f"newer than {opts.python_min}: " + ", ".join(
                f"{k} ({v})" for k, v in list(rec.abi3.newer_than_min.items())[:6]))
        rec.failures.append("abi3 violation: " + "; ".join(parts))
    elif rec.abi3.status == "error":
        rec.failures.append(f"abi3 check failed: {rec.abi3.message}")
    return rec
