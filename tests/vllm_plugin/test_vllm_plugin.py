"""sm7x's vLLM plugin against real vLLM Python on CPU (tests/vllm_plugin/run.sh: one run per pinned
vLLM version): the entry points as vLLM loads them, backend selection on 7.0/7.5 (and not
on 8.0), configuration checks, metadata from vLLM's CommonAttentionMetadata, the cache
write through slot_mapping into a cache laid out as vLLM allocates it, and forward with
the kernel op replaced by a float32 reference (sm7x.fa2's Python path runs unchanged)."""

from __future__ import annotations

import itertools
import math
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: tests/vllm_plugin/run.sh "
                                           "runs these against the pinned vLLM versions")

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.plugins import PLATFORM_PLUGINS_GROUP, load_plugins_by_group  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import sm7x.integrations.vllm as plugin  # noqa: E402
from sm7x.integrations.vllm import _compute  # noqa: E402
from sm7x.integrations.vllm.backend import (  # noqa: E402
    Sm7xFlashAttentionBackend as Backend,
    Sm7xFlashAttentionImpl as Impl,
    Sm7xMetadataBuilder as Builder,
)
from sm7x.integrations.vllm.platform import Sm7xCudaPlatform  # noqa: E402
from vllm.platforms.cuda import CudaPlatform  # noqa: E402

V026 = vllm.__version__.startswith("0.26")
F16 = torch.float16


def selector(**kw):
    args = dict(head_size=128, dtype=F16, kv_cache_dtype="auto", block_size=16)
    args.update(kw)
    return AttentionSelectorConfig(**args)


@pytest.fixture
def on_gpu(monkeypatch):
    """Makes the sm7x platform (and vLLM's CudaPlatform under it) report a capability."""
    def set_cap(major, minor):
        monkeypatch.setattr(Sm7xCudaPlatform, "get_device_capability",
                            classmethod(lambda cls, device_id=0: DeviceCapability(major, minor)))
    return set_cap


# ---------------------------------------------------------------------------------------
# entry points and registration


