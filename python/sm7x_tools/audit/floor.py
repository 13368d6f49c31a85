"""The glibc / libstdc++ floor of shared objects, from their ELF version needs.

    python -m sm7x_tools.audit.floor --glibc 2.28 --gcc 12 FILE...
    python -m sm7x_tools.audit.floor --glibc 2.28 --gcc 12 --package NAME [--prefix P]
    python floor.py ...   (the file alone: what the recipe's package tests run)

A dynamic loader refuses a library that needs a symbol version its glibc (or libstdc++,
libgcc_s) does not define: "version `GLIBC_2.34' not found". Every versioned import is
listed in the library's .gnu.version_r section, so reading it tells, without running
anything, the oldest runtime the library can load on. This fails (exit 1) when a file
needs a GLIBC_* newer than --glibc, or GLIBCXX_*/CXXABI_*/GCC_* newer than what the
libstdc++/libgcc_s of GCC --gcc define. With --package it checks the files of an
installed conda package (conda-meta/NAME-*.json) and that the package says so: a
`__glibc >=X` run dependency with X no older than what its files need, and `libstdcxx
>=N` / `libgcc >=N` when its files import from libstdc++.so.6 / libgcc_s.so.1.

It also fails on a strong import without a version, other than torch's stable-ABI shims
(aoti_torch_*, torch_*) and the Python C API (Py*, _Py*), which the process provides
unversioned: glibc, libstdc++ and libgcc_s version every symbol they export, so an
unversioned import of theirs means the link did not see them (e.g. a function the 2.28
sysroot lacks), and it would fail to resolve at load time.

What it proves: the loader's version check passes on a host with that glibc and those
GCC runtimes, and every versioned import names a version they define. It does not run
anything: that each symbol exists at that version there is the link's doing (against
2.28's stubs), and behaviour is not judged. Needs pyelftools only (stdlib otherwise),
so a package test can run it. Exit status: 0 ok, 1 a file or package fails, 2 usage.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

# Newest version each GCC release's runtime defines (libstdc++ GLIBCXX_/CXXABI_, libgcc_s
# GCC_): a library that needs no more loads with that release's libstdc++/libgcc_s or newer.
GCC_RUNTIME = {
    11: {"GLIBCXX": (3, 4, 29), "CXXABI": (1, 3, 13), "GCC": (11, 0, 0)},
    12: {"GLIBCXX": (3, 4, 30), "CXXABI": (1, 3, 13), "GCC": (12, 0, 0)},
    13: {"GLIBCXX": (3, 4, 32), "CXXABI": (1, 3, 14), "GCC": (13, 0, 0)},
    14: {"GLIBCXX": (3, 4, 33), "CXXABI": (1, 3, 15), "GCC": (14, 0, 0)},
}
_VERSION = re.compile(r"(GLIBC|GLIBCXX|CXXABI|GCC)_([0-9]+(?:\.[0-9]+)*)")
# which conda package provides the runtime a versioned import comes from
_RUNTIME_PACKAGE = {"libstdc++.so.6": "libstdcxx", "libgcc_s.so.1": "libgcc"}


def _tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _text(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def version_needs(path: str) -> dict[str, set[str]]:
    """{needed file: {version names}} of one ELF file; {} for a file that is not ELF."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection

    needs: dict[str, set[str]] = {}
    with open(path, "rb") as f:
        try:
            elf = ELFFile(f)
        except ELFError:
            return {}
        for section in elf.iter_sections():
            if isinstance(section, GNUVerNeedSection):
                for verneed, auxes in section.iter_versions():
                    needs.setdefault(verneed.name, set()).update(a.name for a in auxes)
    return needs


# imports the process provides without a version: torch's C shims and the Python C API
_UNVERSIONED_OK = re.compile(r"(aoti_torch_|torch_|Py|_Py)")


