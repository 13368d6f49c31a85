"""sm7x FlashAttention-2 as a Hugging Face transformers attention implementation.

Importing this module registers two names with transformers (``register()`` does it again,
idempotently)::

    import sm7x.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.float16,
                                                 attn_implementation="sm7x")
    # or, on a loaded model: model.set_attn_implementation("sm7x")

- ``"sm7x"``: prefill and decode with transformers' own caches (dynamic, static, sliding
  window). Padding masks are handled as transformers' flash-attention path handles them;
  left padding (what ``generate`` does) is read in place from the cache (no unpadding
  copy), any other padding is unpadded to a varlen call.
- ``"paged|sm7x"``: continuous batching (``generate_batch``, ``init_continuous_batching``);
  full-attention layers read keys from transformers' paged cache through sm7x's paged
  kernels (a page table derived from the cache's read indices), sliding-window layers
  from the keys the cache gathers.

Training (``model.train()``, inputs that require grad, LoRA/PEFT, gradient checkpointing):
the calls a forward without a cache makes (``flash_attn_func``; ``flash_attn_varlen_func``
for padded or packed batches) are differentiable and run sm7x's backward kernels
(sm7x.fa2's autograd ops); fp32 activations under fp16 autocast are cast as in
transformers' flash path. Calls over a KV cache (decode, chunked prefill) are
inference-only and refuse inputs that require grad.

What sm7x cannot do is refused with a ``ValueError`` that says what and what to use
instead, never computed differently: bf16 (Volta and Turing have no bf16 tensor cores:
load the model in float16), an arbitrary (4-D) attention mask, ``output_attentions``,
attention dropout in training mode. Attention sinks (gpt-oss's ``s_aux``) are passed to the
kernels' calls.

This module imports torch, transformers and sm7x.fa2; ``import sm7x`` imports none.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
except ImportError as exc:  # not installed, or older than the attention interfaces
    raise ImportError(
        "sm7x.integrations.transformers needs transformers >= 5.0 (AttentionInterface and "
        "AttentionMaskInterface): pip install 'transformers>=5' or conda install "
        f"'transformers>=5' ({exc})"
    ) from exc

from .. import fa2
from . import flash_window

NAME = "sm7x"
PAGED_NAME = f"paged|{NAME}"

__all__ = ["NAME", "PAGED_NAME", "register", "attention_forward", "paged_attention_forward"]


# ---------------------------------------------------------------------------------------
# What sm7x cannot do: refused before any work, with the way out.


def _refuse(what: str, instead: str) -> None:
    raise ValueError(f"attn_implementation='{NAME}' (sm7x FlashAttention-2 for Volta/Turing) "
                     f"{what}; {instead}")


def _fp16(module, query, key, value):
    """fp16 q/k/v. fp32 inputs are cast the way transformers' flash path casts them (PEFT
    keeps layer norms in fp32) when the model or autocast says fp16; bf16 is refused."""
    if query.dtype == torch.float32:
        dev = query.device.type
        target = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                  else getattr(module.config, "dtype", None))
        if target == torch.float16:
            return query.half(), key.half(), value.half()
    if query.dtype != torch.float16 or key.dtype != torch.float16 or value.dtype != torch.float16:
        _refuse(f"got {query.dtype} attention inputs: the kernels are float16 only (Volta and "
                f"Turing have no bfloat16 tensor cores)",
                "load the model with dtype=torch.float16 (or model.half()), or use "
                "attn_implementation='sdpa' for other dtypes")
    return query, key, value


def _check_call(module, query, attention_mask, dropout, kwargs) -> None:
    if kwargs.get("output_attentions", False):
        _refuse("cannot return attention weights (output_attentions=True)",
                "use attn_implementation='eager' for them")
    if dropout and module.training:
        _refuse(f"has no attention dropout (got {dropout} in training mode)",
                "set the model config's attention_dropout to 0.0, or train with "
                "attn_implementation='sdpa'")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.dim() != 2):
        shape = (tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                 else type(attention_mask).__name__)
        _refuse(f"takes padding masks [batch, keys] (what transformers builds for it), not an "
                f"arbitrary attention mask {shape}",
                "use attn_implementation='sdpa' or 'eager' for custom masks")


# ---------------------------------------------------------------------------------------
# attn_implementation="sm7x"


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention function: ``query [batch, heads, q_len, head_dim]``,
    ``key``/``value [batch, kv_heads, kv_len, head_dim]`` (the cache's keys, new ones
    included), ``attention_mask`` None or the 2-D padding mask of :func:`_mask`. Returns
    ``(out [batch, q_len, heads, head_dim], None)``."""
    _check_call(module, query, attention_mask, dropout, kwargs)
    query, key, value = _fp16(module, query, key, value)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    hd, v_hd = query.shape[-1], value.shape[-1]
    if v_hd != hd:  # the kernels need one head dim: pad v (MLA) and crop the output
        value = torch.nn.functional.pad(value, [0, hd - v_hd])
    # [batch, seq, heads, head_dim] views: the kernels read these strides in place
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    opts = dict(softmax_scale=scaling, causal=causal, window_size=flash_window(sliding_window, causal),
                softcap=softcap or 0.0)
    if kwargs.get("s_aux") is not None:  # attention sinks (gpt-oss): one logit per head
        opts["s_aux"] = kwargs["s_aux"]
    if torch.is_grad_enabled() and query.requires_grad and _deterministic(kwargs):
        opts["deterministic"] = True  # (read by the differentiable calls only: _no_grad_opts)
    layer = getattr(module, "layer_idx", None)
    if attention_mask is None and kwargs.get("cu_seq_lens_q") is not None:  # padding-free
        out = _packed(q, k, v, kwargs, opts, layer)
    elif attention_mask is None and q.shape[1] >= k.shape[1]:
        packing = _positions_packing(q, k, kwargs.get("position_ids"), layer)
        out = (fa2.flash_attn_func(q, k, v, **opts) if packing is None
               else _varlen_over(q, k, v, packing, opts))
    elif torch.compiler.is_compiling() and not (torch.is_grad_enabled() and q.requires_grad):
        # the host bookkeeping below (mask layout, decode plans) runs inside one custom op,
        # so a compiled forward (static-cache generate) stays one graph
        out = cached_attention(q, k, v, attention_mask, scaling, causal, *opts["window_size"],
                               opts["softcap"], opts.get("s_aux"), layer)
    else:
        out = _cached(q, k, v, attention_mask, opts, layer)
    if v_hd != hd:
        out = out[..., :v_hd]
    return out, None


