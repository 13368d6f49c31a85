"""sm7x FA2 forward against torch SDPA's memory-efficient backend, in the same run.

``[SM7X_FA2_FORCE=sm75] python -m sm7x.bench fa2 [--out fa2.json] [--plot fa2.png]``

The memory-efficient backend is the only fused SDPA backend that runs on Volta/Turing,
so it is the baseline a user of these GPUs has. fp16, ``--tokens`` tokens per batch
(batch = tokens // seqlen), every seqlen x head dim x causal; TFLOP/s counts
4 * b * h * sq * sk * d, halved for causal. On a GPU other than the arch's own the
library is forced (``SM7X_FA2_FORCE``) and runs its PTX: only correctness and relative
speed of the sm75 family mean something there (sm70's mma.m8n8k4 is emulated on
newer GPUs, so no Volta speed can be read off them).
"""

from __future__ import annotations

import os
import sys

import torch

from . import _output
from .core import _time

DEFAULT_SEQLENS = (512, 2048, 8192)
DEFAULT_HEAD_DIMS = (64, 128, 256)


def run(seqlens=DEFAULT_SEQLENS, head_dims=DEFAULT_HEAD_DIMS, tokens: int = 16384,
        head_elems: int = 2048, iters: int = 5, repeats: int = 10) -> dict:
    """head_elems: heads * head_dim (2048: 32 heads at d64, 16 at d128, 8 at d256)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..fa2 import flash_attn_func

    dev = torch.cuda.current_device()
    rows = []
    for d in head_dims:
        h = max(1, head_elems // d)
        for s in seqlens:
            b = max(1, tokens // s)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            for causal in (False, True):
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                ours = _time(lambda: flash_attn_func(q, k, v, causal=causal), iters, repeats, graph=False)
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    ref = _time(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qt, kt, vt, is_causal=causal), iters, repeats, graph=False)
                rows.append({"head_dim": d, "heads": h, "seqlen": s, "batch": b, "causal": causal,
                             "sm7x_tflops": flops / ours / 1e12, "sdpa_eff_tflops": flops / ref / 1e12,
                             "ratio": ref / ours})
    return {"device": torch.cuda.get_device_name(dev),
            "capability": list(torch.cuda.get_device_capability(dev)),
            "torch": torch.__version__, "forced": os.environ.get("SM7X_FA2_FORCE"),
            "tokens": tokens, "results": rows}


def print_table(result: dict) -> None:
    print(f"{result['device']} (capability {tuple(result['capability'])}), torch {result['torch']}, "
          f"forced={result['forced']}")
    print(f"{'d':>4} {'heads':>5} {'seqlen':>6} {'batch':>5} {'causal':>6} {'sm7x TFLOP/s':>12} "
          f"{'SDPA-eff TFLOP/s':>16} {'ratio':>6}")
    for r in result["results"]:
        print(f"{r['head_dim']:>4} {r['heads']:>5} {r['seqlen']:>6} {r['batch']:>5} {str(r['causal']):>6} "
              f"{r['sm7x_tflops']:>12.1f} {r['sdpa_eff_tflops']:>16.1f} {r['ratio']:>6.2f}")


def draw(result: dict, plt):
    """The PNG of the results (see _output.write)."""
    dims = sorted({r["head_dim"] for r in result["results"]})
    fig, axes = plt.subplots(1, len(dims), figsize=(5 * len(dims), 4), squeeze=False)
    for ax, d in zip(axes[0], dims):
        rs = [r for r in result["results"] if r["head_dim"] == d]
        _output.grouped_bars(ax, [f"{r['seqlen']}{' c' if r['causal'] else ''}" for r in rs],
                     {"sm7x FA2": [r["sm7x_tflops"] for r in rs],
                      "SDPA mem-efficient": [r["sdpa_eff_tflops"] for r in rs]})
        ax.set_title(f"head dim {d}")
        ax.set_xlabel("seqlen (c = causal)")
        ax.set_ylabel("TFLOP/s")
    axes[0][0].legend()
    fig.suptitle(f"sm7x FA2 forward vs SDPA memory-efficient, {result['device']}, fp16")
    return fig


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m sm7x.bench fa2", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG bar chart here (needs matplotlib)")
    p.add_argument("--seqlens", default=",".join(map(str, DEFAULT_SEQLENS)))
    p.add_argument("--head-dims", default=",".join(map(str, DEFAULT_HEAD_DIMS)))
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (default: %(default)s)")
    p.add_argument("--iters", type=int, default=5, help="calls per timed sample")
    p.add_argument("--repeats", type=int, default=10, help="timed samples (median taken)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sm7x.bench fa2: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    result = run([int(s) for s in a.seqlens.split(",")], [int(d) for d in a.head_dims.split(",")],
                 a.tokens, iters=a.iters, repeats=a.repeats)
    print_table(result)
    _output.write(result, a.out, a.plot, draw)
    return 0
