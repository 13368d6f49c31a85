"""TFLOP/s of the shipped FA2 kernels themselves (torch.profiler kernel times), to set beside
the data-flow ceilings of dataflow_sm75.cu: forward, and the backward's dV and dK/dQ passes
(split head dims) or main kernel, for one head dim, 16k tokens per batch, on a GPU.

    SM7X_FA2_FORCE=sm75 python csrc/fa2/probes/kernel_tflops.py [--head-dim 128] [--out k.json]

MMA FLOP per kernel: forward 2 GEMMs, dV pass 2, dK/dQ pass 4, unsplit main kernel 4 (its
S^T, dP^T, dV, dK; dQ counted in none), over the visible scores (half of them causal).
"""

from __future__ import annotations

import argparse
import json
import re

import torch
from torch.profiler import ProfilerActivity, profile

import sm7x.fa2 as fa2
from sm7x import _targets


def kernel_kind(name: str) -> tuple[str, int] | None:
    """(what the kernel is, GEMMs it does per score) for the FA2 kernels of a step."""
    if "fwd_kernel" in name:
        return "forward", 2
    if "bwd_kernel" in name:
        mode = re.search(r",\s*(\d)>\s*\(", name) or re.search(r"ELi(\d)EEEvNS0_9BwdParamsE", name)
        return {"1": ("dV pass", 2), "2": ("dK/dQ pass", 4)}.get(mode.group(1) if mode else "0", ("main", 4))
    return None


def seqlens(text: str) -> list[int]:
    """'2048,8192' -> [2048, 8192]: powers of two from 16 to 16384 (16k tokens per batch)."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want comma-separated integers, e.g. 2048,8192")
    bad = [s for s in out if s < 16 or s > 16384 or s & (s - 1)]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad}: each must be a power of two in 16..16384")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128,
                    help="a compiled head dim dividing 2048 (heads x head dim = 2048)")
    ap.add_argument("--seqlens", type=seqlens, default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    dims = _targets.fa2_head_dims(_targets.archs()[0])  # every arch compiles the same list
    if args.head_dim not in dims or 2048 % args.head_dim:
        ap.error(f"--head-dim {args.head_dim}: want one of {[d for d in dims if 2048 % d == 0]}")
    d, rows = args.head_dim, []
    h = 2048 // d
    for s in args.seqlens:
        for causal in (False, True):
            b = 16384 // s
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)

            def step():
                fa2.flash_attn_func(q, k, v, causal=causal).backward(do)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
            gemm = 2.0 * b * h * s * s * d * (0.5 if causal else 1.0)
            for e in prof.key_averages():
                kind = kernel_kind(e.key)
                us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                if kind and us > 0:
                    sec = us / args.steps / 1e6
                    rows.append({"head_dim": d, "heads": h, "seqlen": s, "causal": causal, "kernel": kind[0],
                                 "ms": 1e3 * sec, "tflops": kind[1] * gemm / sec / 1e12})
                    r = rows[-1]
                    print(f"d{d} s{s:<5} causal={causal!s:<5} {r['kernel']:<11} {r['ms']:7.3f} ms {r['tflops']:6.1f} TFLOP/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
