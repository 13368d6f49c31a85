"""The core ops' fuzz property of tests/unit/test_fuzz_entry_points.py on CUDA: every public
core op, through its Python wrapper and through torch.ops.sm7x directly, given a valid call
with some arguments replaced (another dtype or rank, a transposed, expanded or sliced view,
an empty tensor, a tensor sharing an output's memory, a CPU tensor, a non-tensor) either
raises a clear sm7x error or returns what the float32 reference computes.

Marked `gpu`; skips without CUDA or without the built _core library.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"the core ops need torch >= {torch_min()}")
pytest.importorskip("hypothesis")
if not torch.cuda.is_available():
    pytest.skip("torch.cuda.is_available() is False: no CUDA device", allow_module_level=True)

from hypothesis import given, strategies as st  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import test_fuzz_entry_points as fuzz  # noqa: E402

from sm7x import _core_loader  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_core_loader.core_library_path() is None,
                                                  reason="_core not built")]


@pytest.mark.parametrize("op", fuzz.CORE_OPS)
@pytest.mark.parametrize("direct", [False, True], ids=["wrapper", "torch.ops"])
@fuzz.SETTINGS
@given(data=st.data())
def test_core_op_bad_inputs_on_cuda(op, direct, data):
    fuzz.check_core_op_bad_inputs(op, direct, data, "cuda", kinds=[*fuzz.KINDS, "cpu"])
