"""sm7x core ops (_core.abi3.so) against float32 references written in plain torch.

Runs on CPU here; tests/gpu/test_core_cuda.py collects the same tests with the `device`
fixture set to "cuda". Skipped when torch (at least the floor in targets.json) or the built
library is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from sm7x import _targets

torch = pytest.importorskip("torch", reason="the core ops need torch")
_FLOOR = _targets.torch_min()
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < tuple(map(int, _FLOOR.split("."))):
    pytest.skip(f"torch {torch.__version__} < {_FLOOR}: no stable ABI for the core ops",
                allow_module_level=True)

from sm7x import _core_loader  # noqa: E402

if _core_loader.core_library_path() is None:
    pytest.skip(
        f"{_core_loader.LIBRARY_NAME} is not built (pip install -e . with torch installed, "
        f"or set {_core_loader.LIBRARY_PATH_ENV} to a build directory)",
        allow_module_level=True,
    )

from sm7x import ops  # noqa: E402
from sm7x.bench import reference as ref  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Tolerances against the float32 reference: the kernels compute in fp32 and round once.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture(scope="module")
def device():
    """Where the tensors live; tests/gpu/test_core_cuda.py overrides it with "cuda"."""
    return "cpu"


def close(actual, expected, dtype=None):
    dtype = dtype or actual.dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def randn(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def rows_slice(rows, hidden, dtype, device, pad=8, offset=0):
    """[rows, hidden] view into a wider buffer: row stride hidden + pad (not contiguous)."""
    big = randn(rows, hidden + pad, dtype=dtype, device=device)
    return big[:, offset:offset + hidden]


# ---------------------------------------------------------------------------------------
# rms_norm

HIDDEN = [1, 7, 12, 16, 64, 100, 4096, 5003]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm(device, dtype, rows, hidden):
    x = randn(rows, hidden, dtype=dtype, device=device)
    w = randn(hidden, dtype=dtype, device=device)
    out = ops.rms_norm(x, w, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    close(out, ref.rms_norm(x.float(), w.float(), 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [40000, 4100])
def test_rms_norm_long_rows(device, dtype, hidden):
    # Longer than the registers keep on CUDA (re-read path); 4100 fp16 is scalar there.
    x = randn(3, hidden, dtype=dtype, device=device)
    w = randn(hidden, dtype=dtype, device=device)
    close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x.float(), w.float(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_3d_inplace_and_out(device, dtype):
    x = randn(2, 3, 64, dtype=dtype, device=device)
    w = randn(64, dtype=dtype, device=device)
    expected = ref.rms_norm(x.float(), w.float(), 1e-6)
    out = torch.empty_like(x)
    assert ops.rms_norm(x, w, out=out) is out
    close(out, expected, dtype)
    ops.rms_norm(x, w, out=x)  # in place
    close(x, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])  # 1: misaligned rows -> scalar path on CUDA
def test_rms_norm_row_slices(device, dtype, offset):
    x = rows_slice(6, 64, dtype, device, offset=offset)
    w = randn(64, dtype=dtype, device=device)
    out_buf = torch.zeros(6, 80, dtype=dtype, device=device)
    out = out_buf[:, 8:72]
    ops.rms_norm(x, w, out=out)
    close(out, ref.rms_norm(x.float(), w.float(), 1e-6), dtype)
    assert (out_buf[:, :8] == 0).all() and (out_buf[:, 72:] == 0).all()


def test_rms_norm_refuses_bad_layouts(device):
    w = torch.ones(8, device=device)
    xt = torch.randn(8, 6, device=device).t()  # [6, 8], last dim not contiguous
    with pytest.raises(ValueError, match=r"x \(shape \(6, 8\), strides \(1, 6\)\) must have a "
                                         r"contiguous last dimension; call x.contiguous\(\)"):
        ops.rms_norm(xt, w)
    with pytest.raises(RuntimeError, match=r"x \(shape \[6, 8\], strides \(1, 6\)\) must have a "
                                           r"contiguous last dimension \(stride 1\); call x.contiguous"):
        torch.ops.sm7x.rms_norm(torch.empty(6, 8, device=device), xt, w, 1e-6)
    big = torch.randn(2, 3, 8, device=device)
    x = big[:, :2]  # leading dims do not collapse into one row stride
    with pytest.raises(RuntimeError, match=r"do not collapse.*x\.contiguous\(\)"):
        ops.rms_norm(x, w)
    ops.rms_norm(x.contiguous(), w)  # the fix the message names works


def test_rms_norm_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\)"):
        ops.rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match=r"dtype torch.float16 but x has torch.float32"):
        ops.rms_norm(x, w.half())
    with pytest.raises(ValueError, match=r"supported: float16, bfloat16, float32"):
        ops.rms_norm(x.double(), w.double())
    with pytest.raises(ValueError, match=r"eps must be"):
        ops.rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match=r"out has shape"):
        ops.rms_norm(x, w, out=torch.empty(4, 9, device=device))
    # The C++ layer checks on its own too (direct torch.ops calls bypass the wrapper).
    op = torch.ops.sm7x.rms_norm
    with pytest.raises(RuntimeError, match=r"sm7x.rms_norm: weight.shape\[0\] is 7 but must be 8"):
        op(torch.empty_like(x), x, torch.ones(7, device=device), 1e-6)
    with pytest.raises(RuntimeError, match=r"weight has dtype float16 but x has dtype float32"):
        op(torch.empty_like(x), x, w.half(), 1e-6)
    with pytest.raises(RuntimeError, match=r"x has dtype int64; supported: float16"):
        op(torch.empty_like(x), x.long(), w, 1e-6)
    with pytest.raises(RuntimeError, match=r"out has shape \[4, 9\] but x has shape \[4, 8\]"):
        op(torch.empty(4, 9, device=device), x, w, 1e-6)
    with pytest.raises(RuntimeError, match=r"eps must be a finite number"):
        op(torch.empty_like(x), x, w, float("nan"))
    with pytest.raises(RuntimeError, match=r"hidden size 0"):
        op(torch.empty(4, 0, device=device), torch.empty(4, 0, device=device),
           torch.empty(0, device=device), 1e-6)
    with pytest.raises(RuntimeError, match=r"rows must not overlap"):
        op(torch.empty(1, 8, device=device).expand(4, 8), x, w, 1e-6)


# ---------------------------------------------------------------------------------------
# fused_add_rms_norm


def _fused_reference(x, residual, w, eps):
    # Round the sum to the dtype exactly as the kernel does, then the fp32 norm of it.
    r = (x.float() + residual.float()).to(x.dtype)
    return ref.rms_norm(r.float(), w.float(), eps), r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("hidden", [1, 7, 16, 100, 4096, 40000])
def test_fused_add_rms_norm(device, dtype, rows, hidden):
    x = randn(rows, hidden, dtype=dtype, device=device)
    res = randn(rows, hidden, dtype=dtype, device=device)
    w = randn(hidden, dtype=dtype, device=device)
    expected, expected_res = _fused_reference(x, res, w, 1e-6)
    x_out, res_out = ops.fused_add_rms_norm(x, res, w, 1e-6)
    assert x_out is x and res_out is res
    assert torch.equal(res, expected_res)
    close(x, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_row_slices(device, dtype):
    x = rows_slice(5, 64, dtype, device)
    res = rows_slice(5, 64, dtype, device, pad=3, offset=1)
    w = randn(64, dtype=dtype, device=device)
    expected, expected_res = _fused_reference(x.clone(), res.clone(), w, 1e-6)
    ops.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(res, expected_res)
    close(x, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [7, 64, 4096, 40000])  # odd, vectorized, long rows
def test_fused_add_rms_norm_float32_residual(device, dtype, hidden):
    """A float32 residual: the sum is kept in fp32 (not rounded to x's dtype) and the norm
    taken of it; x gets the normalized row in its own dtype."""
    x = randn(5, hidden, dtype=dtype, device=device)
    res = randn(5, hidden, dtype=torch.float32, device=device) * 100
    w = randn(hidden, dtype=dtype, device=device)
    want_res = x.float() + res
    want = ref.rms_norm(want_res, w.float(), 1e-6)
    x_out, res_out = ops.fused_add_rms_norm(x, res, w, 1e-6)
    assert x_out is x and res_out is res and res.dtype == torch.float32 and x.dtype == dtype
    assert torch.equal(res, want_res)
    close(x, want, dtype)


def test_fused_add_rms_norm_float32_residual_does_not_overflow(device):
    """The case the option is for: a residual stream beyond fp16's 65504. In fp16 the sum
    overflows to inf and the normalized row is NaN; with a float32 residual it is finite."""
    x = torch.full((2, 64), 40000.0, dtype=torch.float16, device=device)
    w = torch.ones(64, dtype=torch.float16, device=device)
    res16 = torch.full((2, 64), 40000.0, dtype=torch.float16, device=device)
    out16, r16 = ops.fused_add_rms_norm(x.clone(), res16, w)
    assert torch.isinf(r16).all() and torch.isnan(out16).all()
    res32 = torch.full((2, 64), 40000.0, dtype=torch.float32, device=device)
    out32, r32 = ops.fused_add_rms_norm(x.clone(), res32, w)
    assert torch.equal(r32, torch.full_like(r32, 80000.0))
    assert torch.isfinite(out32).all() and torch.allclose(out32.float(), torch.ones_like(r32))


def test_fused_add_rms_norm_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match=r"residual has shape \(4, 7\)"):
        ops.fused_add_rms_norm(x, torch.randn(4, 7, device=device), w)
    with pytest.raises(ValueError, match=r"residual has dtype torch.float16"):
        ops.fused_add_rms_norm(x, x.half(), w)
    with pytest.raises(ValueError, match=r"residual has dtype torch.bfloat16 but x has "
                                         r"torch.float16; it must be x's dtype, or torch.float32"):
        ops.fused_add_rms_norm(x.half(), x.bfloat16(), w.half())
    op = torch.ops.sm7x.fused_add_rms_norm
    with pytest.raises(RuntimeError, match=r"residual has dtype bfloat16 but x has float16; it "
                                           r"must be x's dtype, or float32"):
        op(x.half(), x.bfloat16(), w.half(), 1e-6)
    with pytest.raises(RuntimeError, match=r"x overlaps residual in memory"):
        op(x, x, w, 1e-6)
    with pytest.raises(RuntimeError, match=r"residual has shape \[4, 7\] but x has shape \[4, 8\]"):
        op(x, torch.randn(4, 7, device=device), w, 1e-6)
    with pytest.raises(RuntimeError, match=r"weight.shape\[0\] is 9 but must be 8"):
        op(x, torch.randn(4, 8, device=device), torch.ones(9, device=device), 1e-6)


# ---------------------------------------------------------------------------------------
# silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("d", [0, 1, 3, 8, 13, 64, 4096])
def test_silu_and_mul(device, dtype, rows, d):
    x = randn(rows, 2 * d, dtype=dtype, device=device, scale=3.0)
    out = ops.silu_and_mul(x)
    assert out.shape == (rows, d) and out.dtype == dtype
    close(out, ref.silu_and_mul(x.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
def test_silu_and_mul_3d_and_slices(device, dtype, offset):
    x3 = randn(2, 3, 32, dtype=dtype, device=device)
    close(ops.silu_and_mul(x3), ref.silu_and_mul(x3.float()), dtype)
    x = rows_slice(4, 32, dtype, device, offset=offset)
    out = torch.zeros(4, 24, dtype=dtype, device=device)[:, 4:20]
    ops.silu_and_mul(x, out=out)
    close(out, ref.silu_and_mul(x.float()), dtype)


def test_silu_and_mul_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"must be even"):
        ops.silu_and_mul(torch.randn(4, 7, device=device))
    with pytest.raises(ValueError, match=r"out has shape \(4, 8\) but must be \(4, 4\)"):
        ops.silu_and_mul(x, out=torch.empty(4, 8, device=device))
    op = torch.ops.sm7x.silu_and_mul
    with pytest.raises(RuntimeError, match=r"x.shape\[-1\] is 7 but must be even"):
        op(torch.empty(4, 3, device=device), torch.randn(4, 7, device=device))
    with pytest.raises(RuntimeError, match=r"out has shape \[4, 8\] but must be x.shape\[:-1\] \+ \[4\]"):
        op(torch.empty(4, 8, device=device), x)
    with pytest.raises(RuntimeError, match=r"out has dtype bfloat16 but x has dtype float32"):
        op(torch.empty(4, 4, device=device, dtype=torch.bfloat16), x)


# ---------------------------------------------------------------------------------------
# rotary_embedding


def make_cache(max_pos, rot_dim, dtype, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)


def check_rotary(device, dtype, tokens, heads, kv_heads, head_size, rot_dim, is_neox,
                 cache_dtype=None, pos_dtype=torch.int64, heads_dim=False, fused_qkv=False):
    max_pos = 64
    cache = make_cache(max_pos, rot_dim, cache_dtype or dtype, device)
    positions = torch.randint(0, max_pos, (tokens,), dtype=pos_dtype).to(device)
    q_cols, k_cols = heads * head_size, kv_heads * head_size
    if fused_qkv:  # query/key are column slices of one [tokens, q + k + v] projection
        qkv = randn(tokens, q_cols + 2 * k_cols, dtype=dtype, device=device)
        query, key = qkv[:, :q_cols], (qkv[:, q_cols:q_cols + k_cols] if kv_heads else None)
    else:
        query = randn(tokens, q_cols, dtype=dtype, device=device)
        key = randn(tokens, k_cols, dtype=dtype, device=device) if kv_heads else None
    if heads_dim:
        query = query.view(tokens, heads, head_size)
        key = key.view(tokens, kv_heads, head_size) if key is not None else None
    q_exp, k_exp = ref.rotary_embedding(positions, query.float(),
                                        key.float() if key is not None else None,
                                        head_size, cache.float(), is_neox)
    q_out, k_out = ops.rotary_embedding(positions, query, key, head_size, cache, is_neox)
    assert q_out is query and k_out is key
    close(query, q_exp, dtype)
    if key is not None:
        close(key, k_exp, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (128, 128), (64, 32), (80, 80),
                                               (80, 40), (10, 6), (128, 2)])
def test_rotary(device, dtype, is_neox, head_size, rot_dim):
    check_rotary(device, dtype, 5, 4, 2, head_size, rot_dim, is_neox)


@pytest.mark.parametrize("tokens", [0, 1, 7])
@pytest.mark.parametrize("kv_heads", [0, 1, 4])  # 0: key=None; 1, 4: GQA/MQA and MHA
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_tokens_and_kv_heads(device, tokens, kv_heads, is_neox):
    check_rotary(device, torch.float16, tokens, 4, kv_heads, 64, 64, is_neox)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_fp32_cache_int32_positions(device, dtype, is_neox):
    check_rotary(device, dtype, 6, 4, 2, 64, 64, is_neox, cache_dtype=torch.float32,
                 pos_dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("heads_dim", [False, True])
def test_rotary_fused_qkv_slices(device, dtype, is_neox, heads_dim):
    check_rotary(device, dtype, 5, 4, 2, 64, 32, is_neox, heads_dim=heads_dim, fused_qkv=True)


def test_rotary_batched_positions(device):
    cache = make_cache(32, 16, torch.float32, device)
    positions = torch.randint(0, 32, (2, 3), device=device)
    query = randn(2, 3, 2 * 16, dtype=torch.float32, device=device)
    key = randn(2, 3, 16, dtype=torch.float32, device=device)
    q_exp, k_exp = ref.rotary_embedding(positions, query, key, 16, cache, True)
    ops.rotary_embedding(positions, query, key, 16, cache, True)
    close(query, q_exp)
    close(key, k_exp)


def test_rotary_out_of_range_positions(device):
    cache = make_cache(8, 16, torch.float32, device)
    query = randn(2, 16, dtype=torch.float32, device=device)
    positions = torch.tensor([3, 8], device=device)
    if device == "cpu":
        with pytest.raises(RuntimeError, match=r"positions\[1\] = 8 is outside the cos_sin_cache"):
            ops.rotary_embedding(positions, query, None, 16, cache, True)
    else:  # CUDA cannot check without a sync: the kernel leaves such tokens alone
        before = query.clone()
        ops.rotary_embedding(positions, query, None, 16, cache, True)
        assert torch.equal(query[1], before[1])
        q_exp, _ = ref.rotary_embedding(positions[:1], before[:1], None, 16, cache, True)
        close(query[:1], q_exp)
    # no row at all: refused on every device (every position would be outside)
    with pytest.raises(RuntimeError, match=r"cos_sin_cache has no rows"):
        ops.rotary_embedding(positions, query, None, 16, cache[:0], True)


def test_index_checks_on_request(device, monkeypatch):
    """SM7X_CHECK_INDICES=1: CUDA refuses what the CPU op refuses, before anything is written."""
    monkeypatch.setenv("SM7X_CHECK_INDICES", "1")
    err = ValueError if device != "cpu" else RuntimeError
    cache = make_cache(8, 16, torch.float32, device)
    query = randn(2, 16, dtype=torch.float32, device=device)
    before = query.clone()
    for bad in (8, -1):
        with pytest.raises(err, match=rf"positions\[1\] = {bad} is outside"):
            ops.rotary_embedding(torch.tensor([3, bad], device=device), query, None, 16, cache,
                                 True)
        assert torch.equal(query, before)
    key = torch.randn(3, 2, 8, device=device)
    kc, vc = torch.zeros(4, 16, 2, 8, device=device), torch.zeros(4, 16, 2, 8, device=device)
    with pytest.raises(err, match=r"slot_mapping\[2\] = 64 is outside"):
        ops.reshape_and_cache(key, key, kc, vc, torch.tensor([0, -1, 64], device=device))
    assert not kc.any() and not vc.any()
    ops.reshape_and_cache(key, key, kc, vc, torch.tensor([0, -1, 63], device=device))  # -1: padding
    assert torch.equal(kc[0, 0], key[0]) and torch.equal(vc[3, 15], key[2])


def test_bad_index_finds_the_first():
    bad = ops._bad_index
    assert bad(torch.tensor([0, 3, 5, -1]), 5, skip_negative=False) == "[2] = 5"
    assert bad(torch.tensor([[0, 3], [1, -1]]), 5, skip_negative=False) == "[1, 1] = -1"
    assert bad(torch.tensor([[0, 3], [1, -1]]), 5, skip_negative=True) is None
    assert bad(torch.tensor([], dtype=torch.int64), 5, skip_negative=False) is None


def test_rotary_bad_inputs(device):
    cache = make_cache(8, 16, torch.float32, device)
    pos = torch.zeros(2, dtype=torch.long, device=device)
    q = torch.randn(2, 32, device=device)
    with pytest.raises(ValueError, match=r"positions has dtype torch.float32"):
        ops.rotary_embedding(pos.float(), q, None, 16, cache)
    with pytest.raises(ValueError, match=r"rot_dim = 16\) must be even, > 0 and <= head_size \(8\)"):
        ops.rotary_embedding(pos, q, None, 8, cache)
    with pytest.raises(ValueError, match=r"key has dtype torch.float16"):
        ops.rotary_embedding(pos, q, q.half(), 16, cache)
    op = torch.ops.sm7x.rotary_embedding
    with pytest.raises(RuntimeError, match=r"query.shape\[-1\] is 32, not a multiple of head_size 12"):
        op(pos, q, None, 12, make_cache(8, 12, torch.float32, device), True)
    with pytest.raises(RuntimeError, match=r"rot_dim = 7\) must be even"):
        op(pos, q, None, 16, torch.randn(8, 7, device=device), True)
    with pytest.raises(RuntimeError, match=r"query.shape\[0\] is 2 but positions.shape\[0\] is 3"):
        op(torch.zeros(3, dtype=torch.long, device=device), q, None, 16, cache, True)
    with pytest.raises(RuntimeError, match=r"cos_sin_cache has dtype bfloat16 but query has dtype float16"):
        op(pos, q.half(), None, 16, cache.bfloat16(), True)
    with pytest.raises(RuntimeError, match=r"positions has dtype float32; it must be int64 or int32"):
        op(pos.float(), q, None, 16, cache, True)
    with pytest.raises(RuntimeError, match=r"query.*contiguous last dimension"):
        op(pos, torch.randn(32, 2, device=device).t(), None, 16, cache, True)


# ---------------------------------------------------------------------------------------
# reshape_and_cache


def check_cache(device, dtype, tokens, kv_heads, head_size, block_size, num_blocks=6,
                slot_dtype=torch.int64, padding=0, v_head_size=None, fused=False):
    v_head_size = v_head_size or head_size
    g = torch.Generator().manual_seed(tokens * 131 + kv_heads)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    if padding:
        slots[torch.randperm(tokens, generator=g)[:padding]] = -1
    slots = slots.to(device=device, dtype=slot_dtype)
    if fused:  # key and value are slices of one [tokens, heads, k + v] buffer
        kv = randn(tokens, kv_heads, head_size + v_head_size, dtype=dtype, device=device)
        key, value = kv[..., :head_size], kv[..., head_size:]
    else:
        key = randn(tokens, kv_heads, head_size, dtype=dtype, device=device)
        value = randn(tokens, kv_heads, v_head_size, dtype=dtype, device=device)
    kc = randn(num_blocks, block_size, kv_heads, head_size, dtype=dtype, device=device)
    vc = randn(num_blocks, block_size, kv_heads, v_head_size, dtype=dtype, device=device)
    kc_exp, vc_exp = ref.reshape_and_cache(key, value, kc, vc, slots)
    assert ops.reshape_and_cache(key, value, kc, vc, slots) is None
    assert torch.equal(kc, kc_exp) and torch.equal(vc, vc_exp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads,head_size", [(1, 64), (2, 128), (8, 80), (3, 3), (2, 7)])
def test_reshape_and_cache(device, dtype, block_size, kv_heads, head_size):
    check_cache(device, dtype, 37, kv_heads, head_size, block_size)


@pytest.mark.parametrize("tokens,padding", [(0, 0), (1, 0), (1, 1), (20, 5)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache_padding(device, tokens, padding, slot_dtype):
    check_cache(device, torch.float16, tokens, 2, 64, 16, slot_dtype=slot_dtype, padding=padding)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_reshape_and_cache_slices_and_value_head_size(device, dtype):
    check_cache(device, dtype, 9, 2, 64, 16, fused=True)
    check_cache(device, dtype, 9, 2, 64, 16, v_head_size=32)
    check_cache(device, dtype, 9, 2, 7, 16, v_head_size=5, fused=True)


def test_reshape_and_cache_bad_inputs(device):
    key = torch.randn(3, 2, 8, device=device)
    kc = torch.zeros(4, 16, 2, 8, device=device)
    slots = torch.tensor([0, 5, 63], device=device)
    with pytest.raises(ValueError, match=r"slot_mapping has dtype torch.float32"):
        ops.reshape_and_cache(key, key, kc, kc.clone(), slots.float())
    with pytest.raises(ValueError, match=r"must be \[num_tokens, num_kv_heads, head_size\]"):
        ops.reshape_and_cache(key.view(3, 16), key, kc, kc.clone(), slots)
    op = torch.ops.sm7x.reshape_and_cache
    with pytest.raises(RuntimeError, match=r"key_cache has no blocks"):
        op(key, key, kc[:0], kc[:0].clone(), slots)
    with pytest.raises(RuntimeError, match=r"key_cache.shape\[2\] is 2 but must be 4"):
        op(torch.randn(3, 4, 4, device=device), torch.randn(3, 4, 4, device=device),
           torch.zeros(4, 16, 2, 8, device=device), torch.zeros(4, 16, 2, 8, device=device), slots)
    with pytest.raises(RuntimeError, match=r"slot_mapping.shape\[0\] is 2 but must be 3"):
        op(key, key, kc, kc.clone(), slots[:2])
    with pytest.raises(RuntimeError, match=r"value_cache has dtype float16 but key has dtype float32"):
        op(key, key, kc, kc.half(), slots)
    with pytest.raises(RuntimeError, match=r"value_cache.shape\[1\] is 32 but must be 16"):
        op(key, key, kc, torch.zeros(4, 32, 2, 8, device=device), slots)
    if device == "cpu":
        with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = 64 is outside the cache "
                                               r"\(4 blocks x 16 slots"):
            op(key, key, kc, kc.clone(), torch.tensor([0, 5, 64], device=device))


# ---------------------------------------------------------------------------------------
# reshape_and_cache into 8-bit caches (vLLM's kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2"):
# against torch's own float8 conversion, which rounds to nearest even, after saturating to
# the largest finite value as vLLM's writes do (__NV_SATFINITE).

FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def fp8_reference(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    dtype, top = FP8[fmt]
    return (x.float().cpu() / scale).clamp(-top, top).to(dtype).view(torch.uint8)


def assert_same_codes(got: torch.Tensor, want: torch.Tensor, fmt: str, x: torch.Tensor):
    """Byte for byte, except that any NaN code matches any NaN code."""
    got = got.cpu().reshape(-1)
    want = want.reshape(-1)
    dtype = FP8[fmt][0]
    g, w = got.view(dtype).float(), want.view(dtype).float()
    assert torch.equal(torch.isnan(g), torch.isnan(w))
    bad = ((got != want) & ~torch.isnan(w)).nonzero().flatten()
    assert bad.numel() == 0, [(x.reshape(-1)[i].item(), hex(got[i]), hex(want[i])) for i in bad[:8]]


def write_fp8(x: torch.Tensor, fmt: str, scale: float, device, cache_dtype=torch.uint8,
              value: torch.Tensor | None = None):
    """x [tokens, heads, d] written at slots 0..tokens-1 of a cache of 16-slot blocks."""
    tokens, heads, d = x.shape
    blocks = (tokens + 15) // 16
    kc = torch.full((blocks, 16, heads, d), 0x55, dtype=torch.uint8, device=device).view(cache_dtype)
    vc = kc.clone()
    value = x if value is None else value
    s = torch.tensor([scale], device=device)
    ops.reshape_and_cache(x.to(device), value.to(device), kc, vc,
                          torch.arange(tokens, device=device), fmt, s, s.clone())
    return (kc.view(torch.uint8).reshape(-1, heads, d)[:tokens],
            vc.view(torch.uint8).reshape(-1, heads, d)[:tokens])


@pytest.mark.parametrize("fmt", list(FP8) + ["fp8"])
@pytest.mark.parametrize("scale", [1.0, 0.0371, 3.5])
def test_fp8_cache_write_of_every_float16(device, fmt, scale):
    """All 65,536 fp16 bit patterns (NaNs, infinities, subnormals included)."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    key = x.view(256, 4, 64)
    kc, vc = write_fp8(key, fmt, scale, device, value=key.flip(0))
    ref_fmt = "fp8_e4m3" if fmt == "fp8" else fmt
    assert_same_codes(kc, fp8_reference(key, scale, ref_fmt), ref_fmt, key)
    assert_same_codes(vc, fp8_reference(key.flip(0), scale, ref_fmt), ref_fmt, key.flip(0))


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_every_code_round_trips_and_ties_go_to_even(device, fmt):
    """Every finite code written from its own value comes back; the midpoints between
    neighbouring codes (exact ties) and one float32 ulp on either side round as torch does."""
    dtype, _ = FP8[fmt]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).float()
    finite = torch.isfinite(values)
    kc, _ = write_fp8(values[finite].view(-1, 1, 1), fmt, 1.0, device)
    assert torch.equal(kc.cpu().flatten(), codes[finite])
    grid = values[finite & (values >= 0)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2  # exact in float32
    up, down = torch.nextafter(mids, torch.tensor(float("inf"))), torch.nextafter(mids, torch.tensor(0.0))
    top = grid[-1]
    x = torch.cat([mids, up, down, -mids, (top * torch.tensor([1.01, 1.1, 1e6])),
                   torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-30, -1e-30])])
    kc, _ = write_fp8(x.view(-1, 1, 1), fmt, 1.0, device)
    assert_same_codes(kc, fp8_reference(x.view(-1, 1, 1), 1.0, fmt), fmt, x)


