"""sm7x FlashAttention-2 for Volta/Turing, with flash-attn's Python API.

``flash_attn_func(q, k, v, ...)`` on ``[batch, seqlen, num_heads, head_dim]`` and
``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, ...)`` on packed ``[total_tokens, num_heads, head_dim]`` take flash-attn
2.x's names, shapes and defaults, and so do the packed variants
``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``,
``flash_attn_varlen_qkvpacked_func`` and ``flash_attn_varlen_kvpacked_func``. Supported:
float16; head dims that are multiples of 8 up to MAX_HEAD_DIM (kernels compiled for
COMPILED_HEAD_DIMS; other sizes run padded); causal (bottom-right aligned when seqlen_q !=
seqlen_k, as flash-attn >= 2.1); sliding window; softcap; GQA/MQA (num_heads a multiple of
num_kv_heads). Not supported: dropout (dropout_p must be 0), ALiBi.

Training (``_autograd.py``): these six functions are differentiable. Under torch.compile
they run as registered custom ops (``torch.ops.sm7x_fa2.attn`` / ``attn_varlen``); eager
calls with inputs that require grad run the same implementations under a
``torch.autograd.Function`` (less host time per call). Either saves q, k, v, out and the
LSE (no S/P) and calls the library's backward kernels (``bwd`` / ``bwd_varlen``): dq, dk,
dv, with dk/dv summed over each GQA group; ``deterministic=True`` asks the kernels for a
fixed accumulation order (bit-identical gradients run to run), and so does
``torch.use_deterministic_algorithms(True)`` (flash-attn reads its argument alone). They trace under
torch.compile (fullgraph) and recompute under torch.utils.checkpoint (reentrant or not).
Where a library has no backward kernel for a head dim (``bwd_supported(head_dim)`` false,
e.g. 256 on Turing), that backward runs in float32 PyTorch math instead, with a one-time
:class:`BackwardFallbackWarning` naming the head dim and why. The serving entry points
(``block_table``/``seqused_k``, ``flash_attn_with_kvcache``) stay inference-only: inputs
that require grad are refused there.

Serving (``_serving.py``): ``flash_attn_varlen_func(..., block_table=, seqused_k=)`` reads
keys from a paged cache ``[num_blocks, page_size, num_kv_heads, head_dim]`` the way vLLM's
flash-attn fork is called; ``flash_attn_with_kvcache`` is flash-attn 2.x's (append new
k/v into a paged or contiguous cache, rotary, then attend); ``plan_decode`` plans the
split-KV of a batch shape once, for calls that must be capturable in a CUDA graph.

The library is chosen per call from the capability of the input tensor's device (see
:func:`sm7x._select.select_fa2_library`; ``SM7X_FA2_FORCE=sm75`` forces one, e.g. to
test on newer GPUs) and loaded on first use, once per process.

This module imports torch; ``import sm7x`` does not import it.
"""

from __future__ import annotations

import os
import threading
import weakref

from .. import _targets

try:
    import torch
except ImportError as exc:
    raise ImportError(
        f"sm7x.fa2 needs PyTorch >= {_targets.torch_min()}, which is not installed in this "
        "environment: conda install pytorch (or: pixi add pytorch)"
    ) from exc

from .. import _args, _select
from . import _loader
from ._loader import input_checks, set_input_checks

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "plan_decode",
           "DecodePlan", "BackwardFallbackWarning", "MAX_HEAD_DIM", "COMPILED_HEAD_DIMS",
           "set_input_checks", "input_checks"]

MAX_HEAD_DIM = _targets.fa2_max_head_dim()
COMPILED_HEAD_DIMS = _targets.fa2_head_dims("sm75")  # both libraries compile the same list
SUPPORTED_HEAD_DIMS = tuple(range(_targets.fa2_head_dim_multiple(), MAX_HEAD_DIM + 1,
                                  _targets.fa2_head_dim_multiple()))

_dev_lock = threading.Lock()
_devices: dict[int, _select.Device] = {}


