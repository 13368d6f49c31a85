"""int8 KV caches with a scale per cached row (vLLM's int8_per_token_head), read by the FA2
serving kernels and written by sm7x.ops.reshape_and_cache / the kvcache append, on a GPU.

Each read case quantizes a float16 cache row by row (absmax / 127, as vLLM's writer does)
and checks the kernels two ways: against the float32 reference computed from the
dequantized cache (codes x row scale; the float16 tests' tolerance: the kernels apply the
scales in fp32 to the scores and probabilities, as vLLM's Triton kernel does, so the
codes reach the GEMMs exact), and against the same
call on the float16 cache (the quantization error, printed at the end with a loose bound a
lost or misplaced scale would break). Caches come in vLLM 0.26's layout (one int8 tensor,
each (kv head, slot) holding [K codes | K scale | V codes | V scale], so V rows are only
4-byte aligned and the scales are strided float32 views into it, HND and NHD) and compact
(separate 16-byte aligned tensors).

Marked `gpu`; on GPUs newer than Turing SM7X_FA2_FORCE names the library, e.g.

    SM7X_FA2_FORCE=sm75 pytest -s tests/gpu/test_fa2_int8.py
"""

from __future__ import annotations

import pytest

from fa2_arch import fa2_arch_or_skip

ARCH = fa2_arch_or_skip()

import torch  # noqa: E402

TAG = f"{ARCH} int8 "

import sm7x.ops  # noqa: E402
from sm7x.fa2 import flash_attn_varlen_func, flash_attn_with_kvcache, plan_decode  # noqa: E402
from sm7x.fa2._serving import encode_int8_rows  # noqa: E402
from cache_cases import (  # noqa: E402
    ATOL, ATOL_SOFTCAP, DECODE_CASES, DEV, F16, I32, MIXES, SHAPES, WINDOW_SOFTCAP, mix_lengths,
    varlen_reference)
from fa2_reference import (  # noqa: E402
    _compare, capture, cu_seqlens, gather_paged, gen, i32, packed_to_batched, paged_cache,
    reference_seqs)

pytestmark = pytest.mark.gpu

QUANT_ERR = {"max_abs_err_vs_fp16": 0.0, "bound": 0.0, "cases": 0}