@pytest.mark.parametrize("cache_dtype", [torch.uint8, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache_write_dtypes_slots_and_padding(device, dtype, cache_dtype):
    """bf16/fp32 inputs, int32 slots, padding tokens and untouched slots; the cache given
    as the format's float8 dtype works as uint8 does."""
    g = torch.Generator().manual_seed(7)
    key = (torch.randn(21, 2, 40, generator=g) * 30).to(dtype)
    value = (torch.randn(21, 2, 24, generator=g) * 30).to(dtype)
    slots = torch.randperm(64, generator=g)[:21].to(torch.int32)
    slots[[3, 11]] = -1
    kc = torch.full((4, 16, 2, 40), 0x55, dtype=torch.uint8).view(cache_dtype).to(device)
    vc = torch.full((4, 16, 2, 24), 0x55, dtype=torch.uint8).view(cache_dtype).to(device)
    ks, vs = torch.tensor([0.25], device=device), torch.tensor([2.0], device=device)
    ops.reshape_and_cache(key.to(device), value.to(device), kc, vc, slots.to(device), "fp8_e5m2", ks, vs)
    want_k = torch.full((64, 2, 40), 0x55, dtype=torch.uint8)
    want_v = torch.full((64, 2, 24), 0x55, dtype=torch.uint8)
    keep = slots >= 0
    want_k[slots[keep].long()] = fp8_reference(key[keep], 0.25, "fp8_e5m2")
    want_v[slots[keep].long()] = fp8_reference(value[keep], 2.0, "fp8_e5m2")
    assert torch.equal(kc.view(torch.uint8).cpu().reshape(64, 2, 40), want_k)
    assert torch.equal(vc.view(torch.uint8).cpu().reshape(64, 2, 24), want_v)


def test_fp8_cache_bad_inputs(device):
    key = torch.randn(3, 2, 8, device=device)
    kc = torch.zeros(4, 16, 2, 8, dtype=torch.uint8, device=device)
    slots = torch.tensor([0, 5, 63], device=device)
    s = torch.tensor([1.0], device=device)
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int4' is not one of 'auto', 'fp8'"):
        ops.reshape_and_cache(key, key, kc, kc.clone(), slots, "int4", s, s)
    with pytest.raises(ValueError, match=r"key_cache has dtype torch.float32 but kv_cache_dtype "
                                         r"'fp8' stores 1-byte codes: allocate it as torch.uint8"):
        ops.reshape_and_cache(key, key, kc.float(), kc.clone(), slots, "fp8", s, s)
    with pytest.raises(ValueError, match=r"value_cache has dtype torch.float8_e5m2 but kv_cache_dtype "
                                         r"'fp8_e4m3'"):
        ops.reshape_and_cache(key, key, kc, kc.view(torch.float8_e5m2), slots, "fp8_e4m3", s, s)
    with pytest.raises(ValueError, match=r"v_scale must be a float32 tensor of one element .* got None"):
        ops.reshape_and_cache(key, key, kc, kc.clone(), slots, "fp8", s, None)
    with pytest.raises(ValueError, match=r"k_scale must be a float32 tensor of one element .* got a "
                                         r"torch.float32 tensor of shape \(2,\)"):
        ops.reshape_and_cache(key, key, kc, kc.clone(), slots, "fp8", torch.ones(2, device=device), s)
    op = torch.ops.sm7x.reshape_and_cache  # the library's own checks, for direct callers
    with pytest.raises(RuntimeError, match=r"kv_cache_dtype 'fp9' is not one of"):
        op(key, key, kc, kc.clone(), slots, "fp9", s, s)
    with pytest.raises(RuntimeError, match=r"k_scale is required with an fp8 kv_cache_dtype"):
        op(key, key, kc, kc.clone(), slots, "fp8_e5m2", None, s)
    with pytest.raises(RuntimeError, match=r"key_cache has dtype float16 but kv_cache_dtype "
                                           r"'fp8_e4m3' stores 1-byte codes"):
        op(key, key, kc.half(), kc.clone(), slots, "fp8", s, s)
    with pytest.raises(RuntimeError, match=r"v_scale has dtype float16; it must be float32"):
        op(key, key, kc, kc.clone(), slots, "fp8", s, s.half())
    if device == "cpu":
        with pytest.raises(RuntimeError, match=r"k_scale is 0; a scale must be finite and positive"):
            op(key, key, kc, kc.clone(), slots, "fp8", torch.zeros(1), s)


# ---------------------------------------------------------------------------------------
# reshape_and_cache into int8 caches with a scale per (token, kv head) row (vLLM's
# "int8_per_token_head"): the scales go into scale caches [blocks, block_size, kv_heads].


def int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's Triton writer in float32: s = max(absmax / 127, 1e-6), x * (1 / s) rounded half
    away from zero, clamped to [-128, 127]; sm7x's choices where int8 has no value: the
    absmax over finite values, NaN -> 0 (+-inf come out of the clamp)."""
    xf = x.float()
    absmax = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf)).amax(-1)
    s = torch.clamp(absmax / 127, min=1e-6)
    q = xf * (1 / s)[..., None]
    q = torch.where(q >= 0, q + 0.5, q - 0.5).clamp(-128, 127).trunc()
    return torch.where(torch.isnan(xf), torch.zeros_like(q), q).to(torch.int8), s


def write_int8(key, value, slots, device, blocks=4, block=16):
    """Caches full of a sentinel (codes 0x55, scales -1) and strided scale caches (views
    into a wider tensor, as vLLM's are), written through reshape_and_cache."""
    heads = key.shape[1]
    kc = torch.full((blocks, block, heads, key.shape[2]), 0x55, dtype=torch.int8, device=device)
    vc = torch.full((blocks, block, heads, value.shape[2]), 0x55, dtype=torch.int8, device=device)
    ks, vs = (torch.full((blocks, block, heads, 3), -1.0, device=device)[..., 1] for _ in range(2))
    ops.reshape_and_cache(key.to(device), value.to(device), kc, vc, slots.to(device),
                          "int8_per_token_head", k_scale_cache=ks, v_scale_cache=vs)
    return kc.cpu(), vc.cpu(), ks.cpu(), vs.cpu()


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_cache_write_codes_scales_and_padding(device, dtype):
    key = (torch.randn(40, 3, 40) * torch.logspace(-3, 2, 40)[:, None, None]).to(dtype)
    value = torch.randn(40, 3, 24).to(dtype)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:40]
    slots[[3, 17]] = -1  # padding tokens: nothing written
    kc, vc, ks, vs = write_int8(key, value, slots, device)
    keep = slots >= 0
    for cache, scales, x in ((kc, ks, key), (vc, vs, value)):
        codes, s = int8_reference(x[keep])
        flat, fs = cache.reshape(64, 3, -1), scales.reshape(64, 3)
        assert torch.equal(flat[slots[keep]], codes)
        assert torch.equal(fs[slots[keep]], s)
        rest = torch.ones(64, dtype=torch.bool)
        rest[slots[keep]] = False
        assert (flat[rest] == 0x55).all() and (fs[rest] == -1).all()


def test_int8_cache_write_rounds_half_away_and_handles_non_finite(device):
    row = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 127.0, -127.0])  # absmax 127: scale 1
    x = torch.stack([row, torch.zeros(8), torch.tensor([1.0, float("inf"), float("-inf"),
                                                        float("nan"), -2.0, 0, 0, 0]),
                     torch.full((8,), 60000.0)]).to(torch.float16)[:, None]  # [4, 1, 8]
    kc, _, ks, _ = write_int8(x, x, torch.arange(4), device)
    codes, scales = kc.reshape(64, 8)[:4], ks.reshape(64)[:4]
    assert codes[0].tolist() == [-3, -2, -1, 1, 2, 3, 127, -127] and scales[0] == 1.0
    assert codes[1].tolist() == [0] * 8 and scales[1] == torch.tensor(1e-6)  # the floor
    # absmax over the finite values (2): scale 2/127; +inf -> 127, -inf -> -128, NaN -> 0
    assert codes[2].tolist() == [64, 127, -128, 0, -127, 0, 0, 0]
    assert scales[2] == torch.tensor(2.0) / 127
    assert codes[3].tolist() == [127] * 8
    want, _ = int8_reference(x)
    assert torch.equal(kc.reshape(64, 1, 8)[:4], want)


