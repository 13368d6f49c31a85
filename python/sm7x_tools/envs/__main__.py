"""python -m sm7x_tools.envs PREFIX SPEC... [--channel DIR]...: create an environment."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from .. import ToolError
from . import RATTLER_ERRORS, channel_dirs, create, exit_now


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sm7x_tools.envs", description=__doc__)
    ap.add_argument("prefix", type=Path)
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--channel", action="append", type=Path,
                    help="channel directory (default: ./channel and the bootstrap channel)")
    args = ap.parse_args(argv)
    try:
        channels = channel_dirs(args.channel)
        if args.prefix.exists():
            shutil.rmtree(args.prefix)
        env = create(args.prefix, args.specs, channels)
    except (ToolError, *RATTLER_ERRORS) as exc:  # a missing channel, an unsolvable spec
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{len(env.records)} packages; solve {env.solve_s * 1000:.1f} ms, install {env.install_s * 1000:.0f} ms -> {env.prefix}")
    return 0


if __name__ == "__main__":
    exit_now(main())
