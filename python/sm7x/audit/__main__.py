"""python -m sm7x.audit PATH... [--json] [--require stable|no-torch|any] ...

Exit status: 0 when every file passes, 1 when any fails (see --require; a misnamed file,
an abi3 violation or an unreadable input always fails) or when no shared object was found
at all, 2 on a usage error or without pyelftools.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from . import Options, audit_paths
from ._report import render_json, render_text
from .tables import parse_version


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sm7x.audit",
        description="ABI audit of shared objects: torch stable ABI (STABLE / UNSTABLE / "
                    "NO-TORCH) and the lowest torch it needs, abi3 (abi3audit), and whether "
                    "each file name matches the module inside.",
        epilog="Exit status: 0 all pass, 1 a file fails or nothing was audited, 2 usage error "
               "(or pyelftools missing).")
    ap.add_argument("paths", nargs="+", metavar="PATH",
                    help="a .so, or a directory / .whl / .conda / .tar.bz2 to scan for .so files")
    ap.add_argument("--json", action="store_true", help="machine-readable records on stdout")
    ap.add_argument("--require", choices=("stable", "no-torch", "any"), default="any",
                    help="stable: every torch-using file must be STABLE; no-torch: no file "
                         "may use torch; any (default): report only")
    ap.add_argument("--torch-target", metavar="X.Y",
                    help="fail a file that needs shims newer than torch X.Y (or shims of "
                         "unknown version), e.g. 2.10 for TORCH_TARGET_VERSION 2.10")
    ap.add_argument("--python-min", metavar="X.Y", default="3.10",
                    help="the oldest Python an .abi3.so must run on (default 3.10)")
    ap.add_argument("--torch-shims-header", metavar="DIR",
                    help="parse the shim headers of this torch (its package dir or include "
                         "dir) instead of the bundled table")
    ap.add_argument("--no-abi3audit", action="store_true",
                    help="check .abi3.so files against the bundled limited-API list only")
    ap.add_argument("--plain", action="store_true", help="plain text even if rich is installed")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if importlib.util.find_spec("elftools") is None:
        print("sm7x.audit needs pyelftools: pip install pyelftools (conda: pyelftools)",
              file=sys.stderr)
        return 2
    for opt in ("torch_target", "python_min"):
        val = getattr(args, opt)
        if val is not None:
            try:
                parse_version(val)
            except ValueError:
                ap.error(f"--{opt.replace('_', '-')}: expected X.Y, got {val!r}")
    opts = Options(require=args.require, torch_target=args.torch_target,
                   python_min=args.python_min, torch_headers=args.torch_shims_header,
                   use_abi3audit=False if args.no_abi3audit else None)
    try:
        from .tables import shim_table

        table = shim_table(opts.torch_headers)
    except (FileNotFoundError, OSError) as exc:
        ap.error(f"--torch-shims-header: {exc}")
    records = audit_paths(args.paths, opts)
    if args.json:
        render_json(records, sys.stdout, {
            "require": args.require, "torch_target": args.torch_target,
            "python_min": args.python_min, "shim_table": table.source})
    else:
        render_text(records, sys.stdout, plain=args.plain)
    if all(r.skipped for r in records):
        print("sm7x.audit: no shared object was audited", file=sys.stderr)
        return 1
    return 0 if all(r.ok for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
