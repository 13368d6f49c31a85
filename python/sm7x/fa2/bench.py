"""Quick FA2 forward benchmark against torch SDPA's memory-efficient backend (the only
fused SDPA backend on Volta/Turing): ``python -m sm7x.fa2.bench``.

fp16, head dim 128 (``--head-dim``), ``--tokens`` tokens per batch (batch = tokens //
seqlen), causal and not; prints TFLOP/s (4 * b * h * sq * sk * d, halved for causal) and
the ratio ours / SDPA.
"""

from __future__ import annotations

import argparse

import torch

from . import flash_attn_func


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2] / 1e3  # median, seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.cuda.current_device()
    print(f"device: {torch.cuda.get_device_name(dev)} "
          f"(capability {torch.cuda.get_device_capability(dev)}), torch {torch.__version__}")
    print(f"{'seqlen':>7} {'batch':>5} {'causal':>6} {'sm7x TFLOP/s':>13} "
          f"{'SDPA-eff TFLOP/s':>17} {'ratio':>6}")
    d, h = args.head_dim, args.heads
    for s in args.seqlens:
        b = max(1, args.tokens // s)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for causal in (False, True):
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            ours = _time(lambda: flash_attn_func(q, k, v, causal=causal), args.iters)
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                ref = _time(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal), args.iters)
            print(f"{s:>7} {b:>5} {str(causal):>6} {flops / ours / 1e12:>13.1f} "
                  f"{flops / ref / 1e12:>17.1f} {ref / ours:>6.2f}")


if __name__ == "__main__":
    main()