def _deterministic(kwargs) -> bool:
    """A backward with a fixed order of dQ sums, as transformers' flash path asks for it:
    its ``deterministic`` argument, else FLASH_ATTENTION_DETERMINISTIC=1 (what
    transformers' enable_full_determinism() sets). (sm7x.fa2 adds
    torch.use_deterministic_algorithms(True) itself.)"""
    asked = kwargs.get("deterministic")
    if asked is not None:
        return bool(asked)
    return os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"


def _no_grad_opts(opts: dict) -> dict:
    """opts for flash_attn_with_kvcache, which has no backward (it refuses inputs that
    require grad, with a message saying which calls are differentiable)."""
    return {k: v for k, v in opts.items() if k != "deterministic"}


# Every device-side value these calls pass is built here (the plan by _plan, the lengths and
# left padding from the mask by _mask_layout), so the op's device-side check of them (a
# kernel and a stream sync per layer) is skipped for them alone; the process-wide setting
# (sm7x.fa2.set_input_checks) still holds for everything else
_OWN_VALUES = {"check_inputs": False}


def _cached(q, k, v, mask, opts, layer):
    """A call over the cache (decode, chunked prefill) or under a padding mask."""
    if mask is not None:
        return _masked(q, k, v, mask, opts, layer)
    # decode / chunked prefill against the cache: split-KV, GQA rows packed per K/V tile
    # (sm7x's serving kernels); no new keys to append, transformers did that
    return fa2.flash_attn_with_kvcache(q, k, v, scheduler_metadata=_plan(q, k),
                                       **_no_grad_opts(opts), **_OWN_VALUES)


