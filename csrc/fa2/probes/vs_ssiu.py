"""Maintainers' probe, run by hand (in no package): sm7x's FA2 against ssiu/flash-attention-
turing (the fastest public FlashAttention-2 for Turing; not part of sm7x), both on one GPU
in one run, forward, forward + backward and the backward alone (their difference).

ssiu's module is built separately as a torch extension with compute_75 PTX (its own
setup.py, ``-gencode arch=compute_75,code=compute_75``) and put on ``PYTHONPATH``. Built
for a GPU machine without network (2026-12-07): ssiu at 6a55261 with its cutlass submodule
(df18f5e4, include/ and tools/util/include/ only), torch's headers and libraries from the
unzipped torch 2.11.0 cp312 wheel (cu130, the GPU machine's torch), nvcc 13.0; setup.py's
sources and flags with the arch replaced, plus the defines torch.utils.cpp_extension adds
(``-D__CUDA_NO_HALF_OPERATORS__`` and the like, ``-D_GLIBCXX_USE_CXX11_ABI=1``,
``TORCH_EXTENSION_NAME=flash_attn_turing``); linked with -shared against c10, torch,
torch_cpu, torch_cuda, torch_python and cudart: a 1 MB module holding PTX only. Its
kernels run on the legacy default stream (its source), as do these timings. Its API
is raw: ``fwd(q, k, v, is_causal) -> [o, lse]``, ``bwd(q, k, v, o, lse, dout, is_causal)
-> [dq, dk, dv]``, contiguous fp16 ``[batch, seqlen, heads, dim]``, head dims 64 and 128,
scale 1/sqrt(d), GQA. sm7x runs as a user calls it: ``flash_attn_func`` and autograd (so its
numbers include what autograd adds; ssiu's include the zero-filled outputs it allocates).

    SM7X_FA2_FORCE=sm75 PYTHONPATH=python:SSIU_BUILD python csrc/fa2/probes/vs_ssiu.py \\
        [--head-dims 64,128] [--seqlens 512,2048,8192] [--occupancy-of t4] [--kernel-times]
        [--out f.json] [--plot f.png]

Per cell (16k tokens, 16 heads as the issue measured; GQA 32/8 at d128): ms of each and
"x" = ssiu's time / sm7x's (above 1: sm7x faster), for fwd, fwd+bwd and bwd alone; and how
far the two libraries' outputs and gradients are apart (max abs difference over max abs
value), so that a faster cell is one that computes the same thing. ``--occupancy-of t4``
caps sm7x's CTAs per SM at a T4's (sm7x.bench.fa2.occupancy_of); ssiu cannot be capped
(its kernels take 64 KB of shared memory, one CTA per T4 SM already). ``--kernel-times``
adds, per cell, each kernel's device time in one forward + backward of either library
(torch.profiler, mean of 3 steps), and how long the GPU sat idle between them, printed
under the table: where each backward's time goes.
"""

from __future__ import annotations

import sys

import torch

from sm7x.bench import _output
from sm7x.bench.core import _time
from sm7x.bench.fa2 import _ints, occupancy_of
from sm7x.fa2 import flash_attn_func

HEADS = 16
SSIU_HEAD_DIMS = {64, 128}
GQA = (128, 32, 8)  # (head dim, query heads, kv heads)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-6)


def kernel_times(fn, steps: int = 3) -> tuple[dict[str, float], float]:
    """Device microseconds per step of each CUDA kernel fn launches (torch.profiler), and the
    microseconds per step the GPU sat idle between them (the span from the first kernel's
    start to the last one's end, less their sum): time a step's wall clock has and its
    kernels do not (host launches that fall behind, syncs)."""
    import json
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    times = {e.key: e.device_time_total / steps for e in prof.key_averages()
             if e.device_time_total > 0}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    return times, (span - sum(e["dur"] for e in gpu)) / steps


def cell(ssiu, d: int, h: int, hk: int, s: int, causal: bool, tokens: int, iters: int,
         repeats: int, kernels: bool = False) -> dict:
    b = max(1, tokens // s)
    g = torch.Generator(device="cuda").manual_seed(s * 7 + d)
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.float16, generator=g)
               for n in (h, hk, hk))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.float16, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def ours_fwd():
        return flash_attn_func(q, k, v, causal=causal)

    def ours_fwd_bwd():
        return torch.autograd.grad(flash_attn_func(*leaves, causal=causal), leaves, dout)

    def theirs_fwd():
        return ssiu.fwd(q, k, v, causal)

    def theirs_fwd_bwd():
        o, lse = ssiu.fwd(q, k, v, causal)
        return ssiu.bwd(q, k, v, o, lse, dout, causal)

    ours_o, theirs_o = ours_fwd(), theirs_fwd()[0]
    ours_g, theirs_g = ours_fwd_bwd(), theirs_fwd_bwd()
    diff = {"out": _rel(theirs_o, ours_o),
            **{n: _rel(t, o) for n, t, o in zip(("dq", "dk", "dv"), theirs_g, ours_g)}}
    t = {name: _time(fn, iters, repeats, graph=False) for name, fn in
         (("sm7x_fwd", ours_fwd), ("ssiu_fwd", theirs_fwd),
          ("sm7x_fwd_bwd", ours_fwd_bwd), ("ssiu_fwd_bwd", theirs_fwd_bwd))}
    row = {"head_dim": d, "heads": h, "kv_heads": hk, "seqlen": s, "batch": b, "causal": causal,
           **{f"{k}_ms": v * 1e3 for k, v in t.items()}, "rel_diff": diff}
    for part in ("fwd", "fwd_bwd"):
        row[f"x_{part}"] = t[f"ssiu_{part}"] / t[f"sm7x_{part}"]
    if kernels:
        (ours_k, ours_idle), (theirs_k, theirs_idle) = (kernel_times(ours_fwd_bwd),
                                                        kernel_times(theirs_fwd_bwd))
        row["kernel_us"] = {"sm7x": ours_k, "ssiu": theirs_k}
        row["gpu_idle_us"] = {"sm7x": ours_idle, "ssiu": theirs_idle}
    ours_bwd = t["sm7x_fwd_bwd"] - t["sm7x_fwd"]
    theirs_bwd = t["ssiu_fwd_bwd"] - t["ssiu_fwd"]
    row.update(sm7x_bwd_ms=ours_bwd * 1e3, ssiu_bwd_ms=theirs_bwd * 1e3,
               x_bwd=theirs_bwd / ours_bwd if ours_bwd > 0 else None)
    return row