def _device_info(device: torch.device) -> _select.Device:
    """The selection rules' view of a CUDA device (cached per index)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    dev = _devices.get(index)
    if dev is None:
        with _dev_lock:
            dev = _devices.get(index)
            if dev is None:
                dev = _select.Device(index, torch.cuda.get_device_name(index),
                                     tuple(torch.cuda.get_device_capability(index)))
                _devices[index] = dev
    return dev


def _ops_for(t: torch.Tensor):
    """The op namespace for the device of ``t``: selection per call, load once."""
    dev = _device_info(t.device)
    selection = _select.select_fa2_library(dev)
    return getattr(torch.ops, _loader.load(selection, dev))


# ---------------------------------------------------------------------------------------
# Validation. One owner per check: the op (ops.cpp) checks every tensor it is given
# (dtypes, shapes, devices, head dims, GQA, layouts, option values) with the op's name in
# its RuntimeError, before it looks at whether q is on a GPU; Python checks what the op
# cannot see or what Python itself uses first: Python types, unsupported options, the
# ranks it allocates outputs and routes calls by, host-side lengths, and CPU tensors (no
# library is picked for them).


def _check_tensor(name: str, t, fn: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sm7x.fa2.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _check_half(name: str, t, fn: str) -> None:
    """For tensors Python itself reads or writes before any op does (appended k / v)."""
    _check_tensor(name, t, fn)
    if t.dtype != torch.float16:
        raise _select.dtype_error(f"sm7x.fa2.{fn}: {name}", str(t.dtype).replace("torch.", ""))


def _check_unsupported(fn: str, dropout_p, alibi_slopes) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"sm7x.fa2.{fn}: attention dropout is not supported (the kernels have no dropout); "
            f"pass dropout_p=0.0 (got {dropout_p})"
        )
    if alibi_slopes is not None:
        raise NotImplementedError(
            f"sm7x.fa2.{fn}: ALiBi is not supported; pass alibi_slopes=None (or use "
            f"torch.nn.functional.scaled_dot_product_attention with an explicit bias)"
        )


def _check_heads(fn: str, hd: int, heads: int, kv_heads: int) -> None:
    """A head dim the kernels run, and query heads a multiple of the kv heads (GQA/MQA)."""
    if hd not in SUPPORTED_HEAD_DIMS:
        raise _select.head_dim_error(hd, SUPPORTED_HEAD_DIMS)
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"sm7x.fa2.{fn}: num_heads ({heads}) must be a multiple of num_kv_heads "
            f"({kv_heads}) (GQA/MQA)"
        )


def _check_qkv(fn: str, q, k, v, nd: int, layout: str) -> tuple[int, int, int]:
    """Tensors of rank nd (Python allocates the outputs from their shapes); the op checks
    the rest. Returns num_heads, num_kv_heads, head_dim as given."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, fn)
        if t.dim() != nd:
            raise ValueError(f"sm7x.fa2.{fn}: {name} must be {nd}-D {layout}, got shape "
                             f"{tuple(t.shape)}")
    return q.shape[-2], k.shape[-2], q.shape[-1]


# cu_seqlens tensors that passed _check_cu_seqlens: (id, total, max_seqlen) -> (weak
# reference, version counter); one tensor may serve as cu_seqlens_q and _k with other bounds.
# A model calls flash_attn_varlen_func once per layer with the same cu_seqlens, and the
# check's host copy waits for the stream: it runs once per tensor and contents (every
# in-place write through torch bumps the tensor's version counter).
_checked_cu: dict[tuple, tuple] = {}
_CHECKED_CU_MAX = 16


