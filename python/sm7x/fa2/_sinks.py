"""Attention sinks (``s_aux``): a learned logit per query head that joins every softmax
denominator as one more column with no value (gpt-oss)::

    out_i = sum_j exp(x_ij) v_j / (exp(s_h) + sum_j exp(x_ij))

The kernels take the sinks (``sinks=`` of the fwd ops, float32 [H]) and add ``exp(s_h)``
to each row's denominator where its output is final (the epilogues; the split-KV combine
for split rows), so the output and LSE leave the kernel sink-aware:

    lse' = logaddexp(lse, s_h),    out' = out * exp(lse - lse')

with lse, out those without the sink. The backward is the kernels' own backward given
``out'`` and ``lse'`` (P rebuilt from ``lse'`` is the sink-aware probability; the sink
column has no value, so dV, dP and rowsum(dO * O) are unchanged in form), plus the sink's
gradient ``ds_h = -sum_i exp(s_h - lse'_i) * rowsum(dO_i * out'_i)``.

A row that sees no key gives out = 0 and lse' = s_h.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _autograd
from ._autograd import NAMESPACE


def check(fn: str, s_aux, q: Tensor, heads: int) -> Tensor:
    """s_aux as float32 [num_heads] on q's device (differentiable: a cast, not a copy by hand)."""
    api = f"sm7x.fa2.{fn}"
    if not isinstance(s_aux, Tensor):
        raise TypeError(f"{api}: s_aux must be a torch.Tensor of one sink logit per query head "
                        f"[num_heads], got {type(s_aux).__name__}")
    if not s_aux.is_floating_point():
        raise TypeError(f"{api}: s_aux has dtype {s_aux.dtype}; it must be a floating-point "
                        f"tensor (float32, or the model's dtype)")
    if s_aux.shape != (heads,):
        raise ValueError(f"{api}: s_aux must have shape [num_heads] = [{heads}], one sink "
                         f"logit per query head, got {tuple(s_aux.shape)}")
    if s_aux.device != q.device:
        raise ValueError(f"{api}: s_aux is on {s_aux.device} but q is on {q.device}; move it "
                         f"with .to(q.device)")
    return s_aux.float().contiguous()


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d s_h = -sum over rows of P_sink * rowsum(dO * O) (float32 [H])."""
    dsum = (dout.float() * out.float()).sum(-1)  # [B, Sq, H] or [T, H]
    p_sink = torch.exp(sinks[:, None] - lse).transpose(-1, -2)
    return -(p_sink * dsum).reshape(-1, sinks.shape[0]).sum(0)


# ---------------------------------------------------------------------------------------
# autograd: the attn / attn_varlen ops, folded, with the sink's gradient


def _attn_sinks(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, softmax_scale: float,
                causal: bool, window_left: int, window_right: int, softcap: float,
                deterministic: bool) -> tuple[Tensor, Tensor]:
    """``attn`` with sinks (float32 [H]): out [B, Sq, H, D], sink-aware lse [B, H, Sq]."""
    return _autograd.fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                         sinks)


attn_sinks = torch.library.custom_op(f"{NAMESPACE}::attn_sinks", _attn_sinks, mutates_args=())


@attn_sinks.register_fake
def _attn_sinks_fake(q, k, v, sinks, *opts):
    return _autograd._attn_fake(q, k, v, *opts)  # the shapes of attn's outputs


def _setup(ctx, inputs, output):
    q, k, v, sinks = inputs[:4]
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse)
    ctx.opts = tuple(inputs[4:])
    ctx.mark_non_differentiable(lse)


def _grad(ctx, dout, _dlse, backward=_autograd.attn_backward):
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dq, dk, dv = backward(dout, q, k, v, out, lse, *ctx.opts)
    return (dq, dk, dv, sink_grad(dout, out, lse, sinks)) + (None,) * len(ctx.opts)


def _attn_varlen_sinks(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, cu_seqlens_q: Tensor,
                       cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                       softmax_scale: float, causal: bool, window_left: int, window_right: int,
                       softcap: float, deterministic: bool) -> tuple[Tensor, Tensor]:
    """``attn_varlen`` with sinks: out [T, H, D], sink-aware lse [H, T]."""
    return _autograd.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, softmax_scale, causal, window_left, window_right,
                                softcap, sinks)


attn_varlen_sinks = torch.library.custom_op(f"{NAMESPACE}::attn_varlen_sinks", _attn_varlen_sinks,
                                            mutates_args=())


@attn_varlen_sinks.register_fake
def _attn_varlen_sinks_fake(q, k, v, sinks, *opts):
    return _autograd._attn_varlen_fake(q, k, v, *opts)  # the shapes of attn_varlen's outputs


def _setup_varlen(ctx, inputs, output):
    q, k, v, sinks, cu_q, cu_k = inputs[:6]
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, cu_q, cu_k)
    ctx.opts = tuple(inputs[6:])
    ctx.mark_non_differentiable(lse)


def _grad_varlen(ctx, dout, _dlse, backward=_autograd.attn_varlen_backward):
    q, k, v, sinks, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = backward(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.opts)
    return (dq, dk, dv, sink_grad(dout, out, lse, sinks)) + (None,) * (2 + len(ctx.opts))


ATTN = _autograd.register_autograd(attn_sinks, _attn_sinks, _setup, _grad,
                                   _autograd._attn_backward)
ATTN_VARLEN = _autograd.register_autograd(attn_varlen_sinks, _attn_varlen_sinks, _setup_varlen,
                                          _grad_varlen, _autograd._attn_varlen_backward)