def run(head_dims, seqlens, tokens: int, iters: int, repeats: int, occupancy: str | None,
        kernels: bool = False) -> dict:
    import flash_attn_turing as ssiu

    if set(head_dims) - SSIU_HEAD_DIMS:  # ssiu launches nothing for others and returns zeros
        raise ValueError(f"--head-dims {sorted(head_dims)}: ssiu has head dims "
                         f"{sorted(SSIU_HEAD_DIMS)} only; pick from those")
    shapes = [(d, HEADS, HEADS) for d in head_dims]
    if GQA[0] in head_dims:
        shapes.append(GQA)
    rows = []
    with occupancy_of(occupancy):
        for d, h, hk in shapes:
            for s in seqlens:
                for causal in (False, True):
                    rows.append(cell(ssiu, d, h, hk, s, causal, tokens, iters, repeats, kernels))
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "occupancy_of": occupancy, "tokens": tokens, "results": rows}


def short_name(name: str, width: int = 110) -> str:
    """A kernel's name for the table: namespaces dropped, and when still too long its start
    and end (the end tells apart kernels that differ in their last template argument, such
    as the two passes of a split backward)."""
    for ns in ("sm7x::fa2::sm75::", "sm7x::fa2::sm70::", "sm7x::fa2::", "cutlass::", "at::native::"):
        name = name.replace(ns, "")
    if len(name) <= width:
        return name
    return name[:width - 45] + " ... " + name[-40:]


def print_table(result: dict) -> None:
    print(f"sm7x vs ssiu/flash-attention-turing on {result['device']} (x = ssiu ms / sm7x ms; "
          f"sm7x occupancy capped at: {result['occupancy_of'] or 'none'})")
    print("  d  heads   seqlen causal |  fwd x | fwd+bwd x |  bwd x | sm7x bwd ms | worst rel diff")
    for r in result["results"]:
        bwd = "n/a" if r["x_bwd"] is None else f"{r['x_bwd']:.2f}"
        print(f"{r['head_dim']:>3} {r['heads']:>3}/{r['kv_heads']:<3} {r['seqlen']:>6} "
              f"{'yes' if r['causal'] else 'no ':>6} | {r['x_fwd']:6.2f} | {r['x_fwd_bwd']:9.2f} | "
              f"{bwd:>6} | {r['sm7x_bwd_ms']:11.3f} | {max(r['rel_diff'].values()):.1e}")
    for r in result["results"]:
        for lib, times in r.get("kernel_us", {}).items():
            print(f"d{r['head_dim']} {r['heads']}/{r['kv_heads']} {r['seqlen']}"
                  f"{' causal' if r['causal'] else ''} {lib} (us per fwd+bwd step; GPU idle "
                  f"between its kernels {r['gpu_idle_us'][lib]:.1f}):")
            for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"  {us:9.1f}  {short_name(name)}")


def draw(result: dict, plt):
    rows = result["results"]
    labels = [f"d{r['head_dim']} {r['heads']}/{r['kv_heads']} {r['seqlen']}"
              f"{' c' if r['causal'] else ''}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.5), 4))
    xs = range(len(rows))
    for i, part in enumerate(("fwd", "fwd_bwd", "bwd")):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r[f"x_{part}"] or 0 for r in rows], 0.27,
               label=part)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), labels, rotation=70, fontsize=7)
    ax.set_ylabel("ssiu time / sm7x time")
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv: list[str]) -> int:
    p = _output.argument_parser("vs_ssiu", __doc__)
    p.prog = "python csrc/fa2/probes/vs_ssiu.py"
    p.add_argument("--head-dims", help="comma-separated (ssiu has 64 and 128)")
    p.add_argument("--seqlens", help="comma-separated")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--occupancy-of", choices=("t4",), help="cap sm7x at a T4's CTAs per SM")
    p.add_argument("--kernel-times", action="store_true",
                   help="per cell, each kernel's device time in one fwd+bwd step of either library")
    a = p.parse_args(argv)
    result = run(_ints("--head-dims", a.head_dims, sorted(SSIU_HEAD_DIMS)),
                 _ints("--seqlens", a.seqlens, (512, 2048, 8192)), a.tokens, a.iters, a.repeats,
                 a.occupancy_of, a.kernel_times)
    print_table(result)
    _output.write(result, a.out, a.plot, draw)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
