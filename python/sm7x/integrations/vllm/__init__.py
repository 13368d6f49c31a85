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

from ..._args import env_flag

BACKEND = "sm7x.integrations.vllm.backend.Sm7xFlashAttentionBackend"
PLATFORM = "sm7x.integrations.vllm.platform.Sm7xCudaPlatform"
# Set to 0 to keep vLLM's own CUDA platform (and its backend choice) on Volta/Turing.
PLATFORM_ENV = "SM7X_VLLM_PLATFORM"
# The compute capabilities the backend runs on (the FA2 libraries' native targets).
CAPABILITIES = ((7, 0), (7, 5))
LOGGER = "vllm.sm7x"  # under vLLM's logger, so vLLM's log configuration shows it


def register() -> None:
    """``vllm.general_plugins`` entry point: register the backend as ``CUSTOM``.

    Leaves an existing registration of another plugin alone (and says so): two plugins
    cannot both be ``CUSTOM``."""
    import logging

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

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
    NVML (as vLLM's CUDA check does) and never raises."""
    if not env_flag(PLATFORM_ENV, True):
        return None
    try:
        return PLATFORM if any(cap in CAPABILITIES for cap in _nvml_capabilities()) else None
    except Exception:  # no NVML, no driver, no NVIDIA GPU: not ours to decide
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
