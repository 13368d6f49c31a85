"""The decode benchmark's timed runs, on the GPU: SDPA backends probed, paged and
contiguous caches built, one decode row per (batch, kv_len) and one chunked-prefill row
per batch timed against torch SDPA (and, with ``--kv-dtype``, sm7x over 8-bit copies of
the same paged cache), the device's copy bandwidth, and :func:`run`, the whole sweep."""

from __future__ import annotations

import gc
import os
import platform
import warnings
from typing import Callable

import torch

from ..core import _copy_fn, _time
from .arithmetic import (COPY_BYTES, DECODE_BASELINES, DEFAULT_BATCHES, DEFAULT_LENS,
                         DEFAULT_PREFILL_BATCHES, DEFAULT_SHAPE, KV8_TORCH_DTYPES, PAGE_SIZE,
                         PREFILL_NEW, PREFILL_PREFIX, Shape, cache_bytes, fits_budget, gbps,
                         kv8_descale, kv_bytes, num_pages, plan_splits, prefill_flops, ratio,
                         time_ratio, useful_bytes)
from .report import (DECODE_HEADER, PREFILL_HEADER, fill_frac_of_copy, finish,
                     format_decode_row, format_kv8_lines, format_prefill_row)


# ---------------------------------------------------------------------------------------
# GPU side.


def _sdpa():
    return torch.nn.functional.scaled_dot_product_attention


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return SDPBackend.FLASH_ATTENTION if "flash" in name else SDPBackend.EFFICIENT_ATTENTION


def _causal_lr(sq: int, sk: int):
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(sq, sk)


