"""sm7x FA2 serving API on a GPU, against the float32 reference of fa2_reference.py built
on keys gathered from the cache: paged KV (block_table), decode with split-KV, chunked
prefill and speculative-decoding verification over a paged prefix (varlen),
flash_attn_with_kvcache (append with rotary, cache_batch_idx, cache_leftpad),
plan_decode and CUDA graphs, composition with sm7x.ops.reshape_and_cache, and the errors
raised for bad device-side values and autograd inputs.

Marked `gpu`. Tests whichever FA2 library the device selects; on GPUs newer than Turing
SM7X_FA2_FORCE must name one (its PTX is JIT-compiled there), e.g. on the H200:

    SM7X_FA2_FORCE=sm75 pytest -s tests/gpu/test_fa2_serving.py
    SM7X_FA2_FORCE=sm70 pytest -s tests/gpu/test_fa2_serving.py

The worst errors are printed at the end (-s) and written to $FA2_ERRORS_OUT when set.
"""

from __future__ import annotations

import functools
import itertools
import re

import pytest

from fa2_arch import fa2_arch_or_skip

ARCH = fa2_arch_or_skip()

import torch  # noqa: E402

TAG = f"{ARCH} "  # names the arch in the worst-error record

import sm7x.fa2 as fa2  # noqa: E402
from sm7x.fa2 import (  # noqa: E402
    flash_attn_varlen_func, flash_attn_with_kvcache, plan_decode)
from cache_cases import ATOL, ATOL_SOFTCAP, DEV, F16, I32  # noqa: E402
from fa2_reference import (  # noqa: E402
    DECODE_ROWS, _compare, _record, apply_rotary, capture, ceil_div, contiguous_from_paged,
    cu_seqlens, gather_paged, gen, i32, packed_to_batched, paged_cache, paged_rows, random_lens,
    reference, reference_seqs, report_worst, rotary_tables)

pytestmark = pytest.mark.gpu

# a value error raised for a bad device-side value (block_table entry, key count)
VALUE_ERRORS = (RuntimeError, ValueError)


# ---------------------------------------------------------------------------------------
# helpers


def randn(*shape, g):
    return torch.randn(*shape, device=DEV, dtype=F16, generator=g)


def check_empty_rows(out_rows, lse_rows=None):
    """Rows without a visible key: exactly 0, lse +inf."""
    assert torch.equal(out_rows, torch.zeros_like(out_rows)), "a row without keys is not 0"
    if lse_rows is not None:
        assert torch.isinf(lse_rows).all() and (lse_rows > 0).all(), "lse of an empty row is not +inf"


# ---------------------------------------------------------------------------------------
# decode (seqlen_q = 1) over a paged cache


DECODE_CASES = {
    # name: (cache lengths, num_heads, num_kv_heads, head_dim, page_size)
    "len1": ([1], 8, 8, 128, 16),
    "len15-16-17": ([15, 16, 17], 8, 2, 128, 16),
    "len0-and-short-gqa4": ([0, 1, 17, 16], 32, 8, 64, 32),
    "len1000-mqa-d256": ([1000, 999], 8, 1, 256, 64),
    "len32768": ([32768], 8, 2, 128, 128),
    "len100000": ([100000, 77777], 8, 8, 128, 64),
    "batch128-mixed-gqa4": (random_lens(128, 1, 2048, seed=1), 32, 8, 128, 16),
    "batch37-d80-padded": (random_lens(37, 1, 3000, seed=2), 8, 8, 80, 32),
    "batch16-mqa-d64": (random_lens(16, 1, 5000, seed=3), 8, 1, 64, 128),
    "batch5-d256-gqa4": ([1, 300, 4097, 64, 2000], 16, 4, 256, 16),
}
SPLITS = (0, 1, 7)  # auto, none, at most 7


@functools.lru_cache(maxsize=1)  # the grid runs a case's splits in a row: build it once
def decode_case(name):
    lens, h, hk, d, page = DECODE_CASES[name]
    seed = sorted(DECODE_CASES).index(name)
    k_cache, v_cache, bt = paged_cache(lens, page, hk, d, seed=seed)
    q = randn(len(lens), 1, h, d, g=gen(100 + seed))
    ks = [gather_paged(k_cache, bt, b, n) for b, n in enumerate(lens)]
    vs = [gather_paged(v_cache, bt, b, n) for b, n in enumerate(lens)]
    ref_out, ref_lse = reference_seqs(list(q), ks, vs, d ** -0.5, causal=True)
    ref_out, ref_lse = packed_to_batched(ref_out, ref_lse, len(lens), 1)
    return dict(lens=lens, h=h, hk=hk, d=d, page=page, q=q, k_cache=k_cache,
                v_cache=v_cache, bt=bt, lens_t=i32(lens), ref_out=ref_out, ref_lse=ref_lse)


@pytest.mark.parametrize("case, num_splits",
                         [(c, s) for c in DECODE_CASES for s in SPLITS])
def test_decode_paged_matches_reference(case, num_splits):
    c = decode_case(case)
    b = len(c["lens"])
    out, lse = flash_attn_with_kvcache(
        c["q"], c["k_cache"], c["v_cache"], cache_seqlens=c["lens_t"], block_table=c["bt"],
        causal=True, num_splits=num_splits, return_softmax_lse=True)
    assert out.shape == c["q"].shape and out.dtype == F16
    assert lse.shape == (b, c["h"], 1) and lse.dtype == torch.float32
    _compare(f"{TAG}decode paged d={c['d']}", out, lse, c["ref_out"], c["ref_lse"])
    empty = [i for i, n in enumerate(c["lens"]) if n == 0]
    if empty:
        check_empty_rows(out[empty], lse[empty])


PLAN_CASES = ["len15-16-17", "len0-and-short-gqa4", "batch128-mixed-gqa4", "len32768"]


@pytest.mark.parametrize("case, num_splits", [(c, s) for c in PLAN_CASES for s in SPLITS])
def test_decode_varlen_with_plan_and_out(case, num_splits):
    """flash_attn_varlen_func(block_table=, seqused_k=, out=, scheduler_metadata=plan):
    writes and returns `out`; with one split it is the kvcache path's result exactly."""
    c = decode_case(case)
    lens, h, hk, d = c["lens"], c["h"], c["hk"], c["d"]
    b = len(lens)
    q = c["q"][:, 0]  # [b, h, d]: one query token per sequence
    plan = plan_decode(b, 1, max(lens), h, hk, d, device=q.device, num_splits=num_splits)
    out_buf = torch.full_like(q, float("nan"))
    out, lse, none = flash_attn_varlen_func(
        q, c["k_cache"], c["v_cache"], cu_seqlens([1] * b), None, 1, max(lens), causal=True,
        return_attn_probs=True, block_table=c["bt"], seqused_k=c["lens_t"], out=out_buf,
        scheduler_metadata=plan)
    assert out.data_ptr() == out_buf.data_ptr() and out.shape == q.shape, "out= was not returned"
    assert none is None and lse.shape == (h, b)
    _compare(f"{TAG}decode varlen+plan d={d}", out[:, None], lse.t()[:, :, None],
             c["ref_out"], c["ref_lse"])
    if num_splits == 1:
        ref1 = flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"],
                                       cache_seqlens=c["lens_t"], block_table=c["bt"],
                                       causal=True, num_splits=1)
        assert torch.equal(out, ref1[:, 0]), "varlen+plan (1 split) != with_kvcache (num_splits=1)"


EXACT_CASES = ["len15-16-17", "len0-and-short-gqa4", "len1000-mqa-d256", "batch37-d80-padded",
               "batch5-d256-gqa4"]