def test_entry_points_are_what_vllm_loads(custom_backend_clear, monkeypatch):
    from vllm import plugins

    monkeypatch.setattr(plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    plugins.load_general_plugins()
    assert custom_backend_clear.get_path() == plugin.BACKEND
    assert custom_backend_clear.get_class() is Backend
    assert AttentionBackendEnum[Backend.get_name()] is AttentionBackendEnum.CUSTOM
    loaded = load_plugins_by_group(PLATFORM_PLUGINS_GROUP)
    assert loaded["sm7x"] is plugin.platform_plugin


def test_register_leaves_another_plugins_custom_backend(custom_backend_clear, sm7x_log):
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(custom_backend_clear, "other.plugin.Backend")
    plugin.register()
    assert custom_backend_clear.get_path() == "other.plugin.Backend"
    assert any("already registered" in r.getMessage() for r in sm7x_log)


@pytest.mark.parametrize("caps, expect", [
    ([(7, 5)], plugin.PLATFORM), ([(7, 0), (7, 0)], plugin.PLATFORM),
    ([(8, 0)], None), ([(9, 0), (8, 6)], None), ([], None), ([(7, 2)], None)])
def test_platform_plugin_activates_on_volta_turing_only(monkeypatch, caps, expect):
    monkeypatch.setattr(plugin, "_nvml_capabilities", lambda: caps)
    assert plugin.platform_plugin() == expect
    monkeypatch.setenv(plugin.PLATFORM_ENV, "0")
    assert plugin.platform_plugin() is None


def test_platform_plugin_never_raises(monkeypatch):
    def boom():
        raise RuntimeError("NVML Shared Library Not Found")
    monkeypatch.setattr(plugin, "_nvml_capabilities", boom)
    assert plugin.platform_plugin() is None


def test_vllm_resolves_the_sm7x_platform_on_turing(monkeypatch):
    import vllm.platforms as platforms

    monkeypatch.setattr(plugin, "_nvml_capabilities", lambda: [(7, 5)])
    assert platforms.resolve_current_platform_cls_qualname() == plugin.PLATFORM
    monkeypatch.setattr(plugin, "_nvml_capabilities", lambda: [(8, 0)])
    assert platforms.resolve_current_platform_cls_qualname() != plugin.PLATFORM


# ---------------------------------------------------------------------------------------
# selection


@pytest.mark.parametrize("cap", [(7, 0), (7, 5)])
def test_selected_on_volta_and_turing(on_gpu, fa2_libraries, custom_backend_clear, sm7x_log,
                                      monkeypatch, cap):
    monkeypatch.setattr(CudaPlatform, "get_attn_backend_cls",
                        classmethod(lambda cls, *a, **k: pytest.fail("vLLM's choice was asked")))
    on_gpu(*cap)
    path = Sm7xCudaPlatform.get_attn_backend_cls(None, selector(), 32)
    assert path == plugin.BACKEND
    assert custom_backend_clear.get_path() == plugin.BACKEND  # registered on the way
    assert any("Using the sm7x FlashAttention-2" in r.getMessage() and
               f"{cap[0]}.{cap[1]}" in r.getMessage() for r in sm7x_log)


def test_selected_for_a_model_with_sinks(on_gpu, fa2_libraries, custom_backend_clear,
                                         monkeypatch):
    """gpt-oss (attention sinks): vLLM's own backends need sm90 (FA3) for them."""
    monkeypatch.setattr(CudaPlatform, "get_attn_backend_cls",
                        classmethod(lambda cls, *a, **k: pytest.fail("vLLM's choice was asked")))
    on_gpu(7, 5)
    assert Sm7xCudaPlatform.get_attn_backend_cls(None, selector(has_sink=True),
                                                 32) == plugin.BACKEND


@pytest.mark.parametrize("cap", [(8, 0), (9, 0), (7, 2), (6, 1)])
def test_not_selected_elsewhere(on_gpu, fa2_libraries, custom_backend_clear, monkeypatch, cap):
    monkeypatch.setattr(CudaPlatform, "get_attn_backend_cls",
                        classmethod(lambda cls, *a, **k: "vllm.default.Backend"))
    on_gpu(*cap)
    assert Sm7xCudaPlatform.get_attn_backend_cls(None, selector(), 32) == "vllm.default.Backend"


def test_explicit_backend_is_vllms_business(on_gpu, fa2_libraries, monkeypatch):
    seen = []
    monkeypatch.setattr(CudaPlatform, "get_attn_backend_cls",
                        classmethod(lambda cls, b, *a, **k: seen.append(b) or "x.Y"))
    on_gpu(7, 5)
    assert Sm7xCudaPlatform.get_attn_backend_cls(AttentionBackendEnum.TRITON_ATTN,
                                                 selector(), 32) == "x.Y"
    assert seen == [AttentionBackendEnum.TRITON_ATTN]


@pytest.mark.parametrize("change, why", [
    (dict(dtype=torch.bfloat16), "--dtype float16"),
    (dict(kv_cache_dtype="fp8_per_token_head"), "--kv-cache-dtype auto, fp8"),
    (dict(head_size=100), "head size 100"),
    (dict(use_mla=True), "MLA"),
    (dict(attn_type="encoder_only"), "encoder_only"),
    (dict(block_size=8), "block_size"),
])
def test_falls_back_with_reason(on_gpu, fa2_libraries, custom_backend_clear, sm7x_log,
                                monkeypatch, change, why):
    monkeypatch.setattr(CudaPlatform, "get_attn_backend_cls",
                        classmethod(lambda cls, *a, **k: "vllm.default.Backend"))
    on_gpu(7, 5)
    assert Sm7xCudaPlatform.get_attn_backend_cls(None, selector(**change), 32) == \
        "vllm.default.Backend"
    assert any("not used" in r.getMessage() and why in r.getMessage() for r in sm7x_log), \
        [r.getMessage() for r in sm7x_log]


def test_missing_library_falls_back_naming_the_package(on_gpu, custom_backend_clear,
                                                       sm7x_log, monkeypatch, tmp_path):
    from sm7x import _select

    monkeypatch.setenv(_select.LIBRARY_PATH_ENV, str(tmp_path))  # nothing there
    monkeypatch.setattr(_select, "library_path", lambda arch: None)
    monkeypatch.setattr(CudaPlatform, "get_attn_backend_cls",
                        classmethod(lambda cls, *a, **k: "vllm.default.Backend"))
    on_gpu(7, 0)
    assert Sm7xCudaPlatform.get_attn_backend_cls(None, selector(), 32) == "vllm.default.Backend"
    assert any("sm7x-fa2-sm70" in r.getMessage() for r in sm7x_log)


def test_custom_on_ampere_is_refused_by_vllm(on_gpu, fa2_libraries, custom_backend_clear):
    """--attention-backend CUSTOM on 8.0: vLLM's own check of the selected backend refuses
    it, saying why (real vLLM code path)."""
    plugin.register()
    on_gpu(8, 0)
    with pytest.raises(ValueError, match="compute capability not supported"):
        Sm7xCudaPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, selector(), 32)


@pytest.mark.parametrize("cap, ok", [((7, 0), True), ((7, 5), True), ((7, 2), False),
                                     ((8, 0), False), ((9, 0), False), ((6, 1), False)])
def test_supports_compute_capability(cap, ok):
    assert Backend.supports_compute_capability(DeviceCapability(*cap)) is ok


# the test aid SM7X_VLLM_TEST_ANY_GPU (README): other GPUs, only with the library forced


def _no_vllm_choice(cls, *a, **k):
    pytest.fail("vLLM's choice was asked")


def test_test_aid_runs_the_forced_library_on_newer_gpus(on_gpu, fa2_libraries,
                                                         custom_backend_clear, sm7x_log,
                                                         monkeypatch):
    monkeypatch.setenv(plugin.TEST_ANY_GPU_ENV, "1")
    monkeypatch.setenv(plugin.FORCE_ENV, "sm75")
    monkeypatch.setattr(CudaPlatform, "get_attn_backend_cls", classmethod(_no_vllm_choice))
    on_gpu(9, 0)
    assert Backend.supports_compute_capability(DeviceCapability(9, 0))
    assert Sm7xCudaPlatform.get_attn_backend_cls(None, selector(), 32) == plugin.BACKEND
    assert any("Using the sm7x FlashAttention-2" in r.getMessage() and "9.0" in r.getMessage()
               for r in sm7x_log)
    monkeypatch.setattr(plugin, "_nvml_capabilities", lambda: [(9, 0)])
    assert plugin.platform_plugin() == plugin.PLATFORM
    assert not Backend.supports_compute_capability(DeviceCapability(6, 1))
    monkeypatch.delenv(plugin.TEST_ANY_GPU_ENV)  # without the aid: refused again
    assert plugin.platform_plugin() is None
    assert not Backend.supports_compute_capability(DeviceCapability(9, 0))


