"""python -m sm7x_tools.envs.bench: solve and install times of `sm7x` from the channel, per node kind.

Each case fakes a node the way users do on a login node (CONDA_OVERRIDE_CUDA_ARCH, with
CONDA_OVERRIDE_CUDA, which rattler needs for the arch override to count) and is timed
against a baseline measured in the same run, interleaved run by run: the same environment
without the FA2 selector (sm7x-core, sm7x-ext, python). The ratio is what the selector and
the FA2 library cost; wall-clock numbers alone are noisy on shared machines.

    PYTHONPATH=python .sm7x/tools/bin/python -m sm7x_tools.envs.bench --out envs_bench.json [--plot envs_bench.png]
        [--runs 5] [--cold] [--channel DIR]...
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from .. import ToolError
from . import RATTLER_ERRORS, channel_dirs, detected, exit_now, install, solve

CASES = {"7.0": "7.0", "7.5": "7.5", "8.0": "8.0", "absent": None, "empty": ""}
SPECS = ["sm7x", "python 3.11.*"]
BASELINE = ["sm7x-core", "sm7x-ext", "python 3.11.*"]
OVERRIDES = ("CONDA_OVERRIDE_CUDA_ARCH", "CONDA_OVERRIDE_CUDA")


@contextmanager
def node(arch: str | None):
    """The environment variables of a node whose __cuda_arch is `arch` (None: unset)."""
    saved = {k: os.environ.get(k) for k in OVERRIDES}
    for k in OVERRIDES:
        os.environ.pop(k, None)
    if arch is not None:
        os.environ.update({"CONDA_OVERRIDE_CUDA_ARCH": arch, "CONDA_OVERRIDE_CUDA": "12.4"})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def timed(specs: list[str], arch: str | None, channels: list[str], work: Path, cold: bool) -> dict:
    """One solve + install into a fresh prefix; milliseconds and what was installed."""
    with node(arch):
        vpkgs = detected()
    prefix = work / "env"
    cache = work / "cache" if cold else None
    t0 = time.perf_counter()
    records = solve(channels, specs, vpkgs)
    t1 = time.perf_counter()
    install(records, prefix, cache_dir=cache)
    t2 = time.perf_counter()
    shutil.rmtree(prefix)
    if cache:
        shutil.rmtree(cache)
    by_name = {r.name.normalized: r for r in records}
    selector = by_name.get("sm7x-fa2")
    return {"solve_ms": (t1 - t0) * 1e3, "install_ms": (t2 - t1) * 1e3, "packages": len(records),
            "selector_build": str(selector.build) if selector else None,
            "fa2_packages": sorted(n for n in by_name if n.startswith("sm7x-fa2-"))}


def run(channels: list[Path], runs: int, cold: bool) -> dict:
    urls = [c.resolve().as_uri() for c in channels]
    result = {"specs": SPECS, "baseline": BASELINE, "runs": runs, "cold_cache": cold,
              "channels": [str(c) for c in channels], "cases": {}}
    with tempfile.TemporaryDirectory(prefix="sm7x-bench-envs-") as tmp:
        work = Path(tmp)
        for case, arch in CASES.items():
            rows = {"case": [], "baseline": []}
            timed(SPECS, arch, urls, work, cold)  # warm-up: first-run effects out of the figures
            for _ in range(runs):  # A B A B: drift hits both alike
                rows["baseline"].append(timed(BASELINE, arch, urls, work, cold))
                rows["case"].append(timed(SPECS, arch, urls, work, cold))
            med = {f"{who}_{what}": statistics.median(r[what] for r in rows[who])
                   for who in rows for what in ("solve_ms", "install_ms")}
            result["cases"][case] = {
                "cuda_arch": arch,
                "selector_build": rows["case"][0]["selector_build"],
                "fa2_packages": rows["case"][0]["fa2_packages"],
                "packages": rows["case"][0]["packages"],
                "baseline_packages": rows["baseline"][0]["packages"],
                **{f"{who}_{what}": [round(r[what], 2) for r in rows[who]]
                   for who in rows for what in ("solve_ms", "install_ms")},
                "median": {k: round(v, 2) for k, v in med.items()},
                "ratio": {what: round(statistics.median(c[what] / b[what] for c, b in zip(rows["case"], rows["baseline"])), 3)
                          for what in ("solve_ms", "install_ms")},
            }
    return result


def report(result: dict) -> None:
    from rich.table import Table

    from ..ui import console

    table = Table(title=f"sm7x solve + install, {result['runs']} runs, "
                        f"{'cold' if result['cold_cache'] else 'warm'} package cache (medians)")
    for col in ("node (__cuda_arch)", "sm7x-fa2 build", "FA2 libraries", "solve ms", "x baseline",
                "install ms", "x baseline"):
        table.add_column(col, justify="right" if col.endswith(("ms", "baseline")) else "left")
    for case, c in result["cases"].items():
        m = c["median"]
        table.add_row(case, c["selector_build"], " ".join(p.removeprefix("sm7x-fa2-") for p in c["fa2_packages"]),
                      f"{m['case_solve_ms']:.1f}", f"{c['ratio']['solve_ms']:.2f}",
                      f"{m['case_install_ms']:.0f}", f"{c['ratio']['install_ms']:.2f}")
    console.print(table)
    console.print(f"baseline: {' '.join(result['baseline'])} on the same node, interleaved")


def draw(result: dict, plt):
    from sm7x.bench._output import grouped_bars

    cases = list(result["cases"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, what in zip(axes, ("solve_ms", "install_ms")):
        grouped_bars(ax, cases, {label: [result["cases"][c]["median"][f"{who}_{what}"] for c in cases]
                                 for label, who in (("without sm7x-fa2", "baseline"), ("sm7x", "case"))})
        ax.set_xlabel("node (__cuda_arch)")
        ax.set_ylabel(what.replace("_", " "))
        ax.legend()
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sm7x_tools.envs.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the result as JSON here")
    ap.add_argument("--plot", help="draw a PNG here (needs matplotlib)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="an empty package cache for every run")
    ap.add_argument("--channel", action="append", type=Path,
                    help="channel directory (default: ./channel and the bootstrap channel)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    try:
        result = run(channel_dirs(args.channel), args.runs, args.cold)
    except (ToolError, *RATTLER_ERRORS) as exc:  # a missing channel, an unsolvable case
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report(result)
    from sm7x.bench._output import write  # the JSON/PNG writer every sm7x benchmark uses (python/ is on the path)

    write(result, args.out, args.plot, draw)
    return 0


if __name__ == "__main__":
    exit_now(main())
