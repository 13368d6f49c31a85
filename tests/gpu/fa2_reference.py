"""What the FA2 GPU tests of every arch share: the float32 reference with flash-attn's
masks, input builders, the comparison, the worst-error record, and the checks that each
arch's test module runs over its own grid (`tag` names the arch in the record)."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
# packed query rows per CTA of the decode kernel (fa2.h kDecodeRows, read there)
from sm7x_tools.kernels import DECODE_ROWS  # noqa: F401  (also for test modules)


WORST: dict[str, float] = {}



def _record(key: str, err: float) -> None:
    WORST[key] = max(WORST.get(key, 0.0), err)


def visible_keys(sq, sk, causal=False, window=(-1, -1), device=None):
    """[sq, sk] bool: which keys each query sees, bottom-right aligned (query i sits at key
    position i + sk - sq); causal is window_right = 0, as the ops apply it."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok


def reference(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0, sinks=None):
    """float32 attention with bottom-right aligned masks; rows without keys: 0, lse +inf.
    ``sinks`` [h]: one more softmax column per head with no value (gpt-oss's attention
    sinks, computed as gpt-oss's eager attention does: concatenated to the scores)."""
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
    s = s.masked_fill(~visible_keys(sq, sk, causal, window, q.device), float("-inf"))
    if sinks is not None:
        column = sinks.to(s.dtype)[None, :, None, None].expand(b, h, sq, 1)
        s = torch.cat([s, column], dim=-1)
    lse = torch.logsumexp(s, dim=-1)  # [b, h, sq]; -inf for empty rows
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    if sinks is not None:
        p = p[..., :-1]  # the sink's column has no value
    out = (p @ vf).transpose(1, 2)
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    return out, lse


def selected_arch() -> tuple[str | None, str]:
    """(the arch whose library the current device runs, or None; why not): the modules that
    test whichever library the device selects (forced on GPUs newer than Turing) skip on it."""
    from sm7x import _select

    forced = os.environ.get(_select.FORCE_ENV, "").strip().lower()
    if torch.cuda.get_device_capability() >= (8, 0) and forced not in _select.ARCHS:
        return None, (f"GPU newer than Turing: set {_select.FORCE_ENV}=sm75 or "
                      f"{_select.FORCE_ENV}=sm70 to test its kernels through their PTX")
    index = torch.cuda.current_device()
    device = _select.Device(index, torch.cuda.get_device_name(index),
                            tuple(torch.cuda.get_device_capability(index)))
    try:
        sel = _select.select_fa2_library(device)
    except (_select.UnsupportedDeviceError, ValueError) as exc:
        return None, f"sm7x FA2 does not run on this device: {exc}"
    for arch in (sel.arch, sel.fallback):  # the loader's order
        if arch is not None and _select.library_path(arch) is not None:
            return arch, ""
    return None, f"{sel.library} is not installed (set SM7X_LIBRARY_PATH to a build)"


