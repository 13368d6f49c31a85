"""sm7x-fa2-sm70 and sm7x-fa2-sm75 from ./channel: one abi3 build each, both in one
environment behind the flash-attn API of `sm7x`, and static checks of the shipped SASS
with the channel's own CUDA tools (no GPU needed)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from sm7x import _targets
from sm7x_tools import envs, kernels
from pkgtest import CHANNEL, CHANNELS, run

pytestmark = pytest.mark.package

SITE = "lib/python3.11/site-packages/sm7x"
# per arch: the tensor-core / load instructions every attention kernel must use (Turing:
# m16n8k8 MMAs fed by ldmatrix; Volta: the HMMA.884 steps WMMA compiles to, no ldmatrix)
ARCHS = {
    "sm75": ("HMMA.1688", "LDSM", "LDG.E.128"),
    "sm70": ("HMMA.884", "LDG.E.128"),
}
REG_GRANULE = 8  # registers are allocated per thread in multiples of 8 on sm_70 / sm_75


def lib(env, arch):
    return env.prefix / SITE / "fa2" / f"_fa2_{arch}.abi3.so"


def fa2_table(env) -> dict:
    """The fa2 section of targets.json as the env's sm7x ships it: the kernels' configs
    (threads, dynamic shared memory) and the cards' limits."""
    return json.loads((env.prefix / SITE / "targets.json").read_text())["fa2"]


def cuobjdump(env, flag, arch) -> str:
    return subprocess.run([str(env.prefix / "bin" / "cuobjdump"), flag, str(lib(env, arch))],
                          capture_output=True, text=True, check=True).stdout


CPU_CALL = r"""
import torch, sm7x
q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
try:
    sm7x.flash_attn_func(q, q, q)
except Exception as exc:
    print(type(exc).__name__, exc)
else:
    raise SystemExit("a CPU tensor must be refused")
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return envs.create(tmp_path_factory.mktemp("fa2") / "env",
                       ["sm7x", "sm7x-fa2-sm70", "sm7x-fa2-sm75", "python 3.11.*", "pytorch 2.13.*",
                        "cuda-nvcc_linux-64", "cuda-nvdisasm"], CHANNELS)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_abi3_build(arch):
    data = json.loads((CHANNEL / "linux-64" / "repodata.json").read_text())["packages.conda"]
    (rec,) = [r for r in data.values() if r["name"] == f"sm7x-fa2-{arch}"]
    assert rec.get("noarch") == "python" and rec["build"].startswith("cuda124_")
    assert {f"pytorch >={_targets.torch_min()}", "__cuda >=12"} <= set(rec.get("constrains", []))
    assert not any(d.startswith(("python_abi", "pytorch", "libtorch")) for d in rec["depends"])


def test_api_refuses_cpu_tensors_with_a_clear_error(env):
    out = run(env, "-c", CPU_CALL)
    assert "CUDA" in out, out


# The op itself (C++ check, no Python wrapper) on CPU tensors: its message names the op and
# the argument and carries no source location at all (csrc/core/check.h), let alone the
# build directory.
OP_CALL = r"""
import torch, sm7x.fa2._loader as loader, sm7x._select as select
dev = select.Device(0, "Tesla T4", (7, 5))
for arch in ("sm75", "sm70"):
    ns = loader.load(select.Selection(arch, "test"), dev)
    q = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8)
    try:
        getattr(torch.ops, ns).fwd(q, q, q, q.clone(), lse, 0.125, False, -1, -1, 0.0)
    except RuntimeError as exc:
        print("MSG", str(exc).splitlines()[0])
"""


def test_op_errors_name_the_op_and_no_build_path(env):
    out = run(env, "-c", OP_CALL)
    lines = [line for line in out.splitlines() if line.startswith("MSG")]
    assert len(lines) == 2, out
    for arch, line in zip(("sm75", "sm70"), lines):
        assert line.startswith(f"MSG sm7x.fa2_{arch}.fwd: q must be a CUDA tensor"), line
        assert ".cpp" not in line and not re.search(r"/\S+/", line), f"a source path in {line!r}"


# The op owns the checks of what it is given (sm7x.fa2 leaves them to it): on CPU tensors
# every one of them comes before "must be a CUDA tensor", so its messages are testable
# here. (bad call, what the message must say), for both libraries.
OP_CHECKS = r"""
import torch, sm7x.fa2._loader as loader, sm7x._select as select
dev = select.Device(0, "Tesla T4", (7, 5))
h = torch.float16
def qkv(b=1, s=8, hq=4, hk=4, d=64, dt=h, dk=None):
    return (torch.zeros(b, s, hq, d, dtype=dt), torch.zeros(b, s, hk, dk or d, dtype=dt),
            torch.zeros(b, s, hk, dk or d, dtype=dt))
