"""sm7x FA2 forward (sm70 library) on a GPU, against a float32 reference.

Marked `gpu`; skipped without CUDA or without the library. On GPUs other than Volta the
sm70 library must be forced (SM7X_FA2_FORCE=sm70: its compute_70 PTX is JIT-compiled),
which is how it is tested on the H200.

The reference, the comparison and the input helpers are shared with the sm75 tests
(fa2_reference.py).
"""

from __future__ import annotations

import pytest

from fa2_arch import require_arch_or_skip

torch = require_arch_or_skip("sm70")

from sm7x.fa2 import _loader, flash_attn_func  # noqa: E402
from fa2_reference import _qkv  # noqa: E402
from fa2_arch_cases import *  # noqa: E402,F401,F403  (its tests, run here over this library)

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
