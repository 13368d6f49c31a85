"""vLLM's CUDA platform with one change: on Volta (7.0) and Turing (7.5), when no attention
backend was asked for (no --attention-backend), it picks the sm7x FlashAttention-2 backend
if the backend accepts the layer's configuration, and logs that it did (or why it did not).
Everything else, and every other GPU, is vLLM's CudaPlatform unchanged.

Why a platform: vLLM's CUDA platform ranks its backends in a fixed list (FLASH_ATTN,
FLASHINFER, TRITON_ATTN, ...) in which a plugin's CUSTOM backend never appears; an
out-of-tree platform plugin is vLLM's supported way to change that choice. vLLM takes an
activated platform plugin over its built-in CUDA platform (sm7x.integrations.vllm.
platform_plugin activates it only where a 7.0/7.5 GPU is present).
"""

from __future__ import annotations

import logging

from vllm.platforms.cuda import CudaPlatform

from ..._args import env_flag
from . import BACKEND, FP32_RESIDUAL_ENV, LOGGER, capability_reason, register

logger = logging.getLogger(LOGGER)
_declined: set[tuple] = set()  # (capability, reasons) already logged


class Sm7xCudaPlatform(CudaPlatform):
    """CudaPlatform that prefers sm7x's attention backend on 7.0/7.5."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        if selected_backend is None:
            path = cls._sm7x_backend(attn_selector_config)
            if path is not None:
                return path
        return super().get_attn_backend_cls(selected_backend, attn_selector_config,
                                            *args, **kwargs)

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        pp = getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1)
        if env_flag(FP32_RESIDUAL_ENV, False) and pp > 1:
            raise ValueError(f"sm7x: {FP32_RESIDUAL_ENV}=1 keeps the residual stream in float32, "
                             f"but pipeline parallelism ({pp} stages) passes it between stages "
                             f"in the model's dtype; use tensor parallelism, or unset "
                             f"{FP32_RESIDUAL_ENV}")

    @classmethod
    def _sm7x_backend(cls, attn_selector_config) -> str | None:
        """BACKEND when it runs this configuration on this GPU, else None (logged)."""
        cap = cls.get_device_capability()
        if cap is None or capability_reason((cap.major, cap.minor)) is not None:
            return None
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        register()  # vLLM finds the backend by its name, CUSTOM
        if AttentionBackendEnum.CUSTOM.get_path() != BACKEND:
            reasons = ["another plugin registered the CUSTOM backend"]
        else:
            from .backend import Sm7xFlashAttentionBackend

            reasons = Sm7xFlashAttentionBackend.validate_configuration(
                device_capability=cap, **attn_selector_config._asdict())
        where = f"compute capability {cap.major}.{cap.minor}"
        if reasons:
            key = ((cap.major, cap.minor), tuple(reasons))
            if key not in _declined:
                _declined.add(key)
                logger.warning("sm7x FlashAttention-2 backend not used on %s for %r: %s; "
                               "vLLM picks its own backend", where, attn_selector_config,
                               "; ".join(reasons))
            return None
        logger.info("Using the sm7x FlashAttention-2 attention backend (%s, registered as "
                    "CUSTOM) on %s", BACKEND, where)
        return BACKEND