def test_int8_cache_bad_inputs(device):
    key = torch.randn(2, 2, 8, device=device)
    kc = torch.zeros(4, 16, 2, 8, dtype=torch.int8, device=device)
    ks = torch.zeros(4, 16, 2, device=device)
    slots = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match=r"k_scale_cache must be a float32 tensor \[num_blocks"):
        ops.reshape_and_cache(key, key, kc, kc.clone(), slots, "int8_per_token_head")
    with pytest.raises(ValueError, match=r"stores int8 codes: allocate it as torch.int8"):
        ops.reshape_and_cache(key, key, kc.view(torch.uint8), kc.clone(), slots,
                              "int8_per_token_head", k_scale_cache=ks, v_scale_cache=ks.clone())
    op = torch.ops.sm7x.reshape_and_cache  # the C++ checks behind the Python ones
    with pytest.raises(RuntimeError, match=r"v_scale_cache has shape \[4, 8, 2\]; it must be "
                                           r"\[4, 16, 2\]"):
        op(key, key, kc, kc.clone(), slots, "int8_per_token_head", None, None, ks,
           ks[:, :8].clone())
    with pytest.raises(RuntimeError, match=r"k_scale_cache has dtype float16; it must be float32"):
        op(key, key, kc, kc.clone(), slots, "int8_per_token_head", None, None, ks.half(), ks)
    with pytest.raises(RuntimeError, match=r"apply to kv_cache_dtype 'int8_per_token_head' only"):
        op(key, key, kc.view(torch.uint8), kc.view(torch.uint8).clone(), slots, "fp8",
           torch.ones(1, device=device), torch.ones(1, device=device), ks, ks.clone())


