"""sm7x FA2 forward (sm75 library) on a GPU, against a float32 reference.

Marked `gpu`; skipped without CUDA or without the library. On GPUs newer than Turing the
sm75 library must be forced (SM7X_FA2_FORCE=sm75: its compute_75 PTX is JIT-compiled),
which is how it is tested on the H200. The worst errors are printed at the end (-s) and
written to $FA2_ERRORS_OUT when set.
"""

from __future__ import annotations

import os

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x FA2 needs torch >= {torch_min()}")
if not torch.cuda.is_available():
    pytest.skip("torch.cuda.is_available() is False: no CUDA device", allow_module_level=True)

from sm7x import _select  # noqa: E402

if _select.library_path("sm75") is None:
    pytest.skip("_fa2_sm75.abi3.so is not installed (set SM7X_LIBRARY_PATH to a build)",
                allow_module_level=True)
if torch.cuda.get_device_capability() >= (8, 0) and os.environ.get(_select.FORCE_ENV) != "sm75":
    pytest.skip(f"GPU newer than Turing: set {_select.FORCE_ENV}=sm75 to test the sm75 "
                f"kernels through their PTX", allow_module_level=True)

from sm7x.fa2 import flash_attn_func  # noqa: E402
from fa2_reference import (  # noqa: E402
    SEQS, _qkv, _record, check_cuda_graph, check_fwd, check_packed_qkv, check_softcap,
    check_mma_peak, check_api_errors_come_from_the_op, check_occupancy_emulation,
    check_serving_tile, check_varlen, check_window, reference, report_worst)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("d", [64, 80, 128, 32, 96, 112, 256, 40, 72, 200])
@pytest.mark.parametrize("sq,sk", SEQS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_fwd_matches_reference(d, sq, sk, causal, group):
    check_fwd("", d, sq, sk, causal, group)


def test_sdpa_agreement_and_scale():
    q, k, v = _qkv(2, 500, 500, 8, 8, 128, seed=3)
    for causal in (False, True):
        out = flash_attn_func(q, k, v, causal=causal, softmax_scale=0.05)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            scale=0.05).transpose(1, 2)
        ref, _ = reference(q, k, v, 0.05, causal)
        err = (out.float() - ref).abs().max().item()
        serr = (sdpa.float() - ref).abs().max().item()
        _record("out sdpa-case ours", err)
        _record("out sdpa-case torch SDPA (for comparison)", serr)
        assert err <= 4e-3


@pytest.mark.parametrize("window", [(16, 0), (100, 50), (-1, 7), (0, 0), (300, -1)])
@pytest.mark.parametrize("sq,sk", [(333, 333), (200, 600), (600, 200)])
@pytest.mark.parametrize("d", [64, 256])  # 256: sm75's dim-split kernel (Gemma: window + softcap)
def test_sliding_window(window, sq, sk, d):
    check_window("", window, sq, sk, d)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [128, 256])
def test_softcap(causal, d):
    check_softcap("", causal, d)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(d, causal):
    check_varlen("", d, causal)


def test_strided_inputs_from_packed_qkv():
    check_packed_qkv()
    # a layout the kernels cannot read directly (odd stride) is copied first
    x = torch.randn(2, 100, 8, 72, device="cuda", dtype=torch.float16)[..., :64]
    out = flash_attn_func(x, x, x)
    ref, _ = reference(x, x, x, 64 ** -0.5)
    assert (out.float() - ref).abs().max().item() <= 4e-3


# d=96 and 256 need the > 48 KB shared-memory opt-in (cudaFuncSetAttribute) on sm75
@pytest.mark.parametrize("d", [64, 96, 256])
def test_cuda_graph_capture_and_replay_on_a_side_stream(d):
    check_cuda_graph("", d)


def test_op_validation_messages():
    q, k, v = _qkv(1, 16, 16, 4, 4, 64)
    flash_attn_func(q, k, v)  # loads the library
    ns = getattr(torch.ops, "sm7x_fa2_sm75")
    out = torch.empty_like(q)
    lse = torch.empty(1, 4, 16, device="cuda")
    with pytest.raises(RuntimeError, match="float16 only"):
        ns.fwd(q.float(), k, v, out, lse, 0.1, False, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match="lse has shape"):
        ns.fwd(q, k, v, out, lse[:, :2], 0.1, False, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        ns.fwd(q, k[:, :, :3], v[:, :, :3], out, lse, 0.1, False, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match="softmax_scale"):
        ns.fwd(q, k, v, out, lse, -1.0, False, -1, -1, 0.0)


def test_zz_report_worst_errors():
    report_worst("")


def test_mma_peak_ceiling_loop():
    check_mma_peak("sm75")


def test_occupancy_emulation_caps_ctas_per_sm():
    check_occupancy_emulation("sm75")


def test_serving_tile_is_the_tables():
    check_serving_tile("sm75")


def test_api_errors_come_from_the_op():
    check_api_errors_come_from_the_op("sm75")
