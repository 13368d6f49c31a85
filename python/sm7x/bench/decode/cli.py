"""The decode benchmark's command line (``python -m sm7x.bench decode``): the argument
parsing (sizes, ``--shape``, ``--kv-dtype``) and :func:`main`, which runs the sweep and
writes what was measured, or with ``--context-table`` prints the context table (no GPU)."""

from __future__ import annotations

import sys

import torch

from .. import _output
from .arithmetic import (DEFAULT_BATCHES, DEFAULT_LENS, DEFAULT_PREFILL_BATCHES, DEFAULT_SHAPE,
                         KV_DTYPE_ALIASES, KV_DTYPES, PAGE_SIZE, QUICK_BATCHES, QUICK_LENS, Shape,
                         context_table)
from .report import context_table_markdown, draw, finish, print_summary
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


def parse_kv_dtypes(text: str) -> list[str]:
    """``"fp16,fp8_e4m3"`` -> the cache formats in KV_DTYPES order, fp16 always first (the
    8-bit ratios are against its sm7x row); ``"all"`` -> every format; ``"fp8"`` is
    ``fp8_e4m3`` and ``"int8"`` ``int8_per_token_head`` (vLLM's names). ValueError naming the unknown entry and the choices."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--kv-dtype {text!r}: empty; choose from {', '.join(KV_DTYPES)} or all")
    if "all" in names:
        return list(KV_DTYPES)
    chosen = {"fp16"}
    for n in names:
        n = KV_DTYPE_ALIASES.get(n, n)
        if n not in KV_DTYPES:
            raise ValueError(f"--kv-dtype: unknown cache format {n!r}; choose from "
                             f"{', '.join(KV_DTYPES)} (comma-separated) or all")
        chosen.add(n)
    return [k for k in KV_DTYPES if k in chosen]


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
    from . import __doc__ as description  # the package's: what the benchmark measures

    p = _output.argument_parser("decode", description, plot="a PNG")
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
    p.add_argument("--kv-dtype", default="fp16", metavar="LIST",
                   help="KV cache formats, comma-separated from fp16, fp8_e4m3, fp8_e5m2, "
                   "int8_per_token_head (fp8 = fp8_e4m3, int8 = int8_per_token_head), or all "
                   "(default: %(default)s). Each 8-bit format adds sm7x rows "
                   "over an 8-bit copy of the same paged cache (decode and chunked prefill): "
                   "step time, GB/s of the bytes it reads, ratio to the fp16 sm7x time; fp16 "
                   "always runs")
    p.add_argument("--context-table", action="store_true",
                   help="print the largest context per KV format for 7B/8B models on a T4 and "
                   "a V100 (arithmetic from model configs, no GPU) and exit; a normal run puts "
                   "it in the JSON")
    p.add_argument("--weights-gb", type=float,
                   help="context table: also a row per model and card with weights of this "
                   "many GB (1e9 bytes), e.g. a 4-bit checkpoint")
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
        a.kv_dtypes = parse_kv_dtypes(a.kv_dtype)
    except ValueError as e:
        p.error(str(e))
    if a.weights_gb is not None and not a.weights_gb > 0:
        p.error("--weights-gb must be > 0")
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


def _context_table(a) -> dict:
    return context_table(weights_bytes=None if a.weights_gb is None else a.weights_gb * 1e9)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.context_table:  # arithmetic only: no CUDA needed
        print(context_table_markdown(_context_table(a)))
        return 0
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
            a.num_splits, a.seed, result=result, shape=a.shape, kv_dtypes=a.kv_dtypes)
    except (Exception, KeyboardInterrupt) as e:  # keep what was measured
        result["aborted"] = _first_line(e)
        rc = 1
        if "results" in result:
            finish(result)
        import traceback

        traceback.print_exc()
    if result.get("results") is not None:
        print_summary(result)
        result["context_table"] = _context_table(a)  # in the JSON, not printed
        _output.write(result, a.out, a.plot, draw)
    return rc

