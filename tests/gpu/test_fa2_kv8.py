"""8-bit KV caches (fp8 e4m3 / e5m2) read by the FA2 serving kernels, on a GPU.

Each case quantizes a float16 cache (x / descale, nearest even, saturating: what
sm7x.ops.reshape_and_cache and vLLM write) and checks the kernels' output two ways:
against the float32 reference computed from the dequantized cache (codes x descale; the
float16 tests' tolerance: only the kernels' own error), and against the same call on the
float16 cache (the quantization error, recorded per format and printed at the end, with
a loose bound that a lost scale or a misread code would break). Then every code point
through the read (the LSE of a one-key row is the key's value; the output of a one-key
row is its value) and through both writers, the descale layouts, appends, CUDA graphs and
the errors.

Marked `gpu`; on GPUs newer than Turing SM7X_FA2_FORCE names the library, e.g.

    SM7X_FA2_FORCE=sm75 pytest -s tests/gpu/test_fa2_kv8.py
    SM7X_FA2_FORCE=sm70 pytest -s tests/gpu/test_fa2_kv8.py

The quantization errors are written to $KV8_ERRORS_OUT (JSON) when set.
"""

from __future__ import annotations

import functools
import json
import os

import pytest

from fa2_arch import fa2_arch_or_skip

ARCH = fa2_arch_or_skip()

import torch  # noqa: E402

TAG = f"{ARCH} "

import sm7x.fa2 as fa2  # noqa: E402
from sm7x.fa2 import flash_attn_varlen_func, flash_attn_with_kvcache, plan_decode  # noqa: E402
from cache_cases import (  # noqa: E402
    ATOL, ATOL_SOFTCAP, DECODE_CASES, DEV, F16, I32, MIXES, SHAPES, WINDOW_SOFTCAP, mix_lengths,
    varlen_reference)
from fa2_reference import (  # noqa: E402
    _compare, capture, cu_seqlens, gather_paged, gen, i32, packed_to_batched, paged_cache,
    reference_seqs, report_worst)

pytestmark = pytest.mark.gpu

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MANTISSA = {"e4m3": 3, "e5m2": 2}
QUANT_ERR: dict[str, dict] = {}  # per format: worst |out - out_fp16| and its bound


def quantize(cache, fmt, per_head=False):
    """(codes, descale, dequantized float32): x / descale as the format's codes, with
    descale = absmax / the format's largest value (per tensor, or per kv head: [hk])."""
    dtype = FORMATS[fmt]
    big = torch.finfo(dtype).max
    x = cache.float()
    if per_head:
        descale = x.abs().amax(dim=(0, 1, 3)) / big  # [hk]
        d = descale[:, None]
    else:
        descale = (x.abs().max() / big).reshape(())
        d = descale
    codes = (x / d).clamp(-big, big).to(dtype)
    return codes, descale, codes.float() * d


def record_quant(fmt, out8, out16, v16):
    err = (out8.float() - out16.float()).abs().max().item()
    # a loose bound: 2^-mantissa of the largest |v| (a lost 2^8 or descale is far off it)
    bound = 2.0 ** -MANTISSA[fmt] * v16.float().abs().max().item()
    r = QUANT_ERR.setdefault(f"{TAG}{fmt}", {"max_abs_err_vs_fp16": 0.0, "bound": bound,
                                             "cases": 0})
    r["max_abs_err_vs_fp16"] = max(r["max_abs_err_vs_fp16"], err)
    r["cases"] += 1
    assert err <= bound, f"{fmt}: |out - out(fp16 cache)| = {err} > {bound}"


# ---------------------------------------------------------------------------------------
# decode over a paged 8-bit cache: every head dim, page size, GQA ratio, split count


SPLITS = (0, 1, 7)