# cudagraph_unsafe: the mask layout is read on the host, which a CUDA graph cannot capture;
# inductor's cudagraphs (mode="reduce-overhead") run the graph's other parts around it
@torch.library.custom_op("sm7x_transformers::cached_attention", mutates_args=(),
                         tags=(torch.Tag.cudagraph_unsafe,))
def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Optional[torch.Tensor], softmax_scale: Optional[float], causal: bool,
                     window_left: int, window_right: int, softcap: float,
                     s_aux: Optional[torch.Tensor], layer: Optional[int]) -> torch.Tensor:
    """:func:`_cached` as one op for compiled forwards: ``[batch, q_len, heads, head_dim]``."""
    opts = dict(softmax_scale=softmax_scale, causal=causal,
                window_size=(window_left, window_right), softcap=softcap)
    if s_aux is not None:
        opts["s_aux"] = s_aux
    return _cached(q, k, v, mask, opts, layer).contiguous()


@cached_attention.register_fake
def _cached_attention_fake(q, k, v, mask, softmax_scale, causal, window_left, window_right,
                           softcap, s_aux, layer):
    return q.new_empty(q.shape)


def _masked(q, k, v, mask, opts, layer):
    """A 2-D padding mask [batch, L] over the first L cache positions (L < kv_len: a static
    cache's allocated but unwritten slots)."""
    batch, sq = q.shape[0], q.shape[1]
    length = mask.shape[1]
    if length > k.shape[1] or mask.shape[0] != batch:
        _refuse(f"got a padding mask {tuple(mask.shape)} for {batch} sequences of "
                f"{k.shape[1]} keys", "pass attention_mask as [batch, past + new tokens]")
    k, v = k[:, :length], v[:, :length]
    mask, lens, leftpad, left_ok, ones, unpads = _mask_layout(mask, layer)
    if ones:
        return (fa2.flash_attn_func(q, k, v, **opts) if sq >= length
                else fa2.flash_attn_with_kvcache(q, k, v, scheduler_metadata=_plan(q, k),
                                                 **_no_grad_opts(opts), **_OWN_VALUES))
    if left_ok and sq < length and opts["causal"]:
        return fa2.flash_attn_with_kvcache(q, k, v, cache_seqlens=length, cache_leftpad=leftpad,
                                           scheduler_metadata=_plan(q, k),
                                           **_no_grad_opts(opts), **_OWN_VALUES)
    return _unpadded(q, k, v, mask, lens, opts, unpads)


def _per_forward(cache: dict, tensors: tuple, layer: int | None, work):
    """work(), done at a forward's first layer and reused by its later ones. A model passes
    the same tensors (a mask, cu_seq_lens) to the layers of a forward in order: a call from
    a layer not after the last one seen starts a new forward and works again, so tensors
    changed in place between forwards are never read stale (version counters do not exist
    for inference tensors)."""
    key = tuple(id(t) for t in tensors)
    hit = cache.get(key)
    if (hit is not None and all(a is b for a, b in zip(hit[0], tensors)) and layer is not None
            and hit[1] is not None and layer > hit[1]):
        cache[key] = (tensors, layer, hit[2])
        return hit[2]
    result = work()
    if len(cache) >= 8:  # the current forward's (one per layer type) suffice
        cache.clear()
    cache[key] = (tensors, layer, result)
    return result


_layouts: dict = {}


@torch.compiler.disable  # host bookkeeping: never traced (compiled training with a mask)
def _mask_layout(mask, layer: int | None):
    """(bool mask, keys per row, left padding per row, left padded?, all ones?, the unpadding
    of each query length, filled by _unpadded) of a padding mask, once per forward
    (_per_forward). One host sync decides the path: a mask of ones (a static cache's written
    slots) needs no mask; left padding (each row's keys one run that ends at L, what
    generate pads) is read in place; anything else is unpadded like transformers' flash
    path."""
    return _per_forward(_layouts, (mask,), layer, lambda: _analyse(mask))


