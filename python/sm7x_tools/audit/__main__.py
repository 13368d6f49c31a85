"""python -m sm7x_tools.audit PATH... [--json] [--require stable|no-torch|any] ...

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
from .shims import parse_version, shim_table


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sm7x_tools.audit",
        description="ABI audit of shared objects: torch stable ABI (STABLE / UNSTABLE / "
                    "NO-TORCH) and the lowest torch it needs, abi3 (abi3audit), and whether "
                    "each file name matches the module inside.",
        epilog="Exit status: 0 all pass, 1 a file fails or nothing was audited, 2 usage error "
               "(or pyelftools missing).")
    ap.add_argument("paths", nargs="*", metavar="PATH",
                    help="a .so, or a directory / .whl / .conda / .tar.bz2 to scan for .so files")
    ap.add_argument("--json", action="store_true", help="machine-readable records on stdout")
    ap.add_argument("--require", choices=("stable", "no-torch", "any"), default="any",
                    help="stable: every torch-using file must be STABLE; no-torch: no file "
                         "may use torch; any (default): report only")
    ap.add_argument("--torch-target", metavar="X.Y|floor",
                    help="fail a file that needs shims newer than torch X.Y (or shims of "
                         "unknown version), e.g. 2.10 for TORCH_TARGET_VERSION 2.10; "
                         "floor: sm7x's torch floor (targets.json torch.min)")
    ap.add_argument("--python-min", metavar="X.Y", default="3.10",
                    help="the oldest Python an .abi3.so must run on (default 3.10)")
    ap.add_argument("--no-abi3audit", action="store_true",
                    help="do not use abi3audit even when installed (an .abi3.so that uses "
                         "the Python C API then fails as unchecked)")
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the only format
    ap.add_argument("--update-shims", choices=("write", "check"), metavar="write|check",
                    help="rewrite (or compare) the shim version table from the installed "
                         "torch-abi-audit, then exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.update_shims:
        from .shims import update

        return update(check=args.update_shims == "check")
    if not args.paths:
        ap.error("give at least one PATH")
    if importlib.util.find_spec("elftools") is None:
        print("sm7x_tools.audit needs pyelftools: pip install pyelftools (conda: pyelftools)",
              file=sys.stderr)
        return 2
    if args.torch_target == "floor":
        from sm7x import _targets

        args.torch_target = _targets.torch_min()
    for opt in ("torch_target", "python_min"):
        val = getattr(args, opt)
        if val is not None:
            try:
                parse_version(val)
            except ValueError:
                ap.error(f"--{opt.replace('_', '-')}: expected X.Y, got {val!r}")
    opts = Options(require=args.require, torch_target=args.torch_target,
                   python_min=args.python_min,
                   use_abi3audit=False if args.no_abi3audit else None)
    records = audit_paths(args.paths, opts)
    if args.json:
        render_json(records, sys.stdout, {
            "require": args.require, "torch_target": args.torch_target,
            "python_min": args.python_min, "shim_table": shim_table().source})
    else:
        render_text(records, sys.stdout)
    if all(r.skipped for r in records):
        print("sm7x_tools.audit: no shared object was audited", file=sys.stderr)
        return 1
    return 0 if all(r.ok for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