def _check_cu_seqlens(fn: str, name: str, cu, total: int, max_seqlen: int, tensor: str) -> None:
    """The kernels read cu_seqlens as offsets into q/k/v, so a wrong one would read out of
    bounds: it is checked on the host (one small device-to-host copy, which waits for the
    stream), once per tensor, contents, total and max_seqlen (_checked_cu; inference-mode
    tensors have no version counter and are checked every call)."""
    key = None if cu.is_inference() else (id(cu), total, max_seqlen)
    if key is not None:
        hit = _checked_cu.get(key)
        if hit is not None and hit[0]() is cu and hit[1] == cu._version:
            return
    c = [int(x) for x in cu.tolist()]
    if c[0] != 0 or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"sm7x.fa2.{fn}: {name} must start at 0 and never decrease, got {c[:8]}"
                         f"{'...' if len(c) > 8 else ''}")
    if c[-1] != total:
        raise ValueError(f"sm7x.fa2.{fn}: {name} ends at {c[-1]} but {tensor} holds {total} tokens; "
                         f"the last entry must be the total token count")
    longest = max((b - a for a, b in zip(c, c[1:])), default=0)
    if longest > max_seqlen:
        raise ValueError(f"sm7x.fa2.{fn}: a sequence in {name} has {longest} tokens but "
                         f"max_seqlen_{tensor} is {max_seqlen}; pass the longest length")
    if key is not None:
        if len(_checked_cu) >= _CHECKED_CU_MAX:
            _checked_cu.clear()
        _checked_cu[key] = (weakref.ref(cu), cu._version)


def _check_max_seqlens(fn: str, max_seqlen_q, max_seqlen_k, total_q: int = 0,
                       total_k: int = 0) -> tuple[int, int]:
    """``total_q``/``total_k``: the query / key rows the call holds (0: not known here). A
    bound of 0 with rows present is refused: the kernels take 0 as "nothing to do" and
    would leave the output unwritten."""
    api = f"sm7x.fa2.{fn}"
    max_seqlen_q = _args.integer(api, "max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _args.integer(api, "max_seqlen_k", max_seqlen_k)
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError(f"{api}: max_seqlen_q/max_seqlen_k must be >= 0")
    for name, bound, rows, what in (("max_seqlen_q", max_seqlen_q, total_q, "q"),
                                    ("max_seqlen_k", max_seqlen_k, total_k, "k")):
        if bound == 0 and rows > 0:
            raise ValueError(f"{api}: {name} is 0 but {what} holds {rows} tokens: pass the "
                             f"longest sequence's length (max of the differences of "
                             f"cu_seqlens_{what})")
    return max_seqlen_q, max_seqlen_k


def _check_out_alias(fn: str, out: torch.Tensor, **inputs) -> None:
    """A caller's out= must not overlap itself (an expanded tensor: rows written twice) or
    any input the kernels still read while it is written (keys, values, the cache); only a
    certain overlap is refused (sm7x._args)."""
    _args.check_writes(f"sm7x.fa2.{fn}", {"out": out}, inputs)


def _prepare(fn: str, q, k, v, out=None):
    """After validation: the library for q's device, kernel-readable q/k/v, and out (the
    caller's, when it is one the kernels can write)."""
    _check_cuda(fn, q)
    ops = _ops_for(q)
    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    if out is not None:
        _check_tensor("out", out, fn)
        if out.shape != q.shape or out.device != q.device or _kernel_layout(out) is not out:
            raise ValueError(f"sm7x.fa2.{fn}: out must be a contiguous float16 tensor of q's "
                             f"shape {tuple(q.shape)} on {q.device}, got {tuple(out.shape)} on "
                             f"{out.device}")
        _check_out_alias(fn, out, q=q, k=k, v=v)
        return ops, q, k, v, out
    return ops, q, k, v, _fresh(q)


def _check_options(fn: str, softmax_scale, hd: int, causal, window_size, softcap):
    api = f"sm7x.fa2.{fn}"
    if softmax_scale is None:
        softmax_scale = hd ** -0.5 if hd > 0 else 1.0  # the op refuses head dim 0
    softmax_scale = _args.number(api, "softmax_scale", softmax_scale)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"{api}: window_size must be a pair (left, right) of ints, got "
                        f"{window_size!r}") from None
    left, right = _args.integer(api, "window_size[0]", left), _args.integer(
        api, "window_size[1]", right)
    softcap = _args.number(api, "softcap", softcap)
    causal = _args.flag(api, "causal", causal)
    if causal and right >= -1:  # a right < -1 is left for the op to refuse
        right = 0
    return softmax_scale, bool(causal), left, right, softcap


