"""sm7x paged decode (split-KV) against torch SDPA's flash and memory-efficient backends.

``[SM7X_FA2_FORCE=sm75] python -m sm7x.bench decode [--out decode.json] [--plot decode.png]
[--batches 1,8,16,64] [--lens 1k,2k,...,128k] [--shape 32/8/128] [--kv-dtype fp16,fp8_e4m3,fp8_e5m2]
[--quick]``; ``python -m sm7x.bench decode --context-table [--weights-gb GB]`` (no GPU).

Decode: fp16, head dim 128, GQA 32 query heads / 8 KV heads (the numbers below; ``--shape
H/HK/D`` sets others, e.g. 16/8/256), one query token per sequence, every sequence of a
batch ``kv_len`` keys long. sm7x reads a vLLM-style paged
cache (``[num_pages, 16, 8, 128]``, the pages of the block table a random permutation, so
no sequence is contiguous in memory) through ``flash_attn_varlen_func(..., block_table=,
seqused_k=, out=, scheduler_metadata=plan_decode(...))``; the baselines read a contiguous
``[batch, heads, kv_len, 128]`` cache through ``scaled_dot_product_attention`` restricted
to one backend. Each backend takes GQA as ``enable_gqa=True`` when it accepts that (probed
once on a small shape, result checked against an fp32 reference); otherwise K/V are
expanded to 32 heads with ``repeat_interleave`` before timing (the output says which: an
expanded baseline reads 4x the bytes). A backend that runs neither way (SDPA flash on
Volta/Turing) is skipped with torch's reason.

Timing: every method is captured ``--iters`` times into a CUDA graph and replayed (serving
engines run decode in graphs), ``--repeats`` replays timed, median per call. sm7x is also
timed eagerly (uncaptured, with its plan), and ``flash_attn_with_kvcache`` eagerly.
GB/s = the useful bytes / time for every method alike: the K and V a decode step needs
(batch * kv_len * 8 kv heads * 128 * 2 tensors * 2 bytes) plus q and out, whatever a
baseline really reads. The device's copy bandwidth (``dst.copy_(src)`` of a large tensor,
bytes read + written / time) is measured in the same run, before and after the sweep, the
faster kept. Short caches fit in L2 and are re-read from it by consecutive calls (rows
marked ``L2``): their GB/s is above what HBM gives.

A (batch, kv_len) whose caches (paged + contiguous, + the expanded copy where a baseline
needs it) would exceed ``--budget`` x the free GPU memory is skipped (or run without the
expanded baseline), and the output says so.

Chunked prefill: 512 new query tokens per sequence over a 16k-token paged prefix (causal,
bottom-right aligned: the queries are the last 512 positions of a 16896-key sequence),
batch 1 and 4: sm7x paged vs SDPA memory-efficient with an explicit boolean bottom-right
mask, and, where the backend runs, SDPA with ``torch.nn.attention.bias.causal_lower_right``
(memory-efficient: its bottom-right mask type; flash: its causal, which is bottom-right
aligned; plain ``is_causal`` is top-left and would be wrong here). TFLOP/s counts
4 * batch * heads * head_dim * (keys each query sees), summed over queries.

8-bit KV caches (``--kv-dtype``, default fp16 alone): per 8-bit format (fp8_e4m3,
fp8_e5m2; vLLM's names) the fp16 paged cache is encoded with
``sm7x.fa2._serving.encode_codes`` (per-tensor descale = amax / the format's largest
value; same pages and block table) and the sm7x decode and chunked-prefill calls run over
it with ``k_descale=, v_descale=, kv_cache_dtype=`` and the same plan, timed the way the
fp16 sm7x row was (CUDA graph), checked against a reference over the dequantized values.
Reported: time per step, GB/s of the bytes that format reads (K/V at 1 byte an element,
q and out fp16) and the step time over the fp16 sm7x step of the same run and (batch,
kv_len). The issue's goals: at most 0.6x fp16's step time at batch 16 x 32k and batch 1 x
128k, chunked prefill within 1.10x. The budget counts each 8-bit copy (half the fp16
paged cache); when they do not fit, the row runs without them and says so.

Context table (``--context-table``, and in every run's JSON): arithmetic, not measured:
the KV tokens that fit per format (fp16, 8-bit) for Llama-3.1-8B and Mistral-7B on a 16 GB
T4 and a 32 GB V100, after 0.9 x the card (vLLM's default gpu_memory_utilization), the
weights and a 1 GiB reserve; a row with 8-bit weights where the fp16 ones leave nothing.

On a GPU other than the arch's own the library is forced (``SM7X_FA2_FORCE``) and runs
its PTX: only correctness and the relative speed of the sm75 family mean something there.
"""