def _analyse(mask):
    """_mask_layout's analysis of a mask (one host sync)."""
    b = mask.bool()
    length = b.shape[1]
    lens = b.sum(-1, dtype=torch.int32)
    leftpad = (length - lens).to(torch.int32)
    left_ok, ones = torch.stack([
        (b == (torch.arange(length, device=b.device) >= leftpad[:, None])).all(),
        b.all()]).tolist()
    return (b, lens, leftpad, left_ok, ones, {})


_PLAN_KEYS = 256  # a decode plan serves the cache lengths up to the next multiple
_plans: dict = {}


@torch.compiler.disable  # host bookkeeping: never traced (compiled training with a mask)
def _plan(q, k):
    """A DecodePlan per (stream, shape, key bound): a generate loop grows the cache by one
    key a step, and one plan serves 256 steps of every layer instead of being rebuilt with
    its workspace each call. Per stream, because the plan's workspace is its own."""
    bound = -(-k.shape[1] // _PLAN_KEYS) * _PLAN_KEYS
    stream = torch.cuda.current_stream(q.device).stream_id if q.is_cuda else 0
    key = (q.device, stream, q.shape[0], q.shape[1],
           bound, q.shape[2], k.shape[2], q.shape[3])
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= 64:  # a long-running server sees many shapes: keep the recent
            _plans.pop(next(iter(_plans)))
        plan = _plans[key] = fa2.plan_decode(q.shape[0], q.shape[1], bound, q.shape[2],
                                             k.shape[2], q.shape[3], device=q.device)
    return plan


def _unpadded(q, k, v, mask, lens, opts, unpads: dict):
    """Attention over the mask's kept rows as one varlen call. Its unpadding (_unpadding:
    host syncs) is worked out once per forward and query length (unpads, _mask_layout's),
    not per layer: the later layers then queue without waiting, cu_seqlens included (the
    same tensors: sm7x.fa2 checks them once)."""
    batch, sq, heads, hd = q.shape
    length = mask.shape[1]
    if sq not in unpads:
        unpads[sq] = _unpadding(mask, lens, sq)
    keep_q, keep_k, cu_q, cu_k, max_q, max_k = unpads[sq]
    out_packed = fa2.flash_attn_varlen_func(
        q.reshape(-1, heads, hd)[keep_q], k.reshape(batch * length, *k.shape[2:])[keep_k],
        v.reshape(batch * length, *v.shape[2:])[keep_k], cu_q, cu_k, max_q, max_k, **opts)
    out = torch.zeros((batch * sq, heads, hd), dtype=q.dtype, device=q.device)
    out[keep_q] = out_packed
    return out.view(batch, sq, heads, hd)


def _unpadding(mask, lens, sq: int):
    """(kept query rows, kept key rows, cu_seqlens_q, cu_seqlens_k, longest query and key
    runs) of a padding mask [batch, L] whose queries are the last sq positions (host syncs:
    each nonzero, and one copy of the two lengths)."""
    batch, length = mask.shape
    keep_k = mask.reshape(-1).nonzero().squeeze(1)
    cu_k = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    if sq == length:
        keep_q, cu_q, qlens = keep_k, cu_k, lens
    else:  # the queries are the last sq positions
        qmask = mask[:, -sq:] if sq > 1 else torch.ones(batch, 1, dtype=torch.bool,
                                                         device=mask.device)
        keep_q = qmask.reshape(-1).nonzero().squeeze(1)
        qlens = qmask.sum(-1, dtype=torch.int32)
        cu_q = torch.nn.functional.pad(qlens.cumsum(0, dtype=torch.int32), (1, 0))
    max_q, max_k = torch.stack([qlens.max(), lens.max()]).tolist()
    return keep_q, keep_k, cu_q, cu_k, max_q, max_k


def _packed(q, k, v, kwargs, opts, layer):
    """Padding-free batches (DataCollatorWithFlattening): sequences concatenated in one row,
    bounded by cu_seq_lens_q/k."""
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        cu = kwargs.get(name)
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1:
            got = (f"a {cu.dim()}-D tensor" if isinstance(cu, torch.Tensor)
                   else "nothing" if cu is None else f"a {type(cu).__name__}")
            _refuse(f"got {got} as {name} for a padding-free batch",
                    "pass both cu_seq_lens_q and cu_seq_lens_k as 1-D integer tensors "
                    "[sequences + 1] (what DataCollatorWithFlattening builds)")
    # a compiled forward traces the packing (no host cache in the graph)
    packing = _packing_of(kwargs) if torch.compiler.is_compiling() else _packing(kwargs, layer)
    return _varlen_over(q, k, v, packing, opts)


def _varlen_over(q, k, v, packing, opts):
    """The sequences of a padding-free batch [1, total, heads, head_dim] (packing: int32
    cu_seqlens q and k, longest q and k runs) through the varlen kernels."""
    cu_q, cu_k, max_q, max_k = packing
    out = fa2.flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu_q, cu_k, max_q, max_k,
                                     **opts)
    return out.view(q.shape[0], -1, *out.shape[1:])