def test_test_aid_needs_the_forced_library(on_gpu, fa2_libraries, custom_backend_clear,
                                           sm7x_log, monkeypatch):
    monkeypatch.setenv(plugin.TEST_ANY_GPU_ENV, "1")
    monkeypatch.delenv(plugin.FORCE_ENV, raising=False)
    assert not Backend.supports_compute_capability(DeviceCapability(9, 0))
    monkeypatch.setattr(plugin, "_nvml_capabilities", lambda: [(9, 0)])
    assert plugin.platform_plugin() is None
    assert any("SM7X_FA2_FORCE=sm75" in r.getMessage() for r in sm7x_log)
    plugin.register()
    on_gpu(9, 0)
    with pytest.raises(ValueError, match="SM7X_FA2_FORCE=sm75"):
        Sm7xCudaPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, selector(), 32)


def test_test_aid_forced_library_must_be_installed(on_gpu, custom_backend_clear, monkeypatch):
    from sm7x import _select

    monkeypatch.setattr(_select, "library_path", lambda arch: "x" if arch == "sm75" else None)
    monkeypatch.setenv(plugin.TEST_ANY_GPU_ENV, "1")
    monkeypatch.setenv(plugin.FORCE_ENV, "sm70")
    plugin.register()
    on_gpu(9, 0)
    with pytest.raises(ValueError, match="sm7x-fa2-sm70"):
        Sm7xCudaPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, selector(), 32)


def test_backend_declarations():
    assert Backend.supported_dtypes == [F16]
    assert set(Backend.supported_kv_cache_dtypes) == {"auto", "float16", "fp8", "fp8_e4m3",
                                                      "fp8_e5m2", "int8_per_token_head"}
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head"):
        assert Backend.supports_kv_cache_dtype(name)
    assert not Backend.supports_kv_cache_dtype("fp8_per_token_head")
    # sm7x.ops.reshape_and_cache writes with one scale per tensor
    assert not Backend.supports_per_head_quant_scales()
    assert Backend.supports_sliding_window()
    assert Backend.supports_sink() and not Backend.is_mla()
    assert Backend.forward_includes_kv_cache_update is False
    assert Backend.supports_block_size(16) and Backend.supports_block_size(48)
    assert not Backend.supports_block_size(8)
    sizes = Backend.get_supported_head_sizes()
    assert 128 in sizes and 512 in sizes and 100 not in sizes and 520 not in sizes
    from vllm.v1.attention.backend import AttentionCGSupport
    assert Builder.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_BATCH


# ---------------------------------------------------------------------------------------
# the impl's configuration checks


def impl(**kw):
    args = dict(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None)
    args.update(kw)
    return Impl(**args)


@pytest.mark.parametrize("change, exc, match", [
    (dict(kv_cache_dtype="fp8_per_token_head"), ValueError, "--kv-cache-dtype auto, fp8"),
    (dict(kv_cache_dtype="bfloat16"), ValueError, "--kv-cache-dtype auto"),
    (dict(alibi_slopes=[1.0] * 8), NotImplementedError, "ALiBi"),
    (dict(sinks=torch.zeros(4)), ValueError, r"one logit per query head \[8\]"),
    (dict(attn_type="encoder_only"), NotImplementedError, "decoder"),
    (dict(head_size=100), ValueError, "head size 100"),
    (dict(num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
])
def test_impl_refuses(change, exc, match):
    with pytest.raises(exc, match=match):
        impl(**change)


def test_impl_refuses_bf16_model_naming_the_flag(monkeypatch):
    import sm7x.integrations.vllm.backend as be

    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16))
    monkeypatch.setattr(be, "get_current_vllm_config_or_none", lambda: cfg)
    with pytest.raises(ValueError, match="--dtype float16"):
        impl()


def test_impl_options():
    i = impl(sliding_window=4096, logits_soft_cap=30.0)
    assert i.sliding_window == (4095, 0) and i.logits_soft_cap == 30.0
    j = impl()
    assert j.sliding_window == (-1, -1) and j.logits_soft_cap == 0.0


# ---------------------------------------------------------------------------------------
# the KV cache as vLLM allocates it


