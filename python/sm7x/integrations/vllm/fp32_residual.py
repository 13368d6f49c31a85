"""Gemma 2 / Gemma 3 in float16 on vLLM, with the residual stream kept in float32 (opt-in:
``SM7X_VLLM_FP32_RESIDUAL=1``).

Why: models trained in bf16 grow their residual stream past float16's 65504 (Gemma 2's
does), and the sum then becomes inf and every later norm NaN. vLLM 0.26 and 0.33 refuse
``--dtype float16`` for ``gemma2``, ``gemma3`` and ``gemma3_text`` by name ("numerical
instability", vllm/config/model.py), which leaves a V100/T4 user (no bf16 tensor cores)
only float32. Engines that serve bf16-trained models in fp16 keep the residual in fp32;
measured on a random-weight Gemma 2 in transformers (csrc/core/probes/
gemma2_fp16_residual.py): once the residual passes 65504, plain fp16 gives NaN logits and
an fp32 residual alone restores fp16's small-scale error.

How: in those models the residual travels only through ``GemmaRMSNorm``'s fused add
(``hidden, residual = norm(hidden, residual)``; vllm/model_executor/models/gemma2.py and
gemma3.py). :class:`Sm7xGemmaRMSNorm` takes its place through vLLM's out-of-tree
CustomOp registry and returns the residual as float32 (the add and the norm in float32,
only the normalized output rounded to the model's dtype), so the stream never rounds to
fp16. With the flag set, :func:`register` also lifts vLLM's float16 refusal for those
three model types, and says so in the log.

What it does not do: the attention and MLP outputs stay float16 (a model whose layer
outputs themselves pass 65504 still overflows: not measured on real checkpoints); the
residual crosses pipeline-parallel stages in the model dtype, so the platform refuses
pipeline parallelism with the flag (Sm7xCudaPlatform.check_and_update_config).
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.layernorm import GemmaRMSNorm

from . import FP32_RESIDUAL_ENV as ENV
from . import LOGGER

logger = logging.getLogger(LOGGER)
# vLLM's float16 refusals that the float32 residual answers: the models built on GemmaRMSNorm
MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text")


class Sm7xGemmaRMSNorm(GemmaRMSNorm):
    """GemmaRMSNorm whose fused add keeps the residual stream in float32."""

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return super().forward_native(x)
        stream = x.float() + residual.float()
        var = stream.pow(2).mean(dim=-1, keepdim=True)
        out = stream * torch.rsqrt(var + self.variance_epsilon) * (1.0 + self.weight.float())
        return out.to(x.dtype), stream

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.forward_native(x, residual)


def register() -> None:
    """Put Sm7xGemmaRMSNorm in GemmaRMSNorm's place and lift vLLM's float16 refusal of the
    Gemma 2/3 model types (idempotent)."""
    from vllm.config import model as model_config
    from vllm.model_executor.custom_op import op_registry_oot

    name = GemmaRMSNorm.__name__
    if op_registry_oot.get(name) not in (None, Sm7xGemmaRMSNorm):
        logger.warning("sm7x: %s is already replaced by %s; %s not applied", name,
                       op_registry_oot[name], ENV)
        return
    if name not in op_registry_oot:
        GemmaRMSNorm.register_oot(Sm7xGemmaRMSNorm)
    refused = getattr(model_config, "_FLOAT16_NOT_SUPPORTED_MODELS", {})
    lifted = [t for t in MODEL_TYPES if refused.pop(t, None) is not None]
    if lifted:
        logger.warning("sm7x: %s=1: float16 allowed for %s with the residual stream kept in "
                       "float32 (sm7x's GemmaRMSNorm); attention and MLP outputs stay float16",
                       ENV, ", ".join(lifted))
