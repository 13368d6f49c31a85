"""Property: every public entry point, given arbitrary (mostly bad) arguments, either raises a
clear error that names sm7x and the argument's op, or returns what the float32 reference
computes; never another exception type, a crash or a silently wrong result.

CPU paths: the core ops through their Python wrappers and through torch.ops.sm7x directly,
and the FA2 Python API (on CPU every FA2 call must end in a clear refusal: the kernels run
on CUDA only). The core ops' property on CUDA: tests/gpu/test_core_properties.py; the FA2
GPU paths: tests/gpu/test_fa2_properties.py.

Each example starts from a valid call and replaces some arguments with a mutation: another
dtype or rank, a transposed, expanded or sliced view, an empty tensor, a tensor sharing an
output's memory, or a non-tensor (None, an int, a str, a float).
"""

from __future__ import annotations

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"the core ops need torch >= {torch_min()}")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from sm7x import _core_loader  # noqa: E402

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
CLEAR = (ValueError, TypeError, RuntimeError)


def mutate(kind: str, t, other):
    """One bad (or unusual but valid) replacement for tensor argument t."""
    if kind == "dtype":
        return t.to(torch.float64 if t.is_floating_point() else torch.int16)
    if kind == "int_dtype":
        return t.to(torch.int32) if t.is_floating_point() else t.float()
    if kind == "rank_up":
        return t.unsqueeze(0)
    if kind == "rank_down":
        return t.reshape(-1) if t.dim() > 1 else (t[0] if t.numel() else t.sum())
    if kind == "transpose":
        return t.transpose(0, -1) if t.dim() > 1 else t
    if kind == "expand":
        return t[:1].expand(t.shape) if t.dim() and t.shape[0] > 1 else t
    if kind == "slice":
        return t[..., : max(t.shape[-1] - 1, 0)] if t.dim() else t
    if kind == "empty":
        return t[:0] if t.dim() else t
    if kind == "alias":  # another argument's memory
        fits = other.is_contiguous() and other.numel() >= t.numel() and other.dtype == t.dtype
        return other.view(-1)[: t.numel()].view(t.shape) if fits else t
    if kind == "none":
        return None
    if kind == "int":
        return 3
    if kind == "str":
        return "x"
    if kind == "float":
        return 1.5
    if kind == "cpu":  # a CPU tensor among CUDA ones
        return t.cpu()
    return t


KINDS = ["dtype", "int_dtype", "rank_up", "rank_down", "transpose", "expand", "slice",
         "empty", "alias", "none", "int", "str", "float", "keep"]
SCALARS = [None, "x", -1.0, float("nan"), float("inf"), 0, 2, True, 1e-6, 8, 16, 1.5]


def _clone(v):
    return v.clone() if isinstance(v, torch.Tensor) else v


def check_clear(exc: BaseException, direct: bool, op: str) -> None:
    assert isinstance(exc, CLEAR), f"{type(exc).__name__}: {exc}"
    msg = str(exc)
    if direct:  # sm7x's own check, or torch's schema check naming the argument
        assert f"sm7x.{op}" in msg or f"sm7x::{op}" in msg, msg
    else:
        assert msg.startswith(f"sm7x.{op}:") or msg.startswith("sm7x."), msg


# ---------------------------------------------------------------------------------------
# Core ops: valid calls, their references, and what each writes

if _core_loader.core_library_path() is not None:
    from sm7x import ops
    from sm7x.bench import reference as ref

    ops.load_library()


def core_case(op: str, g: torch.Generator, device: str = "cpu"):
    """(args dict in the direct op's order, reference fn(args) -> expected outputs dict), the
    tensors on ``device``."""
    a, reference = _core_case(op, g)
    return {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in a.items()}, reference


def _core_case(op: str, g: torch.Generator):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if op == "rms_norm":
        a = dict(out=torch.empty(3, 8), x=r(3, 8), weight=r(8), eps=1e-6)
        return a, lambda a: {"out": ref.rms_norm(a["x"].float(), a["weight"].float(), a["eps"])}
    if op == "fused_add_rms_norm":
        a = dict(x=r(3, 8), residual=r(3, 8), weight=r(8), eps=1e-6)
        return a, lambda a: dict(zip(("x", "residual"), ref.fused_add_rms_norm(
            a["x"], a["residual"], a["weight"], a["eps"])))
    if op == "silu_and_mul":
        a = dict(out=torch.empty(3, 4), x=r(3, 8))
        return a, lambda a: {"out": ref.silu_and_mul(a["x"])}
    if op == "rotary_embedding":
        a = dict(positions=torch.tensor([0, 3, 1]), query=r(3, 16), key=r(3, 8), head_size=8,
                 cos_sin_cache=r(4, 8), is_neox=True)
        return a, lambda a: dict(zip(("query", "key"), ref.rotary_embedding(
            a["positions"], a["query"], a["key"], a["head_size"], a["cos_sin_cache"],
            a["is_neox"])))
    if op == "reshape_and_cache":
        a = dict(key=r(3, 2, 8), value=r(3, 2, 8), key_cache=torch.zeros(2, 4, 2, 8),
                 value_cache=torch.zeros(2, 4, 2, 8), slot_mapping=torch.tensor([0, 5, -1]))
        return a, lambda a: dict(zip(("key_cache", "value_cache"), ref.reshape_and_cache(
            a["key"], a["value"], a["key_cache"], a["value_cache"], a["slot_mapping"])))
    raise AssertionError(op)