@functools.lru_cache(maxsize=2)
def decode_case(name, fmt, per_head):
    lens, h, hk, d, page = DECODE_CASES[name]
    seed = sorted(DECODE_CASES).index(name)
    k16, v16, bt = paged_cache(lens, page, hk, d, seed=seed)
    kc, kd, kq = quantize(k16, fmt, per_head)
    vc, vd, vq = quantize(v16, fmt, per_head)
    q = torch.randn(len(lens), 1, h, d, device=DEV, dtype=F16, generator=gen(100 + seed))
    ks = [gather_paged(kq, bt, b, n) for b, n in enumerate(lens)]
    vs = [gather_paged(vq, bt, b, n) for b, n in enumerate(lens)]
    ref_out, ref_lse = reference_seqs(list(q), ks, vs, d ** -0.5, causal=True)
    ref_out, ref_lse = packed_to_batched(ref_out, ref_lse, len(lens), 1)
    return dict(lens=lens, h=h, d=d, q=q, k16=k16, v16=v16, kc=kc, vc=vc, kd=kd, vd=vd, bt=bt,
                lens_t=i32(lens), ref_out=ref_out, ref_lse=ref_lse)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case, num_splits", [(c, s) for c in DECODE_CASES for s in SPLITS])
def test_decode_paged(case, num_splits, fmt):
    per_head = num_splits == 7  # per-kv-head descales on one of the three split settings
    c = decode_case(case, fmt, per_head)
    kw = dict(cache_seqlens=c["lens_t"], block_table=c["bt"], causal=True,
              num_splits=num_splits, return_softmax_lse=True)
    out, lse = flash_attn_with_kvcache(c["q"], c["kc"], c["vc"], k_descale=c["kd"],
                                       v_descale=c["vd"], **kw)
    _compare(f"{TAG}kv8 {fmt} decode d={c['d']}", out, lse, c["ref_out"], c["ref_lse"])
    out16 = flash_attn_with_kvcache(c["q"], c["k16"], c["v16"], **kw)[0]
    record_quant(fmt, out, out16, c["v16"])
    empty = [i for i, n in enumerate(c["lens"]) if n == 0]
    if empty:
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))


# ---------------------------------------------------------------------------------------
# chunked prefill and speculative verification over an 8-bit cache (varlen, paged)