def unversioned_imports(path: str) -> list[str]:
    """Strong undefined dynamic symbols with no version, other than _UNVERSIONED_OK's."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        try:
            elf = ELFFile(f)
        except ELFError:
            return []
        dynsym = elf.get_section_by_name(".dynsym")
        versym = elf.get_section_by_name(".gnu.version")
        if dynsym is None:
            return []
        bad = []
        for i, sym in enumerate(dynsym.iter_symbols()):
            if i == 0 or sym["st_shndx"] != "SHN_UNDEF" or sym["st_info"]["bind"] != "STB_GLOBAL":
                continue
            index = versym.get_symbol(i)["ndx"] if versym is not None else "VER_NDX_GLOBAL"
            if index in ("VER_NDX_GLOBAL", "VER_NDX_LOCAL", 0, 1) and not _UNVERSIONED_OK.match(sym.name):
                bad.append(sym.name)
        return sorted(bad)


def highest(needs: dict[str, set[str]]) -> dict[str, tuple[int, ...]]:
    """The newest version per family (GLIBC, GLIBCXX, CXXABI, GCC) a file needs."""
    top: dict[str, tuple[int, ...]] = {}
    for names in needs.values():
        for name in names:
            m = _VERSION.fullmatch(name)
            if m:
                v = _tuple(m[2])
                top[m[1]] = max(top.get(m[1], v), v)
    return top


def check_file(path: str, glibc: tuple[int, ...], gcc: int) -> tuple[dict, list[str]]:
    needs = version_needs(path)
    top = highest(needs)
    limits = {"GLIBC": glibc, **GCC_RUNTIME[gcc]}
    problems = [f"{path}: needs {family}_{_text(v)}, newer than {family}_{_text(limits[family])} "
                f"({'glibc ' + _text(glibc) if family == 'GLIBC' else 'GCC ' + str(gcc) + ' runtime'})"
                for family, v in sorted(top.items()) if v > limits[family]]
    loose = unversioned_imports(path)
    if loose:
        problems.append(f"{path}: imports without a symbol version (the link did not resolve them "
                        f"against the sysroot): {', '.join(loose[:10])}" + (" ..." if len(loose) > 10 else ""))
    return {"file": path, "needs": {k: _text(v) for k, v in sorted(top.items())},
            "libraries": sorted(needs)}, problems


def _declared_floor(depends: list[str], name: str) -> tuple[int, ...] | None:
    """X of a `name >=X...` dependency (the lower bound a conda spec declares)."""
    for spec in depends:
        words = spec.split()
        if words and words[0] == name and len(words) > 1:
            m = re.match(r">=([0-9]+(?:\.[0-9]+)*)", words[1])
            if m:
                return _tuple(m[1])
    return None


def check_package(prefix: str, name: str, glibc: tuple[int, ...], gcc: int):
    metas = glob.glob(os.path.join(prefix, "conda-meta", f"{name}-[0-9]*.json"))
    metas = [m for m in metas if json.load(open(m)).get("name") == name]
    if len(metas) != 1:
        raise SystemExit(f"error: {len(metas)} installed records of {name} in {prefix}/conda-meta; "
                         "give the prefix of an environment that has it (--prefix)")
    meta = json.load(open(metas[0]))
    depends = meta.get("depends", [])
    files = [os.path.join(prefix, f) for f in meta.get("files", []) if re.search(r"\.so(\.|$)", f)]
    if not files:
        raise SystemExit(f"error: package {name} has no shared object to check")
    records, problems = [], []
    for path in files:
        record, p = check_file(path, glibc, gcc)
        records.append(record)
        problems += p
        if "GLIBC" in record["needs"]:
            declared = _declared_floor(depends, "__glibc")
            needed = _tuple(record["needs"]["GLIBC"])
            if declared is None or declared < needed:
                problems.append(f"{name}: {path} needs GLIBC_{record['needs']['GLIBC']} but the package "
                                f"declares {'no __glibc' if declared is None else '__glibc >=' + _text(declared)}")
            elif declared > glibc:
                problems.append(f"{name}: declares __glibc >={_text(declared)}, newer than the floor {_text(glibc)}")
        for lib, package in _RUNTIME_PACKAGE.items():
            if lib in record["libraries"]:
                declared = _declared_floor(depends, package)
                if declared is None:
                    problems.append(f"{name}: {path} links {lib} but the package has no {package} run dependency")
                elif declared[0] < gcc:
                    problems.append(f"{name}: {package} >={_text(declared)} is older than GCC {gcc}, whose runtime "
                                    f"the files were checked against")
    return records, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sm7x_tools.audit.floor",
                                 description="Fail when shared objects need a glibc / GCC runtime newer than a floor.")
    ap.add_argument("files", nargs="*", metavar="FILE")
    ap.add_argument("--glibc", required=True, metavar="X.Y", help="the oldest glibc to load on, e.g. 2.28")
    ap.add_argument("--gcc", required=True, type=int, metavar="N",
                    help=f"the oldest GCC runtime (libstdcxx/libgcc >=N), one of {sorted(GCC_RUNTIME)}")
    ap.add_argument("--package", metavar="NAME", help="check an installed conda package's files and run dependencies")
    ap.add_argument("--prefix", default=os.environ.get("CONDA_PREFIX") or os.environ.get("PREFIX") or sys.prefix,
                    help="environment holding --package (default: $CONDA_PREFIX, $PREFIX, this Python's)")
    ap.add_argument("--json", action="store_true", help="records on stdout")
    args = ap.parse_args(argv)
    if args.gcc not in GCC_RUNTIME:
        ap.error(f"--gcc {args.gcc}: known are {sorted(GCC_RUNTIME)}")
    if not re.fullmatch(r"[0-9]+\.[0-9]+", args.glibc):
        ap.error(f"--glibc {args.glibc!r}: give X.Y, e.g. 2.28")
    if bool(args.files) == bool(args.package):
        ap.error("give FILEs or --package NAME")
    try:
        import elftools  # noqa: F401
    except ImportError:
        print("sm7x_tools.audit.floor needs pyelftools (conda: pyelftools)", file=sys.stderr)
        return 2
    glibc = _tuple(args.glibc)
    if args.package:
        records, problems = check_package(args.prefix, args.package, glibc, args.gcc)
    else:
        records, problems = [], []
        for path in args.files:
            if not os.path.isfile(path):
                print(f"error: {path}: no such file", file=sys.stderr)
                return 2
            record, p = check_file(path, glibc, args.gcc)
            records.append(record)
            problems += p
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        for r in records:
            print(f"{r['file']}: " + (", ".join(f"{k}_{v}" for k, v in r["needs"].items()) or "no versioned imports"))
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    if not problems:
        print(f"ok: every file loads with glibc >= {args.glibc} and the GCC {args.gcc} runtime", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
