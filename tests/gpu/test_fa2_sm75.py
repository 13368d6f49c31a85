"""sm7x FA2 forward (sm75 library) on a GPU, against a float32 reference.

Marked `gpu`; skipped without CUDA or without the library. On GPUs newer than Turing the
sm75 library must be forced (SM7X_FA2_FORCE=sm75: its compute_75 PTX is JIT-compiled),
which is how it is tested on the H200. The worst errors are printed at the end (-s) and
written to $FA2_ERRORS_OUT when set.
"""

from __future__ import annotations

import pytest

from fa2_arch import require_arch_or_skip

torch = require_arch_or_skip("sm75")

from sm7x.fa2 import flash_attn_func  # noqa: E402
from fa2_reference import _qkv, _record, reference  # noqa: E402
from fa2_arch_cases import *  # noqa: E402,F401,F403  (its tests, run here over this library)

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