# ---------------------------------------------------------------------------------------
# Properties over random shapes (bounded).

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


@_SETTINGS
@given(rows=st.integers(0, 9), hidden=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       pad=st.integers(0, 9), eps=st.sampled_from([1e-6, 1e-5, 0.1]))
def test_rms_norm_property(device, rows, hidden, dtype, pad, eps):
    x = rows_slice(rows, hidden, dtype, device, pad=pad)
    w = randn(hidden, dtype=dtype, device=device)
    close(ops.rms_norm(x, w, eps), ref.rms_norm(x.float(), w.float(), eps), dtype)


@_SETTINGS
@given(tokens=st.integers(0, 6), heads=st.integers(1, 5), kv_heads=st.integers(0, 3),
       half_head=st.integers(1, 40), data=st.data(), is_neox=st.booleans(),
       dtype=st.sampled_from(DTYPES), fused=st.booleans())
def test_rotary_property(device, tokens, heads, kv_heads, half_head, data, is_neox, dtype,
                         fused):
    head_size = 2 * half_head
    rot_dim = 2 * data.draw(st.integers(1, half_head))
    check_rotary(device, dtype, tokens, heads, kv_heads, head_size, rot_dim, is_neox,
                 fused_qkv=fused)


@_SETTINGS
@given(tokens=st.integers(0, 20), kv_heads=st.integers(1, 4), head_size=st.integers(1, 70),
       block_size=st.sampled_from([1, 8, 16, 32]), padding=st.integers(0, 3),
       dtype=st.sampled_from(DTYPES))
