"""The sm7x core ops written in plain torch.

Two uses: the benchmark's baseline ("the same op in plain torch", run in the input's
dtype the way vLLM's ``forward_native`` methods do) and, called on float32 copies of the
inputs, the float32 reference of the tests. Everything here is out of place: each
function returns new tensors and leaves its inputs alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalized, new residual); the sum is rounded to the dtype before the norm."""
    r = x + residual
    return rms_norm(r, weight, eps), r


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor,
                     key: Optional[torch.Tensor], head_size: int,
                     cos_sin_cache: torch.Tensor,
                     is_neox: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(new query, new key), same shapes and dtypes as the inputs."""
    pos = positions.reshape(-1)
    tokens = pos.numel()
    rot_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache.index_select(0, pos).chunk(2, dim=-1)  # [tokens, rot/2]

    def apply(x: torch.Tensor) -> torch.Tensor:
        xs = x.reshape(tokens, x.numel() // max(tokens * head_size, 1), head_size)
        c = cos[:, None, :].to(x.dtype)
        s = sin[:, None, :].to(x.dtype)
        rot, rest = xs[..., :rot_dim], xs[..., rot_dim:]
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1).reshape(x.shape)

    return apply(query), (apply(key) if key is not None else None)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      skip_negative: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(new key_cache, new value_cache) with token t at slot slot_mapping[t].

    skip_negative=False assumes every slot is valid (no data-dependent masking: the
    benchmark's baseline, which would otherwise sync on the mask).
    """
    nb, bs = key_cache.shape[:2]
    kc = key_cache.clone()
    vc = value_cache.clone()
    slots = slot_mapping.long()
    if skip_negative:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    kc.view(nb * bs, *kc.shape[2:]).index_copy_(0, slots, key)
    vc.view(nb * bs, *vc.shape[2:]).index_copy_(0, slots, value)
    return kc, vc


def reshape_and_cache_(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In-place variant for the benchmark (contiguous caches, every slot valid)."""
    nb, bs = key_cache.shape[:2]
    key_cache.view(nb * bs, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(nb * bs, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)
