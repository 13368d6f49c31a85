"""The FA2 backward kernels alone: torch.ops.<ns>.bwd / bwd_varlen called directly (no
autograd layer), fed with the library's own forward (out, lse), against the gradients of
a float32 reference computed by torch autograd.

Marked `gpu`; skips without CUDA, without a library for the device, or where the library
has no backward for a head dim (bwd_supported). On the H200 force an arch:

    SM7X_LIBRARY_PATH=<dir with _fa2_sm75.abi3.so> SM7X_FA2_FORCE=sm75 \\
        python -m pytest tests/gpu/test_fa2_bwd_kernels.py -q
"""

from __future__ import annotations

import math

import pytest

from fa2_arch import fa2_arch_or_skip

ARCH = fa2_arch_or_skip()

import torch  # noqa: E402

from fa2_reference import visible_keys  # noqa: E402

import sm7x.fa2 as fa2  # noqa: E402
from sm7x import _select  # noqa: E402

pytestmark = pytest.mark.gpu

NS = f"sm7x_fa2_{ARCH}"


def _ops():
    try:
        return getattr(torch.ops, NS).bwd and getattr(torch.ops, NS)
    except (AttributeError, RuntimeError):
        torch.ops.load_library(str(_select.library_path(ARCH)))
        return getattr(torch.ops, NS)


OPS = _ops()


def _need_bwd(d):
    if not OPS.bwd_supported(d):
        pytest.skip(f"{ARCH}: no backward for head dim {d} (bwd_supported is False)")


def _ref_out(q, k, v, scale, causal, window, softcap):
    """float32 attention [b, s, h, d] with bottom-right masks; rows without keys give 0 and
    no NaN in autograd."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))
    if hk != h:
        kf = kf.repeat_interleave(h // hk, dim=1)
        vf = vf.repeat_interleave(h // hk, dim=1)
    s = qf @ kf.transpose(-1, -2)
    s = softcap * torch.tanh(s * scale / softcap) if softcap > 0 else s * scale
    ok = visible_keys(sq, sk, causal, window, q.device)
    has = ok.any(-1)
    s = torch.where(ok, s, torch.where(has[:, None], float("-inf"), 0.0))
    p = torch.softmax(s, dim=-1) * has[:, None]
    return (p @ vf).transpose(1, 2)


def _ref_grads(q, k, v, dout, scale, causal, window, softcap):
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = _ref_out(qf, kf, vf, scale, causal, window, softcap)
    out.backward(dout.float())
    return qf.grad, kf.grad, vf.grad


WORST: dict[str, float] = {}


def _close(tag, name, got, ref):
    assert torch.isfinite(got).all(), f"{tag}: non-finite {name}"
    err = (got.float() - ref).abs().max().item() if got.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    WORST[name] = max(WORST.get(name, 0.0), err / max(scale, 1e-3))
    assert err <= 2e-3 + 1e-2 * scale, f"{tag}: max |{name} - ref| = {err} (max |ref| {scale})"


def _inputs(b, sq, sk, h, hk, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=g)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d), mk(b, sq, h, d)


def dirty_accum(q):
    """dq_accum as the op gets it from torch.empty: NaN everywhere, so that a dq summed into
    anything the op did not zero itself fails the comparison (and the deterministic path,
    which must not read it, would too)."""
    return torch.full(q.shape, float("nan"), device="cuda", dtype=torch.float32)


def _run(q, k, v, dout, scale, causal, window, softcap, deterministic, dq_accum=None):
    b, sq, h, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, h, sq, device="cuda", dtype=torch.float32)
    OPS.fwd(q, k, v, out, lse, scale, causal, window[0], window[1], softcap)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq_accum = dirty_accum(q) if dq_accum is None else dq_accum
    dsum = torch.empty_like(lse)
    OPS.bwd(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, scale, causal, window[0],
            window[1], softcap, deterministic)
    return dq, dk, dv


def check(d, sq, sk, h, hk, causal=False, window=(-1, -1), softcap=0.0, deterministic=False,
          b=2):
    _need_bwd(d)
    q, k, v, dout = _inputs(b, sq, sk, h, hk, d)
    scale = 1.0 / math.sqrt(d)
    dq, dk, dv = _run(q, k, v, dout, scale, causal, window, softcap, deterministic)
    rq, rk, rv = _ref_grads(q, k, v, dout, scale, causal, window, softcap)
    tag = (f"{ARCH} d={d} sq={sq} sk={sk} h={h}/{hk} causal={causal} window={window} "
           f"softcap={softcap} det={deterministic}")
    _close(tag, "dq", dq, rq)
    _close(tag, "dk", dk, rk)
    _close(tag, "dv", dv, rv)


HEAD_DIMS = sorted(set(fa2.COMPILED_HEAD_DIMS)) + [40, 72, 120]  # + dims that run padded
SEQS = [(1, 1), (8, 8), (77, 77), (1, 300), (300, 1), (333, 333), (200, 600), (600, 200)]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("sq,sk", SEQS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_matches_reference(d, sq, sk, causal, deterministic):
    check(d, sq, sk, 4, 4, causal=causal, deterministic=deterministic)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hk", [1, 2, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_gqa(d, hk, causal):
    check(d, 257, 319, 8, hk, causal=causal)


@pytest.mark.parametrize("window", [(16, 0), (100, 50), (-1, 7), (0, 0), (300, -1)])
@pytest.mark.parametrize("sq,sk", [(333, 333), (200, 600), (600, 200)])
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_window(window, sq, sk, d):
    check(d, sq, sk, 4, 2, window=window)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_softcap(d, causal, deterministic):
    check(d, 200, 300, 4, 2, causal=causal, softcap=5.0, deterministic=deterministic)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_bwd_deterministic_is_bitwise(d):
    _need_bwd(d)
    q, k, v, dout = _inputs(2, 700, 900, 8, 2, d, seed=3)
    scale = 1.0 / math.sqrt(d)
    first = _run(q, k, v, dout, scale, True, (-1, -1), 0.0, True)
    for _ in range(3):
        again = _run(q, k, v, dout, scale, True, (-1, -1), 0.0, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_varlen(d, causal, deterministic):
    _need_bwd(d)
    lq, lk = [1, 77, 130, 0, 64], [5, 77, 300, 9, 64]
    h, hk = 4, 2
    q_all, k_all, v_all, do_all = _inputs(1, sum(lq), sum(lk), h, hk, d, seed=1)
    q, k, v, dout = q_all[0], k_all[0], v_all[0], do_all[0]
    cq = torch.tensor([0] + lq, device="cuda").cumsum(0).int()
    ck = torch.tensor([0] + lk, device="cuda").cumsum(0).int()
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    lse = torch.empty(h, q.shape[0], device="cuda", dtype=torch.float32)
    OPS.fwd_varlen(q, k, v, out, lse, cq, ck, max(lq), max(lk), scale, causal, -1, -1, 0.0)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq_accum = dirty_accum(q)
    dsum = torch.empty_like(lse)
    OPS.bwd_varlen(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, cq, ck, max(lq),
                   max(lk), scale, causal, -1, -1, 0.0, deterministic)
    for i in range(len(lq)):
        qs, qe, ks, ke = cq[i].item(), cq[i + 1].item(), ck[i].item(), ck[i + 1].item()
        rq, rk, rv = _ref_grads(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                                dout[None, qs:qe], scale, causal, (-1, -1), 0.0)
        tag = f"{ARCH} varlen d={d} seq {i} ({qe - qs}, {ke - ks}) causal={causal}"
        _close(tag, "dq", dq[qs:qe], rq[0])
        _close(tag, "dk", dk[ks:ke], rk[0])
        _close(tag, "dv", dv[ks:ke], rv[0])


def test_bwd_strided_inputs():
    """q/k/v as views of a packed qkv, dout a transposed view: strides the op accepts."""
    d = 64
    _need_bwd(d)
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(2, 150, 3, 4, d, device="cuda", dtype=torch.float16, generator=g)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = torch.randn(2, 4, 150, d, device="cuda", dtype=torch.float16,
                       generator=g).transpose(1, 2)
    scale = 1.0 / math.sqrt(d)
    dq, dk, dv = _run(q, k, v, dout, scale, True, (-1, -1), 0.0, False)
    rq, rk, rv = _ref_grads(q, k, v, dout, scale, True, (-1, -1), 0.0)
    _close("strided", "dq", dq, rq)
    _close("strided", "dk", dk, rk)
    _close("strided", "dv", dv, rv)


def test_bwd_rejects_bad_dq_accum():
    _need_bwd(64)
    q, k, v, dout = _inputs(1, 16, 16, 2, 2, 64)
    out = torch.empty_like(q)
    lse = torch.empty(1, 2, 16, device="cuda")
    with pytest.raises(RuntimeError, match="dq_accum"):
        OPS.bwd(dout, q, k, v, out, lse, torch.empty_like(q), torch.empty_like(k),
                torch.empty_like(v), torch.zeros(q.shape, device="cuda", dtype=torch.float16),
                torch.empty_like(lse), 0.125, False, -1, -1, 0.0, False)


def _bwd_entry(d):
    """targets.json's backward entry that head dim d runs on (the smallest compiled >= d)."""
    from sm7x import _targets

    entries = _targets.load()["fa2"]["bwd_kernels"][ARCH]
    return min((e for e in entries if e["head_dim"] >= d), key=lambda e: e["head_dim"])


