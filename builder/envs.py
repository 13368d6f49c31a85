"""Solve and install environments from file:// channels with py-rattler (pixi's engine).

Channels are always explicit (py-rattler's default is conda-forge) and virtual packages
are detected (a solve without them assumes none), honouring CONDA_OVERRIDE_* like pixi
(CONDA_OVERRIDE_CUDA_ARCH only counts together with CONDA_OVERRIDE_CUDA).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from rattler import VirtualPackage, VirtualPackageOverrides, install, solve


@dataclass
class Env:
    prefix: Path
    records: list
    solve_s: float
    install_s: float

    @property
    def names(self) -> set[str]:
        return {r.name.normalized for r in self.records}

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"


def create(prefix: Path, specs: list[str], channels: list[Path | str], virtual_packages=None) -> Env:
    prefix = Path(prefix).resolve()
    sources = [c.resolve().as_uri() if isinstance(c, Path) else c for c in channels]
    if virtual_packages is None:
        virtual_packages = VirtualPackage.detect(VirtualPackageOverrides.from_env())
    vpkgs = virtual_packages

    async def run():
        t0 = time.monotonic()
        records = await solve(sources, specs, platforms=["linux-64", "noarch"], virtual_packages=vpkgs)
        t1 = time.monotonic()
        await install(records, target_prefix=prefix, show_progress=False)
        return records, t1 - t0, time.monotonic() - t1

    records, solve_s, install_s = asyncio.run(run())
    return Env(prefix, records, solve_s, install_s)


def main(argv=None) -> int:
    """python -m builder.envs PREFIX SPEC... [--channel DIR]...: create an environment."""
    import argparse
    import shutil
    import sys

    from . import REPO, BuildFailed, bootstrap
    from .airgap import RATTLER_ERRORS, require_channel

    ap = argparse.ArgumentParser(prog="python -m builder.envs", description=main.__doc__)
    ap.add_argument("prefix", type=Path)
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--channel", action="append", type=Path,
                    help="channel directory (default: ./channel and the bootstrap channel)")
    args = ap.parse_args(argv)
    try:
        channels = [require_channel(c) for c in args.channel or [REPO / "channel", bootstrap.CHANNEL]]
        if args.prefix.exists():
            shutil.rmtree(args.prefix)
        env = create(args.prefix, args.specs, channels)
    except (BuildFailed, *RATTLER_ERRORS) as exc:  # a missing channel, an unsolvable spec
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{len(env.records)} packages; solve {env.solve_s * 1000:.1f} ms, install {env.install_s * 1000:.0f} ms -> {env.prefix}")
    return 0


if __name__ == "__main__":
    from . import exit_now

    exit_now(main())
