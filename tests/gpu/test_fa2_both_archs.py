"""Both FA2 libraries in one process: each call goes to the library its device (or the
forced arch) selects, both op namespaces stay registered side by side, and a second
device gets its own library call. Needs both libraries; on GPUs newer than Turing the
archs are forced in turn (their PTX runs there)."""

from __future__ import annotations

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x FA2 needs torch >= {torch_min()}")
if not torch.cuda.is_available():
    pytest.skip("torch.cuda.is_available() is False: no CUDA device", allow_module_level=True)

from sm7x import _select  # noqa: E402

if any(_select.library_path(a) is None for a in _select.ARCHS):
    pytest.skip("needs both _fa2_sm70.abi3.so and _fa2_sm75.abi3.so (SM7X_LIBRARY_PATH)",
                allow_module_level=True)
if torch.cuda.get_device_capability() < (7, 5):
    pytest.skip("forcing sm75 needs a GPU of capability >= 7.5", allow_module_level=True)

from fa2_reference import _compare, _qkv, reference  # noqa: E402

from sm7x.fa2 import _loader, flash_attn_func  # noqa: E402

pytestmark = pytest.mark.gpu


def _run(monkeypatch, arch, device="cuda:0", causal=True):
    monkeypatch.setenv(_select.FORCE_ENV, arch)
    q, k, v = (t.to(device) for t in _qkv(2, 77, 133, 4, 2, 64))
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ro, rl = reference(q, k, v, 64 ** -0.5, causal=causal)
    _compare(f"both-archs {arch} {device}", out, lse, ro, rl)
    return out


def test_both_libraries_side_by_side(monkeypatch):
    a = _run(monkeypatch, "sm70")
    b = _run(monkeypatch, "sm75")
    c = _run(monkeypatch, "sm70")  # back to the first: still loaded, still right
    assert set(_loader.loaded()) >= {"sm70", "sm75"}
    assert hasattr(torch.ops.sm7x_fa2_sm70, "fwd") and hasattr(torch.ops.sm7x_fa2_sm75, "fwd")
    torch.testing.assert_close(a, c, rtol=0, atol=0)  # deterministic
    torch.testing.assert_close(a.float(), b.float(), atol=4e-3, rtol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_devices_two_libraries(monkeypatch):
    _run(monkeypatch, "sm70", "cuda:0")
    _run(monkeypatch, "sm75", "cuda:1")
    assert set(_loader.loaded()) >= {"sm70", "sm75"}
