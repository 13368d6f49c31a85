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

from fa2_reference import _qkv  # noqa: E402
from fa2_arch_cases import (  # noqa: E402,F401  (collected here, over this module's library)
    test_api_errors_come_from_the_op, test_cuda_graph_capture_and_replay_on_a_side_stream,
    test_fwd_matches_reference, test_mma_peak_ceiling_loop,
    test_occupancy_emulation_caps_ctas_per_sm, test_op_validation_messages,
    test_serving_tile_is_the_tables, test_sliding_window, test_softcap,
    test_strided_inputs_from_packed_qkv, test_varlen, test_zz_report_worst_errors)

pytestmark = pytest.mark.gpu


@pytest.fixture
def arch():
    return "sm70"


def test_sm70_library_is_the_one_loaded():
    q, k, v = _qkv(1, 16, 16, 2, 2, 64)
    flash_attn_func(q, k, v)
    assert "sm70" in _loader.loaded()
    assert hasattr(torch.ops.sm7x_fa2_sm70, "fwd")
    assert hasattr(torch.ops.sm7x_fa2_sm70, "fwd_varlen")