def call(ns, q, k, v, scale=0.125, wl=-1, wr=-1, cap=0.0):
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    getattr(torch.ops, ns).fwd(q, k, v, torch.empty_like(q), lse, scale, False, wl, wr, cap)
CASES = {
    "bf16": lambda ns: call(ns, *qkv(dt=torch.bfloat16)),
    "d100": lambda ns: call(ns, *qkv(d=100)),
    "d300": lambda ns: call(ns, *qkv(d=300)),
    "gqa": lambda ns: call(ns, *qkv(hq=4, hk=3)),
    "head-dim": lambda ns: call(ns, *qkv(dk=32)),
    "batch": lambda ns: call(ns, qkv(b=2)[0], *qkv(b=1)[1:]),
    "scale": lambda ns: call(ns, *qkv(), scale=-1.0),
    "window": lambda ns: call(ns, *qkv(), wl=-2),
    "softcap": lambda ns: call(ns, *qkv(), cap=-1.0),
    "cpu": lambda ns: call(ns, *qkv()),
}
for arch in ("sm75", "sm70"):
    ns = loader.load(select.Selection(arch, "test"), dev)
    for name, f in CASES.items():
        try:
            f(ns)
        except RuntimeError as exc:
            print("MSG", arch, name, str(exc).splitlines()[0])
