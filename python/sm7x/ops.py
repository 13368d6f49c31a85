"""sm7x core ops: fused inference kernels for CPU and CUDA (``torch.ops.sm7x.*``).

These wrap the operators of ``_core.abi3.so`` (package sm7x-core), which is loaded on
first use, once per process, from the installed package or ``$SM7X_LIBRARY_PATH``
(see :mod:`sm7x._core_loader`). The semantics follow vLLM's ``_C`` ops:

- ``rms_norm(x, weight, eps, out=None)``: ``out = x / sqrt(mean(x**2) + eps) * weight``
- ``fused_add_rms_norm(x, residual, weight, eps)``: in place, ``residual += x`` and
  ``x = rms_norm(residual) * weight``; ``residual`` in ``x``'s dtype, or float32 (the
  residual stream kept in fp32, past fp16's 65504)
- ``silu_and_mul(x, out=None)``: ``x = [gate | up]`` on the last dim,
  ``out = silu(gate) * up``
- ``rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)``: in
  place on query/key, NeoX (rotate halves) or GPT-J (interleaved pairs) style, partial
  rotary when ``cos_sin_cache.shape[1] < head_size``
- ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
  k_scale, v_scale)``: scatter ``[tokens, kv_heads, head_size]`` into paged caches
  ``[blocks, block_size, kv_heads, head_size]`` at ``slot = block * block_size + offset``;
  negative slots are skipped; fp8 caches (E4M3, E5M2) hold ``round(x / scale)``, int8
  caches (``"int8_per_token_head"``) ``round(x / s)`` with ``s`` per row, into scale caches

dtypes: float16, bfloat16 and float32 (all arithmetic in float32) on CPU and CUDA.

Indices on the device (``positions``, ``slot_mapping``) are checked against the cache on
CPU. On CUDA the kernels skip a token whose index is outside the cache (checking costs a
stream sync per call, which serving cannot pay); set ``SM7X_CHECK_INDICES=1`` to check
them there too, with one sync per call: a ValueError naming the index, where the CPU op
raises (not while a CUDA graph is captured, where a sync is not allowed).
Inputs may be row slices (last dim contiguous, rows of one stride); anything else is
refused with a message that says to call ``.contiguous()``. The ops have fake
implementations, so they work under ``torch.compile``.

This module imports torch; ``import sm7x`` does not import it.
"""

from __future__ import annotations

import threading
from typing import Optional

from . import _targets

try:
    import torch
except ImportError as exc:  # sm7x-core runs in any torch from the floor up, pulls in none
    raise ImportError(
        f"sm7x.ops needs PyTorch >= {_targets.torch_min()}, which is not installed in this "
        "environment: conda install pytorch (or: pixi add pytorch)"
    ) from exc

from . import _args, _core_loader

__all__ = [
    "fused_add_rms_norm",
    "load_library",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int64, torch.int32)

_ready = False
_lock = threading.Lock()


def _register_fakes() -> None:
    # All ops mutate their (a!)/(b!) arguments and return nothing: the fakes only have
    # to exist (and re-check what is cheap on meta/fake tensors).
    def fake_rms_norm(out, x, weight, eps):
        torch._check(out.shape == x.shape, lambda: "sm7x.rms_norm: out must have x's shape")

    def fake_fused_add_rms_norm(x, residual, weight, eps):
        torch._check(residual.shape == x.shape,
                     lambda: "sm7x.fused_add_rms_norm: residual must have x's shape")

    def fake_silu_and_mul(out, x):
        return None

    def fake_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
        return None

    def fake_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                               kv_cache_dtype="auto", k_scale=None, v_scale=None,
                               k_scale_cache=None, v_scale_cache=None):
        return None

    for name, fn in (
        ("rms_norm", fake_rms_norm),
        ("fused_add_rms_norm", fake_fused_add_rms_norm),
        ("silu_and_mul", fake_silu_and_mul),
        ("rotary_embedding", fake_rotary_embedding),
        ("reshape_and_cache", fake_reshape_and_cache),
    ):
        try:
            torch.library.register_fake(f"{_core_loader.NAMESPACE}::{name}")(fn)
        except RuntimeError as exc:
            # A fake registered earlier (e.g. by a reloaded copy of this module) stays.
            if "already" not in str(exc):
                raise


