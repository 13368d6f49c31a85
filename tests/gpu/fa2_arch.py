"""The module-level gate of the FA2 GPU tests: which FA2 library the current device runs,
or a skip of the calling module (no torch, no CUDA device, a GPU newer than Turing without
SM7X_FA2_FORCE, or no library for it). Torch-free at import, so a machine without torch
reaches the skip instead of an ImportError."""

from __future__ import annotations

import os

import pytest


def _torch_with_cuda_or_skip():
    """torch, or a skip of the calling module without torch or a CUDA device."""
    from sm7x._targets import torch_min

    torch = pytest.importorskip("torch", reason=f"sm7x FA2 needs torch >= {torch_min()}")
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.is_available() is False: no CUDA device", allow_module_level=True)
    return torch


def fa2_arch_or_skip() -> str:
    """The arch of the library the tests exercise ("sm75" / "sm70"); call at module top."""
    _torch_with_cuda_or_skip()
    from fa2_reference import selected_arch

    arch, why = selected_arch()
    if arch is None:
        pytest.skip(why, allow_module_level=True)
    return arch


def require_arch_or_skip(arch: str):
    """For a module that tests one library: skips it without torch, a CUDA device or that
    library, or on a GPU that does not run it natively unless SM7X_FA2_FORCE names it (its
    PTX then runs there). Returns torch."""
    torch = _torch_with_cuda_or_skip()
    from sm7x import _select, _targets

    if _select.library_path(arch) is None:
        pytest.skip(f"_fa2_{arch}.abi3.so is not installed (set SM7X_LIBRARY_PATH to a build)",
                    allow_module_level=True)
    native = tuple(torch.cuda.get_device_capability()) == _targets.capability(arch)
    if not native and os.environ.get(_select.FORCE_ENV) != arch:
        pytest.skip(f"the GPU is not {arch}: set {_select.FORCE_ENV}={arch} to test the {arch} "
                    f"kernels through their PTX", allow_module_level=True)
    return torch