def int8_spec(block_size, hk, d):
    """vLLM's spec of an int8_per_token_head layer, as its Attention layer makes it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    return FullAttentionSpec(block_size=block_size, num_kv_heads=hk, head_size=d,
                             dtype=torch.int8, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)


def vllm_kv_cache(num_blocks, block_size, hk, d, layout="NHD", monkeypatch=None,
                  dtype=F16, kv_cache_dtype="auto"):
    """One layer's cache the way vLLM's model runner makes it: memory in the physical
    order, handed to the backend as the logical [blocks, heads, tokens, content] view.
    0.26 asks the backend for shape and order; 0.33's logical shape is fixed (its content
    bytes from the backend's customize_spec) and the layout (LBNHC = NHD by default)
    decides the order."""
    if V026:
        if monkeypatch is not None:
            import vllm.v1.attention.backends.utils as u
            monkeypatch.setattr(u, "get_kv_cache_layout", lambda: layout)
        shape = Backend.get_kv_cache_shape(num_blocks, block_size, hk, d, kv_cache_dtype)
        order = Backend.get_kv_cache_stride_order()
    else:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        assert Backend.supported_kv_cache_layouts() is None  # any layout
        content = 2 * d
        if kv_cache_dtype == "int8_per_token_head":
            content = Backend.customize_spec(int8_spec(block_size, hk, d)).state_content_bytes
        shape = (num_blocks, hk, block_size, content)
        order = (KVCacheLayout.LBNHC if layout == "NHD" else KVCacheLayout.LBHNC).layer_view_order
    physical = torch.zeros([shape[i] for i in order], dtype=dtype)
    inverse = [order.index(i) for i in range(4)]
    kv = physical.permute(*inverse)
    assert kv.shape == shape
    return kv


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_write_through_slot_mapping(layout, monkeypatch):
    pytest.importorskip("sm7x._core_loader").load()
    nb, bs, hk, d = 6, 16, 2, 64
    kv = vllm_kv_cache(nb, bs, hk, d, layout, monkeypatch)
    if layout == "NHD":
        assert kv.stride() == (bs * hk * 2 * d, 2 * d, hk * 2 * d, 1)
    g = torch.Generator().manual_seed(0)
    # a qkv buffer as vLLM's projections leave it: key/value are column slices of it
    qkv = torch.randn(12, (8 + 2 * hk) * d, generator=g).to(F16)
    key = qkv[:, 8 * d:(8 + hk) * d].view(12, hk, d)
    value = qkv[:, (8 + hk) * d:].view(12, hk, d)
    slots = torch.tensor([5, 17, 18, 95, -1, 40, 41, 0, 80, -1], dtype=torch.int64)
    impl().do_kv_cache_update(None, key, value, kv, slots)  # 12 rows, 10 slots
    want = torch.zeros(nb, hk, bs, 2 * d, dtype=F16)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s // bs, :, s % bs, :d] = key[t]
            want[s // bs, :, s % bs, d:] = value[t]
    assert torch.equal(kv, want)


# ---------------------------------------------------------------------------------------
# metadata from vLLM's CommonAttentionMetadata


def common_metadata(query_lens, seq_lens, block_size=16, max_blocks=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    n = int(qsl[-1])
    bt = torch.randperm(len(query_lens) * max_blocks, generator=g).to(torch.int32).view(
        len(query_lens), max_blocks)
    slot = []
    for r, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        for p in range(sl - ql, sl):
            slot.append(int(bt[r, p // block_size]) * block_size + p % block_size)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(query_lens),
        num_actual_tokens=n, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=bt, slot_mapping=torch.tensor(slot, dtype=torch.int64))


@pytest.fixture(autouse=True)
def sm7x_platform(monkeypatch):
    """vLLM's current platform is the sm7x one on a T4 (capability 7.5 unless a test's
    on_gpu says otherwise; vLLM's modules ask at import), so vLLM's config objects and
    layers can be made here."""
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "_current_platform", Sm7xCudaPlatform())
    monkeypatch.setattr(Sm7xCudaPlatform, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(7, 5)))


def builder(**over):
    from vllm.config import VllmConfig

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=F16)
    b = Builder(spec, ["model.layers.0.self_attn.attn"], VllmConfig(), torch.device("cpu"))
    for k, v in over.items():
        setattr(b, k, v)
    return b


def test_metadata_from_common_metadata(on_gpu):
    on_gpu(7, 5)
    m = common_metadata([5, 1, 1, 3], [5, 20, 9, 40])  # prefill, 2 decodes, a chunk
    md = builder().build(0, m)
    assert isinstance(md, _compute.Sm7xAttentionMetadata)
    assert md.query_start_loc is m.query_start_loc and md.seq_lens is m.seq_lens
    assert md.block_table is m.block_table_tensor and md.slot_mapping is m.slot_mapping
    assert (md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (10, 5, 40)
    assert md.plan is None  # CPU: no CUDA graphs


def test_decode_batches_get_one_cached_plan(monkeypatch):
    calls = []
    monkeypatch.setattr(_compute, "make_plan", lambda *a: calls.append(a) or object())
    b = builder(plan_decodes=True, max_graph_tokens=512, max_model_len=4096, num_heads=8)
    decode = common_metadata([1, 1, 1], [7, 30, 2])
    md1, md2 = b.build(0, decode), b.build(0, common_metadata([1, 1, 1], [50, 3, 9]))
    assert md1.plan is not None and md2.plan is md1.plan  # one plan per batch shape
    assert md1.max_seq_len == 4096  # the plan's key bound, fixed in the graph
    assert calls == [(3, 1, 4096, 8, 2, 64, torch.device("cpu"), "auto")]
    assert b.build(0, common_metadata([4, 1], [4, 9])).plan is None  # a prefill: no graph
    b.max_graph_tokens = 2
    assert b.build(0, decode).plan is None  # larger than vLLM captures


def test_non_causal_and_cascade_refused():
    m = common_metadata([2, 1], [2, 5])
    with pytest.raises(NotImplementedError, match="causal"):
        builder().build(0, m.__class__(**{**m.__dict__, "causal": False}))
    with pytest.raises(NotImplementedError, match="cascade"):
        builder().build(16, m)


# ---------------------------------------------------------------------------------------
# forward, with sm7x.fa2's kernel op replaced by a float32 reference


def reference(q, k, v, scale, left=-1, right=0, softcap=0.0, sinks=None):
    """float32 causal (bottom-right) GQA attention of q [sq, h, d] over k/v [sk, hk, d];
    sinks [h]: one more softmax column per head with no value (gpt-oss)."""
    sq, h, _ = q.shape
    sk, hk = k.shape[0], k.shape[1]
    k = k.repeat_interleave(h // hk, dim=1)
    v = v.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    ok = j <= i + (right if right >= 0 else sk)
    if left >= 0:
        ok &= j >= i - left
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None, None].expand(h, sq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p[..., :sk], v)


@pytest.fixture
def reference_kernel(monkeypatch):
    """sm7x.fa2's serving op replaced by the float64 CPU stand-in (tests/unit/
    serving_cpu_ops.py: the paged K/V views read through block_table as the kernels are
    handed them, 8-bit codes times their descales)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import serving_cpu_ops

    return serving_cpu_ops.use(monkeypatch)