def test_reshape_and_cache_property(device, tokens, kv_heads, head_size, block_size, padding,
                                    dtype):
    check_cache(device, dtype, tokens, kv_heads, head_size, block_size,
                num_blocks=(tokens + block_size - 1) // block_size + 1,
                padding=min(padding, tokens))


# ---------------------------------------------------------------------------------------
# torch.compile (fake kernels registered by sm7x.ops)


def _model(x, residual, w, positions, cache, kc, vc, slots):
    h = ops.rms_norm(x, w)
    x2, r2 = ops.fused_add_rms_norm(h, residual, w)
    up = ops.silu_and_mul(torch.cat((x2, r2), dim=-1))
    q = up[:, :32].clone()
    k = up[:, 32:48].clone()
    ops.rotary_embedding(positions, q, k, 16, cache, True)
    ops.reshape_and_cache(k.view(-1, 1, 16), k.view(-1, 1, 16), kc, vc, slots)
    return q * 2, r2 + 1


def _model_inputs(device):
    torch.manual_seed(0)
    return (torch.randn(6, 64, device=device), torch.randn(6, 64, device=device),
            torch.randn(64, device=device), torch.arange(6, device=device),
            make_cache(8, 16, torch.float32, device), torch.zeros(2, 16, 1, 16, device=device),
            torch.zeros(2, 16, 1, 16, device=device), torch.tensor([3, -1, 17, 0, 9, 30], device=device))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile(device, backend):
    torch._dynamo.reset()
    eager_in = _model_inputs(device)
    compiled_in = _model_inputs(device)
    expected = _model(*eager_in)
    actual = torch.compile(_model, backend=backend, fullgraph=True)(*compiled_in)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    # Mutated inputs (residual, caches) were written back by the compiled graph too.
    for i in (1, 5, 6):
        torch.testing.assert_close(compiled_in[i], eager_in[i])