@pytest.mark.parametrize("case, num_splits, sq",
                         [(c, s, sq) for c in EXACT_CASES for s in (1, 0, 7) for sq in (1, 4)])
def test_paged_equals_contiguous_cache_exactly(case, num_splits, sq):
    """The same keys in a paged and in a contiguous cache: bit-identical out and lse."""
    c = decode_case(case)
    lens, h, d = c["lens"], c["h"], c["d"]
    b = len(lens)
    q = c["q"] if sq == 1 else randn(b, sq, h, d, g=gen(7))
    kc, vc = contiguous_from_paged(c["k_cache"], c["bt"]), contiguous_from_paged(c["v_cache"], c["bt"])
    kw = dict(cache_seqlens=c["lens_t"], causal=True, num_splits=num_splits, return_softmax_lse=True)
    out_p, lse_p = flash_attn_with_kvcache(q, c["k_cache"], c["v_cache"], block_table=c["bt"], **kw)
    out_c, lse_c = flash_attn_with_kvcache(q, kc, vc, **kw)
    assert torch.equal(out_p, out_c), "paged and contiguous caches disagree (out)"
    assert torch.equal(lse_p, lse_c), "paged and contiguous caches disagree (lse)"
    if sq > 1:
        ks = [kc[i, :n] for i, n in enumerate(lens)]
        vs = [vc[i, :n] for i, n in enumerate(lens)]
        ro, rl = reference_seqs(list(q), ks, vs, d ** -0.5, causal=True)
        ro, rl = packed_to_batched(ro, rl, b, sq)
        _compare(f"{TAG}kvcache sq={sq} d={d}", out_p, lse_p, ro, rl)


@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("window, softcap, causal", [
    ((256, 0), 0.0, False),
    ((100, -1), 0.0, False),
    ((-1, -1), 30.0, True),
    ((256, 0), 30.0, True),
])
def test_decode_window_and_softcap(window, softcap, causal, num_splits):
    """Split partitions that lie wholly outside the window must merge to nothing."""
    lens, h, hk, d, page = [5000, 300, 1, 257, 4097], 8, 2, 128, 32
    b = len(lens)
    k_cache, v_cache, bt = paged_cache(lens, page, hk, d, seed=21)
    q = randn(b, 1, h, d, g=gen(22))
    if softcap:
        q = q * 3  # so that the cap matters
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=i32(lens), block_table=bt, causal=causal,
        window_size=window, softcap=softcap, num_splits=num_splits, return_softmax_lse=True)
    ks = [gather_paged(k_cache, bt, i, n) for i, n in enumerate(lens)]
    vs = [gather_paged(v_cache, bt, i, n) for i, n in enumerate(lens)]
    ro, rl = reference_seqs(list(q), ks, vs, d ** -0.5, causal, window, softcap)
    ro, rl = packed_to_batched(ro, rl, b, 1)
    _compare(f"{TAG}decode window/softcap", out, lse, ro, rl,
             atol=ATOL_SOFTCAP if softcap else ATOL)


def test_decode_cache_seqlens_as_int():
    b, cap, h, hk, d = 3, 300, 8, 2, 64
    g = gen(31)
    kc, vc = randn(b, cap, hk, d, g=g), randn(b, cap, hk, d, g=g)
    q = randn(b, 1, h, d, g=g)
    a = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=77)
    t = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.full((b,), 77, dtype=I32, device=DEV))
    assert torch.equal(a, t)
    ro, _ = reference(q, kc[:, :77], vc[:, :77], d ** -0.5)
    err = (a.float() - ro).abs().max().item()
    _record(f"out {TAG}kvcache int cache_seqlens", err)
    assert err <= ATOL


# ---------------------------------------------------------------------------------------
# several query tokens per sequence over a paged prefix (flash_attn_varlen_func)

MIXES = {
    # (new query tokens, cached prefix keys): the sequence has prefix + new keys, the new
    # tokens' keys already written to the cache (as an engine does before attention)
    "chunked-prefill": [(37, 0), (37, 1000), (512, 3000), (512, 0), (1, 2500), (64, 17), (37, 2999)],
    "spec-verify": [(2, 100), (5, 2000), (64, 500), (17, 3), (3, 0), (8, 1023), (1, 40)],
}
SHAPES = [  # (head_dim, num_heads, num_kv_heads, page_size)
    (64, 8, 8, 16),
    (112, 16, 4, 32),  # 32-key tiles of 112-wide rows: the copies' partial last round
    (128, 32, 8, 64),
    (256, 8, 1, 128),
]


def _mix_inputs(mix, h, hk, d, page, seed):
    sqs = [n for n, _ in mix]
    sks = [n + p for n, p in mix]
    k_cache, v_cache, bt = paged_cache(sks, page, hk, d, seed=seed)
    q = randn(sum(sqs), h, d, g=gen(seed + 50))
    return sqs, sks, q, k_cache, v_cache, bt


def _varlen_paged_ref(sqs, sks, q, k_cache, v_cache, bt, scale, causal, window=(-1, -1),
                      softcap=0.0):
    cu = [0, *itertools.accumulate(sqs)]
    qs = [q[cu[i]:cu[i + 1]] for i in range(len(sqs))]
    ks = [gather_paged(k_cache, bt, i, n) for i, n in enumerate(sks)]
    vs = [gather_paged(v_cache, bt, i, n) for i, n in enumerate(sks)]
    return reference_seqs(qs, ks, vs, scale, causal, window, softcap)


@pytest.mark.parametrize("d, h, hk, page", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mix", list(MIXES))
def test_varlen_paged_multi_token(mix, causal, d, h, hk, page):
    sqs, sks, q, k_cache, v_cache, bt = _mix_inputs(MIXES[mix], h, hk, d, page, seed=d + page)
    out, lse, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens(sqs), None, max(sqs), max(sks), causal=causal,
        return_attn_probs=True, block_table=bt, seqused_k=i32(sks))
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    ro, rl = _varlen_paged_ref(sqs, sks, q, k_cache, v_cache, bt, d ** -0.5, causal)
    _compare(f"{TAG}varlen paged {mix} d={d}", out, lse, ro, rl)


@pytest.mark.parametrize("window, softcap, causal", [
    ((256, 0), 0.0, True),
    ((100, -1), 0.0, False),
    ((-1, -1), 30.0, True),
    ((64, 0), 30.0, True),
])
def test_varlen_paged_window_and_softcap(window, softcap, causal):
    h, hk, d, page = 8, 2, 128, 32
    sqs, sks, q, k_cache, v_cache, bt = _mix_inputs(MIXES["chunked-prefill"], h, hk, d, page,
                                                    seed=61)
    if softcap:
        q = q * 3
    out, lse, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens(sqs), None, max(sqs), max(sks), causal=causal,
        window_size=window, softcap=softcap, return_attn_probs=True, block_table=bt,
        seqused_k=i32(sks))
    ro, rl = _varlen_paged_ref(sqs, sks, q, k_cache, v_cache, bt, d ** -0.5, causal, window,
                               softcap)
    _compare(f"{TAG}varlen paged window/softcap", out, lse, ro, rl,
             atol=ATOL_SOFTCAP if softcap else ATOL)


# Few rows per kv head (max_seqlen_q x group <= the decode kernel's rows, where the arch
# has one): several tokens of a small group share the decode kernel's 8 columns, so its
# masks see token r // group; the split partials and every decode head dim.
FEW_ROWS = [  # (query tokens per sequence, num_heads, num_kv_heads)
    ([1, 1, 1], 8, 1), ([2, 1, 2], 8, 2), ([4, 3, 1], 8, 4), ([8, 5, 1], 4, 4),
    ([1, 1], 32, 8), ([3, 2], 2, 1)]


