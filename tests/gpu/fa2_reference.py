"""What the FA2 GPU tests of every arch share: the float32 reference with flash-attn's
masks, input builders, the comparison and the worst-error record."""

from __future__ import annotations


import torch


WORST: dict[str, float] = {}


def _record(key: str, err: float) -> None:
    WORST[key] = max(WORST.get(key, 0.0), err)


def reference(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """float32 attention with bottom-right aligned masks; rows without keys: 0, lse +inf."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    if hk != h:
        kf = kf.repeat_interleave(h // hk, dim=1)
        vf = vf.repeat_interleave(h // hk, dim=1)
    s = qf @ kf.transpose(-1, -2)
    if softcap > 0:
        s = softcap * torch.tanh(s * scale / softcap)
    else:
        s = s * scale
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [b, h, sq]; -inf for empty rows
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    out = (p @ vf).transpose(1, 2)
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    return out, lse


def _compare(tag, out, lse, ref_out, ref_lse, atol=4e-3):
    assert torch.isfinite(out).all(), f"{tag}: non-finite output"
    err = (out.float() - ref_out).abs().max().item() if out.numel() else 0.0
    _record(f"out {tag}", err)
    assert err <= atol, f"{tag}: max |out - ref| = {err}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~finite), f"{tag}: lse +inf rows differ"
    if finite.any():
        lerr = (lse[finite] - ref_lse[finite]).abs().max().item()
        _record(f"lse {tag}", lerr)
        assert lerr <= 1e-3, f"{tag}: max |lse - ref| = {lerr}"


def _qkv(b, sq, sk, h, hk, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.float16, generator=g)
    return q, k, v


SEQS = [(1, 1), (8, 8), (333, 333), (1024, 1024), (1, 1024), (8, 333), (333, 1024),
        (1024, 333)]


