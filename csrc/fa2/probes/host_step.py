"""Maintainers' probe, run by hand (in no package): the host time of one eager training step
of attention (forward + ``torch.autograd.grad``) through sm7x.fa2's Python layers, with a
library whose ops do nothing, so that only the Python and dispatcher work is timed. Runs on
the CPU (CPU tensors; no GPU or sm7x library needed):

    PYTHONPATH=python python csrc/fa2/probes/host_step.py [--shape 2,64,4,128]
        [--calls 1000] [--repeats 5] [--out f.json] [--plot f.png]

Three ways to run the same step, interleaved in one run, each the minimum over repeats of
µs per step: ``flash_attn_func`` (the eager path: the autograd ops' implementations under a
``torch.autograd.Function``), ``via_ops`` (the ``sm7x_fa2::attn`` custom op with its
registered autograd, which torch.compile traces, called eagerly) and ``raw`` (the library's
fwd and bwd ops called directly with preallocated-by-hand outputs: no checks, no autograd).
``x`` = via_ops / flash_attn_func. On a GPU this time is hidden behind the kernels while
the host keeps ahead; it shows where each layer's kernels are short (small batches).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from sm7x.bench import _output
from sm7x.bench.fa2 import _ints

_SCHEMA_OPTS = "float softmax_scale, bool causal, int window_left, int window_right, float softcap"


def _nop_library():
    """A namespace with the library's fwd / bwd schemas whose kernels do nothing."""
    lib = torch.library.Library("sm7x_nop_fa2", "DEF")
    lib.define("fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, "
               f"{_SCHEMA_OPTS}, Tensor? sinks=None) -> ()")
    lib.define("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
               "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) dq_accum, "
               f"Tensor(e!) dsum, {_SCHEMA_OPTS}, bool deterministic) -> ()")
    lib.define("bwd_supported(int head_dim) -> bool")
    lib.define("bwd_uses_dq_accum(int head_dim) -> bool")
    for name, fn in (("fwd", lambda *a, **k: None), ("bwd", lambda *a, **k: None),
                     ("bwd_supported", lambda d: True), ("bwd_uses_dq_accum", lambda d: False)):
        lib.impl(name, fn, "CompositeExplicitAutograd")
    return lib, torch.ops.sm7x_nop_fa2


def run(shape: tuple[int, int, int, int], calls: int, repeats: int) -> dict:
    import sm7x.fa2 as fa2
    from sm7x.fa2 import _autograd

    lib, ops = _nop_library()  # noqa: F841 (the Library must stay alive)
    fa2._ops_for = lambda t: ops  # route sm7x.fa2 to it, CPU tensors allowed
    fa2._check_cuda = lambda fn, q: None
    b, s, h, d = shape
    scale = d ** -0.5
    q, k, v, dout = (torch.randn(b, s, h, d, dtype=torch.float16) for _ in range(4))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def eager():
        return torch.autograd.grad(fa2.flash_attn_func(*leaves, causal=True), leaves, dout)

    def via_ops():
        out, _ = _autograd.attn(*leaves, scale, True, -1, 0, 0.0, False)
        return torch.autograd.grad(out, leaves, dout)

    def raw():
        out, lse = torch.empty_like(q), torch.empty((b, h, s), dtype=torch.float32)
        ops.fwd(q, k, v, out, lse, scale, True, -1, 0, 0.0, sinks=None)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        ops.bwd(dout, q, k, v, out, lse, *grads, torch.empty(0), torch.empty_like(lse), scale,
                True, -1, 0, 0.0, False)
        return grads

    steps = {"flash_attn_func": eager, "via_ops": via_ops, "raw": raw}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for fn in steps.values():  # warm-up
        for _ in range(calls // 5 + 1):
            fn()
    for _ in range(repeats):  # interleaved, so that drift hits all three alike
        for name, fn in steps.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    us = {name: min(ts) for name, ts in times.items()}
    return {"torch": torch.__version__, "shape": list(shape), "calls": calls,
            "repeats": repeats, "us_per_step_min": us,
            "us_per_step_median": {n: statistics.median(ts) for n, ts in times.items()},
            "x": us["via_ops"] / us["flash_attn_func"]}


def draw(result: dict, plt):
    fig, ax = plt.subplots(figsize=(5, 3))
    names = list(result["us_per_step_min"])
    ax.bar(names, [result["us_per_step_min"][n] for n in names])
    ax.set_ylabel("host µs per fwd+bwd step (min)")
    return fig


def main(argv: list[str]) -> int:
    p = _output.argument_parser("host_step", __doc__)
    p.prog = "python csrc/fa2/probes/host_step.py"
    p.add_argument("--shape", help="batch,seqlen,heads,head_dim (default 2,64,4,128)")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    try:
        shape = tuple(_ints("--shape", a.shape, (2, 64, 4, 128)))
    except ValueError as exc:
        p.error(str(exc))
    if len(shape) != 4:
        p.error(f"--shape takes 4 numbers (batch,seqlen,heads,head_dim), got {a.shape}")
    for flag, n in (("--calls", a.calls), ("--repeats", a.repeats)):
        if n < 1:
            p.error(f"{flag} must be at least 1, got {n}")
    result = run(shape, a.calls, a.repeats)
    for name, us in result["us_per_step_min"].items():
        print(f"{name:16s} {us:7.1f} µs per step (min of {a.repeats} x {a.calls}; median "
              f"{result['us_per_step_median'][name]:.1f})")
    print(f"x (via_ops / flash_attn_func) {result['x']:.2f}")
    _output.write(result, a.out, a.plot, draw)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