@pytest.mark.parametrize("num_splits", [0, 1, 7])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", sorted(set(fa2.COMPILED_HEAD_DIMS) | {40}))
@pytest.mark.parametrize("few", range(len(FEW_ROWS)))
def test_varlen_paged_few_rows(few, d, causal, num_splits):
    sqs, h, hk = FEW_ROWS[few]
    assert max(sqs) * (h // hk) <= DECODE_ROWS
    page = (16, 32, 64)[few % 3]
    sks = [n + p for n, p in zip(sqs, (700, 17, 2049))]
    k_cache, v_cache, bt = paged_cache(sks, page, hk, d, seed=few + d)
    q = randn(sum(sqs), h, d, g=gen(few + d + 1))
    plan = plan_decode(len(sqs), max(sqs), max(sks), h, hk, d, device=q.device,
                       num_splits=num_splits)
    out, lse, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens(sqs), None, max(sqs), max(sks), causal=causal,
        return_attn_probs=True, block_table=bt, seqused_k=i32(sks), scheduler_metadata=plan)
    ro, rl = _varlen_paged_ref(sqs, sks, q, k_cache, v_cache, bt, d ** -0.5, causal)
    _compare(f"{TAG}varlen paged few rows d={d}", out, lse, ro, rl)


@pytest.mark.parametrize("window, softcap, causal", [
    ((256, 0), 0.0, True), ((100, -1), 0.0, False), ((-1, -1), 30.0, True),
    ((64, 0), 30.0, True), ((5, 3), 0.0, False)])
def test_varlen_paged_few_rows_window_and_softcap(window, softcap, causal):
    h, hk, d, page = 8, 4, 128, 16
    sqs = [2, 1, 2]
    sks = [n + p for n, p in zip(sqs, (300, 0, 1500))]
    k_cache, v_cache, bt = paged_cache(sks, page, hk, d, seed=91)
    q = randn(sum(sqs), h, d, g=gen(92)) * (3 if softcap else 1)
    out, lse, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens(sqs), None, max(sqs), max(sks), causal=causal,
        window_size=window, softcap=softcap, return_attn_probs=True, block_table=bt,
        seqused_k=i32(sks),
        scheduler_metadata=plan_decode(3, 2, max(sks), h, hk, d, device=q.device, num_splits=3))
    ro, rl = _varlen_paged_ref(sqs, sks, q, k_cache, v_cache, bt, d ** -0.5, causal, window,
                               softcap)
    _compare(f"{TAG}varlen paged few rows window/softcap", out, lse, ro, rl,
             atol=ATOL_SOFTCAP if softcap else ATOL)


def test_varlen_paged_rows_without_keys():
    """More queries than keys (causal, bottom-right): the first rows see nothing; a
    sequence with no keys at all gives 0 / +inf everywhere."""
    h, hk, d, page = 8, 2, 64, 16
    sqs, sks = [40, 5, 3], [10, 0, 3]
    k_cache, v_cache, bt = paged_cache(sks, page, hk, d, seed=71)
    q = randn(sum(sqs), h, d, g=gen(72))
    out, lse, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens(sqs), None, max(sqs), max(sks), causal=True,
        return_attn_probs=True, block_table=bt, seqused_k=i32(sks))
    ro, rl = _varlen_paged_ref(sqs, sks, q, k_cache, v_cache, bt, d ** -0.5, True)
    _compare(f"{TAG}varlen paged empty rows", out, lse, ro, rl)
    check_empty_rows(out[:30], lse[:, :30])  # sequence 0: rows 0..29 see no key
    check_empty_rows(out[40:45], lse[:, 40:45])  # sequence 1: no keys


def test_varlen_paged_lengths_from_cu_seqlens_k():
    """Without seqused_k the key counts are cu_seqlens_k's differences."""
    h, hk, d, page = 8, 2, 128, 16
    sqs, sks, q, k_cache, v_cache, bt = _mix_inputs(MIXES["spec-verify"], h, hk, d, page, seed=81)
    args = (q, k_cache, v_cache, cu_seqlens(sqs))
    kw = dict(causal=True, return_attn_probs=True, block_table=bt)
    a, la, _ = flash_attn_varlen_func(*args, cu_seqlens(sks), max(sqs), max(sks), **kw)
    b, lb, _ = flash_attn_varlen_func(*args, None, max(sqs), max(sks), seqused_k=i32(sks), **kw)
    assert torch.equal(a, b) and torch.equal(la, lb)
    ro, rl = _varlen_paged_ref(sqs, sks, q, k_cache, v_cache, bt, d ** -0.5, True)
    _compare(f"{TAG}varlen paged cu_seqlens_k", a, la, ro, rl)


# ---------------------------------------------------------------------------------------
# flash_attn_with_kvcache: append new k/v (with rotary) into the cache in place


def _written_mask(cache, rows, positions, bt, page):
    """[cache.shape[0], cache.shape[1]] bool: the slots of `positions` of each row."""
    mask = torch.zeros(cache.shape[:2], dtype=torch.bool, device=DEV)
    for b, pos in enumerate(positions):
        if bt is None:
            mask[rows[b], pos] = True
        else:
            blk, slot = paged_rows(bt, b, pos, page)
            mask[blk, slot] = True
    return mask


def _expected_cache(k_cache, v_cache, k_new, v_new, rows, starts, bt, page, rotary=None):
    """The caches after the append: row `rows[b]` (or the pages of sequence b) gets
    k_new[b] (rotated at its positions when rotary = (cos, sin, interleaved)) and
    v_new[b] at positions starts[b] ..; also returns the written-slot mask."""
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    positions = []
    for b, s in enumerate(starts):
        pos = torch.arange(s, s + k_new.shape[1], device=DEV)
        positions.append(pos)
        kb = k_new[b]
        if rotary is not None:
            cos, sin, interleaved = rotary
            kb = apply_rotary(kb, cos, sin, pos, interleaved).half()
        if bt is None:
            exp_k[rows[b], pos] = kb
            exp_v[rows[b], pos] = v_new[b]
        else:
            blk, slot = paged_rows(bt, b, pos, page)
            exp_k[blk, slot] = kb
            exp_v[blk, slot] = v_new[b]
    return exp_k, exp_v, _written_mask(k_cache, rows, positions, bt, page)


def _check_cache(tag, k_cache, v_cache, exp_k, exp_v, written):
    assert torch.equal(k_cache[~written], exp_k[~written]), f"{tag}: k_cache changed outside the new slots"
    assert torch.equal(v_cache, exp_v), f"{tag}: v_cache differs from the expected append"
    if written.any():
        got, want = k_cache[written].float(), exp_k[written].float()
        _record(f"k_cache {TAG}append (rotary)", (got - want).abs().max().item())
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3,
                                   msg=lambda m: f"{tag}: new keys in the cache: {m}")


def _cache_keys(cache, rows, b, start, end, bt):
    if bt is None:
        return cache[rows[b], start:end]
    return gather_paged(cache, bt, b, end)[start:]


