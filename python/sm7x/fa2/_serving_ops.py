"""The serving calls as custom ops, for torch.compile: ``sm7x_fa2::kvcache``
(flash_attn_with_kvcache) and ``sm7x_fa2::varlen_paged`` (flash_attn_varlen_func over a
paged cache).

A serving call does host-side work that dynamo cannot trace: it plans the split-KV grid
(cached per shape), checks device values with a 16-byte copy back, checks the 16-byte
layout through ``data_ptr``. Under torch.compile the entry points call these ops instead,
whose real implementations run that same eager code (``_serving``), and whose fake
implementations give only the output shapes, so ``fullgraph=True`` holds. Outside
compilation the entry points run the eager code directly; nothing here is imported then
(``_serving`` is imported on a call's first use).

What cannot cross an op boundary: a ``DecodePlan`` (``scheduler_metadata``), a Python
object: compiled calls plan per shape (cached) instead; and ``out=`` of the paged call,
which the compiled graph fills by a copy.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._autograd import NAMESPACE

_KV = "flash_attn_with_kvcache"
_VARLEN = "flash_attn_varlen_func"


# k_descale / v_descale: an int8 cache's scale caches, which an append writes
@torch.library.custom_op(f"{NAMESPACE}::kvcache",
                         mutates_args=("k_cache", "v_cache", "k_descale", "v_descale"))
def kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
            v: Optional[Tensor], rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor],
            cache_seqlens: Optional[Tensor], cache_batch_idx: Optional[Tensor],
            cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
            softmax_scale: Optional[float], causal: bool, window_left: int,
            window_right: int, softcap: float, rotary_interleaved: bool, num_splits: int,
            k_descale: Optional[Tensor], v_descale: Optional[Tensor],
            kv_cache_dtype: Optional[str], sinks: Optional[Tensor] = None,
            check_inputs: bool = True) -> tuple[Tensor, Tensor]:
    """flash_attn_with_kvcache (appends k/v into the caches first): (out, lse)."""
    from . import _serving

    return _serving.with_kvcache(
        _KV, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
        cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
        (window_left, window_right), softcap, rotary_interleaved, num_splits, True, None,
        k_descale, v_descale, kv_cache_dtype, sinks=sinks, check_inputs=check_inputs)


@kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                  cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                  window_left, window_right, softcap, rotary_interleaved, num_splits,
                  k_descale, v_descale, kv_cache_dtype, sinks=None, check_inputs=True):
    return (q.new_empty(q.shape),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))


@torch.library.custom_op(f"{NAMESPACE}::varlen_paged", mutates_args=())
def varlen_paged(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                 cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale: Optional[float], causal: bool, window_left: int,
                 window_right: int, softcap: float, block_table: Optional[Tensor],
                 seqused_k: Optional[Tensor], k_descale: Optional[Tensor],
                 v_descale: Optional[Tensor], kv_cache_dtype: Optional[str],
                 sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """flash_attn_varlen_func over a paged cache: (out, lse [num_heads, total_q])."""
    from . import _serving

    out, lse, _ = _serving.varlen_paged(
        _VARLEN, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, return_lse=True, block_table=block_table, seqused_k=seqused_k,
        out=None, scheduler_metadata=None, k_descale=k_descale, v_descale=v_descale,
        kv_cache_dtype=kv_cache_dtype, sinks=sinks)
    return out, lse


@varlen_paged.register_fake
def _varlen_paged_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       softmax_scale, causal, window_left, window_right, softcap,
                       block_table, seqused_k, k_descale, v_descale, kv_cache_dtype,
                       sinks=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def no_plan(fn: str, scheduler_metadata) -> None:
    """A DecodePlan is a Python object: it cannot reach the op of a compiled call."""
    if scheduler_metadata is not None:
        raise ValueError(f"sm7x.fa2.{fn}: scheduler_metadata (a DecodePlan) cannot pass "
                         f"through torch.compile; drop it there: compiled calls plan per "
                         f"batch shape (cached)")


def window(window_size) -> tuple[int, int]:
    left, right = window_size
    return int(left), int(right)
