"""The arithmetic of the decode benchmark, no GPU: its sizes and goals, the query/KV
shape, the bytes a decode step must read (fp16 or 8-bit cache), the caches a (batch,
kv_len) allocates against the memory budget, the chunked-prefill FLOPs, the splits a
decode plan chose, and the largest context a 7B/8B model's KV cache fits in on a T4 /
V100 per KV format (from model config numbers, not measured)."""

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

# 8-bit KV caches (--kv-dtype): vLLM's --kv-cache-dtype names; "fp8" is E4M3 there too.
# fp16 is always measured: the 8-bit rows' time ratios are against its sm7x step.
KV_DTYPES = ("fp16", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head")
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "int8": "int8_per_token_head"}
KV_ELEM = {"fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8_per_token_head": 1}  # bytes per cached K/V element
ROW_SCALE_BYTES = {"int8_per_token_head": 4}  # and per cached K/V row (a float32 scale)
KV8_TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# The issue's 8-bit goals: step time <= 0.6x fp16's at these (batch, kv_len) (a cache read
# at half the bytes, with some room for the widening), and chunked prefill over an 8-bit
# prefix within 10% of fp16 (compute-bound: the cache bytes barely matter there).
GOAL_KV8_POINTS = ((16, 32768), (1, 131072))
GOAL_KV8_STEP, GOAL_KV8_PREFILL = 0.60, 1.10

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


def kv_bytes(batch: int, kv_len: int, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
             elem: int = ELEM) -> int:
    """The K and V one attention step must read: batch * kv_len * kv_heads * head_dim * 2
    tensors * elem bytes (2 for fp16, 1 for an 8-bit cache)."""
    return batch * kv_len * kv_heads * head_dim * 2 * elem


def qo_bytes(q_tokens: int, heads: int = HEADS, head_dim: int = HEAD_DIM) -> int:
    """q read once and out written once (q_tokens = all query tokens of the batch)."""
    return 2 * q_tokens * heads * head_dim * ELEM


def useful_bytes(batch: int, kv_len: int, q_per_seq: int = 1, shape: Shape = DEFAULT_SHAPE,
                 kv_dtype: str = "fp16") -> int:
    """K/V at the cache format's bytes per element (and per row: int8's scales), q and out
    in fp16 whatever the cache."""
    return (kv_bytes(batch, kv_len, shape.kv_heads, shape.head_dim, KV_ELEM[kv_dtype])
            + batch * kv_len * shape.kv_heads * 2 * ROW_SCALE_BYTES.get(kv_dtype, 0)
            + qo_bytes(batch * q_per_seq, shape.heads, shape.head_dim))


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return None if not seconds else nbytes / seconds / 1e9


