"""Attention sinks (``s_aux``) in sm7x.fa2, on the CPU: the sink folded into the kernels'
output and LSE (sm7x.fa2._sinks) against a float32 reference that concatenates the sink to
the scores as gpt-oss's eager attention does, through every entry point:

- flash_attn_func / flash_attn_varlen_func, inference and autograd, with the FA2 library
  replaced by its CPU stand-in (fa2_cpu_ops). The backward runs sm7x's float32 fallback,
  which rebuilds P from the saved LSE and takes rowsum(dO * O) from the saved output, as
  the kernels do (the stand-in's own backward recomputes from q, k, v and would not show
  whether the folded output and LSE are what the backward needs).
- flash_attn_with_kvcache and the paged flash_attn_varlen_func with the serving op replaced
  by its CPU stand-in (serving_cpu_ops), eager and compiled (fullgraph).

Gradients of q, k, v and the sinks are checked against autograd of the reference. Every
head-dim, GQA, causal/window/softcap case includes rows that see no key. The kernels
themselves: tests/gpu/test_fa2_sinks.py.
"""

from __future__ import annotations

import warnings

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x.fa2 needs torch >= {torch_min()}")

import fa2_cpu_ops as cpu  # noqa: E402
import sm7x.fa2 as fa2  # noqa: E402
from fa2_reference import reference  # noqa: E402  (fa2_cpu_ops put tests/gpu on the path)
from serving_cpu_ops import use as use_serving  # noqa: E402

F16, I32 = torch.float16, torch.int32

# (heads, kv heads, head dim, sq, sk, causal, window, softcap): seqlen 1, GQA, sq > sk
# (causal rows with no key), a window, softcap, a head dim that is not a power of two
CASES = [
    (4, 4, 64, 1, 1, True, (-1, -1), 0.0),
    (4, 2, 64, 7, 19, True, (-1, -1), 0.0),
    (8, 2, 32, 12, 5, True, (-1, -1), 0.0),
    (4, 1, 96, 9, 33, False, (-1, -1), 0.0),
    (4, 2, 64, 16, 16, True, (4, 0), 0.0),
    (6, 3, 128, 5, 40, True, (-1, -1), 30.0),
]


def _rand(*shape, g):
    return torch.randn(*shape, generator=g).to(F16)


def _inputs(b, h, hk, d, sq, sk, seed=0):
    g = torch.Generator().manual_seed(seed)
    sinks = torch.randn(h, generator=g) * 2  # some rows dominated by the sink, some not
    return _rand(b, sq, h, d, g=g), _rand(b, sk, hk, d, g=g), _rand(b, sk, hk, d, g=g), sinks


def _ref(q, k, v, sinks, causal, window, softcap):
    return reference(q.double(), k.double(), v.double(), q.shape[-1] ** -0.5, causal, window,
                     softcap, sinks=sinks.double())


def _close(got, want, what):
    torch.testing.assert_close(got.double(), want.double(), atol=2e-3, rtol=2e-3, msg=what)


@pytest.fixture
def lib(monkeypatch):
    # the stand-in has the prefill op only: few-row calls stay on it (the fold after the
    # serving kernel's dense path is the same line)
    monkeypatch.setenv("SM7X_FA2_DENSE", "prefill")
    return cpu.use(monkeypatch)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_func_inference(lib, case):
    h, hk, d, sq, sk, causal, window, softcap = case
    q, k, v, sinks = _inputs(2, h, hk, d, sq, sk)
    out, lse, _ = fa2.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                      softcap=softcap, s_aux=sinks, return_attn_probs=True)
    want_out, want_lse = _ref(q, k, v, sinks, causal, window, softcap)
    _close(out, want_out, "out")
    _close(lse, want_lse, "lse (with the sink in the denominator)")
    # without sinks the same call is the plain reference: the sink changed the result
    plain = fa2.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
    assert not torch.allclose(plain.double(), want_out.double(), atol=1e-2)


