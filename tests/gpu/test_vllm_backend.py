"""The vLLM backend's compute path on a GPU, without vLLM (which cannot be installed on the
GPU machine): sm7x.integrations.vllm._compute is what Sm7xFlashAttentionImpl's
do_kv_cache_update and forward delegate to, fed the tensors vLLM hands them, rebuilt here:

- the per-layer KV cache as vLLM's model runner allocates it: memory [num_blocks,
  block_size, num_kv_heads, 2 * head_size] (NHD; HND also tested), handed over as the
  logical [num_blocks, num_kv_heads, block_size, 2 * head_size] view, K and V packed in the
  last dim; block size 16;
- key/value as column slices of one qkv projection, padded token rows, slot_mapping with
  -1 for padding; the context of earlier steps written the same way first;
- one batch mixing a whole prefill, prefill chunks over a cached prefix and decodes, GQA;
  sliding window and softcap; query_start_loc/seq_lens/block_table as vLLM builds them;
- a decode batch captured in a CUDA graph with its plan (as the metadata builder makes it
  under full CUDA graphs) and replayed after the cache and lengths changed.

Compared with torch SDPA in float32 on the contiguous keys of each sequence (an explicit
float32 reference where SDPA has no option: softcap). Marked `gpu`; on GPUs newer than
Turing SM7X_FA2_FORCE must name a library (PTX JIT-compiled), e.g. on the H200:

    SM7X_FA2_FORCE=sm75 SM7X_LIBRARY_PATH=<libs> PYTHONPATH=python pytest -s tests/gpu/test_vllm_backend.py

The worst errors are printed at the end (-s) and written to $FA2_ERRORS_OUT when set.
"""

from __future__ import annotations

import os
import sys

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x FA2 needs torch >= {torch_min()}")
if not torch.cuda.is_available():
    pytest.skip("torch.cuda.is_available() is False: no CUDA device", allow_module_level=True)

from fa2_reference import selected_arch  # noqa: E402
from sm7x import _core_loader, _select  # noqa: E402


def _why_not() -> str | None:
    if selected_arch()[0] is None:
        return selected_arch()[1]
    if _core_loader.core_library_path() is None:
        return "sm7x-core (_core.abi3.so, the cache write) is not installed"
    return None


if (_why := _why_not()) is not None:
    pytest.skip(_why, allow_module_level=True)

from fa2_reference import WORST, _record, capture, report_worst  # noqa: E402

from sm7x.integrations import flash_window  # noqa: E402
from sm7x.integrations.vllm import _compute  # noqa: E402

assert "vllm" not in sys.modules  # the point of this file: no vLLM on the GPU machine

pytestmark = pytest.mark.gpu

DEV = "cuda"
F16, I32, I64 = torch.float16, torch.int32, torch.int64
ATOL = 4e-3  # as the other FA2 GPU tests (fp16 inputs of randn scale)
TAG = os.environ.get(_select.FORCE_ENV, "native").strip() or "native"
BLOCK = 16


def vllm_kv_cache(num_blocks, hk, d, layout="NHD"):
    """vLLM's per-layer cache: memory in the layout's order, the logical view handed over."""
    if layout == "NHD":
        return torch.zeros(num_blocks, BLOCK, hk, 2 * d, dtype=F16, device=DEV).transpose(1, 2)
    return torch.zeros(num_blocks, hk, BLOCK, 2 * d, dtype=F16, device=DEV)