def call_wrapper(op, a):
    if op == "rms_norm":
        return {"out": ops.rms_norm(a["x"], a["weight"], a["eps"], out=a["out"])}
    if op == "fused_add_rms_norm":
        return dict(zip(("x", "residual"), ops.fused_add_rms_norm(a["x"], a["residual"],
                                                                  a["weight"], a["eps"])))
    if op == "silu_and_mul":
        return {"out": ops.silu_and_mul(a["x"], out=a["out"])}
    if op == "rotary_embedding":
        return dict(zip(("query", "key"), ops.rotary_embedding(
            a["positions"], a["query"], a["key"], a["head_size"], a["cos_sin_cache"],
            a["is_neox"])))
    ops.reshape_and_cache(**a)
    return {"key_cache": a["key_cache"], "value_cache": a["value_cache"]}


WRITTEN = {"rms_norm": ("out",), "fused_add_rms_norm": ("x", "residual"),
           "silu_and_mul": ("out",), "rotary_embedding": ("query", "key"),
           "reshape_and_cache": ("key_cache", "value_cache")}
CORE_OPS = list(WRITTEN)
COUNTS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    if COUNTS:  # shown with -s: how many bad calls were refused, how many computed
        for (op, direct, outcome), n in sorted(COUNTS.items()):
            print(f"fuzz {op} {'torch.ops' if direct else 'wrapper'}: {n} {outcome}")


@pytest.mark.skipif(_core_loader.core_library_path() is None, reason="_core not built")
@pytest.mark.parametrize("op", CORE_OPS)
@pytest.mark.parametrize("direct", [False, True], ids=["wrapper", "torch.ops"])
@SETTINGS
@given(data=st.data())
def test_core_op_bad_inputs(op, direct, data):
    check_core_op_bad_inputs(op, direct, data, "cpu")


def check_core_op_bad_inputs(op, direct, data, device, kinds=KINDS):
    """The property on ``device`` (tests/gpu/test_core_properties.py runs it on CUDA, with a
    CPU tensor among the mutations)."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    a, reference = core_case(op, g, device)
    names = list(a)
    for name in data.draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        if isinstance(a[name], torch.Tensor):
            other = a[data.draw(st.sampled_from([n for n in names
                                                 if isinstance(a[n], torch.Tensor)]))]
            a[name] = mutate(data.draw(st.sampled_from(kinds)), a[name], other)
        else:
            a[name] = data.draw(st.sampled_from(SCALARS))
    before = {n: _clone(v) for n, v in a.items()}
    try:
        got = (getattr(torch.ops.sm7x, op)(*a.values()) if direct else call_wrapper(op, a))
    except Exception as exc:  # noqa: BLE001 - the property is about which
        check_clear(exc, direct, op)
        COUNTS[(op, direct, "refused")] = COUNTS.get((op, direct, "refused"), 0) + 1
        return
    if direct:
        got = {n: a[n] for n in WRITTEN[op] if a[n] is not None}
    # on CPU: an index the op let through must fail here, not as a device-side assert
    want = reference({n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in before.items()})
    for n, w in want.items():
        if w is None:
            continue
        t = got[n]
        assert t.shape == w.shape, (op, n, t.shape, w.shape)
        torch.testing.assert_close(t.float().cpu(), w.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{op} {n} accepted bad input, wrong: {m}")
    COUNTS[(op, direct, "computed")] = COUNTS.get((op, direct, "computed"), 0) + 1


# ---------------------------------------------------------------------------------------
# FA2 API on the CPU: always a clear refusal


FA2_SCALARS = [None, "x", -1, 0, 1, 7, 2.5, float("nan"), (-1, -1), (1, "a"), 5, True]


@pytest.mark.parametrize("entry", ["flash_attn_func", "flash_attn_varlen_func",
                                   "flash_attn_with_kvcache", "plan_decode"])
@SETTINGS
@given(data=st.data())
def test_fa2_api_bad_inputs_on_cpu(entry, data):
    from sm7x import fa2

    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    h = lambda *s: torch.randn(*s, generator=g).half()  # noqa: E731
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    if entry == "flash_attn_func":
        a = dict(q=h(2, 5, 4, 64), k=h(2, 7, 2, 64), v=h(2, 7, 2, 64), softmax_scale=None,
                 causal=True, window_size=(-1, -1), softcap=0.0)
    elif entry == "flash_attn_varlen_func":
        a = dict(q=h(9, 4, 64), k=h(11, 2, 64), v=h(11, 2, 64), cu_seqlens_q=i32(0, 4, 9),
                 cu_seqlens_k=i32(0, 5, 11), max_seqlen_q=5, max_seqlen_k=6, causal=True,
                 block_table=None, seqused_k=None)
    elif entry == "flash_attn_with_kvcache":
        a = dict(q=h(2, 1, 4, 64), k_cache=h(4, 16, 2, 64), v_cache=h(4, 16, 2, 64),
                 cache_seqlens=i32(3, 9), block_table=i32(0, 1, 2, 3).view(2, 2), causal=True,
                 num_splits=0)
    else:
        a = dict(batch_size=2, max_seqlen_q=1, max_seqlen_k=64, num_heads=4, num_kv_heads=2,
                 head_dim=64, device="cpu")
    names = list(a)
    for name in data.draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        if isinstance(a[name], torch.Tensor):
            a[name] = mutate(data.draw(st.sampled_from(KINDS)), a[name], a[names[0]])
        else:
            a[name] = data.draw(st.sampled_from(FA2_SCALARS))
    with pytest.raises(CLEAR) as info:
        getattr(fa2, entry)(**a)
    assert str(info.value).startswith("sm7x"), f"{type(info.value).__name__}: {info.value}"
