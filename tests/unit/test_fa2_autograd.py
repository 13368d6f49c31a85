"""sm7x.fa2 through autograd, on the CPU: the plumbing of the differentiable path
(sm7x.fa2._autograd's custom ops) with a CPU stand-in for the FA2 library
(tests/unit/fa2_cpu_ops.py: the library's schemas in float64 torch, backward by autograd
of the float32 reference), and the float32 fallback backward against autograd.

What is checked: gradients reach q, k, v with the right values, shapes and dtypes (GQA:
dk/dv of k/v's shape, summed over the group), batched and varlen (a zero-length sequence
included), the packed variants; the backward op gets ``deterministic`` and a contiguous
fp32 dq_accum of q's shape every call (the op zeroes it); checkpointing (reentrant and not) recomputes the forward;
torch.compile(fullgraph=True) traces forward and backward through the ops' fakes; the
fallback and its one-time warning; the refusals. The kernels themselves:
tests/gpu/test_fa2_backward.py.
"""

from __future__ import annotations

import sys
import warnings

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x.fa2 needs torch >= {torch_min()}")

import fa2_cpu_ops as cpu  # noqa: E402
import sm7x.fa2 as fa2  # noqa: E402
from fa2_reference import reference  # noqa: E402  (fa2_cpu_ops put tests/gpu on the path)
from sm7x.fa2 import _autograd  # noqa: E402

F16 = torch.float16


@pytest.fixture
def lib(monkeypatch):
    return cpu.use(monkeypatch)


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(F16)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _inputs(b=2, sq=9, sk=9, h=4, hk=4, d=16, seed=0):
    q = _rand(b, sq, h, d, seed=seed)
    k = _rand(b, sk, hk, d, seed=seed + 1)
    v = _rand(b, sk, hk, d, seed=seed + 2)
    dout = _rand(b, sq, h, d, seed=seed + 3)
    return q, k, v, dout


def _expected(q, k, v, dout, scale, causal=False, window=(-1, -1), softcap=0.0):
    return cpu.reference_grads(dout, q, k, v, scale, causal,
                               (window[0], 0 if causal else window[1]), softcap)


def _close(name, got, want, shape, rel=1e-2):
    assert got is not None, f"{name}: no gradient"
    assert got.dtype == F16, f"{name}: dtype {got.dtype}"
    assert tuple(got.shape) == tuple(shape), f"{name}: shape {tuple(got.shape)}, want {shape}"
    want = want.float()
    err = (got.float() - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-3)
    assert err <= rel * scale, f"{name}: max |got - want| = {err} (max |want| {scale})"


# ---------------------------------------------------------------------------------------
# batched