def test_fake_tensors_and_meta(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 64, device=device, dtype=torch.float16)
        out = ops.rms_norm(x, torch.empty(64, device=device, dtype=torch.float16))
        assert out.shape == (4, 64) and out.dtype == torch.float16
        assert ops.silu_and_mul(x).shape == (4, 32)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_first_use_inside_compiled_function():
    # A fresh process whose first sm7x call happens while dynamo traces (fullgraph):
    # load_library() is a constant to dynamo, so loading causes no graph break.
    code = textwrap.dedent("""
        import torch, sm7x.ops as ops
        f = torch.compile(lambda x, w: ops.rms_norm(x, w) * 2, backend="eager", fullgraph=True)
        x, w = torch.randn(3, 16), torch.rand(16)
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * 2
        torch.testing.assert_close(f(x, w), ref)
        print("OK")
    """)
    env = dict(os.environ)
    lib = _core_loader.core_library_path()
    env[_core_loader.LIBRARY_PATH_ENV] = str(lib.parent)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_cpu_fp16_paths_agree(tmp_path):
    # fp16 on CPU runs through F16C conversions where the CPU has them; the software
    # conversions (SM7X_CPU_NO_F16C=1) must give bit-identical results.
    code = textwrap.dedent("""
        import sys, torch, sm7x.ops as ops
        g = torch.Generator().manual_seed(0)
        x = torch.randn(7, 96, generator=g).half()
        r = torch.randn(7, 96, generator=g).half()
        w = torch.randn(96, generator=g).half()
        q = torch.randn(7, 4 * 24, generator=g).half()
        k = torch.randn(7, 2 * 24, generator=g).half()
        cache = torch.randn(16, 16, generator=g)
        pos = torch.randint(0, 16, (7,), generator=g)
        outs = [ops.rms_norm(x, w), ops.silu_and_mul(x)]
        outs += list(ops.fused_add_rms_norm(x.clone(), r.clone(), w))
        outs += list(ops.rotary_embedding(pos, q.clone(), k.clone(), 24, cache, True))
        outs += list(ops.rotary_embedding(pos, q.clone(), k.clone(), 24, cache.half(), False))
        torch.save(outs, sys.argv[1])
    """)
    lib = _core_loader.core_library_path()
    results = []
    for flag in ("0", "1"):
        env = dict(os.environ, SM7X_CPU_NO_F16C=flag)
        env[_core_loader.LIBRARY_PATH_ENV] = str(lib.parent)
        out = tmp_path / f"out{flag}.pt"
        proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(torch.load(out))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# The loader and the library file.


