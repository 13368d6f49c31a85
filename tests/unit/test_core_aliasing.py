"""The core ops that write refuse outputs whose elements overlap and outputs that overlap
another tensor of the call, in the Python wrappers (ValueError) and again in the C++ op for
direct torch.ops calls (RuntimeError); arguments of the wrong type are named. Each case was
accepted before these checks (the rotary one then returned a wrong result).
"""

from __future__ import annotations

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"the core ops need torch >= {torch_min()}")
from sm7x import _core_loader  # noqa: E402

if _core_loader.core_library_path() is None:
    pytest.skip(f"{_core_loader.LIBRARY_NAME} is not built", allow_module_level=True)

from sm7x import ops  # noqa: E402

ops.load_library()
OP = torch.ops.sm7x


def both(call_py, call_op, match):
    """The wrapper raises ValueError and the direct op RuntimeError, with one message."""
    with pytest.raises(ValueError, match=match):
        call_py()
    with pytest.raises(RuntimeError, match=match):
        call_op()


def rotary_args(tokens=4, heads=2, hs=8):
    pos = torch.arange(tokens)
    cache = torch.randn(16, hs)
    return pos, cache, hs


def test_rotary_expanded_query_is_refused():
    """[T, H, hs] with stride 0 over tokens: every token would rotate the same row again."""
    pos, cache, hs = rotary_args()
    q = torch.randn(1, 2, hs).expand(4, 2, hs)
    both(lambda: ops.rotary_embedding(pos, q, None, hs, cache),
         lambda: OP.rotary_embedding(pos, q, None, hs, cache, True),
         r"query .* elements may share memory")


def test_rotary_query_overlapping_key_is_refused():
    pos, cache, hs = rotary_args()
    buf = torch.randn(4 * 16 + 8)
    q, k = buf[:64].view(4, 16), buf[8:72].view(4, 16)
    both(lambda: ops.rotary_embedding(pos, q, k, hs, cache),
         lambda: OP.rotary_embedding(pos, q, k, hs, cache, True),
         r"query overlaps key")


def test_rotary_column_slices_of_one_qkv_buffer_pass():
    """q and k as column slices of a fused qkv projection interleave but share nothing."""
    pos, cache, hs = rotary_args()
    qkv = torch.randn(4, 48)
    q, k = qkv[:, :16], qkv[:, 16:32]
    want_q, want_k = q.clone(), k.clone()
    ops.rotary_embedding(pos, want_q, want_k, hs, cache)
    ops.rotary_embedding(pos, q, k, hs, cache)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_fused_add_rms_norm_partly_overlapping_is_refused():
    buf = torch.randn(40)
    x, res, w = buf[:32].view(4, 8), buf[8:40].view(4, 8), torch.ones(8)
    both(lambda: ops.fused_add_rms_norm(x, res, w),
         lambda: OP.fused_add_rms_norm(x, res, w, 1e-6),
         r"x overlaps residual in memory")


def test_rms_norm_out_partly_over_x_is_refused_in_place_is_allowed():
    buf = torch.randn(40)
    x, out, w = buf[:32].view(4, 8), buf[8:40].view(4, 8), torch.ones(8)
    both(lambda: ops.rms_norm(x, w, out=out), lambda: OP.rms_norm(out, x, w, 1e-6),
         r"out overlaps x in memory")
    x = torch.randn(4, 8)
    want = ops.rms_norm(x, w)
    assert ops.rms_norm(x, w, out=x) is x and torch.allclose(x, want)  # in place


def test_rms_norm_out_over_weight_is_refused():
    x, w = torch.randn(1, 8), torch.ones(8)
    both(lambda: ops.rms_norm(x, w, out=w.view(1, 8)), lambda: OP.rms_norm(w.view(1, 8), x, w, 1e-6),
         r"out overlaps weight")


def test_silu_and_mul_out_over_x_is_refused():
    x = torch.randn(4, 16)
    out = x.view(-1)[:32].view(4, 8)
    both(lambda: ops.silu_and_mul(x, out=out), lambda: OP.silu_and_mul(out, x),
         r"out overlaps x")


def test_reshape_and_cache_expanded_or_shared_caches_are_refused():
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([0, 5, 9])
    kc = torch.zeros(1, 4, 2, 8).expand(4, 4, 2, 8)  # every block the same memory
    vc = torch.zeros(4, 4, 2, 8)
    both(lambda: ops.reshape_and_cache(key, value, kc, vc, slots),
         lambda: OP.reshape_and_cache(key, value, kc, vc, slots),
         r"key_cache .* elements may share memory")
    both(lambda: ops.reshape_and_cache(key, value, vc, vc, slots),
         lambda: OP.reshape_and_cache(key, value, vc, vc, slots),
         r"key_cache overlaps value_cache")


def test_reshape_and_cache_vllm_packed_halves_pass():
    """vLLM's cache packs K and V in the last dim: two interleaved views of one tensor."""
    packed = torch.zeros(4, 4, 2, 16)
    kc, vc = packed.split(8, dim=-1)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ops.reshape_and_cache(key, value, kc, vc, torch.tensor([0, 5, 9]))
    assert torch.equal(kc[1, 1], key[1]) and torch.equal(vc[2, 1], value[2])


@pytest.mark.parametrize("call, match", [
    (lambda: ops.rms_norm(torch.randn(2, 8), torch.ones(8), eps="x"),
     "eps must be a number, got str"),
    (lambda: ops.fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8),
                                    eps=None), "eps must be a number, got NoneType"),
    (lambda: ops.rotary_embedding(torch.arange(2), torch.randn(2, 8), None, "8",
                                  torch.randn(4, 8)), "head_size must be an int, got str"),
    (lambda: ops.rotary_embedding(torch.arange(2), torch.randn(2, 8), None, 8,
                                  torch.randn(4, 8), is_neox="yes"),
     "is_neox must be a bool, got str"),
])
def test_wrong_argument_types_are_named(call, match):
    with pytest.raises(TypeError, match=match):
        call()
