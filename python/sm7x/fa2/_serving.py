"""Serving entry points of sm7x.fa2: attention over a paged or contiguous KV cache (decode,
chunked prefill, speculative verification), planned by ``sm7x._sched.split_kv_plan``.

One op does all of it, ``fwd_serving`` of the arch's library (csrc/fa2/ops.cpp): the query
heads of a GQA group are packed into one CTA's rows so each K/V tile is read once per
group, and when batch x kv_heads CTAs cannot fill the GPU the keys of a sequence are split
over several CTAs whose fp32 partials a combine kernel merges by their LSE.

The split plan is made on the host from shapes only (an upper bound of the key count, never
the lengths on the device), so it is made once per batch shape: :func:`plan_decode`
returns it with its workspace, and a call that receives it (``scheduler_metadata=``)
plans nothing and allocates nothing but its output (nothing with ``out=``): it can be
captured in a CUDA graph and replayed with new cache contents and lengths up to the bound.
Without a plan each call plans (cached per shape) and allocates its workspace.

Values on the device (block_table entries, lengths, cu_seqlens_q) are checked by the op
with one small kernel and a 16-byte copy back (the one host sync of an eager call), except
while a CUDA graph is captured or with :func:`sm7x.fa2.set_input_checks` off; the kernels
clamp every index, so a bad value can never make them read out of bounds.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field

import torch

from .. import _args
from .._planner import sched_module
from .. import fa2 as _fa2
from . import (_check_half, _check_heads, _check_max_seqlens, _check_option_values,
               _check_options, _check_out_alias, _fresh, _kernel_layout,
               _rows_aligned)

# Splits per sequence at most: enough for one sequence of 8 kv heads to fill a wave of the
# 8-bit decode kernels on a 132-SM GPU (12 resident CTAs per SM: 198 splits).
_MAX_SPLITS = 256
# A partition walks at least this many key tiles: below it the prologue (Q tile, first
# K/V tiles) and the partial's write-out cost more than the split gains.
_MIN_TILES_PER_SPLIT = 8


# ---------------------------------------------------------------------------------------
# The plan


@dataclass(eq=False)
class DecodePlan:
    """A split-KV plan and its workspace for one batch shape on one device (see the module
    docstring). Pass it as ``scheduler_metadata=``; reuse it for every call of that shape
    (one stream at a time: the workspace is the plan's)."""

    arch: str
    device: torch.device
    batch_size: int
    max_seqlen_q: int
    max_seqlen_k: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str  # the cache format planned for (FORMAT_NAMES)
    block_n: int
    num_splits: tuple[int, ...]  # per sequence
    partitions: torch.Tensor  # int32 [P, 3] (seq, kv_start, kv_end), on the device
    split_offsets: torch.Tensor  # int32 [batch + 1]
    o_accum: torch.Tensor  # float32 [P, kv_heads, max_seqlen_q * group, head_dim] or empty
    lse_accum: torch.Tensor
    waves: int = 0
    _key: tuple = field(default=(), repr=False)

    @property
    def total_splits(self) -> int:
        return int(self.partitions.shape[0])

    def check(self, fn: str, key: tuple) -> None:
        if key != self._key:
            names = ("arch", "device", "batch_size", "max_seqlen_q", "max_seqlen_k (at most)",
                     "num_heads", "num_kv_heads", "head_dim", "kv_cache_dtype", "num_splits")
            # a call's max_seqlen_k may be below the plan's; num_splits 0 takes the plan's
            diffs = [f"{n}: plan {a!r}, call {b!r}" for n, a, b in zip(names, self._key, key)
                     if a != b and not (n.startswith("max_seqlen_k") and b <= a)
                     and not (n == "num_splits" and b == 0)]
            if diffs:
                raise ValueError(f"sm7x.fa2.{fn}: scheduler_metadata was planned for another "
                                 f"shape ({'; '.join(diffs)}); make one with plan_decode for "
                                 f"this batch (and its cache: plan_decode(kv_cache_dtype=))")


def _plan_key(arch, device, batch, sq, sk, heads, kv_heads, hd, kv_format, num_splits) -> tuple:
    return (arch, str(device), batch, sq, sk, heads, kv_heads, hd, FORMAT_NAMES[kv_format],
            num_splits)


def _check_int(fn: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"sm7x.fa2.{fn}: {name} must be an int >= {minimum}, got {value!r}")
    return value


@functools.lru_cache(maxsize=256)
def _split_plan(batch, sq, sk, heads, kv_heads, block_m, block_n, slots, max_splits):
    """sm7x._sched.split_kv_plan for a batch whose sequences hold at most sk keys. The
    planner's "heads" are the CTAs of one partition (kv heads x m-blocks of packed rows),
    its "SMs" the CTA slots of the device (SMs x resident CTAs of the serving kernel). Its
    cost model has no per-split overhead, so the split count is capped where one wave
    of CTAs fills the slots and where a partition would walk fewer than
    _MIN_TILES_PER_SPLIT tiles."""
    from array import array

    _sched = sched_module()  # a clear ImportError where it is missing
    m_blocks = max(1, math.ceil(sq * (heads // kv_heads) / block_m))
    ctas = max(1, batch * kv_heads * m_blocks)
    fill = max(1, math.ceil(slots / ctas))
    longest = max(1, math.ceil(sk / block_n) // _MIN_TILES_PER_SPLIT)
    plan = _sched.split_kv_plan(array("q", [sk] * batch), num_heads=kv_heads * m_blocks,
                                num_sms=slots, block_n=block_n,
                                max_splits=max(1, min(max_splits, fill, longest)))
    return (tuple(plan.num_splits.tolist()), plan.split_offsets.tolist(),
            plan.partitions.tolist(), int(plan.waves))


def _workspace(partitions: int, batch: int, rows: int, kv_heads: int, hd: int, device):
    """The split partials' fp32 o_accum [P, kv_heads, rows, hd] and lse_accum [P, kv_heads,
    rows]; empty when no sequence is split (P == batch)."""
    f32 = dict(dtype=torch.float32, device=device)
    if partitions == batch:
        empty = torch.empty(0, **f32)
        return empty, empty
    return (torch.empty((partitions, kv_heads, rows, hd), **f32),
            torch.empty((partitions, kv_heads, rows), **f32))


def _make_plan(arch, device, batch, sq, sk, heads, kv_heads, hd, kv_format, num_splits,
               workspace: bool) -> DecodePlan:
    rows = sq * (heads // kv_heads)
    block_m, block_n, ctas_per_sm = _serving_tile(arch, device, hd, rows, kv_format)
    if num_splits == 0:  # as many as fill the device's CTA slots
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        slots, max_splits = sms * max(1, ctas_per_sm), _MAX_SPLITS
    else:  # the caller's count: at most n splits
        slots, max_splits = 1 << 30, num_splits
    splits, offsets, parts, waves = _split_plan(batch, sq, sk, heads, kv_heads, block_m,
                                                block_n, slots, max_splits)
    i32 = dict(dtype=torch.int32, device=device)
    partitions = torch.tensor(parts, **i32).reshape(-1, 3)
    o_accum, lse_accum = _workspace(partitions.shape[0] if workspace else batch, batch, rows,
                                    kv_heads, hd, device)
    return DecodePlan(arch, device, batch, sq, sk, heads, kv_heads, hd, FORMAT_NAMES[kv_format],
                      block_n, splits, partitions, torch.tensor(offsets, **i32), o_accum,
                      lse_accum, waves, _plan_key(arch, device, batch, sq, sk, heads, kv_heads,
                                                  hd, kv_format, num_splits))


@functools.lru_cache(maxsize=256)
def _serving_tile(arch: str, device: torch.device, head_dim: int, rows: int,
                  kv_format: int) -> tuple:
    """(block_m, block_n, resident CTAs per SM) of the serving kernel the library runs for
    rows packed query rows per kv head over a cache of kv_format: its serving_tile op, the
    one owner of that choice."""
    ops = getattr(torch.ops, f"sm7x_fa2_{arch}")
    return tuple(int(x) for x in ops.serving_tile(device.index, head_dim, rows, kv_format))


_plans_lock = threading.Lock()
_plans: dict[tuple, DecodePlan] = {}  # per-shape plans of calls without scheduler_metadata


def plan_decode(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim, *,
                device=None, num_splits=0, kv_cache_dtype=None) -> DecodePlan:
    """Plans a serving call (decode, chunked prefill, verification) of this shape once:
    ``batch_size`` sequences of at most ``max_seqlen_q`` query tokens and at most
    ``max_seqlen_k`` keys (an upper bound: the kernels read the real lengths from the device)
    with ``num_heads`` query and ``num_kv_heads`` kv heads of ``head_dim``, over a cache of
    ``kv_cache_dtype`` (None or 'auto': float16; a cache dtype, or vLLM's 'fp8', 'fp8_e4m3',
    'fp8_e5m2', 'int8_per_token_head': each format's kernel fills the GPU differently).
    ``num_splits``: 0 lets sm7x._sched.split_kv_plan choose, 1 never splits, n splits a
    sequence at most n ways. Returns a :class:`DecodePlan` holding the plan and its workspace
    on ``device``."""
    fn = "plan_decode"
    kv_format = _plan_format(fn, kv_cache_dtype)
    batch = _check_int(fn, "batch_size", batch_size, 0)
    sq = _check_int(fn, "max_seqlen_q", max_seqlen_q, 0)
    sk = _check_int(fn, "max_seqlen_k", max_seqlen_k, 0)
    heads = _check_int(fn, "num_heads", num_heads, 1)
    kv_heads = _check_int(fn, "num_kv_heads", num_kv_heads, 1)
    hd = _check_int(fn, "head_dim", head_dim, 1)
    splits = _check_int(fn, "num_splits", num_splits, 0)
    _check_heads(fn, hd, heads, kv_heads)
    try:
        device = torch.device("cuda") if device is None else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"sm7x.fa2.{fn}: device must be a CUDA device (e.g. 'cuda:0'), got "
                         f"{device!r}") from None
    if device.type != "cuda":
        raise ValueError(f"sm7x.fa2.{fn}: device must be a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"sm7x.fa2.{fn}: no CUDA device is available (torch.cuda."
                           f"is_available() is False); the plan lives on a CUDA device")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    arch = _arch_of(torch.empty(0, device=device))
    return _make_plan(arch, device, batch, sq, sk, heads, kv_heads, hd, kv_format, splits, True)


def _plan_format(fn: str, kv_cache_dtype) -> int:
    """plan_decode's kv_cache_dtype as a KvFormat."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return F16
    if isinstance(kv_cache_dtype, torch.dtype) and kv_cache_dtype in KV_FORMATS:
        return KV_FORMATS[kv_cache_dtype]
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_cache_dtype]
    raise ValueError(f"sm7x.fa2.{fn}: kv_cache_dtype must be None, 'auto', one of "
                     f"{', '.join(map(repr, KV_CACHE_DTYPES))} or a cache dtype "
                     f"({', '.join(map(str, KV_FORMATS))}), got {kv_cache_dtype!r}")


def _arch_of(t: torch.Tensor) -> str:
    return _fa2._ops_for(t).name.removeprefix("sm7x_fa2_")


def _check_plan_type(fn: str, given) -> None:
    if given is not None and not isinstance(given, DecodePlan):
        raise TypeError(f"sm7x.fa2.{fn}: scheduler_metadata must be a DecodePlan from "
                        f"sm7x.fa2.plan_decode, got {type(given).__name__}")


def _plan_for(fn, ops, q, batch, sq, sk, heads, kv_heads, hd, kv_format, num_splits, given):
    arch = ops.name.removeprefix("sm7x_fa2_")
    key = _plan_key(arch, q.device, batch, sq, sk, heads, kv_heads, hd, kv_format, num_splits)
    if given is not None:
        given.check(fn, key)
        return given, given.o_accum, given.lse_accum
    with _plans_lock:
        plan = _plans.get(key)
        if plan is None:
            if len(_plans) > 256:
                _plans.clear()
            plan = _plans[key] = _make_plan(arch, q.device, batch, sq, sk, heads, kv_heads, hd,
                                            kv_format, num_splits, False)
    # workspace per call: a cached plan may serve several streams at once
    return (plan, *_workspace(plan.total_splits, batch, sq * (heads // kv_heads), kv_heads, hd,
                              q.device))


# ---------------------------------------------------------------------------------------
# Validation of the serving arguments (shapes and dtypes: before any library is loaded)


def check_no_grad(fn: str, *tensors) -> None:
    """The serving entry points (a paged or contiguous KV cache) are inference-only: an input
    that requires grad would get a silently detached output."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in tensors):
        raise RuntimeError(
            f"sm7x.fa2.{fn}: an input requires grad, but attention over a KV cache (block_table, "
            f"seqused_k, flash_attn_with_kvcache) is forward-only, for inference: call it under "
            f"torch.no_grad() / torch.inference_mode() or pass detached tensors (.detach()); "
            f"to train, call flash_attn_func / flash_attn_varlen_func on q, k, v without a cache "
            f"(those are differentiable)")


def _check_index(fn: str, name: str, t, q, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sm7x.fa2.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"sm7x.fa2.{fn}: {name} has dtype {t.dtype}; it must be torch.int32 "
                        f"(cast with .int())")
    if t.dim() != len(shape) or any(s is not None and a != s for a, s in zip(t.shape, shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"sm7x.fa2.{fn}: {name} must have shape [{want}], got "
                         f"{tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"sm7x.fa2.{fn}: {name} is on {t.device} but q is on {q.device}; move "
                         f"it with .to(q.device)")


# ---------------------------------------------------------------------------------------
# 8-bit caches: the format (csrc/fa2/fa2.h KvFormat) from the cache's dtype, or from
# vLLM's --kv-cache-dtype name for a uint8 cache of codes ("fp8" is E4M3 there too)

KV_FORMATS = {torch.float16: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.int8: 3}
KV_CACHE_DTYPES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2, "int8_per_token_head": 3}
_CODE_DTYPES = {1: torch.float8_e4m3fn, 2: torch.float8_e5m2}
F16 = KV_FORMATS[torch.float16]
# each format's name in plans and their messages: vLLM's (its last spelling: "fp8_e4m3")
FORMAT_NAMES = {F16: "float16", **{fmt: name for name, fmt in KV_CACHE_DTYPES.items()}}
# int8 codes with a scale per cached row and kv head: the scale caches ride in k_descale /
# v_descale ([num_blocks or batch_cache, page_size or seqlen_cache, num_kv_heads] float32,
# any strides)
INT8 = KV_FORMATS[torch.int8]


def scale_caches(fn: str, k_cache, kv_cache_dtype, k_descale, v_descale, k_scale_cache,
                 v_scale_cache):
    """The public k_scale_cache / v_scale_cache (int8 caches, vLLM's names) as the op's
    k_descale / v_descale, which carry them."""
    if k_scale_cache is None and v_scale_cache is None:
        return k_descale, v_descale
    if k_descale is not None or v_descale is not None:
        raise ValueError(f"sm7x.fa2.{fn}: pass k_descale / v_descale (fp8 caches) or "
                         f"k_scale_cache / v_scale_cache (int8 caches), not both")
    dtype = getattr(k_cache, "dtype", None)
    if dtype != torch.int8 and kv_cache_dtype != "int8_per_token_head":
        raise ValueError(f"sm7x.fa2.{fn}: k_scale_cache / v_scale_cache belong to an int8 "
                         f"cache (torch.int8, vLLM's int8_per_token_head), but the cache is "
                         f"{dtype}; an fp8 cache takes k_descale / v_descale")
    return k_scale_cache, v_scale_cache


def _cache_format(fn: str, k_cache, kv_cache_dtype) -> int:
    """The KvFormat of a cache: its dtype names it (float16, float8_e4m3fn, float8_e5m2);
    a uint8 cache needs kv_cache_dtype. Whether the two agree is the op's check."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        fmt = KV_FORMATS.get(k_cache.dtype)
        if fmt is not None:
            return fmt
        if k_cache.dtype == torch.uint8:
            raise ValueError(f"sm7x.fa2.{fn}: k_cache is a uint8 tensor of 8-bit codes: name "
                             f"the format with kv_cache_dtype='fp8_e4m3' (vLLM's 'fp8') or "
                             f"'fp8_e5m2', or pass a .view(torch.float8_e4m3fn) of it")
        raise TypeError(f"sm7x.fa2.{fn}: k_cache has dtype {k_cache.dtype}; a KV cache is "
                        f"float16, float8_e4m3fn, float8_e5m2 or int8 (sm7x has no bf16 "
                        f"kernels)")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"sm7x.fa2.{fn}: kv_cache_dtype {kv_cache_dtype!r} is not one of "
                         f"'auto', {', '.join(map(repr, KV_CACHE_DTYPES))}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def _check_descales(fn: str, fmt: int, k_descale, v_descale) -> None:
    if fmt == INT8:
        for name, d in (("k_scale_cache", k_descale), ("v_scale_cache", v_descale)):
            if not isinstance(d, torch.Tensor):
                raise ValueError(f"sm7x.fa2.{fn}: an int8 cache needs {name} (float32 "
                                 f"[num_blocks, page_size, num_kv_heads]: the scale of each "
                                 f"cached row, as sm7x.ops.reshape_and_cache writes it)")
        return
    for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
        if d is not None and not isinstance(d, torch.Tensor):
            raise TypeError(f"sm7x.fa2.{fn}: {name} must be a float32 torch.Tensor or None, "
                            f"got {type(d).__name__}")
        if d is not None and fmt == F16:
            raise ValueError(f"sm7x.fa2.{fn}: {name} applies to an 8-bit cache, but the cache "
                             f"is float16")


def encode_codes(x: torch.Tensor, fmt: int, descale) -> torch.Tensor:
    """fp16 tokens [batch, seqlen, kv_heads, head_dim] -> the 8-bit codes of format fmt:
    x / descale rounded to nearest even, saturated at the format's largest finite value
    (+-inf too; NaN stays NaN): what sm7x.ops.reshape_and_cache and vLLM's cache writes
    store. descale: None, one value, [kv_heads] or [batch, kv_heads]."""
    dtype = _CODE_DTYPES[fmt]
    y = x.float()
    if descale is not None:
        d = descale.float()
        if d.dim() == 2:
            d = d[:, None, :, None]
        elif d.dim() == 1 and d.numel() > 1:
            d = d[:, None]
        y = y / d
    big = torch.finfo(dtype).max
    return y.clamp(-big, big).to(dtype)


def encode_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 tokens [..., head_dim] -> (int8 codes, float32 scales [...]): one scale per row,
    as sm7x.ops.reshape_and_cache writes int8_per_token_head caches (csrc/core/fp8.h
    int8row: absmax of the finite values / 127, floored at 1e-6; half away from zero;
    +inf -> 127, -inf -> -128, NaN -> 0)."""
    y = x.float()
    finite = torch.isfinite(y)
    absmax = torch.where(finite, y.abs(), torch.zeros_like(y)).amax(-1)
    # tensor / tensor: IEEE division as the C++ writers do (torch divides a CUDA tensor by
    # a Python number as a multiply by its reciprocal, one rounding off)
    scale = (absmax / torch.full_like(absmax, 127.0)).clamp_min(1e-6)
    q = y * (torch.ones_like(scale) / scale)[..., None]
    q = torch.where(q >= 0, q + 0.5, q - 0.5).clamp(-128, 127)
    q = torch.where(torch.isnan(y), torch.zeros_like(q), q)
    return q.to(torch.int8), scale


def _check_cache(fn: str, q, k_cache, v_cache, paged: bool) -> tuple[int, int, int]:
    """k_cache/v_cache against q ([..., num_heads, head_dim]); returns heads, kv_heads, hd."""
    layout = ("[num_blocks, page_size, num_kv_heads, head_dim]" if paged
              else "[batch_cache, seqlen_cache, num_kv_heads, head_dim]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"sm7x.fa2.{fn}: {name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"sm7x.fa2.{fn}: {name} must be 4-D {layout}, got shape "
                             f"{tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"sm7x.fa2.{fn}: {name} is on {t.device} but q is on {q.device}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"sm7x.fa2.{fn}: k_cache {tuple(k_cache.shape)} {k_cache.dtype} and "
                         f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must have the same "
                         f"shape and dtype")
    hd, heads, kv_heads = q.shape[-1], q.shape[-2], k_cache.shape[2]
    if k_cache.shape[3] != hd:
        raise ValueError(f"sm7x.fa2.{fn}: q has head_dim {hd} but k_cache has "
                         f"{k_cache.shape[3]}")
    _check_heads(fn, hd, heads, kv_heads)
    if paged:
        ps = k_cache.shape[1]
        if ps <= 0 or ps & (ps - 1):
            raise ValueError(f"sm7x.fa2.{fn}: page_size (k_cache.shape[1]) is {ps}; the "
                             f"kernels support powers of two (16, 32, 64, 128, ...)")
    return heads, kv_heads, hd


def _cache_layout(fn: str, name: str, t: torch.Tensor) -> None:
    """A cache is never copied (appends must land in it, and copying it would cost more
    than the call): refuse one the kernels cannot read in place."""
    if t.dtype == torch.int8:  # vLLM's int8 rows are followed by their scale: 4-byte aligned
        if not _rows_aligned(t, 4, 4):
            raise ValueError(f"sm7x.fa2.{fn}: {name} (strides {t.stride()}) must have a "
                             f"contiguous last dim and rows at multiples of 4 bytes")
        return
    if _kernel_layout(t) is not t:
        raise ValueError(f"sm7x.fa2.{fn}: {name} (strides {t.stride()}) must have a contiguous "
                         f"last dim, other strides multiples of 8 and 16-byte aligned data; "
                         f"allocate the cache contiguous")


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------------------
# The call


def _run(fn, ops, q, k_cache, v_cache, out, lse, *, cu_seqlens_q, seqused_k, cu_seqlens_k,
         block_table, cache_batch_idx, leftpad, batch, max_seqlen_q, seqlen_k_bound,
         seqused_add, scale, causal, left, right, softcap, num_splits, plan, kv_format,
         k_descale, v_descale, sinks=None, check_inputs=True):
    heads, kv_heads, hd = q.shape[-2], k_cache.shape[2], q.shape[-1]
    plan, o_accum, lse_accum = _plan_for(fn, ops, q, batch, max_seqlen_q, seqlen_k_bound, heads,
                                         kv_heads, hd, kv_format, num_splits, plan)
    ops.fwd_serving(q, k_cache, v_cache, out, lse, cu_seqlens_q, seqused_k, cu_seqlens_k,
                    block_table, cache_batch_idx, leftpad, plan.partitions, plan.split_offsets,
                    o_accum, lse_accum, max_seqlen_q, seqlen_k_bound, seqused_add, scale, causal,
                    left, right, softcap, kv_format, k_descale, v_descale, sinks=sinks,
                    # passed only when off: a default call keeps the op's schema default
                    **({} if check_inputs else {"check_inputs": False}))
    return plan


def _check_q_and_cache(fn, q, layout: str, k_cache, v_cache, paged: bool, kv_cache_dtype,
                       k_descale, v_descale) -> tuple[int, int, int, int]:
    """q (of ``layout``: "<n>-D [...]") against the caches and their format: (num_heads,
    num_kv_heads, head_dim, the cache's KvFormat)."""
    _check_half("q", q, fn)
    if q.dim() != int(layout[0]):
        raise ValueError(f"sm7x.fa2.{fn}: q must be {layout}, got shape {tuple(q.shape)}")
    heads, kv_heads, hd = _check_cache(fn, q, k_cache, v_cache, paged)
    kv_format = _cache_format(fn, k_cache, kv_cache_dtype)
    _check_descales(fn, kv_format, k_descale, v_descale)
    return heads, kv_heads, hd, kv_format


def _serving_call(fn, q, k_cache, v_cache, inputs, plan, softmax_scale, hd, causal,
                  window_size, softcap):
    """The last checks of a serving call before it plans, writes or launches: no grad, the
    plan's type, the options (values too: an append must not run for a call the op would
    refuse), a CUDA q, caches the kernels read in place. Returns (the op namespace, the
    options as the op takes them)."""
    check_no_grad(fn, *inputs)
    _check_plan_type(fn, plan)
    options = _check_options(fn, softmax_scale, hd, causal, window_size, softcap)
    _check_option_values(fn, options[0], *options[2:])
    # looked up per call (not bound at import): the device's library, or a stand-in a
    # caller routed sm7x.fa2 to (the CPU tests)
    _fa2._check_cuda(fn, q)
    ops = _fa2._ops_for(q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _cache_layout(fn, name, t)
    return ops, options


def varlen_paged(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 softmax_scale, causal, window_size, softcap, return_lse, block_table,
                 seqused_k, out, scheduler_metadata, k_descale=None, v_descale=None,
                 kv_cache_dtype=None, sinks=None):
    """flash_attn_varlen_func over a paged cache (vLLM's flash-attn fork's call)."""
    paged = block_table is not None
    heads, kv_heads, hd, kv_format = _check_q_and_cache(
        fn, q, "3-D [total_q, num_heads, head_dim]", k, v, paged, kv_cache_dtype, k_descale,
        v_descale)
    _check_index(fn, "cu_seqlens_q", cu_seqlens_q, q, (None,))
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError(f"sm7x.fa2.{fn}: cu_seqlens_q must have batch + 1 >= 1 entries")
    if paged:
        _check_index(fn, "block_table", block_table, q, (batch, None))
    if seqused_k is not None:
        _check_index(fn, "seqused_k", seqused_k, q, (batch,))
    elif cu_seqlens_k is not None:
        _check_index(fn, "cu_seqlens_k", cu_seqlens_k, q, (batch + 1,))
    else:
        raise ValueError(f"sm7x.fa2.{fn}: with block_table pass seqused_k (int32 [batch], the "
                         f"key count of each sequence) or cu_seqlens_k")
    max_seqlen_q, max_seqlen_k = _check_max_seqlens(fn, max_seqlen_q, max_seqlen_k, q.shape[0])
    capacity = block_table.shape[1] * k.shape[1] if paged else k.shape[1]
    if max_seqlen_k > capacity:
        raise ValueError(f"sm7x.fa2.{fn}: max_seqlen_k ({max_seqlen_k}) is larger than the "
                         f"cache holds per sequence ({capacity})")
    if out is not None:
        _check_half("out", out, fn)
        if out.shape != q.shape or out.device != q.device:
            raise ValueError(f"sm7x.fa2.{fn}: out must have q's shape {tuple(q.shape)} on "
                             f"{q.device}, got {tuple(out.shape)} on {out.device}")
        _check_out_alias(fn, out, q=q, k_cache=k, v_cache=v, block_table=block_table,
                         seqused_k=seqused_k, cu_seqlens_q=cu_seqlens_q)
    ops, (scale, causal, left, right, softcap) = _serving_call(
        fn, q, k, v, (q, k, v), scheduler_metadata, softmax_scale, hd, causal, window_size,
        softcap)
    q = _kernel_layout(q)
    if out is None:
        out = _fresh(q)
    else:
        _cache_layout(fn, "out", out)
    lse = q.new_empty((heads, q.shape[0]), dtype=torch.float32)
    _run(fn, ops, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
         cu_seqlens_k=cu_seqlens_k if seqused_k is None else None, block_table=block_table,
         cache_batch_idx=None, leftpad=None, batch=batch, max_seqlen_q=max_seqlen_q,
         seqlen_k_bound=max_seqlen_k, seqused_add=0, scale=scale, causal=causal, left=left,
         right=right, softcap=softcap, num_splits=0, plan=scheduler_metadata,
         kv_format=kv_format, k_descale=k_descale, v_descale=v_descale, sinks=sinks)
    return (out, lse, None) if return_lse else out


def dense(fn, ops, q, k, v, out, lse, scale, causal, left, right, softcap, sinks=None) -> None:
    """A flash_attn_func call with few query rows per kv head, by a model that keeps its
    own K/V and calls the dense API, on the serving kernel: k and v read as a contiguous
    cache that every sequence fills, the GQA group's rows packed so each key is read once
    per kv head, and split-KV planned as for flash_attn_with_kvcache. The prefill kernel
    would run one CTA per query head and sequence over all the keys. Same masks (bottom-
    right causal, windows), softcap, output and LSE."""
    _run(fn, ops, q, k, v, out, lse, cu_seqlens_q=None, seqused_k=None, cu_seqlens_k=None,
         block_table=None, cache_batch_idx=None, leftpad=None, batch=q.shape[0],
         max_seqlen_q=q.shape[1], seqlen_k_bound=k.shape[1], seqused_add=0, scale=scale,
         causal=causal, left=left, right=right, softcap=softcap, num_splits=0, plan=None,
         kv_format=F16, k_descale=None, v_descale=None, sinks=sinks)


def dense_varlen(fn, ops, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, scale, causal, left, right, softcap, sinks=None) -> None:
    """flash_attn_varlen_func's few-rows calls, as dense: the packed k / v are one cache row
    [1, total_k, num_kv_heads, head_dim] in which sequence b holds keys [cu_seqlens_k[b],
    cu_seqlens_k[b + 1]) (its cache_leftpad and cache_seqlens)."""
    batch = cu_seqlens_q.shape[0] - 1
    cu_k = cu_seqlens_k.contiguous()
    rows = torch.zeros(batch, dtype=torch.int32, device=q.device)
    _run(fn, ops, q, k.unsqueeze(0), v.unsqueeze(0), out, lse,
         cu_seqlens_q=cu_seqlens_q.contiguous(), seqused_k=cu_k[1:], cu_seqlens_k=None,
         block_table=None, cache_batch_idx=rows, leftpad=cu_k[:-1], batch=batch,
         max_seqlen_q=max_seqlen_q, seqlen_k_bound=max_seqlen_k, seqused_add=0, scale=scale,
         causal=causal, left=left, right=right, softcap=softcap, num_splits=0, plan=None,
         kv_format=F16, k_descale=None, v_descale=None, sinks=sinks)


def _rotary(x, cos, sin, pos, interleaved: bool):
    """x [B, S, H, D] rotated at positions pos [B, S] (flash-attn's apply_rotary: the first
    rotary_dim = 2 * cos.shape[1] channels; GPT-J pairs when interleaved, else NeoX halves);
    fp32 math, fp16 result."""
    rd = cos.shape[1] * 2
    c = cos[pos].float().unsqueeze(2)  # [B, S, 1, rd/2]
    s = sin[pos].float().unsqueeze(2)
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def with_kvcache(fn, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                 cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size,
                 softcap, rotary_interleaved, num_splits, return_softmax_lse,
                 scheduler_metadata, k_descale=None, v_descale=None, kv_cache_dtype=None,
                 sinks=None, check_inputs=True):
    """flash-attn 2.x's flash_attn_with_kvcache (see sm7x.fa2.flash_attn_with_kvcache)."""
    paged = block_table is not None
    heads, kv_heads, hd, kv_format = _check_q_and_cache(
        fn, q, "4-D [batch, seqlen_q, num_heads, head_dim]", k_cache, v_cache, paged,
        kv_cache_dtype, k_descale, v_descale)
    batch, sq = q.shape[0], q.shape[1]
    if paged:
        _check_index(fn, "block_table", block_table, q, (batch, None))
        for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if t is not None:
                raise ValueError(f"sm7x.fa2.{fn}: {name} applies to a contiguous cache; with "
                                 f"block_table the table already maps each sequence's keys")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            _check_index(fn, "cache_batch_idx", cache_batch_idx, q, (batch,))
        elif k_cache.shape[0] < batch:
            raise ValueError(f"sm7x.fa2.{fn}: k_cache has {k_cache.shape[0]} rows for a batch of "
                             f"{batch}; pass cache_batch_idx or a cache with a row per sequence")
        if cache_leftpad is not None:
            _check_index(fn, "cache_leftpad", cache_leftpad, q, (batch,))
    if (k is None) != (v is None):
        raise ValueError(f"sm7x.fa2.{fn}: pass both k and v (the new tokens) or neither")
    seqlen_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _check_half(name, t, fn)
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:]:
                raise ValueError(f"sm7x.fa2.{fn}: {name} must be [batch={batch}, seqlen_new, "
                                 f"num_kv_heads={kv_heads}, head_dim={hd}], got "
                                 f"{tuple(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"sm7x.fa2.{fn}: k {tuple(k.shape)} and v {tuple(v.shape)} must "
                             f"have the same shape")
        seqlen_new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError(f"sm7x.fa2.{fn}: appending k/v needs cache_seqlens (where each "
                             f"sequence's new tokens go)")
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"sm7x.fa2.{fn}: cache_seqlens={cache_seqlens} is outside [0, "
                             f"{capacity}] (the cache's keys per sequence)")
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif cache_seqlens is not None:
        _check_index(fn, "cache_seqlens", cache_seqlens, q, (batch,))
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"sm7x.fa2.{fn}: pass both rotary_cos and rotary_sin or neither")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape != rotary_cos.shape:
                raise ValueError(f"sm7x.fa2.{fn}: rotary_cos and rotary_sin must both be "
                                 f"[seqlen_ro, rotary_dim / 2]")
            if t.device != q.device:
                raise ValueError(f"sm7x.fa2.{fn}: {name} is on {t.device} but q is on "
                                 f"{q.device}")
        if not 0 < 2 * rotary_cos.shape[1] <= hd:
            raise ValueError(f"sm7x.fa2.{fn}: rotary_dim (2 * rotary_cos.shape[1] = "
                             f"{2 * rotary_cos.shape[1]}) must be in (0, head_dim={hd}]")
        if cache_seqlens is None:
            raise ValueError(f"sm7x.fa2.{fn}: rotary needs cache_seqlens (the positions)")
    num_splits = _args.integer(f"sm7x.fa2.{fn}", "num_splits", num_splits)
    if num_splits < 0:
        raise ValueError(f"sm7x.fa2.{fn}: num_splits must be >= 0 (0: automatic), got "
                         f"{num_splits}")
    ops, (scale, causal, left, right, softcap) = _serving_call(
        fn, q, k_cache, v_cache, (q, k_cache, v_cache, k, v), scheduler_metadata,
        softmax_scale, hd, causal, window_size, softcap)
    if k is not None or rotary_cos is not None:
        positions = cache_seqlens.long()[:, None] + torch.arange(
            max(seqlen_new, sq), device=q.device)  # [B, max(Sn, Sq)]
        # q's rotary positions: cache_seqlens + i when causal or local, else cache_seqlens
        qpos = positions[:, :sq] if (causal or left >= 0 or right >= 0) else \
            positions[:, :1].expand(batch, sq)
        if not _capturing():
            _check_positions(fn, positions[:, :seqlen_new], qpos, capacity, block_table,
                             k_cache, None if rotary_cos is None else rotary_cos.shape[0])
        if rotary_cos is not None:
            seqlen_ro = rotary_cos.shape[0]
            q = _rotary(q, rotary_cos, rotary_sin, qpos.clamp(0, seqlen_ro - 1),
                        rotary_interleaved)
            if k is not None:
                k = _rotary(k, rotary_cos, rotary_sin,
                            positions[:, :seqlen_new].clamp(0, seqlen_ro - 1), rotary_interleaved)
        if k is not None:
            kc, vc = k_cache, v_cache
            if kv_format == INT8:  # codes and their rows' scales
                (k, ks), (v, vs) = encode_int8_rows(k), encode_int8_rows(v)
                _append_scales(k_descale, v_descale, ks, vs, positions[:, :seqlen_new],
                               capacity, block_table, cache_batch_idx)
            elif kv_format:  # the new tokens as the cache stores them, copied as bytes
                k = encode_codes(k, kv_format, k_descale).view(torch.uint8)
                v = encode_codes(v, kv_format, v_descale).view(torch.uint8)
                kc, vc = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
            _append(kc, vc, k, v, positions[:, :seqlen_new], capacity, block_table,
                    cache_batch_idx)
    q = _kernel_layout(q)
    out = _fresh(q)
    lse = q.new_empty((batch, heads, sq), dtype=torch.float32)
    _run(fn, ops, q, k_cache, v_cache, out, lse, cu_seqlens_q=None, seqused_k=cache_seqlens,
         cu_seqlens_k=None, block_table=block_table, cache_batch_idx=cache_batch_idx,
         leftpad=cache_leftpad, batch=batch, max_seqlen_q=sq, seqlen_k_bound=capacity,
         seqused_add=seqlen_new, scale=scale, causal=causal, left=left, right=right,
         softcap=softcap, num_splits=num_splits, plan=scheduler_metadata, kv_format=kv_format,
         k_descale=k_descale, v_descale=v_descale, sinks=sinks, check_inputs=check_inputs)
    return (out, lse) if return_softmax_lse else out


def _check_positions(fn, pos, qpos, capacity, block_table, k_cache, seqlen_ro) -> None:
    """Before anything is written: every appended position pos inside the cache and on a
    page of it, and, with rotary, every position of q and of the new keys inside rotary_cos.
    One host sync for all of it (skipped while a CUDA graph is captured, where _append and
    the rotary lookups clamp); the details are read only for the message of a failure."""
    zero = torch.zeros((), dtype=torch.bool, device=pos.device)
    bad_len = (pos < 0) | (pos >= capacity)
    bad_page = None
    if block_table is not None:  # on clamped positions: a bad length is reported first
        ps = k_cache.shape[1]
        pages = block_table.gather(1, pos.clamp(0, max(capacity - 1, 0)) // ps)
        bad_page = (pages < 0) | (pages >= k_cache.shape[0])
    rotary = torch.cat((qpos.flatten(), pos.flatten())) if seqlen_ro is not None else None
    flags = torch.stack([bad_len.any() if pos.numel() else zero,
                         bad_page.any() if bad_page is not None and pos.numel() else zero,
                         (rotary >= seqlen_ro).any() if rotary is not None and rotary.numel()
                         else zero]).tolist()
    if flags[0]:
        b = int(bad_len.any(1).nonzero()[0, 0])
        raise ValueError(f"sm7x.fa2.{fn}: sequence {b} would append up to position "
                         f"{int(pos[b].max())} but the cache holds {capacity} keys per sequence "
                         f"(cache_seqlens + seqlen_new must be <= {capacity})")
    if flags[1]:
        b, j = (int(x) for x in bad_page.nonzero()[0])
        raise ValueError(f"sm7x.fa2.{fn}: block_table[{b}, {int(pos[b, j]) // ps}] = "
                         f"{int(pages[b, j])} is not a page of k_cache (num_blocks "
                         f"{k_cache.shape[0]}); entries must be in [0, {k_cache.shape[0]})")
    if flags[2]:
        raise ValueError(f"sm7x.fa2.{fn}: rotary_cos has {seqlen_ro} positions but q or the new "
                         f"keys need position {int(rotary.max())}; pass tables that cover "
                         f"cache_seqlens + seqlen_new")


def _append_scales(k_scales, v_scales, ks, vs, pos, capacity, block_table,
                   cache_batch_idx) -> None:
    """The new rows' scales [B, S, kv_heads] into the scale caches (any strides: indexed
    writes), at the positions _append writes their codes."""
    pos = pos.clamp(0, max(capacity - 1, 0)).long()
    if block_table is not None:
        ps, n = k_scales.shape[1], k_scales.shape[0]
        idx = (block_table.gather(1, pos // ps).long().clamp(0, n - 1), pos % ps)
    else:
        rows = (cache_batch_idx.long().clamp(0, k_scales.shape[0] - 1)
                if cache_batch_idx is not None else torch.arange(ks.shape[0], device=ks.device))
        idx = (rows[:, None].expand_as(pos), pos)
    k_scales[idx] = ks
    v_scales[idx] = vs


def _append(k_cache, v_cache, k, v, pos, capacity, block_table, cache_batch_idx) -> None:
    """Writes the new tokens into the cache in place (indices clamped into the cache, so a
    bad value under graph capture cannot write out of bounds)."""
    pos = pos.clamp(0, max(capacity - 1, 0))
    if block_table is not None:
        ps, n = k_cache.shape[1], k_cache.shape[0]
        pages = block_table.gather(1, pos // ps).long().clamp(0, n - 1)
        slots = (pages * ps + pos % ps).flatten()
        for cache, new in ((k_cache, k), (v_cache, v)):
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new.flatten(0, 1))
    else:
        rows = (cache_batch_idx.long().clamp(0, k_cache.shape[0] - 1) if cache_batch_idx is not None
                else torch.arange(k.shape[0], device=k.device))
        rows = rows[:, None].expand_as(pos)
        for cache, new in ((k_cache, k), (v_cache, v)):
            cache[rows, pos] = new
