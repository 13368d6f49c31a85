"""The vLLM backend's compute path, without vLLM: the views of vLLM's KV cache, the cache
write through slot_mapping, the attention call, and the per-batch metadata.

backend.py (which imports vLLM) delegates every tensor operation here, so the GPU test
(tests/gpu/test_vllm_backend.py) runs exactly this code on a machine where vLLM cannot be
installed, with tensors laid out as vLLM lays them out.

vLLM's KV cache, per attention layer (vLLM 0.26 and 0.33 alike): one tensor of logical
shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, K and V packed in the last
dim, physically ordered by the cache layout (NHD by default: ``[num_blocks, block_size,
num_kv_heads, 2 * head_size]`` in memory). ``transpose(1, 2).split(head_size, -1)`` gives
the K and V caches ``[num_blocks, block_size, num_kv_heads, head_size]`` that the sm7x
kernels read in place through their strides (NHD: token stride ``num_kv_heads * 2 *
head_size``, head stride ``2 * head_size``; neither view is contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import fa2, ops

# The page sizes (vLLM "kernel block sizes") the paged kernels take are powers of two;
# these are the ones offered to vLLM (it picks one that divides its block size).
KERNEL_BLOCK_SIZES = (16, 32, 64, 128, 256)


def is_kernel_block_size(block_size: int) -> bool:
    return block_size >= 16 and block_size & (block_size - 1) == 0


# Cache dtypes ("--kv-cache-dtype") the kernels read: float16, and vLLM's 8-bit fp8
# caches (uint8 tensors of E4M3 or E5M2 codes holding x / layer._k_scale; "fp8" is E4M3).
FP16_KV_CACHE_DTYPES = ("auto", "float16")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
# int8 codes with a float32 scale per (token, kv head) row, stored right after the row's
# codes: vLLM lays each (kv head, slot) out as [K codes | K scale | V codes | V scale]
INT8_KV_CACHE_DTYPES = ("int8_per_token_head",)
KV_CACHE_DTYPES = FP16_KV_CACHE_DTYPES + FP8_KV_CACHE_DTYPES + INT8_KV_CACHE_DTYPES
ROW_SCALE_BYTES = 4


def content_dim(head_size: int, kv_cache_dtype: str = "auto") -> int:
    """The packed cache's last dim: K and V rows (plus each one's scale for int8)."""
    return 2 * (head_size + ROW_SCALE_BYTES) if kv_cache_dtype in INT8_KV_CACHE_DTYPES \
        else 2 * head_size


@dataclass
class Sm7xAttentionMetadata:
    """One batch, as the kernels take it (built by the vLLM metadata builder from vLLM's
    CommonAttentionMetadata; the GPU test builds it directly).

    A batch may mix prefill chunks and decodes: request ``i`` has queries
    ``query_start_loc[i]:query_start_loc[i + 1]``, the last of its ``seq_lens[i]`` keys,
    causal bottom-right aligned."""

    num_actual_tokens: int  # tokens to compute (query and output rows past it: padding)
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], on the device
    max_seq_len: int  # at least every seq_lens entry (the kernels' bound)
    seq_lens: torch.Tensor  # int32 [num_reqs]: keys per request, new tokens included
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot of each new token, -1 padding
    # sm7x.fa2.DecodePlan for batches vLLM captures in a CUDA graph: planned once per batch
    # shape with max_seq_len as the key bound, so a replay needs no host sync or allocation.
    plan: fa2.DecodePlan | None = None


def _is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in FP8_KV_CACHE_DTYPES


_STORES = {**{n: "1-byte codes (uint8)" for n in FP8_KV_CACHE_DTYPES},
           **{n: "int8 codes and row scales" for n in INT8_KV_CACHE_DTYPES}}


def kv_cache_views(kv_cache: torch.Tensor, head_size: int,
                   kv_cache_dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's packed per-layer cache -> (key_cache, value_cache), each ``[num_blocks,
    block_size, num_kv_heads, head_size]``: views, nothing is copied. float16, or with an
    fp8 ``kv_cache_dtype`` the one-byte codes (uint8, as vLLM allocates them), or int8
    codes (``int8_per_token_head``; their scales: :func:`scale_cache_views`)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"sm7x vLLM backend: --kv-cache-dtype {kv_cache_dtype} is not "
                         f"supported; use one of {', '.join(KV_CACHE_DTYPES)}")
    width = content_dim(head_size, kv_cache_dtype)
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4 \
            or kv_cache.shape[-1] != width:
        shape = tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache)
        raise ValueError(
            f"sm7x vLLM backend: kv_cache must be vLLM's packed cache [num_blocks, "
            f"num_kv_heads, block_size, {width}] (head_size {head_size}, --kv-cache-dtype "
            f"{kv_cache_dtype}), got {shape}")
    want = ((torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2) if _is_fp8(kv_cache_dtype)
            else (torch.int8,) if kv_cache_dtype in INT8_KV_CACHE_DTYPES else (torch.float16,))
    if kv_cache.dtype not in want:
        raise TypeError(
            f"sm7x vLLM backend: the KV cache is {kv_cache.dtype}, but --kv-cache-dtype "
            f"{kv_cache_dtype} stores {_STORES.get(kv_cache_dtype, 'float16')}: run vLLM with "
            f"--dtype float16 and --kv-cache-dtype auto, fp8, fp8_e5m2 or int8_per_token_head")
    rows = kv_cache.transpose(1, 2)
    half = width // 2
    return rows[..., :head_size], rows[..., half:half + head_size]


def scale_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8_per_token_head cache's row scales: float32 views ``[num_blocks, block_size,
    num_kv_heads]`` of the 4 bytes after each K and V row (as vLLM's TRITON_ATTN carves
    them), nothing copied."""
    f32 = kv_cache.view(torch.float32).transpose(1, 2)  # last dim: (head_size + 4) / 2 floats
    half = (head_size + ROW_SCALE_BYTES) // 4
    return f32[..., head_size // 4], f32[..., half + head_size // 4]


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, head_size: int, kv_cache_dtype: str = "auto",
                   k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Writes the new tokens' ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]``
    into the cache at ``slot_mapping`` (slot = block * block_size + offset; negative slots
    are padding and skipped). vLLM may pass more key rows than slots (padded batches):
    only the first ``len(slot_mapping)`` are written. One sm7x.ops.reshape_and_cache call,
    which takes the strided cache views and runs inside CUDA graphs. An fp8 cache stores
    ``x / k_scale`` (``v_scale``) as codes: vLLM's layer._k_scale / _v_scale, one value;
    an int8 cache each row's codes and its own scale (absmax / 127) beside them."""
    key_cache, value_cache = kv_cache_views(kv_cache, head_size, kv_cache_dtype)
    n = slot_mapping.shape[0]
    if key.shape[0] < n or value.shape[0] < n:
        raise ValueError(
            f"sm7x vLLM backend: slot_mapping has {n} slots but key/value hold "
            f"{key.shape[0]}/{value.shape[0]} tokens")
    if _is_fp8(kv_cache_dtype):
        ops.reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping,
                              kv_cache_dtype, k_scale, v_scale)
    elif kv_cache_dtype in INT8_KV_CACHE_DTYPES:
        k_rows, v_rows = scale_cache_views(kv_cache, head_size)
        ops.reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping,
                              kv_cache_dtype, k_scale_cache=k_rows, v_scale_cache=v_rows)
    else:
        ops.reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping)


