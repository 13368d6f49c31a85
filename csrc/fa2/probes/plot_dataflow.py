"""Bars of a dataflow_sm75 result: % of the mma.m16n8k8 loop per case (the benchmarks'
writer, sm7x.bench._output: no matplotlib, no plot).

    ./dataflow --json > dataflow.json
    PYTHONPATH=python python csrc/fa2/probes/plot_dataflow.py dataflow.json dataflow.png
"""

import json
import sys

from sm7x.bench._output import write


def draw(result: dict, plt):
    cases = result["cases"][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(cases) + 1.2))
    ax.barh([c["case"] for c in cases], [c["pct_mma_loop"] for c in cases])
    ax.set_xlabel(f"% of the mma.m16n8k8 register loop ({result['mma_loop_tflops']} TFLOP/s, {result['device']})")
    ax.set_xlim(0, 100)
    return fig


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} DATAFLOW.json OUT.png  (DATAFLOW.json: ./dataflow --json)")
    with open(sys.argv[1]) as f:
        write(json.load(f), None, sys.argv[2], draw)