def _append_inputs(layout, b, h, hk, d, cap, page, new, seed):
    """A paged or contiguous cache of cap keys per sequence (bt None when contiguous), q and
    the new k, v of an append."""
    g = gen(seed)
    if layout == "paged":
        k_cache, v_cache, bt = paged_cache([cap] * b, page, hk, d, seed=seed + 1)
    else:
        k_cache, v_cache, bt = randn(b, cap, hk, d, g=g), randn(b, cap, hk, d, g=g), None
    q, k, v = randn(b, new, h, d, g=g), randn(b, new, hk, d, g=g), randn(b, new, hk, d, g=g)
    return k_cache, v_cache, bt, q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("new", [1, 5])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_kvcache_append_with_rotary(layout, new, interleaved, rotary_fraction, causal):
    b, h, hk, d, cap, page = 3, 8, 2, 128, 512, 16
    starts = [0, 200, cap - new]  # an empty cache, a middle, one filled to capacity
    k_cache, v_cache, bt, q, k, v = _append_inputs(layout, b, h, hk, d, cap, page, new, 91)
    rd = int(d * rotary_fraction)
    cos, sin = rotary_tables(cap, rd, seed=93)
    rows = list(range(b))
    exp_k, exp_v, written = _expected_cache(k_cache, v_cache, k, v, rows, starts, bt, page,
                                            rotary=(cos, sin, interleaved))
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=i32(starts),
        block_table=bt, causal=causal, rotary_interleaved=interleaved, return_softmax_lse=True)
    tag = f"append {layout} new={new} interleaved={interleaved} rd={rd} causal={causal}"
    _check_cache(tag, k_cache, v_cache, exp_k, exp_v, written)
    # q is rotated at cache_seqlens + i (causal or local) or all at cache_seqlens (else)
    qs = []
    for i, s in enumerate(starts):
        pos = torch.arange(s, s + new, device=DEV) if causal else torch.full((new,), s, device=DEV)
        qs.append(apply_rotary(q[i], cos, sin, pos, interleaved).half())
    ks = [_cache_keys(exp_k, rows, i, 0, s + new, bt) for i, s in enumerate(starts)]
    vs = [_cache_keys(exp_v, rows, i, 0, s + new, bt) for i, s in enumerate(starts)]
    ro, rl = packed_to_batched(*reference_seqs(qs, ks, vs, d ** -0.5, causal), b, new)
    _compare(f"{TAG}kvcache append+rotary", out, lse, ro, rl)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_kvcache_append_without_rotary_and_splits(layout):
    """Append then attend over long caches with split-KV (auto and 7 splits)."""
    b, h, hk, d, cap, page, new = 2, 16, 4, 64, 8192, 64, 3
    starts = [8000, 1234]
    k_cache, v_cache, bt, q, k, v = _append_inputs(layout, b, h, hk, d, cap, page, new, 101)
    rows = list(range(b))
    for num_splits in (0, 7):
        kc, vc = k_cache.clone(), v_cache.clone()
        exp_k, exp_v, written = _expected_cache(kc, vc, k, v, rows, starts, bt, page)
        out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=i32(starts),
                                      block_table=bt, causal=True, num_splits=num_splits)
        assert torch.equal(kc, exp_k) and torch.equal(vc, exp_v), "append without rotary is a copy"
        ks = [_cache_keys(exp_k, rows, i, 0, s + new, bt) for i, s in enumerate(starts)]
        vs = [_cache_keys(exp_v, rows, i, 0, s + new, bt) for i, s in enumerate(starts)]
        ro, _ = reference_seqs(list(q), ks, vs, d ** -0.5, True)
        err = (out.float() - ro.reshape(out.shape)).abs().max().item()
        _record(f"out {TAG}kvcache append split", err)
        assert err <= ATOL, f"num_splits={num_splits}: max |out - ref| = {err}"


def test_kvcache_cache_batch_idx():
    """cache_batch_idx picks the cache row of each sequence: reads and the append go there;
    the other rows stay untouched."""
    b_cache, h, hk, d, cap, new = 5, 8, 2, 64, 300, 2
    idx, starts = [4, 0, 2], [100, 0, cap - new]
    g = gen(111)
    k_cache, v_cache = randn(b_cache, cap, hk, d, g=g), randn(b_cache, cap, hk, d, g=g)
    q, k, v = randn(3, new, h, d, g=g), randn(3, new, hk, d, g=g), randn(3, new, hk, d, g=g)
    exp_k, exp_v, written = _expected_cache(k_cache, v_cache, k, v, idx, starts, None, 0)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=i32(starts),
                                       cache_batch_idx=i32(idx), causal=True,
                                       return_softmax_lse=True)
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)
    ks = [_cache_keys(exp_k, idx, i, 0, s + new, None) for i, s in enumerate(starts)]
    vs = [_cache_keys(exp_v, idx, i, 0, s + new, None) for i, s in enumerate(starts)]
    ro, rl = packed_to_batched(*reference_seqs(list(q), ks, vs, d ** -0.5, True), 3, new)
    _compare(f"{TAG}kvcache cache_batch_idx", out, lse, ro, rl)


@pytest.mark.parametrize("new", [0, 3])
def test_kvcache_cache_leftpad(new):
    """Keys before cache_leftpad[b] are ignored; cache_seqlens is the absolute end (the
    append writes at cache_seqlens); causal alignment is to the visible keys' end."""
    b, h, hk, d, cap = 3, 8, 2, 64, 400
    leftpad, starts = [0, 10, 100], [50, 60, 300]
    sq = max(new, 1)
    g = gen(121)
    k_cache, v_cache = randn(b, cap, hk, d, g=g), randn(b, cap, hk, d, g=g)
    q = randn(b, sq, h, d, g=g)
    kv = dict(k=randn(b, new, hk, d, g=g), v=randn(b, new, hk, d, g=g)) if new else {}
    rows = list(range(b))
    if new:
        exp_k, exp_v, _ = _expected_cache(k_cache, v_cache, kv["k"], kv["v"], rows, starts, None, 0)
    else:
        exp_k, exp_v = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, **kv, cache_seqlens=i32(starts),
                                       cache_leftpad=i32(leftpad), causal=True,
                                       return_softmax_lse=True)
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)
    ks = [exp_k[i, lp:s + new] for i, (lp, s) in enumerate(zip(leftpad, starts))]
    vs = [exp_v[i, lp:s + new] for i, (lp, s) in enumerate(zip(leftpad, starts))]
    ro, rl = packed_to_batched(*reference_seqs(list(q), ks, vs, d ** -0.5, True), b, sq)
    _compare(f"{TAG}kvcache cache_leftpad", out, lse, ro, rl)


@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("layout", ["paged", "contiguous", "leftpad"])
def test_stale_nan_outside_the_sequences_is_never_used(layout, num_splits):
    """A cache is allocated with torch.empty: the slots past a sequence's end (the tail of
    its last page, unused pages) and before its cache_leftpad may hold NaN. Masked keys
    must not reach the output (0 * NaN is NaN: V rows past the end must not be read into
    P @ V)."""
    lens, h, hk, d, page = [1, 15, 17, 100, 333], 8, 2, 64, 16
    b = len(lens)
    g = gen(131)
    q = randn(b, 1, h, d, g=g)
    kw = {}
    if layout == "paged":
        k_cache, v_cache, bt = paged_cache(lens, page, hk, d, seed=132)
        valid = _written_mask(k_cache, None, [torch.arange(n, device=DEV) for n in lens], bt, page)
        ks = [gather_paged(k_cache, bt, i, n) for i, n in enumerate(lens)]
        vs = [gather_paged(v_cache, bt, i, n) for i, n in enumerate(lens)]
        kw["block_table"] = bt
    else:
        cap = 400
        k_cache, v_cache = randn(b, cap, hk, d, g=g), randn(b, cap, hk, d, g=g)
        lp = [0, 3, 16, 50, 300] if layout == "leftpad" else [0] * b
        valid = torch.zeros(b, cap, dtype=torch.bool, device=DEV)
        for i, (a, n) in enumerate(zip(lp, lens)):
            valid[i, a:n] = True
        ks = [k_cache[i, a:n] for i, (a, n) in enumerate(zip(lp, lens))]
        vs = [v_cache[i, a:n] for i, (a, n) in enumerate(zip(lp, lens))]
        if layout == "leftpad":
            kw["cache_leftpad"] = i32(lp)
    k_cache[~valid] = float("nan")
    v_cache[~valid] = float("nan")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=i32(lens),
                                       causal=True, num_splits=num_splits,
                                       return_softmax_lse=True, **kw)
    ro, rl = packed_to_batched(*reference_seqs(list(q), ks, vs, d ** -0.5, True), b, 1)
    _compare(f"{TAG}stale NaN {layout}", out, lse, ro, rl)


