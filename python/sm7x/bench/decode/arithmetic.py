"""The arithmetic of the decode benchmark, no GPU: its sizes and goals, the query/KV
shape, the bytes a decode step must read, the caches a (batch, kv_len) allocates against
the memory budget, the chunked-prefill FLOPs, the splits a decode plan chose."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