def int8_cache(k16, v16, layout):
    """fp16 caches [num_blocks, page, hk, d] -> (k codes, v codes, k scales, v scales,
    k dequantized, v dequantized) in `layout`: "vllm-hnd" / "vllm-nhd" (vLLM 0.26's
    TritonAttentionBackend: one int8 tensor [nb, hk, page, 2 (d + 4)] or [nb, page, hk,
    2 (d + 4)], the scales float32 views into it, as its _ensure_scale_caches makes them),
    or "compact" (contiguous codes [nb, page, hk, d], scales [nb, page, hk])."""
    nb, page, hk, d = k16.shape
    (kq, ks), (vq, vs) = encode_int8_rows(k16), encode_int8_rows(v16)
    if layout == "compact":
        kc, vc, ksc, vsc = kq.clone(), vq.clone(), ks.clone(), vs.clone()
    else:
        hnd = layout == "vllm-hnd"
        raw = torch.zeros((nb, hk, page, 2 * (d + 4)) if hnd else (nb, page, hk, 2 * (d + 4)),
                          dtype=torch.int8, device=DEV)
        f32 = raw.view(torch.float32)
        swap = (lambda t: t.transpose(1, 2)) if hnd else (lambda t: t)  # noqa: E731
        kc, vc = swap(raw[..., :d]), swap(raw[..., d + 4:2 * d + 4])
        ksc, vsc = swap(f32[..., d // 4]), swap(f32[..., (2 * d + 4) // 4])
        kc.copy_(kq)
        vc.copy_(vq)
        ksc.copy_(ks)
        vsc.copy_(vs)
    return kc, vc, ksc, vsc, kq.float() * ks[..., None], vq.float() * vs[..., None]


def record_quant(out8, out16, v16):
    err = (out8.float() - out16.float()).abs().max().item()
    # loose: 1/64 of the largest |v| (a row's step is its absmax / 127; a lost or
    # misplaced scale is far off)
    bound = v16.float().abs().max().item() / 64
    QUANT_ERR["max_abs_err_vs_fp16"] = max(QUANT_ERR["max_abs_err_vs_fp16"], err)
    QUANT_ERR["bound"] = max(QUANT_ERR["bound"], bound)
    QUANT_ERR["cases"] += 1
    assert err <= bound, f"int8: |out - out(fp16 cache)| = {err} > {bound}"


# ---------------------------------------------------------------------------------------
# decode over a paged int8 cache: every head dim, page sizes, GQA ratios, split counts

# (num_splits, layout): vLLM's HND layout with every split count, the others once
SPLIT_LAYOUTS = [(0, "vllm-hnd"), (1, "vllm-hnd"), (7, "vllm-hnd"), (1, "compact"),
                 (7, "vllm-nhd")]


@pytest.mark.parametrize("num_splits, layout", SPLIT_LAYOUTS)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_paged(case, num_splits, layout):
    lens, h, hk, d, page = DECODE_CASES[case]
    seed = sorted(DECODE_CASES).index(case)
    k16, v16, bt = paged_cache(lens, page, hk, d, seed=seed)
    kc, vc, ks, vs, kq, vq = int8_cache(k16, v16, layout)
    q = torch.randn(len(lens), 1, h, d, device=DEV, dtype=F16, generator=gen(100 + seed))
    ref = reference_seqs(list(q), [gather_paged(kq, bt, b, n) for b, n in enumerate(lens)],
                         [gather_paged(vq, bt, b, n) for b, n in enumerate(lens)], d ** -0.5,
                         causal=True)
    ro, rl = packed_to_batched(*ref, len(lens), 1)
    kw = dict(cache_seqlens=i32(lens), block_table=bt, causal=True, num_splits=num_splits,
              return_softmax_lse=True)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_scale_cache=ks, v_scale_cache=vs, **kw)
    _compare(f"{TAG}decode {layout} d={d}", out, lse, ro, rl)
    record_quant(out, flash_attn_with_kvcache(q, k16, v16, **kw)[0], v16)
    empty = [i for i, n in enumerate(lens) if n == 0]
    if empty:
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))


# ---------------------------------------------------------------------------------------
# chunked prefill and speculative verification over an int8 cache (varlen, paged)



def _varlen(mix, h, hk, d, page, seed, layout="vllm-hnd"):
    sqs, sks = mix_lengths(mix)
    k16, v16, bt = paged_cache(sks, page, hk, d, seed=seed)
    q = torch.randn(sum(sqs), h, d, device=DEV, dtype=F16, generator=gen(seed + 50))
    return sqs, sks, q, bt, k16, v16, int8_cache(k16, v16, layout)