# ---------------------------------------------------------------------------------------
# composition with the core op that fills paged caches


def test_reshape_and_cache_then_paged_attention():
    from sm7x import _core_loader

    if _core_loader.core_library_path() is None:
        pytest.skip(f"{_core_loader.LIBRARY_NAME} (sm7x-core) is not installed")
    from sm7x import ops

    lens, sqs, h, hk, d, page = [50, 130, 7, 1], [1, 5, 7, 1], 8, 2, 128, 16
    b = len(lens)
    g = gen(141)
    keys = [randn(n, hk, d, g=g) for n in lens]
    vals = [randn(n, hk, d, g=g) for n in lens]
    used = [ceil_div(n, page) for n in lens]
    num_blocks = sum(used) + 4
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(142))
    bt = torch.zeros(b, max(used), dtype=I32)
    off = 0
    for i, u in enumerate(used):
        bt[i, :u] = perm[off:off + u].to(I32)
        off += u
    bt = bt.to(DEV)
    slots = [bt[i].long()[torch.arange(n, device=DEV) // page] * page
             + torch.arange(n, device=DEV) % page for i, n in enumerate(lens)]
    pad = 3  # padding tokens, slot -1: skipped
    key = torch.cat(keys + [randn(pad, hk, d, g=g)])
    value = torch.cat(vals + [randn(pad, hk, d, g=g)])
    slot_mapping = torch.cat(slots + [torch.full((pad,), -1, dtype=torch.long, device=DEV)])
    k_cache = torch.zeros(num_blocks, page, hk, d, dtype=F16, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    for i, n in enumerate(lens):  # the cache holds the keys where the FA2 kernels read them
        assert torch.equal(gather_paged(k_cache, bt, i, n), keys[i])
        assert torch.equal(gather_paged(v_cache, bt, i, n), vals[i])
    q = randn(sum(sqs), h, d, g=g)
    out, lse, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens(sqs), None, max(sqs), max(lens), causal=True,
        return_attn_probs=True, block_table=bt, seqused_k=i32(lens))
    cu = [0, *itertools.accumulate(sqs)]
    ro, rl = reference_seqs([q[cu[i]:cu[i + 1]] for i in range(b)], keys, vals, d ** -0.5, True)
    _compare(f"{TAG}reshape_and_cache + paged", out, lse, ro, rl)


# ---------------------------------------------------------------------------------------
# plan_decode and CUDA graphs


class _GraphDecode:
    """Static decode inputs of a CUDA graph: a paged cache, block table and lengths that
    are refilled in place between replays."""

    def __init__(self, api, b=4, h=16, hk=4, d=128, page=32, max_k=4096):
        self.api, self.b, self.h, self.hk, self.d, self.page, self.max_k = api, b, h, hk, d, page, max_k
        self.max_blocks = max_k // page
        self.num_blocks = b * self.max_blocks + 8
        shape = (self.num_blocks, page, hk, d)
        self.k_cache = torch.empty(shape, dtype=F16, device=DEV)
        self.v_cache = torch.empty(shape, dtype=F16, device=DEV)
        self.bt = torch.empty(b, self.max_blocks, dtype=I32, device=DEV)
        self.lens = torch.empty(b, dtype=I32, device=DEV)
        self.q = torch.empty(b, h, d, dtype=F16, device=DEV)
        self.cu_q = cu_seqlens([1] * b)
        self.out = torch.empty_like(self.q)

    def fill(self, seed, lens):
        g = gen(seed)
        self.k_cache.copy_(randn(*self.k_cache.shape, g=g))
        self.v_cache.copy_(randn(*self.v_cache.shape, g=g))
        self.q.copy_(randn(*self.q.shape, g=g))
        perm = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(seed))
        self.bt.copy_(perm[: self.b * self.max_blocks].view(self.b, self.max_blocks).to(I32))
        self.lens.copy_(i32(lens))
        self.host_lens = list(lens)

    def call(self, plan, out=None):
        if self.api == "varlen":
            return flash_attn_varlen_func(
                self.q, self.k_cache, self.v_cache, self.cu_q, None, 1, self.max_k, causal=True,
                block_table=self.bt, seqused_k=self.lens, out=out, scheduler_metadata=plan)
        o = flash_attn_with_kvcache(self.q[:, None], self.k_cache, self.v_cache,
                                    cache_seqlens=self.lens, block_table=self.bt, causal=True,
                                    scheduler_metadata=plan)
        if out is not None:
            out.copy_(o[:, 0])
            return out
        return o[:, 0]

    def reference(self):
        ks = [gather_paged(self.k_cache, self.bt, i, n) for i, n in enumerate(self.host_lens)]
        vs = [gather_paged(self.v_cache, self.bt, i, n) for i, n in enumerate(self.host_lens)]
        ro, _ = reference_seqs(list(self.q[:, None]), ks, vs, self.d ** -0.5, True)
        return ro


@pytest.mark.parametrize("api", ["varlen", "kvcache"])
def test_cuda_graph_decode_with_plan(api):
    """Capture a decode call that gets a plan_decode plan, then replay it after refilling
    the cache, block table, lengths and q in place: first with shorter lengths than at
    capture (one sequence empty), then with lengths up to the plan's max_seqlen_k. A
    replay must equal an eager call with the same plan and match the reference."""
    s = _GraphDecode(api)
    s.fill(0, [4096, 100, 3000, 1])
    plan = plan_decode(s.b, 1, s.max_k, s.h, s.hk, s.d, device=s.q.device)
    graph, graph_out = capture(lambda: s.call(plan, out=s.out if api == "varlen" else None))
    for seed, lens in ((1, [17, 0, 2999, 1]), (2, [4096, 4095, 1, 333])):
        s.fill(seed, lens)
        graph.replay()
        torch.cuda.synchronize()
        got = graph_out.clone()
        ref = s.reference()
        err = (got.float() - ref).abs().max().item()
        _record(f"out {TAG}graph decode replay", err)
        assert err <= ATOL, f"replay with lengths {lens}: max |out - ref| = {err}"
        assert torch.equal(got, s.call(plan)), f"replay with lengths {lens} != eager call with the plan"
        eager = s.call(None)  # no plan: its own split, same result within rounding
        assert (eager.float() - ref).abs().max().item() <= ATOL
        if 0 in lens:
            check_empty_rows(got[lens.index(0)])


