"""The decode benchmark's command line (``python -m sm7x.bench decode``): the argument
parsing (sizes, ``--shape``) and :func:`main`, which runs the sweep and writes what was
measured."""

from __future__ import annotations

import sys

import torch

from .. import _output
from .arithmetic import (DEFAULT_BATCHES, DEFAULT_LENS, DEFAULT_PREFILL_BATCHES, DEFAULT_SHAPE,
                         PAGE_SIZE, QUICK_BATCHES, QUICK_LENS, Shape)
from .report import draw, finish, print_summary
from .runs import _first_line, run


def parse_shape(text: str) -> Shape:
    """``"H/HK/D"`` -> Shape; ValueError saying what is wrong (HK must divide H; D a multiple
    of targets.json's fa2.head_dim_multiple up to its fa2.max_head_dim, what the kernels take)."""
    from ... import _targets

    parts = text.strip().split("/")
    try:
        heads, kv_heads, head_dim = (int(x) for x in parts)
    except ValueError:
        raise ValueError(f"--shape {text!r}: want HEADS/KV_HEADS/HEAD_DIM, e.g. 32/8/128") from None
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"--shape {text!r}: KV heads ({kv_heads}) must divide query heads ({heads})")
    step, top = _targets.fa2_head_dim_multiple(), _targets.fa2_max_head_dim()
    if not (step <= head_dim <= top and head_dim % step == 0):
        raise ValueError(f"--shape {text!r}: head dim {head_dim} must be a multiple of {step} "
                         f"in {step}..{top}")
    return Shape(heads, kv_heads, head_dim)


def parse_sizes(text: str) -> list[int]:
    """'1k,32K,4096' -> [1024, 32768, 4096] (k = 1024, m = 1024**2); positive ints only."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part[-1] in "km":
            mult = 1024 if part[-1] == "k" else 1024 * 1024
            part = part[:-1]
        try:
            n = int(part) * mult
        except ValueError:
            raise ValueError(f"not a size: {part!r} (use e.g. 1024 or 1k)") from None
        if n <= 0:
            raise ValueError(f"sizes must be positive, got {n}")
        out.append(n)
    if not out:
        raise ValueError("empty list of sizes")
    return out


def parse_args(argv: list[str]):
    import argparse

    from . import __doc__ as description  # the package's: what the benchmark measures

    p = argparse.ArgumentParser(prog="python -m sm7x.bench decode", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    p.add_argument("--batches", help=f"comma-separated batch sizes (default: "
                   f"{','.join(map(str, DEFAULT_BATCHES))}; "
                   f"--quick: {','.join(map(str, QUICK_BATCHES))})")
    p.add_argument("--lens", help="comma-separated KV lengths, 1k = 1024 (default: 1k,2k,...,128k; "
                   "--quick: 1k,32k)")
    p.add_argument("--prefill-batches", help="batches of the chunked-prefill rows, 0 = none "
                   "(default: 1,4; --quick: 1)")
    p.add_argument("--quick", action="store_true",
                   help="a small subset for smoke tests (fewer sizes, iters and repeats)")
    p.add_argument("--iters", type=int, help="calls per timed sample / CUDA graph (default: 20; "
                   "--quick: 5)")
    p.add_argument("--repeats", type=int, help="timed samples, median taken (default: 10; "
                   "--quick: 5)")
    p.add_argument("--budget", type=float, default=0.4,
                   help="skip sizes whose caches need more than this fraction of the free GPU "
                   "memory (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=PAGE_SIZE, help="default: %(default)s")
    p.add_argument("--shape", default=str(DEFAULT_SHAPE),
                   help="QUERY_HEADS/KV_HEADS/HEAD_DIM of every call (default: %(default)s; "
                   "e.g. 16/8/256 for Gemma-2 9B)")
    p.add_argument("--num-splits", type=int, default=0,
                   help="plan_decode(num_splits=): 0 = the planner decides (default), 1 = no "
                   "split, n = at most n splits per sequence")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        a.batches = parse_sizes(a.batches) if a.batches is not None else list(
            QUICK_BATCHES if a.quick else DEFAULT_BATCHES)
        a.lens = parse_sizes(a.lens) if a.lens is not None else list(
            QUICK_LENS if a.quick else DEFAULT_LENS)
        if a.prefill_batches is None:
            a.prefill_batches = [1] if a.quick else list(DEFAULT_PREFILL_BATCHES)
        elif a.prefill_batches.strip() in ("", "0", "none"):
            a.prefill_batches = []
        else:
            a.prefill_batches = parse_sizes(a.prefill_batches)
        a.shape = parse_shape(a.shape)
    except ValueError as e:
        p.error(str(e))
    if a.iters is None:
        a.iters = 5 if a.quick else 20
    if a.repeats is None:
        a.repeats = 5 if a.quick else 10
    if a.iters < 1 or a.repeats < 1:
        p.error("--iters and --repeats must be >= 1")
    if not 0 < a.budget <= 1:
        p.error("--budget must be in (0, 1]")
    if a.page_size < 1 or a.page_size & (a.page_size - 1):
        p.error("--page-size must be a power of two")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("sm7x.bench decode: needs a CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 1
    try:
        from ...fa2 import flash_attn_varlen_func, plan_decode  # noqa: F401
    except ImportError as e:
        print(f"sm7x.bench decode: sm7x.fa2 has no paged decode API here ({e})", file=sys.stderr)
        return 1
    result: dict = {}
    rc = 0
    try:
        run(a.batches, a.lens, a.prefill_batches, a.iters, a.repeats, a.budget, a.page_size,
            a.num_splits, a.seed, result=result, shape=a.shape)
    except (Exception, KeyboardInterrupt) as e:  # keep what was measured
        result["aborted"] = _first_line(e)
        rc = 1
        if "results" in result:
            finish(result)
        import traceback

        traceback.print_exc()
    if result.get("results") is not None:
        print_summary(result)
        _output.write(result, a.out, a.plot, draw)
    return rc

