"""sm7x.fa2's serving API without a GPU: the argument errors of flash_attn_varlen_func with
a paged cache (block_table, seqused_k, out, scheduler_metadata), of flash_attn_with_kvcache
and of plan_decode, and the refusal of autograd inputs (the serving paths are
inference-only). All are raised before any library is loaded, so they are tested with CPU
tensors: each must be its own error, not the generic "inputs are on cpu; sm7x FA2 runs on
CUDA tensors only" that a valid call on CPU tensors ends with (test_valid_calls_reach_the_cuda_check shows the base inputs are
valid)."""

from __future__ import annotations

import contextlib
import re

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x.fa2 needs torch >= {torch_min()}")

import sm7x.fa2 as fa2  # noqa: E402
from sm7x.fa2 import (  # noqa: E402
    _loader, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, plan_decode)

F16, I32 = torch.float16, torch.int32
CPU_ERROR = "CUDA tensors only"  # the message of a valid call on CPU tensors
FORWARD_ONLY = (RuntimeError, NotImplementedError, ValueError)
SHAPE_ERRORS = (ValueError, TypeError)


@pytest.fixture(autouse=True)
def no_load(monkeypatch):
    """Any attempt to load a library fails the test: validation must come first."""
    def boom(*a, **kw):
        raise AssertionError("a library was loaded before validation finished")
    monkeypatch.setattr(_loader, "load", boom)


@contextlib.contextmanager
def raises(exc, match):
    """pytest.raises, and the error is not the generic CPU-tensor refusal."""
    with pytest.raises(exc, match=match) as info:
        yield info
    assert CPU_ERROR not in str(info.value), f"the specific check did not run first: {info.value}"


def grad(t):
    return t.detach().clone().requires_grad_(True)


# ---------------------------------------------------------------------------------------
# base inputs (valid except for the device)


def paged_varlen(b=2, sq=1, h=8, hk=2, d=64, page=16, num_blocks=8, max_blocks=4):
    """kwargs of a valid paged flash_attn_varlen_func call: b sequences of sq queries."""
    return dict(
        q=torch.zeros(b * sq, h, d, dtype=F16),
        k=torch.zeros(num_blocks, page, hk, d, dtype=F16),
        v=torch.zeros(num_blocks, page, hk, d, dtype=F16),
        cu_seqlens_q=torch.arange(0, b * sq + 1, sq, dtype=I32),
        cu_seqlens_k=None, max_seqlen_q=sq, max_seqlen_k=max_blocks * page,
        block_table=torch.zeros(b, max_blocks, dtype=I32),
        seqused_k=torch.full((b,), 10, dtype=I32),
    )


def call_varlen(**changes):
    kw = paged_varlen()
    kw.update(changes)
    return flash_attn_varlen_func(**kw)


def kvcache(layout="paged", b=2, sq=1, h=8, hk=2, d=64, page=16, num_blocks=8, max_blocks=4,
            seqlen_cache=64):
    """kwargs of a valid flash_attn_with_kvcache call (paged or contiguous cache)."""
    if layout == "paged":
        shape, bt = (num_blocks, page, hk, d), torch.zeros(b, max_blocks, dtype=I32)
    else:
        shape, bt = (b, seqlen_cache, hk, d), None
    return dict(q=torch.zeros(b, sq, h, d, dtype=F16), k_cache=torch.zeros(shape, dtype=F16),
                v_cache=torch.zeros(shape, dtype=F16), block_table=bt,
                cache_seqlens=torch.full((b,), 10, dtype=I32))


def call_kvcache(layout="paged", **changes):
    kw = kvcache(layout)
    kw.update(changes)
    return flash_attn_with_kvcache(**kw)


def new_kv(b=2, n=1, hk=2, d=64):
    return torch.zeros(b, n, hk, d, dtype=F16), torch.zeros(b, n, hk, d, dtype=F16)