def test_cuda_graph_capture_without_plan_works_or_refuses_clearly():
    s = _GraphDecode("varlen", b=2, h=8, hk=2, d=64, page=16, max_k=512)
    s.fill(0, [300, 7])
    s.call(None)  # loads the library
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=side):
            out = s.call(None, out=s.out)
    except (RuntimeError, ValueError) as exc:
        assert re.search(r"plan_decode|scheduler_metadata", str(exc)), (
            f"capture without a plan failed without saying to pass one: {exc}")
    else:
        s.fill(1, [512, 1])
        graph.replay()
        torch.cuda.synchronize()
        err = (out.float() - s.reference()).abs().max().item()
        assert err <= ATOL, f"replay of a capture without a plan: max |out - ref| = {err}"
    # the device is still usable afterwards
    torch.cuda.synchronize()
    s.fill(2, [100, 200])
    assert (s.call(None).float() - s.reference()).abs().max().item() <= ATOL


def test_plan_shape_mismatch_raises():
    b, h, hk, d, page = 4, 8, 2, 128, 16
    lens = [100, 7, 64, 1]
    # 64 block-table columns: the cache holds the plan's max_seqlen_k (1024) per sequence
    k_cache, v_cache, bt = paged_cache(lens, page, hk, d, seed=151, max_blocks=64)
    plan = plan_decode(b, 1, 1024, h, hk, d, device=torch.device(DEV))
    g = gen(152)

    def call(q, bt=bt, lens=lens, max_q=1, cache=(k_cache, v_cache), cu=None):
        n = len(lens)
        return flash_attn_varlen_func(
            q, *cache, cu if cu is not None else cu_seqlens([1] * n), None, max_q, 1024,
            block_table=bt, seqused_k=i32(lens), scheduler_metadata=plan)

    call(randn(b, h, d, g=g))  # matches the plan
    match = r"scheduler_metadata|plan"
    with pytest.raises(ValueError, match=match):  # batch
        call(randn(b - 1, h, d, g=g), bt=bt[:-1], lens=lens[:-1])
    with pytest.raises(ValueError, match=match):  # num_heads
        call(randn(b, 2 * h, d, g=g))
    with pytest.raises(ValueError, match=match):  # num_kv_heads
        call(randn(b, h, d, g=g), cache=(k_cache[:, :, :1], v_cache[:, :, :1]))
    with pytest.raises(ValueError, match=match):  # head_dim
        call(randn(b, h, 64, g=g), cache=(k_cache[..., :64].contiguous(), v_cache[..., :64].contiguous()))
    with pytest.raises(ValueError, match=match):  # max_seqlen_q (plan for decode, 2 queries each)
        call(randn(2 * b, h, d, g=g), max_q=2, cu=cu_seqlens([2] * b))
    q4 = randn(b, 1, h, d, g=g)  # the kvcache path checks the plan too
    flash_attn_with_kvcache(q4, k_cache, v_cache, cache_seqlens=i32(lens), block_table=bt,
                            scheduler_metadata=plan)
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(q4[:-1], k_cache, v_cache, cache_seqlens=i32(lens[:-1]),
                                block_table=bt[:-1], scheduler_metadata=plan)
    # a plan is made for one cache format: the kernel of each fills the GPU differently
    with pytest.raises(ValueError, match=r"kv_cache_dtype: plan 'float16', call 'fp8_e5m2'"):
        flash_attn_with_kvcache(q4, k_cache.to(torch.float8_e5m2), v_cache.to(torch.float8_e5m2),
                                cache_seqlens=i32(lens), block_table=bt, scheduler_metadata=plan)


def test_plan_max_seqlen_k_smaller_than_the_call_raises():
    b, h, hk, d, page = 2, 8, 2, 64, 16
    k_cache, v_cache, bt = paged_cache([100, 2000], page, hk, d, seed=161)
    plan = plan_decode(b, 1, 1024, h, hk, d, device=torch.device(DEV))
    q = randn(b, h, d, g=gen(162))
    with pytest.raises(ValueError, match=r"max_seqlen_k|scheduler_metadata|plan"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens([1] * b), None, 1, 2000,
                               block_table=bt, seqused_k=i32([100, 2000]),
                               scheduler_metadata=plan)


# ---------------------------------------------------------------------------------------
# bad device-side values: rejected with the argument's name, nothing corrupted after


def _small_paged(seed=171):
    """Two sequences of 40 and 100 keys in pages of 16; the block table has 10 columns
    (3 and 7 of them used): capacity 160 keys."""
    lens, h, hk, d, page = [40, 100], 8, 2, 64, 16
    k_cache, v_cache, bt = paged_cache(lens, page, hk, d, seed=seed, max_blocks=10)
    q = randn(len(lens), 1, h, d, g=gen(seed + 1))
    return lens, page, k_cache, v_cache, bt, q


def _decode_ref(q, k_cache, v_cache, bt, lens):
    ks = [gather_paged(k_cache, bt, i, n) for i, n in enumerate(lens)]
    vs = [gather_paged(v_cache, bt, i, n) for i, n in enumerate(lens)]
    ro, _ = reference_seqs(list(q), ks, vs, q.shape[-1] ** -0.5, True)
    return ro.reshape(q.shape)


def _paged_decode(api, q, k_cache, v_cache, bt, lens, max_k=None):
    lens_t = lens if isinstance(lens, torch.Tensor) else i32(lens)
    if api == "varlen":
        b = q.shape[0]
        max_k = max_k if max_k is not None else int(lens_t.max())
        return flash_attn_varlen_func(q[:, 0], k_cache, v_cache, cu_seqlens([1] * b), None, 1,
                                      max_k, causal=True, block_table=bt,
                                      seqused_k=lens_t)[:, None]
    return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens_t, block_table=bt,
                                   causal=True)


def _still_correct(api, q, k_cache, v_cache, bt, lens):
    torch.cuda.synchronize()  # an out-of-bounds access would surface here
    out = _paged_decode(api, q, k_cache, v_cache, bt, lens)
    err = (out.float() - _decode_ref(q, k_cache, v_cache, bt, lens)).abs().max().item()
    assert err <= ATOL, f"a valid call after a rejected one: max |out - ref| = {err}"


@pytest.mark.parametrize("api", ["varlen", "kvcache"])
@pytest.mark.parametrize("bad", ["negative", "num_blocks", "huge"])
def test_block_table_entry_out_of_range_raises(api, bad):
    lens, page, k_cache, v_cache, bt, q = _small_paged()
    num_blocks = k_cache.shape[0]
    value = {"negative": -1, "num_blocks": num_blocks, "huge": 2**31 - 1}[bad]
    broken = bt.clone()
    broken[1, 3] = value  # keys 48..63 of sequence 1 (100 keys): a used page
    with pytest.raises(VALUE_ERRORS, match="block_table"):
        _paged_decode(api, q, k_cache, v_cache, broken, lens)
    _still_correct(api, q, k_cache, v_cache, bt, lens)


@pytest.mark.parametrize("api", ["varlen", "kvcache"])
def test_bad_entry_anywhere_in_a_long_block_table_raises(api):
    """A 70,000-key sequence uses 4,375 pages: the check reads them in slices of the table,
    several entries per thread (csrc/fa2/serving.cu validate_kernel); a bad entry in the
    first, a middle or the last used page of any slice is found and named."""
    lens, page = [3000, 70000], 16
    k_cache, v_cache, bt = paged_cache(lens, page, 1, 64, seed=191)
    q = randn(len(lens), 1, 4, 64, g=gen(192))
    used = ceil_div(lens[1], page)
    for j in (0, 255, 256, 1023, 1024, 2047, 3000, used - 1):
        broken = bt.clone()
        broken[1, j] = k_cache.shape[0]
        with pytest.raises(VALUE_ERRORS, match=rf"block_table\[1, {j}\] = {k_cache.shape[0]}"):
            _paged_decode(api, q, k_cache, v_cache, broken, lens)
    _still_correct(api, q, k_cache, v_cache, bt, lens)


