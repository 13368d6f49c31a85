"""The sm7x attention backend for vLLM's V1 engine: AttentionBackend, AttentionImpl and
AttentionMetadataBuilder. vLLM imports this module (through the CUSTOM registration or the
sm7x platform); it imports vLLM. Every tensor operation is in _compute.py (no vLLM).

Interfaces followed (read from the 0.26.0 and 0.33.0 wheels): the backend's class methods
that vLLM's selector consults (validate_configuration and the supports_* it calls), the
kernel block sizes, the per-layer KV cache (0.26 asks the backend for its shape and
physical order; 0.33 fixes the logical shape and negotiates the physical layout, where
this backend takes any: the kernels read the cache through its strides), the metadata
builder fed vLLM's CommonAttentionMetadata, and the impl's do_kv_cache_update + forward.
What differs between the two versions is only which of these hooks vLLM calls; the
methods for both are defined, each unused by the other version.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from ... import _install_hints, _select, fa2
from ..._args import env_flag
from .. import flash_window
from . import TEST_ANY_GPU_ENV, _compute, capability_reason
from ._compute import Sm7xAttentionMetadata

NAME = "CUSTOM"  # vLLM looks the backend up by this name in AttentionBackendEnum


def _capability(cap) -> tuple[int, int]:
    return (cap.major, cap.minor) if hasattr(cap, "major") else tuple(cap)


def _forced_arch() -> str | None:
    return _select._resolve_force(None)[0]


def _arch_for(cap: tuple[int, int]) -> str:
    return _forced_arch() or ("sm70" if cap == (7, 0) else "sm75")


def _missing_library(cap: tuple[int, int]) -> str | None:
    """Why the FA2 library for ``cap`` cannot load here, or None when one is installed
    (7.5 runs the sm75 library, or the sm70 one as its fallback; SM7X_FA2_FORCE names
    exactly one)."""
    forced = _forced_arch()
    archs = (forced,) if forced else ("sm70",) if cap == (7, 0) else ("sm75", "sm70")
    if any(_select.library_path(a) is not None for a in archs):
        return None
    package = _select.package_name(_arch_for(cap))
    return (f"sm7x: {_select.library_name(_arch_for(cap))} is not installed ("
            f"{_install_hints.install_hint(package)})")


def dtype_reason(dtype: torch.dtype | None, kv_cache_dtype: str | None) -> str | None:
    """Why vLLM's model dtype / --kv-cache-dtype cannot run on sm7x (naming the flag to
    change), or None."""
    if dtype is not None and dtype != torch.float16:
        return (f"sm7x: model dtype {str(dtype).replace('torch.', '')} is not supported: "
                f"Volta/Turing have float16 tensor cores only; run vLLM with --dtype float16")
    if kv_cache_dtype is not None and kv_cache_dtype not in _compute.KV_CACHE_DTYPES:
        return (f"sm7x: KV cache dtype {kv_cache_dtype} is not supported (the kernels read "
                f"float16, fp8 and int8_per_token_head caches); run vLLM with --kv-cache-dtype "
                f"auto, fp8 (e4m3), fp8_e5m2 or int8_per_token_head (and --dtype float16)")
    return None


def head_size_reason(head_size: int) -> str | None:
    """Why sm7x has no kernel for a head size, or None."""
    if head_size in fa2.SUPPORTED_HEAD_DIMS:
        return None
    return (f"sm7x: head size {head_size} has no kernel (head sizes: multiples of "
            f"{fa2.SUPPORTED_HEAD_DIMS[0]} up to {fa2.MAX_HEAD_DIM})")


class Sm7xFlashAttentionBackend(AttentionBackend):
    """FlashAttention-2 for Volta and Turing (sm7x.fa2) as a vLLM attention backend."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(_compute.KV_CACHE_DTYPES)
    # vLLM writes the cache through do_kv_cache_update before forward.
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[Sm7xFlashAttentionImpl]:
        return Sm7xFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[Sm7xMetadataBuilder]:
        return Sm7xMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(_compute.KERNEL_BLOCK_SIZES)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        # vLLM may split its block into kernel blocks: any multiple of one of ours runs
        return block_size is None or any(block_size % b == 0 for b in _compute.KERNEL_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(fa2.SUPPORTED_HEAD_DIMS)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # 7.0/7.5; other GPUs only with the test aid SM7X_VLLM_TEST_ANY_GPU (README)
        return capability_reason(_capability(capability)) is None

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        # gpt-oss's attention sinks: applied by the kernels (sm7x.fa2, s_aux)
        return True

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability):
        """vLLM lists this next to its generic reasons ("dtype not supported"): the fix."""
        reason = dtype_reason(dtype, kv_cache_dtype) or head_size_reason(head_size)
        if reason is None:
            cap = _capability(device_capability)
            reason = capability_reason(cap)
            if reason is None:
                reason = _missing_library(cap)
            elif not env_flag(TEST_ANY_GPU_ENV, False):
                reason = None  # vLLM's own "compute capability not supported" says it
        return reason

    # vLLM 0.26: the per-layer cache's logical shape and its physical order.
    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if not _compute.is_kernel_block_size(block_size):
            raise ValueError(f"sm7x: kernel block size {block_size} is not a power of two "
                             f">= 16; run vLLM with --block-size 16")
        if cache_dtype_str not in _compute.KV_CACHE_DTYPES:
            raise ValueError(dtype_reason(None, cache_dtype_str))
        return (num_blocks, num_kv_heads, block_size,
                _compute.content_dim(head_size, cache_dtype_str))

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # Logical [blocks, heads, tokens, 2D] (+ a leading layers dim). Memory order follows
        # vLLM's NHD/HND setting (NHD unless a KV connector or VLLM_KV_CACHE_LAYOUT asks
        # otherwise); the kernels read either through the strides.
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        hnd = get_kv_cache_layout() == "HND"
        if include_num_layers_dimension:  # blocks outermost, then the layers
            return (1, 2, 0, 3, 4) if hnd else (1, 0, 3, 2, 4)
        return (0, 1, 2, 3) if hnd else (0, 2, 1, 3)

    # vLLM 0.33: the logical shape is fixed; None = the kernels take any physical layout.
    @classmethod
    def supported_kv_cache_layouts(cls):
        return None

    # vLLM 0.33: the bytes of one (kv head, slot) come from the spec (0.26 budgets the
    # int8 scales in the spec itself and takes get_kv_cache_shape's padded width); an
    # int8_per_token_head cache keeps each row's float32 scale after its codes, as TRITON_ATTN
    # lays it out (_compute.content_dim).
    @classmethod
    def customize_spec(cls, spec):
        from dataclasses import replace

        mode = getattr(spec, "kv_quant_mode", None)
        if getattr(spec, "state_content_bytes", None) is not None or \
                getattr(mode, "name", None) != "INT8_PER_TOKEN_HEAD":
            return spec
        if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
            raise ValueError(f"sm7x: an int8_per_token_head cache needs one head size for K "
                             f"and V (got {spec.head_size} and {spec.head_size_v}); pick "
                             f"another backend with --attention-backend")
        return replace(spec, state_content_bytes=_compute.content_dim(
            spec.head_size, "int8_per_token_head"))


