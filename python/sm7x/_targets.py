"""The GPU targets of sm7x (archs, selector builds, FA2 head dims), read from targets.json.

targets.json is the one place these facts are written: CMake reads it to decide which
FA2 libraries and kernels to compile, the channel builder to check variant files, and
this module serves the runtime. Pure stdlib and read once, so `import sm7x` stays cheap.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

PATH = Path(__file__).with_name("targets.json")


@functools.lru_cache(maxsize=None)
def load() -> dict:
    return json.loads(PATH.read_text(encoding="utf-8"))


def archs() -> tuple[str, ...]:
    """FA2 library archs, oldest first: ("sm70", "sm75")."""
    return tuple(sorted(load()["archs"], key=lambda a: capability(a)))


def capability(arch: str) -> tuple[int, int]:
    major, minor = load()["archs"][arch]["capability"].split(".")
    return int(major), int(minor)


def arch_number(arch: str) -> str:
    """"70" for "sm70": the form variant files (sm7x_cuda_archs) and CMake use."""
    return load()["archs"][arch]["capability"].replace(".", "")


def family(arch: str) -> str:
    """The GPU family, e.g. "Volta (V100, Titan V)"."""
    return load()["archs"][arch]["family"]


def cuda_max_major(arch: str) -> int | None:
    """The last CUDA major that still compiles ``arch`` (None: no limit known)."""
    return load()["archs"][arch]["cuda_max_major"]


def selector_build(arch: str) -> int:
    """Build number of the sm7x-fa2 selector build that installs only ``arch``."""
    return int(load()["archs"][arch]["selector_build"])


def selector_cuda_arch(arch: str) -> str:
    """The __cuda_arch range that selector build depends on, e.g. ">=7.0,<7.5"."""
    return load()["archs"][arch]["selector_cuda_arch"]


def selector_installs(arch: str) -> tuple[str, ...]:
    """The FA2 libraries that selector build pulls in, of those a variant builds: the node's
    lowest arch and every newer one its GPUs may also be (a 7.0 node may hold Turing GPUs)."""
    return tuple(load()["archs"][arch]["selector_installs"])


def torch_min() -> str:
    """The oldest torch the native libraries load in ("2.10"): their stable-ABI target."""
    return str(load()["torch"]["min"])


def fallback_build(every_arch: bool) -> int:
    """Build number of the fallback selector (no __cuda_arch needed)."""
    return int(load()["selector_fallback_build"]["every_arch" if every_arch else "one_arch"])


def fa2_head_dims(arch: str) -> tuple[int, ...]:
    """Head dims the ``arch`` FA2 library has kernels for, ascending."""
    return tuple(sorted(k["head_dim"] for k in load()["fa2"]["kernels"][arch]))


def fa2_card_limits(arch: str) -> dict:
    """Per-block and per-SM limits of the card ``arch`` is for (fa2.card_limits: card name,
    smem_per_block, smem_per_sm, regs_per_sm, warps_per_sm, blocks_per_sm)."""
    return dict(load()["fa2"]["card_limits"][arch])


def fa2_max_head_dim() -> int:
    return int(load()["fa2"]["max_head_dim"])


def fa2_head_dim_multiple() -> int:
    return int(load()["fa2"]["head_dim_multiple"])


def fa2_serving_wide_rows() -> int:
    """Serving calls with more query rows per sequence and kv head than this run the
    serving kernel with the prefill tiles (fa2.kernels), others fa2.serving_kernels (the
    library applies the rule: its serving_tile op)."""
    return int(load()["fa2"]["serving_wide_rows"])


def fa2_kernel(arch: str, head_dim: int, *, serving: bool = False) -> dict:
    """The kernel config (targets.json fa2.kernels entry, or fa2.serving_kernels with
    ``serving``) that runs ``head_dim`` on ``arch``: the smallest compiled head dim >= it.
    KeyError when none does."""
    table = load()["fa2"]["serving_kernels" if serving else "kernels"][arch]
    for k in sorted(table, key=lambda k: k["head_dim"]):
        if head_dim <= k["head_dim"]:
            return dict(k)
    raise KeyError(f"no {arch} FA2 kernel runs head_dim {head_dim}")


def fa2_decode_kernel(arch: str, head_dim: int) -> dict | None:
    """The decode kernel entry (fa2.decode_kernels) of the compiled head dim that runs
    ``head_dim`` on ``arch``, or None where that head dim decodes on the narrow serving
    kernel (not listed, or an arch without the table)."""
    d = fa2_kernel(arch, head_dim)["head_dim"]
    table = load()["fa2"].get("decode_kernels", {}).get(arch, [])
    return next((dict(k) for k in table if k["head_dim"] == d), None)


