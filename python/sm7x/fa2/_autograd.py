"""FA2 through autograd: flash_attn_func / flash_attn_varlen_func (and the packed variants)
on inputs that require grad, or under torch.compile.

Four Python custom ops in namespace ``sm7x_fa2`` (``torch.library.custom_op``), each a thin
shell around the arch library's op (``sm7x_fa2_sm75`` / ``sm7x_fa2_sm70``, picked per call
from the input's device):

- ``attn`` / ``attn_varlen``: the forward; return ``(out, lse)``. Differentiable through
  ``register_autograd``: the context saves q, k, v, out and the fp32 LSE, never S or P
  (flash-attn's semantics); lse is not differentiable (flash-attn ignores its gradient too).
- ``attn_backward`` / ``attn_varlen_backward``: the library's ``bwd`` / ``bwd_varlen``
  (dq, dk, dv; GQA: dk/dv summed over the query heads of a group inside the op, so they
  have k/v's shape; ``deterministic`` is passed on).

Being registered ops with fake implementations, torch.compile (``fullgraph=True``) traces
them as single nodes, forward and backward. Eager calls (``call``) run the same
implementations, setup and backward under a ``torch.autograd.Function`` instead: the
ops' autograd wrapper is host time paid on every call, per layer and step.
torch.utils.checkpoint recomputes either like any op. What the kernels need (16-byte
chunks, the library of the device, host checks of cu_seqlens) happens inside the ops' real
implementations, never in traced code.

Fallback: where the library has no backward kernel for a head dim
(``bwd_supported(head_dim)`` false; the likely case is d=256 on Turing, whose 64 KB of
shared memory per block is tight for the backward's tiles) or no backward at all (a library
built before it), that call's backward is computed here in float32 PyTorch math from the
saved q, k, v, out and LSE (the same formulas: P rebuilt from the LSE, dS = P * (dP - D)),
per sequence and in chunks of query rows so that each fp32 score-sized buffer stays within
~128 MB (a few live at once), with a :class:`BackwardFallbackWarning` once per library and
head dim naming the head dim and why. It is correct but slower and uses more memory than
the kernels. Why a fallback rather than an error: a fine-tune of a d=256 model (Gemma) on
a T4 then still runs, its other layers and the forward on the kernels, and says so once;
to make it an error instead:
``warnings.filterwarnings("error", category=sm7x.fa2.BackwardFallbackWarning)``.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .. import fa2 as _fa2

NAMESPACE = "sm7x_fa2"
# fp32 elements of one S / P / dP / dS chunk in the fallback (4 of them live at a time)
_FALLBACK_CHUNK = 32 * 1024 * 1024


class BackwardFallbackWarning(UserWarning):
    """A backward ran in float32 PyTorch math instead of the library's kernels."""


_warn_lock = threading.Lock()
_warned: set[tuple[str, int]] = set()
_supported: dict[tuple[str, int], tuple[bool, str]] = {}
_accum: dict[tuple[str, int], bool] = {}  # (library, head dim): bwd_uses_dq_accum


def _lib_key(ops, head_dim: int) -> tuple[str, int]:
    """The key of the per-library caches above: (the library's name, head dim)."""
    name = getattr(ops, "name", None)  # (not getattr's default: str(ops) on every call)
    return (name if name is not None else str(ops), head_dim)


def _backward_kernel(ops, head_dim: int) -> tuple[bool, str]:
    """(the library has a backward kernel for head_dim, why not)."""
    key = _lib_key(ops, head_dim)
    name = key[0]
    hit = _supported.get(key)
    if hit is None:
        if not (hasattr(ops, "bwd") and hasattr(ops, "bwd_supported")):
            hit = (False, f"the loaded library ({name}) has no backward kernels (built before "
                          f"sm7x had them): update the sm7x-fa2 packages")
        elif not bool(ops.bwd_supported(head_dim)):
            hit = (False, f"{name} has no backward kernel for head_dim={head_dim} (its "
                          f"bwd_supported({head_dim}) is false)")
        else:
            hit = (True, "")
        _supported[key] = hit
    return hit