def _packing_of(kwargs):
    """(int32 cu_seqlens q and k, longest q and k runs) of a padding-free batch (missing
    max_length_q/k: one host read of both)."""
    cu_q, cu_k = kwargs["cu_seq_lens_q"].int(), kwargs["cu_seq_lens_k"].int()
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if not max_q or not max_k:
        max_q, max_k = torch.stack([(cu_q[1:] - cu_q[:-1]).max(),
                                    (cu_k[1:] - cu_k[:-1]).max()]).tolist()
    return cu_q, cu_k, int(max_q), int(max_k)


_packings: dict = {}


def _packing(kwargs, layer: int | None):
    """_packing_of, once per eager forward (_per_forward): int64 cu_seq_lens would otherwise
    become new int32 tensors at every layer, each checked again by sm7x.fa2 (a host sync),
    and missing max_length_q/k would be read back per layer."""
    return _per_forward(_packings, (kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]), layer,
                        lambda: _packing_of(kwargs))


_positions: dict = {}


def _positions_packing(q, k, position_ids, layer: int | None):
    """A padding-free batch that only its position_ids describe (DataCollatorWithFlattening
    without return_flash_attn_kwargs: one row, each sequence's positions restarting at the
    smallest), as transformers' flash path reads it: its packing (_varlen_over), or None
    for anything else (one sequence, a batch of rows, a call over a cache). Without this a
    packed row would attend across its sequences."""
    n = q.shape[1]
    if (q.shape[0] != 1 or k.shape[1] != n or n < 2 or not isinstance(position_ids, torch.Tensor)
            or tuple(position_ids.shape) != (1, n)):
        return None
    return _positions_layout(position_ids, layer)


@torch.compiler.disable  # host bookkeeping: never traced (a compiled forward breaks here)
def _positions_layout(position_ids, layer: int | None):
    """_packing_of_positions, once per forward (_per_forward): its host read would otherwise
    sync at every layer."""
    return _per_forward(_positions, (position_ids,), layer,
                        lambda: _packing_of_positions(position_ids))


def _packing_of_positions(position_ids):
    """(int32 cu_seqlens q and k, longest runs) from packed position_ids [1, n], or None
    when they hold one sequence. One host read (the starts)."""
    pos = position_ids.reshape(-1)
    starts = (pos == pos.min()).nonzero().view(-1)
    bounds = starts.tolist()
    if bounds[0] != 0:
        _refuse(f"got position_ids whose first sequence does not start at the smallest "
                f"position (the first restart is at token {bounds[0]}) for a padding-free "
                f"batch", "start every packed sequence at the same position, or pass "
                "cu_seq_lens_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True))")
    if len(bounds) < 2:
        return None
    bounds.append(pos.numel())
    cu = torch.cat([starts.to(torch.int32), starts.new_full((1,), pos.numel(), dtype=torch.int32)])
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return cu, cu, longest, longest


# ---------------------------------------------------------------------------------------
# attn_implementation="paged|sm7x" (continuous batching)