@pytest.mark.parametrize("api", ["varlen", "kvcache"])
def test_input_checks_off_clamp_instead_of_raising(api):
    """With sm7x.fa2.set_input_checks(False) (engines that build block tables themselves)
    a bad entry is not refused: the kernels clamp it, so the call finishes with finite
    output and no out-of-bounds access (compute-sanitizer: tests/gpu/sanitize.sh), and a
    valid call afterwards is right; turned on again, the same call raises."""
    lens, page, k_cache, v_cache, bt, q = _small_paged(seed=177)
    broken = bt.clone()
    broken[1, 3] = 2**31 - 1
    assert fa2.input_checks()
    fa2.set_input_checks(False)
    try:
        out = _paged_decode(api, q, k_cache, v_cache, broken, lens)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        _still_correct(api, q, k_cache, v_cache, bt, lens)
    finally:
        fa2.set_input_checks(True)
    with pytest.raises(VALUE_ERRORS, match="block_table"):
        _paged_decode(api, q, k_cache, v_cache, broken, lens)


@pytest.mark.parametrize("api", ["varlen", "kvcache"])
def test_block_table_entries_past_the_used_pages_are_not_checked(api):
    """Entries for pages past a sequence's length are padding (-1 or anything): not read,
    not rejected."""
    lens, page, k_cache, v_cache, bt, q = _small_paged(seed=181)
    padded = bt.clone()
    padded[0, ceil_div(lens[0], page):] = -1
    padded[1, ceil_div(lens[1], page):] = 2**31 - 1
    out = _paged_decode(api, q, k_cache, v_cache, padded, lens)
    err = (out.float() - _decode_ref(q, k_cache, v_cache, bt, lens)).abs().max().item()
    _record(f"out {TAG}padded block_table", err)
    assert err <= ATOL


@pytest.mark.parametrize("api", ["varlen", "kvcache"])
def test_key_count_beyond_the_cache_raises(api):
    """More keys than max_blocks * page_size: seqused_k (varlen) / cache_seqlens (kvcache).
    max_seqlen_k stays a legal bound (the capacity): the device value is what is wrong."""
    lens, page, k_cache, v_cache, bt, q = _small_paged(seed=191)
    capacity = bt.shape[1] * page
    name = "seqused_k" if api == "varlen" else "cache_seqlens"
    with pytest.raises(VALUE_ERRORS, match=name):
        _paged_decode(api, q, k_cache, v_cache, bt, [lens[0], capacity + 1], max_k=capacity)
    _still_correct(api, q, k_cache, v_cache, bt, lens)


def test_kvcache_cache_seqlens_beyond_contiguous_capacity_raises():
    b, h, hk, d, cap = 2, 8, 2, 64, 128
    g = gen(201)
    k_cache, v_cache = randn(b, cap, hk, d, g=g), randn(b, cap, hk, d, g=g)
    q = randn(b, 1, h, d, g=g)
    with pytest.raises(VALUE_ERRORS, match="cache_seqlens"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=i32([10, cap + 1]))
    # with an append: cache_seqlens + seqlen_new > capacity would write past the row
    k, v = randn(b, 2, hk, d, g=g), randn(b, 2, hk, d, g=g)
    k0, v0 = k_cache.clone(), v_cache.clone()
    with pytest.raises(VALUE_ERRORS, match="cache_seqlens"):
        flash_attn_with_kvcache(randn(b, 2, h, d, g=g), k_cache, v_cache, k, v,
                                cache_seqlens=i32([10, cap - 1]), causal=True)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0), "a rejected append wrote the cache"
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=i32([10, cap]))
    ro, _ = reference_seqs(list(q), [k_cache[0, :10], k_cache[1]], [v_cache[0, :10], v_cache[1]],
                           d ** -0.5)
    assert (out.float() - ro.reshape(out.shape)).abs().max().item() <= ATOL


@pytest.mark.parametrize("bad, message", [
    ([1, 2, 3], "cu_seqlens_q"),  # does not start at 0
    ([0, 1, 3], "cu_seqlens_q"),  # ends past total_q (2 tokens)
])
def test_varlen_paged_inconsistent_cu_seqlens_q_raises(bad, message):
    lens, page, k_cache, v_cache, bt, q = _small_paged(seed=211)
    with pytest.raises(VALUE_ERRORS, match=message):
        flash_attn_varlen_func(q[:, 0], k_cache, v_cache, i32(bad), None, 2, max(lens),
                               block_table=bt, seqused_k=i32(lens))
    _still_correct("varlen", q, k_cache, v_cache, bt, lens)


def _fwd_serving(ops, *, q, k_cache, v_cache, out, lse, cu_seqlens_q, seqused_k, block_table,
                 max_seqlen_q, max_seqlen_k, softmax_scale, causal=True):
    """Calls the library's fwd_serving op directly (csrc/fa2/ops.cpp), one partition per
    sequence (no split), so the op's own checks are what is tested."""
    batch = block_table.shape[0]
    partitions = torch.tensor([[i, 0, max_seqlen_k] for i in range(batch)], dtype=I32, device=DEV)
    split_offsets = torch.arange(batch + 1, dtype=I32, device=DEV)
    empty = torch.empty(0, dtype=torch.float32, device=DEV)
    return ops.fwd_serving(q, k_cache, v_cache, out, lse, cu_seqlens_q, seqused_k, None,
                           block_table, None, None, partitions, split_offsets, empty, empty,
                           max_seqlen_q, max_seqlen_k, 0, softmax_scale, causal, -1, -1, 0.0,
                           0, None, None)


def check_direct_op_rejects(ops):
    """The op itself (not only the Python API) rejects a block_table entry outside
    [0, num_blocks) for a used page and a key count past the cache, naming the argument;
    a valid call through the same mapping matches the reference."""
    lens, page, k_cache, v_cache, bt, q4 = _small_paged(seed=221)
    b, _, h, d = q4.shape
    q = q4[:, 0].contiguous()

    def run(block_table=bt, seqused=lens):
        out = torch.zeros_like(q)
        lse = torch.empty(h, b, dtype=torch.float32, device=DEV)
        _fwd_serving(ops, q=q, k_cache=k_cache, v_cache=v_cache, out=out, lse=lse,
                   cu_seqlens_q=cu_seqlens([1] * b), seqused_k=i32(seqused), block_table=block_table,
                   max_seqlen_q=1, max_seqlen_k=max(seqused), softmax_scale=d ** -0.5)
        return out

    out = run()
    err = (out.float() - _decode_ref(q4, k_cache, v_cache, bt, lens)[:, 0]).abs().max().item()
    assert err <= ATOL, f"direct fwd_serving call: max |out - ref| = {err}"
    for value in (-1, k_cache.shape[0]):
        broken = bt.clone()
        broken[1, 3] = value
        with pytest.raises(RuntimeError, match="block_table"):
            run(block_table=broken)
    with pytest.raises(RuntimeError, match="seqused_k"):
        run(seqused=[lens[0], bt.shape[1] * page + 1])
    torch.cuda.synchronize()
    assert torch.equal(run(), out)


def test_direct_op_rejects_bad_device_values():
    lens, page, k_cache, v_cache, bt, q = _small_paged()
    _paged_decode("varlen", q, k_cache, v_cache, bt, lens)  # loads the library
    ops = fa2._ops_for(q)
    assert f"sm7x_fa2_{ARCH}" in str(ops), ops
    check_direct_op_rejects(ops)


# ---------------------------------------------------------------------------------------
# autograd inputs: the serving paths are inference-only (flash_attn_func and the non-paged
# flash_attn_varlen_func are differentiable: tests/gpu/test_fa2_backward.py)