def _dq_accum(ops, q: Tensor, deterministic: bool) -> Tensor:
    """The fp32 dQ sum the library's backward adds into (the op zeroes it), or an empty
    tensor where this call's dQ comes from the library's dQ kernel instead: deterministic,
    or a head dim whose kernel entry says dq_pass (``bwd_uses_dq_accum`` false). A library
    built before that op refuses an empty one, so it always gets q's shape."""
    if hasattr(ops, "bwd_uses_dq_accum") and (deterministic or not _uses_accum(ops, q.shape[-1])):
        return q.new_empty(0, dtype=torch.float32)
    return _fa2._fresh(q, dtype=torch.float32)


def _uses_accum(ops, head_dim: int) -> bool:
    key = _lib_key(ops, head_dim)
    hit = _accum.get(key)
    if hit is None:
        hit = _accum[key] = bool(ops.bwd_uses_dq_accum(head_dim))
    return hit


def _warn_fallback(ops, head_dim: int, why: str) -> None:
    key = _lib_key(ops, head_dim)
    if key in _warned:
        return
    with _warn_lock:
        if key in _warned:
            return
        warnings.warn(
            f"sm7x.fa2: backward for head_dim={head_dim} runs in float32 PyTorch math, not in "
            f"FA2 kernels: {why}. Gradients are correct but slower and use more memory "
            f"(S is materialized per chunk of query rows). Said once per library and head dim.",
            BackwardFallbackWarning, stacklevel=2)
        _warned.add(key)  # after warn: a filter that turns it into an error raises each time


def _layout(*ts: Tensor):
    return tuple(_fa2._kernel_layout(t) for t in ts)


# ---------------------------------------------------------------------------------------
# batched [B, S, H, D]


def _attn(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
          window_left: int, window_right: int, softcap: float,
          deterministic: bool) -> tuple[Tensor, Tensor]:
    """out [B, Sq, H, D] fp16, lse [B, H, Sq] fp32 (the library's fwd). ``deterministic``
    does not change the forward (it always is): it is an input so that the backward gets it."""
    return fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap)


attn = torch.library.custom_op(f"{NAMESPACE}::attn", _attn, mutates_args=())


def fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, sinks=None):
    """The library's fwd into new out / lse (with sinks: float32 [H], in the kernel)."""
    ops = _fa2._ops_for(q)
    q, k, v = _layout(q, k, v)
    out = _fa2._fresh(q)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    ops.fwd(q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
            sinks=sinks)
    return out, lse


@attn.register_fake
def _attn_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
               deterministic):
    return (q.new_empty(q.shape),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))


