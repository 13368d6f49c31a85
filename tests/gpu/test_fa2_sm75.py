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
from fa2_reference import _qkv, _record, reference  # noqa: E402
from fa2_arch_cases import (  # noqa: E402,F401  (collected here, over this module's library)
    test_api_errors_come_from_the_op, test_cuda_graph_capture_and_replay_on_a_side_stream,
    test_fwd_matches_reference, test_mma_peak_ceiling_loop,
    test_occupancy_emulation_caps_ctas_per_sm, test_op_validation_messages,
    test_serving_tile_is_the_tables, test_sliding_window, test_softcap,
    test_strided_inputs_from_packed_qkv, test_varlen, test_zz_report_worst_errors)

pytestmark = pytest.mark.gpu


@pytest.fixture
def arch():
    return "sm75"


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
