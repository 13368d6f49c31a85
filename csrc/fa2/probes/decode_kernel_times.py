"""Device time per kernel of one sm7x decode step (the decode kernel, the split-KV combine),
per cache format, from torch.profiler: where an 8-bit step's time goes beside fp16's.

``SM7X_FA2_FORCE=sm75 PYTHONPATH=python python csrc/fa2/probes/decode_kernel_times.py
[--rows 1x128k,16x32k] [--formats fp16,fp8_e4m3,fp8_e5m2,int8_per_token_head] [--splits 0]
[--out times.json]``

32 / 8 heads, d128, pages of 16 in a random order, as ``python -m sm7x.bench decode``;
``--splits`` is plan_decode's num_splits (0: the planner's)."""

from __future__ import annotations

import argparse
import collections
import json

import torch


def _row(text: str) -> tuple[int, int]:
    """'16x32k' -> (16, 32768): batch x keys, the keys as --lens reads them."""
    from sm7x.bench.decode.cli import parse_sizes

    b, _, n = text.partition("x")
    return int(b), parse_sizes(n)[0]


def _short(name: str) -> str:
    """A profiler kernel name without return type, namespaces and arguments."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    for stop in "<(":
        name = name.split(stop)[0]
    return name.split("::")[-1]


def main() -> None:
    from sm7x.bench.decode import runs
    from sm7x.bench.decode.arithmetic import DEFAULT_SHAPE as sh
    from sm7x.fa2 import flash_attn_varlen_func, plan_decode

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1x128k,16x32k")
    p.add_argument("--formats", default="fp16,fp8_e4m3,fp8_e5m2,int8_per_token_head")
    p.add_argument("--splits", type=int, default=0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", help="also write the rows to this JSON file")
    a = p.parse_args()
    rows = []
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for batch, kv_len in map(_row, a.rows.split(",")):
        _, _, k_p, v_p, bt, seqused = runs._paged_inputs(batch, kv_len, 16, gen, dev, sh)
        q = torch.randn(batch, sh.heads, sh.head_dim, device=dev, dtype=torch.float16,
                        generator=gen)
        cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        for fmt in a.formats.split(","):
            if fmt == "fp16":
                k, v, extra, kvd = k_p, v_p, {}, None
            else:
                (k, dk), (v, dv) = runs._encode_cache(k_p, fmt), runs._encode_cache(v_p, fmt)
                extra, kvd = runs._kv8_args(fmt, dk, dv), fmt
            plan = plan_decode(batch, 1, kv_len, sh.heads, sh.kv_heads, sh.head_dim, device=dev,
                               num_splits=a.splits, kv_cache_dtype=kvd)
            out = torch.empty_like(q)

            def call():
                flash_attn_varlen_func(q, k, v, cu_q, None, 1, kv_len, causal=True,
                                       block_table=bt, seqused_k=seqused, out=out,
                                       scheduler_metadata=plan, **extra)

            for _ in range(3):
                call()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(a.iters):
                    call()
                torch.cuda.synchronize()
            per = collections.defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name] += e.device_time_total / a.iters
            total = sum(per.values())
            parts = ", ".join(f"{_short(n)} {t:.1f}"
                              for n, t in sorted(per.items(), key=lambda x: -x[1]))
            print(f"{batch}x{kv_len // 1024}k {fmt:<20} splits {plan.total_splits:>5} "
                  f"waves {plan.waves}: {total:7.1f} us = {parts}", flush=True)
            rows.append({"batch": batch, "kv_len": kv_len, "format": fmt,
                         "splits": plan.total_splits, "waves": plan.waves, "total_us": total,
                         "kernels_us": {_short(n): t for n, t in per.items()}})
            del k, v
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