"""

OP_MESSAGES = {
    "bf16": "q has dtype bfloat16; sm7x FA2 supports float16 only",
    "d100": ("head dim 100 is not supported: it must be a multiple of 8 and at most "
             f"{_targets.fa2_max_head_dim()}"),
    "d300": "head dim 300 is not supported",
    "gqa": "num_heads (4) must be a multiple of num_kv_heads (3)",
    "head-dim": "q, k and v must have the same head dim",
    "batch": "q has batch 2 but k has 1",
    "scale": "softmax_scale must be a finite number > 0",
    "window": "window_size must be (left, right) with -1 for unbounded",
    "softcap": "softcap must be a finite number >= 0",
    "cpu": "q must be a CUDA tensor",
}


def test_the_op_checks_its_arguments_before_the_device(env):
    out = run(env, "-c", OP_CHECKS)
    got = {tuple(line.split(" ", 3)[1:3]): line.split(" ", 3)[3]
           for line in out.splitlines() if line.startswith("MSG ")}
    for arch in ("sm75", "sm70"):
        for name, want in OP_MESSAGES.items():
            msg = got.get((arch, name))
            assert msg is not None, f"{arch} {name}: the op raised nothing\n{out}"
            assert msg.startswith(f"sm7x.fa2_{arch}.fwd: ") and want in msg, (arch, name, msg)
    assert "zero-pad q, k, v to 104" in got[("sm75", "d100")]


def expected_kernels(arch: str, fa2: dict) -> dict[tuple, dict]:
    """(head_dim, block_m, block_n, serving, kv_read) -> its table entry: the prefill
    kernels (fa2.kernels), the narrow serving ones (fa2.serving_kernels) and the wide
    serving ones (fa2.kernels' tiles, where they have more rows than the narrow tile of
    that head dim; elsewhere the narrow kernel runs those calls), and the decode kernels
    (fa2.decode_kernels, DECODE_ROWS rows). kv_read (fa2.h KvRead,
    sm7x_tools.kernels.KV_READ): each serving kernel over fp16, fp8 and int8 caches."""
    narrow_bm = {e["head_dim"]: e["block_m"] for e in fa2["serving_kernels"][arch]}
    want = {}
    for e in fa2["kernels"][arch]:
        want[(e["head_dim"], e["block_m"], e["block_n"], False, 0)] = e
        if e["block_m"] > narrow_bm[e["head_dim"]]:
            for kv in kernels.KV_READ:
                want[(e["head_dim"], e["block_m"], e["block_n"], True, kv)] = e
    for e in fa2["serving_kernels"][arch]:
        for kv in kernels.KV_READ:
            want[(e["head_dim"], e["block_m"], e["block_n"], True, kv)] = e
    for e in fa2.get("decode_kernels", {}).get(arch, []):  # DECODE_ROWS rows: no clash
        for kv in kernels.KV_READ:
            want[(e["head_dim"], kernels.DECODE_ROWS, e["block_n"], True, kv)] = e
    return want


def block_fit_problems(what: str, r: dict, threads: int, smem_dyn: int, limits: dict,
                       stack: int = 0) -> list[str]:
    """One kernel's block against the card (forward and backward alike): registers, rounded
    to their allocation granule, x threads <= the card's registers per block; static plus
    dynamic shared memory <= its opt-in limit per block; nothing in local memory and no
    stack (spills) beyond `stack` bytes, the allowance a backward entry states."""
    problems = []
    regs = -(-r["reg"] // REG_GRANULE) * REG_GRANULE * threads
    if regs > limits["regs_per_block"]:
        problems.append(f"{what}: {r['reg']} registers x {threads} threads "
                        f"= {regs} > {limits['regs_per_block']} per block: cannot launch")
    smem = r["shared"] + smem_dyn
    if smem > limits["smem_per_block"]:
        problems.append(f"{what}: {smem} bytes of shared memory > "
                        f"{limits['smem_per_block']} per block")
    if r["local"] or r["stack"] > stack:
        problems.append(f"{what}: local memory (spills or stack) {r}, allowed: a stack of "
                        f"{stack} bytes")
    return problems


def kernel_problems(arch: str, res_text: str, sass_text: str, fa2: dict) -> list[str]:
    """What ptxas does not check, per kernel of the tables (expected_kernels): it is in
    the library (one kernel per entry, no other); its block fits on an SM at all with the
    table's dynamic shared memory (block_fit_problems); it runs on tensor cores and 128-bit
    loads (ARCHS)."""
    limits = fa2["card_limits"][arch]
    res, sass = kernels.resources(res_text), kernels.sass_functions(sass_text)
    found = {}
    for name in res:
        key = kernels.kernel_key(name)
        if key is not None:
            found.setdefault(key, []).append(name)
    problems = []
    for key, e in expected_kernels(arch, fa2).items():
        kind = "decode" if key[1] == kernels.DECODE_ROWS else "serving"
        what = (f"{arch} d={key[0]} {key[1]}x{key[2]} "
                f"{kind + kernels.KV_READ[key[4]] if key[3] else 'prefill'}")
        names = found.pop(key, [])
        if len(names) != 1:
            problems.append(f"{what}: {len(names)} kernels in the library, want 1")
            continue
        name, r = names[0], res[names[0]]
        threads = kernels.kernel_threads(name)  # the wide serving kernels: 16 rows per warp
        # the int8 decode kernels of a measured entry may keep a few bytes on the stack
        int8 = kernels.KV_READ[key[4]] == " int8"
        stack = e.get("int8_stack_bytes", 0) if kind == "decode" and int8 else 0
        problems += block_fit_problems(what, r, threads, e["smem_bytes"], limits, stack)
        ops = [op for _, op, _ in sass.get(name, [])]
        for instruction in ARCHS[arch]:
            if not any(op.startswith(instruction) for op in ops):
                problems.append(f"{what}: no {instruction} in its SASS")
    problems += [f"{arch} {key}: kernel not in targets.json: {names}" for key, names in found.items()]
    return problems


@pytest.mark.parametrize("arch", ARCHS)
def test_sass_and_ptx_for_its_own_arch_only(env, arch):
    out = subprocess.run([str(env.prefix / "bin" / "cuobjdump"), "--list-elf", "--list-ptx", str(lib(env, arch))],
                         capture_output=True, text=True, check=True).stdout
    want = "sm_" + arch[2:]
    assert set(re.findall(r"\.(sm_\d+)\.(?:cubin|ptx)", out)) == {want}, out
    assert ".ptx" in out and ".cubin" in out


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_of_the_table_is_built_and_fits_the_card(env, arch):
    problems = kernel_problems(arch, cuobjdump(env, "-res-usage", arch),
                               cuobjdump(env, "-sass", arch), fa2_table(env))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", ARCHS)
def test_static_tile_analysis_of_the_shipped_sass(env, arch):
    """python -m sm7x_tools.kernels on the shipped library: every kernel of the tables is
    found, and in each the tensor-core instructions of the K/V-tile loop do exactly one
    tile's FLOP (4 * block_m * block_n * head_dim): the loop the analysis reports on is the
    tile loop, so its per-tile shared-memory bytes and occupancy can be trusted."""
    fa2 = fa2_table(env)
    stats = kernels.analyse(lib(env, arch), fa2, cuda_bin=str(env.prefix / "bin"))
    kinds = {"prefill": 0, **{kind + label: kv for kv, label in kernels.KV_READ.items()
                              for kind in ("serving", "decode")}}
    stats = [s for s in stats if s.kind in kinds]  # backward: below
    found = {(s.head_dim, s.block_m, s.block_n, s.serving, kinds[s.kind]) for s in stats}
    assert found == set(expected_kernels(arch, fa2)), found
    bad = [s for s in stats if not s.tensor_flop_matches or s.blocks_per_sm < 1]
    assert not bad, bad


# The backward kernels (fa2.bwd_kernels.<arch>, csrc/fa2/README.md "Backward"): BwdConfig<D,
# block_n, block_m, dq_block_m, dq_block_n, split, ...>; bwd_kernel<Config, mode> (mode 0: dK,
# dV and dQ; split: 1 = dV, 2 = dK and dQ) and bwd_dq_kernel<Config> (deterministic dQ), read
# from their names by sm7x_tools.kernels.bwd_key.


def bwd_kernel_problems(arch: str, res_text: str, sass_text: str, fa2: dict) -> list[str]:
    """Per entry of fa2.bwd_kernels.<arch>: its kernels are in the library (bwd_kernel once,
    or with split a dV pass at dv_block_n and a dK/dQ pass (dq_pass: no dQ in them);
    bwd_dq_kernel once), fit the
    card (registers x threads, shared memory), keep nothing in local memory (the main
    kernels: no stack beyond the entry's stack_bytes; the dQ kernel none) and run on tensor
    cores."""
    limits = fa2["card_limits"][arch]
    res, sass = kernels.resources(res_text), kernels.sass_functions(sass_text)
    found: dict[tuple, list[str]] = {}
    for name in res:
        key = kernels.bwd_key(name)  # (kind: "bwd", "bwd dV", "bwd dKdQ", "bwd dQ"; d, tile)
        if key is not None:
            found.setdefault(key[:4], []).append(name)
    problems = []
    for e in fa2.get("bwd_kernels", {}).get(arch, []):
        d = e["head_dim"]
        allowed = e.get("stack_bytes", 0)  # measured with it (csrc/fa2/MEASUREMENTS.md)
        main = {(False, False): "bwd", (True, False): "bwd dKdQ", (False, True): "bwd dKdV",
                (True, True): "bwd dK"}[bool(e.get("split")), bool(e.get("dq_pass"))]
        passes = [(main, e["block_n"], e["block_m"], e["smem_bytes"], allowed),
                  ("bwd dQ", e["dq_block_m"], e["dq_block_n"], e["dq_smem_bytes"], 0)]
        if e.get("split"):
            passes.append(("bwd dV", e.get("dv_block_n", e["block_n"]), e["block_m"],
                           e["dv_smem_bytes"], allowed))
        for kind, rows, cols, smem_dyn, stack in passes:
            what = f"{arch} d={d} {kind} {rows}x{cols}"
            names = found.pop((kind, d, rows, cols), [])
            if len(names) != 1:
                problems.append(f"{what}: {len(names)} kernels in the library, want 1")
                continue
            name = names[0]
            problems += block_fit_problems(what, res[name], kernels.bwd_key(name)[4], smem_dyn,
                                           limits, stack)
            ops = [op for _, op, _ in sass.get(name, [])]
            if not any(op.startswith(ARCHS[arch][0]) for op in ops):
                problems.append(f"{what}: no {ARCHS[arch][0]} in its SASS")
    problems += [f"{arch} {key}: backward kernel not in targets.json" for key in found]
    return problems


@pytest.mark.parametrize("arch", ARCHS)
def test_every_backward_kernel_of_the_table_is_built_and_fits_the_card(env, arch):
    problems = bwd_kernel_problems(arch, cuobjdump(env, "-res-usage", arch),
                                   cuobjdump(env, "-sass", arch), fa2_table(env))
    assert not problems, "\n".join(problems)


# Issue 16: each FA2 package (forward + backward of every head dim) stays under 10 MB.
MAX_FA2_PACKAGE_BYTES = 10 * 1000 * 1000


@pytest.mark.parametrize("arch", ARCHS)
def test_fa2_package_size(arch):
    data = json.loads((CHANNEL / "linux-64" / "repodata.json").read_text())["packages.conda"]
    for fn, rec in data.items():
        if rec["name"] == f"sm7x-fa2-{arch}":
            size = (CHANNEL / "linux-64" / fn).stat().st_size
            assert size == rec["size"] and size < MAX_FA2_PACKAGE_BYTES, \
                f"{fn}: {size / 1e6:.2f} MB (limit {MAX_FA2_PACKAGE_BYTES / 1e6:.0f} MB)"