def _attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   softmax_scale: float, causal: bool, window_left: int, window_right: int,
                   softcap: float, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (q's, k's, v's shapes, fp16): the library's bwd, or the float32 fallback."""
    ops = _fa2._ops_for(q)
    ok, why = _backward_kernel(ops, q.shape[-1])
    if not ok:
        _warn_fallback(ops, q.shape[-1], why)
        return _math_backward_batched(dout, q, k, v, out, lse, softmax_scale, causal,
                                      window_left, window_right, softcap)
    dout, q, k, v, out = _layout(dout, q, k, v, out)
    dq, dk, dv = _fa2._fresh(q), _fa2._fresh(k), _fa2._fresh(v)
    dq_accum = _dq_accum(ops, q, deterministic)
    dsum = _fa2._fresh(lse)
    ops.bwd(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, dq_accum, dsum, softmax_scale,
            causal, window_left, window_right, softcap, deterministic)
    return dq, dk, dv


attn_backward = torch.library.custom_op(f"{NAMESPACE}::attn_backward", _attn_backward,
                                        mutates_args=())


@attn_backward.register_fake
def _attn_backward_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left,
                        window_right, softcap, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    # softmax_scale, causal, window_left, window_right, softcap, deterministic
    ctx.opts = tuple(inputs[3:])
    ctx.mark_non_differentiable(lse)


def _attn_grad(ctx, dout, _dlse, backward=attn_backward):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = backward(dout, q, k, v, out, lse, *ctx.opts)
    return (dq, dk, dv) + (None,) * len(ctx.opts)


# ---------------------------------------------------------------------------------------
# varlen [total, H, D]


def _attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                 max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
                 window_left: int, window_right: int, softcap: float,
                 deterministic: bool) -> tuple[Tensor, Tensor]:
    """out [total_q, H, D] fp16, lse [H, total_q] fp32 (the library's fwd_varlen). The
    cu_seqlens are checked against the tensors here (a host copy, once per tensor and
    contents: _fa2._check_cu_seqlens), before the library is loaded: the kernels read them
    as offsets."""
    return fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal, window_left, window_right, softcap)


attn_varlen = torch.library.custom_op(f"{NAMESPACE}::attn_varlen", _attn_varlen, mutates_args=())


def fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
               causal, window_left, window_right, softcap, sinks=None):
    """The library's fwd_varlen into new out / lse (with sinks: float32 [H], in the kernel)."""
    fn = "flash_attn_varlen_func"
    _fa2._check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "q")
    _fa2._check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "k")
    ops = _fa2._ops_for(q)
    q, k, v = _layout(q, k, v)
    out = _fa2._fresh(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    ops.fwd_varlen(q, k, v, out, lse, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                   max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                   window_right, softcap, sinks=sinks)
    return out, lse


@attn_varlen.register_fake
def _attn_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal, window_left, window_right, softcap,
                      deterministic):
    return (q.new_empty(q.shape),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _attn_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                          lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                          causal: bool, window_left: int, window_right: int, softcap: float,
                          deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of attn_varlen: the library's bwd_varlen, or the float32 fallback."""
    ops = _fa2._ops_for(q)
    ok, why = _backward_kernel(ops, q.shape[-1])
    if not ok:
        _warn_fallback(ops, q.shape[-1], why)
        return _math_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                     softmax_scale, causal, window_left, window_right, softcap)
    dout, q, k, v, out = _layout(dout, q, k, v, out)
    dq, dk, dv = _fa2._fresh(q), _fa2._fresh(k), _fa2._fresh(v)
    dq_accum = _dq_accum(ops, q, deterministic)
    dsum = _fa2._fresh(lse)
    ops.bwd_varlen(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, dq_accum, dsum,
                   cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q,
                   max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                   deterministic)
    return dq, dk, dv


attn_varlen_backward = torch.library.custom_op(f"{NAMESPACE}::attn_varlen_backward",
                                               _attn_varlen_backward, mutates_args=())


@attn_varlen_backward.register_fake
def _attn_varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                               window_right, softcap, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k = inputs[:5]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    # max_seqlen_q, max_seqlen_k, scale, causal, left, right, softcap, deterministic
    ctx.opts = tuple(inputs[5:])
    ctx.mark_non_differentiable(lse)


def _attn_varlen_grad(ctx, dout, _dlse, backward=attn_varlen_backward):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = backward(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.opts)
    return (dq, dk, dv) + (None,) * (2 + len(ctx.opts))


# ---------------------------------------------------------------------------------------
# eager calls: the same implementations, setup and backward under a torch.autograd.Function


class Twin(NamedTuple):
    """What an autograd op runs, for the eager path: the op, its implementation, its
    setup_context, its backward (which calls the backward op unless given ``backward=``) and
    the backward op's implementation."""
    op: object
    impl: Callable
    setup: Callable
    grad: Callable
    backward_impl: Callable


def register_autograd(op, impl: Callable, setup: Callable, grad: Callable,
                      backward_impl: Callable) -> Twin:
    """Registers grad / setup as op's autograd (what torch.compile traces) and returns the
    Twin that runs the same for eager calls (``call``)."""
    op.register_autograd(grad, setup_context=setup)
    return Twin(op, impl, setup, grad, backward_impl)


class _Eager(torch.autograd.Function):
    """A Twin's forward and backward. torch.library's autograd wrapper around a Python
    custom op costs host time on every call (measured with kernels that do nothing:
    MEASUREMENTS.md, "Host time of an eager training step"); eager training pays it per
    attention layer and step, torch.compile does not (it traces the ops once)."""

    # forward with ctx, no setup_context: a new-style Function costs more host time per call
    # (~35 µs a step in host_step.py), and torch.func transforms fail either way (so did the ops)
    @staticmethod
    def forward(ctx, twin, *inputs):
        output = twin.impl(*inputs)
        twin.setup(ctx, inputs, output)
        ctx.twin = twin
        ctx.set_materialize_grads(False)  # no zero-filled gradient for the lse output
        return output

    @staticmethod
    def backward(ctx, *grads):
        twin = ctx.twin
        if torch.is_grad_enabled():
            # create_graph=True: through the backward op, whose outputs refuse a second
            # backward (it has no formula) instead of passing as constants
            return (None, *twin.grad(ctx, *grads))
        return (None, *twin.grad(ctx, *grads, backward=twin.backward_impl))