@pytest.mark.parametrize("d", [64, 120, 128])
def test_bwd_dq_accum_only_where_the_op_sums_into_it(d):
    """bwd_uses_dq_accum(d) is true where a non-deterministic call sums dQ in dq_accum (an
    entry without dq_pass): there an empty dq_accum is refused, naming it; a dq_pass head
    dim, and any deterministic call, takes an empty one and gives the reference gradients."""
    _need_bwd(d)
    uses = bool(OPS.bwd_uses_dq_accum(d))
    assert uses == (not _bwd_entry(d).get("dq_pass", False))
    q, k, v, dout = _inputs(2, 200, 300, 4, 2, d, seed=7)
    scale = 1.0 / math.sqrt(d)
    empty = torch.empty(0, device="cuda", dtype=torch.float32)
    rq, rk, rv = _ref_grads(q, k, v, dout, scale, True, (-1, -1), 0.0)
    for deterministic in (False, True):
        if uses and not deterministic:
            with pytest.raises(RuntimeError, match="dq_accum is empty"):
                _run(q, k, v, dout, scale, True, (-1, -1), 0.0, False, dq_accum=empty)
            continue
        dq, dk, dv = _run(q, k, v, dout, scale, True, (-1, -1), 0.0, deterministic,
                          dq_accum=empty)
        tag = f"{ARCH} d={d} empty dq_accum det={deterministic}"
        _close(tag, "dq", dq, rq)
        _close(tag, "dk", dk, rk)
        _close(tag, "dv", dv, rv)


def test_report_worst():
    print(f"\n{ARCH} backward worst max|err| / max|ref|: "
          + ", ".join(f"{k} {v:.2e}" for k, v in sorted(WORST.items())))
