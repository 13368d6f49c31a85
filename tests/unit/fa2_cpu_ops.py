"""A CPU stand-in for an sm7x FA2 library, for the autograd plumbing tests: namespace
``sm7x_test_bwd`` with the library's schemas (fwd, fwd_varlen, bwd, bwd_varlen,
bwd_supported, bwd_uses_dq_accum), computed in float64 torch on CPU.

- fwd / fwd_varlen write the float32 reference of tests/gpu/fa2_reference.py (flash-attn's
  masks; rows without keys: 0 and lse +inf).
- bwd / bwd_varlen compute dq/dk/dv by torch autograd of that reference. Autograd is off
  inside an op's implementation (the dispatcher runs it below the Autograd key, a
  thread-local setting), so they run it in a fresh thread, where it is on. That keeps the
  oracle independent of sm7x's own float32 fallback formulas.
- Each call is recorded in CALLS (name, deterministic, whether dq_accum came contiguous and
  fp32 like q, or empty; the shapes; the op zeroes it itself, so it may come dirty); bwd
  then dirties dq_accum as a kernel would. Like the library's, a call that sums dQ in
  dq_accum (not deterministic, head dim not in DQ_PASS) refuses an empty one.
- bwd_supported(head_dim) is true except for the head dims in NO_BWD (256, like Turing);
  bwd_uses_dq_accum(head_dim) except for those and the ones in DQ_PASS (an entry whose dQ
  always comes from the dQ kernel, like sm75's d128).

``use(monkeypatch)`` routes sm7x.fa2 to it: ``_ops_for`` returns this namespace and the
CUDA-only check is lifted.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from fa2_reference import reference  # noqa: E402

NS = "sm7x_test_bwd"
CALLS: list[dict] = []
NO_BWD: set[int] = {256}
DQ_PASS: set[int] = {32}

_lib = torch.library.Library(NS, "DEF")
_lib.define("fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, float softmax_scale, "
            "bool causal, int window_left, int window_right, float softcap, "
            "Tensor? sinks=None) -> ()")
_lib.define("fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, "
            "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
            "float softmax_scale, bool causal, int window_left, int window_right, "
            "float softcap, Tensor? sinks=None) -> ()")
_lib.define("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor(a!) dq, "
            "Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) dq_accum, Tensor(e!) dsum, "
            "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
            "bool deterministic) -> ()")
_lib.define("bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) dq_accum, Tensor(e!) dsum, "
            "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
            "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
            "bool deterministic) -> ()")
_lib.define("bwd_supported(int head_dim) -> bool")
_lib.define("bwd_uses_dq_accum(int head_dim) -> bool")


def _window(causal, left, right):
    return (left, 0 if causal else right)


def _fwd(q, k, v, out, lse, scale, causal, left, right, softcap, sinks=None):
    CALLS.append(dict(op="fwd"))
    o, l = reference(q.double(), k.double(), v.double(), scale, causal,
                     _window(causal, left, right), softcap, sinks)
    out.copy_(o.to(out.dtype))
    lse.copy_(l.to(lse.dtype))


def _fwd_varlen(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap,
                sinks=None):
    CALLS.append(dict(op="fwd_varlen", max_q=max_q, max_k=max_k))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        assert cq[b + 1] - cq[b] <= max_q and ck[b + 1] - ck[b] <= max_k
        o, l = reference(q[None, qs].double(), k[None, ks].double(), v[None, ks].double(), scale,
                         causal, _window(causal, left, right), softcap, sinks)
        out[qs] = o[0].to(out.dtype)
        lse[:, qs] = l[0].to(lse.dtype)


def _autograd_in_thread(fn):
    """fn() with autograd on (a new thread does not inherit the op's below-autograd state)."""
    box = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["exc"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "exc" in box:
        raise box["exc"]
    return box["out"]


def reference_grads(dout, q, k, v, scale, causal, window, softcap):
    """(dq, dk, dv) float64 of reference(q, k, v) with the output gradient dout, by autograd
    (batched [B, S, H, D] tensors)."""
    def grads():
        qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
        o, _ = reference(qq, kk, vv, scale, causal, window, softcap)
        return torch.autograd.grad(o, (qq, kk, vv), dout.double())
    return _autograd_in_thread(grads)


def _uses_accum(head_dim: int) -> bool:
    return head_dim not in NO_BWD and head_dim not in DQ_PASS


def _record_bwd(op, q, dq_accum, deterministic, **extra):
    if dq_accum.numel() == 0 and not deterministic and _uses_accum(q.shape[-1]):
        raise RuntimeError(f"{op}: dq_accum is empty, but head dim {q.shape[-1]} sums dQ in it")
    CALLS.append(dict(op=op, deterministic=deterministic, accum_empty=dq_accum.numel() == 0,
                      accum_ok=bool(dq_accum.dtype == torch.float32 and dq_accum.is_contiguous()
                                    and dq_accum.shape == q.shape), **extra))
    dq_accum.fill_(7.0)  # a kernel leaves it dirty (the op zeroes it first)


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, scale, causal, left, right,
         softcap, deterministic):
    _record_bwd("bwd", q, dq_accum, deterministic, dq_shape=tuple(dq.shape), dk_shape=tuple(dk.shape),
                dsum_shape=tuple(dsum.shape))
    gq, gk, gv = reference_grads(dout, q, k, v, scale, causal, _window(causal, left, right),
                                 softcap)
    for dst, src in ((dq, gq), (dk, gk), (dv, gv)):
        dst.copy_(src.to(dst.dtype))


def _bwd_varlen(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, cu_q, cu_k, max_q, max_k,
                scale, causal, left, right, softcap, deterministic):
    _record_bwd("bwd_varlen", q, dq_accum, deterministic, dq_shape=tuple(dq.shape),
                dk_shape=tuple(dk.shape), dsum_shape=tuple(dsum.shape))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    dq.zero_(), dk.zero_(), dv.zero_()
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        gq, gk, gv = reference_grads(dout[None, qs], q[None, qs], k[None, ks], v[None, ks], scale,
                                     causal, _window(causal, left, right), softcap)
        dq[qs], dk[ks], dv[ks] = gq[0].to(dq.dtype), gk[0].to(dk.dtype), gv[0].to(dv.dtype)


_lib.impl("fwd", _fwd, "CPU")
_lib.impl("fwd_varlen", _fwd_varlen, "CPU")
_lib.impl("bwd", _bwd, "CPU")
_lib.impl("bwd_varlen", _bwd_varlen, "CPU")
_lib.impl("bwd_supported", lambda head_dim: head_dim not in NO_BWD, "CompositeExplicitAutograd")
_lib.impl("bwd_uses_dq_accum", _uses_accum, "CompositeExplicitAutograd")
for _name in ("fwd", "fwd_varlen", "bwd", "bwd_varlen"):
    torch.library.register_fake(f"{NS}::{_name}")(lambda *a, **kw: None)


def use(monkeypatch, ops=None):
    """Route sm7x.fa2 to this namespace (or to ``ops``) on CPU tensors; fresh records."""
    import sm7x.fa2 as fa2
    from sm7x.fa2 import _autograd

    ns = getattr(torch.ops, NS) if ops is None else ops
    monkeypatch.setattr(fa2, "_ops_for", lambda t: ns)
    monkeypatch.setattr(fa2, "_check_cuda", lambda fn, q: None)
    monkeypatch.setattr(_autograd, "_supported", {})
    monkeypatch.setattr(_autograd, "_accum", {})
    monkeypatch.setattr(_autograd, "_warned", set())
    CALLS.clear()
    return ns


def ops(name: str) -> list[dict]:
    return [c for c in CALLS if c["op"] == name]
