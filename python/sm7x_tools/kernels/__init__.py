"""Static analysis of the FA2 kernels from the SASS a library ships (no GPU needed).

``python -m sm7x_tools.kernels LIB.so [--json]`` prints, per FA2 kernel of the library (the
sm_70 or sm_75 SASS cuobjdump finds in it; forward, serving and backward): head dim and tile, threads, registers, shared
memory per block, the blocks and warps resident per SM of the arch's card (V100 for sm_70,
T4 for sm_75: the occupancy rules of the CUDA occupancy calculator), and, from the body of
the kernel's K/V-tile loop, the tensor-core instructions, the shared-memory bytes moved
per K/V tile (per block: every LDS/STS/LDSM of the body, times 32 lanes, times the warps)
and the FLOP per shared-memory byte (4 * rows * keys * head_dim per tile).

The loop body is the span of the backward branch that encloses the most tensor-core
instructions; both sides of a data-dependent branch inside it are counted (masking code
has no shared-memory traffic). The FLOP the tensor-core instructions do (512 per
HMMA.884.F32 step on sm_70, 2048 per HMMA.1688.F32 on sm_75) is checked against the
analytic count: a mismatch means the loop was not found as one tile.

Needs cuobjdump and nvdisasm on PATH (``--cuda-bin`` names their folder): conda's
cuda-cuobjdump / cuda-nvdisasm, or any CUDA toolkit.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

# Per-SM limits of the cards the archs are for (CUDA occupancy calculator, cc 7.0 / 7.5),
# from targets.json fa2.card_limits.
DEFAULT_TARGETS = Path(__file__).resolve().parents[2] / "sm7x" / "targets.json"
_LIMITS = json.loads(DEFAULT_TARGETS.read_text())["fa2"]["card_limits"]
CARDS = {arch: dict(card=c["card"], regs=c["regs_per_sm"], smem=c["smem_per_sm"],
                    warps=c["warps_per_sm"], blocks=c["blocks_per_sm"])
         for arch, c in _LIMITS.items()}
REG_UNIT = 256  # registers are allocated per warp in units of 256
SMEM_UNIT = 256  # shared memory per block in units of 256 bytes
# FLOP per warp-level tensor-core instruction (SASS opcode prefix -> FLOP).
TENSOR_FLOP = {"HMMA.884.F32": 512, "HMMA.884.F16": 512, "HMMA.1688.F32": 2048,
               "HMMA.1688.F16": 2048}
# Bytes per lane of a shared-memory access, by opcode suffix; LDSM moves whole 8x8 fp16
# matrices (128 bytes each) per warp.
WIDTH = {"128": 16, "64": 8, "32": 4, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
# fwd_kernel<FwdConfig<head_dim, block_m, block_n, ..., warp_rows, dim_split>, SERVING> in a
# mangled name (libraries built before warp_rows end the FwdConfig at q_in_regs: 16 rows per
# warp; those before dim_split at warp_rows: one warp per row slice)
KERNEL = re.compile(r"fwd_kernelINS1_9FwdConfigILi(\d+)ELi(\d+)ELi(\d+)ELNS0_10KvPrefetchE\d+ELb[01]"
                    r"(?:ELi(\d+))?(?:ELi(\d+))?EEELb([01])(?:ELb([01])|ELi(\d))?EEEv")
# fwd_kernel's last argument: what the serving kernel reads (fa2.h KvRead; a bool "8-bit
# cache" in libraries built before int8 caches, none before 8-bit caches)
KV_READ = {0: "", 1: " kv8", 2: " int8"}
# decode_kernel<DecodeConfig<head_dim, block_n>, KvRead> (sm75/decode_kernel.cuh): one warp,
# DECODE_ROWS query rows (fa2.h kDecodeRows, read from there)
DECODE_KERNEL = re.compile(r"decode_kernelINS1_12DecodeConfigILi(\d+)ELi(\d+)EEELi(\d)EEEv")
_FA2_H = Path(__file__).resolve().parents[3] / "csrc" / "fa2" / "fa2.h"
DECODE_ROWS = int(re.search(r"constexpr int kDecodeRows = (\d+);", _FA2_H.read_text())[1])
# bwd_kernel<BwdConfig<head_dim, block_n, block_m, dq_block_m, dq_block_n, split, prefetch,
# min_blocks, v_in_regs, dim_split, dq_pass>, mode> and bwd_dq_kernel<BwdConfig<...>>
# (common/bwd_common.cuh: mode 0 all, 1 dV only, 2 dK and dQ; with dq_pass no dQ in either);
# libraries built before prefetch end the config at split, those before v_in_regs at
# min_blocks, those before dim_split at v_in_regs, those before dq_pass at dim_split
BWD_KERNEL = re.compile(r"(bwd_kernel|bwd_dq_kernel)INS1_9BwdConfigILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)"
                        r"ELi(\d+)ELb([01])(?:ELb[01]ELi\d+(?:ELb[01](?:ELi(\d+)(?:ELb([01]))?)?)?)?"
                        r"EEE(?:Li(\d)E)?E")
# kind by (mode, dq_pass)
BWD_MODES = {(0, False): "bwd", (1, False): "bwd dV", (2, False): "bwd dKdQ",
             (0, True): "bwd dKdV", (1, True): "bwd dV", (2, True): "bwd dK"}
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


@dataclass
class KernelStats:
    arch: str
    head_dim: int
    block_m: int
    block_n: int
    serving: bool
    threads: int
    regs: int
    smem_bytes: int
    blocks_per_sm: int
    warps_per_sm: int
    # per block and tile; None (backward only) where the loop body is not one tile: the
    # compiler kept an inner loop (over head-dim slices) rolled, and its trip count is not
    # in the SASS, so static counts would cover only part of a tile
    tensor_insns_per_tile: int | None
    smem_bytes_per_tile: int | None
    flop_per_tile: int  # forward 4 * block_m * block_n * head_dim; backward bwd_flop
    flop_per_smem_byte: float | None
    tensor_flop_matches: bool | None
    card: str
    kind: str = ""  # prefill, serving / decode (kv8, int8), bwd (dV, dKdQ: the two passes at d256), bwd dQ
    local_bytes: int = 0  # per thread, ptxas stack + local memory: spills (0 but sm75 bwd d64)


def tools(cuda_bin: str | None = None) -> str:
    """The cuobjdump to run (nvdisasm must sit beside it or on PATH)."""
    path = None if cuda_bin is None else str(Path(cuda_bin))
    exe = shutil.which("cuobjdump", path=path)
    if exe is None or shutil.which("nvdisasm", path=path) is None:
        raise FileNotFoundError(
            "cuobjdump and nvdisasm are needed (conda: cuda-cuobjdump cuda-nvdisasm, or a CUDA "
            "toolkit's bin/); put them on PATH or pass --cuda-bin")
    return exe


def _run(exe: str, args: list[str], cuda_bin: str | None) -> str:
    env = None
    if cuda_bin:
        import os

        env = {**os.environ, "PATH": f"{cuda_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([exe, *args], capture_output=True, text=True, check=True,
                          env=env).stdout


def resources(text: str) -> dict[str, dict]:
    """cuobjdump -res-usage -> {mangled name: {arch, reg, stack, shared, local}} (shared:
    the static shared memory; the FA2 kernels' tiles are dynamic)."""
    out, name, arch = {}, None, None
    for line in text.splitlines():
        m = re.search(r"arch = (sm_\d+)", line)
        if m:
            arch = m.group(1).replace("_", "")
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and name:
            out[name] = dict(zip(("reg", "stack", "shared", "local"), map(int, m.groups())),
                             arch=arch)
    return out


def kernel_key(name: str) -> tuple[int, int, int, bool, int] | None:
    """(head_dim, block_m, block_n, serving, kv_read) of an FA2 fwd kernel's mangled name
    (kv_read, KV_READ: 0 fp16, 1 over an fp8 cache, 2 over an int8 cache with row scales)."""
    m = KERNEL.search(name)
    if not m:
        m = DECODE_KERNEL.search(name)  # the decode kernel: DECODE_ROWS rows, serving
        return None if not m else (int(m[1]), DECODE_ROWS, int(m[2]), True, int(m[3]))
    d, bm, bn, serving = (int(m.group(i)) for i in (1, 2, 3, 6))
    return d, bm, bn, bool(serving), int(m.group(7) or m.group(8) or 0)


def is_decode(name: str) -> bool:
    """Whether an FA2 kernel's mangled name is the decode kernel's."""
    return DECODE_KERNEL.search(name) is not None


def kernel_threads(name: str) -> int:
    """Block size of an FA2 fwd kernel from its mangled name: block_m / warp_rows x
    dim_split warps (the wide serving kernel of a table entry runs 16 rows per warp and no
    dim split whatever the entry says, so the table's threads do not always apply)."""
    if is_decode(name):
        return 32
    m = KERNEL.search(name)
    if not m:
        raise ValueError(f"not an FA2 fwd kernel: {name}")
    return int(m.group(2)) // int(m.group(4) or 16) * int(m.group(5) or 1) * 32


def bwd_key(name: str) -> tuple[str, int, int, int, int, bool] | None:
    """(kind, head_dim, tile rows, tile columns, threads, split) of an FA2 backward kernel's mangled
    name: the main kernel's tile is block_n keys x block_m queries (16 keys per warp, times
    dim_split), the deterministic dQ kernel's dq_block_m queries x dq_block_n keys (16
    queries per warp)."""
    m = BWD_KERNEL.search(name)
    if not m:
        return None
    fn, d, bn, bm, dbm, dbn = m.group(1), *(int(m.group(i)) for i in range(2, 7))
    split = m.group(7) == "1"
    if fn == "bwd_dq_kernel":
        return "bwd dQ", d, dbm, dbn, dbm // 16 * 32, split
    kind = BWD_MODES[int(m.group(10) or 0), m.group(9) == "1"]
    return kind, d, bn, bm, bn // 16 * int(m.group(8) or 1) * 32, split


def bwd_flop(kind: str, d: int, rows: int, cols: int, split: bool) -> int:
    """FLOP of one tile (rows x cols) of a backward kernel: 2 * rows * cols * d per GEMM.
    Main: S^T, dP^T, dV, dK and dQ (the dQ GEMM is in the loop body even when
    deterministic=True skips it at run time); dV pass: S^T and dV; dK/dQ pass: S^T, dP^T,
    dK, dQ; with dq_pass no dQ: dK/dV 4, dK 3. dQ kernel: S, dP and dQ (split: dQ of half
    the columns per CTA)."""
    gemms = {"bwd": 5, "bwd dV": 2, "bwd dKdQ": 4, "bwd dKdV": 4, "bwd dK": 3,
             "bwd dQ": 2.5 if split else 3}[kind]
    return int(gemms * 2 * rows * cols * d)


def sass_functions(text: str) -> dict[str, list[tuple[int, str, str]]]:
    """cuobjdump -sass -> {mangled name: [(address, opcode, operands)]}."""
    funcs, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
            continue
        m = INSN.search(line)
        if m and name:
            funcs[name].append((int(m.group(1), 16), m.group(3), m.group(4)))
    return funcs


def tile_loop(insns: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions of the backward branch's span holding the most tensor-core ops."""
    best: list = []
    best_n = -1
    for addr, op, operands in insns:
        if op.split(".")[0] != "BRA":  # BRA, BRA.U (uniform)
            continue
        m = re.search(r"0x([0-9a-f]+)", operands)
        if not m or int(m.group(1), 16) >= addr:
            continue
        lo = int(m.group(1), 16)
        body = [i for i in insns if lo <= i[0] <= addr]
        n = sum(i[1].startswith("HMMA") for i in body)
        if n > best_n:
            best, best_n = body, n
    return best


def smem_bytes_per_warp(body: list[tuple[int, str, str]]) -> int:
    total = 0
    for _, op, _ in body:
        parts = op.split(".")
        if parts[0] == "LDSM":  # .16.M88.N: N (1, 2, 4) 8x8 fp16 matrices per warp
            total += 128 * (int(parts[-1]) if parts[-1].isdigit() else 1)
        elif parts[0] in ("LDS", "STS"):
            width = next((WIDTH[p] for p in parts[1:] if p in WIDTH), 4)
            total += 32 * width
    return total


def tensor_flop_per_warp(body: list[tuple[int, str, str]]) -> tuple[int, int]:
    n = flop = 0
    for _, op, _ in body:
        for prefix, f in TENSOR_FLOP.items():
            if op.startswith(prefix):
                n += 1
                flop += f
    return n, flop


def occupancy(arch: str, threads: int, regs: int, smem: int) -> tuple[int, int]:
    """(blocks, warps) resident per SM of the arch's card."""
    c = CARDS[arch]
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    by_regs = (c["regs"] // per_warp) // warps if per_warp else c["blocks"]
    smem_alloc = -(-smem // SMEM_UNIT) * SMEM_UNIT
    by_smem = c["smem"] // smem_alloc if smem_alloc else c["blocks"]
    blocks = min(by_regs, by_smem, c["warps"] // warps, c["blocks"])
    return blocks, blocks * warps


def analyse(lib: str | Path, targets: dict, cuda_bin: str | None = None) -> list[KernelStats]:
    """Stats of every FA2 fwd kernel in lib; targets: targets.json's "fa2" table (its
    smem_bytes: the kernels' shared memory is dynamic, not in the resource usage)."""
    exe = tools(cuda_bin)
    res = resources(_run(exe, ["-res-usage", str(lib)], cuda_bin))
    funcs = sass_functions(_run(exe, ["-sass", str(lib)], cuda_bin))
    out = []
    for name, insns in funcs.items():
        if name in res and bwd_key(name) is not None:
            out.append(_bwd_stats(name, insns, res[name], targets, lib))
            continue
        key = kernel_key(name)
        if key is None or name not in res:
            continue
        d, bm, bn, serving, kv8 = key
        arch, regs, static_smem = res[name]["arch"], res[name]["reg"], res[name]["shared"]
        decode = is_decode(name)
        if decode:
            table = targets.get("decode_kernels", {}).get(arch, [])
            entry = next((e for e in table if (e["head_dim"], e["block_n"]) == (d, bn)), None)
        else:
            table = targets["serving_kernels" if serving else "kernels"][arch]
            entry = next((e for e in table if (e["head_dim"], e["block_m"], e["block_n"])
                          == (d, bm, bn)), None)
        if entry is None and serving:  # the wide serving kernels run the prefill tiles
            entry = next((e for e in targets["kernels"][arch]
                          if (e["head_dim"], e["block_m"], e["block_n"]) == (d, bm, bn)), None)
        if entry is None:
            raise LookupError(f"{lib}: its {arch} d={d} {bm}x{bn} kernel is not in the given "
                              "targets.json: pass the one the library was built from (--targets)")
        threads, smem = kernel_threads(name), entry["smem_bytes"] + static_smem
        warps = threads // 32
        body = tile_loop(insns)
        n_tensor, flop_warp = tensor_flop_per_warp(body)
        smem_tile = smem_bytes_per_warp(body) * warps
        flop = 4 * bm * bn * d
        blocks, resident = occupancy(arch, threads, regs, smem)
        out.append(KernelStats(arch, d, bm, bn, bool(serving), threads, regs, smem, blocks,
                               resident, n_tensor * warps, smem_tile, flop,
                               round(flop / smem_tile, 2) if smem_tile else float("inf"),
                               flop_warp * warps == flop, CARDS[arch]["card"],
                               ("decode" if decode else "serving" if serving else "prefill")
                               + (KV_READ[kv8] if serving else ""), local_bytes(res[name])))
    order = ["prefill", "serving", "serving kv8", "serving int8", "decode", "decode kv8",
             "decode int8", "bwd", "bwd dKdV", "bwd dV", "bwd dKdQ", "bwd dK", "bwd dQ"]
    return sorted(out, key=lambda s: (s.arch, order.index(s.kind), s.head_dim, s.block_m))


def local_bytes(res: dict) -> int:
    """A kernel's stack and local memory per thread (-res-usage): what it spills."""
    return res["stack"] + res["local"]


def _bwd_stats(name: str, insns, res: dict, targets: dict, lib) -> KernelStats:
    kind, d, rows, cols, threads, split = bwd_key(name)
    arch = res["arch"]
    entry = next((e for e in targets.get("bwd_kernels", {}).get(arch, []) if e["head_dim"] == d),
                 None)
    if entry is None:
        raise LookupError(f"{lib}: its {arch} d={d} backward kernel is not in the given "
                          "targets.json: pass the one the library was built from (--targets)")
    # the dV pass of a split entry has its own (smaller) layout: no V, no dS^T
    key = {"bwd dQ": "dq_smem_bytes", "bwd dV": "dv_smem_bytes"}.get(kind, "smem_bytes")
    smem = entry.get(key, entry["smem_bytes"]) + res["shared"]
    body = tile_loop(insns)
    n_tensor, flop_warp = tensor_flop_per_warp(body)
    warps = threads // 32
    smem_tile = smem_bytes_per_warp(body) * warps
    flop = bwd_flop(kind, d, rows, cols, split)
    blocks, resident = occupancy(arch, threads, res["reg"], smem)
    if flop_warp * warps != flop:  # see KernelStats: no per-tile figures from a rolled loop
        return KernelStats(arch, d, rows, cols, False, threads, res["reg"], smem, blocks,
                           resident, None, None, flop, None, None, CARDS[arch]["card"], kind,
                           local_bytes(res))
    return KernelStats(arch, d, rows, cols, False, threads, res["reg"], smem, blocks, resident,
                       n_tensor * warps, smem_tile, flop,
                       round(flop / smem_tile, 2) if smem_tile else float("inf"), True,
                       CARDS[arch]["card"], kind, local_bytes(res))


def render(stats: list[KernelStats]) -> str:
    head = (f"{'arch':<5} {'kernel':<8} {'d':>3} {'tile':>7} {'thr':>4} {'regs':>4} {'lmem':>4} "
            f"{'smem/blk':>8} {'blk/SM':>6} {'warps/SM':>8} {'MMA/tile':>8} "
            f"{'smem B/tile':>11} {'FLOP/B':>7} {'check':>6}")
    lines = [head]
    na = lambda x: "n/a" if x is None else x  # noqa: E731
    for s in stats:
        check = {True: "ok", False: "FLOP?", None: "rolled"}[s.tensor_flop_matches]
        lines.append(f"{s.arch:<5} {s.kind:<8} {s.head_dim:>3} "
                     f"{s.block_m:>3}x{s.block_n:<3} {s.threads:>4} {s.regs:>4} {s.local_bytes:>4} "
                     f"{s.smem_bytes:>8} {s.blocks_per_sm:>6} {s.warps_per_sm:>8} "
                     f"{na(s.tensor_insns_per_tile):>8} {na(s.smem_bytes_per_tile):>11} "
                     f"{na(s.flop_per_smem_byte):>7} {check:>6}")
    cards = sorted({f"{s.arch}: {s.card}" for s in stats})
    lines.append(f"per SM of: {', '.join(cards)}; lmem: bytes of stack and local memory per "
                 f"thread (spills); MMA/tile and smem B/tile per block per tile "
                 f"of the loop; FLOP/B: the tile's FLOP (forward 4*rows*keys*d; backward 2*rows*"
                 f"cols*d per GEMM) / smem bytes; bwd tiles are keys x queries, bwd dQ queries x keys; "
                 f"rolled: the loop's static counts are not one tile (an inner loop kept rolled)")
    return "\n".join(lines)


def as_json(stats: list[KernelStats]) -> list[dict]:
    return [asdict(s) for s in stats]