def num_pages(kv_len: int, page_size: int = PAGE_SIZE) -> int:
    return -(-kv_len // page_size)


def cache_bytes(batch: int, kv_len: int, page_size: int = PAGE_SIZE, expanded: bool = False,
                shape: Shape = DEFAULT_SHAPE, kv8: int = 0) -> dict:
    """GPU bytes of the caches one (batch, kv_len) allocates: the paged K/V of sm7x (whole
    pages), the contiguous K/V of the SDPA baselines, with expanded their copy expanded to
    all query heads, and kv8 8-bit paged caches (the same pages at 1 byte an element: half
    the fp16 paged cache each; counted as if all were live, an upper bound)."""
    pages = num_pages(kv_len, page_size) * page_size
    paged = kv_bytes(batch, pages, shape.kv_heads, shape.head_dim)
    paged8 = kv8 * kv_bytes(batch, pages, shape.kv_heads, shape.head_dim, elem=1)
    contiguous = kv_bytes(batch, kv_len, shape.kv_heads, shape.head_dim)
    exp = kv_bytes(batch, kv_len, shape.heads, shape.head_dim) if expanded else 0
    return {"paged": paged, "contiguous": contiguous, "expanded": exp, "paged_8bit": paged8,
            "total": paged + contiguous + exp + paged8}


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


def time_ratio(t: float | None, t_ref: float | None) -> float | None:
    """t / t_ref, a time over a time (the 8-bit goals: lower is better); None if either is
    missing."""
    return t / t_ref if t and t_ref else None


def kv8_descale(amax, kv_dtype: str):
    """Per-tensor descale of an 8-bit cache holding x / descale: amax / the format's largest
    finite value, so the largest |x| lands on the top code (vLLM's calculated scales are an
    amax over a constant too); a zero amax gives a tiny descale, not a division by 0."""
    big = torch.finfo(KV8_TORCH_DTYPES[kv_dtype]).max
    if isinstance(amax, torch.Tensor):
        return amax.float().clamp_min(1e-12) / big
    return max(float(amax), 1e-12) / big


# ---------------------------------------------------------------------------------------
# The largest context that fits, per KV format: arithmetic from model config numbers (no
# GPU, nothing measured). vLLM's way of sizing its KV pool: card memory x
# gpu_memory_utilization, minus the weights, minus what the profiling forward pass, CUDA
# graphs and the CUDA context take (here one stated constant), is the KV pool.

GiB = 1 << 30
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
# Activations of the profiled forward pass, CUDA graphs, sampler, CUDA context: a round
# constant stated in the table, not measured (vLLM profiles it per model and batch).
CONTEXT_RESERVE = 1 * GiB
# (label, bytes per element, bytes per K or V row): "8-bit" is fp8 (e4m3 and e5m2 take the
# same bytes); int8_per_token_head adds each row's float32 scale
CONTEXT_KV_FORMATS = (("fp16", 2, 0), ("8-bit", 1, 0), ("int8", 1, 4))


@dataclass(frozen=True)
class ModelConfig:
    """What the KV cache of a model needs: layers, KV heads, head dim (its config.json),
    the bytes of its fp16 weights (parameters x 2) and its longest context."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    weights_bytes: float
    max_context: int


@dataclass(frozen=True)
class Card:
    """A card as torch reports it (total_memory, what vLLM's utilization multiplies): ECC
    keeps part of the nominal size."""

    name: str
    total_bytes: int


CONTEXT_MODELS = (
    ModelConfig("Llama-3.1-8B", 32, 8, 128, 16.06e9, 131072),  # 8.03e9 parameters
    ModelConfig("Mistral-7B-v0.3", 32, 8, 128, 14.48e9, 32768),  # 7.24e9 parameters
)
CONTEXT_CARDS = (
    Card("T4 16 GB", round(14.75 * GiB)),  # torch: "14.75 GiB total capacity"
    Card("V100 32 GB", round(31.74 * GiB)),  # torch: "31.74 GiB total capacity"
)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, elem: int,
                       row_bytes: int = 0) -> int:
    """2 (K and V) x layers x kv_heads x (head_dim x bytes per element + bytes per row)."""
    return 2 * layers * kv_heads * (head_dim * elem + row_bytes)


def kv_memory(card_bytes: float, weights_bytes: float,
              utilization: float = GPU_MEMORY_UTILIZATION,
              reserve: float = CONTEXT_RESERVE) -> float:
    """Bytes left for the KV cache: card x utilization - weights - reserve (negative when
    the weights and the reserve alone do not fit)."""
    return card_bytes * utilization - weights_bytes - reserve


def tokens_that_fit(kv_mem: float, per_token: int, page_size: int = PAGE_SIZE) -> int:
    """Tokens of KV cache in kv_mem bytes, in whole pages (the pool is allocated in blocks
    of page_size tokens); 0 when nothing is left."""
    if kv_mem <= 0:
        return 0
    return int(kv_mem // (per_token * page_size)) * page_size


def context_table(models=CONTEXT_MODELS, cards=CONTEXT_CARDS, weights_bytes: float | None = None,
                  utilization: float = GPU_MEMORY_UTILIZATION, reserve: float = CONTEXT_RESERVE,
                  page_size: int = PAGE_SIZE) -> dict:
    """Per card and model, the tokens of KV cache that fit per KV format (all sequences
    together) and the longest single sequence (also capped by the model's context). When
    the fp16 weights do not leave room, a row for 8-bit weights (the fp16 bytes halved) is
    added; weights_bytes (``--weights-gb``) adds a row with that weight size."""
    rows = []
    for card in cards:
        usable = card.total_bytes * utilization
        for m in models:
            left_fp16 = kv_memory(card.total_bytes, m.weights_bytes, utilization, reserve)
            variants = [("fp16", m.weights_bytes)]
            if left_fp16 <= 0:
                variants.append(("8-bit (fp16 bytes / 2)", m.weights_bytes / 2))
            if weights_bytes:
                variants.append(("given (--weights-gb)", float(weights_bytes)))
            for label, wb in variants:
                left = kv_memory(card.total_bytes, wb, utilization, reserve)
                per_tok = {f: kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, e, rb)
                           for f, e, rb in CONTEXT_KV_FORMATS}
                tokens = {f: tokens_that_fit(left, per_tok[f], page_size) for f in per_tok}
                rows.append({
                    "card": card.name, "card_bytes": card.total_bytes, "usable_bytes": usable,
                    "model": m.name, "layers": m.layers, "kv_heads": m.kv_heads,
                    "head_dim": m.head_dim, "max_context": m.max_context,
                    "weights": label, "weights_bytes": wb, "kv_memory_bytes": left,
                    "fits": left > 0, "kv_bytes_per_token": per_tok, "tokens": tokens,
                    "one_sequence": {f: min(n, m.max_context) for f, n in tokens.items()},
                })
    return {
        "kind": "arithmetic from model config numbers, not measured",
        "formula": ("KV bytes/token = 2 (K and V) x layers x kv_heads x (head_dim x bytes per "
                    "element + bytes per row: int8's 4-byte scale); KV memory = card memory x utilization - weights - reserve; "
                    "tokens = KV memory / bytes per token, whole pages"),
        "utilization": utilization, "reserve_bytes": reserve, "page_size": page_size,
        "rows": rows,
    }