@pytest.mark.parametrize("d, h, hk, page", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mix", list(MIXES))
def test_varlen_paged_multi_token(mix, causal, d, h, hk, page):
    sqs, sks, q, bt, k16, v16, (kc, vc, ks, vs, kq, vq) = _varlen(mix, h, hk, d, page, d + page)
    kw = dict(causal=causal, return_attn_probs=True, block_table=bt, seqused_k=i32(sks))
    out, lse, _ = flash_attn_varlen_func(q, kc, vc, cu_seqlens(sqs), None, max(sqs), max(sks),
                                         k_scale_cache=ks, v_scale_cache=vs, **kw)
    _compare(f"{TAG}varlen {mix} d={d}", out, lse,
             *varlen_reference(sqs, sks, q, bt, kq, vq, d ** -0.5, causal))
    out16 = flash_attn_varlen_func(q, k16, v16, cu_seqlens(sqs), None, max(sqs), max(sks),
                                   **kw)[0]
    record_quant(out, out16, v16)


@pytest.mark.parametrize("window, softcap, causal", WINDOW_SOFTCAP)
def test_varlen_paged_window_and_softcap(window, softcap, causal):
    h, hk, d, page = 8, 2, 128, 32
    sqs, sks, q, bt, _, _, (kc, vc, ks, vs, kq, vq) = _varlen("chunked-prefill", h, hk, d,
                                                              page, 61, "vllm-nhd")
    if softcap:
        q = q * 3
    out, lse, _ = flash_attn_varlen_func(
        q, kc, vc, cu_seqlens(sqs), None, max(sqs), max(sks), causal=causal,
        window_size=window, softcap=softcap, return_attn_probs=True, block_table=bt,
        seqused_k=i32(sks), k_scale_cache=ks, v_scale_cache=vs)
    _compare(f"{TAG}window/softcap", out, lse,
             *varlen_reference(sqs, sks, q, bt, kq, vq, d ** -0.5, causal, window, softcap),
             atol=ATOL_SOFTCAP if softcap else ATOL)


# ---------------------------------------------------------------------------------------
# contiguous caches, appends (quantized on write), leftpad and cache_batch_idx


def test_contiguous_cache_append_with_batch_idx_and_leftpad():
    b, s, h, hk, d, new = 3, 600, 8, 2, 64, 5
    g = gen(11)
    # rows of very different magnitude: each gets its own scale
    k16 = torch.randn(4, s, hk, d, device=DEV, dtype=F16, generator=g) * \
        torch.tensor([0.01, 1.0, 30.0, 2.0], device=DEV, dtype=F16)[:, None, None, None]
    v16 = torch.randn(4, s, hk, d, device=DEV, dtype=F16, generator=g)
    (kc, ks), (vc, vs) = encode_int8_rows(k16), encode_int8_rows(v16)
    q = torch.randn(b, new, h, d, device=DEV, dtype=F16, generator=g)
    kn = torch.randn(b, new, hk, d, device=DEV, dtype=F16, generator=g)
    vn = torch.randn(b, new, hk, d, device=DEV, dtype=F16, generator=g)
    rows, lens, pad = [2, 0, 3], [400, 1, 123], [7, 0, 100]
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k=kn, v=vn, cache_seqlens=i32(lens), cache_batch_idx=i32(rows),
        cache_leftpad=i32(pad), causal=True, return_softmax_lse=True, k_scale_cache=ks,
        v_scale_cache=vs)
    (knq, kns), (vnq, vns) = encode_int8_rows(kn), encode_int8_rows(vn)
    for i, (r, n) in enumerate(zip(rows, lens)):  # the append wrote codes and scales
        assert torch.equal(kc[r, n:n + new], knq[i]) and torch.equal(vc[r, n:n + new], vnq[i])
        assert torch.equal(ks[r, n:n + new], kns[i]) and torch.equal(vs[r, n:n + new], vns[i])
    kq, vq = kc.float() * ks[..., None], vc.float() * vs[..., None]
    ref = reference_seqs(list(q), [kq[r, p:n + new] for r, n, p in zip(rows, lens, pad)],
                         [vq[r, p:n + new] for r, n, p in zip(rows, lens, pad)], d ** -0.5,
                         causal=True)
    _compare(f"{TAG}contiguous append", out, lse, *packed_to_batched(*ref, b, new))


# ---------------------------------------------------------------------------------------
# every code point and scale range through the read; the writers


