"""Attention sinks (``s_aux``, gpt-oss) through the FA2 kernels, on a GPU: the kernels'
output and LSE with the sinks applied in their epilogues (and the split-KV combine)
against the float32 reference that concatenates the sink to the scores, and the backward
kernels given the sink-aware output and LSE against autograd of that reference.

Every compiled head dim; seqlen 1, lengths that are not tile multiples, seqlen_q >
seqlen_k (causal rows that see no key), GQA, sliding window (gpt-oss alternates windowed
and full layers), softcap; the few-rows path of flash_attn_func, varlen, the serving
calls (paged and contiguous, split-KV, an append, a CUDA graph with a plan).

    SM7X_FA2_FORCE=sm75 pytest tests/gpu/test_fa2_sinks.py
    SM7X_FA2_FORCE=sm70 pytest tests/gpu/test_fa2_sinks.py
"""

from __future__ import annotations

import pytest

from fa2_arch import fa2_arch_or_skip

ARCH = fa2_arch_or_skip()

import torch  # noqa: E402

import sm7x.fa2 as fa2  # noqa: E402
from fa2_reference import (  # noqa: E402
    _compare, capture, cu_seqlens, gather_paged, paged_cache, reference)

pytestmark = pytest.mark.gpu
DIMS = list(fa2.COMPILED_HEAD_DIMS)
SHAPES = [(1, 1), (1, 333), (8, 8), (77, 200), (333, 333), (200, 77)]


def _inputs(b, sq, sk, h, hk, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.float16, generator=g)
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    sinks = torch.randn(h, device="cuda", generator=g) * 2
    return q, k, v, sinks


def _ref(q, k, v, sinks, causal=False, window=(-1, -1), softcap=0.0):
    return reference(q, k, v, q.shape[-1] ** -0.5, causal, window, softcap, sinks=sinks)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_func(d, sq, sk, causal):
    q, k, v, sinks = _inputs(2, sq, sk, 8, 2, d)
    out, lse, _ = fa2.flash_attn_func(q, k, v, causal=causal, s_aux=sinks,
                                      return_attn_probs=True)
    ref_out, ref_lse = _ref(q, k, v, sinks, causal)
    _compare(f"{ARCH} sinks d{d} {sq}x{sk} causal={causal}", out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("window,softcap", [((64, 0), 0.0), ((-1, -1), 30.0)])
def test_func_window_softcap(window, softcap):
    q, k, v, sinks = _inputs(2, 300, 300, 8, 1, 64, seed=1)
    out = fa2.flash_attn_func(q, k, v, causal=True, window_size=window, softcap=softcap,
                              s_aux=sinks)
    ref_out, _ = _ref(q, k, v, sinks, True, window, softcap)
    assert (out.float() - ref_out).abs().max().item() <= 4e-3


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward(d, causal):
    """The backward kernels given the folded output and LSE: dq, dk, dv and d sinks."""
    q, k, v, sinks = _inputs(1, 200, 333, 8, 2, d, seed=2)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks)]
    out = fa2.flash_attn_func(*leaves[:3], causal=causal, s_aux=leaves[3])
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = [t.detach().float().requires_grad_(True) for t in (q, k, v, sinks)]
    want, _ = _ref(*ref, causal)
    want.backward(dout.float())
    for name, got, r in zip(("dq", "dk", "dv", "dsinks"), leaves, ref):
        scale = r.grad.abs().max().item()
        err = (got.grad.float() - r.grad).abs().max().item()
        assert err <= 1e-2 * max(scale, 1.0), f"{name}: max err {err} (max |grad| {scale})"


