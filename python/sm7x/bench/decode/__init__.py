"""sm7x paged decode (split-KV) against torch SDPA's flash and memory-efficient backends.

``[SM7X_FA2_FORCE=sm75] python -m sm7x.bench decode [--out decode.json] [--plot decode.png]
[--batches 1,8,16,64] [--lens 1k,2k,...,128k] [--shape 32/8/128] [--quick]``

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

On a GPU other than the arch's own the library is forced (``SM7X_FA2_FORCE``) and runs
its PTX: only correctness and the relative speed of the sm75 family mean something there.
"""

# The benchmark by job; the package re-exports their names (what ``sm7x.bench.decode`` held
# as one module), ``main`` included for ``python -m sm7x.bench decode``:
#   arithmetic  sizes, goals, the query/KV shape, bytes, cache budget, prefill FLOPs,
#               plan splits (pure functions, no GPU)
#   runs        the timed GPU work: SDPA probes, paged inputs, decode / prefill rows, the
#               copy bandwidth, run()
#   report      results -> derived fields (finish), goal lines, tables, plot (draw)
#   cli         argument parsing and main()
# A name a function looks up at call time (``_time``, ``_backend``, ``PREFILL_NEW``) is
# looked up in its own module: monkeypatch it there (e.g. ``decode.runs._time``).

from __future__ import annotations

from .arithmetic import (  # noqa: F401
    COPY_BYTES, DECODE_BASELINES, DEFAULT_BATCHES, DEFAULT_LENS, DEFAULT_PREFILL_BATCHES,
    DEFAULT_SHAPE, ELEM, GOAL_BATCH, GOAL_FRAC_COPY, GOAL_LEN, GOAL_VS_FLASH, HEAD_DIM, HEADS,
    KV_HEADS, PAGE_SIZE, PREFILL_BASELINES, PREFILL_NEW, PREFILL_PREFIX, QUICK_BATCHES,
    QUICK_LENS, WARN_DIFF, Shape, _max_int, cache_bytes, fits_budget, gbps, kv_bytes, num_pages,
    plan_splits, prefill_flops, qo_bytes, ratio, useful_bytes)
from .cli import main, parse_args, parse_shape, parse_sizes  # noqa: F401
from .report import (  # noqa: F401
    DECODE_HEADER, PREFILL_HEADER, _fmt, draw, find_row, finish, format_decode_row,
    format_prefill_row, goal_lines, print_summary, print_table)
from .runs import (  # noqa: F401
    _backend, _bottom_right_mask, _causal_lr, _copy_bandwidth, _decode_reference, _decode_row,
    _expand, _fill_paged, _first_line, _free_cuda, _make_plan, _max_diff, _paged_inputs,
    _prefill_row, _reference, _sdpa, _sdpa_call, _timed, probe_sdpa, run)