def _check_option_values(fn: str, scale: float, left: int, right: int, softcap: float) -> None:
    """The op's option checks, for the calls that write into a cache before the op runs
    (flash_attn_with_kvcache's append): a call the op would refuse must not write first."""
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"sm7x.fa2.{fn}: softmax_scale must be a finite number > 0, got "
                         f"{scale}")
    if left < -1 or right < -1:
        raise ValueError(f"sm7x.fa2.{fn}: window_size values must be >= 0, or -1 for "
                         f"unbounded, got ({left}, {right})")
    if not (softcap >= 0 and softcap != float("inf")):
        raise ValueError(f"sm7x.fa2.{fn}: softcap must be a finite number >= 0 (0 = off), "
                         f"got {softcap}")


def _check_cuda(fn: str, q) -> None:
    if q.device.type != "cuda":
        raise ValueError(
            f"sm7x.fa2.{fn}: inputs are on {q.device}; sm7x FA2 runs on CUDA tensors only "
            f"(move them with .cuda(), or use torch.nn.functional.scaled_dot_product_attention "
            f"on CPU)"
        )


def _deterministic(fn: str, asked) -> bool:
    """deterministic=, or torch.use_deterministic_algorithms(True): a torch user who asked
    for reproducible runs gets a fixed dQ order without also passing the argument."""
    return (_args.flag(f"sm7x.fa2.{fn}", "deterministic", asked)
            or torch.are_deterministic_algorithms_enabled())


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _differentiable(*tensors) -> bool:
    """The call goes through the autograd custom ops (sm7x.fa2._autograd): an input requires
    grad, or torch.compile traces it (the ops have fakes and do their layout work at run
    time, where the direct path reads data pointers)."""
    return torch.compiler.is_compiling() or _needs_grad(*tensors)


def _rows_aligned(t: torch.Tensor, elems: int, data_bytes: int) -> bool:
    """Last dim contiguous, data at a multiple of data_bytes, other strides (of dims longer
    than 1) multiples of elems elements."""
    return t.stride(-1) == 1 and t.data_ptr() % data_bytes == 0 and all(
        s % elems == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n > 1)


def _fresh(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """A new contiguous tensor of t's shape (t's dtype unless given) on t's device: what the
    kernels write (outputs, gradients, scratch). torch.empty(shape, dtype=, device=) costs
    about 1 µs more host time per call (its device argument); a training step allocates
    seven (host_step: MEASUREMENTS.md, "Host time of an eager training step")."""
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """The kernels read 16-byte chunks: last dim contiguous, other strides multiples of 8.
    (A contiguous tensor whose last dim is a multiple of 8 has them: checked first, as the
    common case costs a few µs less of host time per call that way.)"""
    if t.is_contiguous() and t.shape[-1] % 8 == 0 and t.data_ptr() % 16 == 0:
        return t
    return t if _rows_aligned(t, 8, 16) else t.contiguous()


# ---------------------------------------------------------------------------------------
# API (flash-attn 2.x names and shapes).


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False, s_aux=None):
    """Attention over ``q [batch, seqlen_q, num_heads, head_dim]``, ``k``/``v``
    ``[batch, seqlen_k, num_kv_heads, head_dim]`` (fp16, CUDA).

    Returns ``out [batch, seqlen_q, num_heads, head_dim]``; with ``return_attn_probs``
    ``(out, softmax_lse [batch, num_heads, seqlen_q] fp32, None)`` (no dropout, so no
    S_dmask). Rows that see no key (causal with seqlen_q > seqlen_k, windows) give 0
    and lse = +inf. Differentiable in q, k, v (not in softmax_lse). ``deterministic``:
    the backward accumulates dq in a fixed order (the forward always is deterministic).
    ``s_aux``: attention sinks, one logit per query head ``[num_heads]`` (gpt-oss; vLLM's
    ``sinks``) that joins every row's softmax denominator with no value; differentiable
    too; softmax_lse then includes it.
    """
    fn = "flash_attn_func"
    _check_unsupported(fn, dropout_p, alibi_slopes)
    heads, kv_heads, hd = _check_qkv(fn, q, k, v, 4, "[batch, seqlen, num_heads, head_dim]")
    sinks = _sink_logits(fn, s_aux, q)
    scale, causal, left, right, softcap = _check_options(fn, softmax_scale, hd, causal,
                                                         window_size, softcap)
    deterministic = _deterministic(fn, deterministic)
    if _differentiable(*_grad_inputs(q, k, v, s_aux)):
        _check_cuda(fn, q)
        opts = (scale, causal, left, right, softcap, deterministic)
        out, lse = (_autograd.call(_autograd.ATTN, q, k, v, *opts) if sinks is None
                    else _autograd.call(_sinks.ATTN, q, k, v, sinks, *opts))
        return (out, lse, None) if return_attn_probs else out
    ops, q, k, v, out = _prepare(fn, q, k, v)
    lse = q.new_empty((q.shape[0], heads, q.shape[1]), dtype=torch.float32)
    if q.shape[0] == k.shape[0] and _few_rows(q.shape[1], heads, kv_heads, hd, k.shape[1]):
        _serving_module().dense(fn, ops, q, k, v, out, lse, scale, causal, left, right, softcap,
                                sinks)
    else:
        ops.fwd(q, k, v, out, lse, scale, causal, left, right, softcap, sinks=sinks)
    return (out, lse, None) if return_attn_probs else out