def test_varlen_with_an_empty_sequence():
    lens_q, lens_k = [1, 77, 0, 128], [300, 77, 5, 129]
    h, hk, d = 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.float16, generator=g)
            for _ in range(2))
    sinks = torch.randn(h, device="cuda", generator=g)
    out = fa2.flash_attn_varlen_func(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k),
                                      max(lens_q), max(lens_k), causal=True, s_aux=sinks)
    oq = ok = 0
    for nq, nk in zip(lens_q, lens_k):
        if nq:
            want, _ = _ref(q[None, oq:oq + nq], k[None, ok:ok + nk], v[None, ok:ok + nk],
                           sinks, True)
            assert (out[oq:oq + nq].float() - want[0]).abs().max().item() <= 4e-3
        oq, ok = oq + nq, ok + nk


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("num_splits", [1, 0])
def test_kvcache_paged_append(d, num_splits):
    lens = [1, 700, 33, 4000]
    kc, vc, bt = paged_cache([n + 2 for n in lens], 16, 2, d, seed=4)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(4, 2, 8, d, device="cuda", dtype=torch.float16, generator=g)
    k_new, v_new = (torch.randn(4, 2, 2, d, device="cuda", dtype=torch.float16, generator=g)
                    for _ in range(2))
    sinks = torch.randn(8, device="cuda", generator=g) * 2
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=seqlens,
                                           block_table=bt, causal=True, num_splits=num_splits,
                                           s_aux=sinks, return_softmax_lse=True)
    for b, n in enumerate(lens):
        ks, vs = gather_paged(kc, bt, b, n + 2), gather_paged(vc, bt, b, n + 2)
        want, want_lse = _ref(q[b:b + 1], ks[None], vs[None], sinks, True)
        _compare(f"{ARCH} sinks kvcache d{d} seq {b}", out[b:b + 1], lse[b:b + 1], want,
                 want_lse)


def test_varlen_paged_in_a_cuda_graph_with_a_plan():
    """vLLM's call: paged, out=, a plan, captured; the sinks are read at replay."""
    h, hk, d = 8, 2, 64
    lens, qlens = [900, 1, 64], [1, 1, 5]
    kc, vc, bt = paged_cache(lens, 16, hk, d, seed=6)
    q = torch.randn(sum(qlens), h, d, device="cuda", dtype=torch.float16)
    sinks = torch.zeros(h, device="cuda", dtype=torch.float16)
    cu_q, used = cu_seqlens(qlens), torch.tensor(lens, dtype=torch.int32, device="cuda")
    plan = fa2.plan_decode(3, max(qlens), max(lens), h, hk, d, device=q.device)
    out = torch.empty_like(q)
    graph, _ = capture(lambda: fa2.flash_attn_varlen_func(
        q, kc, vc, cu_q, None, max(qlens), max(lens), causal=True, block_table=bt,
        seqused_k=used, out=out, scheduler_metadata=plan, s_aux=sinks))
    sinks.copy_(torch.randn(h, device="cuda") * 2)  # loaded after capture, as vLLM does
    graph.replay()
    torch.cuda.synchronize()
    o = 0
    for b, (n, nq) in enumerate(zip(lens, qlens)):
        ks, vs = gather_paged(kc, bt, b, n), gather_paged(vc, bt, b, n)
        want, _ = _ref(q[None, o:o + nq], ks[None], vs[None], sinks.float(), True)
        assert (out[o:o + nq].float() - want[0]).abs().max().item() <= 4e-3, f"sequence {b}"
        o += nq


@pytest.mark.parametrize("path", ["prefill", "decode", "split"])
def test_sinks_far_from_the_scores(path):
    """Sinks up to 100 above or below every score (exp(s_h - max) overflows fp32 past 88):
    out ~0 / unchanged, lse ~s_h / unchanged; prefill, the serving kernel's final rows and
    the split-KV combine."""
    h, d = 8, 64
    sinks = torch.tensor([100.0, -100.0, 30.0, -30.0, 0.0, 88.0, 90.0, -90.0], device="cuda")
    if path == "prefill":
        q, k, v, _ = _inputs(2, 77, 200, h, 2, d, seed=7)
        out, lse, _ = fa2.flash_attn_func(q, k, v, causal=True, s_aux=sinks,
                                          return_attn_probs=True)
        want, want_lse = _ref(q, k, v, sinks, True)
        _compare(f"{ARCH} far sinks prefill", out, lse, want, want_lse)
        return
    lens = [3000, 5]
    kc, vc, bt = paged_cache(lens, 16, 2, d, seed=8)
    q = torch.randn(2, 1, h, d, device="cuda", dtype=torch.float16)
    out, lse = fa2.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_table=bt, causal=True, num_splits=1 if path == "decode" else 0, s_aux=sinks,
        return_softmax_lse=True)
    for b, n in enumerate(lens):
        ks, vs = gather_paged(kc, bt, b, n), gather_paged(vc, bt, b, n)
        want, want_lse = _ref(q[b:b + 1], ks[None], vs[None], sinks, True)
        _compare(f"{ARCH} far sinks {path} seq {b}", out[b:b + 1], lse[b:b + 1], want, want_lse)