def _varlen_case(mix, h, hk, d, page, fmt, seed):
    sqs, sks = mix_lengths(mix)
    k16, v16, bt = paged_cache(sks, page, hk, d, seed=seed)
    q = torch.randn(sum(sqs), h, d, device=DEV, dtype=F16, generator=gen(seed + 50))
    kc, kd, kq = quantize(k16, fmt)
    vc, vd, vq = quantize(v16, fmt)
    return sqs, sks, q, bt, (k16, v16), (kc, vc, kd, vd), (kq, vq)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("d, h, hk, page", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mix", list(MIXES))
def test_varlen_paged_multi_token(mix, causal, d, h, hk, page, fmt):
    sqs, sks, q, bt, (k16, v16), (kc, vc, kd, vd), (kq, vq) = _varlen_case(
        mix, h, hk, d, page, fmt, seed=d + page)
    kw = dict(causal=causal, return_attn_probs=True, block_table=bt, seqused_k=i32(sks))
    out, lse, _ = flash_attn_varlen_func(q, kc, vc, cu_seqlens(sqs), None, max(sqs), max(sks),
                                         k_descale=kd, v_descale=vd, **kw)
    ro, rl = varlen_reference(sqs, sks, q, bt, kq, vq, d ** -0.5, causal)
    _compare(f"{TAG}kv8 {fmt} varlen {mix} d={d}", out, lse, ro, rl)
    out16 = flash_attn_varlen_func(q, k16, v16, cu_seqlens(sqs), None, max(sqs), max(sks),
                                   **kw)[0]
    record_quant(fmt, out, out16, v16)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("window, softcap, causal", WINDOW_SOFTCAP)
def test_varlen_paged_window_and_softcap(window, softcap, causal, fmt):
    h, hk, d, page = 8, 2, 128, 32
    sqs, sks, q, bt, _, (kc, vc, kd, vd), (kq, vq) = _varlen_case(
        "chunked-prefill", h, hk, d, page, fmt, seed=61)
    if softcap:
        q = q * 3
    out, lse, _ = flash_attn_varlen_func(
        q, kc, vc, cu_seqlens(sqs), None, max(sqs), max(sks), causal=causal,
        window_size=window, softcap=softcap, return_attn_probs=True, block_table=bt,
        seqused_k=i32(sks), k_descale=kd, v_descale=vd)
    ro, rl = varlen_reference(sqs, sks, q, bt, kq, vq, d ** -0.5, causal, window, softcap)
    _compare(f"{TAG}kv8 {fmt} window/softcap", out, lse, ro, rl,
             atol=ATOL_SOFTCAP if softcap else ATOL)


# ---------------------------------------------------------------------------------------
# descale layouts, uint8 caches, per-sequence descales


def _small(fmt, seed=7, lens=(40, 300, 1), h=8, hk=2, d=128, page=16):
    k16, v16, bt = paged_cache(list(lens), page, hk, d, seed=seed)
    q = torch.randn(len(lens), 1, h, d, device=DEV, dtype=F16, generator=gen(seed))
    return list(lens), q, k16, v16, bt


@pytest.mark.parametrize("layout", ["scalar", "one", "per-head", "expanded", "uint8"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_descale_layouts_and_uint8_caches(fmt, layout):
    lens, q, k16, v16, bt = _small(fmt)
    kc, kd, kq = quantize(k16, fmt, per_head=layout in ("per-head", "expanded"))
    vc, vd, vq = quantize(v16, fmt, per_head=layout in ("per-head", "expanded"))
    extra = {}
    if layout == "one":
        kd, vd = kd.reshape(1), vd.reshape(1)
    elif layout == "expanded":  # vLLM's FA call: layer._k_scale.expand((batch, kv_heads))
        kd, vd = kd[None].expand(len(lens), -1), vd[None].expand(len(lens), -1)
    elif layout == "uint8":  # vLLM allocates fp8 caches as uint8 and names the format
        kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
        extra["kv_cache_dtype"] = "fp8" if fmt == "e4m3" else "fp8_e5m2"
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(lens), block_table=bt,
                                       causal=True, return_softmax_lse=True, k_descale=kd,
                                       v_descale=vd, **extra)
    ks = [gather_paged(kq, bt, b, n) for b, n in enumerate(lens)]
    vs = [gather_paged(vq, bt, b, n) for b, n in enumerate(lens)]
    ro, rl = packed_to_batched(*reference_seqs(list(q), ks, vs, 128 ** -0.5, causal=True),
                               len(lens), 1)
    _compare(f"{TAG}kv8 {fmt} descale {layout}", out, lse, ro, rl)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_per_sequence_descales_contiguous_cache(fmt):
    """[batch, kv_heads] descales: each cache row quantized with its own scales."""
    b, s, h, hk, d = 3, 700, 8, 2, 64
    g = gen(3)
    k16 = torch.randn(b, s, hk, d, device=DEV, dtype=F16, generator=g) * \
        torch.tensor([0.1, 1.0, 8.0], device=DEV, dtype=F16)[:, None, None, None]
    v16 = torch.randn(b, s, hk, d, device=DEV, dtype=F16, generator=g)
    q = torch.randn(b, 1, h, d, device=DEV, dtype=F16, generator=g)
    big = torch.finfo(FORMATS[fmt]).max
    kd = k16.float().abs().amax(dim=(1, 3)) / big  # [b, hk]
    vd = v16.float().abs().amax(dim=(1, 3)) / big
    kc = (k16.float() / kd[:, None, :, None]).clamp(-big, big).to(FORMATS[fmt])
    vc = (v16.float() / vd[:, None, :, None]).clamp(-big, big).to(FORMATS[fmt])
    lens = [700, 1, 431]
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(lens), causal=True,
                                       return_softmax_lse=True, k_descale=kd, v_descale=vd)
    kq = kc.float() * kd[:, None, :, None]
    vq = vc.float() * vd[:, None, :, None]
    ro, rl = packed_to_batched(*reference_seqs(list(q), [kq[i, :n] for i, n in enumerate(lens)],
                                               [vq[i, :n] for i, n in enumerate(lens)],
                                               d ** -0.5, causal=True), b, 1)
    _compare(f"{TAG}kv8 {fmt} per-sequence descales", out, lse, ro, rl)


# ---------------------------------------------------------------------------------------
# every code point through the read and both writers


def _all_codes(fmt):
    """The 256 codes of fmt as a [2, 128] uint8 tensor and their float32 values (torch's
    conversion, the format's definition)."""
    codes = torch.arange(256, dtype=torch.int32, device=DEV).to(torch.uint8).reshape(2, 128)
    return codes, codes.view(FORMATS[fmt]).float()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_code_point_reads_exactly(fmt):
    """Values: a one-key sequence's output row is its value row (the softmax of one key is
    1), exact in fp16 for every code; NaN codes read as NaN, E5M2's infinities as
    infinities. Keys: with q = e_i and scale 1 the LSE of head i is key element i, exact
    for every finite code (a NaN anywhere in the key row would make every score NaN, as
    0 x NaN is NaN: the non-finite codes are left out of the key rows)."""
    codes, values = _all_codes(fmt)
    d, h = 128, 128
    q = torch.eye(d, device=DEV, dtype=F16)[None, None].expand(2, 1, h, d).contiguous()
    rows = codes.reshape(2, 1, 1, d)  # sequence b's one key / value row holds codes[b]
    zero_keys = torch.zeros_like(rows)
    out = flash_attn_with_kvcache(q, zero_keys.view(FORMATS[fmt]), rows.view(FORMATS[fmt]),
                                  cache_seqlens=1, causal=True, softmax_scale=1.0)
    want_v = values.to(F16)  # exact: every fp8 value is an fp16 value
    got_v = out[:, 0, 0, :]  # head 0's output row = the value row
    same = (got_v == want_v) | (torch.isnan(got_v) & torch.isnan(want_v))
    assert same.all(), f"{fmt}: codes {codes[~same].tolist()} read as {got_v[~same].tolist()}"
    finite = torch.isfinite(values)
    finite_keys = torch.where(finite, codes, torch.zeros_like(codes)).reshape(2, 1, 1, d)
    _, lse = flash_attn_with_kvcache(q, finite_keys.view(FORMATS[fmt]), rows.view(FORMATS[fmt]),
                                     cache_seqlens=1, causal=True, softmax_scale=1.0,
                                     return_softmax_lse=True)
    got_k = lse[:, :, 0]  # [2, h]: lse of head i = element i of the key
    # exact up to the LSE's log(l = 1) (a fast log: within 1e-6 of 0); neighbouring codes
    # differ by at least 2^-9 (E4M3) / 2^-16 (E5M2)
    bad = ~torch.isclose(got_k, values, rtol=1e-6, atol=2e-6) & finite
    assert not bad.any(), (f"{fmt}: key codes {codes[bad][:8].tolist()} read as "
                           f"{got_k[bad][:8].tolist()}, not {values[bad][:8].tolist()}")


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("writer", ["append", "reshape_and_cache"])
def test_every_code_point_round_trips_through_the_writers(fmt, writer):
    """value(code) written gives code back (NaN a NaN code); +-inf saturates to the largest
    finite code (E4M3 has no infinity; E5M2's writes saturate as vLLM's do)."""
    codes, values = _all_codes(fmt)
    big = torch.finfo(FORMATS[fmt]).max
    x = values.reshape(256, 1, 1).to(F16)  # 256 tokens, 1 kv head, head dim 1 -> padded below
    x = torch.cat([x, torch.tensor([float("inf"), float("-inf")], device=DEV,
                                   dtype=F16).reshape(2, 1, 1)])
    n = x.shape[0]
    x = x.expand(n, 1, 8).contiguous()  # head dim 8 (the caches' chunk)
    cache = torch.zeros(n, 1, 1, 8, device=DEV, dtype=torch.uint8)  # [blocks, page 1, hk, d]
    one = torch.ones((), device=DEV)
    if writer == "append":
        kc = cache.view(FORMATS[fmt])
        vc = kc.clone()
        flash_attn_with_kvcache(torch.zeros(n, 1, 1, 8, device=DEV, dtype=F16), kc, vc,
                                k=x[:, None], v=x[:, None], cache_seqlens=0,
                                block_table=torch.arange(n, dtype=I32, device=DEV)[:, None],
                                k_descale=one, v_descale=one)
        got = kc.view(torch.uint8)[:, 0, 0, 0]
    else:
        import sm7x.ops as ops
        vc = cache.clone()
        ops.reshape_and_cache(x, x, cache, vc, torch.arange(n, device=DEV),
                              "fp8" if fmt == "e4m3" else "fp8_e5m2", one.reshape(1),
                              one.reshape(1))
        got = cache[:, 0, 0, 0]
    want, flat = codes.flatten(), values.flatten()
    finite, nan = torch.isfinite(flat), torch.isnan(flat)
    assert torch.equal(got[:256][finite], want[finite]), f"{writer} {fmt}: a finite code changed"
    assert torch.isnan(got[:256][nan].view(FORMATS[fmt]).float()).all(), f"{writer}: NaN lost"
    sat = got[256:].view(FORMATS[fmt]).float().tolist()
    assert sat == [big, -big], f"{writer} {fmt}: +-inf wrote {sat}, not +-{big}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reshape_and_cache_then_paged_attention(fmt):
    """sm7x.ops.reshape_and_cache (vLLM's layout and scale tensors) writes the cache the
    kernels read; the result matches the reference over the dequantized cache."""
    import sm7x.ops as ops
    lens, h, hk, d, page = [33, 70], 8, 2, 128, 16
    g = gen(11)
    k = torch.randn(sum(lens), hk, d, device=DEV, dtype=F16, generator=g) * 3
    v = torch.randn(sum(lens), hk, d, device=DEV, dtype=F16, generator=g)
    nb = 12
    kc = torch.zeros(nb, page, hk, d, device=DEV, dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    bt = i32([5, 1, 9, 0, 0, 0, 7, 3, 11, 2, 4, 0]).reshape(2, 6)
    slots = torch.cat([bt[b].long()[torch.arange(n, device=DEV) // page] * page +
                       torch.arange(n, device=DEV) % page for b, n in enumerate(lens)])
    ks = torch.full((1,), 0.02, device=DEV)
    vs = torch.full((1,), 0.005, device=DEV)
    name = "fp8" if fmt == "e4m3" else "fp8_e5m2"
    ops.reshape_and_cache(k, v, kc, vc, slots, name, ks, vs)
    q = torch.randn(sum(lens), h, d, device=DEV, dtype=F16, generator=g)
    out, lse, _ = flash_attn_varlen_func(q, kc, vc, cu_seqlens(lens), None, max(lens), max(lens),
                                         causal=True, return_attn_probs=True, block_table=bt,
                                         seqused_k=i32(lens), k_descale=ks, v_descale=vs,
                                         kv_cache_dtype=name)
    kq = kc.view(FORMATS[fmt]).float() * ks
    vq = vc.view(FORMATS[fmt]).float() * vs
    ro, rl = varlen_reference(lens, lens, q, bt, kq, vq, d ** -0.5, True)
    _compare(f"{TAG}kv8 {fmt} reshape_and_cache", out, lse, ro, rl)


# ---------------------------------------------------------------------------------------
# appends (quantized on write) and CUDA graphs


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("new", [1, 5])
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_kvcache_append_quantizes_on_write(layout, new, fmt):
    """The appended k/v are written as codes of x / descale (nearest even, saturating);
    the attention then reads them with the rest of the cache."""
    b, h, hk, d, cap, page = 3, 8, 2, 64, 64, 16
    starts = [20, cap - new, 0]
    k16, v16, bt = paged_cache([cap] * b, page, hk, d, seed=21)  # every page a sequence's
    if layout == "contiguous":  # the same keys, row by row
        k16, v16 = (c[bt.long()].reshape(b, cap, hk, d) for c in (k16, v16))
    kc, kd, kq = quantize(k16, fmt)
    vc, vd, vq = quantize(v16, fmt)
    g = gen(23)
    q = torch.randn(b, new, h, d, device=DEV, dtype=F16, generator=g)
    k_new = torch.randn(b, new, hk, d, device=DEV, dtype=F16, generator=g)
    v_new = torch.randn(b, new, hk, d, device=DEV, dtype=F16, generator=g)
    out = flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=i32(starts),
                                  block_table=bt if layout == "paged" else None, causal=True,
                                  k_descale=kd, v_descale=vd)
    big = torch.finfo(FORMATS[fmt]).max
    enc_k = (k_new.float() / kd).clamp(-big, big).to(FORMATS[fmt])
    enc_v = (v_new.float() / vd).clamp(-big, big).to(FORMATS[fmt])
    ks, vs = [], []
    for i, n in enumerate(starts):
        pos = torch.arange(n, n + new, device=DEV)
        rows = (bt[i].long()[pos // page], pos % page) if layout == "paged" else \
            (torch.full_like(pos, i), pos)
        for cache, enc in ((kc, enc_k), (vc, enc_v)):
            assert torch.equal(cache.view(torch.uint8)[rows], enc[i].view(torch.uint8)), \
                f"{fmt} {layout}: appended codes differ from x / descale encoded"
        old_k = gather_paged(kq, bt, i, n) if layout == "paged" else kq[i, :n]
        old_v = gather_paged(vq, bt, i, n) if layout == "paged" else vq[i, :n]
        ks.append(torch.cat([old_k, enc_k[i].float() * kd]))
        vs.append(torch.cat([old_v, enc_v[i].float() * vd]))
    ro, _ = packed_to_batched(*reference_seqs(list(q), ks, vs, d ** -0.5, causal=True), b, new)
    err = (out.float() - ro).abs().max().item()
    assert err <= ATOL, f"{fmt} append {layout}: max |out - ref| = {err}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cuda_graph_with_plan_reads_new_cache_and_descales(fmt):
    """Captured once with a plan; replayed after new codes, lengths and descale values
    are written into the same tensors (the kernels read the descales on the device)."""
    lens, q, k16, v16, bt = _small(fmt, seed=31, lens=(900, 30, 2000, 5))
    kc, kd, _ = quantize(k16, fmt)
    vc, vd, _ = quantize(v16, fmt)
    lens_t = i32(lens)
    plan = plan_decode(4, 1, bt.shape[1] * 16, 8, 2, 128, kv_cache_dtype=kc.dtype)
    out = torch.empty_like(q)

    def call():
        out.copy_(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens_t, block_table=bt,
                                          causal=True, k_descale=kd, v_descale=vd,
                                          scheduler_metadata=plan))
    graph, _ = capture(call)
    new16 = torch.randn_like(k16.float()).to(F16) * 4
    nkc, nkd, nkq = quantize(new16, fmt)
    nvc, nvd, nvq = quantize(v16 * 2, fmt)
    kc.copy_(nkc)
    vc.copy_(nvc)
    kd.copy_(nkd)
    vd.copy_(nvd)
    lens = [1999, 1, 64, 700]
    lens_t.copy_(i32(lens))
    graph.replay()
    torch.cuda.synchronize()
    ks = [gather_paged(nkq, bt, b, n) for b, n in enumerate(lens)]
    vs = [gather_paged(nvq, bt, b, n) for b, n in enumerate(lens)]
    ro, rl = packed_to_batched(*reference_seqs(list(q), ks, vs, 128 ** -0.5, causal=True), 4, 1)
    err = (out.float() - ro).abs().max().item()
    assert err <= ATOL, f"{fmt} graph replay: max |out - ref| = {err}"


# ---------------------------------------------------------------------------------------
# errors


def test_errors_name_the_argument_and_the_fix():
    lens, q, k16, v16, bt = _small("e4m3")
    kc, kd, _ = quantize(k16, "e4m3")
    kw = dict(cache_seqlens=i32(lens), block_table=bt, causal=True)
    with pytest.raises(ValueError, match="same shape and dtype"):
        flash_attn_with_kvcache(q, kc, v16, **kw)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3'"):
        flash_attn_with_kvcache(q, kc.view(torch.uint8), kc.view(torch.uint8), **kw)
    with pytest.raises(ValueError, match="applies to an 8-bit cache"):
        flash_attn_with_kvcache(q, k16, v16, k_descale=kd, **kw)
    with pytest.raises(RuntimeError, match="float8_e4m3fn but kv_format is fp8 e5m2"):
        flash_attn_with_kvcache(q, kc, kc, kv_cache_dtype="fp8_e5m2", **kw)
    with pytest.raises(RuntimeError, match="k_descale has dtype float16; descales are float32"):
        flash_attn_with_kvcache(q, kc, kc, k_descale=kd.half(), **kw)
    with pytest.raises(RuntimeError, match=r"k_descale has shape \[5\]"):
        flash_attn_with_kvcache(q, kc, kc, k_descale=torch.ones(5, device=DEV), **kw)
    with pytest.raises(RuntimeError, match="k_descale is on cpu but q is on cuda:0; move all"):
        flash_attn_with_kvcache(q, kc, kc, k_descale=kd.cpu(), **kw)
    with pytest.raises(ValueError, match="applies to calls over a KV cache"):
        flash_attn_varlen_func(q[:, 0], q[:, 0], q[:, 0], cu_seqlens([1, 1, 1]),
                               cu_seqlens([1, 1, 1]), 1, 1, k_descale=kd)


def test_zz_report_quantization_errors():
    """Prints the worst error of each format against the float16 cache (-s) and writes
    them to $KV8_ERRORS_OUT."""
    report_worst(f"{ARCH} 8-bit KV cache: worst |out - reference(dequantized cache)|")
    for key, r in sorted(QUANT_ERR.items()):
        print(f"  {key}: max |out - out(fp16 cache)| = {r['max_abs_err_vs_fp16']:.4g} over "
              f"{r['cases']} calls (bound {r['bound']:.3g})")
    path = os.environ.get("KV8_ERRORS_OUT")
    if path:
        with open(path, "w") as f:
            json.dump(QUANT_ERR, f, indent=1)


@pytest.mark.parametrize("fmt", [None, "e4m3"])
def test_kvcache_compiled_fullgraph_matches_eager(fmt):
    """torch.compile(fullgraph=True) of a decode step with an append (the sm7x_fa2::kvcache
    op): same output and the same cache bytes as the eager call, fp16 and 8-bit caches."""
    lens, q, k16, v16, bt = _small(fmt or "e4m3", seed=41, lens=(33, 70, 2))
    extra = {}
    kc, vc = k16, v16
    if fmt:
        kc, kd, _ = quantize(k16, fmt)
        vc, vd, _ = quantize(v16, fmt)
        extra = dict(k_descale=kd, v_descale=vd)
    g = gen(42)
    k_new = torch.randn(3, 1, 2, 128, device=DEV, dtype=F16, generator=g)
    v_new = torch.randn(3, 1, 2, 128, device=DEV, dtype=F16, generator=g)

    def step(q, kc, vc, lens):
        return flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lens,
                                       block_table=bt, causal=True, **extra) * 1.0

    kc_e, vc_e = kc.clone(), vc.clone()
    want = step(q, kc_e, vc_e, i32(lens))
    got = torch.compile(step, fullgraph=True)(q, kc, vc, i32(lens))
    assert torch.equal(got, want)
    assert torch.equal(kc.view(torch.uint8), kc_e.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_e.view(torch.uint8))