# The benchmark by job; the package re-exports their names (what ``sm7x.bench.decode`` held
# as one module), ``main`` included for ``python -m sm7x.bench decode``:
#   arithmetic  sizes, goals, the query/KV shape, bytes (fp16 / 8-bit), cache budget,
#               prefill FLOPs, plan splits, the context table (pure functions, no GPU)
#   runs        the timed GPU work: SDPA probes, paged inputs, decode / prefill rows, the
#               copy bandwidth, run()
#   report      results -> derived fields (finish), goal lines, tables, plot (draw)
#   cli         argument parsing and main()
# A name a function looks up at call time (``_time``, ``_backend``, ``PREFILL_NEW``) is
# looked up in its own module: monkeypatch it there (e.g. ``decode.runs._time``).

from __future__ import annotations

from .arithmetic import (  # noqa: F401
    CONTEXT_CARDS, CONTEXT_KV_FORMATS, CONTEXT_MODELS, CONTEXT_RESERVE, COPY_BYTES,
    DECODE_BASELINES, DEFAULT_BATCHES, DEFAULT_LENS, DEFAULT_PREFILL_BATCHES, DEFAULT_SHAPE, ELEM,
    GOAL_BATCH, GOAL_FRAC_COPY, GOAL_KV8_POINTS, GOAL_KV8_PREFILL, GOAL_KV8_STEP, GOAL_LEN,
    GOAL_VS_FLASH, GPU_MEMORY_UTILIZATION, HEAD_DIM, HEADS, KV8_TORCH_DTYPES, KV_DTYPE_ALIASES,
    KV_DTYPES, KV_ELEM, KV_HEADS, PAGE_SIZE, PREFILL_BASELINES, PREFILL_NEW, PREFILL_PREFIX,
    QUICK_BATCHES, QUICK_LENS, WARN_DIFF, Card, ModelConfig, Shape, _max_int, cache_bytes,
    context_table, fits_budget, gbps, kv8_descale, kv_bytes, kv_bytes_per_token, kv_memory,
    num_pages, plan_splits, prefill_flops, qo_bytes, ratio, time_ratio, tokens_that_fit,
    useful_bytes)
from .cli import main, parse_args, parse_kv_dtypes, parse_shape, parse_sizes  # noqa: F401
from .report import (  # noqa: F401
    DECODE_HEADER, PREFILL_HEADER, _fmt, all_goal_lines, context_table_markdown, dense_goal_lines,
    draw, fill_frac_of_copy, find_row, finish, format_decode_row, format_kv8_lines,
    format_prefill_row, goal_lines, kv8_formats, kv8_goal_lines, print_summary, print_table)
from .runs import (  # noqa: F401
    _backend, _bottom_right_mask, _causal_lr, _copy_bandwidth, _decode_reference, _decode_row,
    _dequant, _encode_cache, _expand, _fill_paged, _first_line, _free_cuda, _make_plan,
    _max_diff, _paged_inputs, _prefill_row, _reference, _sdpa, _sdpa_call, _time_like_fp16,
    _timed, probe_sdpa, run)