def test_loader_uses_env_path_first_and_never_cwd(tmp_path, monkeypatch):
    (tmp_path / "env").mkdir()
    fake = tmp_path / "env" / _core_loader.LIBRARY_NAME
    fake.write_bytes(b"")
    monkeypatch.setenv(_core_loader.LIBRARY_PATH_ENV, os.pathsep.join(["", str(tmp_path / "env")]))
    assert _core_loader.core_library_path() == fake
    # An empty entry does not mean cwd; a library lying in cwd is never picked.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / _core_loader.LIBRARY_NAME).write_bytes(b"")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv(_core_loader.LIBRARY_PATH_ENV, "")
    found = _core_loader.core_library_path()
    assert found is None or found.parent != cwd


def test_loader_loaded_once():
    ops.load_library()
    path = _core_loader.loaded_path()
    assert path is not None and path.name == _core_loader.LIBRARY_NAME
    assert _core_loader.load() is path  # no second load


def test_torch_ops_namespace_is_filled_by_load_library():
    """What README says to code that calls torch.ops.sm7x.* directly: empty in a fresh
    process, filled by sm7x.ops.load_library() (README, "The loader")."""
    code = ("import torch, sm7x.ops\n"
            "before = hasattr(torch.ops.sm7x, 'rms_norm')\n"
            "sm7x.ops.load_library()\n"
            "x, w = torch.randn(3, 8), torch.rand(8)\n"
            "out = torch.empty_like(x)\n"
            "torch.ops.sm7x.rms_norm(out, x, w, 1e-6)\n"
            "torch.testing.assert_close(out, sm7x.ops.rms_norm(x, w, 1e-6))\n"
            "print(before)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"


def test_missing_library_message(tmp_path, monkeypatch):
    monkeypatch.setattr(_core_loader, "search_dirs", lambda: [tmp_path])
    monkeypatch.setattr(_core_loader.importlib.util, "find_spec", lambda name: None)
    assert _core_loader.core_library_path() is None
    monkeypatch.setattr(_core_loader, "_loaded", None)
    monkeypatch.setattr(_core_loader, "_registered", lambda torch: False)
    with pytest.raises(_core_loader.MissingCoreLibraryError,
                       match=r"_core.abi3.so \(package sm7x-core\) is not installed.*SM7X_LIBRARY_PATH"):
        _core_loader.load()


def _dynamic_symbols(path):
    elftools = pytest.importorskip("elftools.elf.elffile", reason="needs pyelftools")
    with open(path, "rb") as f:
        elf = elftools.ELFFile(f)
        dyn = elf.get_section_by_name(".dynamic")
        needed = [t.needed for t in dyn.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
        undefined = [s.name for s in elf.get_section_by_name(".dynsym").iter_symbols()
                     if s.name and s["st_shndx"] == "SHN_UNDEF"]
    return needed, undefined


def test_loader_and_bench_packages_do_not_import_torch():
    code = ("import sys, sm7x, sm7x._core_loader, sm7x.bench, sm7x.bench.__main__; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_bench_cli_smoke(tmp_path):
    # The benchmark's own logic on CPU (timings meaningless); the real run is on CUDA.
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    env = dict(os.environ)
    env[_core_loader.LIBRARY_PATH_ENV] = str(_core_loader.core_library_path().parent)
    proc = subprocess.run(
        [sys.executable, "-m", "sm7x.bench", "core", "--device", "cpu", "--tokens", "16,32",
         "--hidden", "64", "--iters", "1", "--repeats", "1", "--out", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads(out.read_text())
    ops_seen = {r["op"] for r in result["results"]}
    assert ops_seen == {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
                        "reshape_and_cache"}
    for r in result["results"]:
        assert r["sm7x_gbps"] > 0 and r["torch_gbps"] > 0 and r["copy_gbps"] > 0
        assert r["max_abs_err"] < 0.05, r
    assert "speedup" in proc.stdout
    assert png.is_file() or "matplotlib is not installed" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "sm7x.bench", "nope"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "core" in bad.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="ELF checks")
def test_library_uses_only_stable_c_shims():
    path = _core_loader.core_library_path()
    needed, undefined = _dynamic_symbols(path)
    # Only libtorch_cpu.so (holds the C shims); never libtorch_cuda (CPU-only torch must
    # load it), libc10, libtorch.so, libtorch_python, libcudart or libpython.
    torch_libs = [n for n in needed if "torch" in n or "c10" in n or "cudart" in n or "python" in n]
    assert torch_libs == ["libtorch_cpu.so"], needed
    shims = [s for s in undefined if s.startswith(("aoti_torch_", "torch_"))]
    assert shims and "aoti_torch_get_current_cuda_stream" not in shims
    # No C++ symbol of torch/c10/ATen (mangled names in namespaces c10, at, torch).
    cxx_torch = [s for s in undefined if re.match(r"_Z(N|NK|TI|TV|TS)?(3c10|2at|5torch)", s)]
    assert not cxx_torch, cxx_torch
    assert not [s for s in undefined if s.startswith("Py")], "uses the Python C API"
    if shutil.which("nm"):  # the same with binutils, demangled, as a person would check
        out = subprocess.run(["nm", "-D", "-C", "--undefined-only", str(path)],
                             capture_output=True, text=True, check=True).stdout
        assert not re.search(r"\b(c10|at|torch)::", out), out