FORWARD_ONLY = (RuntimeError, NotImplementedError, ValueError)


def needs_grad(t):
    return t.detach().clone().requires_grad_(True)


def test_requires_grad_inputs_raise():
    g = gen(231)
    lens, page, k_cache, v_cache, bt, qd = _small_paged(seed=232)
    with pytest.raises(FORWARD_ONLY, match="forward"):
        flash_attn_varlen_func(needs_grad(qd[:, 0]), k_cache, v_cache, cu_seqlens([1, 1]),
                               None, 1, max(lens), block_table=bt, seqused_k=i32(lens))
    with pytest.raises(FORWARD_ONLY, match="forward"):
        flash_attn_with_kvcache(needs_grad(qd), k_cache, v_cache, cache_seqlens=i32(lens),
                                block_table=bt)
    kn = randn(2, 1, 2, 64, g=g)
    with pytest.raises(FORWARD_ONLY, match="forward"):
        flash_attn_with_kvcache(qd, k_cache, v_cache, needs_grad(kn), kn,
                                cache_seqlens=i32(lens), block_table=bt)


def test_kvcache_rotary_table_too_short_for_the_new_keys_raises():
    """Non-causal q is rotated at cache_seqlens alone, but the new keys at cache_seqlens ..
    + seqlen_new - 1: a table that covers q but not the keys is refused, cache untouched."""
    b, h, hk, d, cap, new = 2, 8, 2, 64, 128, 5
    g = gen(301)
    k_cache, v_cache = randn(b, cap, hk, d, g=g), randn(b, cap, hk, d, g=g)
    before = k_cache.clone()
    q, k, v = randn(b, 1, h, d, g=g), randn(b, new, hk, d, g=g), randn(b, new, hk, d, g=g)
    cos, sin = rotary_tables(32, d, seed=302)
    with pytest.raises(ValueError, match="rotary_cos has 32 positions"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin,
                                cache_seqlens=torch.tensor([30, 0], dtype=I32, device=DEV),
                                causal=False)
    assert torch.equal(k_cache, before)


# flash_attn_func with few query rows per kv head (a model that keeps its own cache and
# calls the dense API) runs on the serving kernel: (seqlen_q, num_heads, num_kv_heads), up
# to 64 rows per kv head; the dims of every compiled kernel and two that run padded.
DENSE_ROWS = [(1, 8, 8), (1, 32, 8), (1, 16, 1), (2, 16, 2), (5, 12, 4), (8, 64, 8), (64, 4, 4)]
DENSE_MASKS = [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (True, (100, 0), 0.0),
               (False, (37, 5), 0.0), (False, (-1, -1), 30.0)]


def _spy(monkeypatch, name: str = "dense") -> list:
    """The shapes of q in the calls of sm7x.fa2._serving.<name> from now on."""
    from sm7x.fa2 import _serving

    calls, real = [], getattr(_serving, name)
    monkeypatch.setattr(_serving, name, lambda *a: (calls.append(a[2].shape), real(*a))[1])
    return calls


def _check_both_kernels(monkeypatch, what, call, ref, softcap) -> None:
    """call() (out, lse, _) against the float32 reference ref, and its output against the
    same call kept on the prefill kernel (SM7X_FA2_DENSE=prefill)."""
    out, lse, _ = call()
    monkeypatch.setenv("SM7X_FA2_DENSE", "prefill")
    prefill = call()[0]
    monkeypatch.delenv("SM7X_FA2_DENSE")
    _compare(f"{TAG}{what}", out, lse, *ref, atol=ATOL_SOFTCAP if softcap else ATOL)
    assert (out.float() - prefill.float()).abs().max().item() <= 2 * ATOL, what


@pytest.mark.parametrize("d", sorted(set(fa2.COMPILED_HEAD_DIMS) | {40, 72}))
@pytest.mark.parametrize("sq,h,hk", DENSE_ROWS)
def test_dense_few_rows_run_the_serving_kernel(sq, h, hk, d, monkeypatch):
    """Against the float32 reference and against the same call on the prefill kernel
    (SM7X_FA2_DENSE=prefill), over masks, windows and softcap; keys not a tile multiple."""
    calls = _spy(monkeypatch)
    for i, (causal, window, softcap) in enumerate(DENSE_MASKS):
        b, sk, g = 3, 1000 + 37 * i, gen(400 + i)
        q, k, v = (randn(b, n, heads, d, g=g) for n, heads in ((sq, h), (sk, hk), (sk, hk)))
        kw = dict(causal=causal, window_size=window, softcap=softcap, return_attn_probs=True)
        _check_both_kernels(monkeypatch, f"dense few rows sq={sq} {h}/{hk} d={d} {kw}",
                            lambda: fa2.flash_attn_func(q, k, v, **kw),
                            reference(q, k, v, d ** -0.5, causal, window, softcap), softcap)
    assert len(calls) == len(DENSE_MASKS), "the few-rows calls did not reach the serving kernel"


@pytest.mark.parametrize("d", sorted(set(fa2.COMPILED_HEAD_DIMS) | {40}))
@pytest.mark.parametrize("h,hk", [(8, 8), (32, 8), (16, 1)])
def test_dense_varlen_few_rows_run_the_serving_kernel(h, hk, d, monkeypatch):
    """flash_attn_varlen_func with 1-4 queries per sequence over 0-2000 keys (one sequence
    without keys, one with fewer keys than queries) against the float32 reference and
    against the prefill kernel, over masks, windows and softcap."""
    calls = _spy(monkeypatch, "dense_varlen")
    for i, (causal, window, softcap) in enumerate(DENSE_MASKS):
        lq = [1, 4, 2, 1, 3]
        lk = [0, 3, 2000, 777, 1 + 61 * i]
        g = gen(470 + i)
        qs = [randn(n, h, d, g=g) for n in lq]
        ks, vs = ([randn(n, hk, d, g=g) for n in lk] for _ in range(2))
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        args = (q, k, v, cu_seqlens(lq), cu_seqlens(lk), max(lq), max(lk))
        kw = dict(causal=causal, window_size=window, softcap=softcap, return_attn_probs=True)
        _check_both_kernels(monkeypatch, f"dense varlen few rows {h}/{hk} d={d} {kw}",
                            lambda: fa2.flash_attn_varlen_func(*args, **kw),
                            reference_seqs(qs, ks, vs, d ** -0.5, causal, window, softcap),
                            softcap)
    assert len(calls) == len(DENSE_MASKS), "the few-rows calls did not reach the serving kernel"


def test_dense_calls_that_stay_on_the_prefill_kernel(monkeypatch):
    """More than 64 rows per kv head, no more keys than queries, and calls that need grad
    keep the prefill kernel (the serving kernel is forward-only); results still right."""
    calls = _spy(monkeypatch)
    for sq, sk, h, hk, grad in ((65, 500, 4, 4, False), (9, 500, 64, 8, False),
                                (16, 16, 8, 8, False), (1, 500, 8, 8, True)):
        g = gen(450)
        q, k, v = (randn(2, n, heads, 64, g=g) for n, heads in ((sq, h), (sk, hk), (sk, hk)))
        if grad:
            q.requires_grad_(True)
        out = fa2.flash_attn_func(q, k, v, causal=True)
        ro, _ = reference(q.detach(), k, v, 64 ** -0.5, True)
        assert (out.detach().float() - ro).abs().max().item() <= ATOL, (sq, sk, h, hk, grad)
    assert calls == []


def test_zz_report_worst_errors():
    report_worst(f" (serving, {ARCH})")