def capture(fn):
    """(a CUDA graph of fn(), what the captured fn() returned): fn runs once on a side stream
    first (the warm-up: loads the libraries, sets the shared-memory opt-in, plans), then
    is captured on that stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = fn()
    return graph, out


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




def check_fwd(tag, d, sq, sk, causal, group):
    from sm7x.fa2 import flash_attn_func

    h = 8
    q, k, v = _qkv(2, sq, sk, h, h // group, d, seed=sq * 7 + sk + d)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ref_out, ref_lse = reference(q, k, v, d ** -0.5, causal)
    _compare(f"{tag}d={d}", out, lse, ref_out, ref_lse)


def check_window(tag, window, sq, sk, d=64):
    from sm7x.fa2 import flash_attn_func

    q, k, v = _qkv(2, sq, sk, 4, 2, d, seed=11)
    out, lse, _ = flash_attn_func(q, k, v, window_size=window, return_attn_probs=True)
    ref_out, ref_lse = reference(q, k, v, d ** -0.5, False, window)
    _compare(f"{tag}window", out, lse, ref_out, ref_lse)


def check_softcap(tag, causal, d=128):
    from sm7x.fa2 import flash_attn_func

    q, k, v = _qkv(2, 257, 300, 4, 4, d, seed=5)
    q = q * 3
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, softcap=30.0, return_attn_probs=True)
    ref_out, ref_lse = reference(q, k, v, d ** -0.5, causal, softcap=30.0)
    _compare(f"{tag}softcap", out, lse, ref_out, ref_lse)


def check_varlen(tag, d, causal):
    from sm7x.fa2 import flash_attn_varlen_func

    lens_q = [1, 77, 300, 8, 513]
    lens_k = [1, 77, 300, 40, 700]
    h, hk = 8, 2
    g = torch.Generator(device="cuda").manual_seed(d)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, h, d, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(tk, hk, d, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(tk, hk, d, device="cuda", dtype=torch.float16, generator=g)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=causal, return_attn_probs=True)
    assert lse.shape == (h, tq)
    for i in range(len(lens_q)):
        a, b_ = cu_q[i].item(), cu_q[i + 1].item()
        c, e = cu_k[i].item(), cu_k[i + 1].item()
        ro, rl = reference(q[None, a:b_], k[None, c:e], v[None, c:e], d ** -0.5, causal)
        _compare(f"{tag}varlen d={d}", out[a:b_][None], lse[:, a:b_][None], ro, rl)


def _library_ops():
    """The op namespace of the library that runs on the current device, loaded (a test run
    alone, e.g. with -k, may be the first to touch it)."""
    from sm7x.fa2 import _ops_for

    return _ops_for(torch.empty(1, device="cuda"))


def check_mma_peak(arch):
    """The benchmark's ceiling loop (mma_peak) really runs its MMAs: every thread's sum of
    accumulators is iters x 8 chains x (its share of A.B) for the constant fp16 operands, and
    the FLOP it reports follow from its launch."""
    ops = _library_ops()
    out = torch.full((2 * 256,), float("nan"), device="cuda")
    iters = 16
    flop = ops.mma_peak(out, iters)
    torch.cuda.synchronize()
    a1, a2, b1, b2 = torch.tensor([1e-3, 2e-3, 3e-3, 1e-3]).half().float().tolist()
    # sm75 m16n8k8: 4 accumulators of 4 (a1 b1 + a2 b2) terms; sm70 m8n8k4: 8 of 2 terms
    want = iters * 8 * 16 * (a1 * b1 + a2 * b2)
    assert flop == 2 * 8 * iters * 8 * 2048
    assert torch.allclose(out, torch.full_like(out, want), rtol=1e-3), (out[:4], want)
    with pytest.raises(RuntimeError, match="mma_peak: out must be contiguous with a multiple of 256"):
        ops.mma_peak(torch.empty(100, device="cuda"), 1)
    with pytest.raises(RuntimeError, match="mma_peak: iters must be"):
        ops.mma_peak(out, 0)


def check_packed_qkv():
    from sm7x.fa2 import flash_attn_func

    qkv = torch.randn(2, 300, 3, 8, 64, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v, causal=True)
    ref, _ = reference(q, k, v, 64 ** -0.5, True)
    assert (out.float() - ref).abs().max().item() <= 4e-3


def check_cuda_graph(tag, d, causal=True):
    """flash_attn_func captured in a real CUDA graph on a side stream, replayed on new
    inputs. A launch on another stream than the capturing one (the legacy default stream,
    say) fails the capture; a launch that ran eagerly instead of being captured leaves the
    output of the capture-time inputs, which the new inputs' reference does not match."""
    from sm7x.fa2 import flash_attn_func

    b, sq, sk, h, hk = 2, 200, 333, 4, 2
    q, k, v = _qkv(b, sq, sk, h, hk, d, seed=20)  # the graph's static inputs
    graph, out = capture(lambda: flash_attn_func(q, k, v, causal=causal))
    for seed in (21, 22):
        nq, nk, nv = _qkv(b, sq, sk, h, hk, d, seed=seed)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference(nq, nk, nv, d ** -0.5, causal)
        err = (out.float() - ref).abs().max().item()
        _record(f"out {tag}graph replay d={d}", err)
        assert err <= 4e-3, f"{tag}graph replay d={d}, inputs {seed}: max |out - ref| = {err}"


