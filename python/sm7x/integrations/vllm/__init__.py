"""sm7x FlashAttention-2 as an attention backend of upstream vLLM (V1 engine; 0.26 and 0.33).

vLLM loads it through two entry points of the ``sm7x`` distribution (README, "Use it with
vLLM"):

- ``vllm.general_plugins``: :func:`register` registers the backend as vLLM's
  ``CUSTOM`` attention backend in every vLLM process, so ``--attention-backend CUSTOM``
  selects it (on a GPU it does not support, vLLM then says why and stops).
- ``vllm.platform_plugins``: :func:`platform_plugin` makes vLLM use
  :class:`~sm7x.integrations.vllm.platform.Sm7xCudaPlatform` on machines with a Volta
  (7.0) or Turing (7.5) GPU: vLLM's CUDA platform, except that on those GPUs, when no
  backend was asked for, it picks the sm7x backend (and logs it) where the configuration
  allows, and vLLM's own choice otherwise. ``SM7X_VLLM_PLATFORM=0`` turns it off.

This module is what the entry points import: it imports neither torch nor vLLM (vLLM
calls the functions; they import what they need).
"""

from __future__ import annotations

import os

from ..._args import env_flag

BACKEND = "sm7x.integrations.vllm.backend.Sm7xFlashAttentionBackend"
PLATFORM = "sm7x.integrations.vllm.platform.Sm7xCudaPlatform"
# Set to 0 to keep vLLM's own CUDA platform (and its backend choice) on Volta/Turing.
PLATFORM_ENV = "SM7X_VLLM_PLATFORM"
# The compute capabilities the backend runs on (the FA2 libraries' native targets).
CAPABILITIES = ((7, 0), (7, 5))
LOGGER = "vllm.sm7x"  # under vLLM's logger, so vLLM's log configuration shows it
# Test aid, never for serving: with the FA2 library named by SM7X_FA2_FORCE, the backend
# (and the platform) also take GPUs newer than Turing, whose driver JIT-compiles the
# library's PTX. That is how the backend is run inside a real vLLM engine on an sm80+
# test machine (tests/vllm_engine). Refused without SM7X_FA2_FORCE.
TEST_ANY_GPU_ENV = "SM7X_VLLM_TEST_ANY_GPU"
FORCE_ENV = "SM7X_FA2_FORCE"  # sm7x._select.FORCE_ENV (not imported: it reads targets.json)
# Opt-in: Gemma 2/3 in float16 with the residual stream in float32 (fp32_residual.py)
FP32_RESIDUAL_ENV = "SM7X_VLLM_FP32_RESIDUAL"


def capability_reason(cap: tuple[int, int]) -> str | None:
    """Why the backend does not run on a GPU of compute capability ``cap``, or None when it
    does: 7.0 and 7.5, and with the test aid any capability >= 7.0."""
    cap = tuple(cap)
    if cap in CAPABILITIES:
        return None
    where = f"compute capability {cap[0]}.{cap[1]}"
    if not env_flag(TEST_ANY_GPU_ENV, False):
        return (f"sm7x: the vLLM backend runs on Volta (7.0) and Turing (7.5), not on {where}"
                f" (use vLLM's own backends there)")
    if not os.environ.get(FORCE_ENV, "").strip():
        return (f"sm7x: {TEST_ANY_GPU_ENV} is set (a test aid that runs the backend on "
                f"{where}) but {FORCE_ENV} is not: set {FORCE_ENV}=sm75 (or sm70) to name "
                f"the FA2 library whose PTX runs there, or unset {TEST_ANY_GPU_ENV}")
    if cap < (7, 0):
        return f"sm7x: {where} is older than Volta; the FA2 kernels need tensor cores"
    return None


def register() -> None:
    """``vllm.general_plugins`` entry point: register the backend as ``CUSTOM``, and where
    the sm7x platform is active, sm7x's vision-tower attention in place of vLLM's
    ``MMEncoderAttention`` (sm7x.integrations.vllm.encoder) and, with
    ``SM7X_VLLM_FP32_RESIDUAL=1``, the float32 residual stream for Gemma 2/3 in float16
    (sm7x.integrations.vllm.fp32_residual).

    Leaves an existing registration of another plugin alone (and says so): two plugins
    cannot both be ``CUSTOM``."""
    import logging

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    platform = type(current_platform)
    if f"{platform.__module__}.{platform.__qualname__}" == PLATFORM:
        from . import encoder

        encoder.register()
        if env_flag(FP32_RESIDUAL_ENV, False):
            from . import fp32_residual

            fp32_residual.register()

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != BACKEND:
        logging.getLogger(LOGGER).warning(
            "sm7x: the CUSTOM attention backend is already registered as %s; not "
            "registering sm7x's (--attention-backend CUSTOM keeps that one)",
            custom.get_path())
        return
    register_backend(custom, BACKEND)


def platform_plugin() -> str | None:
    """``vllm.platform_plugins`` entry point: the sm7x platform's class path when this
    machine has a GPU of capability 7.0 or 7.5, else None (vLLM's own platform).

    vLLM calls it at every start, on any machine, before CUDA is initialised: it asks
    NVML (as vLLM's CUDA check does) and never raises. With the test aid
    (SM7X_VLLM_TEST_ANY_GPU and SM7X_FA2_FORCE) any GPU >= 7.0 activates it."""
    if not env_flag(PLATFORM_ENV, True):
        return None
    try:
        caps = _nvml_capabilities()
    except Exception:  # no NVML, no driver, no NVIDIA GPU: not ours to decide
        return None
    reasons = [capability_reason(cap) for cap in caps]
    if any(r is None for r in reasons):
        return PLATFORM
    if env_flag(TEST_ANY_GPU_ENV, False) and reasons:  # the test aid was asked for: say why not
        import logging

        logging.getLogger(LOGGER).warning("%s", reasons[0])
    return None


def _nvml_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the NVIDIA GPUs NVML sees (none on a CPU build of vLLM)."""
    from importlib.metadata import version

    if "cpu" in version("vllm"):  # vLLM's own CUDA check refuses CPU builds the same way
        return []
    from vllm.utils.import_utils import import_pynvml

    pynvml = import_pynvml()
    pynvml.nvmlInit()
    try:
        return [tuple(pynvml.nvmlDeviceGetCudaComputeCapability(
            pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
