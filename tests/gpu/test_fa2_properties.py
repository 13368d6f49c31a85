"""Properties of the FA2 GPU paths, with hypothesis: every valid call equals the float32
reference (fa2_reference.py), and a call with one argument broken raises a clear sm7x
error (ValueError / TypeError / RuntimeError whose message starts with "sm7x."), never a
crash, a hang or a silently wrong result. The CPU half (core ops, FA2 refusals on CPU) is
tests/unit/test_fuzz_entry_points.py.

Marked `gpu`; tests whichever library the device selects (SM7X_FA2_FORCE on GPUs newer
than Turing), like test_fa2_serving.py. Examples are derandomized: a run is repeatable.
"""

from __future__ import annotations

import pytest

from fa2_arch import fa2_arch_or_skip

ARCH = fa2_arch_or_skip()
hypothesis = pytest.importorskip("hypothesis")

import torch  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings, strategies as st  # noqa: E402

from fa2_reference import _compare, reference  # noqa: E402

import sm7x.fa2  # noqa: E402
from sm7x.fa2 import flash_attn_func, flash_attn_varlen_func  # noqa: E402

pytestmark = pytest.mark.gpu
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CLEAR = (ValueError, TypeError, RuntimeError)


def _randn(shape, g):
    return torch.randn(*shape, device="cuda", dtype=torch.float16, generator=g)


windows = st.one_of(st.just((-1, -1)), st.tuples(st.integers(-1, 80), st.integers(-1, 80)))


@SETTINGS
@given(b=st.integers(1, 3), sq=st.integers(1, 300), sk=st.integers(1, 300),
       hk=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 4, 8]),
       d=st.sampled_from(list(range(8, 257, 8))), causal=st.booleans(), window=windows,
       softcap=st.sampled_from([0.0, 0.0, 30.0]), seed=st.integers(0, 1 << 16))
def test_any_valid_call_equals_the_reference(b, sq, sk, hk, group, d, causal, window, softcap, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = hk * group
    q, k, v = _randn((b, sq, h, d), g), _randn((b, sk, hk, d), g), _randn((b, sk, hk, d), g)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                  return_attn_probs=True)
    ref_out, ref_lse = reference(q, k, v, d ** -0.5, causal, window, softcap)
    _compare(f"{ARCH} property d={d}", out, lse, ref_out, ref_lse)


@SETTINGS
@given(lens=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), min_size=1, max_size=5),
       d=st.sampled_from([32, 64, 80, 96, 112, 128, 256]), group=st.sampled_from([1, 4]),
       causal=st.booleans(), seed=st.integers(0, 1 << 16))
def test_any_valid_varlen_call_equals_the_reference(lens, d, group, causal, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hk = 2
    h = hk * group
    lq, lk = [a for a, _ in lens], [c for _, c in lens]
    tq, tk = sum(lq), sum(lk)
    assume(tq > 0 and tk > 0)
    q, k, v = _randn((tq, h, d), g), _randn((tk, hk, d), g), _randn((tk, hk, d), g)
    cu = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                 device="cuda")
    cu_q, cu_k = cu(lq), cu(lk)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                         return_attn_probs=True)
    for i in range(len(lens)):
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        c, f = int(cu_k[i]), int(cu_k[i + 1])
        if e == a:
            continue
        ro, rl = reference(q[None, a:e], k[None, c:f], v[None, c:f], d ** -0.5, causal)
        _compare(f"{ARCH} property varlen d={d}", out[a:e][None], lse[:, a:e][None], ro, rl)


def _break(kind: str, t: torch.Tensor):
    """One bad replacement for an input tensor."""
    return {
        "float32": lambda: t.float(),
        "bfloat16": lambda: t.bfloat16(),
        "cpu": lambda: t.cpu(),
        "rank": lambda: t[0],
        "last_dim_strided": lambda: t.transpose(-1, -2),
        "head_dim_odd": lambda: t[..., :-3],
        "too_big_head_dim": lambda: torch.cat([t] * 3, dim=-1)[..., :264],
        "none": lambda: None,
        "int": lambda: 3,
    }[kind]()


BREAKS = ["float32", "bfloat16", "cpu", "rank", "last_dim_strided", "head_dim_odd",
          "too_big_head_dim", "none", "int"]


@SETTINGS
@given(which=st.sampled_from(["q", "k", "v"]), kind=st.sampled_from(BREAKS),
       causal=st.booleans(), seed=st.integers(0, 1 << 16))