def _grad_inputs(q, k, v, s_aux) -> tuple:
    """The tensors a call may differentiate in: q, k, v, and the sinks when given."""
    return (q, k, v) if s_aux is None else (q, k, v, s_aux)


def _sink_logits(fn: str, s_aux, q):
    """s_aux checked against q (float32 [num_heads]), or None: before any work or write."""
    if s_aux is None:
        return None
    _check_tensor("q", q, fn)
    if q.dim() < 3:
        raise ValueError(f"sm7x.fa2.{fn}: q must be [..., num_heads, head_dim], got shape "
                         f"{tuple(q.shape)}")
    return _sinks.check(fn, s_aux, q, q.shape[-2])


def _few_rows(sq: int, heads: int, kv_heads: int, hd: int, sk: int) -> bool:
    """An inference call of flash_attn_func / flash_attn_varlen_func (sq, sk: the longest
    sequence's) that the serving kernel runs faster: few query rows per kv head over more
    keys than rows (decode, short verification: see _serving.dense). The prefill kernel
    keeps the rest, every call that needs grad, and every call its op refuses (a head dim
    or GQA ratio no kernel runs: the prefill op says why)."""
    if kv_heads <= 0 or heads % kv_heads or not 0 < hd <= MAX_HEAD_DIM or _dense_forced():
        return False
    # the rows the serving kernel's narrow tiles are for: more run its prefill tiles, which
    # the prefill kernel matches
    return 0 < sq * (heads // kv_heads) <= _targets.fa2_serving_wide_rows() and sk > sq


def _dense_forced() -> bool:
    """SM7X_FA2_DENSE=prefill keeps every flash_attn_func / flash_attn_varlen_func call on
    the prefill kernel (for A/B measurements and as an escape hatch)."""
    return os.environ.get("SM7X_FA2_DENSE", "").strip().lower() == "prefill"


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None,
                           seqused_k=None, out=None, scheduler_metadata=None, k_descale=None,
                           v_descale=None, kv_cache_dtype=None, k_scale_cache=None,
                           v_scale_cache=None, s_aux=None):
    """Attention over packed sequences: ``q [total_q, num_heads, head_dim]``, ``k``/``v``
    ``[total_k, num_kv_heads, head_dim]``; sequence ``i`` is ``q[cu_seqlens_q[i]:
    cu_seqlens_q[i+1]]`` (int32 ``[batch + 1]``). ``max_seqlen_q``/``max_seqlen_k`` must
    be at least the longest sequence (they size the grid). Returns ``out [total_q,
    num_heads, head_dim]``; with ``return_attn_probs`` ``(out, softmax_lse [num_heads,
    total_q] fp32, None)``.

    Paged (vLLM's flash-attn fork's call): with ``block_table`` (int32 ``[batch,
    max_blocks]``) ``k``/``v`` are the caches ``[num_blocks, page_size, num_kv_heads,
    head_dim]`` (page_size a power of two; the layout ``sm7x.ops.reshape_and_cache``
    writes) and the key counts come from ``seqused_k`` (int32 ``[batch]``; or the
    differences of ``cu_seqlens_k``); ``max_seqlen_k`` bounds them. Several queries per
    sequence (chunked prefill, speculative verification) use bottom-right causal masking.
    ``out``: written in place when given. ``scheduler_metadata``: a :class:`DecodePlan`
    from :func:`plan_decode` (no planning, no workspace allocation: CUDA-graph capturable).
    8-bit caches: ``torch.float8_e4m3fn`` / ``float8_e5m2`` (or uint8 with
    ``kv_cache_dtype`` ``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, vLLM's names) holding
    ``x / descale``; ``k_descale`` / ``v_descale``: float32, one value, one per kv head or
    ``[batch, num_kv_heads]`` (FA3's names; None: 1). int8 caches (``torch.int8``,
    vLLM's ``"int8_per_token_head"``) hold ``x / s`` with a scale per cached row and kv
    head in ``k_scale_cache`` / ``v_scale_cache`` (float32 ``[num_blocks, page_size,
    num_kv_heads]``, any strides; rows 4-byte aligned, as vLLM lays them out).
    The paged call is inference-only; the others are differentiable in q, k, v (then
    without ``out``), with ``deterministic`` and ``s_aux`` (sinks) as in
    :func:`flash_attn_func`.
    """
    fn = "flash_attn_varlen_func"
    _check_unsupported(fn, dropout_p, alibi_slopes)
    sinks = _sink_logits(fn, s_aux, q)
    if k_scale_cache is not None or v_scale_cache is not None:
        k_descale, v_descale = _serving_module().scale_caches(
            fn, k, kv_cache_dtype, k_descale, v_descale, k_scale_cache, v_scale_cache)
    if (block_table is not None or seqused_k is not None) and torch.compiler.is_compiling():
        _serving_ops.no_plan(fn, scheduler_metadata)
        res, lse = _serving_ops.varlen_paged(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, *_serving_ops.window(window_size), softcap, block_table, seqused_k,
            k_descale, v_descale, kv_cache_dtype, sinks)
        if out is not None:
            res = out.copy_(res)
        return (res, lse, None) if return_attn_probs else res
    if block_table is not None or seqused_k is not None:
        res = _serving_module().varlen_paged(
            fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, return_lse=return_attn_probs, block_table=block_table,
            seqused_k=seqused_k, out=out, scheduler_metadata=scheduler_metadata,
            k_descale=k_descale, v_descale=v_descale, kv_cache_dtype=kv_cache_dtype, sinks=sinks)
        return res
    for name, given in (("scheduler_metadata", scheduler_metadata), ("k_descale", k_descale),
                        ("v_descale", v_descale), ("kv_cache_dtype", kv_cache_dtype)):
        if given is not None:
            raise ValueError(f"sm7x.fa2.{fn}: {name} applies to calls over a KV cache; pass "
                             f"it with block_table/seqused_k")
    heads, kv_heads, hd = _check_qkv(fn, q, k, v, 3, "[total_tokens, num_heads, head_dim]")
    for name, c in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(c, torch.Tensor):
            raise TypeError(f"sm7x.fa2.{fn}: {name} must be a torch.Tensor, got "
                            f"{type(c).__name__}")
        if c.dtype != torch.int32:
            raise TypeError(f"sm7x.fa2.{fn}: {name} has dtype {c.dtype}; it must be "
                            f"torch.int32 (cast with .int())")
        if c.dim() != 1 or c.shape[0] < 1:
            raise ValueError(f"sm7x.fa2.{fn}: {name} must be 1-D [batch + 1], got shape "
                             f"{tuple(c.shape)}")
        if c.device != q.device:
            raise ValueError(f"sm7x.fa2.{fn}: {name} is on {c.device} but q is on "
                             f"{q.device}; move it with .to(q.device)")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"sm7x.fa2.{fn}: cu_seqlens_q {tuple(cu_seqlens_q.shape)} and "
                         f"cu_seqlens_k {tuple(cu_seqlens_k.shape)} must both be [batch + 1]")
    max_seqlen_q, max_seqlen_k = _check_max_seqlens(fn, max_seqlen_q, max_seqlen_k,
                                                    q.shape[0], k.shape[0])
    scale, causal, left, right, softcap = _check_options(fn, softmax_scale, hd, causal,
                                                         window_size, softcap)
    deterministic = _deterministic(fn, deterministic)
    if _differentiable(*_grad_inputs(q, k, v, s_aux)):
        if out is not None and _needs_grad(*_grad_inputs(q, k, v, s_aux)):
            raise ValueError(f"sm7x.fa2.{fn}: out= cannot be combined with inputs that require "
                             f"grad (autograd saves the op's own output); drop out=, or call "
                             f"under torch.no_grad()")
        _check_cuda(fn, q)
        # the op checks cu_seqlens against q/k on the host when it runs (not traced)
        opts = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, left,
                right, softcap, deterministic)
        res, lse = (_autograd.call(_autograd.ATTN_VARLEN, q, k, v, *opts) if sinks is None
                    else _autograd.call(_sinks.ATTN_VARLEN, q, k, v, sinks, *opts))
        if out is not None:  # compiled inference with out=
            _check_tensor("out", out, fn)
            if out.shape != res.shape:
                raise ValueError(f"sm7x.fa2.{fn}: out must have q's shape {tuple(q.shape)}, got "
                                 f"{tuple(out.shape)}")
            res = out.copy_(res)
        return (res, lse, None) if return_attn_probs else res
    _check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "q")
    _check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "k")
    ops, q, k, v, out = _prepare(fn, q, k, v, out)
    lse = q.new_empty((heads, q.shape[0]), dtype=torch.float32)
    if _few_rows(max_seqlen_q, heads, kv_heads, hd, max_seqlen_k):
        _serving_module().dense_varlen(fn, ops, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, scale, causal, left, right,
                                       softcap, sinks)
    else:
        ops.fwd_varlen(q, k, v, out, lse, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                       max_seqlen_q, max_seqlen_k, scale, causal, left, right, softcap,
                       sinks=sinks)
    return (out, lse, None) if return_attn_probs else out