class Batch:
    """Requests with `seq_lens` keys of which the last `query_lens` are this step's tokens
    (query_len == seq_len: a whole prefill; 1: a decode; else a chunk over a prefix)."""

    def __init__(self, query_lens, seq_lens, h, hk, d, *, max_blocks, num_blocks, seed,
                 pad_tokens=5, layout="NHD"):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.h, self.hk, self.d = h, hk, d
        self.query_lens, self.seq_lens = list(query_lens), list(seq_lens)
        self.kv = vllm_kv_cache(num_blocks, hk, d, layout)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        used = [-(-n // BLOCK) for n in seq_lens]
        assert sum(used) <= num_blocks and max(used) <= max_blocks
        if num_blocks >= len(seq_lens) * max_blocks:  # every entry its own page (graph test)
            bt = perm[:len(seq_lens) * max_blocks].to(I32).view(len(seq_lens), max_blocks)
        else:  # pages in use distinct; the rest of each row padding (block 0)
            bt = torch.zeros(len(seq_lens), max_blocks, dtype=I32)
            off = 0
            for r, u in enumerate(used):
                bt[r, :u] = perm[off:off + u].to(I32)
                off += u
        self.block_table = bt.to(DEV)
        # every key of every request, as the model would produce them step by step
        self.keys = [torch.randn(n, hk, d, device=DEV, dtype=F16, generator=g) for n in seq_lens]
        self.vals = [torch.randn(n, hk, d, device=DEV, dtype=F16, generator=g) for n in seq_lens]
        self.qs = [torch.randn(q, h, d, device=DEV, dtype=F16, generator=g) for q in query_lens]
        self.pad = pad_tokens
        self.g = g

    def slots(self, ranges):
        """slot_mapping (int64) of the positions [a, b) of each request."""
        bt = self.block_table.cpu()
        return torch.tensor([int(bt[r, p // BLOCK]) * BLOCK + p % BLOCK
                             for r, (a, b) in enumerate(ranges) for p in range(a, b)],
                            dtype=I64, device=DEV)

    def qkv_rows(self, ks, vs, qs=None):
        """key/value (and query) as vLLM passes them: column slices of one qkv tensor,
        with `pad` padding rows at the end."""
        n = sum(k.shape[0] for k in ks)
        h, hk, d = self.h, self.hk, self.d
        qkv = torch.randn(n + self.pad, (h + 2 * hk) * d, device=DEV, dtype=F16, generator=self.g)
        q = qkv[:, :h * d].view(-1, h, d)
        k = qkv[:, h * d:(h + hk) * d].view(-1, hk, d)
        v = qkv[:, (h + hk) * d:].view(-1, hk, d)
        k[:n], v[:n] = torch.cat(ks), torch.cat(vs)
        if qs is not None:
            q[:n] = torch.cat(qs)
        return q, k, v

    def write_context(self):
        """Earlier steps: the prefix of each request through the same cache write."""
        ctx = [n - q for n, q in zip(self.seq_lens, self.query_lens)]
        if sum(ctx) == 0:
            return
        _, k, v = self.qkv_rows([k[:c] for k, c in zip(self.keys, ctx)],
                                [v[:c] for v, c in zip(self.vals, ctx)])
        slots = self.slots([(0, c) for c in ctx])
        slots = torch.cat([slots, torch.full((2,), -1, dtype=I64, device=DEV)])  # padded slots
        _compute.write_kv_cache(k, v, self.kv, slots, self.d)

    def step(self):
        """This step: new tokens written through slot_mapping, then attention. Returns the
        output rows of the real tokens."""
        ranges = [(n - q, n) for n, q in zip(self.seq_lens, self.query_lens)]
        query, key, value = self.qkv_rows([k[a:b] for k, (a, b) in zip(self.keys, ranges)],
                                          [v[a:b] for v, (a, b) in zip(self.vals, ranges)],
                                          self.qs)
        slot_mapping = self.slots(ranges)
        _compute.write_kv_cache(key, value, self.kv, slot_mapping, self.d)
        return query, slot_mapping

    def metadata(self, slot_mapping, plan=None, max_seq_len=None):
        qsl = [0]
        for q in self.query_lens:
            qsl.append(qsl[-1] + q)
        return _compute.Sm7xAttentionMetadata(
            num_actual_tokens=qsl[-1], max_query_len=max(self.query_lens),
            query_start_loc=torch.tensor(qsl, dtype=I32, device=DEV),
            max_seq_len=max_seq_len or max(self.seq_lens),
            seq_lens=torch.tensor(self.seq_lens, dtype=I32, device=DEV),
            block_table=self.block_table, slot_mapping=slot_mapping, plan=plan)

    def reference(self, window=(-1, -1), softcap=0.0):
        """float32 attention of each request's queries over its keys: SDPA with the
        bottom-right causal (and window) mask; softcap: the same in plain torch."""
        outs = []
        for q, k, v in zip(self.qs, self.keys, self.vals):
            sq, sk = q.shape[0], k.shape[0]
            i = torch.arange(sq, device=DEV)[:, None] + (sk - sq)
            j = torch.arange(sk, device=DEV)[None, :]
            mask = j <= i
            if window[0] >= 0:
                mask &= j >= i - window[0]
            qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))  # [heads, s, d]
            if softcap == 0.0:
                o = torch.nn.functional.scaled_dot_product_attention(
                    qf, kf, vf, attn_mask=mask, scale=self.d ** -0.5, enable_gqa=True)
            else:
                kf = kf.repeat_interleave(self.h // self.hk, 0)
                vf = vf.repeat_interleave(self.h // self.hk, 0)
                s = softcap * torch.tanh((qf @ kf.transpose(-1, -2)) * self.d ** -0.5 / softcap)
                o = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vf
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)


MIXED = dict(  # a whole prefill, prefill chunks over prefixes, decodes (one at a page edge)
    query_lens=[77, 1, 40, 1, 1, 16, 3],
    seq_lens=[77, 300, 240, 16, 1, 529, 1030])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h, hk", [(8, 2), (16, 2), (8, 8)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_mixed_batch(d, h, hk, layout):
    b = Batch(MIXED["query_lens"], MIXED["seq_lens"], h, hk, d, max_blocks=72,
              num_blocks=200, seed=d + h + hk, layout=layout)
    b.write_context()
    query, slot_mapping = b.step()
    md = b.metadata(slot_mapping)
    output = torch.full(query.shape, float("nan"), dtype=F16, device=DEV)
    _compute.attention(query, b.kv, output, md, head_size=d, scale=d ** -0.5)
    n = md.num_actual_tokens
    err = (output[:n].float() - b.reference()).abs().max().item()
    _record(f"out {TAG} mixed d={d} h={h}/{hk} {layout}", err)
    assert err <= ATOL, f"max |out - SDPA| = {err}"
    assert torch.isnan(output[n:]).all(), "padding rows were written"


@pytest.mark.parametrize("window, softcap", [(64, 0.0), (1, 0.0), (None, 30.0), (100, 20.0)])
def test_mixed_batch_window_softcap(window, softcap):
    d, h, hk = 128, 16, 4
    b = Batch(MIXED["query_lens"], MIXED["seq_lens"], h, hk, d, max_blocks=72,
              num_blocks=200, seed=7)
    b.qs = [q * 3 for q in b.qs] if softcap else b.qs  # logits large enough to be capped
    b.write_context()
    query, slot_mapping = b.step()
    md = b.metadata(slot_mapping)
    output = torch.empty(query.shape, dtype=F16, device=DEV)
    win = flash_window(window)
    _compute.attention(query, b.kv, output, md, head_size=d, scale=d ** -0.5,
                       window_size=win, softcap=softcap)
    err = (output[:md.num_actual_tokens].float() - b.reference(win, softcap)).abs().max().item()
    _record(f"out {TAG} window={window} softcap={softcap}", err)
    assert err <= ATOL, f"max |out - reference| = {err}"


def test_cache_holds_exactly_what_slot_mapping_wrote():
    b = Batch(MIXED["query_lens"], MIXED["seq_lens"], 8, 2, 64, max_blocks=72,
              num_blocks=200, seed=3)
    b.write_context()
    b.step()
    key_cache, value_cache = _compute.kv_cache_views(b.kv, 64)
    bt = b.block_table.long()
    written = torch.zeros(b.kv.shape[0], BLOCK, dtype=torch.bool, device=DEV)
    for r, n in enumerate(b.seq_lens):
        pos = torch.arange(n, device=DEV)
        blocks, offs = bt[r, pos // BLOCK], pos % BLOCK
        assert torch.equal(key_cache[blocks, offs], b.keys[r])
        assert torch.equal(value_cache[blocks, offs], b.vals[r])
        written[blocks, offs] = True
    assert (b.kv.transpose(1, 2)[~written] == 0).all(), "a slot no token maps to was written"


def test_decode_batch_in_a_cuda_graph():
    """What vLLM does under full CUDA graphs with the metadata builder's plan: capture the
    cache write and the attention of a decode batch once, replay with new tokens, cache
    contents and lengths (up to the plan's bound, max_model_len)."""
    h, hk, d, max_model_len, reqs = 32, 8, 128, 2048, 6
    max_blocks = max_model_len // BLOCK
    b = Batch([1] * reqs, [5, 700, 1, 2048, 64, 300], h, hk, d, max_blocks=max_blocks,
              num_blocks=reqs * max_blocks + 2, seed=11, pad_tokens=2)
    plan = _compute.make_plan(reqs, 1, max_model_len, h, hk, d, DEV)
    # static buffers the graph reads (vLLM's persistent input buffers)
    query, key, value = b.qkv_rows([k[-1:] for k in b.keys], [v[-1:] for v in b.vals], b.qs)
    slot_mapping = b.slots([(n - 1, n) for n in b.seq_lens])
    md = b.metadata(slot_mapping, plan=plan, max_seq_len=max_model_len)
    output = torch.empty(query.shape, dtype=F16, device=DEV)

    def step():
        _compute.write_kv_cache(key, value, b.kv, md.slot_mapping, d)
        _compute.attention(query, b.kv, output, md, head_size=d, scale=d ** -0.5)

    b.write_context()
    graph, _ = capture(step)
    for seed, lens in ((1, [6, 701, 2, 2048, 65, 301]), (2, [2048, 1, 1000, 17, 16, 33])):
        nb = Batch([1] * reqs, lens, h, hk, d, max_blocks=max_blocks,
                   num_blocks=reqs * max_blocks + 2, seed=100 + seed, pad_tokens=2)
        nb.block_table = b.block_table  # same pages, new contents
        nb.kv = b.kv
        nb.kv.zero_()
        nb.write_context()
        q2, k2, v2 = nb.qkv_rows([k[-1:] for k in nb.keys], [v[-1:] for v in nb.vals], nb.qs)
        query.copy_(q2), key.copy_(k2), value.copy_(v2)
        md.slot_mapping.copy_(nb.slots([(n - 1, n) for n in lens]))
        md.seq_lens.copy_(torch.tensor(lens, dtype=I32))
        graph.replay()
        torch.cuda.synchronize()
        err = (output[:reqs].float() - nb.reference()).abs().max().item()
        _record(f"out {TAG} graph decode replay", err)
        assert err <= ATOL, f"replay with lengths {lens}: max |out - SDPA| = {err}"


def test_zz_report_worst_errors():
    assert any(TAG in key for key in WORST), "no comparison of this file ran"
    report_worst(f" (vLLM backend compute path, {TAG})")