def report_worst(title):
    """Print the worst errors (pytest -s) and write them to $FA2_ERRORS_OUT when set."""
    lines = [f"{key}: {err:.3e}" for key, err in sorted(WORST.items())]
    text = "\n".join(lines)
    print(f"\nworst errors vs float32 reference{title}:\n" + text)
    path = os.environ.get("FA2_ERRORS_OUT")
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


# ---------------------------------------------------------------------------------------
# Serving (paged KV cache, decode, split-KV, kv-cache append with rotary): cache builders
# and references, used by test_fa2_serving.py. Pure torch; `device` defaults to CUDA.


def gen(seed, device="cuda"):
    return torch.Generator(device=device).manual_seed(seed)


def i32(values, device="cuda"):
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def cu_seqlens(lens, device="cuda"):
    """int32 [len(lens) + 1] prefix sums: the cu_seqlens of sequences of these lengths."""
    return i32([0, *itertools.accumulate(lens)], device)


def random_lens(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def paged_cache(lens, page_size, hk, d, *, seed=0, max_blocks=None, spare_blocks=3,
                device="cuda"):
    """(k_cache, v_cache, block_table) for sequences of `lens` keys.

    Caches: randn fp16 [num_blocks, page_size, hk, d]; block_table: int32 [batch,
    max_blocks]. The pages a sequence uses are distinct blocks in shuffled order (no two
    sequences share one); the entries past them point at arbitrary valid blocks (as a
    serving engine's padding would), which the kernels must not read.
    """
    g = torch.Generator().manual_seed(seed)
    used = [ceil_div(n, page_size) for n in lens]
    if max_blocks is None:
        max_blocks = max(used + [1])
    assert max(used + [0]) <= max_blocks
    num_blocks = sum(used) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.randint(0, num_blocks, (len(lens), max_blocks), generator=g, dtype=torch.int32)
    off = 0
    for i, u in enumerate(used):
        bt[i, :u] = perm[off:off + u].to(torch.int32)
        off += u
    gd = torch.Generator(device=device).manual_seed(seed + 1)
    shape = (num_blocks, page_size, hk, d)
    k_cache = torch.randn(shape, device=device, dtype=torch.float16, generator=gd)
    v_cache = torch.randn(shape, device=device, dtype=torch.float16, generator=gd)
    return k_cache, v_cache, bt.to(device)


def paged_rows(block_table, b, positions, page_size):
    """(block, slot) index tensors of key positions `positions` (long) of sequence b."""
    positions = torch.as_tensor(positions, device=block_table.device).long()
    return block_table[b].long()[positions // page_size], positions % page_size


def gather_paged(cache, block_table, b, n):
    """Keys 0..n-1 of sequence b of a paged cache, as a contiguous [n, hk, d] tensor."""
    page = cache.shape[1]
    nb = ceil_div(n, page)
    idx = block_table[b, :nb].long()
    return cache[idx].reshape(nb * page, *cache.shape[2:])[:n]


def contiguous_from_paged(cache, block_table):
    """The contiguous cache [batch, max_blocks * page_size, hk, d] holding, row by row,
    what the block table maps (every entry of block_table must be a valid block)."""
    b, mb = block_table.shape
    return cache[block_table.long()].reshape(b, mb * cache.shape[1], *cache.shape[2:])


def reference_seqs(qs, ks, vs, scale, causal=False, window=(-1, -1), softcap=0.0):
    """`reference` per sequence: qs, ks, vs are lists of [s, heads, d] tensors.

    Returns the packed (varlen) layout: out [sum sq, h, d] float32 and lse [h, sum sq]
    (+inf for rows without a visible key, as the kernels report them).
    """
    outs, lses = [], []
    for q, k, v in zip(qs, ks, vs):
        o, l = reference(q[None], k[None], v[None], scale, causal, window, softcap)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def packed_to_batched(out, lse, batch, sq):
    """(out [b*sq, h, d], lse [h, b*sq]) -> (out [b, sq, h, d], lse [b, h, sq])."""
    h = out.shape[1]
    return (out.reshape(batch, sq, h, out.shape[-1]),
            lse.reshape(h, batch, sq).permute(1, 0, 2).contiguous())


def rotary_tables(seqlen_ro, rotary_dim, *, seed=0, device="cuda"):
    """rotary_cos, rotary_sin fp16 [seqlen_ro, rotary_dim / 2] of random angles (as
    flash-attn's tests: any position or pairing mistake shows)."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(seqlen_ro, rotary_dim // 2, generator=g, dtype=torch.float64) * 2 * math.pi
    return (torch.cos(angle).to(device=device, dtype=torch.float16),
            torch.sin(angle).to(device=device, dtype=torch.float16))


def apply_rotary(x, cos, sin, positions, interleaved):
    """x [s, heads, d] rotated at `positions` [s] in float32, flash-attn's definition:
    the first rotary_dim = 2 * cos.shape[1] dims rotate, the rest pass through;
    interleaved (GPT-J): pairs (x[2i], x[2i+1]); else (GPT-NeoX): halves (x[i],
    x[i + rotary_dim/2]). Returns float32 (round with .half() as the kernels store)."""
    rd = cos.shape[1] * 2
    x = x.float()
    positions = torch.as_tensor(positions, device=x.device).long()
    c = cos.float()[positions][:, None, :]
    s = sin.float()[positions][:, None, :]
    xr = x[..., :rd]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot, x[..., rd:]), dim=-1)


def check_api_errors_come_from_the_op(arch):
    """sm7x.fa2 leaves the checks of what the op sees to the op: through the Python API a
    bad dtype, head dim, GQA ratio, batch or option value raises the op's RuntimeError
    (its name in the message), on the prefill path, the few-rows (serving) path, varlen
    and the autograd path alike."""
    from sm7x.fa2 import flash_attn_func, flash_attn_varlen_func

    ns = f"sm7x\\.fa2_{arch}\\."
    q, k, v = _qkv(2, 16, 16, 4, 4, 64, seed=70)
    q1 = q[:, :1]
    cases = [
        (lambda: flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16()),
         ns + r"fwd: q has dtype bfloat16; sm7x FA2 supports float16 only"),
        (lambda: flash_attn_func(q1.bfloat16(), k.bfloat16(), v.bfloat16()),
         ns + r"fwd_serving: q has dtype bfloat16"),
        (lambda: flash_attn_func(*_qkv(1, 4, 4, 2, 2, 100)), r"zero-pad q, k, v to 104"),
        (lambda: flash_attn_func(q, k[:, :, :3], v[:, :, :3]),
         ns + r"fwd: num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        (lambda: flash_attn_func(q, k[:1], v[:1]), ns + r"fwd: q has batch 2 but k has 1"),
        (lambda: flash_attn_func(q1, k[:1], v[:1]), ns + r"fwd: q has batch 2 but k has 1"),
        (lambda: flash_attn_func(q, k, v, softmax_scale=-1.0), ns + r"fwd: softmax_scale"),
        (lambda: flash_attn_func(q, k, v, softcap=float("inf")), ns + r"fwd: softcap"),
        (lambda: flash_attn_func(q.requires_grad_(True), k, v, window_size=(-3, 0)),
         ns + r"fwd: window_size"),
        (lambda: flash_attn_varlen_func(*(t[0, :, :, :12].contiguous() for t in (q, k, v)),
                                        i32([0, 16]), i32([0, 16]), 16, 16),
         ns + r"fwd_varlen: head dim 12"),
    ]
    for call, match in cases:
        with pytest.raises(RuntimeError, match=match):
            call()
    q.requires_grad_(False)


def check_serving_tile(arch):
    """serving_tile, the planner's view of the serving kernel, is the table's: up to
    8 packed rows per kv head the decode kernel where fa2.decode_kernels lists the head dim
    (8 rows per CTA), then up to fa2.serving_wide_rows the narrow serving tile, above it the
    prefill tile where that has more rows (else the narrow kernel runs), resident CTAs > 0;
    head dims between compiled ones run the next one up; every cache format (kv_format: the
    same tiles, each kernel's own resident CTAs); out-of-range arguments are refused."""
    from sm7x import _targets
    from sm7x.fa2._serving import FORMAT_NAMES

    ops = _library_ops()
    dev, wide = torch.cuda.current_device(), _targets.fa2_serving_wide_rows()
    for d in range(16, _targets.fa2_max_head_dim() + 1, _targets.fa2_head_dim_multiple()):
        narrow, prefill = _targets.fa2_kernel(arch, d, serving=True), _targets.fa2_kernel(arch, d)
        big = prefill if prefill["block_m"] > narrow["block_m"] else narrow
        decode = _targets.fa2_decode_kernel(arch, d)
        few = narrow if decode is None else dict(decode, block_m=DECODE_ROWS)
        for rows, want in ((0, few), (1, few), (DECODE_ROWS, few), (DECODE_ROWS + 1, narrow),
                           (wide, narrow), (wide + 1, big), (1 << 40, big)):
            for fmt in FORMAT_NAMES:
                bm, bn, ctas = ops.serving_tile(dev, d, rows, fmt)
                assert (bm, bn) == (want["block_m"], want["block_n"]), (d, rows, fmt, bm, bn, want)
                assert ctas >= 1, (d, rows, fmt, ctas)
    for bad, match in (((dev, 0, 1, 0), "head_dim must be in"),
                       ((dev, _targets.fa2_max_head_dim() + 1, 1, 0), "head_dim must be in"),
                       ((dev, 64, -1, 0), "rows must be >= 0"),
                       ((dev, 64, 1, 4), "kv_format must be 0 .float16.")):
        with pytest.raises(RuntimeError, match=match):
            ops.serving_tile(*bad)


def check_occupancy_emulation(arch):
    """set_occupancy_emulation (the benchmark's --occupancy-of) caps the CTAs per SM of every
    kernel at what a card with that much shared memory and those threads holds, and 0, 0
    lifts the cap: seen through serving_tile, whose CTAs per SM are the occupancy query of
    the launches' own shared-memory size, for the wide serving kernels (the prefill tiles)."""
    from sm7x import _targets
    from sm7x.bench.fa2 import OCCUPANCY_CARDS

    ops = _library_ops()
    assert ops.name == f"sm7x_fa2_{arch}"
    smem_cap, threads_cap = OCCUPANCY_CARDS["t4" if arch == "sm75" else "v100"]
    dev, rows = torch.cuda.current_device(), _targets.fa2_serving_wide_rows() + 1

    def ctas(d):
        return ops.serving_tile(dev, d, rows, 0)[2]  # the fp16 kernel

    free = {d: ctas(d) for d in _targets.fa2_head_dims(arch)}
    try:
        ops.set_occupancy_emulation(smem_cap, threads_cap)
        for d, n_free in free.items():
            k = _targets.fa2_kernel(arch, d)
            if k["block_m"] <= _targets.fa2_kernel(arch, d, serving=True)["block_m"]:
                k = _targets.fa2_kernel(arch, d, serving=True)  # no wide kernel: the narrow runs
            threads = k["block_m"] // 16 * 32  # the wide serving kernel runs 16 rows per warp
            want = max(1, min(smem_cap // k["smem_bytes"], threads_cap // threads, n_free))
            assert ctas(d) == want, (d, k, n_free)
    finally:
        ops.set_occupancy_emulation(0, 0)
    assert {d: ctas(d) for d in free} == free
    with pytest.raises(RuntimeError, match="smem_per_sm must be"):
        ops.set_occupancy_emulation(-1, 0)