def load_library() -> bool:
    """Loads the core library and registers the fake kernels (once; thread-safe).

    Called by every op; under torch.compile, dynamo runs it at trace time and treats it
    as a constant, so first use inside a compiled function causes no graph break (not
    even with fullgraph=True). Raises sm7x._core_loader.MissingCoreLibraryError when the
    library is not installed.
    """
    global _ready
    if _ready:
        return True
    with _lock:
        if not _ready:
            _core_loader.load()
            _register_fakes()
            _ready = True
    return True


# What torch.compiler.assume_constant_result(load_library) does (it sets this attribute,
# torch/_dynamo/decorators.py), without the decorator's import of torch._dynamo: that
# import made `import sm7x.ops` cost about 3 s on top of torch's own. Dynamo reads the mark
# when it traces a call (tests/unit/test_core_ops.py checks that a first call inside
# torch.compile(fullgraph=True) still causes no graph break).
load_library._dynamo_marked_constant = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------
# Cheap argument checks, done before C++ (which checks everything again).


def _tensor(name: str, t, op: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sm7x.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _float(name: str, t: torch.Tensor, op: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"sm7x.{op}: {name} has dtype {t.dtype}; supported: float16, bfloat16, float32 "
            f"(cast with .half(), .bfloat16() or .float())"
        )


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return repr(x) if x is None else type(x).__name__


def _same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, op: str,
          dtype: bool = True) -> None:
    """t on ref's device and (dtype: True) of ref's dtype."""
    if t.device != ref.device:
        raise ValueError(
            f"sm7x.{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; move all "
            f"tensors to one device"
        )
    if dtype and t.dtype != ref.dtype:
        raise ValueError(
            f"sm7x.{op}: {name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they "
            f"must match (cast {name} with .to({ref_name}.dtype))"
        )


def _last_contiguous(name: str, t: torch.Tensor, op: str) -> None:
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"sm7x.{op}: {name} (shape {tuple(t.shape)}, strides {t.stride()}) must have a "
            f"contiguous last dimension; call {name}.contiguous() first"
        )


def _bad_index(idx: torch.Tensor, limit: int, skip_negative: bool) -> Optional[str]:
    """'[i] = v' (the position and value) of the first index outside [0, limit) (negative ones
    allowed where the op skips them), or None; one host sync."""
    bad = (idx >= limit) if skip_negative else ((idx < 0) | (idx >= limit))
    if idx.numel() == 0 or not bool(bad.any()):
        return None
    flat = bad.flatten().nonzero()[0, 0]
    i = tuple(int(x) for x in torch.unravel_index(flat, idx.shape))
    return f"[{i[0] if len(i) == 1 else ', '.join(map(str, i))}] = {int(idx.flatten()[flat])}"


def _check_indices(op: str, name: str, idx: torch.Tensor, limit: int, what: str,
                   skip_negative: bool) -> None:
    """With SM7X_CHECK_INDICES set, on CUDA, outside CUDA-graph capture: _bad_index as a
    ValueError (the CPU op checks the same itself)."""
    if (idx.device.type != "cuda" or not _args.env_flag("SM7X_CHECK_INDICES", False)
            or torch.cuda.is_current_stream_capturing()):
        return
    bad = _bad_index(idx, limit, skip_negative)
    if bad is not None:
        raise ValueError(
            f"sm7x.{op}: {name}{bad} is outside {what} (valid: "
            f"{'negative to skip, or ' if skip_negative else ''}0 .. {limit - 1}; checked "
            f"because SM7X_CHECK_INDICES is set)"
        )


def _eps(eps, op: str) -> float:
    eps = _args.number(f"sm7x.{op}", "eps", eps)
    if not eps >= 0 or eps == float("inf"):
        raise ValueError(f"sm7x.{op}: eps must be a finite number >= 0, got {eps}")
    return eps


