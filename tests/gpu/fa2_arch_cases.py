"""The forward tests both arch modules run, each over its own library
(test_fa2_sm75.py, test_fa2_sm70.py import them): they take that module's `arch` fixture
("sm75" / "sm70"), which also names the arch in the worst-error record."""

from __future__ import annotations

import pytest
import torch

import sm7x.fa2 as fa2
from fa2_reference import (
    SEQS, _qkv, check_api_errors_come_from_the_op, check_cuda_graph, check_fwd,
    check_mma_peak, check_occupancy_emulation, check_packed_qkv, check_serving_tile,
    check_softcap, check_varlen, check_window, report_worst)

__all__ = [
    "test_fwd_matches_reference",
    "test_sliding_window",
    "test_softcap",
    "test_varlen",
    "test_strided_inputs_from_packed_qkv",
    "test_cuda_graph_capture_and_replay_on_a_side_stream",
    "test_op_validation_messages",
    "test_mma_peak_ceiling_loop",
    "test_occupancy_emulation_caps_ctas_per_sm",
    "test_serving_tile_is_the_tables",
    "test_api_errors_come_from_the_op",
    "test_zz_report_worst_errors",
]

# every compiled head dim, and dims that run padded on the next one up
HEAD_DIMS = sorted(set(fa2.COMPILED_HEAD_DIMS) | {40, 72, 200, 384})


def _tag(arch: str) -> str:
    return f"{arch} "


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("sq,sk", SEQS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_fwd_matches_reference(arch, d, sq, sk, causal, group):
    check_fwd(_tag(arch), d, sq, sk, causal, group)


@pytest.mark.parametrize("window", [(16, 0), (100, 50), (-1, 7), (0, 0), (300, -1)])
@pytest.mark.parametrize("sq,sk", [(333, 333), (200, 600), (600, 200)])
@pytest.mark.parametrize("d", [64, 256])  # 256: sm75's dim-split kernel (Gemma: window + softcap)
def test_sliding_window(arch, window, sq, sk, d):
    check_window(_tag(arch), window, sq, sk, d)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [128, 256])
def test_softcap(arch, causal, d):
    check_softcap(_tag(arch), causal, d)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(arch, d, causal):
    check_varlen(_tag(arch), d, causal)


def test_strided_inputs_from_packed_qkv():
    check_packed_qkv()


# the configs above 48 KB of shared memory need the opt-in (cudaFuncSetAttribute)
@pytest.mark.parametrize("d", [32, 64, 96, 256])
def test_cuda_graph_capture_and_replay_on_a_side_stream(arch, d):
    check_cuda_graph(_tag(arch), d)


def test_op_validation_messages(arch):
    q, k, v = _qkv(1, 16, 16, 4, 4, 64)
    fa2.flash_attn_func(q, k, v)  # loads the library
    ns = getattr(torch.ops, f"sm7x_fa2_{arch}")
    out = torch.empty_like(q)
    lse = torch.empty(1, 4, 16, device="cuda")
    with pytest.raises(RuntimeError, match=rf"sm7x\.fa2_{arch}\.fwd: .*float16 only"):
        ns.fwd(q.float(), k, v, out, lse, 0.1, False, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match="lse has shape"):
        ns.fwd(q, k, v, out, lse[:, :2], 0.1, False, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        ns.fwd(q, k[:, :, :3], v[:, :, :3], out, lse, 0.1, False, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match="softmax_scale"):
        ns.fwd(q, k, v, out, lse, -1.0, False, -1, -1, 0.0)


def test_mma_peak_ceiling_loop(arch):
    check_mma_peak(arch)


def test_occupancy_emulation_caps_ctas_per_sm(arch):
    check_occupancy_emulation(arch)


def test_serving_tile_is_the_tables(arch):
    check_serving_tile(arch)


def test_api_errors_come_from_the_op(arch):
    check_api_errors_come_from_the_op(arch)


def test_zz_report_worst_errors(arch):
    report_worst(f" ({arch})")