@pytest.mark.parametrize("window, softcap, sinks, d", [
    (None, None, False, 64), (24, None, False, 64), (None, 30.0, False, 64),
    (None, None, True, 64), (24, None, True, 64), (None, None, False, 512)])
def test_forward_mixed_batch_gqa(reference_kernel, monkeypatch, on_gpu, window, softcap, sinks,
                                 d):
    """A batch mixing a prefill, decodes and prefill chunks over a cached prefix: the
    context is written first (earlier steps), then the step's new tokens through
    do_kv_cache_update, then forward; compared with attention over the full sequences.
    With sinks as gpt-oss has them (its layers alternate sliding window and full), and at
    head size 512 (Gemma 4's full-attention layers)."""
    pytest.importorskip("sm7x._core_loader").load()
    on_gpu(7, 5)
    h, hk, bs = 8, 2, 16
    query_lens, seq_lens = [17, 1, 1, 9, 1], [17, 40, 3, 70, 16]
    m = common_metadata(query_lens, seq_lens, block_size=bs, max_blocks=5, seed=3)
    g = torch.Generator().manual_seed(1)
    keys = [torch.randn(n, hk, d, generator=g).to(F16) for n in seq_lens]
    vals = [torch.randn(n, hk, d, generator=g).to(F16) for n in seq_lens]
    qs = [torch.randn(ql, h, d, generator=g).to(F16) for ql in query_lens]
    kv = vllm_kv_cache(m.block_table_tensor.numel(), bs, hk, d, "NHD", monkeypatch)
    sink_logits = (torch.randn(h, generator=g) * 2).to(F16) if sinks else None
    layer = impl(num_heads=h, num_kv_heads=hk, head_size=d, scale=d ** -0.5,
                 sliding_window=window, logits_soft_cap=softcap, sinks=sink_logits)
    bt = m.block_table_tensor
    ctx_k = torch.cat([k[: n - ql] for k, n, ql in zip(keys, seq_lens, query_lens)])
    ctx_v = torch.cat([v[: n - ql] for v, n, ql in zip(vals, seq_lens, query_lens)])
    ctx_slots = torch.tensor([int(bt[r, p // bs]) * bs + p % bs
                              for r, (n, ql) in enumerate(zip(seq_lens, query_lens))
                              for p in range(n - ql)], dtype=torch.int64)
    layer.do_kv_cache_update(None, ctx_k, ctx_v, kv, ctx_slots)
    new_k = torch.cat([k[n - ql:] for k, n, ql in zip(keys, seq_lens, query_lens)])
    new_v = torch.cat([v[n - ql:] for v, n, ql in zip(vals, seq_lens, query_lens)])
    pad = 3  # vLLM pads the token count of a batch; slot_mapping stays unpadded
    query = torch.cat([torch.cat(qs), torch.zeros(pad, h, d, dtype=F16)])
    new_k = torch.cat([new_k, torch.zeros(pad, hk, d, dtype=F16)])
    new_v = torch.cat([new_v, torch.zeros(pad, hk, d, dtype=F16)])
    layer.do_kv_cache_update(None, new_k, new_v, kv, m.slot_mapping)
    md = builder().build(0, m)
    output = torch.full((query.shape[0], h, d), float("nan"), dtype=F16)
    layer.forward(None, query, new_k, new_v, kv, md, output)
    assert reference_kernel.calls == 1
    left = -1 if window is None else window - 1
    want = torch.cat([reference(q.float(), k.float(), v.float(), d ** -0.5, left, 0, softcap or 0.0,
                                sink_logits) for q, k, v in zip(qs, keys, vals)])
    err = (output[: m.num_actual_tokens].float() - want).abs().max().item()
    assert err < 2e-3, err
    assert torch.isnan(output[m.num_actual_tokens:]).all()  # padding rows untouched


def _forward_over_a_quantized_cache(monkeypatch, kv_cache_dtype, cache_dtype, layer,
                                    layout="NHD"):
    """A batch (one prefill, two decodes over a cached prefix) written through
    do_kv_cache_update into vLLM's cache of kv_cache_dtype, then forward: (the queries, keys,
    values per request, the output rows per request, head dim)."""
    h, hk, d, bs = 8, 2, 64, 16
    query_lens, seq_lens = [5, 1, 1], [5, 40, 23]
    m = common_metadata(query_lens, seq_lens, block_size=bs, max_blocks=3, seed=5)
    g = torch.Generator().manual_seed(2)
    keys = [torch.randn(n, hk, d, generator=g).to(F16) * 3 for n in seq_lens]
    vals = [torch.randn(n, hk, d, generator=g).to(F16) for n in seq_lens]
    qs = [torch.randn(ql, h, d, generator=g).to(F16) for ql in query_lens]
    kv = vllm_kv_cache(m.block_table_tensor.numel(), bs, hk, d, layout, monkeypatch,
                       dtype=cache_dtype, kv_cache_dtype=kv_cache_dtype)
    layer_impl = impl(num_heads=h, num_kv_heads=hk, head_size=d, scale=d ** -0.5,
                      kv_cache_dtype=kv_cache_dtype)
    bt = m.block_table_tensor
    slots = torch.tensor([int(bt[r, p // bs]) * bs + p % bs
                          for r, n in enumerate(seq_lens) for p in range(n)], dtype=torch.int64)
    layer_impl.do_kv_cache_update(layer, torch.cat(keys), torch.cat(vals), kv, slots)
    md = builder().build(0, m)
    query = torch.cat(qs)
    output = torch.full((query.shape[0], h, d), float("nan"), dtype=F16)
    layer_impl.forward(layer, query, None, None, kv, md, output)
    last = [0, *itertools.accumulate(query_lens)]
    outs = [output[last[i]:last[i + 1]].float() for i in range(len(qs))]
    return qs, keys, vals, outs, d


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_forward_over_an_fp8_cache(reference_kernel, monkeypatch, on_gpu, kv_cache_dtype):
    """--kv-cache-dtype fp8*: vLLM allocates the cache as uint8 and gives each layer float32
    _k_scale / _v_scale; do_kv_cache_update stores codes of x / scale (sm7x.ops, CPU here)
    and forward hands the kernel op the codes, the format and the scales: the result is
    attention over the dequantized cache, and within the format's error of the fp16 one."""
    pytest.importorskip("sm7x._core_loader").load()
    on_gpu(7, 5)
    layer = types.SimpleNamespace(_k_scale=torch.tensor(0.05), _v_scale=torch.tensor(0.01))
    qs, keys, vals, outs, d = _forward_over_a_quantized_cache(monkeypatch, kv_cache_dtype,
                                                              torch.uint8, layer)
    assert reference_kernel.calls == 1 and reference_kernel.kv_format == (
        2 if kv_cache_dtype == "fp8_e5m2" else 1)
    codes = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    big = torch.finfo(codes).max

    def stored(x, scale):  # what the cache holds, dequantized
        return (x.float() / scale).clamp(-big, big).to(codes).float() * scale

    for q, k, v, got in zip(qs, keys, vals, outs):
        want = reference(q.float(), stored(k, 0.05), stored(v, 0.01), d ** -0.5)
        assert (got - want).abs().max().item() < 2e-3
        exact = reference(q.float(), k.float(), v.float(), d ** -0.5)
        # the format's error (2^-mantissa of the largest value), not a lost scale
        bound = 2.0 ** -(2 if kv_cache_dtype == "fp8_e5m2" else 3) * v.float().abs().max()
        assert (got - exact).abs().max().item() < bound


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_forward_over_an_int8_cache(reference_kernel, monkeypatch, on_gpu, layout):
    """--kv-cache-dtype int8_per_token_head: vLLM gives the backend an int8 cache whose
    (kv head, slot) rows are [K codes | K scale | V codes | V scale] (0.26: the backend's
    get_kv_cache_shape; 0.33: its customize_spec; the scale bytes are in vLLM's page size
    either way); do_kv_cache_update stores each row's codes and scale (sm7x.ops, CPU here)
    and forward hands the kernel op the codes and the scale views: attention over the
    dequantized cache, within int8's error of the fp16 one."""
    pytest.importorskip("sm7x._core_loader").load()
    on_gpu(7, 5)
    bs, hk, d = 16, 2, 64
    assert vllm_kv_cache(4, bs, hk, d, layout, monkeypatch, dtype=torch.int8,
                         kv_cache_dtype="int8_per_token_head").shape[-1] == 2 * (d + 4)
    spec = int8_spec(bs, hk, d)  # vLLM's page size holds the padded rows exactly
    spec = spec if V026 else Backend.customize_spec(spec)
    assert spec.page_size_bytes == bs * hk * 2 * (d + 4)
    layer = types.SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    qs, keys, vals, outs, d = _forward_over_a_quantized_cache(
        monkeypatch, "int8_per_token_head", torch.int8, layer, layout)
    assert reference_kernel.calls == 1 and reference_kernel.kv_format == 3

    def stored(x):  # what the cache holds, dequantized: row codes x row scale
        s = (x.float().abs().amax(-1) / 127).clamp(min=1e-6)
        q = x.float() * (torch.ones_like(s) / s)[..., None]  # the writer's rounding
        q = torch.where(q >= 0, q + 0.5, q - 0.5).clamp(-128, 127).trunc()
        return q * s[..., None]

    for q, k, v, got in zip(qs, keys, vals, outs):
        want = reference(q.float(), stored(k), stored(v), d ** -0.5)
        assert (got - want).abs().max().item() < 2e-3
        exact = reference(q.float(), k.float(), v.float(), d ** -0.5)
        assert (got - exact).abs().max().item() < v.float().abs().max() / 64


def test_profiling_run_without_metadata():
    out = torch.full((4, 8, 64), 7.0, dtype=F16)
    assert impl().forward(None, out, None, None, torch.empty(0), None, out) is out
    assert (out == 0).all()


def test_fp8_cache_of_the_wrong_dtype_is_refused(on_gpu):
    kv = torch.zeros(2, 2, 16, 128, dtype=F16)
    md = builder().build(0, common_metadata([1], [3]))
    layer = types.SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    with pytest.raises(TypeError, match="stores 1-byte codes"):
        impl(kv_cache_dtype="fp8").forward(layer, torch.zeros(1, 8, 64, dtype=F16), None,
                                           None, kv, md, torch.zeros(1, 8, 64, dtype=F16))


def test_forward_refuses_bf16_cache(on_gpu):
    kv = torch.zeros(2, 2, 16, 128, dtype=torch.bfloat16)
    md = builder().build(0, common_metadata([1], [3]))
    with pytest.raises(TypeError, match="--kv-cache-dtype auto"):
        impl().forward(None, torch.zeros(1, 8, 64, dtype=F16), None, None, kv, md,
                       torch.zeros(1, 8, 64, dtype=F16))


def test_importing_the_entry_point_module_is_light():
    import subprocess

    code = ("import sys, sm7x.integrations.vllm; "
            "assert not {'torch', 'vllm'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------
# vision-tower attention (MMEncoderAttention, replaced through vLLM's out-of-tree CustomOp
# registry)


@pytest.fixture
def encoder_registry():
    """MMEncoderAttention's out-of-tree entry cleared before and after (process-global)."""
    from vllm.model_executor.custom_op import op_registry_oot

    op_registry_oot.pop("MMEncoderAttention", None)
    yield op_registry_oot
    op_registry_oot.pop("MMEncoderAttention", None)


def _encoder_layer(heads, head_size, dtype=F16):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import MMEncoderAttention

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # vLLM builds the model under its dtype
    try:
        with set_current_vllm_config(VllmConfig()):
            return MMEncoderAttention(heads, head_size)
    finally:
        torch.set_default_dtype(old)


def test_encoder_attention_is_sm7x_where_the_platform_is(encoder_registry, custom_backend_clear,
                                                        monkeypatch):
    import vllm.platforms
    from sm7x.integrations.vllm.encoder import Sm7xMMEncoderAttention

    plugin.register()  # the autouse fixture's platform: sm7x on a T4
    layer = _encoder_layer(16, 80)
    assert type(layer) is Sm7xMMEncoderAttention and layer.sm7x_reason is None
    plugin.register()  # idempotent
    encoder_registry.pop("MMEncoderAttention")
    monkeypatch.setattr(vllm.platforms, "_current_platform", CudaPlatform())
    plugin.register()  # vLLM's own platform (an Ampere node): vLLM's layer stays
    assert "MMEncoderAttention" not in encoder_registry


@pytest.mark.parametrize("dtype, head_size, why", [(torch.bfloat16, 80, "--dtype float16"),
                                                   (F16, 100, "head size 100")])
def test_encoder_attention_says_why_not(encoder_registry, custom_backend_clear, dtype,
                                        head_size, why):
    plugin.register()
    assert why in _encoder_layer(16, head_size, dtype).sm7x_reason


@pytest.mark.parametrize("head_size", [64, 72, 80])
def test_encoder_forward_matches_vllms_sdpa(encoder_registry, custom_backend_clear,
                                            monkeypatch, head_size):
    """Qwen2.5-VL's call: the patches of several images (and windows) packed in one row,
    bounded by cu_seqlens, hidden [1, tokens, heads * head_size]; sm7x's path (its library
    replaced by the float32 CPU stand-in) against the layer's own SDPA path."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import fa2_cpu_ops

    fa2_cpu_ops.use(monkeypatch)
    monkeypatch.setenv("SM7X_FA2_DENSE", "prefill")  # the stand-in has the prefill op only
    fa2_cpu_ops.CALLS.clear()
    plugin.register()
    heads, lens = 4, [64, 1, 37, 128]
    layer = _encoder_layer(heads, head_size)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, sum(lens), heads * head_size, generator=g).to(F16)
               for _ in range(3))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    from vllm.model_executor.layers.attention import mm_encoder_attention
    from vllm.v1.attention.ops import vit_attn_wrappers

    # vLLM's SDPA path as a plain function (its op is registered for CUDA only)
    monkeypatch.setattr(mm_encoder_attention, "vit_torch_sdpa_wrapper",
                        vit_attn_wrappers.torch_sdpa_wrapper)
    with torch.no_grad():
        got = layer.forward_cuda(q, k, v, cu_seqlens=cu, max_seqlen=torch.tensor(0))
        want = layer.forward_native(q, k, v, cu_seqlens=cu)
    assert got.shape == want.shape == (1, sum(lens), heads * head_size)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
    assert [c["op"] for c in fa2_cpu_ops.CALLS] == ["fwd_varlen"]
    assert fa2_cpu_ops.CALLS[0]["max_q"] == max(lens)  # read from cu_seqlens (vLLM passed 0)
    with torch.no_grad():  # a model that passes the longest length as an int
        again = layer.forward_cuda(q, k, v, cu_seqlens=cu, max_seqlen=max(lens))
    assert torch.equal(again, got) and fa2_cpu_ops.CALLS[-1]["max_q"] == max(lens)


# ---------------------------------------------------------------------------------------
# Gemma 2/3 in float16 with a float32 residual stream (SM7X_VLLM_FP32_RESIDUAL=1)


@pytest.fixture
def gemma_registry(monkeypatch):
    """GemmaRMSNorm's out-of-tree entry and vLLM's float16 refusals restored afterwards."""
    from vllm.config import model as model_config
    from vllm.model_executor.custom_op import op_registry_oot

    monkeypatch.setattr(model_config, "_FLOAT16_NOT_SUPPORTED_MODELS",
                        dict(model_config._FLOAT16_NOT_SUPPORTED_MODELS))
    op_registry_oot.pop("GemmaRMSNorm", None)
    yield op_registry_oot
    op_registry_oot.pop("GemmaRMSNorm", None)
    op_registry_oot.pop("MMEncoderAttention", None)


def _gemma_norm(hidden):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    with set_current_vllm_config(VllmConfig()):
        norm = GemmaRMSNorm(hidden)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, hidden))
    return norm


def test_fp32_residual_is_opt_in(gemma_registry, custom_backend_clear, monkeypatch):
    from vllm.config.model import _check_valid_dtype

    plugin.register()
    with pytest.raises(ValueError, match="does not support float16"):
        _check_valid_dtype("gemma2", F16)  # vLLM's refusal stands without the flag
    assert "GemmaRMSNorm" not in gemma_registry
    monkeypatch.setenv(plugin.FP32_RESIDUAL_ENV, "1")
    plugin.register()
    for model_type in ("gemma2", "gemma3", "gemma3_text"):
        _check_valid_dtype(model_type, F16)
    with pytest.raises(ValueError, match="does not support float16"):
        _check_valid_dtype("glm4", F16)  # not a GemmaRMSNorm model: still refused
    from sm7x.integrations.vllm.fp32_residual import Sm7xGemmaRMSNorm

    assert type(_gemma_norm(16)) is Sm7xGemmaRMSNorm


def test_fp32_residual_stream_does_not_overflow(gemma_registry, custom_backend_clear,
                                                monkeypatch):
    """Three fused adds whose stream passes 65504: vLLM's GemmaRMSNorm in fp16 gives inf/NaN,
    sm7x's keeps it in float32 and matches a float32 computation."""
    monkeypatch.setenv(plugin.FP32_RESIDUAL_ENV, "1")
    plugin.register()
    norm = _gemma_norm(64)
    g = torch.Generator().manual_seed(0)
    sign = torch.randn(3, 64, generator=g).sign()  # each element's stream grows one way
    adds = [(sign * (torch.rand(3, 64, generator=g) * 3e4 + 2.5e4)).half() for _ in range(3)]
    residual = torch.zeros(3, 64, dtype=F16)
    ref_stream = torch.zeros(3, 64)
    for a in adds:
        out, residual = norm(a, residual)
        ref_stream = ref_stream + a.float()
        ref = ref_stream * torch.rsqrt(ref_stream.pow(2).mean(-1, keepdim=True) + 1e-6) * (
            1.0 + norm.weight.float())
        assert out.dtype == F16 and residual.dtype == torch.float32
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-3)
        torch.testing.assert_close(residual, ref_stream)
    assert ref_stream.abs().max() > 65504  # the case is one fp16 cannot hold
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    plain = GemmaRMSNorm.forward_native(norm, adds[0], torch.zeros(3, 64, dtype=F16))[1]
    for a in adds[1:]:
        plain = GemmaRMSNorm.forward_native(norm, a, plain)[1]
    assert not torch.isfinite(plain).all()  # vLLM's own fused add in fp16 overflows


def test_fp32_residual_refuses_pipeline_parallelism(monkeypatch):
    monkeypatch.setenv(plugin.FP32_RESIDUAL_ENV, "1")
    monkeypatch.setattr(CudaPlatform, "check_and_update_config", classmethod(lambda cls, c: None))
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        Sm7xCudaPlatform.check_and_update_config(config)
    config.parallel_config.pipeline_parallel_size = 1
    Sm7xCudaPlatform.check_and_update_config(config)