# ---------------------------------------------------------------------------------------
# Ops.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMS norm over the last dim: ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    ``x``: ``[..., hidden]``; ``weight``: ``[hidden]`` of x's dtype. Writes ``out``
    (allocated when None; may be ``x`` itself) and returns it.
    """
    op = "rms_norm"
    load_library()
    _tensor("x", x, op)
    _tensor("weight", weight, op)
    _float("x", x, op)
    _same("weight", weight, "x", x, op)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"sm7x.{op}: weight has shape {tuple(weight.shape)} but must be [hidden] = "
            f"[{x.shape[-1] if x.dim() else '?'}] for x of shape {tuple(x.shape)}"
        )
    _last_contiguous("x", x, op)
    eps = _eps(eps, op)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _tensor("out", out, op)
        _same("out", out, "x", x, op)
        if out.shape != x.shape:
            raise ValueError(
                f"sm7x.{op}: out has shape {tuple(out.shape)} but x has {tuple(x.shape)}"
            )
        _args.check_writes(f"sm7x.{op}", {"out": out}, {"x": x, "weight": weight},
                           in_place=(("out", "x"),))
    torch.ops.sm7x.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``.

    The sum is rounded to the residual's dtype before the norm (vLLM semantics). The
    residual is ``x``'s dtype, or float32: then the residual stream is accumulated and kept
    in fp32 and only ``x`` (the normalized output) is rounded to fp16, which is what keeps a
    model trained in bf16 from overflowing fp16's 65504 in its residual (the sum of every
    layer's output) on GPUs without bf16. Returns ``(x, residual)``, the same tensors.
    """
    op = "fused_add_rms_norm"
    load_library()
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        _tensor(name, t, op)
    _float("x", x, op)
    _same("residual", residual, "x", x, op, dtype=False)
    if residual.dtype not in (x.dtype, torch.float32):  # float32: the residual stream in fp32
        raise ValueError(
            f"sm7x.{op}: residual has dtype {residual.dtype} but x has {x.dtype}; it must "
            f"be x's dtype, or torch.float32 to keep the residual stream in fp32")
    _same("weight", weight, "x", x, op)
    if residual.shape != x.shape:
        raise ValueError(
            f"sm7x.{op}: residual has shape {tuple(residual.shape)} but x has "
            f"{tuple(x.shape)}; they must match"
        )
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"sm7x.{op}: weight has shape {tuple(weight.shape)} but must be [hidden] = "
            f"[{x.shape[-1] if x.dim() else '?'}] for x of shape {tuple(x.shape)}"
        )
    _last_contiguous("x", x, op)
    _last_contiguous("residual", residual, op)
    _args.check_writes(f"sm7x.{op}", {"x": x, "residual": residual}, {"weight": weight})
    torch.ops.sm7x.fused_add_rms_norm(x, residual, weight, _eps(eps, op))
    return x, residual


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x = [gate | up]`` on the last dim (``2 * d``): ``out = silu(gate) * up``, ``[..., d]``."""
    op = "silu_and_mul"
    load_library()
    _tensor("x", x, op)
    _float("x", x, op)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(
            f"sm7x.{op}: x has shape {tuple(x.shape)}; its last dimension must be even "
            f"(x = [gate | up])"
        )
    _last_contiguous("x", x, op)
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    if out is None:
        out = x.new_empty(shape)
    else:
        _tensor("out", out, op)
        _same("out", out, "x", x, op)
        if tuple(out.shape) != shape:
            raise ValueError(
                f"sm7x.{op}: out has shape {tuple(out.shape)} but must be {shape} for x of "
                f"shape {tuple(x.shape)}"
            )
        _args.check_writes(f"sm7x.{op}", {"out": out}, {"x": x})
    torch.ops.sm7x.silu_and_mul(out, x)
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor,
                     key: Optional[torch.Tensor], head_size: int,
                     cos_sin_cache: torch.Tensor,
                     is_neox: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rotary position embedding, in place on ``query`` and ``key`` (vLLM semantics).

    ``positions``: ``[tokens]`` (or ``[batch, seq]``) int64/int32; ``query``/``key``:
    ``positions.shape + [heads * head_size]`` or ``+ [heads, head_size]`` (key may be
    None, and may have fewer heads); ``cos_sin_cache``: ``[max_position, rot_dim]`` =
    ``[cos | sin]``, ``rot_dim <= head_size`` (only the first rot_dim dims rotate), of
    the query's dtype or float32. ``is_neox``: rotate halves; else GPT-J interleaved
    pairs. Returns ``(query, key)``. A position outside the cache is an error on CPU; on
    CUDA (checking would sync the stream) that token is left unrotated, unless
    ``SM7X_CHECK_INDICES=1`` (one sync per call; see the module docstring).
    """
    op = "rotary_embedding"
    load_library()
    _tensor("positions", positions, op)
    _tensor("query", query, op)
    _tensor("cos_sin_cache", cos_sin_cache, op)
    if positions.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"sm7x.{op}: positions has dtype {positions.dtype}; it must be int64 or int32"
        )
    _float("query", query, op)
    if cos_sin_cache.dtype not in (query.dtype, torch.float32):
        raise ValueError(
            f"sm7x.{op}: cos_sin_cache has dtype {cos_sin_cache.dtype}; it must be the "
            f"query's dtype ({query.dtype}) or float32"
        )
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != query.device:
            raise ValueError(
                f"sm7x.{op}: {name} is on {t.device} but query is on {query.device}; move "
                f"all tensors to one device"
            )
    head_size = _args.integer(f"sm7x.{op}", "head_size", head_size)
    is_neox = _args.flag(f"sm7x.{op}", "is_neox", is_neox)
    if head_size <= 0:
        raise ValueError(f"sm7x.{op}: head_size must be > 0, got {head_size}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(
            f"sm7x.{op}: cos_sin_cache must be [max_position, rot_dim], got shape "
            f"{tuple(cos_sin_cache.shape)}"
        )
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or not 0 < rot_dim <= head_size:
        raise ValueError(
            f"sm7x.{op}: cos_sin_cache.shape[1] (rot_dim = {rot_dim}) must be even, > 0 and "
            f"<= head_size ({head_size})"
        )
    _last_contiguous("query", query, op)
    if key is not None:
        _tensor("key", key, op)
        _same("key", key, "query", query, op)
        _last_contiguous("key", key, op)
    _args.check_writes(f"sm7x.{op}", {"query": query, "key": key},
                       {"positions": positions, "cos_sin_cache": cos_sin_cache})
    _check_indices(op, "positions", positions, cos_sin_cache.shape[0],
                   f"cos_sin_cache ({cos_sin_cache.shape[0]} positions)", skip_negative=False)
    torch.ops.sm7x.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    return query, key