def test_a_broken_tensor_gets_a_clear_error_or_the_right_result(which, kind, causal, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    args = {"q": _randn((2, 33, 4, 64), g), "k": _randn((2, 40, 2, 64), g),
            "v": _randn((2, 40, 2, 64), g)}
    args[which] = _break(kind, args[which])
    try:
        out = flash_attn_func(args["q"], args["k"], args["v"], causal=causal)
    except CLEAR as exc:
        assert str(exc).startswith("sm7x."), f"{type(exc).__name__}: {exc}"
        return
    # accepted (a strided last dim is copied): then it must be right
    ref, _ = reference(*(t.cuda().half().contiguous() for t in (args["q"], args["k"], args["v"])),
                       args["q"].shape[-1] ** -0.5, causal)
    assert (out.float() - ref).abs().max().item() <= 4e-3, (which, kind)


@SETTINGS
@given(name=st.sampled_from(["softmax_scale", "window_size", "softcap", "causal", "dropout_p"]),
       value=st.sampled_from([None, "x", -1.0, float("nan"), float("inf"), 0, (1,), (-2, 0),
                              (1.5, 2), 1e-6, 2, True]))
def test_a_bad_option_gets_a_clear_error_or_the_right_result(name, value):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = _randn((1, 17, 2, 32), g), _randn((1, 20, 2, 32), g), _randn((1, 20, 2, 32), g)
    try:
        out = flash_attn_func(q, k, v, **{name: value})
    except CLEAR as exc:
        assert str(exc).startswith("sm7x."), f"{type(exc).__name__}: {exc}"
        return
    opts = {"softmax_scale": 32 ** -0.5, "causal": False, "window": (-1, -1), "softcap": 0.0}
    if name == "softmax_scale" and value is not None:
        opts["softmax_scale"] = float(value)
    elif name == "window_size":
        opts["window"] = tuple(value)
    elif name == "softcap" and value is not None:
        opts["softcap"] = float(value)
    elif name == "causal":
        opts["causal"] = bool(value)
    ref, _ = reference(q, k, v, opts["softmax_scale"], opts["causal"], opts["window"], opts["softcap"])
    assert (out.float() - ref).abs().max().item() <= 4e-3, (name, value)


@SETTINGS
@given(kind=st.sampled_from(["int64", "short", "decreasing", "past_total", "max_too_small"]),
       seed=st.integers(0, 1 << 16))
def test_bad_cu_seqlens_get_a_clear_error(kind, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = _randn((30, 2, 64), g), _randn((30, 2, 64), g), _randn((30, 2, 64), g)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device="cuda")
    cu_q, max_q = {"int64": (cu.long(), 20), "short": (cu[:1], 20),
                   "decreasing": (torch.tensor([0, 20, 10], dtype=torch.int32, device="cuda"), 20),
                   "past_total": (torch.tensor([0, 10, 31], dtype=torch.int32, device="cuda"), 21),
                   "max_too_small": (cu, 5)}[kind]
    with pytest.raises(CLEAR) as e:
        flash_attn_varlen_func(q, k, v, cu_q, cu, max_q, 20)
    assert str(e.value).startswith("sm7x."), str(e.value)


@SETTINGS
@given(op=st.sampled_from(["fwd", "fwd_varlen"]), kind=st.sampled_from(BREAKS[:6]),
       seed=st.integers(0, 1 << 16))
def test_direct_op_calls_with_a_broken_tensor_get_the_ops_message(op, kind, seed):
    """torch.ops.sm7x_fa2_<arch>.* called directly: the op's own check, never a crash."""
    ops = sm7x.fa2._ops_for(torch.empty(1, device="cuda"))  # loads the library
    g = torch.Generator(device="cuda").manual_seed(seed)
    if op == "fwd":
        q, k, v = _randn((1, 16, 2, 64), g), _randn((1, 16, 2, 64), g), _randn((1, 16, 2, 64), g)
        out, lse = torch.empty_like(q), torch.empty(1, 2, 16, device="cuda")
        bad = _break(kind, q)
        call = lambda: ops.fwd(bad, k, v, out, lse, 0.125, False, -1, -1, 0.0)  # noqa: E731
    else:
        q, k, v = _randn((16, 2, 64), g), _randn((16, 2, 64), g), _randn((16, 2, 64), g)
        out, lse = torch.empty_like(q), torch.empty(2, 16, device="cuda")
        cu = torch.tensor([0, 16], dtype=torch.int32, device="cuda")
        bad = _break(kind, q)
        call = lambda: ops.fwd_varlen(bad, k, v, out, lse, cu, cu, 16, 16, 0.125, False, -1, -1, 0.0)  # noqa: E731
    with pytest.raises(RuntimeError) as e:
        call()
    assert f"sm7x.fa2_{ARCH}." in str(e.value), str(e.value)
