"""python -m sm7x_tools.kernels LIB.so... [--json] [--cuda-bin DIR] [--targets targets.json]

Exit status: 0, 1 when a library has no FA2 kernel, cuobjdump cannot read it, or a forward
kernel's tile loop was not found (its tensor-core FLOP do not match one tile; a backward
kernel whose loop is not one tile is shown as "rolled"), 2 for a missing file
or without cuobjdump/nvdisasm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from . import DEFAULT_TARGETS, analyse, as_json, render


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sm7x_tools.kernels",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("libs", nargs="+", metavar="LIB.so")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cuda-bin", help="folder holding cuobjdump and nvdisasm")
    ap.add_argument("--targets", default=str(DEFAULT_TARGETS),
                    help="the targets.json the library was built from (its smem_bytes)")
    a = ap.parse_args(argv)
    fa2 = json.loads(Path(a.targets).read_text())["fa2"]
    missing = [lib for lib in a.libs if not Path(lib).is_file()]
    if missing:
        print(f"sm7x_tools.kernels: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    stats = []
    try:
        for lib in a.libs:
            found = analyse(lib, fa2, a.cuda_bin)
            if not found:
                print(f"{lib}: no FA2 fwd kernel found", file=sys.stderr)
                return 1
            stats += found
    except (FileNotFoundError, LookupError) as exc:
        print(f"sm7x_tools.kernels: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:  # not a CUDA library, or a broken one
        print(f"sm7x_tools.kernels: cuobjdump could not read {exc.cmd[-1]}: "
              f"{(exc.stderr or '').strip() or exc}", file=sys.stderr)
        return 1
    print(json.dumps(as_json(stats), indent=1) if a.json else render(stats))
    return 0 if all(s.tensor_flop_matches is not False for s in stats) else 1


if __name__ == "__main__":
    sys.exit(main())