def _bottom_right_mask(sq: int, sk: int, device) -> torch.Tensor:
    """bool [sq, sk]: query i sees key j iff j <= i + sk - sq."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)


def _sdpa_call(kind: str, q, k, v, gqa: bool, mask=None, lr=None):
    """kind: decode (no mask: one query sees every key), mask (explicit boolean mask),
    lr (causal_lower_right bias)."""
    kw = {"enable_gqa": True} if gqa else {}
    if kind == "decode":
        return _sdpa()(q, k, v, **kw)
    if kind == "mask":
        return _sdpa()(q, k, v, attn_mask=mask, **kw)
    return _sdpa()(q, k, v, attn_mask=lr, **kw)


def _reference(q, k, v, causal: bool) -> torch.Tensor:
    """fp32 attention, [b, H, sq, D] from k/v [b, HK, sk, D] (probe sizes only)."""
    g = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(g, 1) for t in (k, v))
    s = q.float() @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~_bottom_right_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return s.softmax(-1) @ vf


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def probe_sdpa(name: str, kind: str, dev, shape: Shape = DEFAULT_SHAPE) -> dict:
    """Whether SDPA backend `name` runs call `kind` on GQA inputs, and how: {"gqa":
    "enable_gqa" | "expanded" | None, "note": why not / what}. Checked on a small shape
    against an fp32 reference, so a path that runs but answers wrong counts as not running."""
    from torch.nn.attention import sdpa_kernel

    b, sq, sk = 2, (1 if kind == "decode" else 16), 80
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, shape.heads, sq, shape.head_dim, device=dev, dtype=torch.float16,
                    generator=gen)
    k, v = (torch.randn(b, shape.kv_heads, sk, shape.head_dim, device=dev, dtype=torch.float16,
                        generator=gen) for _ in range(2))
    ref = _reference(q, k, v, causal=kind != "decode")
    mask = _bottom_right_mask(sq, sk, dev) if kind == "mask" else None
    lr = _causal_lr(sq, sk) if kind == "lr" else None
    reasons = []
    for mode in ("enable_gqa", "expanded"):
        kk, vv = (k, v) if mode == "enable_gqa" else (
            _expand(k, shape), _expand(v, shape))
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel(_backend(name)):
            warnings.simplefilter("always")
            try:
                out = _sdpa_call(kind, q, kk, vv, mode == "enable_gqa", mask, lr)
                torch.cuda.synchronize()
                err = (out.float() - ref).abs().max().item()
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
                why = [str(w.message).strip().splitlines()[0] for w in caught][:3]
                reasons.append(f"{mode}: {_first_line(e)}"
                               + (f" ({'; '.join(why)})" if why else ""))
                continue
        if err <= 2e-2:
            return {"gqa": mode, "note": "; ".join(reasons) or None}
        reasons.append(f"{mode}: ran but max abs error {err:.2e} vs fp32 reference")
    return {"gqa": None, "note": "; ".join(reasons)}


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _timed(name: str, fn: Callable[[], object], iters: int, repeats: int, graph: bool,
           notes: list[str]) -> float | None:
    """Median seconds per call, None (and a note) when the call or its capture fails."""
    try:
        return _time(fn, iters, repeats, graph)
    except Exception as e:  # noqa: BLE001 - report and go on with the other methods
        notes.append(f"{name} ({'CUDA graph' if graph else 'eager'}) failed: {_first_line(e)}")
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return None


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _decode_reference(q: torch.Tensor, k_c: torch.Tensor, v_c: torch.Tensor) -> torch.Tensor:
    """Decode without expanding K/V: q [b, H, D], k/v [b, HK, L, D] -> [b, H, D]; fp16
    matmuls per KV-head group (query head h uses KV head h // group), fp32 softmax."""
    b, h, d = q.shape
    hk = k_c.shape[1]
    s = ((q * d ** -0.5).view(b, hk, h // hk, d) @ k_c.transpose(-1, -2)).float()
    return (s.softmax(-1).to(v_c.dtype) @ v_c).view(b, h, d)


def _fill_paged(contig: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """contig [batch, HK, L, D] -> paged [num_pages, page_size, HK, D] holding key j of
    sequence b at row j % page_size of page block_table[b, j // page_size] (one sequence at
    a time: no full-size temporary). Rows past L are zero."""
    batch, hk, length, d = contig.shape
    pages = block_table.numel()
    paged = torch.zeros(pages, page_size, hk, d, device=contig.device, dtype=contig.dtype)
    flat = paged.view(pages * page_size, hk, d)
    tok = torch.arange(length, device=contig.device)
    page_of, row_of = tok // page_size, tok % page_size
    for b in range(batch):
        slots = block_table[b].long()[page_of] * page_size + row_of
        flat.index_copy_(0, slots, contig[b].transpose(0, 1))
    return paged


def _paged_inputs(batch: int, kv_len: int, page_size: int, gen: torch.Generator, dev,
                  shape: Shape):
    """Contiguous K/V for SDPA, the same keys in a paged cache for sm7x (random page
    permutation), the block table and seqused_k."""
    k_c, v_c = (torch.randn(batch, shape.kv_heads, kv_len, shape.head_dim, device=dev,
                            dtype=torch.float16, generator=gen) for _ in range(2))
    nblk = num_pages(kv_len, page_size)
    block_table = torch.randperm(batch * nblk, device=dev, generator=gen).to(torch.int32)
    block_table = block_table.view(batch, nblk).contiguous()
    k_p, v_p = (_fill_paged(t, block_table, page_size) for t in (k_c, v_c))
    seqused = torch.full((batch,), kv_len, device=dev, dtype=torch.int32)
    return k_c, v_c, k_p, v_p, block_table, seqused


# ---------------------------------------------------------------------------------------
# 8-bit caches: the fp16 paged cache encoded (same pages, same block table), the
# dequantized reference, and the timing matched to the fp16 row's.

_CHUNK_BYTES = 1 << 28  # fp32 bytes a slice of an encode / amax may take


def _slices(t: torch.Tensor, max_bytes: int | None = None):
    """Slices of t's first dim of at most max_bytes (default _CHUNK_BYTES) in fp32:
    encode_codes and the amax widen to fp32, and a whole 64 x 64k cache would be an 8.6 GB
    temporary per tensor."""
    max_bytes = _CHUNK_BYTES if max_bytes is None else max_bytes
    per = max(1, max_bytes // max(1, t[0].numel() * 4)) if t.shape[0] else 1
    return [slice(i, i + per) for i in range(0, t.shape[0], per)]


def _encode_cache(t: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 cache (4-D, paged or not) -> (its 8-bit codes as a float8 tensor, the float32
    [1] descale): a per-tensor scale from its amax, encoded with the library's own
    encode_codes (what reshape_and_cache stores). int8_per_token_head: (int8 codes, the
    float32 scale of every row, t.shape[:-1]), encode_int8_rows."""
    from ...fa2._serving import KV_CACHE_DTYPES, encode_codes, encode_int8_rows

    if kv_dtype == "int8_per_token_head":
        codes = torch.empty(t.shape, device=t.device, dtype=torch.int8)
        scales = torch.empty(t.shape[:-1], device=t.device, dtype=torch.float32)
        for s in _slices(t):
            codes[s], scales[s] = encode_int8_rows(t[s])
        return codes, scales

    amax = torch.zeros((), device=t.device, dtype=torch.float32)
    for s in _slices(t):  # on the device: no host sync
        amax = torch.maximum(amax, t[s].abs().amax().float())
    descale = kv8_descale(amax, kv_dtype).reshape(1)
    codes = torch.empty(t.shape, device=t.device, dtype=KV8_TORCH_DTYPES[kv_dtype])
    for s in _slices(t):
        codes[s] = encode_codes(t[s], KV_CACHE_DTYPES[kv_dtype], descale)
    return codes, descale


def _kv8_args(kv_dtype: str, dk: torch.Tensor, dv: torch.Tensor) -> dict:
    """The FA2 call's arguments for an 8-bit cache of _encode_cache."""
    if kv_dtype == "int8_per_token_head":
        return dict(k_scale_cache=dk, v_scale_cache=dv)
    return dict(k_descale=dk, v_descale=dv, kv_cache_dtype=kv_dtype)


def _dequant(t: torch.Tensor, kv_dtype: str, descale: torch.Tensor) -> torch.Tensor:
    """fp16 values the 8-bit cache holds for t: encode, then codes * descale (int8: each
    row's own scale, the same rows' codes and scales as the paged copy's)."""
    from ...fa2._serving import KV_CACHE_DTYPES, encode_codes, encode_int8_rows

    if kv_dtype == "int8_per_token_head":
        codes, scales = encode_int8_rows(t)
        return (codes.float() * scales[..., None]).half()

    return (encode_codes(t, KV_CACHE_DTYPES[kv_dtype], descale).float() * descale).half()


def _time_like_fp16(name: str, fn, a, notes: list[str], kind: str | None, fp16: dict,
                    fp16_fn) -> tuple[float | None, str | None, float | None]:
    """Times an 8-bit call the way its fp16 row was timed (kind: "graph" or "eager"), so
    the ratio compares like with like. Returns (seconds, how, the fp16 seconds timed that
    way); a graph capture that fails falls back to eager against fp16 eager (timed here if
    the row has no eager time). fp16: {"graph": s, "eager": s} of the fp16 call."""
    if kind is None:
        return None, None, None
    if kind == "graph":
        t = _timed(name, fn, a.iters, a.repeats, True, notes)
        if t is not None:
            return t, "graph", fp16.get("graph")
        notes.append(f"{name}: its time ratio is eager against fp16 eager (CUDA graph "
                     f"capture failed)")
    t = _timed(name, fn, a.iters, a.repeats, False, notes)
    if t is not None and fp16.get("eager") is None:
        fp16["eager"] = _timed("sm7x eager", fp16_fn, a.iters, a.repeats, False, notes)
    return t, ("eager" if t is not None else None), fp16.get("eager")


def _kv8_formats(a) -> tuple[str, ...]:
    return tuple(getattr(a, "kv8", ()) or ())


def _expand(t: torch.Tensor, shape: Shape) -> torch.Tensor:
    """[b, HK, ...] -> [b, H, ...]: each KV head repeated for its query heads."""
    return t.repeat_interleave(shape.group, dim=1)


def _make_plan(batch, q_len, kv_len, dev, num_splits, notes, shape: Shape, kv_dtype=None):
    """plan_decode of this shape for the cache format kv_dtype (None: fp16; else a
    --kv-dtype name, vLLM's kv_cache_dtype string)."""
    from ...fa2 import plan_decode

    try:
        return plan_decode(batch, q_len, kv_len, shape.heads, shape.kv_heads, shape.head_dim,
                           device=dev, num_splits=num_splits, kv_cache_dtype=kv_dtype)
    except Exception as e:  # noqa: BLE001
        notes.append(f"plan_decode failed, sm7x runs without a plan: {_first_line(e)}")
        return None


DENSE_TIMES = ("sm7x_dense_eager", "sm7x_dense_prefill_eager")


def _dense_times(q, k_c, v_c, ref, a, diffs: dict, notes: list[str]) -> dict:
    """The same decode step through flash_attn_func, as a model that keeps its own [B, H,
    S, D] cache calls it (k/v transposed views): eager, on the serving kernel (few rows per
    kv head: sm7x.fa2 picks it) and with SM7X_FA2_DENSE=prefill (the prefill kernel, what
    such a call ran on before)."""
    from ...fa2 import flash_attn_func

    q4, kd, vd = q.unsqueeze(1), k_c.transpose(1, 2), v_c.transpose(1, 2)

    def dense():
        return flash_attn_func(q4, kd, vd, causal=True)

    times: dict = {}
    saved = os.environ.pop("SM7X_FA2_DENSE", None)
    try:
        for name, env in (("sm7x_dense_eager", None), ("sm7x_dense_prefill_eager", "prefill")):
            if env is not None:
                os.environ["SM7X_FA2_DENSE"] = env
            diffs[name.removesuffix("_eager")] = _max_diff(dense().reshape(ref.shape), ref)
            times[name] = _timed(f"flash_attn_func ({env or 'default'})", dense, a.iters,
                                 a.repeats, False, notes)
    except Exception as e:  # noqa: BLE001
        notes.append(f"flash_attn_func (few rows) failed: {_first_line(e)}")
    finally:
        os.environ.pop("SM7X_FA2_DENSE", None)
        if saved is not None:
            os.environ["SM7X_FA2_DENSE"] = saved
    return times


def _decode_row(batch, kv_len, a, baselines, free, gen, dev, l2_bytes) -> dict:
    from torch.nn.attention import sdpa_kernel

    from ...fa2 import flash_attn_varlen_func

    notes: list[str] = []
    sh = a.shape
    nbytes = useful_bytes(batch, kv_len, shape=sh)
    kvb = kv_bytes(batch, kv_len, sh.kv_heads, sh.head_dim)
    row: dict = {"batch": batch, "kv_len": kv_len, "kv_mbytes": kvb / 1e6, "useful_bytes": nbytes}
    need_exp = any(b["gqa"] == "expanded" for b in baselines.values())
    kv8 = _kv8_formats(a)
    base = cache_bytes(batch, kv_len, a.page_size, expanded=False, shape=sh)
    full = cache_bytes(batch, kv_len, a.page_size, expanded=need_exp, shape=sh, kv8=len(kv8))
    budget = a.budget * free
    row["cache_gb"] = full["total"] / 1e9
    if not fits_budget(base["total"], free, a.budget):
        row["skipped"] = (f"caches need {base['total'] / 1e9:.1f} GB > "
                          f"budget {budget / 1e9:.1f} GB "
                          f"({a.budget:.0%} of {free / 1e9:.1f} GB free)")
        return row
    # The 8-bit caches come before the expanded baseline copy: they are what --kv-dtype asked.
    with8 = cache_bytes(batch, kv_len, a.page_size, shape=sh, kv8=len(kv8))
    use_kv8 = bool(kv8) and fits_budget(with8["total"], free, a.budget)
    if kv8 and not use_kv8:
        row["kv8_skipped"] = (f"caches with {len(kv8)} 8-bit copies need "
                              f"{with8['total'] / 1e9:.1f} GB > budget {budget / 1e9:.1f} GB")
        notes.append(f"{row['kv8_skipped']}: the 8-bit rows are skipped")
    need = cache_bytes(batch, kv_len, a.page_size, expanded=need_exp, shape=sh,
                       kv8=len(kv8) if use_kv8 else 0)
    use_exp = need_exp and fits_budget(need["total"], free, a.budget)
    if need_exp and not use_exp:
        notes.append(f"K/V expanded to {sh.heads} heads would need {need['total'] / 1e9:.1f} GB > "
                     f"budget {budget / 1e9:.1f} GB: the baselines that need it are skipped")

    k_c, v_c, k_p, v_p, bt, seqused = _paged_inputs(batch, kv_len, a.page_size, gen, dev, sh)
    q = torch.randn(batch, sh.heads, sh.head_dim, device=dev, dtype=torch.float16, generator=gen)
    cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)
    plan = _make_plan(batch, 1, kv_len, dev, a.num_splits, notes, sh)
    row["num_splits"], row["num_splits_attr"] = plan_splits(plan)
    for attr in ("total_splits", "waves"):  # DecodePlan's, where it has them
        v = getattr(plan, attr, None)
        row[f"plan_{attr}"] = v if isinstance(v, int) else None
    if plan is not None and row["num_splits"] is None:
        notes.append(f"number of splits not found on {type(plan).__name__}")

    def sm7x():
        return flash_attn_varlen_func(q, k_p, v_p, cu_q, None, 1, kv_len, causal=True,
                                      block_table=bt, seqused_k=seqused, out=out,
                                      scheduler_metadata=plan)

    ref = _decode_reference(q, k_c, v_c)
    diffs: dict[str, float] = {}
    ours = None
    try:
        sm7x()
        ours = out.clone()
        diffs["torch_matmul"] = _max_diff(ours, ref)
    except Exception as e:  # noqa: BLE001
        notes.append(f"sm7x failed: {_first_line(e)}")

    times: dict[str, float | None] = {}
    if ours is not None:
        times["sm7x"] = _timed("sm7x", sm7x, a.iters, a.repeats, True, notes)
        times["sm7x_eager"] = _timed("sm7x eager", sm7x, a.iters, a.repeats, False, notes)
    try:
        from ...fa2 import flash_attn_with_kvcache

        q4 = q.unsqueeze(1)

        def kvc():
            return flash_attn_with_kvcache(q4, k_p, v_p, cache_seqlens=seqused, block_table=bt,
                                           causal=True, num_splits=0)

        o = kvc()
        diffs["sm7x_kvcache"] = _max_diff(o.reshape(batch, sh.heads, sh.head_dim), ref)
        times["sm7x_kvcache_eager"] = _timed("flash_attn_with_kvcache", kvc, a.iters, a.repeats,
                                             False, notes)
    except Exception as e:  # noqa: BLE001
        notes.append(f"flash_attn_with_kvcache failed: {_first_line(e)}")
    times.update(_dense_times(q, k_c, v_c, ref, a, diffs, notes))

    # 8-bit caches: the same keys, pages and block table, each with the plan of its format
    # (plan_decode(kv_cache_dtype=)), timed as the fp16 row was;
    # each copy lives in kv8_one only (freed before the next and before the baselines).
    fp16_kind = "graph" if times.get("sm7x") else ("eager" if times.get("sm7x_eager") else None)
    fp16_t = {"graph": times.get("sm7x"), "eager": times.get("sm7x_eager")}

    def kv8_one(fmt: str, n8: int) -> dict:
        (k8, dk), (v8, dv) = _encode_cache(k_p, fmt), _encode_cache(v_p, fmt)
        out8 = torch.empty_like(q)
        plan8 = _make_plan(batch, 1, kv_len, dev, a.num_splits, notes, sh, fmt)

        def call8():
            return flash_attn_varlen_func(q, k8, v8, cu_q, None, 1, kv_len, causal=True,
                                          block_table=bt, seqused_k=seqused, out=out8,
                                          scheduler_metadata=plan8, **_kv8_args(fmt, dk, dv))

        call8()
        # Against a reference over the values the codes stand for, one sequence at a time
        # (no full-size dequantized copy); diff_vs_fp16: how far quantization moved it.
        diff = max(_max_diff(out8[i:i + 1], _decode_reference(
            q[i:i + 1], _dequant(k_c[i:i + 1], fmt, dk), _dequant(v_c[i:i + 1], fmt, dv)))
            for i in range(batch))
        vs16 = _max_diff(out8, ours)
        t8, how, t16 = _time_like_fp16(f"sm7x {fmt}", call8, a, notes, fp16_kind, fp16_t, sm7x)
        return {"us": None if t8 is None else t8 * 1e6, "gbps": gbps(n8, t8), "timing": how,
                "time_ratio": time_ratio(t8, t16), "max_abs_diff": diff, "diff_vs_fp16": vs16}

    for fmt in kv8:
        p = f"sm7x_{fmt}"
        n8 = useful_bytes(batch, kv_len, shape=sh, kv_dtype=fmt)
        row.update({f"{p}_useful_bytes": n8, f"{p}_us": None, f"{p}_gbps": None,
                    f"{p}_time_ratio": None, f"{p}_timing": None, f"{p}_max_abs_diff": None,
                    f"{p}_diff_vs_fp16": None})
        if not use_kv8 or ours is None:
            continue
        try:
            row.update({f"{p}_{k}": v for k, v in kv8_one(fmt, n8).items()})
        except Exception as e:  # noqa: BLE001
            notes.append(f"sm7x {fmt} failed: {_first_line(e)}")

    qs = q.unsqueeze(2)  # [b, H, 1, D]
    k_e = v_e = None
    for name, b in baselines.items():
        row[f"{name}_gqa"] = b["gqa"]
        if b["gqa"] is None or (b["gqa"] == "expanded" and not use_exp):
            row[f"{name}_gqa"] = None
            continue
        if b["gqa"] == "expanded" and k_e is None:
            k_e, v_e = _expand(k_c, sh), _expand(v_c, sh)  # outside the timed region
        kk, vv = (k_c, v_c) if b["gqa"] == "enable_gqa" else (k_e, v_e)
        gqa = b["gqa"] == "enable_gqa"

        def call(kk=kk, vv=vv, gqa=gqa):
            return _sdpa_call("decode", qs, kk, vv, gqa)

        with sdpa_kernel(_backend(name)):
            try:
                o = call().squeeze(2)
                diffs[name] = _max_diff(ours, o) if ours is not None else None
                times[name] = _timed(name, call, a.iters, a.repeats, True, notes)
            except Exception as e:  # noqa: BLE001
                notes.append(f"{name} failed: {_first_line(e)}")

    t_sm = times.get("sm7x") or times.get("sm7x_eager")
    if times.get("sm7x") is None and times.get("sm7x_eager") is not None:
        notes.append("sm7x GB/s is the eager time (CUDA graph capture failed)")
    row["sm7x_timing"] = "graph" if times.get("sm7x") else ("eager" if t_sm else None)
    for name in ("sm7x", "sm7x_eager", "sm7x_kvcache_eager") + DENSE_TIMES + tuple(baselines):
        t = t_sm if name == "sm7x" else times.get(name)
        row[f"{name}_us"] = None if t is None else t * 1e6
        row[f"{name}_gbps"] = gbps(nbytes, t)
    for name in baselines:
        row[f"sm7x_over_{name}"] = ratio(times.get(name), t_sm)
    row["frac_of_copy"] = None  # filled in once the copy bandwidth is final
    sdpa_diffs = [d for n, d in diffs.items() if n in baselines and d is not None]
    row["max_abs_diff_vs"] = diffs
    row["max_abs_diff"] = max(sdpa_diffs) if sdpa_diffs else diffs.get("torch_matmul")
    row["l2_resident"] = bool(l2_bytes and kvb < l2_bytes)
    row["notes"] = notes
    return row


def _prefill_row(batch, a, baselines, free, gen, dev) -> dict:
    from torch.nn.attention import sdpa_kernel

    from ...fa2 import flash_attn_varlen_func

    new, prefix = PREFILL_NEW, PREFILL_PREFIX
    lk = prefix + new
    notes: list[str] = []
    sh = a.shape
    flops = prefill_flops(batch, new, prefix, sh.heads, sh.head_dim)
    row: dict = {"batch": batch, "q_len": new, "prefix": prefix, "kv_len": lk, "flops": flops}
    need_exp = any(b["gqa"] == "expanded" for b in baselines.values())
    kv8 = _kv8_formats(a)
    need = cache_bytes(batch, lk, a.page_size, expanded=need_exp, shape=sh)["total"]
    if not fits_budget(need, free, a.budget):
        row["skipped"] = f"caches need {need / 1e9:.1f} GB > budget {a.budget * free / 1e9:.1f} GB"
        return row
    need8 = cache_bytes(batch, lk, a.page_size, expanded=need_exp, shape=sh, kv8=len(kv8))["total"]
    use_kv8 = bool(kv8) and fits_budget(need8, free, a.budget)
    if kv8 and not use_kv8:
        row["kv8_skipped"] = (f"caches with {len(kv8)} 8-bit copies need {need8 / 1e9:.1f} GB > "
                              f"budget {a.budget * free / 1e9:.1f} GB")
        notes.append(f"{row['kv8_skipped']}: the 8-bit rows are skipped")
    k_c, v_c, k_p, v_p, bt, seqused = _paged_inputs(batch, lk, a.page_size, gen, dev, sh)
    q = torch.randn(batch * new, sh.heads, sh.head_dim, device=dev, dtype=torch.float16,
                    generator=gen)
    cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int32) * new
    out = torch.empty_like(q)
    plan = _make_plan(batch, new, lk, dev, a.num_splits, notes, sh)
    row["num_splits"], row["num_splits_attr"] = plan_splits(plan)

    def sm7x():
        return flash_attn_varlen_func(q, k_p, v_p, cu_q, None, new, lk, causal=True,
                                      block_table=bt, seqused_k=seqused, out=out,
                                      scheduler_metadata=plan)

    ours = None
    times: dict[str, float | None] = {}
    try:
        sm7x()
        ours = out.clone()
        times["sm7x"] = _timed("sm7x", sm7x, a.iters, a.repeats, plan is not None, notes)
        if times["sm7x"] is None and plan is not None:
            times["sm7x"] = _timed("sm7x", sm7x, a.iters, a.repeats, False, notes)
            row["sm7x_timing"] = "eager"
        else:
            row["sm7x_timing"] = "graph" if plan is not None else "eager"
    except Exception as e:  # noqa: BLE001
        notes.append(f"sm7x failed: {_first_line(e)}")

    qs = q.view(batch, new, sh.heads, sh.head_dim).transpose(1, 2)  # [b, H, new, D]
    # sm7x paged over an 8-bit prefix: same pages and block table, the plan of its format,
    # timed as fp16 was.
    fp16_t = {row.get("sm7x_timing"): times.get("sm7x")}

    def kv8_one(fmt: str) -> dict:
        (k8, dk), (v8, dv) = _encode_cache(k_p, fmt), _encode_cache(v_p, fmt)
        out8 = torch.empty_like(q)
        plan8 = _make_plan(batch, new, lk, dev, a.num_splits, notes, sh, fmt)

        def call8():
            return flash_attn_varlen_func(q, k8, v8, cu_q, None, new, lk, causal=True,
                                          block_table=bt, seqused_k=seqused, out=out8,
                                          scheduler_metadata=plan8, **_kv8_args(fmt, dk, dv))

        call8()
        diff = _prefill_kv8_diff(out8.view(batch, new, sh.heads, sh.head_dim), qs, k_c, v_c,
                                 fmt, dk, dv, prefix)
        vs16 = _max_diff(out8, ours)
        t8, how, t16 = _time_like_fp16(f"sm7x {fmt}", call8, a, notes, row.get("sm7x_timing"),
                                       fp16_t, sm7x)
        return {"us": None if t8 is None else t8 * 1e6,
                "tflops": None if not t8 else flops / t8 / 1e12, "timing": how,
                "time_ratio": time_ratio(t8, t16), "max_abs_diff": diff, "diff_vs_fp16": vs16}

    for fmt in kv8:
        p = f"sm7x_{fmt}"
        row.update({f"{p}_us": None, f"{p}_tflops": None, f"{p}_time_ratio": None,
                    f"{p}_timing": None, f"{p}_max_abs_diff": None, f"{p}_diff_vs_fp16": None})
        if not use_kv8 or ours is None:
            continue
        try:
            row.update({f"{p}_{k}": v for k, v in kv8_one(fmt).items()})
        except Exception as e:  # noqa: BLE001
            notes.append(f"sm7x {fmt} failed: {_first_line(e)}")

    mask = _bottom_right_mask(new, lk, dev)
    lr = _causal_lr(new, lk)
    diffs: dict[str, float] = {}
    outs: dict[str, torch.Tensor] = {}
    k_e = v_e = None
    for name, b in baselines.items():
        row[f"{name}_gqa"] = b["gqa"]
        if b["gqa"] is None:
            continue
        if b["gqa"] == "expanded" and k_e is None:
            k_e, v_e = _expand(k_c, sh), _expand(v_c, sh)
        kk, vv = (k_c, v_c) if b["gqa"] == "enable_gqa" else (k_e, v_e)
        kind = "mask" if name == "sdpa_efficient" else "lr"

        def call(kk=kk, vv=vv, gqa=b["gqa"] == "enable_gqa", kind=kind):
            return _sdpa_call(kind, qs, kk, vv, gqa, mask, lr)

        with sdpa_kernel(_backend(name)):
            try:
                o = call().transpose(1, 2).reshape(batch * new, sh.heads, sh.head_dim)
                outs[name] = o
                if ours is not None:
                    diffs[name] = _max_diff(ours, o)
                times[name] = _timed(name, call, a.iters, a.repeats, True, notes)
            except Exception as e:  # noqa: BLE001
                notes.append(f"{name} failed: {_first_line(e)}")
    if "sdpa_efficient" in outs:  # the lower-right paths against the explicit mask
        for name, o in outs.items():
            if name != "sdpa_efficient":
                diffs[f"{name}_vs_sdpa_efficient"] = _max_diff(o, outs["sdpa_efficient"])
    t_sm = times.get("sm7x")
    for name in ("sm7x",) + tuple(baselines):
        t = times.get(name)
        row[f"{name}_us"] = None if t is None else t * 1e6
        row[f"{name}_tflops"] = None if not t else flops / t / 1e12
    for name in baselines:
        row[f"sm7x_over_{name}"] = ratio(times.get(name), t_sm)
    sdpa_diffs = [d for n, d in diffs.items() if n in baselines]
    row["max_abs_diff_vs"] = diffs
    row["max_abs_diff"] = max(sdpa_diffs) if sdpa_diffs else None
    row["notes"] = notes
    return row


def _prefill_kv8_diff(o8, qs, k_c, v_c, fmt, dk, dv, prefix: int, chunk: int = 128) -> float:
    """Max abs diff of the 8-bit prefill output o8 [b, new, H, D] against the fp32
    reference over the dequantized keys, per sequence and per chunk of queries (queries
    [s, e) are the last e - s of a prefix + e key sequence: bottom-right alignment holds
    on the truncated keys; keeps the score matrix small)."""
    worst = 0.0
    for i in range(qs.shape[0]):
        kd = _dequant(k_c[i:i + 1], fmt, dk)
        vd = _dequant(v_c[i:i + 1], fmt, dv)
        for s in range(0, qs.shape[2], chunk):
            e = min(s + chunk, qs.shape[2])
            ref = _reference(qs[i:i + 1, :, s:e], kd[:, :, :prefix + e], vd[:, :, :prefix + e],
                             causal=True)
            worst = max(worst, _max_diff(o8[i, s:e], ref[0].transpose(0, 1)))
    return worst


def _copy_bandwidth(nbytes: int, iters: int, repeats: int) -> float:
    # Eager: a device-to-device copy_ captured in a CUDA graph becomes a memcpy node that
    # ran at about 2.8 TB/s on the H200 (the copy engine), against about 4.2 TB/s eager:
    # the bandwidth to compare a kernel's reads with is the eager one.
    copy = _copy_fn(nbytes)
    t = _time(copy, iters, repeats, False)
    del copy
    _free_cuda()
    return nbytes / t / 1e9


def run(batches=DEFAULT_BATCHES, lens=DEFAULT_LENS, prefill_batches=DEFAULT_PREFILL_BATCHES,
        iters: int = 20, repeats: int = 10, budget: float = 0.4, page_size: int = PAGE_SIZE,
        num_splits: int = 0, seed: int = 0, result: dict | None = None,
        shape: Shape = DEFAULT_SHAPE, kv_dtypes=("fp16",)) -> dict:
    """Fills and returns `result` (pass a dict to keep what was measured when a later step
    raises). kv_dtypes: the cache formats (fp16 always runs; each 8-bit one adds its rows)."""
    import argparse

    from ...fa2 import _loader

    kv8 = tuple(f for f in kv_dtypes if f != "fp16")
    a = argparse.Namespace(iters=iters, repeats=repeats, budget=budget, page_size=page_size,
                           num_splits=num_splits, shape=shape, kv8=kv8)
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 0) or 0
    print(f"{props.name} (capability {props.major}.{props.minor}, "
          f"{props.multi_processor_count} SMs, "
          f"L2 {l2 / 2**20:.0f} MB), torch {torch.__version__}, "
          f"SM7X_FA2_FORCE={os.environ.get('SM7X_FA2_FORCE')}", flush=True)
    result = {} if result is None else result
    result.update({
        "benchmark": "sm7x paged decode vs torch SDPA (flash, memory-efficient)",
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_mb": round(l2 / 2**20, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "forced": os.environ.get("SM7X_FA2_FORCE"),
        "library": None,
        "config": {"dtype": "float16", "heads": shape.heads, "kv_heads": shape.kv_heads,
                   "head_dim": shape.head_dim,
                   "page_size": page_size, "page_order": "random permutation",
                   "batches": list(batches), "kv_lens": list(lens),
                   "prefill": {"batches": list(prefill_batches), "q_len": PREFILL_NEW,
                               "prefix": PREFILL_PREFIX, "causal": "bottom-right"},
                   "plan_num_splits_arg": num_splits, "memory_budget_fraction": budget,
                   "seed": seed},
        "timing": {"iters_per_sample": iters, "samples": repeats, "statistic": "median",
                   "cuda_graph": "all methods except *_eager"},
        "bytes": ("useful bytes for every method: K and V of every sequence "
                  "(batch * kv_len * kv_heads * head_dim * 2 * 2) + q + out; an expanded "
                  "baseline really reads more"),
        "results": [], "prefill": [], "notes": [], "warnings": [],
    })
    if kv8:  # only then: a default run's JSON keeps its fields
        result["config"]["kv_dtypes"] = ["fp16", *kv8]
        result["config"]["kv8_scale"] = ("fp8: per tensor (K and V each): descale = amax / "
                                         "the format's largest value; codes from "
                                         "sm7x.fa2._serving.encode_codes of the fp16 cache; "
                                         "int8_per_token_head: a scale per row "
                                         "(encode_int8_rows), codes and scales in separate "
                                         "contiguous tensors")
        result["bytes_8bit"] = ("8-bit rows: K and V at 1 byte an element (batch * kv_len * "
                                "kv_heads * head_dim * 2; int8: + 4 bytes a row) + q + out "
                                "in fp16")
    _free_cuda()
    free0, _ = torch.cuda.mem_get_info(dev)
    copy_bytes = int(min(COPY_BYTES, 0.2 * free0)) // 4 * 4
    result["copy"] = {"bytes": copy_bytes, "samples_gbps": [], "gbps": None}
    result["copy"]["samples_gbps"].append(_copy_bandwidth(copy_bytes, iters, repeats))
    result["copy"]["gbps"] = max(result["copy"]["samples_gbps"])
    print(f"copy bandwidth {result['copy']['gbps']:.0f} GB/s", flush=True)

    result["baselines"] = {
        "decode": {n: probe_sdpa(n, "decode", dev, shape) for n in DECODE_BASELINES},
        "prefill": {"sdpa_efficient": probe_sdpa("sdpa_efficient", "mask", dev, shape),
                    "sdpa_efficient_lr": probe_sdpa("sdpa_efficient", "lr", dev, shape),
                    "sdpa_flash_lr": probe_sdpa("sdpa_flash", "lr", dev, shape)},
    }
    for kind, bl in result["baselines"].items():
        for n, b in bl.items():
            print(f"{kind} baseline {n}: {b['gqa'] or 'unavailable'}"
                  + (f" ({b['note']})" if b.get("note") else ""), flush=True)
    _free_cuda()

    gen = torch.Generator(device=dev).manual_seed(seed)
    if kv8:
        print("under each row, per 8-bit format: sm7x over an 8-bit copy of its paged cache: "
              "KV MB, us, GB/s of the bytes it reads, step time over the fp16 sm7x row's",
              flush=True)
    print(DECODE_HEADER, flush=True)
    for batch in batches:
        for kv_len in lens:
            _free_cuda()
            free, _ = torch.cuda.mem_get_info(dev)
            row = _decode_row(batch, kv_len, a, result["baselines"]["decode"], free, gen, dev, l2)
            fill_frac_of_copy(row, result["copy"]["gbps"], kv8)
            result["results"].append(row)
            if result["library"] is None and _loader.loaded():
                result["library"] = {k: str(p) for k, p in _loader.loaded().items()}
            print(format_decode_row(row), flush=True)
            for line in format_kv8_lines(row, kv8):
                print(line, flush=True)
    _free_cuda()

    if prefill_batches:
        print("\n" + PREFILL_HEADER, flush=True)
    for batch in prefill_batches:
        _free_cuda()
        free, _ = torch.cuda.mem_get_info(dev)
        row = _prefill_row(batch, a, result["baselines"]["prefill"], free, gen, dev)
        result["prefill"].append(row)
        print(format_prefill_row(row), flush=True)
        for line in format_kv8_lines(row, kv8, prefill=True):
            print(line, flush=True)
    _free_cuda()

    result["copy"]["samples_gbps"].append(_copy_bandwidth(copy_bytes, iters, repeats))
    result["copy"]["gbps"] = max(result["copy"]["samples_gbps"])
    finish(result)
    return result