def test_a_row_with_no_key_gives_zero_and_the_sink_as_lse(lib):
    q, k, v, sinks = _inputs(1, 2, 2, 64, 6, 2)
    out, lse, _ = fa2.flash_attn_func(q, k, v, causal=True, s_aux=sinks,
                                      return_attn_probs=True)
    assert torch.equal(out[0, :4], torch.zeros_like(out[0, :4]))  # rows 0-3 see no key
    torch.testing.assert_close(lse[0, :, :4], sinks[:, None].expand(2, 4))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_func_gradients(lib, monkeypatch, case):
    h, hk, d, sq, sk, causal, window, softcap = case
    monkeypatch.setattr(cpu, "NO_BWD", {d})  # sm7x's fallback: P from the saved LSE
    q, k, v, sinks = _inputs(2, h, hk, d, sq, sk, seed=1)
    dout = _inputs(2, h, hk, d, sq, sk, seed=2)[0]
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    s_leaf = sinks.detach().clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa2.BackwardFallbackWarning)
        out = fa2.flash_attn_func(*leaves, causal=causal, window_size=window, softcap=softcap,
                                  s_aux=s_leaf)
        out.backward(dout)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, sinks)]
    want, _ = reference(*ref_leaves[:3], d ** -0.5, causal, window, softcap,
                        sinks=ref_leaves[3])
    want.backward(dout.double())
    _close(out, want, "out")
    for name, got, ref in zip("qkv", leaves, ref_leaves):
        _close(got.grad, ref.grad, f"d{name}")
    _close(s_leaf.grad, ref_leaves[3].grad, "d sinks")


def _varlen_inputs(lens_q, lens_k, h, hk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = _rand(sum(lens_q), h, d, g=g)
    k, v = _rand(sum(lens_k), hk, d, g=g), _rand(sum(lens_k), hk, d, g=g)
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=I32)
          for n in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1], torch.randn(h, generator=g)


def _varlen_ref(q, k, v, cu_q, cu_k, sinks, causal):
    outs = []
    for i in range(cu_q.shape[0] - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        outs.append(_ref(q[None, qs], k[None, ks], v[None, ks], sinks, causal, (-1, -1),
                         0.0)[0][0])
    return torch.cat(outs)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_varlen(lib, monkeypatch, grad):
    monkeypatch.setattr(cpu, "NO_BWD", {64})
    lens_q, lens_k = [3, 1, 0, 8], [9, 1, 4, 8]
    q, k, v, cu_q, cu_k, sinks = _varlen_inputs(lens_q, lens_k, 4, 2, 64)
    s = sinks.clone().requires_grad_(grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa2.BackwardFallbackWarning)
        out = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 9, causal=True, s_aux=s)
        if grad:
            out.double().sum().backward()
    want = _varlen_ref(q, k, v, cu_q, cu_k, sinks, True)
    _close(out, want, "out")
    if grad:
        s_ref = sinks.double().requires_grad_(True)
        _varlen_ref(q, k, v, cu_q, cu_k, s_ref, True).sum().backward()
        _close(s.grad, s_ref.grad, "d sinks")


def test_compiled_func_traces_the_sink_op(lib, monkeypatch):
    monkeypatch.setattr(cpu, "NO_BWD", {64})
    torch._dynamo.reset()
    q, k, v, sinks = _inputs(1, 4, 2, 64, 5, 9)
    s = sinks.clone().requires_grad_(True)
    f = lambda q, k, v, s: fa2.flash_attn_func(q, k, v, causal=True, s_aux=s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa2.BackwardFallbackWarning)
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, s)
        out.double().sum().backward()
    s_ref = sinks.double().requires_grad_(True)
    want, _ = _ref(q, k, v, s_ref, True, (-1, -1), 0.0)
    want.sum().backward()
    _close(out, want, "out")
    _close(s.grad, s_ref.grad, "d sinks")


# ---------------------------------------------------------------------------------------
# serving entry points (the serving op's CPU stand-in)


