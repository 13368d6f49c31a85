"""``python -m sm7x.bench BENCHMARK [options]``; benchmarks: core (see sm7x.bench.core)."""

from __future__ import annotations

import sys

BENCHMARKS = {"core": "sm7x core ops (rms_norm, ..., reshape_and_cache) vs plain torch"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: python -m sm7x.bench BENCHMARK [options]  (BENCHMARK --help for options)")
        for name, what in BENCHMARKS.items():
            print(f"  {name:<6} {what}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "core":
        from . import core

        return core.main(argv[1:])
    return 2


if __name__ == "__main__":
    sys.exit(main())