def paged_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                            scaling=None, sliding_window=None, softcap=None, **kwargs):
    """Continuous batching's attention: ``query [1, heads, tokens, head_dim]`` and
    ``key``/``value [1, kv_heads, tokens, head_dim]`` of every scheduled request packed,
    the paged cache in ``kwargs["cache"]``. The 4-D mask transformers builds for
    non-flash implementations is not needed (the kernels mask by the sequence bounds)."""
    cache = kwargs.get("cache")
    if cache is None:
        _refuse("'paged|' was called without continuous batching's paged cache",
                f"use attn_implementation='{NAME}' for a standard forward")
    _check_call(module, query, None, dropout, kwargs)
    query, key, value = _fp16(module, query, key, value)
    if value.shape[-1] != query.shape[-1]:
        _refuse("needs the same head dim for values and keys in continuous batching",
                f"use attn_implementation='{NAME}' with generate()")
    sliding = getattr(module, "sliding_window", None) or sliding_window
    layer_type = "sliding_attention" if sliding else "full_attention"
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    cu_q, max_q = kwargs["cu_seq_lens_q"].int(), int(kwargs["max_seqlen_q"])
    cu_k = cu_k.int()
    group, in_group = cache.layer_index_to_group_indices[module.layer_idx]
    read, write = kwargs["read_index"][group], kwargs["write_index"][group]
    q = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
    opts = dict(softmax_scale=scaling if scaling is not None else module.scaling, causal=True,
                window_size=flash_window(sliding), softcap=softcap or 0.0)
    if kwargs.get("s_aux") is not None:
        opts["s_aux"] = kwargs["s_aux"]
    # rows past the last sequence (CUDA-graph padding) are never written by the kernels
    out = torch.zeros_like(q)
    bs = cache.block_size
    if not sliding and read.numel() and bs & (bs - 1) == 0:
        k_cache, v_cache = cache.key_cache[in_group], cache.value_cache[in_group]
        k_cache.index_copy_(0, write, key[0].transpose(0, 1))
        v_cache.index_copy_(0, write, value[0].transpose(0, 1))
        pages = _page_table(read, cu_k, int(max_k), bs)
        shape = (-1, bs, *k_cache.shape[1:])
        fa2.flash_attn_varlen_func(q, k_cache.view(shape), v_cache.view(shape), cu_q, cu_k,
                                   max_q, int(max_k), block_table=pages,
                                   seqused_k=cu_k[1:] - cu_k[:-1], out=out, **opts)
    else:  # sliding layers (a ring of pages), a batch with nothing cached, odd page sizes
        k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                            read_index=kwargs["read_index"], write_index=kwargs["write_index"])
        fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, int(max_k), out=out, **opts)
    return out, None


def _page_table(read, cu_k, max_k: int, page_size: int):
    """Full-attention layers read request i's keys at read[cu_k[i]:cu_k[i+1]], slot =
    page * page_size + offset in key order: the first slot of each page_size run names the
    page. Built on the device (no host sync)."""
    n = cu_k.shape[0] - 1
    pages = max(1, -(-max_k // page_size))
    idx = cu_k[:-1, None].long() + torch.arange(pages, device=read.device) * page_size
    last = (cu_k[1:, None].long() - 1).clamp(min=0)
    idx = torch.minimum(idx, last).clamp(0, read.numel() - 1)
    return (read[idx.view(-1)] // page_size).view(n, pages).int()


# ---------------------------------------------------------------------------------------


def _mask(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs):
    """transformers builds for "sm7x" the mask it builds for flash-attention: None, or the
    2-D padding mask. Under torch.compile its test for a mask of ones (a host read) is left
    to :func:`_mask_layout`, inside the compiled graph's attention op."""
    if torch.compiler.is_compiling() and attention_mask is not None:
        return attention_mask[:, -kv_length:]
    return flash_attention_mask(batch_size, q_length, kv_length, *args,
                                attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register ``"sm7x"`` and ``"paged|sm7x"`` with transformers (idempotent); returns
    ``"sm7x"``."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionInterface.register(PAGED_NAME, paged_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


register()