@pytest.mark.parametrize("scale", [1.0, 0.0173, 3e-5, 1e-6])
def test_every_code_point_reads_as_code_times_scale(scale):
    """A one-key sequence's output row is its value row: the probability 1 times the row's
    scale, rounded to fp16 as the P operand of P V (vLLM's Triton kernel does the same;
    below fp16's normal range, 6.1e-5, that rounding is coarser), times each code, exact:
    for all 256 codes, bit for bit."""
    codes = torch.arange(-128, 128, dtype=I32, device=DEV).to(torch.int8).reshape(2, 1, 1, 128)
    scales = torch.full((2, 1, 1), scale, device=DEV)
    q = torch.zeros(2, 1, 1, 128, device=DEV, dtype=F16)
    out = flash_attn_with_kvcache(q, torch.zeros_like(codes), codes, cache_seqlens=1,
                                  causal=True, k_scale_cache=torch.ones_like(scales),
                                  v_scale_cache=scales)
    want = (codes.float() * torch.tensor(scale).half().float()).to(F16)[:, 0]
    assert torch.equal(out[:, 0], want), f"scale {scale}"


def _writer_rows(hk=2, d=128):
    g = gen(5)
    x = torch.randn(40, hk, d, device=DEV, dtype=F16, generator=g) * 3
    x[1] = 0  # all zeros: scale 1e-6, codes 0
    x[2] *= 1e-4  # tiny rows (fp16 subnormals in part)
    x[3, 0, 5] = float("inf")
    x[3, 1, 7] = float("-inf")
    x[4, 0, 9] = float("nan")
    x[5, :, :] = 60000.0  # large: code 127
    x[6, 0] = torch.arange(d, device=DEV, dtype=F16) - 64  # exact halves in q
    return x


@pytest.mark.parametrize("layout", ["vllm-hnd", "compact"])
def test_reshape_and_cache_matches_the_reference_and_the_cpu_op(layout):
    """Codes and scales bit for bit: the CUDA op, the CPU op and encode_int8_rows (the
    kvcache append's writer); NaN stored as 0, +inf as 127, -inf as -128, the absmax over
    the finite values."""
    x, y = _writer_rows(), _writer_rows().flip(0).contiguous()
    n, hk, d = x.shape
    page = 16
    slots = torch.randperm(3 * page, generator=torch.Generator().manual_seed(0))[:n]
    slots[10] = -1  # padding token: skipped
    blank = torch.zeros(3, page, hk, d, device=DEV, dtype=F16)
    kc, vc, ks, vs, _, _ = int8_cache(blank, blank, layout)
    for t in (kc, vc):
        t.fill_(99)
    for t in (ks, vs):
        t.fill_(-1.0)
    sm7x.ops.reshape_and_cache(x, y, kc, vc, slots.to(DEV), "int8_per_token_head",
                               k_scale_cache=ks, v_scale_cache=vs)
    ckc, cvc = (torch.full((3, page, hk, d), 99, dtype=torch.int8) for _ in range(2))
    cks, cvs = (torch.full((3, page, hk), -1.0) for _ in range(2))
    sm7x.ops.reshape_and_cache(x.cpu(), y.cpu(), ckc, cvc, slots, "int8_per_token_head",
                               k_scale_cache=cks, v_scale_cache=cvs)
    (xq, xs), (yq, ys) = encode_int8_rows(x), encode_int8_rows(y)
    flat = lambda t: t.reshape(3 * page, *t.shape[2:])  # noqa: E731
    live = slots >= 0
    sl = slots[live].to(DEV)
    for got, cpu_got, want in ((kc, ckc, xq), (vc, cvc, yq), (ks, cks, xs), (vs, cvs, ys)):
        assert torch.equal(flat(got.contiguous())[sl], want[live.to(DEV)])
        assert torch.equal(flat(cpu_got).to(DEV)[sl], want[live.to(DEV)])
    assert int(xq[3, 0, 5]) == 127 and int(xq[3, 1, 7]) == -128 and int(xq[4, 0, 9]) == 0
    assert torch.equal(xs[1], torch.full_like(xs[1], 1e-6))
    untouched = torch.ones(3 * page, dtype=torch.bool)
    untouched[slots[live]] = False
    assert (flat(kc.contiguous())[untouched.to(DEV)] == 99).all()  # nothing else written


