"""The shapes the 8-bit KV cache tests run (test_fa2_kv8.py: fp8; test_fa2_int8.py: int8
with row scales), so both formats cover the same edges: decode over a paged cache at every
head dim, page size, GQA ratio and sequence length class, and varlen batches mixing
prefill chunks and speculative verification over a cached prefix; plus the float32
reference of a varlen call over a paged cache."""

from __future__ import annotations

import itertools

import torch

from fa2_reference import gather_paged, random_lens, reference_seqs

# what the serving and 8-bit tests share: the device, dtypes and tolerances (fa2_reference's
# tolerance on outputs for fp16 inputs of randn scale; softcap's tanh adds a little)
DEV = "cuda"
F16 = torch.float16
I32 = torch.int32
ATOL = 4e-3
ATOL_SOFTCAP = 5e-3

DECODE_CASES = {
    # name: (cache lengths, num_heads, num_kv_heads, head_dim, page_size)
    "len1-d32": ([1], 8, 8, 32, 16),
    "len15-16-17": ([15, 16, 17], 8, 2, 128, 16),
    "len0-short-gqa4-d64": ([0, 1, 17, 16], 32, 8, 64, 32),
    "len1000-mqa-d256": ([1000, 999], 8, 1, 256, 64),
    "len32768-d128": ([32768], 8, 2, 128, 128),
    "batch37-d80": (random_lens(37, 1, 3000, seed=2), 8, 8, 80, 32),
    "batch9-d96-gqa8": (random_lens(9, 1, 2500, seed=4), 16, 2, 96, 16),
    "batch6-d112": (random_lens(6, 1, 2000, seed=5), 8, 4, 112, 64),
    "batch5-d160": (random_lens(5, 1, 1500, seed=6), 8, 2, 160, 32),
    "batch4-d192-gqa4": ([1, 700, 1300, 64], 16, 4, 192, 16),
    "batch3-d224": ([333, 1, 1025], 4, 4, 224, 128),
    "batch16-mqa-d64": (random_lens(16, 1, 5000, seed=3), 8, 1, 64, 128),
}

# (query tokens, cached prefix) per sequence
MIXES = {
    "chunked-prefill": [(37, 0), (37, 1000), (512, 3000), (512, 0), (1, 2500), (64, 17)],
    "spec-verify": [(2, 100), (5, 2000), (64, 500), (17, 3), (3, 0), (8, 1023)],
}
SHAPES = [(64, 8, 8, 16), (112, 16, 4, 32), (128, 32, 8, 64), (256, 8, 1, 128)]  # d, h, hk, page
WINDOW_SOFTCAP = [  # (window, softcap, causal)
    ((256, 0), 0.0, True),
    ((100, -1), 0.0, False),
    ((-1, -1), 30.0, True),
    ((64, 0), 30.0, True),
]


def mix_lengths(mix):
    """(query lengths, key lengths) of the sequences of MIXES[mix]."""
    return [n for n, _ in MIXES[mix]], [n + p for n, p in MIXES[mix]]


def varlen_reference(sqs, sks, q, bt, kq, vq, scale, causal, window=(-1, -1), softcap=0.0):
    """out, lse of the packed queries q over the paged float32 caches kq / vq."""
    cu = [0, *itertools.accumulate(sqs)]
    qs = [q[cu[i]:cu[i + 1]] for i in range(len(sqs))]
    ks = [gather_paged(kq, bt, i, n) for i, n in enumerate(sks)]
    vs = [gather_paged(vq, bt, i, n) for i, n in enumerate(sks)]
    return reference_seqs(qs, ks, vs, scale, causal, window, softcap)