def rotary(rotary_dim=64, seqlen_ro=64):
    return (torch.ones(seqlen_ro, rotary_dim // 2, dtype=F16),
            torch.zeros(seqlen_ro, rotary_dim // 2, dtype=F16))


def test_serving_api_is_exported():
    for name in ("flash_attn_with_kvcache", "plan_decode"):
        assert name in fa2.__all__, name
    assert hasattr(fa2, "DecodePlan")


def test_valid_calls_reach_the_cuda_check():
    """The base inputs pass every check but the device one (so the error tests below
    test one fault each)."""
    cases = [
        lambda: call_varlen(),
        lambda: call_varlen(out=torch.empty(2, 8, 64, dtype=F16)),
        lambda: call_varlen(q=torch.zeros(7, 8, 64, dtype=F16),  # 3 + 4 queries, causal
                            cu_seqlens_q=torch.tensor([0, 3, 7], dtype=I32), max_seqlen_q=4,
                            causal=True, window_size=(256, 0), softcap=30.0),
        # lengths from cu_seqlens_k: its offsets do not index the paged k, so its last entry
        # need not be k.shape[0]
        lambda: call_varlen(seqused_k=None, cu_seqlens_k=torch.tensor([0, 10, 30], dtype=I32)),
        lambda: call_kvcache("paged"),
        lambda: call_kvcache("contiguous"),
        # 8-bit caches: float8 dtypes, or uint8 with vLLM's format name; descales
        lambda: call_varlen(k=torch.zeros(8, 16, 2, 64, dtype=torch.float8_e4m3fn),
                            v=torch.zeros(8, 16, 2, 64, dtype=torch.float8_e4m3fn),
                            k_descale=torch.ones(()), v_descale=torch.ones(2, 2)),
        lambda: call_varlen(k=torch.zeros(8, 16, 2, 64, dtype=torch.uint8),
                            v=torch.zeros(8, 16, 2, 64, dtype=torch.uint8), kv_cache_dtype="fp8"),
        lambda: call_kvcache("contiguous", k_cache=torch.zeros(2, 64, 2, 64, dtype=torch.float8_e5m2),
                             v_cache=torch.zeros(2, 64, 2, 64, dtype=torch.float8_e5m2),
                             k_descale=torch.ones(1)),
        lambda: call_kvcache("paged", cache_seqlens=10),
        lambda: call_kvcache("contiguous", cache_batch_idx=torch.tensor([1, 0], dtype=I32),
                             cache_leftpad=torch.zeros(2, dtype=I32)),
        lambda: call_kvcache("paged", q=torch.zeros(2, 5, 8, 64, dtype=F16), causal=True,
                             num_splits=3, return_softmax_lse=True),
    ]
    for layout in ("paged", "contiguous"):
        for rd in (64, 32):
            cos, sin = rotary(rd)
            cases.append(lambda layout=layout, cos=cos, sin=sin: call_kvcache(
                layout, **dict(zip("kv", new_kv(n=3))), q=torch.zeros(2, 3, 8, 64, dtype=F16),
                rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False, causal=True))
    for i, case in enumerate(cases):
        with pytest.raises(ValueError, match=CPU_ERROR):
            case()


# ---------------------------------------------------------------------------------------
# flash_attn_varlen_func with a paged cache


VARLEN_CASES = [
    ("block_table int64", dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), SHAPE_ERRORS, "block_table"),
    ("block_table float", dict(block_table=torch.zeros(2, 4)), SHAPE_ERRORS, "block_table"),
    ("block_table 1-D", dict(block_table=torch.zeros(4, dtype=I32)), SHAPE_ERRORS, "block_table"),
    ("block_table 3-D", dict(block_table=torch.zeros(2, 4, 1, dtype=I32)), SHAPE_ERRORS, "block_table"),
    ("block_table batch", dict(block_table=torch.zeros(3, 4, dtype=I32)), SHAPE_ERRORS, "block_table"),
    ("cache 3-D", dict(k=torch.zeros(8 * 16, 2, 64, dtype=F16), v=torch.zeros(8 * 16, 2, 64, dtype=F16)),
     SHAPE_ERRORS, "4-D"),
    ("page_size 48", dict(k=torch.zeros(8, 48, 2, 64, dtype=F16), v=torch.zeros(8, 48, 2, 64, dtype=F16)),
     ValueError, "page_size"),
    ("page_size 24", dict(k=torch.zeros(8, 24, 2, 64, dtype=F16), v=torch.zeros(8, 24, 2, 64, dtype=F16)),
     ValueError, "page_size"),
    ("seqused_k batch + 1", dict(seqused_k=torch.full((3,), 10, dtype=I32)), SHAPE_ERRORS, "seqused_k"),
    ("seqused_k 2-D", dict(seqused_k=torch.full((2, 1), 10, dtype=I32)), SHAPE_ERRORS, "seqused_k"),
    ("seqused_k int64", dict(seqused_k=torch.full((2,), 10, dtype=torch.int64)), SHAPE_ERRORS, "seqused_k"),
    ("no key lengths", dict(seqused_k=None, cu_seqlens_k=None), SHAPE_ERRORS, "seqused_k|cu_seqlens_k"),
    ("cache dtype", dict(k=torch.zeros(8, 16, 2, 64), v=torch.zeros(8, 16, 2, 64)), TypeError,
     "a KV cache is float16, float8_e4m3fn, float8_e5m2 or int8"),
    ("k and v caches differ", dict(v=torch.zeros(9, 16, 2, 64, dtype=F16)), ValueError, "same shape"),
    ("k fp8, v fp16", dict(k=torch.zeros(8, 16, 2, 64, dtype=torch.float8_e4m3fn)), ValueError,
     "same shape and dtype"),
    ("uint8 cache, no format", dict(k=torch.zeros(8, 16, 2, 64, dtype=torch.uint8),
                                    v=torch.zeros(8, 16, 2, 64, dtype=torch.uint8)),
     ValueError, "kv_cache_dtype='fp8_e4m3'"),
    ("kv_cache_dtype unknown", dict(k=torch.zeros(8, 16, 2, 64, dtype=torch.uint8),
                                    v=torch.zeros(8, 16, 2, 64, dtype=torch.uint8),
                                    kv_cache_dtype="int4"), ValueError, "kv_cache_dtype 'int4'"),
    ("descale on a float16 cache", dict(k_descale=torch.ones(())), ValueError,
     "applies to an 8-bit cache"),
    ("descale not a tensor", dict(k=torch.zeros(8, 16, 2, 64, dtype=torch.float8_e5m2),
                                  v=torch.zeros(8, 16, 2, 64, dtype=torch.float8_e5m2),
                                  v_descale=0.5), TypeError, "v_descale must be a float32"),
    ("scale caches on a float16 cache", dict(k_scale_cache=torch.ones(8, 16, 2),
                                              v_scale_cache=torch.ones(8, 16, 2)),
     ValueError, "belong to an int8 cache .* an fp8 cache takes k_descale"),
    ("int8 cache without scale caches", dict(k=torch.zeros(8, 16, 2, 64, dtype=torch.int8),
                                             v=torch.zeros(8, 16, 2, 64, dtype=torch.int8)),
     ValueError, "an int8 cache needs k_scale_cache"),
    ("scale caches and descales", dict(k=torch.zeros(8, 16, 2, 64, dtype=torch.int8),
                                       v=torch.zeros(8, 16, 2, 64, dtype=torch.int8),
                                       k_descale=torch.ones(()), k_scale_cache=torch.ones(8, 16, 2)),
     ValueError, "not both"),
    ("head_dim differs", dict(k=torch.zeros(8, 16, 2, 128, dtype=F16), v=torch.zeros(8, 16, 2, 128, dtype=F16)),
     ValueError, "head_dim"),
    ("GQA", dict(k=torch.zeros(8, 16, 3, 64, dtype=F16), v=torch.zeros(8, 16, 3, 64, dtype=F16)),
     ValueError, "multiple of num_kv_heads"),
    ("out shape", dict(out=torch.empty(3, 8, 64, dtype=F16)), ValueError, r"\bout\b"),
    ("out dtype", dict(out=torch.empty(2, 8, 64)), SHAPE_ERRORS, r"\bout\b|float16 only"),
    ("scheduler_metadata type", dict(scheduler_metadata={"num_splits": 1}), SHAPE_ERRORS,
     "scheduler_metadata"),
    ("alibi", dict(alibi_slopes=torch.ones(8)), NotImplementedError, "alibi_slopes=None"),
    ("dropout", dict(dropout_p=0.1), NotImplementedError, "dropout_p=0.0"),
]


@pytest.mark.parametrize("name, changes, exc, match", VARLEN_CASES,
                         ids=[case[0] for case in VARLEN_CASES])
def test_varlen_paged_argument_errors(name, changes, exc, match):
    with raises(exc, match):
        call_varlen(**changes)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_paged_requires_grad_refused(which):
    kw = paged_varlen()
    kw[which] = grad(kw[which])
    with raises(FORWARD_ONLY, "forward"):
        flash_attn_varlen_func(**kw)


# ---------------------------------------------------------------------------------------
# flash_attn_with_kvcache


def _kv_cases():
    k, v = new_kv()
    cos, sin = rotary()
    bt = torch.zeros(2, 4, dtype=I32)
    idx = torch.tensor([1, 0], dtype=I32)
    return [
        ("q 3-D", "paged", dict(q=torch.zeros(2, 8, 64, dtype=F16)), SHAPE_ERRORS, "4-D"),
        ("k_cache 3-D", "contiguous", dict(k_cache=torch.zeros(2, 64, 128, dtype=F16),
                                           v_cache=torch.zeros(2, 64, 128, dtype=F16)),
         SHAPE_ERRORS, "4-D"),
        ("paged cache 5-D", "paged", dict(k_cache=torch.zeros(8, 16, 2, 64, 1, dtype=F16),
                                          v_cache=torch.zeros(8, 16, 2, 64, 1, dtype=F16)),
         SHAPE_ERRORS, "4-D"),
        ("check_inputs not a bool", "paged", dict(check_inputs=1), TypeError, "check_inputs"),
        ("k without v", "paged", dict(k=k), SHAPE_ERRORS, r"\bv\b"),
        ("v without k", "contiguous", dict(v=v), SHAPE_ERRORS, r"\bk\b"),
        ("rotary_cos without rotary_sin", "paged", dict(k=k, v=v, rotary_cos=cos), SHAPE_ERRORS,
         "rotary_sin"),
        ("rotary_sin without rotary_cos", "contiguous", dict(k=k, v=v, rotary_sin=sin), SHAPE_ERRORS,
         "rotary_cos"),
        ("rotary_dim > head_dim", "contiguous", dict(k=k, v=v, rotary_cos=rotary(128)[0],
                                                     rotary_sin=rotary(128)[1]),
         SHAPE_ERRORS, "rotary"),
        ("cache_batch_idx with block_table", "paged", dict(cache_batch_idx=idx), SHAPE_ERRORS,
         "cache_batch_idx"),
        ("cache_leftpad with block_table", "paged", dict(cache_leftpad=torch.zeros(2, dtype=I32)),
         SHAPE_ERRORS, "cache_leftpad"),
        ("block_table int64", "paged", dict(block_table=bt.long()), SHAPE_ERRORS, "block_table"),
        ("block_table 1-D", "paged", dict(block_table=bt[0]), SHAPE_ERRORS, "block_table"),
        ("block_table batch", "paged", dict(block_table=torch.zeros(3, 4, dtype=I32)), SHAPE_ERRORS,
         "block_table"),
        ("page_size 48", "paged", dict(k_cache=torch.zeros(8, 48, 2, 64, dtype=F16),
                                       v_cache=torch.zeros(8, 48, 2, 64, dtype=F16)),
         ValueError, "page_size"),
        ("cache_seqlens batch + 1", "paged", dict(cache_seqlens=torch.full((3,), 10, dtype=I32)),
         SHAPE_ERRORS, "cache_seqlens"),
        ("cache_seqlens 2-D", "contiguous", dict(cache_seqlens=torch.full((2, 1), 10, dtype=I32)),
         SHAPE_ERRORS, "cache_seqlens"),
        ("num_splits negative", "paged", dict(num_splits=-1), ValueError, "num_splits"),
        ("cache dtype", "contiguous", dict(k_cache=torch.zeros(2, 64, 2, 64), v_cache=torch.zeros(2, 64, 2, 64)),
         TypeError, "a KV cache is float16"),
        ("k and v caches differ", "contiguous", dict(v_cache=torch.zeros(2, 32, 2, 64, dtype=F16)),
         ValueError, "same shape|v_cache"),
        ("GQA", "paged", dict(q=torch.zeros(2, 1, 3, 64, dtype=F16)), ValueError,
         "multiple of num_kv_heads"),
        ("scheduler_metadata type", "paged", dict(scheduler_metadata=object()), SHAPE_ERRORS,
         "scheduler_metadata"),
        ("alibi", "paged", dict(alibi_slopes=torch.ones(8)), NotImplementedError, "alibi_slopes=None"),
    ]


@pytest.mark.parametrize("name, layout, changes, exc, match", _kv_cases(),
                         ids=[case[0] for case in _kv_cases()])
def test_kvcache_argument_errors(name, layout, changes, exc, match):
    with raises(exc, match):
        call_kvcache(layout, **changes)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_kvcache_requires_grad_refused(layout, which):
    k, v = new_kv()
    kw = kvcache(layout)
    kw.update(k=k, v=v)
    kw[which] = grad(kw[which])
    with raises(FORWARD_ONLY, "forward"):
        flash_attn_with_kvcache(**kw)


# ---------------------------------------------------------------------------------------
# the message says where training goes instead (flash_attn_func / flash_attn_varlen_func on
# q, k, v are differentiable: tests/unit/test_fa2_autograd.py)


def test_requires_grad_message_says_inference_only_and_where_to_train():
    kw = paged_varlen()
    kw["q"] = grad(kw["q"])
    with pytest.raises(FORWARD_ONLY) as info:
        flash_attn_varlen_func(**kw)
    msg = str(info.value)
    assert "forward" in msg and "requires grad" in msg and "flash_attn_func" in msg, msg


# ---------------------------------------------------------------------------------------
# plan_decode: argument checks (a plan itself needs the device: GPU tests)


def _plan_error(match, **changes):
    args = dict(batch_size=4, max_seqlen_q=1, max_seqlen_k=1024, num_heads=8, num_kv_heads=2,
                head_dim=128)
    args.update(changes)
    try:
        plan_decode(**args)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        if "CUDA" in msg and not re.search(match, msg):
            pytest.skip(f"plan_decode checks the device before its arguments: {msg}")
        assert re.search(match, msg), f"{type(exc).__name__}: {msg}"
        return
    except Exception as exc:  # noqa: BLE001  (torch without CUDA, the no-load guard)
        pytest.skip(f"plan_decode needs a device before checking its arguments: "
                    f"{type(exc).__name__}: {exc}")
    pytest.fail(f"plan_decode accepted {changes}")


@pytest.mark.parametrize("changes, match", [
    (dict(num_heads=8, num_kv_heads=3), "num_kv_heads"),
    (dict(head_dim=12), "head_dim"),
    (dict(head_dim=512), "head_dim"),
    (dict(num_splits=-1), "num_splits"),
    (dict(batch_size=-1), "batch_size"),
    (dict(max_seqlen_k=-1), "max_seqlen_k"),
    (dict(max_seqlen_q=-1), "max_seqlen_q"),
    (dict(kv_cache_dtype="bf16"), "kv_cache_dtype must be None, 'auto', one of 'fp8'"),
    (dict(kv_cache_dtype=torch.bfloat16), "kv_cache_dtype .*got torch.bfloat16"),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_plan_decode_argument_errors(changes, match):
    _plan_error(match, **changes)


def test_out_that_overlaps_itself_or_an_input_is_refused():
    kw = paged_varlen()
    q = kw["q"]
    expanded = torch.zeros(1, q.shape[1], q.shape[2], dtype=F16).expand(q.shape)
    with raises(ValueError, match="out .* elements may share memory"):
        call_varlen(out=expanded)
    # out as a view into the key cache: the kernels would overwrite keys they still read
    k = kw["k"]
    with raises(ValueError, match="out overlaps k_cache"):
        call_varlen(k=k, out=k.view(-1, q.shape[1], q.shape[2])[: q.shape[0]])
    with raises(ValueError, match="out overlaps q"):
        call_varlen(q=q, out=q)


def test_out_interleaved_with_an_input_but_disjoint_is_accepted():
    # out and q as column slices of one buffer: their spans interleave, no element is
    # shared, so the call gets as far as the CUDA check
    kw = paged_varlen()
    t, h, d = kw["q"].shape
    buf = torch.zeros(t, 2, h, d, dtype=F16)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        call_varlen(q=buf[:, 0], out=buf[:, 1])


def test_paged_max_seqlen_q_zero_with_queries_is_refused():
    """Before: the paged call returned zeros, silently (the kernels skip a 0 bound)."""
    with raises(ValueError, match="max_seqlen_q is 0 but q holds"):
        call_varlen(max_seqlen_q=0)


# ---------------------------------------------------------------------------------------
# 8-bit caches: what flash_attn_with_kvcache's append writes


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_append_encoding_equals_reshape_and_cache(fmt):
    """The append's encoder (torch ops) and sm7x.ops.reshape_and_cache (the core library's
    integer encoder, on CPU) write the same byte for all 65,536 float16 bit patterns, NaN
    codes aside (any NaN code for a NaN)."""
    ops = pytest.importorskip("sm7x.ops")
    from sm7x.fa2 import _serving
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(F16).view(256, 4, 64)
    scale = torch.tensor([0.37])
    cache = torch.zeros(16, 16, 4, 64, dtype=torch.uint8)
    try:
        ops.reshape_and_cache(x, x, cache, cache.clone(), torch.arange(256), fmt, scale, scale)
    except ImportError as exc:  # no core library in this environment
        pytest.skip(str(exc))
    fmt_id = _serving.KV_CACHE_DTYPES[fmt]
    mine = _serving.encode_codes(x[None], fmt_id, scale).view(torch.uint8)[0]
    theirs = cache.reshape(256, 4, 64)
    dtype = {1: torch.float8_e4m3fn, 2: torch.float8_e5m2}[fmt_id]
    nan = torch.isnan(theirs.view(dtype).float())
    assert torch.equal(nan, torch.isnan(mine.view(dtype).float()))
    assert torch.equal(mine[~nan], theirs[~nan])


@pytest.mark.parametrize("name", ["k_descale", "v_descale", "kv_cache_dtype"])
def test_cache_arguments_refused_without_a_cache(name):
    q = torch.zeros(4, 8, 64, dtype=F16)
    cu = torch.tensor([0, 4], dtype=I32)
    with raises(ValueError, match=f"{name} applies to calls over a KV cache"):
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, **{name: "fp8" if name == "kv_cache_dtype"
                                                         else torch.ones(())})