def _unpack(fn: str, name: str, t, nd: int, n: int, layout: str):
    """The n views (q, k, v or k, v) of a packed tensor along its dim -3."""
    _check_tensor(name, t, fn)
    if t.dim() != nd or t.shape[-3] != n:
        raise ValueError(f"sm7x.fa2.{fn}: {name} must be {nd}-D {layout}, got shape "
                         f"{tuple(t.shape)}")
    return t.unbind(-3)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` on ``qkv [batch, seqlen, 3, num_heads, head_dim]`` (q, k and
    v read in place through strided views; the gradient is ``[..., 3, ...]`` like qkv)."""
    q, k, v = _unpack("flash_attn_qkvpacked_func", "qkv", qkv, 5, 3,
                      "[batch, seqlen, 3, num_heads, head_dim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` with ``kv [batch, seqlen_k, 2, num_kv_heads, head_dim]``."""
    k, v = _unpack("flash_attn_kvpacked_func", "kv", kv, 5, 2,
                   "[batch, seqlen_k, 2, num_kv_heads, head_dim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` on ``qkv [total_tokens, 3, num_heads, head_dim]``
    (the same sequences for queries and keys)."""
    q, k, v = _unpack("flash_attn_varlen_qkvpacked_func", "qkv", qkv, 4, 3,
                      "[total_tokens, 3, num_heads, head_dim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """:func:`flash_attn_varlen_func` with ``kv [total_k, 2, num_kv_heads, head_dim]``."""
    k, v = _unpack("flash_attn_varlen_kvpacked_func", "kv", kv, 4, 2,
                   "[total_k, 2, num_kv_heads, head_dim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, scheduler_metadata=None, k_descale=None,
                            v_descale=None, kv_cache_dtype=None, k_scale_cache=None,
                            v_scale_cache=None, s_aux=None, check_inputs=None):
    """flash-attn 2.x's decoding call: ``q [batch, seqlen_q, num_heads, head_dim]`` against
    a KV cache, contiguous ``[batch_cache, seqlen_cache, num_kv_heads, head_dim]`` or paged
    ``[num_blocks, page_size, num_kv_heads, head_dim]`` with ``block_table [batch,
    max_blocks]``.

    ``k``/``v`` ``[batch, seqlen_new, num_kv_heads, head_dim]``: appended in place at
    positions ``cache_seqlens[b] ..`` before attending (over ``cache_seqlens + seqlen_new``
    keys). ``rotary_cos``/``rotary_sin`` ``[seqlen_ro, rotary_dim / 2]``: rotary on the new
    k at its positions and on q at ``cache_seqlens + i`` (causal or local) or at
    ``cache_seqlens`` (GPT-J pairs when ``rotary_interleaved``, else NeoX halves).
    ``cache_batch_idx``: the cache row of each sequence; ``cache_leftpad``: keys before it
    are ignored (contiguous cache only). ``num_splits``: 0 automatic split-KV, 1 none, n at
    most n. Returns ``out`` (and ``softmax_lse [batch, num_heads, seqlen_q]`` with
    ``return_softmax_lse``). The append and rotary are torch ops; the attention is one
    sm7x call.

    8-bit caches (``torch.float8_e4m3fn`` / ``float8_e5m2``, or uint8 with
    ``kv_cache_dtype``, as in :func:`flash_attn_varlen_func`) hold ``x / descale``: the
    appended ``k``/``v`` are encoded so (nearest even, saturating) with ``k_descale`` /
    ``v_descale`` (float32; one value, one per kv head or ``[batch, num_kv_heads]``).
    int8 caches (``torch.int8``) with ``k_scale_cache`` / ``v_scale_cache`` ``[batch_cache
    or num_blocks, seqlen_cache or page_size, num_kv_heads]``, a scale per cached row: the
    appended rows are encoded as ``sm7x.ops.reshape_and_cache`` writes them and their
    scales stored beside them. ``s_aux``: sinks, as in :func:`flash_attn_func`.

    ``check_inputs`` (sm7x's own): ``False`` skips the device-side input check of this
    call (:func:`set_input_checks`: a small kernel and one stream sync) for a caller that
    built ``cache_seqlens``, ``block_table``, ``cache_batch_idx``, ``cache_leftpad`` and the
    plan itself; ``None`` (the default) follows :func:`input_checks`. Off, a bad value gives
    a wrong answer, never an out-of-bounds access.
    """
    fn = "flash_attn_with_kvcache"
    _check_unsupported(fn, 0.0, alibi_slopes)
    if check_inputs is not None and not isinstance(check_inputs, bool):
        raise TypeError(f"sm7x.fa2.{fn}: check_inputs must be None, True or False, got "
                        f"{type(check_inputs).__name__}")
    sinks = _sink_logits(fn, s_aux, q)
    if k_scale_cache is not None or v_scale_cache is not None:
        k_descale, v_descale = _serving_module().scale_caches(
            fn, k_cache, kv_cache_dtype, k_descale, v_descale, k_scale_cache, v_scale_cache)
    if torch.compiler.is_compiling():  # one opaque op: no host-side work in the graph
        _serving_ops.no_plan(fn, scheduler_metadata)
        if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
            cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                       device=q.device)
        out, lse = _serving_ops.kvcache(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, causal, *_serving_ops.window(window_size),
            softcap, rotary_interleaved, num_splits, k_descale, v_descale, kv_cache_dtype, sinks,
            check_inputs is not False)
        return (out, lse) if return_softmax_lse else out
    return _serving_module().with_kvcache(
        fn, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
        rotary_interleaved, num_splits, return_softmax_lse, scheduler_metadata, k_descale,
        v_descale, kv_cache_dtype, sinks=sinks, check_inputs=check_inputs is not False)


from . import _autograd  # noqa: E402  (uses the helpers above)
from . import _serving_ops  # noqa: E402  (the serving calls as ops, for torch.compile)
from . import _sinks  # noqa: E402  (attention sinks: checks, autograd with the sink's gradient)
from ._autograd import BackwardFallbackWarning  # noqa: E402


def _serving_module():
    """The serving paths (_serving.py), imported on first use: a prefill-only or training
    process never pays its import (``import sm7x.fa2`` is held to 50 ms beyond torch)."""
    from . import _serving

    return _serving


def __getattr__(name: str):
    if name in ("DecodePlan", "plan_decode"):
        return getattr(_serving_module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
