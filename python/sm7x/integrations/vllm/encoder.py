"""Vision-tower attention (vLLM's ``MMEncoderAttention``: Qwen2.5-VL, Qwen3-VL and the other
multimodal encoders) on sm7x's FA2: non-causal, over each image's or window's patches.

The hook: vLLM 0.26 and 0.33 pick a vision tower's attention backend per platform
(``get_vit_attn_backend``) from a fixed list (FLASH_ATTN, TRITON_ATTN, FLASHINFER,
TORCH_SDPA) with no plugin entry; on Volta and Turing it comes to TORCH_SDPA.
``MMEncoderAttention`` is a vLLM ``CustomOp``, and a class registered under its name with
``CustomOp.register_oot`` is instantiated in its place: :func:`register` puts
:class:`Sm7xMMEncoderAttention` there, whose ``forward_cuda`` runs sm7x where sm7x runs
the layer (fp16, a head size sm7x has, a 7.0/7.5 GPU) and vLLM's own choice elsewhere.
The sm7x platform registers it in every vLLM process (sm7x.integrations.vllm.register),
only where the platform is active.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor
from vllm.model_executor.layers.attention import MMEncoderAttention

from ... import fa2
from . import LOGGER, capability_reason
from .backend import dtype_reason, head_size_reason

logger = logging.getLogger(LOGGER)
_logged: set[tuple] = set()


def reason(head_size: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> str | None:
    """Why sm7x does not run a vision layer of this configuration, or None when it does
    (the decoder backend's reasons)."""
    why = dtype_reason(dtype, None) or head_size_reason(head_size)
    if why is not None:
        return why
    return "no CUDA device capability" if capability is None else capability_reason(capability)


class Sm7xMMEncoderAttention(MMEncoderAttention):
    """MMEncoderAttention whose CUDA forward is sm7x's FA2 where sm7x runs the layer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from vllm.platforms import current_platform

        cap = current_platform.get_device_capability()
        self.sm7x_reason = reason(self.head_size, self.dtype,
                                  None if cap is None else (cap.major, cap.minor))
        key = (self.head_size, str(self.dtype), self.sm7x_reason)
        if key not in _logged:
            _logged.add(key)
            if self.sm7x_reason is None:
                logger.info("Using sm7x FlashAttention-2 for MMEncoderAttention (head size %d)",
                            self.head_size)
            else:
                logger.info("sm7x FlashAttention-2 not used for MMEncoderAttention: %s; vLLM's "
                            "%s runs it", self.sm7x_reason, self.attn_backend)

    def forward_cuda(self, query: Tensor, key: Tensor, value: Tensor,
                     cu_seqlens: Tensor | None = None, max_seqlen: Tensor | None = None,
                     *args, **kwargs) -> Tensor:
        if self.sm7x_reason is not None or query.dtype != torch.float16:
            return super().forward_cuda(query, key, value, cu_seqlens, max_seqlen, *args,
                                        **kwargs)
        bsz, q_len = query.shape[:2]
        kv_len = key.shape[1]
        q, k, v = self.view_qkv_to_4d(query, key, value, bsz, q_len, kv_len)
        if max_seqlen is not None and not isinstance(max_seqlen, torch.Tensor):
            max_seqlen = torch.tensor(int(max_seqlen))  # some models pass an int
        out = encoder_attention(q, k, v, float(self.scale), cu_seqlens, max_seqlen)
        return out.reshape(bsz, q_len, -1) if query.dim() != 4 else out


# One op for torch.compile (vLLM compiles some vision towers): the longest sequence is read
# on the host here, as vLLM's own flash-attention wrapper does.
@torch.library.custom_op("sm7x_vllm::encoder_attention", mutates_args=())
def encoder_attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
                      cu_seqlens: Optional[Tensor], max_seqlen: Optional[Tensor]) -> Tensor:
    """Non-causal attention of ``q [batch, seq, heads, head_size]`` over ``k``/``v``; with
    ``cu_seqlens`` (int32, over the flattened batch x seq tokens) each sequence attends
    within itself (vLLM's layout)."""
    if cu_seqlens is None:
        return fa2.flash_attn_func(q, k, v, softmax_scale=scale)
    cu = cu_seqlens.int()
    longest = 0 if max_seqlen is None else int(max_seqlen)
    if longest <= 0:  # vLLM passes 0 unless its backend is FA
        longest = int((cu[1:] - cu[:-1]).max())
    h, hk, d = q.shape[2], k.shape[2], q.shape[3]
    out = fa2.flash_attn_varlen_func(q.reshape(-1, h, d), k.reshape(-1, hk, d),
                                     v.reshape(-1, hk, d), cu, cu, longest, longest,
                                     softmax_scale=scale)
    return out.view(q.shape)


@encoder_attention.register_fake
def _encoder_attention_fake(q, k, v, scale, cu_seqlens, max_seqlen):
    return q.new_empty(q.shape)


def register() -> None:
    """Put Sm7xMMEncoderAttention in MMEncoderAttention's place (idempotent)."""
    from vllm.model_executor.custom_op import op_registry_oot

    if op_registry_oot.get(MMEncoderAttention.__name__) is Sm7xMMEncoderAttention:
        return
    if MMEncoderAttention.__name__ in op_registry_oot:
        logger.warning("sm7x: MMEncoderAttention is already replaced by %s; not replacing it",
                       op_registry_oot[MMEncoderAttention.__name__])
        return
    MMEncoderAttention.register_oot(Sm7xMMEncoderAttention)
