"""sm7x FA2 forward (or forward + backward) against torch SDPA's memory-efficient backend,
in the same run.

``[SM7X_FA2_FORCE=sm75] python -m sm7x.bench fa2 [--backward] [--out fa2.json] [--plot fa2.png]``

The memory-efficient backend is the only fused SDPA backend that runs on Volta/Turing,
so it is the baseline a user of these GPUs has. fp16, ``--tokens`` tokens per batch
(batch = tokens // seqlen), every seqlen x case x causal; TFLOP/s counts
4 * b * h * sq * sk * d, halved for causal. The cases are the head dims (query heads =
kv heads = 2048 / d) and one GQA case (32 query heads sharing 8 kv heads at d 128: SDPA
gets K/V expanded to 32 heads beforehand, outside its timing, as a model would pass them).

"% ceiling" is sm7x's TFLOP/s over the tensor-core ceiling of the library's own MMA
instruction (sm_75 mma.m16n8k8, sm_70 mma.m8n8k4), measured in the same run by a
register-only loop in the library (its mma_peak op), not taken from a datasheet.

``--backward``: forward + backward through autograd (what a training step runs): sm7x's
flash_attn_func then torch.autograd.grad for q, k, v, against SDPA memory-efficient's
forward and backward on the same tensors. FLOP = 3.5x the forward's (the standard count:
the backward does 2.5x the forward's matmul work). Default head dims 64/128/256 and
seqlens 512..8192 (plus the GQA case; SDPA then differentiates expanded K/V, without the
group sum). A head dim whose backward has no kernel in the library runs sm7x's float32
fallback: its rows say so ("backward": "fallback"). Each cell also records how far sm7x's
dq/dk/dv are from SDPA's (max abs difference over max abs SDPA gradient).

``--sinks``: the forward also with attention sinks (``s_aux``, one logit per query head,
gpt-oss), timed beside the same call without them: the "sinks" column is that time over
the plain call's (what folding the sink into the output and LSE costs).

On a V100 or T4 the library of the card runs its own SASS. On a GPU other than the arch's
own the library is forced (``SM7X_FA2_FORCE``) and runs its PTX, JIT-compiled for that
GPU: only correctness and the relative speed of the sm75 family mean something there
(sm70's mma.m8n8k4 is emulated on newer GPUs, so no Volta speed can be read off them).
"""

from __future__ import annotations

import os
import sys

import torch

from .. import _select, _targets
from . import _output
from .core import _time

DEFAULT_SEQLENS = (512, 2048, 8192)
DEFAULT_HEAD_DIMS = (64, 80, 96, 128, 256)
DEFAULT_GQA = ((128, 32, 8),)  # (head dim, query heads, kv heads)
BACKWARD_SEQLENS = (512, 1024, 2048, 4096, 8192)
BACKWARD_HEAD_DIMS = (64, 128, 256)
FWD_BWD_FLOP_FACTOR = 3.5  # forward 1 + backward 2.5 (the backward's five matmuls vs two)
CEILING_BLOCKS_PER_SM = 8
CEILING_ITERS = 4096
# --occupancy-of: shared memory and threads per SM of the cards these libraries are for
# (targets.json fa2.card_limits; registers, 64 K per SM, are the same on every GPU that
# runs them).
OCCUPANCY_CARDS = {lim["card"].lower(): (lim["smem_per_sm"], lim["warps_per_sm"] * 32)
                   for lim in map(_targets.fa2_card_limits, _targets.archs())}