def call(twin: Twin, *inputs):
    """twin's op under torch.compile (a traced node with a fake), its implementation under
    _Eager outside it."""
    if torch.compiler.is_compiling():
        return twin.op(*inputs)
    return _Eager.apply(twin, *inputs)


ATTN = register_autograd(attn, _attn, _setup, _attn_grad, _attn_backward)
ATTN_VARLEN = register_autograd(attn_varlen, _attn_varlen, _setup_varlen,
                                _attn_varlen_grad, _attn_varlen_backward)


# ---------------------------------------------------------------------------------------
# float32 fallback (see the module docstring)


def _math_backward_seq(do, q, k, v, o, lse, scale, causal, left, right, softcap):
    """One sequence: do/q/o [Sq, H, D], k/v [Sk, Hk, D], lse [H, Sq] (+inf: a row that saw
    no key). Returns float32 dq [Sq, H, D], dk/dv [Sk, Hk, D] (summed over each GQA group).
    P is rebuilt from the saved LSE: P = exp(S - lse) on the visible keys."""
    sq, h, d = q.shape
    sk, hk = k.shape[0], k.shape[1]
    group = h // hk
    dq = torch.zeros(sq, h, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(h, sk, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(h, sk, d, dtype=torch.float32, device=q.device)

    def group_sum(g):  # [H, Sk, D] -> [Sk, Hk, D]
        return g.transpose(0, 1).reshape(sk, hk, group, d).sum(2)

    if sq == 0 or sk == 0:
        return dq, group_sum(dk), group_sum(dv)
    if causal:
        right = 0
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Sk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    j = torch.arange(sk, device=q.device)[None, :]
    rows = max(1, _FALLBACK_CHUNK // (h * sk))
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        qf = q[r0:r1].float().transpose(0, 1)  # [H, r, D]
        dof = do[r0:r1].float().transpose(0, 1)
        of = o[r0:r1].float().transpose(0, 1)
        s = qf @ kf.transpose(1, 2)  # [H, r, Sk]
        if softcap > 0:
            t = torch.tanh(s * (scale / softcap))
            s = softcap * t
        else:
            s = s * scale
        i = torch.arange(r0, r1, device=q.device)[:, None] + (sk - sq)
        visible = torch.ones(r1 - r0, sk, dtype=torch.bool, device=q.device)
        if right >= 0:
            visible &= j <= i + right
        if left >= 0:
            visible &= j >= i - left
        ls = lse[:, r0:r1].float()[..., None]
        p = torch.exp(s - torch.where(torch.isinf(ls), torch.zeros_like(ls), ls))
        p = torch.where(visible & torch.isfinite(ls), p, torch.zeros_like(p))
        dv += p.transpose(1, 2) @ dof
        dp = dof @ vf.transpose(1, 2)
        ds = p * (dp - (dof * of).sum(-1, keepdim=True))
        ds = ds * (scale * (1 - t * t)) if softcap > 0 else ds * scale
        dq[r0:r1] = (ds @ kf).transpose(0, 1)
        dk += ds.transpose(1, 2) @ qf
    return dq, group_sum(dk), group_sum(dv)


def _math_backward_batched(dout, q, k, v, out, lse, scale, causal, left, right, softcap):
    grads = [_math_backward_seq(dout[b], q[b], k[b], v[b], out[b], lse[b], scale, causal, left,
                                right, softcap) for b in range(q.shape[0])]
    if not grads:
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    return tuple(torch.stack([g[n] for g in grads]).to(t.dtype)
                 for n, t in enumerate((q, k, v)))


def _math_backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, left, right,
                          softcap):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        dq[qs], dk[ks], dv[ks] = _math_backward_seq(dout[qs], q[qs], k[ks], v[ks], out[qs],
                                                    lse[:, qs], scale, causal, left, right,
                                                    softcap)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
