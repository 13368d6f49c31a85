"""Benchmark of the sm7x core ops against the same ops in plain torch, on CUDA.

For each op and token count it times, in the same run and on the same inputs:

- ``sm7x``: the op of ``_core.abi3.so`` (``torch.ops.sm7x.*``, without the Python
  wrapper's checks, so small sizes are not bound by Python);
- ``torch``: the op written in plain torch (:mod:`sm7x.bench.reference`);
- ``copy``: ``dst.copy_(src)`` of half the op's bytes (a copy reads and writes each
  byte), the device's copy bandwidth for the same traffic (timed before and after the
  op, the faster of the two kept).

Timing: each variant is captured ``--iters`` times into a CUDA graph (no launch or
Python overhead; ``--no-graph`` launches eagerly instead), replayed for warm-up, then
``--repeats`` replays are timed with CUDA events; the median per iteration is reported.
Bandwidth = the bytes the op must move (each input read once, each output written
once) / time, for both implementations.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .. import _core_loader, ops
from . import _output, reference as ref

DEFAULT_TOKENS = (1024, 4096, 16384, 65536)
HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16


@dataclass
class Case:
    op: str
    tokens: int
    shape: str
    nbytes: int
    sm7x: Callable[[], object]
    baselines: dict[str, Callable[[], object]]
    check: Callable[[], float] | None = None  # max abs error sm7x vs torch, fresh inputs


@dataclass
class Row:
    op: str
    tokens: int
    shape: str
    mbytes: float
    sm7x_us: float
    torch_us: float
    copy_us: float
    sm7x_gbps: float
    torch_gbps: float
    copy_gbps: float
    speedup: float  # torch time / sm7x time
    frac_of_copy: float  # sm7x bandwidth / copy bandwidth
    max_abs_err: float | None
    other_baselines: dict[str, dict[str, float]] = field(default_factory=dict)


def _cases(tokens: int, hidden: int, dtype: torch.dtype, dev: str = "cuda") -> list[Case]:
    e = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=dev).manual_seed(tokens)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g)

    sm = torch.ops.sm7x
    cases = []
    eps = 1e-6

    # rms_norm: read x, write out (weight is negligible).
    x, w, out = rnd(tokens, hidden), rnd(hidden), rnd(tokens, hidden)
    base = {"torch": lambda x=x, w=w: ref.rms_norm(x, w, eps)}
    if hasattr(torch.nn.functional, "rms_norm"):
        base["F.rms_norm"] = lambda x=x, w=w: torch.nn.functional.rms_norm(x, (hidden,), w, eps)

    def check_rms(x=x, w=w):
        o = torch.empty_like(x)
        sm.rms_norm(o, x, w, eps)
        return (o.float() - ref.rms_norm(x, w, eps).float()).abs().max().item()

    cases.append(Case("rms_norm", tokens, f"[{tokens}, {hidden}]", 2 * tokens * hidden * e,
                      lambda: sm.rms_norm(out, x, w, eps), base, check_rms))

    # fused_add_rms_norm: read x and residual, write both.
    x2, r2 = rnd(tokens, hidden), rnd(tokens, hidden)

    def check_fused(x=x2, r=r2, w=w):
        xa, ra = x.clone(), r.clone()
        sm.fused_add_rms_norm(xa, ra, w, eps)
        xe, _ = ref.fused_add_rms_norm(x, r, w, eps)
        return (xa.float() - xe.float()).abs().max().item()

    cases.append(Case("fused_add_rms_norm", tokens, f"[{tokens}, {hidden}]",
                      4 * tokens * hidden * e,
                      lambda: sm.fused_add_rms_norm(x2, r2, w, eps),
                      {"torch": lambda: ref.fused_add_rms_norm(x2, r2, w, eps)}, check_fused))

    # silu_and_mul: x [tokens, 2 * hidden] -> [tokens, hidden].
    xs, os_ = rnd(tokens, 2 * hidden), rnd(tokens, hidden)

    def check_silu(x=xs):
        o = torch.empty(tokens, hidden, device=dev, dtype=dtype)
        sm.silu_and_mul(o, x)
        return (o.float() - ref.silu_and_mul(x).float()).abs().max().item()

    cases.append(Case("silu_and_mul", tokens, f"[{tokens}, {2 * hidden}]",
                      3 * tokens * hidden * e, lambda: sm.silu_and_mul(os_, xs),
                      {"torch": lambda: ref.silu_and_mul(xs)}, check_silu))

    # rotary_embedding (NeoX, fp32 cache): q [tokens, 32*128], k [tokens, 8*128] read and
    # written; positions and one cache row per token read.
    max_pos = 8192
    rot = HEAD_SIZE
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=dev, dtype=torch.float32) / rot))
    freqs = torch.arange(max_pos, device=dev, dtype=torch.float32)[:, None] * inv_freq
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    pos = torch.randint(0, max_pos, (tokens,), device=dev, generator=g)
    q, k = rnd(tokens, HEADS * HEAD_SIZE), rnd(tokens, KV_HEADS * HEAD_SIZE)
    cache_t = cache.to(dtype)  # plain torch (vLLM's forward_native) uses the query dtype

    def check_rot(q=q, k=k):
        qa, ka = q.clone(), k.clone()
        sm.rotary_embedding(pos, qa, ka, HEAD_SIZE, cache, True)
        qe, ke = ref.rotary_embedding(pos, q.float(), k.float(), HEAD_SIZE, cache, True)
        return max((qa.float() - qe).abs().max().item(), (ka.float() - ke).abs().max().item())

    rot_bytes = 2 * tokens * (HEADS + KV_HEADS) * HEAD_SIZE * e + tokens * (8 + rot * 4)
    cases.append(Case("rotary_embedding", tokens,
                      f"q[{tokens}, {HEADS}x{HEAD_SIZE}] k[{tokens}, {KV_HEADS}x{HEAD_SIZE}]",
                      rot_bytes, lambda: sm.rotary_embedding(pos, q, k, HEAD_SIZE, cache, True),
                      {"torch": lambda: ref.rotary_embedding(pos, q, k, HEAD_SIZE, cache_t, True)},
                      check_rot))

    # reshape_and_cache: key/value [tokens, 8, 128] into block-16 caches, random slots.
    nblocks = tokens // BLOCK_SIZE + 1
    key, value = rnd(tokens, KV_HEADS, HEAD_SIZE), rnd(tokens, KV_HEADS, HEAD_SIZE)
    kc = torch.zeros(nblocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(nblocks * BLOCK_SIZE, device=dev, generator=g)[:tokens]

    def check_cache():
        ka, va = torch.zeros_like(kc), torch.zeros_like(vc)
        sm.reshape_and_cache(key, value, ka, va, slots)
        ke, ve = ref.reshape_and_cache(key, value, torch.zeros_like(kc), torch.zeros_like(vc),
                                       slots, skip_negative=False)
        return max((ka.float() - ke.float()).abs().max().item(),
                   (va.float() - ve.float()).abs().max().item())

    cases.append(Case("reshape_and_cache", tokens, f"kv[{tokens}, {KV_HEADS}, {HEAD_SIZE}]",
                      4 * tokens * KV_HEADS * HEAD_SIZE * e + tokens * 8,
                      lambda: sm.reshape_and_cache(key, value, kc, vc, slots),
                      {"torch": lambda: ref.reshape_and_cache_(key, value, kc, vc, slots)},
                      check_cache))
    return cases


def _time(fn: Callable[[], object], iters: int, repeats: int, graph: bool,
          dev: str = "cuda") -> float:
    """Median seconds per call of fn."""
    fn()  # warm-up (lazy module loading, PTX JIT, allocator)
    if dev == "cpu":  # smoke test of the benchmark itself: wall clock
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) / iters)
        return statistics.median(times)
    torch.cuda.synchronize()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up on a side stream before capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()

        def run():
            g.replay()
    else:
        def run():
            for _ in range(iters):
                fn()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    if graph:
        del g
    return statistics.median(times)


def _copy_fn(nbytes: int, dev: str = "cuda") -> Callable[[], object]:
    n = max(1, nbytes // 2 // 2)  # fp16 elements: half the bytes read, half written
    src = torch.empty(n, device=dev, dtype=torch.float16).normal_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def run(tokens_list=DEFAULT_TOKENS, hidden: int = 4096, dtype: str = "float16",
        iters: int = 10, repeats: int = 10, graph: bool = True,
        ops_filter: list[str] | None = None, device: str = "cuda") -> dict:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("sm7x.bench core: needs a CUDA device (torch.cuda.is_available() is "
                         "False); --device cpu only smoke-tests the benchmark")
    graph = graph and device == "cuda"
    ops.load_library()
    dt = getattr(torch, dtype)
    rows: list[Row] = []
    for tokens in tokens_list:
        for case in _cases(tokens, hidden, dt, device):
            if ops_filter and case.op not in ops_filter:
                continue
            err = case.check() if case.check else None
            copy = _copy_fn(case.nbytes, device)
            # The copy is timed before and after the op and the faster taken: the
            # device's bandwidth, not a moment's dip (clocks, other allocations).
            t_copy = _time(copy, iters, repeats, graph, device)
            t_sm = _time(case.sm7x, iters, repeats, graph, device)
            base_times = {name: _time(fn, iters, repeats, graph, device)
                          for name, fn in case.baselines.items()}
            t_copy = min(t_copy, _time(copy, iters, repeats, graph, device))
            del copy
            t_torch = base_times.pop("torch")
            gb = case.nbytes / 1e9
            rows.append(Row(
                op=case.op, tokens=tokens, shape=case.shape, mbytes=case.nbytes / 1e6,
                sm7x_us=t_sm * 1e6, torch_us=t_torch * 1e6, copy_us=t_copy * 1e6,
                sm7x_gbps=gb / t_sm, torch_gbps=gb / t_torch, copy_gbps=gb / t_copy,
                speedup=t_torch / t_sm, frac_of_copy=t_copy / t_sm, max_abs_err=err,
                other_baselines={name: {"us": t * 1e6, "gbps": gb / t, "speedup": t / t_sm}
                                 for name, t in base_times.items()},
            ))
            print(_format_row(rows[-1]), flush=True)
            del case
        if device == "cuda":
            torch.cuda.empty_cache()
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, cap = props.name, f"{props.major}.{props.minor}"
    else:
        name, cap = f"CPU ({platform.processor() or platform.machine()})", "-"
    return {
        "benchmark": "sm7x core ops vs plain torch",
        "device": name,
        "capability": cap,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "library": str(_core_loader.loaded_path()),
        "dtype": dtype,
        "hidden": hidden,
        "timing": {"iters_per_sample": iters, "samples": repeats, "statistic": "median",
                   "cuda_graph": graph},
        "bytes": "each input read once and each output written once (minimum traffic)",
        "results": [asdict(r) for r in rows],
    }


HEADER = (f"{'op':<20} {'tokens':>7} {'MB':>9} {'sm7x us':>9} {'torch us':>9} "
          f"{'sm7x GB/s':>10} {'torch GB/s':>10} {'copy GB/s':>10} {'speedup':>8} "
          f"{'%copy':>6} {'max err':>9}")


def _format_row(r: Row) -> str:
    err = f"{r.max_abs_err:.2e}" if r.max_abs_err is not None else "-"
    return (f"{r.op:<20} {r.tokens:>7} {r.mbytes:>9.1f} {r.sm7x_us:>9.1f} {r.torch_us:>9.1f} "
            f"{r.sm7x_gbps:>10.0f} {r.torch_gbps:>10.0f} {r.copy_gbps:>10.0f} "
            f"{r.speedup:>7.2f}x {100 * r.frac_of_copy:>5.0f}% {err:>9}")


def print_table(result: dict) -> None:
    print(f"\nsm7x core ops on {result['device']} (capability {result['capability']}), "
          f"torch {result['torch']}, {result['dtype']}, hidden {result['hidden']}")
    print(HEADER)
    for r in result["results"]:
        print(_format_row(Row(**r)))
        for name, b in r["other_baselines"].items():
            print(f"{'':<20} {'':>7} {'':>9} {'':>9} {b['us']:>9.1f} {'':>10} "
                  f"{b['gbps']:>10.0f} {'':>10} {b['speedup']:>7.2f}x  (vs {name})")


def draw(result: dict, plt):
    """The PNG of the results (see _output.write)."""
    rows = result["results"]
    op_names = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(op_names), figsize=(4.2 * len(op_names), 4), squeeze=False)
    for ax, op in zip(axes[0], op_names):
        rs = [r for r in rows if r["op"] == op]
        _output.grouped_bars(ax, [f"{r['tokens'] // 1024}k" if r["tokens"] >= 1024 else str(r["tokens"])
                          for r in rs],
                     {"sm7x": [r["sm7x_gbps"] for r in rs], "plain torch": [r["torch_gbps"] for r in rs],
                      "copy": [r["copy_gbps"] for r in rs]})
        ax.set_title(op)
        ax.set_xlabel("tokens")
        ax.set_ylabel("GB/s")
    axes[0][0].legend()
    fig.suptitle(f"sm7x core ops, {result['device']}, {result['dtype']}, hidden {result['hidden']}")
    return fig


def main(argv: list[str]) -> int:
    p = _output.argument_parser("core", __doc__)
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                   help="comma-separated token counts (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (default: %(default)s)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=10, help="calls per timed sample")
    p.add_argument("--repeats", type=int, default=10, help="timed samples (median taken)")
    p.add_argument("--no-graph", action="store_true", help="launch eagerly, no CUDA graphs")
    p.add_argument("--ops", help="comma-separated subset of the ops")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu only smoke-tests the benchmark (timings say nothing)")
    a = p.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",") if t]
    if a.device == "cuda" and not torch.cuda.is_available():
        print("sm7x.bench core: needs a CUDA device (torch.cuda.is_available() is False); "
              "--device cpu only smoke-tests the benchmark", file=sys.stderr)
        return 1
    print(HEADER)
    result = run(tokens, a.hidden, a.dtype, a.iters, a.repeats, not a.no_graph,
                 a.ops.split(",") if a.ops else None, a.device)
    print_table(result)
    _output.write(result, a.out, a.plot, draw)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