class Sm7xMetadataBuilder(AttentionMetadataBuilder[Sm7xAttentionMetadata]):
    """CommonAttentionMetadata -> Sm7xAttentionMetadata. Nothing is copied or synced: the
    kernels take vLLM's device tensors as they are.

    CUDA graphs: UNIFORM_BATCH, as vLLM's FlashAttention-2 backend. Batches of decodes
    (every request 1 + num_speculative_tokens queries at most) that vLLM runs in a full
    CUDA graph get a plan (sm7x.fa2.plan_decode) made once per (requests, query length)
    with max_model_len as the key bound, and cached here, so the captured launch and its
    replays share the plan's workspace and do no host work. Mixed prefill/decode batches
    run outside graphs (vLLM's piecewise mode) and are planned per call."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        comp = getattr(vllm_config, "compilation_config", None)
        mode = getattr(comp, "cudagraph_mode", None)
        # plans only where a full graph may capture the call, on the GPU
        self.plan_decodes = (torch.device(device).type == "cuda" and mode is not None
                             and mode.has_full_cudagraphs())
        self.max_graph_tokens = getattr(comp, "max_cudagraph_capture_size", None) or 0
        spec = getattr(vllm_config, "speculative_config", None)
        self.decode_query_len = 1 + (getattr(spec, "num_speculative_tokens", None) or 0)
        model = getattr(vllm_config, "model_config", None)
        self.max_model_len = getattr(model, "max_model_len", None)
        # --kv-cache-dtype: the plans are made for the kernel of that cache format
        cache = getattr(vllm_config, "cache_config", None)
        self.kv_cache_dtype = getattr(cache, "cache_dtype", None) or "auto"
        self.num_heads: int | None = None  # from the layers, when a plan needs it
        self._plans: dict[tuple[int, int], fa2.DecodePlan] = {}

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Sm7xAttentionMetadata:
        m = common_attn_metadata
        if common_prefix_len:  # vLLM 0.26 passes it only to backends that ask for cascade
            raise NotImplementedError("sm7x vLLM backend: cascade attention is not supported")
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise NotImplementedError(
                "sm7x vLLM backend: only causal decoder attention is supported")
        md = Sm7xAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc, max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens, block_table=m.block_table_tensor, slot_mapping=m.slot_mapping)
        if (self.plan_decodes and m.max_query_len <= self.decode_query_len
                and m.num_actual_tokens <= self.max_graph_tokens and self.max_model_len):
            md.plan = self._plan(m.num_reqs, m.max_query_len)
            md.max_seq_len = self.max_model_len  # the plan's bound, fixed in the graph
        return md

    def _plan(self, num_reqs: int, max_query_len: int) -> fa2.DecodePlan:
        key = (num_reqs, max_query_len)
        plan = self._plans.get(key)
        if plan is None:
            if self.num_heads is None:
                self.num_heads = self._layer_num_heads()
            plan = self._plans[key] = _compute.make_plan(
                num_reqs, max_query_len, self.max_model_len, self.num_heads,
                self.num_kv_heads, self.head_size, self.device, self.kv_cache_dtype)
        return plan

    def _layer_num_heads(self) -> int:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(self.vllm_config, Attention, self.layer_names)
        heads = {layer.num_heads for layer in layers.values()}
        if len(heads) != 1:
            raise ValueError(f"sm7x vLLM backend: the layers {self.layer_names} of one "
                             f"KV cache group have query head counts {sorted(heads)}; one "
                             f"count per group is supported")
        return heads.pop()


class Sm7xFlashAttentionImpl(AttentionImpl[Sm7xAttentionMetadata]):
    """One attention layer: checks its configuration once, then writes the cache and
    attends through _compute."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None) -> None:
        what = "sm7x vLLM backend"
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{what}: attention type {attn_type} is not supported "
                                      f"(decoder self-attention only); pick another "
                                      f"backend with --attention-backend")
        if alibi_slopes is not None:
            raise NotImplementedError(f"{what}: ALiBi is not supported; pick another backend "
                                      f"with --attention-backend (e.g. TRITON_ATTN)")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"{what}: sinks must have one logit per query head [{num_heads}], "
                             f"got shape {tuple(sinks.shape)}")
        config = get_current_vllm_config_or_none()
        model_dtype = getattr(getattr(config, "model_config", None), "dtype", None)
        reason = dtype_reason(model_dtype, kv_cache_dtype)
        if reason is not None:
            raise ValueError(reason)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_size not in fa2.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"{what}: head size {head_size} has no kernel (supported: "
                             f"multiples of {fa2.SUPPORTED_HEAD_DIMS[0]} up to "
                             f"{fa2.MAX_HEAD_DIM}); pick another backend with "
                             f"--attention-backend")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"{what}: num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"{what}: sliding_window must be > 0, got {sliding_window}")
        # vLLM builds the block tables and lengths itself: no stream sync per eager
        # attention call to check them, unless SM7X_CHECK_INDICES asks for the checks
        fa2.set_input_checks(env_flag("SM7X_CHECK_INDICES", False))
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = flash_window(sliding_window)
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.alibi_slopes = None
        self.sinks = sinks  # vLLM's parameter, loaded later: read at each call

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        _compute.write_kv_cache(key, value, kv_cache, slot_mapping, self.head_size,
                                self.kv_cache_dtype, *self._scales(layer))

    def _scales(self, layer) -> tuple:
        """vLLM's per-layer fp8 scales (float32 tensors: 1.0 unless the checkpoint or
        --calculate-kv-scales sets them, in place), or (None, None) for a float16 cache."""
        if self.kv_cache_dtype not in _compute.FP8_KV_CACHE_DTYPES:
            return None, None
        return layer._k_scale, layer._v_scale

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Sm7xAttentionMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("sm7x vLLM backend: fused output quantization is not "
                                      "supported")
        if attn_metadata is None:  # vLLM's memory-profiling run: no cache yet
            return output.fill_(0)
        k_scale, v_scale = self._scales(layer)
        return _compute.attention(query, kv_cache, output, attn_metadata,
                                  head_size=self.head_size, scale=self.scale,
                                  window_size=self.sliding_window,
                                  softcap=self.logits_soft_cap,
                                  kv_cache_dtype=self.kv_cache_dtype, k_scale=k_scale,
                                  v_scale=v_scale, sinks=self.sinks)
