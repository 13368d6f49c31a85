"""sm7x FA2 forward (sm70 library) on a GPU, against a float32 reference.

Marked `gpu`; skipped without CUDA or without the library. On GPUs other than Volta the
sm70 library must be forced (SM7X_FA2_FORCE=sm70: its compute_70 PTX is JIT-compiled),
which is how it is tested on the H200.

The reference, the comparison and the input helpers are shared with the sm75 tests
(fa2_reference.py).
"""

from __future__ import annotations

import os

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x FA2 needs torch >= {torch_min()}")
if not torch.cuda.is_available():
    pytest.skip("torch.cuda.is_available() is False: no CUDA device", allow_module_level=True)

from sm7x import _select  # noqa: E402

if _select.library_path("sm70") is None:
    pytest.skip("_fa2_sm70.abi3.so is not installed (set SM7X_LIBRARY_PATH to a build)",
                allow_module_level=True)
if (torch.cuda.get_device_capability()[0] != 7 or torch.cuda.get_device_capability() >= (7, 5)) \
        and os.environ.get(_select.FORCE_ENV) != "sm70":
    pytest.skip(f"GPU is not Volta: set {_select.FORCE_ENV}=sm70 to test the sm70 kernels "
                f"(through their PTX on GPUs newer than sm_70)", allow_module_level=True)

from sm7x.fa2 import _loader, flash_attn_func  # noqa: E402

pytestmark = pytest.mark.gpu


from fa2_reference import (  # noqa: E402
    SEQS, _qkv, check_cuda_graph, check_mma_peak, check_api_errors_come_from_the_op, check_occupancy_emulation,
    check_serving_tile, check_fwd, check_packed_qkv, check_softcap, check_varlen,
    check_window, report_worst)


@pytest.mark.parametrize("d", [64, 128, 32, 96, 112, 256, 80, 40, 72])
@pytest.mark.parametrize("sq,sk", SEQS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_fwd_matches_reference(d, sq, sk, causal, group):
    check_fwd("sm70 ", d, sq, sk, causal, group)


def test_sm70_library_is_the_one_loaded():
    q, k, v = _qkv(1, 16, 16, 2, 2, 64)
    flash_attn_func(q, k, v)
    assert "sm70" in _loader.loaded()
    assert hasattr(torch.ops.sm7x_fa2_sm70, "fwd")
    assert hasattr(torch.ops.sm7x_fa2_sm70, "fwd_varlen")


@pytest.mark.parametrize("window", [(16, 0), (100, 50), (-1, 7), (0, 0), (300, -1)])
@pytest.mark.parametrize("sq,sk", [(333, 333), (200, 600), (600, 200)])
@pytest.mark.parametrize("d", [64, 256])  # 256: sm75's dim-split kernel (Gemma: window + softcap)
def test_sliding_window(window, sq, sk, d):
    check_window("sm70 ", window, sq, sk, d)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [128, 256])
def test_softcap(causal, d):
    check_softcap("sm70 ", causal, d)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(d, causal):
    check_varlen("sm70 ", d, causal)


def test_strided_inputs_from_packed_qkv():
    check_packed_qkv()


# every sm70 config but d=32 needs the > 48 KB shared-memory opt-in (cudaFuncSetAttribute)
@pytest.mark.parametrize("d", [32, 64, 256])
def test_cuda_graph_capture_and_replay_on_a_side_stream(d):
    check_cuda_graph("sm70 ", d)


def test_op_validation_messages():
    q, k, v = _qkv(1, 16, 16, 4, 4, 64)
    flash_attn_func(q, k, v)  # loads the library
    ns = torch.ops.sm7x_fa2_sm70
    out = torch.empty_like(q)
    lse = torch.empty(1, 4, 16, device="cuda")
    with pytest.raises(RuntimeError, match=r"sm7x\.fa2_sm70\.fwd: .*float16 only"):
        ns.fwd(q.float(), k, v, out, lse, 0.1, False, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match="lse has shape"):
        ns.fwd(q, k, v, out, lse[:, :2], 0.1, False, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        ns.fwd(q, k[:, :, :3], v[:, :, :3], out, lse, 0.1, False, -1, -1, 0.0)


def test_zz_report_worst_errors():
    report_worst(" (sm70)")


def test_mma_peak_ceiling_loop():
    check_mma_peak("sm70")


def test_occupancy_emulation_caps_ctas_per_sm():
    check_occupancy_emulation("sm70")


def test_serving_tile_is_the_tables():
    check_serving_tile("sm70")


def test_api_errors_come_from_the_op():
    check_api_errors_come_from_the_op("sm70")