# vLLM's kv_cache_dtype strings -> the float8 dtype of the codes ("fp8" is E4M3 there too)
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                    "fp8_e5m2": torch.float8_e5m2}


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_cache_dtype: str = "auto", k_scale: Optional[torch.Tensor] = None,
                      v_scale: Optional[torch.Tensor] = None,
                      k_scale_cache: Optional[torch.Tensor] = None,
                      v_scale_cache: Optional[torch.Tensor] = None) -> None:
    """Writes ``key``/``value`` ``[tokens, kv_heads, head_size]`` into the paged caches.

    Caches: ``[num_blocks, block_size, kv_heads, head_size]`` (the layout the FA2 kernels
    read). Token ``t`` goes to block ``slot // block_size``, offset ``slot % block_size``
    with ``slot = slot_mapping[t]``; tokens with a negative slot (padding) are skipped. A
    slot past the cache is an error on CPU; on CUDA (checking would sync the stream) that
    token is skipped too, unless ``SM7X_CHECK_INDICES=1`` (one sync per call; see the module
    docstring).

    ``kv_cache_dtype`` (vLLM's strings): ``"auto"``, caches of key's dtype; ``"fp8"`` /
    ``"fp8_e4m3"`` or ``"fp8_e5m2"``, 8-bit caches (torch.uint8, as vLLM allocates them, or
    the format's float8 dtype) holding ``round(x / k_scale)`` (``v_scale`` for values):
    nearest even, saturated to the format's largest finite value (448 / 57344; +-inf too),
    NaN kept, as vLLM writes them. The scales are float32 tensors of one element on the
    caches' device (read there, no sync). ``"int8_per_token_head"``: torch.int8 caches and
    a scale per cached row, written into ``k_scale_cache`` / ``v_scale_cache`` (float32
    ``[num_blocks, block_size, kv_heads]``, any strides: vLLM's are views into its cache):
    ``s = max(absmax(row) / 127, 1e-6)``, codes ``x * (1 / s)`` rounded half away from zero
    and clamped to [-128, 127], as vLLM's Triton writer does; non-finite values do not count
    in the absmax, +inf saturates to 127, -inf to -128 and NaN is stored as 0 (int8 has
    neither).
    """
    op = "reshape_and_cache"
    load_library()
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        _tensor(name, t, op)
    _float("key", key, op)
    _same("value", value, "key", key, op)
    if kv_cache_dtype == "auto":
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            _same(name, t, "key", key, op)
    elif kv_cache_dtype in FP8_CACHE_DTYPES:
        own = FP8_CACHE_DTYPES[kv_cache_dtype]
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if t.device != key.device:
                raise ValueError(f"sm7x.{op}: {name} is on {t.device} but key is on {key.device}; "
                                 f"move all tensors to one device")
            if t.dtype not in (torch.uint8, own):
                raise ValueError(f"sm7x.{op}: {name} has dtype {t.dtype} but kv_cache_dtype "
                                 f"{kv_cache_dtype!r} stores 1-byte codes: allocate it as torch.uint8 "
                                 f"or {own}")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1:
                raise ValueError(f"sm7x.{op}: {name} must be a float32 tensor of one element with "
                                 f"kv_cache_dtype {kv_cache_dtype!r} (the cache stores round(x / "
                                 f"{name})), got {_describe(s)}")
            if s.device != key_cache.device:
                raise ValueError(f"sm7x.{op}: {name} is on {s.device} but the caches are on "
                                 f"{key_cache.device}; move it there")
    elif kv_cache_dtype == "int8_per_token_head":
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if t.dtype != torch.int8:
                raise ValueError(f"sm7x.{op}: {name} has dtype {t.dtype} but kv_cache_dtype "
                                 f"'int8_per_token_head' stores int8 codes: allocate it as "
                                 f"torch.int8")
        for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise ValueError(f"sm7x.{op}: {name} must be a float32 tensor [num_blocks, "
                                 f"block_size, num_kv_heads] with kv_cache_dtype "
                                 f"'int8_per_token_head' (it receives each row's scale), got "
                                 f"{_describe(t)}")
    else:
        raise ValueError(f"sm7x.{op}: kv_cache_dtype {kv_cache_dtype!r} is not one of 'auto', "
                         f"{', '.join(map(repr, FP8_CACHE_DTYPES))}, 'int8_per_token_head'")
    if slot_mapping.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"sm7x.{op}: slot_mapping has dtype {slot_mapping.dtype}; it must be int64 or int32"
        )
    if slot_mapping.device != key.device:
        raise ValueError(
            f"sm7x.{op}: slot_mapping is on {slot_mapping.device} but key is on "
            f"{key.device}; move all tensors to one device"
        )
    if key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            f"sm7x.{op}: key and value must be [num_tokens, num_kv_heads, head_size], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(
            f"sm7x.{op}: key_cache and value_cache must be [num_blocks, block_size, "
            f"num_kv_heads, head_size], got {tuple(key_cache.shape)} and "
            f"{tuple(value_cache.shape)}"
        )
    written = {"key_cache": key_cache, "value_cache": value_cache}
    if kv_cache_dtype == "int8_per_token_head":
        written.update(k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)
    _args.check_writes(f"sm7x.{op}", written,
                       {"key": key, "value": value, "slot_mapping": slot_mapping})
    slots = key_cache.shape[0] * key_cache.shape[1]
    _check_indices(op, "slot_mapping", slot_mapping, slots,
                   f"the cache ({key_cache.shape[0]} blocks x {key_cache.shape[1]} = {slots} "
                   f"slots)", skip_negative=True)
    torch.ops.sm7x.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                     kv_cache_dtype, k_scale, v_scale, k_scale_cache,
                                     v_scale_cache)
