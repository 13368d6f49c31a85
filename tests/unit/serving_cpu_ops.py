"""A CPU stand-in for the FA2 libraries' serving op (``fwd_serving``), for the tests of
what sits above it (torch.compile through the serving entry points, the vLLM backend):
the keys each sequence sees are gathered from the paged or contiguous cache exactly as the
kernels address them (an 8-bit cache's codes times its descales or row scales), and the float64
reference of tests/gpu/fa2_reference.py gives out and lse.

``use(monkeypatch)`` routes sm7x.fa2's serving path to it on CPU tensors (the CUDA-only
checks, the split planner and the graph-capture query are lifted) and returns it; it
counts its calls and keeps the last kv_format.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from fa2_reference import reference  # noqa: E402

_CODES = {1: torch.float8_e4m3fn, 2: torch.float8_e5m2}


class ServingReference:
    name = "sm7x_fa2_sm75"

    def __init__(self):
        self.calls = 0
        self.kv_format = None
        self.check_inputs = None  # of the last call

    def fwd_serving(self, q, k_cache, v_cache, out, lse, cu_seqlens_q, seqused_k,
                    cu_seqlens_k, block_table, cache_batch_idx, leftpad, partitions,
                    split_offsets, o_accum, lse_accum, max_seqlen_q, seqlen_k_bound,
                    seqused_add, scale, causal, left, right, softcap, kv_format, k_descale,
                    v_descale, sinks=None, check_inputs=True):
        self.calls += 1
        self.kv_format = kv_format
        self.check_inputs = check_inputs
        varlen = cu_seqlens_q is not None
        batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
        for b in range(batch):
            n = int(seqused_k[b]) + seqused_add
            pos = torch.arange(n)
            if block_table is not None:
                ps = k_cache.shape[1]
                pages = block_table[b].long()[pos // ps]
                k, v = k_cache[pages, pos % ps], v_cache[pages, pos % ps]
            else:
                row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
                k, v = k_cache[row, :n], v_cache[row, :n]
            if kv_format in _CODES:  # an 8-bit cache: codes x descale
                codes = _CODES[kv_format]
                k = k.view(torch.uint8).view(codes).double() * k_descale.double()
                v = v.view(torch.uint8).view(codes).double() * v_descale.double()
            elif kv_format == 3:  # int8: codes x their row's scale (k_descale: scale caches)
                if block_table is not None:
                    ks, vs = k_descale[pages, pos % ps], v_descale[pages, pos % ps]
                else:
                    ks, vs = k_descale[row, :n], v_descale[row, :n]
                k = k.double() * ks.double()[..., None]
                v = v.double() * vs.double()[..., None]
            k, v = k.double(), v.double()
            qs = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])) if varlen else b
            o, l = reference(q[qs][None].double(), k[None], v[None], scale, causal,
                             (left, right), softcap, sinks)
            out[qs] = o[0].to(out.dtype)
            if varlen:
                lse[:, qs] = l[0].float()
            else:
                lse[b] = l[0].float()


def use(monkeypatch) -> ServingReference:
    import sm7x.fa2 as fa2
    from sm7x.fa2 import _serving

    ops = ServingReference()
    monkeypatch.setattr(fa2, "_check_cuda", lambda fn, q: None)
    monkeypatch.setattr(fa2, "_ops_for", lambda t: ops)  # _serving looks it up per call
    monkeypatch.setattr(_serving, "_capturing", lambda: False)  # a CPU-only torch has no CUDA graphs
    monkeypatch.setattr(_serving, "_plan_for", lambda fn, ops_, q, *a: (
        types.SimpleNamespace(partitions=None, split_offsets=None), None, None))
    return ops