def attention(query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
              metadata: Sm7xAttentionMetadata, *, head_size: int, scale: float,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
              kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
              v_scale: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ``query [num_tokens, num_heads, head_size]`` over the paged
    cache, written into ``output`` (same shape) for the first ``num_actual_tokens`` rows;
    returns ``output``. GQA: num_heads a multiple of the cache's num_kv_heads. An fp8
    cache is read as codes x k_scale / v_scale (on the device: the scales may change
    after a CUDA graph was captured); an int8 one as codes x each row's own scale.
    ``sinks`` [num_heads]: attention sinks (gpt-oss), one softmax column per head."""
    key_cache, value_cache = kv_cache_views(kv_cache, head_size, kv_cache_dtype)
    n = metadata.num_actual_tokens
    if _is_fp8(kv_cache_dtype):
        scales = dict(k_descale=k_scale, v_descale=v_scale, kv_cache_dtype=kv_cache_dtype)
    elif kv_cache_dtype in INT8_KV_CACHE_DTYPES:
        k_rows, v_rows = scale_cache_views(kv_cache, head_size)
        scales = dict(k_scale_cache=k_rows, v_scale_cache=v_rows)
    else:
        scales = {}
    fa2.flash_attn_varlen_func(
        query[:n], key_cache, value_cache,
        cu_seqlens_q=metadata.query_start_loc, cu_seqlens_k=None,
        max_seqlen_q=metadata.max_query_len, max_seqlen_k=metadata.max_seq_len,
        softmax_scale=scale, causal=True, window_size=window_size, softcap=softcap,
        block_table=metadata.block_table, seqused_k=metadata.seq_lens, out=output[:n],
        scheduler_metadata=metadata.plan, s_aux=sinks, **scales)
    return output


def make_plan(num_reqs: int, max_query_len: int, max_seq_len: int, num_heads: int,
              num_kv_heads: int, head_size: int, device,
              kv_cache_dtype: str = "auto") -> fa2.DecodePlan:
    """The split-KV plan (and its workspace) of one captured batch shape over a cache of
    --kv-cache-dtype kv_cache_dtype."""
    return fa2.plan_decode(num_reqs, max_query_len, max_seq_len, num_heads, num_kv_heads,
                           head_size, device=device, kv_cache_dtype=kv_cache_dtype)
