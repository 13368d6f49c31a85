"""What every benchmark writes: its result as JSON, and a PNG drawn by its own plot
function when matplotlib is there (a missing matplotlib skips the plot, not the run)."""

from __future__ import annotations

import json
import sys
from typing import Callable


def argument_parser(name: str, description: str, plot: str = "a PNG bar chart",
                    out: str = "the results as JSON"):
    """The parser every benchmark starts from: ``python -m sm7x.bench <name>`` with --out
    (``out`` here) and --plot (``plot`` here, drawn with matplotlib); the description is
    printed as written."""
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m sm7x.bench {name}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help=f"write {out} here")
    p.add_argument("--plot", help=f"write {plot} here (needs matplotlib)")
    return p


def write(result: dict, out: str | None, plot_path: str | None, draw: Callable) -> None:
    """draw(result, plt) makes the figure on matplotlib's pyplot and returns it."""
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {out}")
    if not plot_path:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {plot_path}", file=sys.stderr)
        return
    fig = draw(result, plt)
    fig.tight_layout()
    fig.savefig(plot_path, dpi=110)
    print(f"wrote {plot_path}")


def grouped_bars(ax, labels: list[str], series: dict[str, list[float]]) -> None:
    """One bar per series side by side at each x label (series: legend label -> values)."""
    width = 0.8 / len(series)
    xs = range(len(labels))
    for n, (name, values) in enumerate(series.items()):
        ax.bar([x + (n - (len(series) - 1) / 2) * width for x in xs], values, width, label=name)
    ax.set_xticks(list(xs), labels)