@pytest.mark.parametrize("sq,sk,group,causal,window,softcap", [
    (9, 9, 1, False, (-1, -1), 0.0),
    (9, 9, 4, True, (-1, -1), 0.0),
    (5, 13, 2, True, (-1, -1), 0.0),      # causal bottom-right, seqlen_q < seqlen_k
    (13, 5, 1, True, (-1, -1), 0.0),      # rows without keys
    (1, 1, 4, False, (-1, -1), 0.0),
    (11, 11, 2, False, (3, 2), 0.0),
    (11, 11, 1, False, (-1, -1), 2.0),
])
def test_grads_flow_with_values_and_shapes(lib, sq, sk, group, causal, window, softcap):
    q, k, v, dout = _inputs(sq=sq, sk=sk, h=4, hk=4 // group)
    ql, kl, vl = _leaf(q), _leaf(k), _leaf(v)
    out = fa2.flash_attn_func(ql, kl, vl, causal=causal, window_size=window, softcap=softcap)
    assert out.requires_grad and out.dtype == F16 and out.shape == q.shape
    ref_out, _ = reference(q, k, v, 16 ** -0.5, causal, (window[0], 0 if causal else window[1]),
                           softcap)
    assert (out.float() - ref_out).abs().max().item() < 5e-3
    out.backward(dout)
    gq, gk, gv = _expected(q, k, v, dout, 16 ** -0.5, causal, window, softcap)
    _close("dq", ql.grad, gq, q.shape)
    _close("dk", kl.grad, gk, k.shape)  # GQA: summed over the group, k's shape
    _close("dv", vl.grad, gv, v.shape)
    (call,) = cpu.ops("bwd")
    assert call["dk_shape"] == tuple(k.shape) and call["dsum_shape"] == (2, 4, sq)


def test_gqa_grads_are_the_group_sums(lib):
    """dk of a GQA call = the sum over the group of dk of the call with K/V repeated."""
    q, k, v, dout = _inputs(h=8, hk=2)
    kl, vl = _leaf(k), _leaf(v)
    fa2.flash_attn_func(q, kl, vl).backward(dout)
    kr, vr = _leaf(k.repeat_interleave(4, 2)), _leaf(v.repeat_interleave(4, 2))
    fa2.flash_attn_func(q, kr, vr).backward(dout)
    want = kr.grad.float().view(2, 9, 2, 4, 16).sum(3)
    assert (kl.grad.float() - want).abs().max().item() < 1e-2 * want.abs().max().item()
    assert not torch.equal(kl.grad, torch.zeros_like(kl.grad))


def test_only_some_inputs_require_grad(lib):
    q, k, v, dout = _inputs()
    vl = _leaf(v)
    out = fa2.flash_attn_func(q, k, vl)
    out.backward(dout)
    _close("dv", vl.grad, _expected(q, k, v, dout, 16 ** -0.5)[2], v.shape)


@pytest.mark.parametrize("det", [False, True])
def test_deterministic_reaches_the_backward_op(lib, det):
    q, k, v, dout = _inputs()
    fa2.flash_attn_func(_leaf(q), k, v, deterministic=det).backward(dout)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    fa2.flash_attn_varlen_func(_leaf(q[0]), k[0], v[0], cu, cu, 5, 5,
                               deterministic=det).backward(dout[0])
    assert [c["deterministic"] for c in cpu.ops("bwd") + cpu.ops("bwd_varlen")] == [det, det]
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        fa2.flash_attn_func(_leaf(q), k, v, deterministic="yes")


def test_torch_deterministic_mode_asks_for_a_fixed_order(lib, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) (its flag: CPU ops refuse some calls
    in the mode itself) deterministic=False still reaches the backward op as True."""
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    q, k, v, dout = _inputs()
    fa2.flash_attn_func(_leaf(q), k, v, deterministic=False).backward(dout)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    fa2.flash_attn_varlen_func(_leaf(q[0]), k[0], v[0], cu, cu, 5, 5).backward(dout[0])
    assert [c["deterministic"] for c in cpu.ops("bwd") + cpu.ops("bwd_varlen")] == [True, True]


def test_dq_accum_is_fp32_like_q_every_call(lib):
    q, k, v, dout = _inputs()
    for _ in range(3):
        fa2.flash_attn_func(_leaf(q), k, v, causal=True).backward(dout)
    assert [c["accum_ok"] for c in cpu.ops("bwd")] == [True] * 3


def test_dq_accum_is_empty_where_the_op_does_not_sum_into_it(lib):
    """Deterministic calls, and head dims whose dQ always comes from the dQ kernel
    (bwd_uses_dq_accum false), get an empty dq_accum instead of a float32 copy of q."""
    q, k, v, dout = _inputs()
    fa2.flash_attn_func(_leaf(q), k, v, deterministic=True).backward(dout)
    q32, k32, v32, dout32 = _inputs(d=32)
    assert 32 in cpu.DQ_PASS
    for det in (False, True):
        fa2.flash_attn_func(_leaf(q32), k32, v32, deterministic=det).backward(dout32)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    fa2.flash_attn_varlen_func(_leaf(q32[0]), k32[0], v32[0], cu, cu, 5, 5).backward(dout32[0])
    assert [c["accum_empty"] for c in cpu.ops("bwd") + cpu.ops("bwd_varlen")] == [True] * 4


def test_dq_accum_for_a_library_without_the_query(monkeypatch):
    """A library built before bwd_uses_dq_accum refuses an empty dq_accum (its check wants
    q's shape even when deterministic): every call gets a full one."""
    from sm7x.fa2 import _autograd

    old = type("OldOps", (), {"name": "old"})()  # no bwd_uses_dq_accum attribute
    q = torch.zeros(2, 3, 4, 32)
    assert _autograd._dq_accum(old, q, False).shape == q.shape
    assert _autograd._dq_accum(old, q, True).shape == q.shape


def test_lse_is_returned_but_not_differentiable(lib):
    q, k, v, _ = _inputs()
    out, lse, none = fa2.flash_attn_func(_leaf(q), k, v, return_attn_probs=True)
    assert none is None and out.requires_grad and not lse.requires_grad
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    _, ref_lse = reference(q, k, v, 16 ** -0.5)
    assert torch.allclose(lse, ref_lse, atol=1e-4)


def test_no_grad_calls_take_the_direct_path(lib):
    q, k, v, _ = _inputs()
    with torch.no_grad():
        out = fa2.flash_attn_func(_leaf(q), k, v)
    assert not out.requires_grad and out.grad_fn is None
    assert [c["op"] for c in cpu.CALLS] == ["fwd"]


def _custom_ops_run(fn) -> set[str]:
    """The sm7x_fa2 custom ops the profiler saw while fn ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith(_autograd.NAMESPACE + "::")}


@pytest.mark.parametrize("sinks", [False, True])
def test_eager_training_bypasses_the_custom_ops(lib, sinks):
    """Outside torch.compile a call that needs grad runs the ops' implementations under an
    autograd.Function (_autograd.call), with the same values as the ops themselves."""
    q, k, v, dout = _inputs(h=4, hk=2)
    s_aux = torch.tensor([0.5, -1.0, 0.0, 2.0]) if sinks else None
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    eager = [_leaf(t) for t in (q, k, v)]

    def step():
        fa2.flash_attn_func(*eager, causal=True, s_aux=s_aux).backward(dout)
        fa2.flash_attn_varlen_func(*(t[0] for t in eager), cu, cu, 5, 5, s_aux=s_aux
                                   ).backward(dout[0])

    assert _custom_ops_run(step) == set()
    assert [c["op"] for c in cpu.CALLS] == ["fwd", "bwd", "fwd_varlen", "bwd_varlen"]
    # the same step through the ops, as torch.compile runs it
    via_ops = [_leaf(t) for t in (q, k, v)]
    opts = (16 ** -0.5, True, -1, 0, 0.0, False)
    if sinks:
        out, _ = fa2._sinks.attn_sinks(*via_ops, s_aux, *opts)
    else:
        out, _ = _autograd.attn(*via_ops, *opts)
    out.backward(dout)
    vopts = (cu, cu, 5, 5, 16 ** -0.5, False, -1, -1, 0.0, False)
    if sinks:
        out, _ = fa2._sinks.attn_varlen_sinks(*(t[0] for t in via_ops), s_aux, *vopts)
    else:
        out, _ = _autograd.attn_varlen(*(t[0] for t in via_ops), *vopts)
    out.backward(dout[0])
    for name, a, b in zip("qkv", eager, via_ops):
        assert torch.equal(a.grad, b.grad), name


def test_double_backward_is_refused(lib):
    """The backward has no backward of its own: differentiating the gradients of a
    create_graph=True backward raises (the eager path then runs the backward op, which has no
    formula), never treats them as constants."""
    q, k, v, dout = _inputs()
    ql = _leaf(q)
    (gq,) = torch.autograd.grad(fa2.flash_attn_func(ql, k, v), ql, dout, create_graph=True)
    assert gq.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        gq.float().sum().backward()


# ---------------------------------------------------------------------------------------
# varlen


def _varlen(lens_q, lens_k, h=4, hk=2, d=16, seed=5):
    tq, tk = sum(lens_q), sum(lens_k)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return (_rand(tq, h, d, seed=seed), _rand(tk, hk, d, seed=seed + 1),
            _rand(tk, hk, d, seed=seed + 2), _rand(tq, h, d, seed=seed + 3), cu(lens_q), cu(lens_k))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_grads_per_sequence(lib, causal):
    lens_q, lens_k = [3, 0, 7, 1], [5, 0, 7, 4]  # a zero-length sequence included
    q, k, v, dout, cq, ck = _varlen(lens_q, lens_k)
    ql, kl, vl = _leaf(q), _leaf(k), _leaf(v)
    out = fa2.flash_attn_varlen_func(ql, kl, vl, cq, ck, 7, 7, causal=causal)
    out.backward(dout)
    for b in range(4):
        qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if qs.start == qs.stop:
            continue
        gq, gk, gv = _expected(q[None, qs], k[None, ks], v[None, ks], dout[None, qs], 16 ** -0.5,
                               causal)
        _close(f"dq seq {b}", ql.grad[qs], gq[0], gq[0].shape)
        _close(f"dk seq {b}", kl.grad[ks], gk[0], gk[0].shape)
        _close(f"dv seq {b}", vl.grad[ks], gv[0], gv[0].shape)
    (call,) = cpu.ops("bwd_varlen")
    assert call["dq_shape"] == tuple(q.shape) and call["dsum_shape"] == (4, q.shape[0])
    assert call["accum_ok"]


def test_varlen_cu_seqlens_are_still_checked(lib):
    q, k, v, _, cq, ck = _varlen([3, 4], [3, 4])
    with pytest.raises(ValueError, match="ends at 7 but q holds 6 tokens"):
        fa2.flash_attn_varlen_func(_leaf(q[:6]), k, v, cq, ck, 4, 4)
    with pytest.raises(ValueError, match="max_seqlen_k is 3"):
        fa2.flash_attn_varlen_func(_leaf(q), k, v, cq, ck, 4, 3)


def test_cu_seqlens_are_read_once_per_tensor_and_contents(lib, monkeypatch):
    """The host check of cu_seqlens (a device-to-host copy: a stream sync on a GPU) runs once
    per tensor, contents, total and max_seqlen, not once per layer; an in-place write, another
    bound or another tensor is checked again, and inference-mode tensors every call."""
    q, k, v, _, cq, ck = _varlen([3, 4], [3, 4])
    reads = []
    real = torch.Tensor.tolist

    def counting(t):
        if sys._getframe(1).f_code.co_name == "_check_cu_seqlens":
            reads.append(t)
        return real(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    fa2._checked_cu.clear()
    for _ in range(3):  # three layers, one step
        fa2.flash_attn_varlen_func(_leaf(q), k, v, cq, ck, 4, 4)
    with torch.no_grad():
        fa2.flash_attn_varlen_func(q, k, v, cq, ck, 4, 4)
    assert [t is cq for t in reads] == [True, False] and reads[1] is ck
    fa2.flash_attn_varlen_func(q, k, v, cq, ck, 5, 4)  # another bound: cq again
    assert len(reads) == 3 and reads[2] is cq
    cq[1] = 5  # in place: the next call sees it
    with pytest.raises(ValueError, match="max_seqlen_q is 4"):
        fa2.flash_attn_varlen_func(q, k, v, cq, ck, 4, 4)
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        for _ in range(2):
            fa2.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4)
    assert sum(t is cu for t in reads) == 4  # q's and k's, both calls


# ---------------------------------------------------------------------------------------
# packed variants (flash-attn 2.x signatures)


def test_qkvpacked_and_kvpacked(lib):
    q, k, v, dout = _inputs(h=4, hk=4)
    gq, gk, gv = _expected(q, k, v, dout, 16 ** -0.5, True)
    qkv = _leaf(torch.stack([q, k, v], dim=2))
    fa2.flash_attn_qkvpacked_func(qkv, causal=True).backward(dout)
    assert qkv.grad.shape == qkv.shape
    for n, (name, want) in enumerate((("dq", gq), ("dk", gk), ("dv", gv))):
        _close(name, qkv.grad[:, :, n], want, want.shape)
    ql, kv = _leaf(q), _leaf(torch.stack([k, v], dim=2))
    fa2.flash_attn_kvpacked_func(ql, kv, causal=True).backward(dout)
    _close("dq", ql.grad, gq, q.shape)
    _close("dk", kv.grad[:, :, 0], gk, k.shape)
    _close("dv", kv.grad[:, :, 1], gv, v.shape)


def test_varlen_packed_variants(lib):
    q, k, v, dout, cq, _ = _varlen([4, 6], [4, 6], h=2, hk=2)
    qkv = _leaf(torch.stack([q, k, v], dim=1))
    out = fa2.flash_attn_varlen_qkvpacked_func(qkv, cq, 6, causal=True)
    out.backward(dout)
    ql, kv = _leaf(q), _leaf(torch.stack([k, v], dim=1))
    fa2.flash_attn_varlen_kvpacked_func(ql, kv, cq, cq, 6, 6, causal=True).backward(dout)
    for b in range(2):
        s = slice(int(cq[b]), int(cq[b + 1]))
        gq, gk, gv = _expected(q[None, s], k[None, s], v[None, s], dout[None, s], 16 ** -0.5, True)
        _close("qkv dq", qkv.grad[s, 0], gq[0], gq[0].shape)
        _close("qkv dk", qkv.grad[s, 1], gk[0], gk[0].shape)
        _close("qkv dv", qkv.grad[s, 2], gv[0], gv[0].shape)
        _close("kv dq", ql.grad[s], gq[0], gq[0].shape)
        _close("kv dv", kv.grad[s, 1], gv[0], gv[0].shape)
    with pytest.raises(ValueError, match=r"qkv must be 5-D \[batch, seqlen, 3"):
        fa2.flash_attn_qkvpacked_func(qkv)


# ---------------------------------------------------------------------------------------
# checkpointing, torch.compile


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes(lib, reentrant):
    from torch.utils.checkpoint import checkpoint

    q, k, v, dout = _inputs(h=4, hk=2)
    w = _leaf(_rand(16, 16, seed=9))

    def block(x, kk, vv):
        return fa2.flash_attn_func(x @ w, kk, vv, causal=True)

    ref = [_leaf(t) for t in (q, k, v)]
    block(*ref).backward(dout)
    want = [t.grad for t in ref] + [w.grad]
    w.grad = None
    cpu.CALLS.clear()
    got = [_leaf(t) for t in (q, k, v)]
    checkpoint(block, *got, use_reentrant=reentrant).backward(dout)
    assert [c["op"] for c in cpu.CALLS] == ["fwd", "fwd", "bwd"]  # forward recomputed
    for a, b in zip([t.grad for t in got] + [w.grad], want):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph_traces_forward_and_backward(lib):
    torch._dynamo.reset()
    q, k, v, dout = _inputs(h=4, hk=2)
    lin = torch.nn.Linear(16, 16).to(F16)

    def f(x, kk, vv):
        out = fa2.flash_attn_func(lin(x), kk, vv, causal=True, window_size=(4, 0),
                                  deterministic=True)
        return out.float().mul(dout.float()).sum()

    ref = [_leaf(t) for t in (q, k, v)]
    f(*ref).backward()
    want = [t.grad for t in ref]
    cpu.CALLS.clear()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = [_leaf(t) for t in (q, k, v)]
    compiled(*got).backward()
    ops = [c["op"] for c in cpu.CALLS]
    assert ops.count("fwd") == 1 and ops.count("bwd") == 1, ops
    assert cpu.ops("bwd")[0]["deterministic"] is True
    for a, b in zip((t.grad for t in got), want):
        assert torch.allclose(a.float(), b.float(), atol=1e-3)


def test_torch_compile_varlen(lib):
    torch._dynamo.reset()
    q, k, v, dout, cq, ck = _varlen([3, 6], [5, 6])

    def f(x, kk, vv):
        return fa2.flash_attn_varlen_func(x, kk, vv, cq, ck, 6, 6, causal=True)

    eager = [_leaf(t) for t in (q, k, v)]
    f(*eager).backward(dout)
    got = [_leaf(t) for t in (q, k, v)]
    torch.compile(f, fullgraph=True, backend="aot_eager")(*got).backward(dout)
    for a, b in zip((t.grad for t in got), (t.grad for t in eager)):
        assert torch.allclose(a.float(), b.float(), atol=1e-3)


def test_torch_compile_inference_traces_the_op(lib):
    """Under torch.compile even a no-grad call goes through the op (the direct path reads
    data pointers, which a traced tensor has not)."""
    torch._dynamo.reset()
    q, k, v, _ = _inputs()
    with torch.no_grad():
        out = torch.compile(lambda a, b, c: fa2.flash_attn_func(a, b, c), fullgraph=True,
                            backend="aot_eager")(q, k, v)
    ref, _ = reference(q, k, v, 16 ** -0.5)
    assert (out.float() - ref).abs().max().item() < 5e-3


# ---------------------------------------------------------------------------------------
# fallback: no backward kernel for the head dim, or no backward in the library


def test_fallback_for_unsupported_head_dim_warns_once_and_is_correct(lib):
    q, k, v, dout = _inputs(d=256, h=2, hk=1, sq=7, sk=10)
    gq, gk, gv = _expected(q, k, v, dout, 256 ** -0.5, True)
    for i in range(2):
        leaves = [_leaf(t) for t in (q, k, v)]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fa2.flash_attn_func(*leaves, causal=True).backward(dout)
        msgs = [str(w.message) for w in seen if issubclass(w.category, fa2.BackwardFallbackWarning)]
        if i == 0:
            assert len(msgs) == 1 and "head_dim=256" in msgs[0] and "float32" in msgs[0], msgs
            assert "no backward kernel for head_dim=256" in msgs[0]
        else:
            assert msgs == []  # once
        for name, t, want in zip("qkv", leaves, (gq, gk, gv)):
            _close(f"d{name}", t.grad, want, want.shape)
    assert cpu.ops("bwd") == []  # the kernel op was never called


def test_fallback_can_be_made_an_error(lib):
    q, k, v, dout = _inputs(d=256)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=fa2.BackwardFallbackWarning)
        for _ in range(2):  # every time, not only the first
            with pytest.raises(fa2.BackwardFallbackWarning, match="head_dim=256"):
                fa2.flash_attn_func(_leaf(q), k, v).backward(dout)


def test_fallback_when_the_library_has_no_backward(monkeypatch):
    real = torch.ops.sm7x_test_bwd

    class ForwardOnly:  # a library built before the backward kernels
        name = "sm7x_test_fwd_only"
        fwd, fwd_varlen = real.fwd, real.fwd_varlen

    cpu.use(monkeypatch, ForwardOnly())
    q, k, v, dout, cq, ck = _varlen([4, 5], [6, 5])
    ql, kl = _leaf(q), _leaf(k)
    with pytest.warns(fa2.BackwardFallbackWarning, match="has no backward kernels"):
        fa2.flash_attn_varlen_func(ql, kl, v, cq, ck, 5, 6, window_size=(2, 1)).backward(dout)
    for b in range(2):
        qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        gq, gk, _ = _expected(q[None, qs], k[None, ks], v[None, ks], dout[None, qs], 16 ** -0.5,
                              False, (2, 1))
        _close("dq", ql.grad[qs], gq[0], gq[0].shape)
        _close("dk", kl.grad[ks], gk[0], gk[0].shape)


@pytest.mark.parametrize("sq,sk,group,causal,window,softcap", [
    (17, 17, 1, False, (-1, -1), 0.0),
    (17, 17, 4, True, (-1, -1), 0.0),
    (6, 23, 2, True, (-1, -1), 0.0),
    (23, 6, 1, True, (-1, -1), 0.0),   # rows without keys: zero gradients there
    (20, 20, 2, False, (5, 3), 0.0),
    (20, 20, 1, False, (0, 0), 0.0),
    (19, 19, 2, True, (-1, -1), 3.0),
    (9, 9, 8, False, (2, -1), 1.5),
])
def test_fallback_math_matches_autograd(monkeypatch, sq, sk, group, causal, window, softcap):
    """_autograd's float32 backward (used where there is no kernel) against autograd of the
    reference, with tiny row chunks so the chunk loop is exercised."""
    monkeypatch.setattr(_autograd, "_FALLBACK_CHUNK", 8 * sk)
    h, d, scale = 8, 24, 0.3
    q, k, v, dout = _inputs(b=2, sq=sq, sk=sk, h=h, hk=h // group, d=d, seed=sq + sk)
    win = (window[0], 0 if causal else window[1])
    out, lse = reference(q, k, v, scale, causal, win, softcap)
    dq, dk, dv = _autograd._math_backward_batched(dout, q, k, v, out.to(F16), lse, scale, causal,
                                                  window[0], window[1], softcap)
    gq, gk, gv = _expected(q, k, v, dout, scale, causal, window, softcap)
    _close("dq", dq, gq, q.shape)
    _close("dk", dk, gk, k.shape)
    _close("dv", dv, gv, v.shape)


# ---------------------------------------------------------------------------------------
# refusals


def test_serving_paths_stay_inference_only(lib):
    q = _leaf(_rand(2, 1, 4, 16))
    k_cache, v_cache = _rand(4, 16, 2, 16), _rand(4, 16, 2, 16)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="inference.*flash_attn_func / flash_attn_varlen_func"):
        fa2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=bt)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="forward-only, for inference"):
        fa2.flash_attn_varlen_func(q[:, 0], k_cache, v_cache, cu, None, 1, 32, block_table=bt,
                                   seqused_k=lens)


def test_out_with_grad_is_refused(lib):
    q, k, v, _, cq, ck = _varlen([3, 4], [3, 4])
    with pytest.raises(ValueError, match="out= cannot be combined with inputs that require grad"):
        fa2.flash_attn_varlen_func(_leaf(q), k, v, cq, ck, 4, 4, out=torch.empty_like(q))


def test_dropout_is_refused_with_grad(lib):
    q, k, v, _ = _inputs()
    with pytest.raises(NotImplementedError, match="dropout_p=0.0"):
        fa2.flash_attn_func(_leaf(q), k, v, dropout_p=0.1)


def test_grad_inputs_on_cpu_get_the_cuda_error(monkeypatch):
    """Without the stand-in: CPU tensors that require grad are refused before any library
    is loaded, with the CUDA message."""
    from sm7x.fa2 import _loader

    monkeypatch.setattr(_loader, "load", lambda *a: (_ for _ in ()).throw(AssertionError("load")))
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="CUDA tensors only"):
        fa2.flash_attn_func(_leaf(q), k, v)


def test_torch_compile_inference_with_out(lib):
    """Compiled, no grad: out= is written (the op's result copied into it)."""
    torch._dynamo.reset()
    q, k, v, _, cq, ck = _varlen([3, 6], [5, 6])
    out = torch.zeros_like(q)

    def f(a, b, c, o):
        return fa2.flash_attn_varlen_func(a, b, c, cq, ck, 6, 6, causal=True, out=o)

    with torch.no_grad():
        res = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, out)
        want = f(q, k, v, torch.zeros_like(q))
    assert torch.equal(out, want) and torch.equal(res, want) and out.abs().sum() > 0
