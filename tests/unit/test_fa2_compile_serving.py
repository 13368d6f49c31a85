"""torch.compile(fullgraph=True) through the serving entry points, without a GPU:
flash_attn_with_kvcache (paged and contiguous, with an append) and flash_attn_varlen_func
over a paged cache become one custom op each (sm7x.fa2._serving_ops), whose real
implementation runs the eager serving code; the library's kernel op is replaced by a
float64 reference on CPU (serving_cpu_ops), so what is checked is the tracing:
no graph break, the caches mutated in place as in eager, the same output."""

from __future__ import annotations

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x.fa2 needs torch >= {torch_min()}")

import sm7x.fa2 as fa2  # noqa: E402

from serving_cpu_ops import use  # noqa: E402

F16, I32 = torch.float16, torch.int32


@pytest.fixture
def reference_ops(monkeypatch):
    torch._dynamo.reset()
    return use(monkeypatch)


def _paged(b=2, h=4, hk=2, d=64, page=16, blocks=8, max_blocks=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(blocks, page, hk, d, generator=g).to(F16)
    vc = torch.randn(blocks, page, hk, d, generator=g).to(F16)
    bt = torch.randperm(blocks, generator=g)[:b * max_blocks].reshape(b, max_blocks).to(I32)
    return kc, vc, bt, g


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_kvcache_compiles_fullgraph_and_appends_in_place(reference_ops, layout):
    kc, vc, bt, g = _paged()
    if layout == "contiguous":
        kc = kc[bt.long()].reshape(2, 64, 2, 64).contiguous()
        vc = vc[bt.long()].reshape(2, 64, 2, 64).contiguous()
        bt = None
    q = torch.randn(2, 3, 4, 64, generator=g).to(F16)
    k_new = torch.randn(2, 3, 2, 64, generator=g).to(F16)
    v_new = torch.randn(2, 3, 2, 64, generator=g).to(F16)
    lens = torch.tensor([5, 40], dtype=I32)

    def step(q, kc, vc, k_new, v_new, lens):
        out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lens,
                                               block_table=bt, causal=True,
                                               return_softmax_lse=True)
        return out * 2, lse

    kc_e, vc_e = kc.clone(), vc.clone()
    want_out, want_lse = step(q, kc_e, vc_e, k_new, v_new, lens)
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    got_out, got_lse = compiled(q, kc, vc, k_new, v_new, lens)
    assert torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)
    assert torch.equal(kc, kc_e) and torch.equal(vc, vc_e), "the append did not land in place"
    assert not torch.equal(kc, _paged()[0]) or layout == "contiguous"


def test_kvcache_int_cache_seqlens_compiles(reference_ops):
    kc, vc, bt, g = _paged()
    q = torch.randn(2, 1, 4, 64, generator=g).to(F16)
    step = lambda q: fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=30, block_table=bt)
    assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(q), step(q))


def test_varlen_paged_compiles_fullgraph_with_out(reference_ops):
    kc, vc, bt, g = _paged()
    q = torch.randn(7, 4, 64, generator=g).to(F16)
    cu = torch.tensor([0, 3, 7], dtype=I32)
    used = torch.tensor([20, 50], dtype=I32)

    def step(q, out):
        res = fa2.flash_attn_varlen_func(q, kc, vc, cu, None, 4, 64, causal=True,
                                         block_table=bt, seqused_k=used, out=out)
        return res + 1

    out_e, out_c = torch.empty_like(q), torch.empty_like(q)
    want = step(q, out_e)
    got = torch.compile(step, fullgraph=True, backend="eager")(q, out_c)
    assert torch.equal(got, want) and torch.equal(out_c, out_e)


def test_a_plan_is_refused_under_compile_with_the_fix(reference_ops):
    kc, vc, bt, g = _paged()
    q = torch.randn(2, 1, 4, 64, generator=g).to(F16)
    plan = object()
    step = lambda q: fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=30, block_table=bt,
                                                 scheduler_metadata=plan)
    with pytest.raises(Exception, match="cannot pass through torch.compile"):
        torch.compile(step, fullgraph=True, backend="eager")(q)


@pytest.mark.parametrize("compiled", [False, True])
def test_check_inputs_reaches_the_op_only_when_off(reference_ops, compiled):
    """check_inputs=False is passed to the op (which then skips its device-side check);
    the default leaves the op's own default, which follows set_input_checks."""
    kc, vc, bt, g = _paged()
    q = torch.randn(2, 1, 4, 64, generator=g).to(F16)
    lens = torch.tensor([5, 40], dtype=I32)
    for given, seen in ((False, False), (None, True), (True, True)):
        step = lambda q: fa2.flash_attn_with_kvcache(  # noqa: E731
            q, kc, vc, cache_seqlens=lens, block_table=bt, check_inputs=given)
        out = torch.compile(step, fullgraph=True, backend="eager")(q) if compiled else step(q)
        assert reference_ops.check_inputs is seen, (given, reference_ops.check_inputs)
        assert torch.equal(out, fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                            block_table=bt))