def cases(head_dims, gqa=DEFAULT_GQA, head_elems: int = 2048) -> list[tuple[int, int, int]]:
    """(head dim, query heads, kv heads) per benchmarked case: MHA with heads * d =
    head_elems, then the GQA cases."""
    out = [(d, max(1, head_elems // d), max(1, head_elems // d)) for d in head_dims]
    return out + [c for c in gqa if c not in out]


def parse_gqa(text: str) -> tuple[tuple[int, int, int], ...]:
    """"128:32/8,64:16/2" -> ((128, 32, 8), (64, 16, 2)); heads a multiple of kv heads."""
    out = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        try:
            d, heads = part.split(":")
            h, hk = heads.split("/")
            case = (int(d), int(h), int(hk))
        except ValueError:
            raise ValueError(f"--gqa: {part!r} is not d:heads/kv_heads (e.g. 128:32/8)") from None
        if min(case) < 1 or case[1] % case[2]:
            raise ValueError(f"--gqa: {part!r}: sizes must be positive and heads a multiple of kv_heads")
        out.append(case)
    return tuple(out)


def library_arch(device: int) -> str:
    """The FA2 library (sm70 / sm75) that sm7x runs on ``device``, as the API picks it."""
    from ..fa2 import _device_info

    return _select.select_fa2_library(_device_info(torch.device("cuda", device))).arch


def ceiling_tflops(device: int, iters: int = 5, repeats: int = 10) -> float | None:
    """TFLOP/s of the library's mma_peak loop on ``device`` (median of ``repeats``); None
    for a library built before it had the op (comparing an older build)."""
    from ..fa2 import _ops_for

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(sms * CEILING_BLOCKS_PER_SM * 256, dtype=torch.float32, device=f"cuda:{device}")
    ops = _ops_for(out)
    if not hasattr(ops, "mma_peak"):
        return None
    flop = int(ops.mma_peak(out, CEILING_ITERS))
    return flop / _time(lambda: ops.mma_peak(out, CEILING_ITERS), iters, repeats, graph=False) / 1e12


def gpu_note(capability: tuple[int, int], arch: str, forced: str | None) -> str | None:
    """The first line's warning when what runs is not the card's own SASS."""
    if capability >= (8, 0):
        return (f"NOTE: this GPU (capability {capability[0]}.{capability[1]}) is newer than Turing: "
                f"it runs the {arch} library's PTX, JIT-compiled (forced with {_select.FORCE_ENV}={forced}); "
                "these are not V100/T4 numbers" + (" (and Volta's mma.m8n8k4 is emulated here: "
                                                   "no sm70 speed can be read)" if arch == "sm70" else ""))
    return None


class occupancy_of:
    """Context: sm7x's kernels run no more CTAs per SM than they would on ``card`` (a key of
    OCCUPANCY_CARDS, or None for no cap): on a larger GPU (an H200 holds 228 KB of shared
    memory per SM, a T4 64 KB) a forced library otherwise runs more CTAs per SM than its
    card can, and its speed says less about that card. SDPA is not capped."""

    def __init__(self, card: str | None):
        self.card = card

    def __enter__(self):
        if self.card is None:
            return self
        from ..fa2 import _ops_for

        self.ops = _ops_for(torch.empty(1, device="cuda"))
        if not hasattr(self.ops, "set_occupancy_emulation"):
            raise RuntimeError("sm7x.bench fa2: --occupancy-of needs an sm7x FA2 library with the "
                               "set_occupancy_emulation op (sm7x >= this release)")
        self.ops.set_occupancy_emulation(*OCCUPANCY_CARDS[self.card])
        return self

    def __exit__(self, *exc):
        if self.card is not None:
            self.ops.set_occupancy_emulation(0, 0)
        return False


def run(seqlens=DEFAULT_SEQLENS, head_dims=DEFAULT_HEAD_DIMS, tokens: int = 16384,
        head_elems: int = 2048, iters: int = 5, repeats: int = 10, gqa=DEFAULT_GQA,
        occupancy: str | None = None, sinks: bool = False) -> dict:
    """head_elems: heads * head_dim of the MHA cases (2048: 32 heads at d64, 16 at d128);
    occupancy: cap sm7x's CTAs per SM at a card's (see occupancy_of); sinks: also time
    each call with attention sinks."""
    dev = torch.cuda.current_device()
    arch = library_arch(dev)
    ceiling = ceiling_tflops(dev, iters, repeats)
    with occupancy_of(occupancy):
        rows = _rows(seqlens, head_dims, tokens, head_elems, iters, repeats, gqa, ceiling,
                     sinks)
    cap = tuple(torch.cuda.get_device_capability(dev))
    forced = os.environ.get(_select.FORCE_ENV)
    return {"device": torch.cuda.get_device_name(dev), "capability": list(cap),
            "torch": torch.__version__, "forced": forced, "library": arch,
            "note": gpu_note(cap, arch, forced), "mma_ceiling_tflops": ceiling,
            "occupancy_of": occupancy, "tokens": tokens, "results": rows}


def _rows(seqlens, head_dims, tokens, head_elems, iters, repeats, gqa, ceiling,
          sinks=False) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..fa2 import flash_attn_func

    rows = []
    for d, h, hk in cases(head_dims, gqa, head_elems):
        for s in seqlens:
            b = max(1, tokens // s)
            q = torch.randn(b, s, h, d, device="cuda", dtype=torch.float16)
            k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            if hk != h:  # what SDPA's memory-efficient backend needs: K/V per query head
                kt, vt = (t.repeat_interleave(h // hk, dim=1) for t in (kt, vt))
            for causal in (False, True):
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                ours = _time(lambda: flash_attn_func(q, k, v, causal=causal), iters, repeats, graph=False)
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    ref = _time(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qt, kt, vt, is_causal=causal), iters, repeats, graph=False)
                rows.append({"head_dim": d, "heads": h, "kv_heads": hk, "seqlen": s, "batch": b,
                             "causal": causal, "sm7x_tflops": flops / ours / 1e12,
                             "sdpa_eff_tflops": flops / ref / 1e12, "ratio": ref / ours,
                             "pct_ceiling": 100 * flops / ours / 1e12 / ceiling if ceiling else None})
                if sinks:
                    s_aux = torch.randn(h, device="cuda")
                    with_sinks = _time(lambda: flash_attn_func(q, k, v, causal=causal, s_aux=s_aux),
                                       iters, repeats, graph=False)
                    rows[-1]["sinks_time_ratio"] = with_sinks / ours
            del q, k, v, qt, kt, vt
    return rows


def _baseline_backend():
    """SDPA's memory-efficient backend (a function, so the CPU test can swap it)."""
    from torch.nn.attention import SDPBackend

    return SDPBackend.EFFICIENT_ATTENTION


def attention_flops(b: int, h: int, s: int, d: int, causal: bool, backward: bool) -> float:
    """4 b h s^2 d for the forward (halved when causal), x3.5 with the backward."""
    fwd = 4 * b * h * s * s * d / (2 if causal else 1)
    return fwd * FWD_BWD_FLOP_FACTOR if backward else fwd


def backward_row(d, h, hk, s, causal, tokens, iters, repeats, deterministic, device, timer,
                 path: str) -> dict:
    """One cell of --backward: sm7x and SDPA memory-efficient forward + backward, timed
    with ``timer(fn, iters, repeats)``; their gradient difference; ``path`` is "kernel" or
    "fallback" (which backward sm7x runs for d)."""
    from torch.nn.attention import sdpa_kernel

    from ..fa2 import flash_attn_func

    b = max(1, tokens // s)
    g = torch.Generator(device=device).manual_seed(s * 131 + d)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float16, generator=g)

    q, k, v = randn(b, s, h, d), randn(b, s, hk, d), randn(b, s, hk, d)
    dout = randn(b, s, h, d)
    ours_in = [t.requires_grad_(True) for t in (q, k, v)]
    # SDPA: [b, heads, s, d] leaves, K/V expanded per query head for GQA
    sq_, sk_, sv_ = (t.detach().transpose(1, 2) for t in (q, k, v))
    if hk != h:
        sk_, sv_ = (t.repeat_interleave(h // hk, dim=1) for t in (sk_, sv_))
    sdpa_in = [t.contiguous().requires_grad_(True) for t in (sq_, sk_, sv_)]
    dout_t = dout.transpose(1, 2)

    def ours():
        out = flash_attn_func(*ours_in, causal=causal, deterministic=deterministic)
        return torch.autograd.grad(out, ours_in, dout)

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(*sdpa_in, is_causal=causal)
        return torch.autograd.grad(out, sdpa_in, dout_t)

    with sdpa_kernel(_baseline_backend()):
        ref_grads = sdpa()
        t_sdpa = timer(sdpa, iters, repeats)
    our_grads = ours()
    if path == "fallback":  # float32 math: slow, a few samples say enough
        iters, repeats = 1, min(repeats, 3)
    t_ours = timer(ours, iters, repeats)
    diffs = []
    for n, (a, r) in enumerate(zip(our_grads, ref_grads)):
        r = r.transpose(1, 2)
        if n and hk != h:  # SDPA's per-query-head dk/dv summed over each group
            r = r.reshape(b, s, hk, h // hk, d).sum(3)
        diffs.append((a.float() - r.float()).abs().max().item()
                     / max(r.float().abs().max().item(), 1e-6))
    flops = attention_flops(b, h, s, d, causal, True)
    del ours_in, sdpa_in, our_grads, ref_grads
    return {"head_dim": d, "heads": h, "kv_heads": hk, "seqlen": s, "batch": b, "causal": causal,
            "backward": path, "sm7x_tflops": flops / t_ours / 1e12,
            "sdpa_eff_tflops": flops / t_sdpa / 1e12, "ratio": t_sdpa / t_ours,
            "sm7x_ms": t_ours * 1e3, "sdpa_eff_ms": t_sdpa * 1e3,
            "grad_rel_diff": max(diffs)}


def run_backward(seqlens=BACKWARD_SEQLENS, head_dims=BACKWARD_HEAD_DIMS, tokens: int = 16384,
                 head_elems: int = 2048, iters: int = 5, repeats: int = 10, gqa=DEFAULT_GQA,
                 deterministic: bool = False, device: str = "cuda",
                 occupancy: str | None = None) -> dict:
    """--backward: forward + backward TFLOP/s of sm7x and SDPA memory-efficient per cell.
    ``device="cpu"`` is the unit tests' smoke run (a stand-in library, wall-clock timing);
    occupancy: cap sm7x's CTAs per SM (forward and backward kernels) at a card's."""
    from ..fa2 import _autograd, _ops_for

    if device == "cpu":
        def timer(fn, it, rep):
            return _time(fn, it, rep, graph=False, dev="cpu")
        dev_name, cap, arch, ceiling = "cpu", (0, 0), "cpu", None
    else:
        def timer(fn, it, rep):
            return _time(fn, it, rep, graph=False)
        idx = torch.cuda.current_device()
        dev_name, cap = torch.cuda.get_device_name(idx), tuple(torch.cuda.get_device_capability(idx))
        arch = library_arch(idx)
        ceiling = ceiling_tflops(idx, iters, repeats)
    rows = []
    with occupancy_of(occupancy if device != "cpu" else None):
        for d, h, hk in cases(head_dims, gqa, head_elems):
            probe = torch.empty(0, device=device)
            ok, why = _autograd._backward_kernel(_ops_for(probe), d)
            for s in seqlens:
                for causal in (False, True):
                    row = backward_row(d, h, hk, s, causal, tokens, iters, repeats, deterministic,
                                       device, timer, "kernel" if ok else "fallback")
                    row["pct_ceiling"] = 100 * row["sm7x_tflops"] / ceiling if ceiling else None
                    if not ok:
                        row["fallback_reason"] = why
                    rows.append(row)
    forced = os.environ.get(_select.FORCE_ENV)
    return {"mode": "forward+backward", "flop_factor": FWD_BWD_FLOP_FACTOR,
            "deterministic": deterministic, "device": dev_name, "capability": list(cap),
            "torch": torch.__version__, "forced": forced, "library": arch,
            "note": gpu_note(cap, arch, forced) if device != "cpu" else None,
            "mma_ceiling_tflops": ceiling, "occupancy_of": occupancy, "tokens": tokens,
            "results": rows}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}%"


def print_table(result: dict) -> None:
    if result.get("note"):
        print(result["note"])
    if result.get("occupancy_of"):
        smem, threads = OCCUPANCY_CARDS[result["occupancy_of"]]
        print(f"sm7x's CTAs per SM capped at a {result['occupancy_of'].upper()}'s ({smem // 1024} KB "
              f"shared memory, {threads} threads per SM); SDPA runs uncapped")
    print(f"{result['device']} (capability {tuple(result['capability'])}), torch {result['torch']}, "
          f"library {result['library']}, forced={result['forced']}; "
          + (f"mma ceiling {result['mma_ceiling_tflops']:.0f} TFLOP/s" if result["mma_ceiling_tflops"]
             else "no mma ceiling (this library has no mma_peak op)"))
    backward = result.get("mode") == "forward+backward"
    if backward:
        print(f"forward + backward (FLOP = {result['flop_factor']}x the forward's), "
              f"deterministic={result['deterministic']}")
    print(f"{'d':>4} {'heads':>6} {'seqlen':>6} {'batch':>5} {'causal':>6} {'sm7x TFLOP/s':>12} "
          f"{'% ceiling':>9} {'SDPA-eff TFLOP/s':>16} {'ratio':>6}"
          + (f" {'backward':>8} {'grad diff':>9}" if backward else "")
          + (f" {'sinks':>6}" if any("sinks_time_ratio" in r for r in result["results"]) else ""))
    for r in result["results"]:
        heads = f"{r['heads']}/{r['kv_heads']}" if r["kv_heads"] != r["heads"] else str(r["heads"])
        print(f"{r['head_dim']:>4} {heads:>6} {r['seqlen']:>6} {r['batch']:>5} {str(r['causal']):>6} "
              f"{r['sm7x_tflops']:>12.1f} {_pct(r['pct_ceiling']):>9} {r['sdpa_eff_tflops']:>16.1f} "
              f"{r['ratio']:>6.2f}"
              + (f" {r['backward']:>8} {r['grad_rel_diff']:>9.1e}" if backward else "")
              + (f" {r['sinks_time_ratio']:>5.2f}x" if "sinks_time_ratio" in r else ""))


def draw(result: dict, plt):
    """The PNG of the results (see _output.write): one panel per case, the ceiling as a line."""
    keys = []
    for r in result["results"]:
        k = (r["head_dim"], r["heads"], r["kv_heads"])
        if k not in keys:
            keys.append(k)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (d, h, hk) in zip(axes[0], keys):
        rs = [r for r in result["results"] if (r["head_dim"], r["heads"], r["kv_heads"]) == (d, h, hk)]
        _output.grouped_bars(ax, [f"{r['seqlen']}{' c' if r['causal'] else ''}" for r in rs],
                     {"sm7x FA2": [r["sm7x_tflops"] for r in rs],
                      "SDPA mem-efficient": [r["sdpa_eff_tflops"] for r in rs]})
        if result["mma_ceiling_tflops"]:
            ax.axhline(result["mma_ceiling_tflops"], color="gray", linestyle="--", label="mma ceiling")
        fallback = any(r.get("backward") == "fallback" for r in rs)
        ax.set_title(f"head dim {d}" + (f", GQA {h}/{hk}" if h != hk else "")
                     + (" (fp32 fallback backward)" if fallback else ""))
        ax.set_xlabel("seqlen (c = causal)")
        ax.set_ylabel("TFLOP/s")
    axes[0][0].legend()
    what = "forward + backward" if result.get("mode") == "forward+backward" else "forward"
    fig.suptitle(f"sm7x FA2 {what} ({result['library']}) vs SDPA memory-efficient, "
                 f"{result['device']}, fp16")
    return fig


def _ints(flag: str, text: str | None, default) -> list[int]:
    if text is None:
        return list(default)
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of ints") from None
    if not out or min(out) < 1:
        raise ValueError(f"{flag}: {text!r}: give positive ints, e.g. 512,2048")
    return out


def main(argv: list[str]) -> int:
    p = _output.argument_parser("fa2", __doc__)
    p.add_argument("--backward", action="store_true",
                   help="time forward + backward (training) instead of the forward")
    p.add_argument("--deterministic", action="store_true",
                   help="with --backward: sm7x's deterministic backward")
    p.add_argument("--seqlens", help="comma-separated (default: "
                   f"{','.join(map(str, DEFAULT_SEQLENS))}; with --backward "
                   f"{','.join(map(str, BACKWARD_SEQLENS))})")
    p.add_argument("--head-dims", help="comma-separated (default: "
                   f"{','.join(map(str, DEFAULT_HEAD_DIMS))}; with --backward "
                   f"{','.join(map(str, BACKWARD_HEAD_DIMS))})")
    p.add_argument("--gqa", default=",".join(f"{d}:{h}/{hk}" for d, h, hk in DEFAULT_GQA),
                   help="GQA cases d:heads/kv_heads, comma-separated ('' for none; default %(default)s)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (default: %(default)s)")
    p.add_argument("--iters", type=int, default=5, help="calls per timed sample")
    p.add_argument("--repeats", type=int, default=10, help="timed samples (median taken)")
    p.add_argument("--sinks", action="store_true",
                   help="also time each forward with attention sinks (s_aux), as a ratio")
    p.add_argument("--occupancy-of", choices=sorted(OCCUPANCY_CARDS),
                   help="on a larger GPU: run sm7x's kernels at most as many CTAs per SM as this "
                        "card holds (shared memory, threads)")
    a = p.parse_args(argv)
    try:
        gqa = parse_gqa(a.gqa)
        seqlens = _ints("--seqlens", a.seqlens,
                        BACKWARD_SEQLENS if a.backward else DEFAULT_SEQLENS)
        head_dims = _ints("--head-dims", a.head_dims,
                          BACKWARD_HEAD_DIMS if a.backward else DEFAULT_HEAD_DIMS)
    except ValueError as e:
        p.error(str(e))
    if a.deterministic and not a.backward:
        p.error("--deterministic needs --backward (the forward always is deterministic)")
    if a.sinks and a.backward:
        p.error("--sinks times the forward; leave out --backward")
    if not torch.cuda.is_available():
        print("sm7x.bench fa2: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    if a.backward:
        result = run_backward(seqlens, head_dims, a.tokens, iters=a.iters, repeats=a.repeats,
                              gqa=gqa, deterministic=a.deterministic, occupancy=a.occupancy_of)
    else:
        result = run(seqlens, head_dims, a.tokens, iters=a.iters, repeats=a.repeats, gqa=gqa,
                     occupancy=a.occupancy_of, sinks=a.sinks)
    print_table(result)
    _output.write(result, a.out, a.plot, draw)
    return 0
