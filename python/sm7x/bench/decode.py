"""sm7x paged decode (split-KV) against torch SDPA's flash and memory-efficient backends.

``[SM7X_FA2_FORCE=sm75] python -m sm7x.bench decode [--out decode.json] [--plot decode.png]
[--batches 1,8,16,64] [--lens 1k,2k,...,128k] [--shape 32/8/128] [--quick]``

Decode: fp16, head dim 128, GQA 32 query heads / 8 KV heads (the numbers below; ``--shape
H/HK/D`` sets others, e.g. 16/8/256), one query token per sequence, every sequence of a
batch ``kv_len`` keys long. sm7x reads a vLLM-style paged
cache (``[num_pages, 16, 8, 128]``, the pages of the block table a random permutation, so
no sequence is contiguous in memory) through ``flash_attn_varlen_func(..., block_table=,
seqused_k=, out=, scheduler_metadata=plan_decode(...))``; the baselines read a contiguous
``[batch, heads, kv_len, 128]`` cache through ``scaled_dot_product_attention`` restricted
to one backend. Each backend takes GQA as ``enable_gqa=True`` when it accepts that (probed
once on a small shape, result checked against an fp32 reference); otherwise K/V are
expanded to 32 heads with ``repeat_interleave`` before timing (the output says which: an
expanded baseline reads 4x the bytes). A backend that runs neither way (SDPA flash on
Volta/Turing) is skipped with torch's reason.

Timing: every method is captured ``--iters`` times into a CUDA graph and replayed (serving
engines run decode in graphs), ``--repeats`` replays timed, median per call. sm7x is also
timed eagerly (uncaptured, with its plan), and ``flash_attn_with_kvcache`` eagerly.
GB/s = the useful bytes / time for every method alike: the K and V a decode step needs
(batch * kv_len * 8 kv heads * 128 * 2 tensors * 2 bytes) plus q and out, whatever a
baseline really reads. The device's copy bandwidth (``dst.copy_(src)`` of a large tensor,
bytes read + written / time) is measured in the same run, before and after the sweep, the
faster kept. Short caches fit in L2 and are re-read from it by consecutive calls (rows
marked ``L2``): their GB/s is above what HBM gives.

A (batch, kv_len) whose caches (paged + contiguous, + the expanded copy where a baseline
needs it) would exceed ``--budget`` x the free GPU memory is skipped (or run without the
expanded baseline), and the output says so.

Chunked prefill: 512 new query tokens per sequence over a 16k-token paged prefix (causal,
bottom-right aligned: the queries are the last 512 positions of a 16896-key sequence),
batch 1 and 4: sm7x paged vs SDPA memory-efficient with an explicit boolean bottom-right
mask, and, where the backend runs, SDPA with ``torch.nn.attention.bias.causal_lower_right``
(memory-efficient: its bottom-right mask type; flash: its causal, which is bottom-right
aligned; plain ``is_causal`` is top-left and would be wrong here). TFLOP/s counts
4 * batch * heads * head_dim * (keys each query sees), summed over queries.

On a GPU other than the arch's own the library is forced (``SM7X_FA2_FORCE``) and runs
its PTX: only correctness and the relative speed of the sm75 family mean something there.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from . import _output
from .core import _copy_fn, _time

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16  # the default --shape
ELEM = 2  # fp16 bytes
DEFAULT_BATCHES = (1, 8, 16, 64)
DEFAULT_LENS = tuple(1024 << i for i in range(8))  # 1k .. 128k
QUICK_BATCHES = (1, 16)
QUICK_LENS = (1024, 32768)
PREFILL_NEW, PREFILL_PREFIX = 512, 16384
DEFAULT_PREFILL_BATCHES = (1, 4)
GOAL_BATCH, GOAL_LEN = 16, 32768
GOAL_VS_FLASH, GOAL_FRAC_COPY = 0.75, 0.60
WARN_DIFF = 1e-2
COPY_BYTES = 2 << 30  # copy traffic: 1 GiB read + 1 GiB written

DECODE_BASELINES = ("sdpa_flash", "sdpa_efficient")
PREFILL_BASELINES = ("sdpa_efficient", "sdpa_efficient_lr", "sdpa_flash_lr")


# ---------------------------------------------------------------------------------------
# Arithmetic (no GPU).


@dataclass(frozen=True)
class Shape:
    """Query heads, KV heads and head dim of every call (``--shape H/HK/D``)."""

    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def __str__(self) -> str:
        return f"{self.heads}/{self.kv_heads}/{self.head_dim}"


DEFAULT_SHAPE = Shape()


def parse_shape(text: str) -> Shape:
    """``"H/HK/D"`` -> Shape; ValueError saying what is wrong (HK must divide H; D a multiple
    of targets.json's fa2.head_dim_multiple up to its fa2.max_head_dim, what the kernels take)."""
    from .. import _targets

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


def kv_bytes(batch: int, kv_len: int, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> int:
    """The K and V one attention step must read: batch * kv_len * kv_heads * head_dim * 2
    tensors * 2 bytes."""
    return batch * kv_len * kv_heads * head_dim * 2 * ELEM


def qo_bytes(q_tokens: int, heads: int = HEADS, head_dim: int = HEAD_DIM) -> int:
    """q read once and out written once (q_tokens = all query tokens of the batch)."""
    return 2 * q_tokens * heads * head_dim * ELEM


def useful_bytes(batch: int, kv_len: int, q_per_seq: int = 1, shape: Shape = DEFAULT_SHAPE) -> int:
    return (kv_bytes(batch, kv_len, shape.kv_heads, shape.head_dim)
            + qo_bytes(batch * q_per_seq, shape.heads, shape.head_dim))


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return None if not seconds else nbytes / seconds / 1e9


def num_pages(kv_len: int, page_size: int = PAGE_SIZE) -> int:
    return -(-kv_len // page_size)


def cache_bytes(batch: int, kv_len: int, page_size: int = PAGE_SIZE, expanded: bool = False,
                shape: Shape = DEFAULT_SHAPE) -> dict:
    """GPU bytes of the caches one (batch, kv_len) allocates: the paged K/V of sm7x (whole
    pages), the contiguous K/V of the SDPA baselines and, with expanded, their copy
    expanded to all query heads."""
    paged = kv_bytes(batch, num_pages(kv_len, page_size) * page_size, shape.kv_heads, shape.head_dim)
    contiguous = kv_bytes(batch, kv_len, shape.kv_heads, shape.head_dim)
    exp = kv_bytes(batch, kv_len, shape.heads, shape.head_dim) if expanded else 0
    return {"paged": paged, "contiguous": contiguous, "expanded": exp,
            "total": paged + contiguous + exp}


def fits_budget(need: int, free: int, fraction: float) -> bool:
    return need <= fraction * free


def prefill_flops(batch: int, new: int = PREFILL_NEW, prefix: int = PREFILL_PREFIX,
                  heads: int = HEADS, head_dim: int = HEAD_DIM) -> int:
    """4 * batch * heads * head_dim * keys seen, summed over the new queries; query i
    (0-based, bottom-right causal) sees prefix + i + 1 keys."""
    seen = new * prefix + new * (new + 1) // 2
    return 4 * batch * heads * head_dim * seen


def plan_splits(plan, _depth: int = 0) -> tuple[int | None, str | None]:
    """(splits per sequence the plan chose, the attribute it came from); the largest when
    they differ. Tries a few names and a nested plan, so the bench runs whatever the
    DecodePlan calls it; (None, None) when nothing fits."""
    if plan is None or _depth > 2:
        return None, None
    for name in ("num_splits", "splits", "n_splits", "split_count"):
        v = getattr(plan, name, None)
        if v is None or callable(v):
            continue
        n = _max_int(v)
        if n is not None and n >= 1:  # 0 would be the num_splits=0 (auto) argument
            return n, name
    for name in ("split_plan", "plan", "sched", "metadata"):
        inner = getattr(plan, name, None)
        if inner is not None and inner is not plan:
            n, attr = plan_splits(inner, _depth + 1)
            if n is not None:
                return n, f"{name}.{attr}"
    return None, None


def _max_int(v) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, torch.Tensor):
        return int(v.max().item()) if v.numel() else None
    try:
        values = memoryview(v).tolist()
    except TypeError:
        try:
            values = list(v)
        except TypeError:
            try:
                return int(v)
            except (TypeError, ValueError):
                return None
    flat = []
    stack = [values]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        else:
            flat.append(x)
    try:
        return max(int(x) for x in flat) if flat else None
    except (TypeError, ValueError):
        return None


def ratio(t_base: float | None, t_ours: float | None) -> float | None:
    """ours / base in GB/s (or TFLOP/s) = base time / our time."""
    return t_base / t_ours if t_base and t_ours else None


def find_row(result: dict, batch: int, kv_len: int) -> dict | None:
    for r in result.get("results", []):
        if r.get("batch") == batch and r.get("kv_len") == kv_len:
            return r
    return None


def _fmt(x, spec: str, width: int) -> str:
    return f"{x:{width}{spec}}" if x is not None else f"{'-':>{width}}"


def goal_lines(result: dict) -> list[str]:
    """The issue's goal line for 32k x batch 16."""
    label = f"{GOAL_LEN // 1024}k x batch {GOAL_BATCH}"
    r = find_row(result, GOAL_BATCH, GOAL_LEN)
    if r is None:
        return [f"{label}: not measured (add --batches {GOAL_BATCH} --lens {GOAL_LEN})"]
    if r.get("skipped"):
        return [f"{label}: skipped ({r['skipped']})"]
    vs = r.get("sm7x_over_sdpa_flash")
    frac = r.get("frac_of_copy")
    if vs is None:
        why = (result.get("baselines", {}).get("decode", {}).get("sdpa_flash", {}).get("note")
               or "not measured")
        vs_s = f"n/a (sdpa_flash: {why})"
    else:
        vs_s = f"{vs:.2f}"
    frac_s = f"{frac:.2f}" if frac is not None else "n/a"

    def met(x, goal):
        return "" if x is None else (" [met]" if x >= goal else " [missed]")

    return [f"{label}: sm7x/sdpa_flash = {vs_s} (goal >= {GOAL_VS_FLASH:.2f})"
            f"{met(vs, GOAL_VS_FLASH)}, "
            f"fraction of copy bandwidth = {frac_s} (goal >= {GOAL_FRAC_COPY:.2f})"
            f"{met(frac, GOAL_FRAC_COPY)}"]


# ---------------------------------------------------------------------------------------
# Tables.

DECODE_HEADER = (f"{'batch':>5} {'kv_len':>7} {'KV MB':>8} {'splits':>6} {'sm7x us':>9} "
                 f"{'sm7x GB/s':>9} {'eager us':>9} {'kvc us':>8} {'flash GB/s':>10} "
                 f"{'eff GB/s':>9} {'x flash':>7} {'x eff':>6} {'%copy':>6} {'max diff':>9}")


def format_decode_row(r: dict) -> str:
    head = f"{r['batch']:>5} {r['kv_len']:>7}"
    if r.get("skipped"):
        return f"{head}  skipped: {r['skipped']}"
    frac = r.get("frac_of_copy")
    flags = []
    if r.get("l2_resident"):
        flags.append("L2")
    for b in DECODE_BASELINES:
        if r.get(f"{b}_gqa") == "expanded":
            flags.append(f"{b.split('_')[1]}:expanded")
    if r.get("max_abs_diff") is not None and r["max_abs_diff"] > WARN_DIFF:
        flags.append("DIFF!")
    return (f"{head} {r['kv_mbytes']:>8.1f} {_fmt(r.get('num_splits'), 'd', 6)} "
            f"{_fmt(r.get('sm7x_us'), '.1f', 9)} {_fmt(r.get('sm7x_gbps'), '.0f', 9)} "
            f"{_fmt(r.get('sm7x_eager_us'), '.1f', 9)} "
            f"{_fmt(r.get('sm7x_kvcache_eager_us'), '.1f', 8)} "
            f"{_fmt(r.get('sdpa_flash_gbps'), '.0f', 10)} "
            f"{_fmt(r.get('sdpa_efficient_gbps'), '.0f', 9)} "
            f"{_fmt(r.get('sm7x_over_sdpa_flash'), '.2f', 7)} "
            f"{_fmt(r.get('sm7x_over_sdpa_efficient'), '.2f', 6)} "
            f"{_fmt(None if frac is None else 100 * frac, '.0f', 5)}% "
            f"{_fmt(r.get('max_abs_diff'), '.1e', 9)}" + (f"  {' '.join(flags)}" if flags else ""))


PREFILL_HEADER = (f"{'batch':>5} {'q':>4} {'prefix':>6} {'sm7x ms':>8} {'TFLOP/s':>7} "
                  f"{'eff-mask ms':>11} {'TFLOP/s':>7} {'eff-lr ms':>9} {'TFLOP/s':>7} "
                  f"{'flash-lr ms':>11} {'TFLOP/s':>7} {'x eff-mask':>10} {'x eff-lr':>8} "
                  f"{'x flash-lr':>10} {'max diff':>9}")


def format_prefill_row(r: dict) -> str:
    head = f"{r['batch']:>5} {r['q_len']:>4} {r['prefix']:>6}"
    if r.get("skipped"):
        return f"{head}  skipped: {r['skipped']}"

    def ms(name):
        us = r.get(f"{name}_us")
        return None if us is None else us / 1e3

    cols = [f"{_fmt(ms('sm7x'), '.3f', 8)} {_fmt(r.get('sm7x_tflops'), '.1f', 7)}"]
    for b, w in (("sdpa_efficient", 11), ("sdpa_efficient_lr", 9), ("sdpa_flash_lr", 11)):
        cols.append(f"{_fmt(ms(b), '.3f', w)} {_fmt(r.get(f'{b}_tflops'), '.1f', 7)}")
    cols.append(f"{_fmt(r.get('sm7x_over_sdpa_efficient'), '.2f', 10)} "
                f"{_fmt(r.get('sm7x_over_sdpa_efficient_lr'), '.2f', 8)} "
                f"{_fmt(r.get('sm7x_over_sdpa_flash_lr'), '.2f', 10)} "
                f"{_fmt(r.get('max_abs_diff'), '.1e', 9)}")
    flag = "  DIFF!" if r.get("max_abs_diff") is not None and r["max_abs_diff"] > WARN_DIFF else ""
    return f"{head} " + " ".join(cols) + flag


def print_summary(result: dict) -> None:
    """Everything after the live rows: baselines, notes, warnings, goal lines."""
    print(f"\n{result['device']} (capability {result['capability']}, {result.get('sm_count')} SMs, "
          f"L2 {result.get('l2_mb')} MB), torch {result['torch']} (CUDA {result.get('cuda')}), "
          f"SM7X_FA2_FORCE={result['forced']}, sm7x library {result.get('library')}")
    c = result.get("copy") or {}
    if c.get("gbps"):
        print(f"device copy bandwidth: {c['gbps']:.0f} GB/s (dst.copy_(src), "
              f"{c['bytes'] / 2**30:.1f} GiB read + written, best of {len(c['samples_gbps'])})")
    for kind, bl in (result.get("baselines") or {}).items():
        for name, b in bl.items():
            how = b.get("gqa") or "unavailable"
            note = f": {b['note']}" if b.get("note") else ""
            print(f"{kind} baseline {name}: {how}{note}")
    for n in result.get("notes", []):
        print(f"note: {n}")
    for r in result.get("results", []):
        for n in r.get("notes", []):
            print(f"note (decode batch {r['batch']}, kv_len {r['kv_len']}): {n}")
    for r in result.get("prefill", []):
        for n in r.get("notes", []):
            print(f"note (prefill batch {r['batch']}): {n}")
    for w in result.get("warnings", []):
        print(f"WARNING: {w}")
    if result.get("aborted"):
        print(f"ABORTED: {result['aborted']}")
    for line in result.get("goal", []):
        print(line)


def print_table(result: dict) -> None:
    print(DECODE_HEADER)
    for r in result.get("results", []):
        print(format_decode_row(r))
    if result.get("prefill"):
        print("\n" + PREFILL_HEADER)
        for r in result["prefill"]:
            print(format_prefill_row(r))
    print_summary(result)


# ---------------------------------------------------------------------------------------
# GPU side.


def _sdpa():
    return torch.nn.functional.scaled_dot_product_attention


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return SDPBackend.FLASH_ATTENTION if "flash" in name else SDPBackend.EFFICIENT_ATTENTION


def _causal_lr(sq: int, sk: int):
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(sq, sk)


def _bottom_right_mask(sq: int, sk: int, device) -> torch.Tensor:
    """bool [sq, sk]: query i sees key j iff j <= i + sk - sq."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)


def _sdpa_call(kind: str, q, k, v, gqa: bool, mask=None, lr=None):
    """kind: decode (no mask: one query sees every key), mask (explicit boolean mask),
    lr (causal_lower_right bias)."""
    kw = {"enable_gqa": True} if gqa else {}
    if kind == "decode":
        return _sdpa()(q, k, v, **kw)
    if kind == "mask":
        return _sdpa()(q, k, v, attn_mask=mask, **kw)
    return _sdpa()(q, k, v, attn_mask=lr, **kw)


def _reference(q, k, v, causal: bool) -> torch.Tensor:
    """fp32 attention, [b, H, sq, D] from k/v [b, HK, sk, D] (probe sizes only)."""
    g = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(g, 1) for t in (k, v))
    s = q.float() @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~_bottom_right_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return s.softmax(-1) @ vf


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def probe_sdpa(name: str, kind: str, dev, shape: Shape = DEFAULT_SHAPE) -> dict:
    """Whether SDPA backend `name` runs call `kind` on GQA inputs, and how: {"gqa":
    "enable_gqa" | "expanded" | None, "note": why not / what}. Checked on a small shape
    against an fp32 reference, so a path that runs but answers wrong counts as not running."""
    from torch.nn.attention import sdpa_kernel

    b, sq, sk = 2, (1 if kind == "decode" else 16), 80
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, shape.heads, sq, shape.head_dim, device=dev, dtype=torch.float16,
                    generator=gen)
    k, v = (torch.randn(b, shape.kv_heads, sk, shape.head_dim, device=dev, dtype=torch.float16,
                        generator=gen) for _ in range(2))
    ref = _reference(q, k, v, causal=kind != "decode")
    mask = _bottom_right_mask(sq, sk, dev) if kind == "mask" else None
    lr = _causal_lr(sq, sk) if kind == "lr" else None
    reasons = []
    for mode in ("enable_gqa", "expanded"):
        kk, vv = (k, v) if mode == "enable_gqa" else (
            _expand(k, shape), _expand(v, shape))
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel(_backend(name)):
            warnings.simplefilter("always")
            try:
                out = _sdpa_call(kind, q, kk, vv, mode == "enable_gqa", mask, lr)
                torch.cuda.synchronize()
                err = (out.float() - ref).abs().max().item()
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
                why = [str(w.message).strip().splitlines()[0] for w in caught][:3]
                reasons.append(f"{mode}: {_first_line(e)}"
                               + (f" ({'; '.join(why)})" if why else ""))
                continue
        if err <= 2e-2:
            return {"gqa": mode, "note": "; ".join(reasons) or None}
        reasons.append(f"{mode}: ran but max abs error {err:.2e} vs fp32 reference")
    return {"gqa": None, "note": "; ".join(reasons)}


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _timed(name: str, fn: Callable[[], object], iters: int, repeats: int, graph: bool,
           notes: list[str]) -> float | None:
    """Median seconds per call, None (and a note) when the call or its capture fails."""
    try:
        return _time(fn, iters, repeats, graph)
    except Exception as e:  # noqa: BLE001 - report and go on with the other methods
        notes.append(f"{name} ({'CUDA graph' if graph else 'eager'}) failed: {_first_line(e)}")
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return None


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _decode_reference(q: torch.Tensor, k_c: torch.Tensor, v_c: torch.Tensor) -> torch.Tensor:
    """Decode without expanding K/V: q [b, H, D], k/v [b, HK, L, D] -> [b, H, D]; fp16
    matmuls per KV-head group (query head h uses KV head h // group), fp32 softmax."""
    b, h, d = q.shape
    hk = k_c.shape[1]
    s = ((q * d ** -0.5).view(b, hk, h // hk, d) @ k_c.transpose(-1, -2)).float()
    return (s.softmax(-1).to(v_c.dtype) @ v_c).view(b, h, d)


def _fill_paged(contig: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """contig [batch, HK, L, D] -> paged [num_pages, page_size, HK, D] holding key j of
    sequence b at row j % page_size of page block_table[b, j // page_size] (one sequence at
    a time: no full-size temporary). Rows past L are zero."""
    batch, hk, length, d = contig.shape
    pages = block_table.numel()
    paged = torch.zeros(pages, page_size, hk, d, device=contig.device, dtype=contig.dtype)
    flat = paged.view(pages * page_size, hk, d)
    tok = torch.arange(length, device=contig.device)
    page_of, row_of = tok // page_size, tok % page_size
    for b in range(batch):
        slots = block_table[b].long()[page_of] * page_size + row_of
        flat.index_copy_(0, slots, contig[b].transpose(0, 1))
    return paged


def _paged_inputs(batch: int, kv_len: int, page_size: int, gen: torch.Generator, dev,
                  shape: Shape):
    """Contiguous K/V for SDPA, the same keys in a paged cache for sm7x (random page
    permutation), the block table and seqused_k."""
    k_c, v_c = (torch.randn(batch, shape.kv_heads, kv_len, shape.head_dim, device=dev,
                            dtype=torch.float16, generator=gen) for _ in range(2))
    nblk = num_pages(kv_len, page_size)
    block_table = torch.randperm(batch * nblk, device=dev, generator=gen).to(torch.int32)
    block_table = block_table.view(batch, nblk).contiguous()
    k_p, v_p = (_fill_paged(t, block_table, page_size) for t in (k_c, v_c))
    seqused = torch.full((batch,), kv_len, device=dev, dtype=torch.int32)
    return k_c, v_c, k_p, v_p, block_table, seqused


def _expand(t: torch.Tensor, shape: Shape) -> torch.Tensor:
    """[b, HK, ...] -> [b, H, ...]: each KV head repeated for its query heads."""
    return t.repeat_interleave(shape.group, dim=1)


def _make_plan(batch, q_len, kv_len, dev, num_splits, notes, shape: Shape):
    from ..fa2 import plan_decode

    try:
        return plan_decode(batch, q_len, kv_len, shape.heads, shape.kv_heads, shape.head_dim,
                           device=dev, num_splits=num_splits)
    except Exception as e:  # noqa: BLE001
        notes.append(f"plan_decode failed, sm7x runs without a plan: {_first_line(e)}")
        return None


def _decode_row(batch, kv_len, a, baselines, free, gen, dev, l2_bytes) -> dict:
    from torch.nn.attention import sdpa_kernel

    from ..fa2 import flash_attn_varlen_func

    notes: list[str] = []
    sh = a.shape
    nbytes = useful_bytes(batch, kv_len, shape=sh)
    kvb = kv_bytes(batch, kv_len, sh.kv_heads, sh.head_dim)
    row: dict = {"batch": batch, "kv_len": kv_len, "kv_mbytes": kvb / 1e6, "useful_bytes": nbytes}
    need_exp = any(b["gqa"] == "expanded" for b in baselines.values())
    base = cache_bytes(batch, kv_len, a.page_size, expanded=False, shape=sh)
    full = cache_bytes(batch, kv_len, a.page_size, expanded=need_exp, shape=sh)
    budget = a.budget * free
    row["cache_gb"] = full["total"] / 1e9
    if not fits_budget(base["total"], free, a.budget):
        row["skipped"] = (f"caches need {base['total'] / 1e9:.1f} GB > "
                          f"budget {budget / 1e9:.1f} GB "
                          f"({a.budget:.0%} of {free / 1e9:.1f} GB free)")
        return row
    use_exp = need_exp and fits_budget(full["total"], free, a.budget)
    if need_exp and not use_exp:
        notes.append(f"K/V expanded to {sh.heads} heads would need {full['total'] / 1e9:.1f} GB > "
                     f"budget {budget / 1e9:.1f} GB: the baselines that need it are skipped")

    k_c, v_c, k_p, v_p, bt, seqused = _paged_inputs(batch, kv_len, a.page_size, gen, dev, sh)
    q = torch.randn(batch, sh.heads, sh.head_dim, device=dev, dtype=torch.float16, generator=gen)
    cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)
    plan = _make_plan(batch, 1, kv_len, dev, a.num_splits, notes, sh)
    row["num_splits"], row["num_splits_attr"] = plan_splits(plan)
    for attr in ("total_splits", "waves"):  # DecodePlan's, where it has them
        v = getattr(plan, attr, None)
        row[f"plan_{attr}"] = v if isinstance(v, int) else None
    if plan is not None and row["num_splits"] is None:
        notes.append(f"number of splits not found on {type(plan).__name__}")

    def sm7x():
        return flash_attn_varlen_func(q, k_p, v_p, cu_q, None, 1, kv_len, causal=True,
                                      block_table=bt, seqused_k=seqused, out=out,
                                      scheduler_metadata=plan)

    ref = _decode_reference(q, k_c, v_c)
    diffs: dict[str, float] = {}
    ours = None
    try:
        sm7x()
        ours = out.clone()
        diffs["torch_matmul"] = _max_diff(ours, ref)
    except Exception as e:  # noqa: BLE001
        notes.append(f"sm7x failed: {_first_line(e)}")

    times: dict[str, float | None] = {}
    if ours is not None:
        times["sm7x"] = _timed("sm7x", sm7x, a.iters, a.repeats, True, notes)
        times["sm7x_eager"] = _timed("sm7x eager", sm7x, a.iters, a.repeats, False, notes)
    try:
        from ..fa2 import flash_attn_with_kvcache

        q4 = q.unsqueeze(1)

        def kvc():
            return flash_attn_with_kvcache(q4, k_p, v_p, cache_seqlens=seqused, block_table=bt,
                                           causal=True, num_splits=0)

        o = kvc()
        diffs["sm7x_kvcache"] = _max_diff(o.reshape(batch, sh.heads, sh.head_dim), ref)
        times["sm7x_kvcache_eager"] = _timed("flash_attn_with_kvcache", kvc, a.iters, a.repeats,
                                             False, notes)
    except Exception as e:  # noqa: BLE001
        notes.append(f"flash_attn_with_kvcache failed: {_first_line(e)}")

    qs = q.unsqueeze(2)  # [b, H, 1, D]
    k_e = v_e = None
    for name, b in baselines.items():
        row[f"{name}_gqa"] = b["gqa"]
        if b["gqa"] is None or (b["gqa"] == "expanded" and not use_exp):
            row[f"{name}_gqa"] = None
            continue
        if b["gqa"] == "expanded" and k_e is None:
            k_e, v_e = _expand(k_c, sh), _expand(v_c, sh)  # outside the timed region
        kk, vv = (k_c, v_c) if b["gqa"] == "enable_gqa" else (k_e, v_e)
        gqa = b["gqa"] == "enable_gqa"

        def call(kk=kk, vv=vv, gqa=gqa):
            return _sdpa_call("decode", qs, kk, vv, gqa)

        with sdpa_kernel(_backend(name)):
            try:
                o = call().squeeze(2)
                diffs[name] = _max_diff(ours, o) if ours is not None else None
                times[name] = _timed(name, call, a.iters, a.repeats, True, notes)
            except Exception as e:  # noqa: BLE001
                notes.append(f"{name} failed: {_first_line(e)}")

    t_sm = times.get("sm7x") or times.get("sm7x_eager")
    if times.get("sm7x") is None and times.get("sm7x_eager") is not None:
        notes.append("sm7x GB/s is the eager time (CUDA graph capture failed)")
    row["sm7x_timing"] = "graph" if times.get("sm7x") else ("eager" if t_sm else None)
    for name in ("sm7x", "sm7x_eager", "sm7x_kvcache_eager") + tuple(baselines):
        t = t_sm if name == "sm7x" else times.get(name)
        row[f"{name}_us"] = None if t is None else t * 1e6
        row[f"{name}_gbps"] = gbps(nbytes, t)
    for name in baselines:
        row[f"sm7x_over_{name}"] = ratio(times.get(name), t_sm)
    row["frac_of_copy"] = None  # filled in once the copy bandwidth is final
    sdpa_diffs = [d for n, d in diffs.items() if n in baselines and d is not None]
    row["max_abs_diff_vs"] = diffs
    row["max_abs_diff"] = max(sdpa_diffs) if sdpa_diffs else diffs.get("torch_matmul")
    row["l2_resident"] = bool(l2_bytes and kvb < l2_bytes)
    row["notes"] = notes
    return row


def _prefill_row(batch, a, baselines, free, gen, dev) -> dict:
    from torch.nn.attention import sdpa_kernel

    from ..fa2 import flash_attn_varlen_func

    new, prefix = PREFILL_NEW, PREFILL_PREFIX
    lk = prefix + new
    notes: list[str] = []
    sh = a.shape
    flops = prefill_flops(batch, new, prefix, sh.heads, sh.head_dim)
    row: dict = {"batch": batch, "q_len": new, "prefix": prefix, "kv_len": lk, "flops": flops}
    need_exp = any(b["gqa"] == "expanded" for b in baselines.values())
    need = cache_bytes(batch, lk, a.page_size, expanded=need_exp, shape=sh)["total"]
    if not fits_budget(need, free, a.budget):
        row["skipped"] = f"caches need {need / 1e9:.1f} GB > budget {a.budget * free / 1e9:.1f} GB"
        return row
    k_c, v_c, k_p, v_p, bt, seqused = _paged_inputs(batch, lk, a.page_size, gen, dev, sh)
    q = torch.randn(batch * new, sh.heads, sh.head_dim, device=dev, dtype=torch.float16,
                    generator=gen)
    cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int32) * new
    out = torch.empty_like(q)
    plan = _make_plan(batch, new, lk, dev, a.num_splits, notes, sh)
    row["num_splits"], row["num_splits_attr"] = plan_splits(plan)

    def sm7x():
        return flash_attn_varlen_func(q, k_p, v_p, cu_q, None, new, lk, causal=True,
                                      block_table=bt, seqused_k=seqused, out=out,
                                      scheduler_metadata=plan)

    ours = None
    times: dict[str, float | None] = {}
    try:
        sm7x()
        ours = out.clone()
        times["sm7x"] = _timed("sm7x", sm7x, a.iters, a.repeats, plan is not None, notes)
        if times["sm7x"] is None and plan is not None:
            times["sm7x"] = _timed("sm7x", sm7x, a.iters, a.repeats, False, notes)
            row["sm7x_timing"] = "eager"
        else:
            row["sm7x_timing"] = "graph" if plan is not None else "eager"
    except Exception as e:  # noqa: BLE001
        notes.append(f"sm7x failed: {_first_line(e)}")

    qs = q.view(batch, new, sh.heads, sh.head_dim).transpose(1, 2)  # [b, H, new, D]
    mask = _bottom_right_mask(new, lk, dev)
    lr = _causal_lr(new, lk)
    diffs: dict[str, float] = {}
    outs: dict[str, torch.Tensor] = {}
    k_e = v_e = None
    for name, b in baselines.items():
        row[f"{name}_gqa"] = b["gqa"]
        if b["gqa"] is None:
            continue
        if b["gqa"] == "expanded" and k_e is None:
            k_e, v_e = _expand(k_c, sh), _expand(v_c, sh)
        kk, vv = (k_c, v_c) if b["gqa"] == "enable_gqa" else (k_e, v_e)
        kind = "mask" if name == "sdpa_efficient" else "lr"

        def call(kk=kk, vv=vv, gqa=b["gqa"] == "enable_gqa", kind=kind):
            return _sdpa_call(kind, qs, kk, vv, gqa, mask, lr)

        with sdpa_kernel(_backend(name)):
            try:
                o = call().transpose(1, 2).reshape(batch * new, sh.heads, sh.head_dim)
                outs[name] = o
                if ours is not None:
                    diffs[name] = _max_diff(ours, o)
                times[name] = _timed(name, call, a.iters, a.repeats, True, notes)
            except Exception as e:  # noqa: BLE001
                notes.append(f"{name} failed: {_first_line(e)}")
    if "sdpa_efficient" in outs:  # the lower-right paths against the explicit mask
        for name, o in outs.items():
            if name != "sdpa_efficient":
                diffs[f"{name}_vs_sdpa_efficient"] = _max_diff(o, outs["sdpa_efficient"])
    t_sm = times.get("sm7x")
    for name in ("sm7x",) + tuple(baselines):
        t = times.get(name)
        row[f"{name}_us"] = None if t is None else t * 1e6
        row[f"{name}_tflops"] = None if not t else flops / t / 1e12
    for name in baselines:
        row[f"sm7x_over_{name}"] = ratio(times.get(name), t_sm)
    sdpa_diffs = [d for n, d in diffs.items() if n in baselines]
    row["max_abs_diff_vs"] = diffs
    row["max_abs_diff"] = max(sdpa_diffs) if sdpa_diffs else None
    row["notes"] = notes
    return row


def _copy_bandwidth(nbytes: int, iters: int, repeats: int) -> float:
    # Eager: a device-to-device copy_ captured in a CUDA graph becomes a memcpy node that
    # ran at about 2.8 TB/s on the H200 (the copy engine), against about 4.2 TB/s eager:
    # the bandwidth to compare a kernel's reads with is the eager one.
    copy = _copy_fn(nbytes)
    t = _time(copy, iters, repeats, False)
    del copy
    _free_cuda()
    return nbytes / t / 1e9


def run(batches=DEFAULT_BATCHES, lens=DEFAULT_LENS, prefill_batches=DEFAULT_PREFILL_BATCHES,
        iters: int = 20, repeats: int = 10, budget: float = 0.4, page_size: int = PAGE_SIZE,
        num_splits: int = 0, seed: int = 0, result: dict | None = None,
        shape: Shape = DEFAULT_SHAPE) -> dict:
    """Fills and returns `result` (pass a dict to keep what was measured when a later step
    raises)."""
    import argparse

    from ..fa2 import _loader

    a = argparse.Namespace(iters=iters, repeats=repeats, budget=budget, page_size=page_size,
                           num_splits=num_splits, shape=shape)
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 0) or 0
    print(f"{props.name} (capability {props.major}.{props.minor}, "
          f"{props.multi_processor_count} SMs, "
          f"L2 {l2 / 2**20:.0f} MB), torch {torch.__version__}, "
          f"SM7X_FA2_FORCE={os.environ.get('SM7X_FA2_FORCE')}", flush=True)
    result = {} if result is None else result
    result.update({
        "benchmark": "sm7x paged decode vs torch SDPA (flash, memory-efficient)",
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_mb": round(l2 / 2**20, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "forced": os.environ.get("SM7X_FA2_FORCE"),
        "library": None,
        "config": {"dtype": "float16", "heads": shape.heads, "kv_heads": shape.kv_heads,
                   "head_dim": shape.head_dim,
                   "page_size": page_size, "page_order": "random permutation",
                   "batches": list(batches), "kv_lens": list(lens),
                   "prefill": {"batches": list(prefill_batches), "q_len": PREFILL_NEW,
                               "prefix": PREFILL_PREFIX, "causal": "bottom-right"},
                   "plan_num_splits_arg": num_splits, "memory_budget_fraction": budget,
                   "seed": seed},
        "timing": {"iters_per_sample": iters, "samples": repeats, "statistic": "median",
                   "cuda_graph": "all methods except *_eager"},
        "bytes": ("useful bytes for every method: K and V of every sequence "
                  "(batch * kv_len * kv_heads * head_dim * 2 * 2) + q + out; an expanded "
                  "baseline really reads more"),
        "results": [], "prefill": [], "notes": [], "warnings": [],
    })
    _free_cuda()
    free0, _ = torch.cuda.mem_get_info(dev)
    copy_bytes = int(min(COPY_BYTES, 0.2 * free0)) // 4 * 4
    result["copy"] = {"bytes": copy_bytes, "samples_gbps": [], "gbps": None}
    result["copy"]["samples_gbps"].append(_copy_bandwidth(copy_bytes, iters, repeats))
    result["copy"]["gbps"] = max(result["copy"]["samples_gbps"])
    print(f"copy bandwidth {result['copy']['gbps']:.0f} GB/s", flush=True)

    result["baselines"] = {
        "decode": {n: probe_sdpa(n, "decode", dev, shape) for n in DECODE_BASELINES},
        "prefill": {"sdpa_efficient": probe_sdpa("sdpa_efficient", "mask", dev, shape),
                    "sdpa_efficient_lr": probe_sdpa("sdpa_efficient", "lr", dev, shape),
                    "sdpa_flash_lr": probe_sdpa("sdpa_flash", "lr", dev, shape)},
    }
    for kind, bl in result["baselines"].items():
        for n, b in bl.items():
            print(f"{kind} baseline {n}: {b['gqa'] or 'unavailable'}"
                  + (f" ({b['note']})" if b.get("note") else ""), flush=True)
    _free_cuda()

    gen = torch.Generator(device=dev).manual_seed(seed)
    print(DECODE_HEADER, flush=True)
    for batch in batches:
        for kv_len in lens:
            _free_cuda()
            free, _ = torch.cuda.mem_get_info(dev)
            row = _decode_row(batch, kv_len, a, result["baselines"]["decode"], free, gen, dev, l2)
            if row.get("sm7x_gbps") and result["copy"]["gbps"]:
                row["frac_of_copy"] = row["sm7x_gbps"] / result["copy"]["gbps"]
            result["results"].append(row)
            if result["library"] is None and _loader.loaded():
                result["library"] = {k: str(p) for k, p in _loader.loaded().items()}
            print(format_decode_row(row), flush=True)
    _free_cuda()

    if prefill_batches:
        print("\n" + PREFILL_HEADER, flush=True)
    for batch in prefill_batches:
        _free_cuda()
        free, _ = torch.cuda.mem_get_info(dev)
        row = _prefill_row(batch, a, result["baselines"]["prefill"], free, gen, dev)
        result["prefill"].append(row)
        print(format_prefill_row(row), flush=True)
    _free_cuda()

    result["copy"]["samples_gbps"].append(_copy_bandwidth(copy_bytes, iters, repeats))
    result["copy"]["gbps"] = max(result["copy"]["samples_gbps"])
    finish(result)
    return result


def finish(result: dict) -> None:
    """Derived fields that need the whole run: fraction of copy bandwidth (the best copy
    sample), warnings, goal lines."""
    copy = (result.get("copy") or {}).get("gbps")
    warns = result.setdefault("warnings", [])
    warns.clear()
    for r in result.get("results", []):
        if r.get("sm7x_gbps") and copy:
            r["frac_of_copy"] = r["sm7x_gbps"] / copy
        d = r.get("max_abs_diff")
        if d is not None and d > WARN_DIFF:
            warns.append(f"decode batch {r['batch']} kv_len {r['kv_len']}: max abs diff sm7x vs "
                         f"SDPA = {d:.3e} > {WARN_DIFF} ({r.get('max_abs_diff_vs')})")
        if not r.get("skipped") and r.get("sm7x_us") is None:
            warns.append(f"decode batch {r['batch']} kv_len {r['kv_len']}: sm7x did not run")
    for r in result.get("prefill", []):
        d = r.get("max_abs_diff")
        if d is not None and d > WARN_DIFF:
            warns.append(f"prefill batch {r['batch']}: max abs diff sm7x vs SDPA = {d:.3e} > "
                         f"{WARN_DIFF} ({r.get('max_abs_diff_vs')})")
        if not r.get("skipped") and r.get("sm7x_us") is None:
            warns.append(f"prefill batch {r['batch']}: sm7x did not run")
    skipped = [f"{r['batch']}x{r['kv_len']}" for r in result.get("results", []) if r.get("skipped")]
    if skipped:
        msg = f"skipped (memory budget): batch x kv_len {', '.join(skipped)}"
        if msg not in result.setdefault("notes", []):
            result["notes"].append(msg)
    result["goal"] = goal_lines(result)


def draw(result: dict, plt):
    """The PNG (see _output.write): decode GB/s vs kv_len, one panel per batch, one line
    per method, the copy bandwidth dotted; chunked prefill TFLOP/s in the last panel."""
    rows = [r for r in result.get("results", []) if not r.get("skipped")]
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    pre = [r for r in result.get("prefill", []) if not r.get("skipped")]
    n = len(batches) + (1 if pre else 0)
    fig, axes = plt.subplots(1, max(n, 1), figsize=(4.5 * max(n, 1), 4), squeeze=False)
    styles = {"sm7x_gbps": ("sm7x (graph)", "-", "o"), "sm7x_eager_gbps": ("sm7x eager", "--", "."),
              "sdpa_flash_gbps": ("SDPA flash", "-", "s"),
              "sdpa_efficient_gbps": ("SDPA mem-efficient", "-", "^")}
    copy = (result.get("copy") or {}).get("gbps")
    for ax, b in zip(axes[0], batches):
        rs = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["kv_len"])
        for key, (label, ls, marker) in styles.items():
            pts = [(r["kv_len"], r[key]) for r in rs if r.get(key)]
            if pts:
                exp = any(r.get(key.replace("_gbps", "_gqa")) == "expanded" for r in rs)
                ax.plot(*zip(*pts), ls, marker=marker,
                        label=label + (" (K/V expanded)" if exp else ""))
        if copy:
            ax.axhline(copy, ls=":", color="gray", label="device copy")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["kv_len"] for r in rs],
                      [f"{r['kv_len'] // 1024}k" if r["kv_len"] >= 1024 else str(r["kv_len"])
                       for r in rs])
        ax.set_title(f"decode, batch {b}")
        ax.set_xlabel("kv_len")
        ax.set_ylabel("GB/s of K/V read")
        ax.legend(fontsize=7)
    if pre:
        ax = axes[0][n - 1]
        series = {}
        for key, label in (("sm7x", "sm7x"), ("sdpa_efficient", "SDPA eff (bool mask)"),
                           ("sdpa_efficient_lr", "SDPA eff (lower-right)"),
                           ("sdpa_flash_lr", "SDPA flash (lower-right)")):
            vals = [r.get(f"{key}_tflops") or 0.0 for r in pre]
            if any(vals):
                series[label] = vals
        if series:
            _output.grouped_bars(ax, [f"batch {r['batch']}" for r in pre], series)
            ax.legend(fontsize=7)
        ax.set_title(f"chunked prefill {PREFILL_NEW} q / {PREFILL_PREFIX // 1024}k prefix")
        ax.set_ylabel("TFLOP/s")
    forced = f", SM7X_FA2_FORCE={result['forced']}" if result.get("forced") else ""
    cfg = result["config"]
    fig.suptitle(f"sm7x paged decode vs SDPA, {result['device']}{forced}, fp16, "
                 f"{cfg['heads']}/{cfg['kv_heads']} heads, d{cfg['head_dim']}, "
                 f"page {cfg['page_size']}")
    return fig


def parse_args(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser(prog="python -m sm7x.bench decode", description=__doc__,
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
        from ..fa2 import flash_attn_varlen_func, plan_decode  # noqa: F401
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