def _paged(b=2, h=4, hk=2, d=64, page=16, blocks=8, max_blocks=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc, vc = _rand(blocks, page, hk, d, g=g), _rand(blocks, page, hk, d, g=g)
    bt = torch.randperm(blocks, generator=g)[:b * max_blocks].reshape(b, max_blocks).to(I32)
    return kc, vc, bt, g


def _gather(cache, bt, b, n):
    pos = torch.arange(n)
    return cache[bt[b].long()[pos // cache.shape[1]], pos % cache.shape[1]]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_kvcache_paged_with_append(monkeypatch, compiled):
    use_serving(monkeypatch)
    torch._dynamo.reset()
    kc, vc, bt, g = _paged()
    q, k_new, v_new = _rand(2, 3, 4, 64, g=g), _rand(2, 3, 2, 64, g=g), _rand(2, 3, 2, 64, g=g)
    lens, sinks = torch.tensor([5, 40], dtype=I32), torch.randn(4, generator=g)

    def step(q, kc, vc, k_new, v_new):
        return fa2.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lens,
                                           block_table=bt, causal=True, s_aux=sinks,
                                           return_softmax_lse=True)

    run = torch.compile(step, fullgraph=True, backend="eager") if compiled else step
    out, lse = run(q, kc, vc, k_new, v_new)
    for b in range(2):
        n = int(lens[b]) + 3
        want, want_lse = _ref(q[b:b + 1], _gather(kc, bt, b, n)[None], _gather(vc, bt, b, n)[None],
                              sinks, True, (-1, -1), 0.0)
        _close(out[b:b + 1], want, f"out of sequence {b}")
        _close(lse[b:b + 1], want_lse, f"lse of sequence {b}")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_varlen_paged_with_out(monkeypatch, compiled):
    """vLLM's call: paged caches, seqused_k, out= written in place, sinks."""
    use_serving(monkeypatch)
    torch._dynamo.reset()
    kc, vc, bt, g = _paged()
    q = _rand(4, 4, 64, g=g)  # sequence 0: 1 query (decode), sequence 1: 3 (chunked prefill)
    cu_q, used = torch.tensor([0, 1, 4], dtype=I32), torch.tensor([30, 17], dtype=I32)
    sinks = torch.randn(4, generator=g).half()  # the model's dtype, as vLLM keeps them
    out = torch.full_like(q, float("nan"))

    def step(q, out):
        fa2.flash_attn_varlen_func(q, kc, vc, cu_q, None, 3, 30, causal=True, block_table=bt,
                                   seqused_k=used, out=out, s_aux=sinks)
        return out

    run = torch.compile(step, fullgraph=True, backend="eager") if compiled else step
    got = run(q, out)
    for b, (q0, q1) in enumerate([(0, 1), (1, 4)]):
        n = int(used[b])
        want, _ = _ref(q[None, q0:q1], _gather(kc, bt, b, n)[None], _gather(vc, bt, b, n)[None],
                       sinks.float(), True, (-1, -1), 0.0)
        _close(out[q0:q1], want[0], f"out of sequence {b}")
    assert got is out or torch.equal(got, out)


# ---------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize("bad,match", [
    ([0.5] * 4, "must be a torch.Tensor"),
    (torch.zeros(4, dtype=torch.int32), "floating-point"),
    (torch.zeros(2), r"shape \[num_heads\] = \[4\]"),
    (torch.zeros(1, 4), r"shape \[num_heads\] = \[4\]"),
])
def test_bad_sinks_are_refused_before_any_write(monkeypatch, bad, match):
    use_serving(monkeypatch)
    kc, vc, bt, g = _paged()
    before = kc.clone()
    q, k_new = _rand(2, 1, 4, 64, g=g), _rand(2, 1, 2, 64, g=g)
    with pytest.raises((TypeError, ValueError), match=match):
        fa2.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=k_new, cache_seqlens=3,
                                    block_table=bt, s_aux=bad)
    assert torch.equal(kc, before), "a refused call wrote into the cache"
    with pytest.raises((TypeError, ValueError), match=match):
        fa2.flash_attn_func(q, k_new, k_new, s_aux=bad)