# ---------------------------------------------------------------------------------------
# CUDA graphs, errors


def test_cuda_graph_with_plan_reads_new_codes_and_scales():
    lens, h, hk, d = [900, 30, 2000, 5], 8, 2, 128
    k16, v16, bt = paged_cache(lens, 16, hk, d, seed=31)
    kc, vc, ks, vs, _, _ = int8_cache(k16, v16, "vllm-hnd")
    q = torch.randn(4, 1, h, d, device=DEV, dtype=F16, generator=gen(31))
    lens_t = i32(lens)
    plan = plan_decode(4, 1, bt.shape[1] * 16, h, hk, d, kv_cache_dtype="int8_per_token_head")
    out = torch.empty_like(q)

    def call():
        out.copy_(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens_t, block_table=bt,
                                          causal=True, k_scale_cache=ks, v_scale_cache=vs,
                                          scheduler_metadata=plan))
    graph, _ = capture(call)
    nkc, nvc, nks, nvs, nkq, nvq = int8_cache(torch.randn_like(k16) * 4, v16 * 2, "compact")
    for dst, src in ((kc, nkc), (vc, nvc), (ks, nks), (vs, nvs)):
        dst.copy_(src)
    lens = [1999, 1, 64, 700]
    lens_t.copy_(i32(lens))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_seqs(list(q), [gather_paged(nkq, bt, b, n) for b, n in enumerate(lens)],
                         [gather_paged(nvq, bt, b, n) for b, n in enumerate(lens)], d ** -0.5,
                         causal=True)
    ro, _ = packed_to_batched(*ref, 4, 1)
    err = (out.float() - ro).abs().max().item()
    assert err <= ATOL, f"int8 graph replay: max |out - ref| = {err}"


def test_errors_name_the_argument_and_the_fix():
    lens = [40, 3]
    k16, v16, bt = paged_cache(lens, 16, 2, 64, seed=1)
    kc, vc, ks, vs, _, _ = int8_cache(k16, v16, "vllm-hnd")
    q = torch.randn(2, 1, 8, 64, device=DEV, dtype=F16)
    kw = dict(cache_seqlens=i32(lens), block_table=bt, causal=True)
    with pytest.raises(ValueError, match="needs k_scale_cache"):
        flash_attn_with_kvcache(q, kc, vc, **kw)
    with pytest.raises(ValueError, match="not both"):
        flash_attn_with_kvcache(q, kc, vc, k_descale=ks, v_descale=vs, k_scale_cache=ks,
                                v_scale_cache=vs, **kw)
    with pytest.raises(Exception, match=r"v_scale_cache has shape .*must be"):
        flash_attn_with_kvcache(q, kc, vc, k_scale_cache=ks, v_scale_cache=vs[:, :8], **kw)
    with pytest.raises(Exception, match="float32"):
        flash_attn_with_kvcache(q, kc, vc, k_scale_cache=ks, v_scale_cache=vs.half(), **kw)
    with pytest.raises(ValueError, match="int8 codes"):
        sm7x.ops.reshape_and_cache(k16[0], v16[0], kc.view(torch.uint8), vc.view(torch.uint8),
                                   i32([0] * 16).long(), "int8_per_token_head",
                                   k_scale_cache=ks, v_scale_cache=vs)


def test_zz_report_quantization_error():
    """Prints the int8 cache's error against the fp16 cache over this file's calls."""
    if not QUANT_ERR["cases"]:
        pytest.skip("no int8 read ran")
    print(f"\n{TAG}quantization error vs the fp16 cache: max |out - out(fp16)| = "
          f"{QUANT_ERR['max_abs_err_vs_fp16']:.4f} over {QUANT_ERR['cases']} calls (bound "
          f"{QUANT_ERR['bound']:.3f})")
