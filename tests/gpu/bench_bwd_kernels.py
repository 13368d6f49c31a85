"""Speed of the FA2 backward ops alone (torch.ops.<ns>.bwd, the library's own forward for
out/lse) against torch SDPA's memory-efficient backward, fp16, 16k tokens per batch,
heads x d = 2048. Not a test (no test_ prefix): run it by hand on a GPU, e.g. on the H200

    SM7X_LIBRARY_PATH=<dir> SM7X_FA2_FORCE=sm75 python tests/gpu/bench_bwd_kernels.py

TFLOP/s count the backward as 2.5x the forward's 4 * b * h * sq * sk * d (half with causal).
"""

from __future__ import annotations

import math
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fa2_reference import selected_arch  # noqa: E402

from sm7x import _select  # noqa: E402


def _time(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main():
    arch, why = selected_arch()
    if arch is None:
        raise SystemExit(why)
    ns = f"sm7x_fa2_{arch}"
    torch.ops.load_library(str(_select.library_path(arch)))
    ops = getattr(torch.ops, ns)
    print(f"{ns} on {torch.cuda.get_device_name()}")
    print("d    seqlen causal det   sm7x ms  TFLOP/s  sdpa-eff ms  TFLOP/s  ratio")
    for d in (64, 128, 256):
        h = 2048 // d
        for s in (512, 2048, 8192):
            b = max(1, 16384 // s)
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16,
                                         generator=g) for _ in range(4))
            scale = 1 / math.sqrt(d)
            for causal in (False, True):
                out = torch.empty_like(q)
                lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
                ops.fwd(q, k, v, out, lse, scale, causal, -1, -1, 0.0)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                dq_accum = torch.empty(q.shape, device="cuda", dtype=torch.float32)  # op zeroes it
                dsum = torch.empty_like(lse)
                flop = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)

                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                go = dout.transpose(1, 2)
                t_ref = _time(lambda: torch.autograd.grad(o, (qt, kt, vt), go, retain_graph=True))
                for det in (False, True):
                    def run():
                        ops.bwd(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, scale,
                                causal, -1, -1, 0.0, det)
                    t = _time(run)
                    print(f"{d:<4} {s:<6} {causal!s:<6} {det!s:<5} {t * 1e3:8.3f} "
                          f"{flop / t / 1e12:8.1f} {t_ref * 1e3:11.3f} {flop / t_ref / 1e12:8.1f} "
                          f"{t_ref / t:6.2f}")


if __name__ == "__main__":
    main()
