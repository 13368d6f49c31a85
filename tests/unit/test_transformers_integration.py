"""sm7x.integrations.transformers on the CPU: registration, the refusals, and the glue
(masks, left padding, static and sliding caches, packed and paged batches) with sm7x's
three FA2 entry points replaced by a float32 reference of their documented semantics.
Training: gradients against eager attention, through that reference and through sm7x.fa2's
own autograd ops on a CPU stand-in library (tests/unit/fa2_cpu_ops.py). Small random-weight
models (Llama-style GQA, Qwen2 with a sliding window, Gemma 2 with
softcap and sliding window) in float16 are compared with transformers' eager attention.

The kernels themselves run in tests/gpu/test_transformers_generate.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))  # the shared reference
from fa2_reference import gather_paged, reference  # noqa: E402

from sm7x.integrations import transformers as tf_sm7x  # noqa: E402

# ---------------------------------------------------------------------------------------
# float32 reference of the sm7x.fa2 calls the integration makes (bottom-right masks)


class FakeFa2:
    """Stands in for sm7x.fa2 inside the integration and records which entry ran."""

    def __init__(self):
        self.calls = []
        self.plans = 0
        self.checks = set()  # check_inputs of every cache call

    @staticmethod
    def _attend(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                s_aux=None):
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out, _ = reference(q, k, v, scale, causal, tuple(window_size), softcap or 0.0,
                           sinks=s_aux)
        return out.to(q.dtype)

    def flash_attn_func(self, q, k, v, **opts):
        self.calls.append("func")
        return self._attend(q, k, v, **opts)

    def plan_decode(self, batch, sq, sk, heads, kv_heads, hd, device=None):
        self.plans += 1
        return ("plan", batch, sq, sk, heads, kv_heads, hd)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, cache_seqlens=None,
                                cache_leftpad=None, scheduler_metadata=None, check_inputs=None,
                                **opts):
        self.calls.append("kvcache" + ("+leftpad" if cache_leftpad is not None else ""))
        self.checks.add(check_inputs)
        # the integration's plan: this shape, at least this many keys
        _, batch, sq, sk, heads, kv_heads, hd = scheduler_metadata
        assert (batch, sq, heads, kv_heads, hd) == (q.shape[0], q.shape[1], *q.shape[2:3],
                                                    k_cache.shape[2], q.shape[3])
        assert sk >= k_cache.shape[1]
        outs = []
        for b in range(q.shape[0]):
            hi = k_cache.shape[1] if cache_seqlens is None else int(
                torch.as_tensor(cache_seqlens).reshape(-1).expand(q.shape[0])[b])
            lo = 0 if cache_leftpad is None else int(cache_leftpad[b])
            outs.append(self._attend(q[b:b + 1], k_cache[b:b + 1, lo:hi], v_cache[b:b + 1, lo:hi],
                                     **opts))
        return torch.cat(outs)

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, block_table=None,
                               seqused_k=None, out=None, **opts):
        self.calls.append("varlen" + ("+paged" if block_table is not None else ""))
        out = torch.zeros_like(q) if out is None else out
        for i in range(cu_q.shape[0] - 1):
            q0, q1 = int(cu_q[i]), int(cu_q[i + 1])
            if block_table is not None:
                n = int(seqused_k[i])
                ks, vs = (gather_paged(c, block_table, i, n) for c in (k, v))
            else:
                ks, vs = k[int(cu_k[i]):int(cu_k[i + 1])], v[int(cu_k[i]):int(cu_k[i + 1])]
            assert q1 - q0 <= max_q and ks.shape[0] <= max_k
            if q1 > q0:
                out[q0:q1] = self._attend(q[None, q0:q1], ks[None], vs[None], **opts)[0]
        return out


@pytest.fixture
def fake(monkeypatch):
    f = FakeFa2()
    monkeypatch.setattr(tf_sm7x, "fa2", f)
    monkeypatch.setattr(tf_sm7x, "_plans", {})
    monkeypatch.setattr(tf_sm7x, "_layouts", {})
    return f


# ---------------------------------------------------------------------------------------
# tiny fp16 models from configs (no download)


def _model(kind: str, attn: str):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, pad_token_id=0, eos_token_id=None,
                  bos_token_id=None)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=6,
                                       max_window_layers=1)
        cfg.layer_types = ["full_attention", "sliding_attention"]
    elif kind == "gemma2":
        cfg = transformers.Gemma2Config(**common, sliding_window=6, attn_logit_softcapping=5.0,
                                        final_logit_softcapping=30.0, query_pre_attn_scalar=16)
    elif kind == "gemma3":  # no softcap; sliding layers with their own rope base
        cfg = transformers.Gemma3TextConfig(**common, sliding_window=6, query_pre_attn_scalar=16,
                                            layer_types=["sliding_attention", "full_attention"])
    elif kind == "gemma4":  # full-attention layers of head dim 512 beside sliding ones of 16
        cfg = transformers.Gemma4TextConfig(**common, global_head_dim=512, sliding_window=6,
                                            layer_types=["sliding_attention", "full_attention"],
                                            vocab_size_per_layer_input=128,
                                            hidden_size_per_layer_input=16)
    elif kind == "gptoss":  # attention sinks, alternating with sliding-window layers
        cfg = transformers.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=6,
                                        layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters=dict(rope_type="default",
                                                             rope_theta=10000.0))
    else:
        raise AssertionError(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    for layer in model.model.layers if kind == "gptoss" else ():
        with torch.no_grad():  # sinks that matter (initialized near 0): some rows mostly sink
            layer.self_attn.sinks.normal_(0.0, 2.0)
    for layer in model.model.layers if kind == "gemma4" else ():
        with torch.no_grad():  # Gemma 4 scales scores by 1 after q/k norms: random norms give
            # scores of std sqrt(head_dim), 22.6 at d512, where eager's own fp16 scores are off
            # by 0.03; 1 / sqrt(head_dim) on q's norm gives std ~1, as a trained model's
            layer.self_attn.q_norm.weight.mul_(layer.self_attn.head_dim ** -0.5)
    return model.half().eval()


def _batch(lens, side="left", vocab=128):
    g = torch.Generator().manual_seed(1)
    width = max(lens)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        sl = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, sl] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, sl] = 1
    return ids, mask


def _twin(kind):
    """The same weights under eager and sm7x."""
    ref = _model(kind, "eager")
    ours = _model(kind, "eager")
    ours.set_attn_implementation(tf_sm7x.NAME)
    return ref, ours


# ---------------------------------------------------------------------------------------


def test_registered_names():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert tf_sm7x.register() == "sm7x"
    assert AttentionInterface._global_mapping["sm7x"] is tf_sm7x.attention_forward
    assert AttentionInterface._global_mapping["paged|sm7x"] is tf_sm7x.paged_attention_forward
    assert "sm7x" in AttentionMaskInterface._global_mapping


def test_import_sm7x_integrations_imports_no_framework():
    code = ("import sys, sm7x, sm7x.integrations; "
            "bad = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "gemma3", "gemma4", "gptoss"])
@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_forward_logits_match_eager(fake, kind, side):
    ref, ours = _twin(kind)
    lens = [11, 11, 11] if side == "none" else [11, 4, 8]
    ids, mask = _batch(lens, "left" if side == "none" else side)
    with torch.no_grad():
        a = ref(input_ids=ids, attention_mask=mask).logits
        b = ours(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    err = (a[valid].float() - b[valid].float()).abs().max().item()
    assert err < 2e-2, f"{kind} {side}: max |logits - eager| = {err}"
    # no padding: no mask, the plain call; padding on the left or right: unpadded varlen
    assert fake.calls[0] == ("func" if side == "none" else "varlen"), fake.calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "gemma3", "gemma4", "gptoss"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_left_padded_matches_eager(fake, kind, cache):
    ref, ours = _twin(kind)
    ids, mask = _batch([9, 3, 6])
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
              output_scores=True, cache_implementation=cache)
    with torch.inference_mode():  # inference tensors: no version counters (a real trap)
        a = ref.generate(input_ids=ids, attention_mask=mask, **kw)
        b = ours.generate(input_ids=ids, attention_mask=mask, **kw)
    first = _first_difference(a, b)
    assert first is None, f"{kind}/{cache}: tokens differ from eager first at step {first}"
    # decode with left padding reads the cache in place (cache_leftpad), never unpads
    assert "kvcache+leftpad" in fake.calls, fake.calls
    # lengths, left padding and plan are the integration's own: no device-side check
    assert fake.checks == {False}, fake.checks
    decode_calls = fake.calls[len(fake.calls) // 2:]
    assert "varlen" not in decode_calls, fake.calls


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_mask_analysed_once_per_forward(monkeypatch, mode):
    syncs = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: syncs.append(1) or real(t))
    monkeypatch.setattr(tf_sm7x, "_layouts", {})
    with mode():
        mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
        first = tf_sm7x._mask_layout(mask, 0)
        for layer in (1, 2, 3):  # the later layers of the forward: no new sync
            assert tf_sm7x._mask_layout(mask, layer) is first
        assert len(syncs) == 1 and first[3] and not first[4]  # left padded, not all ones
        mask[0, 0] = 1  # changed in place between forwards: the next forward sees it
        again = tf_sm7x._mask_layout(mask, 0)
        assert len(syncs) == 2 and again[4]
        assert tf_sm7x._mask_layout(mask, None) is not again  # no layer index: no reuse
        assert not tf_sm7x._mask_layout(torch.tensor([[1, 0, 1]]), 0)[3]  # a hole


def test_unpadding_worked_out_once_per_forward(fake, monkeypatch):
    """A right-padded training batch is unpadded to varlen calls: the kept rows' indices,
    cu_seqlens and longest lengths (host syncs) come from the first layer of a forward;
    the later layers reuse them (the same cu_seqlens tensors) and compute the same thing."""
    syncs = []
    for name in ("tolist", "nonzero"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda t, *a, _n=name, _r=real, **k: syncs.append(_n) or _r(t, *a, **k))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 5, n, 16, generator=g).half() for n in (4, 2, 2))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    opts = dict(softmax_scale=0.25, causal=True, window_size=(-1, -1), softcap=0.0)
    outs = [tf_sm7x._masked(q, k, v, mask, opts, layer) for layer in range(4)]
    assert fake.calls == ["varlen"] * 4
    assert sorted(syncs) == ["nonzero", "tolist", "tolist"], syncs  # layer 0 only
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    want = FakeFa2._attend(q[:1, :3], k[:1, :3], v[:1, :3], **opts)
    assert torch.equal(outs[0][:1, :3], want) and not outs[0][:1, 3:].any()


def test_packing_worked_out_once_per_forward(fake, monkeypatch):
    """A padding-free batch with int64 cu_seq_lens and no max lengths: the int32 copies and
    the longest runs (a host read) come from a forward's first layer; the later layers pass
    the same cu_seqlens tensors (sm7x.fa2 checks a tensor once), and a new forward (layer 0
    again) works them out afresh, so cu_seq_lens changed in place are never read stale."""
    seen, syncs = [], []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda t, *a, **k: syncs.append(1) or real_tolist(t, *a, **k))
    real_varlen = fake.flash_attn_varlen_func
    monkeypatch.setattr(fake, "flash_attn_varlen_func",
                        lambda q, k, v, cu_q, cu_k, *a, **kw: seen.append((cu_q, cu_k))
                        or real_varlen(q, k, v, cu_q, cu_k, *a, **kw))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 9, n, 16, generator=g).half() for n in (4, 2, 2))
    cu = torch.tensor([0, 4, 9])  # int64, as a hand-built batch passes it
    opts = dict(softmax_scale=0.25, causal=True, window_size=(-1, -1), softcap=0.0)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    outs = [tf_sm7x._packed(q, k, v, kwargs, opts, layer) for layer in range(4)]
    assert len(syncs) == 1, syncs
    assert all(c[0] is seen[0][0] and c[1] is seen[0][1] for c in seen)
    assert seen[0][0].dtype == torch.int32
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    cu[1] = 6  # in place, between forwards
    again = tf_sm7x._packed(q, k, v, kwargs, opts, 0)
    assert len(syncs) == 2 and seen[-1][0] is not seen[0][0]
    assert seen[-1][0].tolist() == [0, 6, 9]
    want = FakeFa2._attend(q[:, 6:], k[:, 6:], v[:, 6:], **opts)
    assert torch.equal(again[:, 6:], want)


def test_packing_traced_in_a_compiled_forward(fake, monkeypatch):
    """A compiled forward over a padding-free batch (max lengths given, as
    DataCollatorWithFlattening passes them) traces the packing in one graph: the host-side
    cache of eager forwards stays out of it."""
    seen = []
    monkeypatch.setattr(fake, "flash_attn_varlen_func",
                        lambda q, k, v, cu_q, cu_k, max_q, max_k, **kw:
                        seen.append((cu_q.dtype, max_q, max_k)) or q * 2)
    q, k, v = (torch.randn(1, 9, n, 16).half() for n in (4, 2, 2))
    kwargs = {"cu_seq_lens_q": torch.tensor([0, 4, 9]), "cu_seq_lens_k": torch.tensor([0, 4, 9]),
              "max_length_q": 5, "max_length_k": 5}
    opts = dict(softmax_scale=0.25, causal=True, window_size=(-1, -1), softcap=0.0)
    compiled = torch.compile(lambda q, k, v: tf_sm7x._packed(q, k, v, kwargs, opts, 0),
                             backend="eager", fullgraph=True)
    out = compiled(q, k, v)
    assert torch.equal(out, q * 2)
    assert seen and seen[-1] == (torch.int32, 5, 5)
    assert not tf_sm7x._packings or all(p[0][0] is not kwargs["cu_seq_lens_q"]
                                        for p in tf_sm7x._packings.values())


def _first_difference(a, b):
    """The first generated step where the tokens differ, or None. A step where every
    differing token ties with eager's pick in eager's own fp16 logits is a tie, not a
    difference (the sequences part there legitimately; later steps are not compared)."""
    diff = (a.sequences != b.sequences).any(0).nonzero()
    if diff.numel() == 0:
        return None
    step = int(diff[0])
    scores = a.scores[step - (a.sequences.shape[1] - len(a.scores))].float()
    rows = (a.sequences[:, step] != b.sequences[:, step]).nonzero().squeeze(1)
    picked = scores[rows, b.sequences[rows, step]]
    return None if torch.equal(picked, scores[rows].max(-1).values) else step


def test_generate_batch_one_no_mask_uses_decode_kernel(fake):
    ref, ours = _twin("llama")
    ids, _ = _batch([7])
    with torch.no_grad():
        a = ref.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        b = ours.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)
    assert fake.calls[0] == "func" and set(fake.calls[2:]) == {"kvcache"}, fake.calls
    assert fake.plans == 1  # one plan for all layers and steps (7 + 6 keys < 256)
    assert fake.checks == {False}, fake.checks  # the plan is the integration's own


def test_packed_padding_free_batch(fake):
    """DataCollatorWithFlattening's layout: one row, sequences bounded by cu_seq_lens."""
    ref, ours = _twin("llama")
    ids, _ = _batch([5, 7])
    a_parts = []
    with torch.no_grad():
        for row in ids:
            a_parts.append(ref(input_ids=row[None]).logits[0])
        flat = ids.reshape(1, -1)
        pos = torch.cat([torch.arange(7), torch.arange(7)])[None]
        cu = torch.tensor([0, 7, 14], dtype=torch.int32)
        b = ours(input_ids=flat, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                 max_length_q=7, max_length_k=7).logits[0]
    err = (torch.cat(a_parts).float() - b.float()).abs().max().item()
    assert err < 2e-2
    assert "varlen" in fake.calls


def _positions_row(ref, ours, lens=(5, 9, 2)):
    """(the sequences, ref's logits over each alone, ours' over them packed in one row that
    only position_ids bound: DataCollatorWithFlattening's default)."""
    ids, _ = _batch(list(lens))
    rows = [ids[i, ids.shape[1] - n:] for i, n in enumerate(lens)]
    with torch.no_grad():
        want = torch.cat([ref(input_ids=r[None]).logits[0] for r in rows])
        got = ours(input_ids=torch.cat(rows)[None],
                   position_ids=torch.cat([torch.arange(n) for n in lens])[None]).logits[0]
    return rows, want, got


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "gemma3", "gemma4", "gptoss"])
def test_packed_by_position_ids_alone(fake, monkeypatch, kind):
    """DataCollatorWithFlattening's default row (position_ids, no cu_seq_lens; sequences of
    5, 9 and 2 tokens): each sequence attends to itself only, as eager attention over each
    alone, and the bounds are read once per forward. Before, the row was one sequence."""
    ref, ours = _twin(kind)
    reads = []
    real = tf_sm7x._packing_of_positions
    monkeypatch.setattr(tf_sm7x, "_packing_of_positions", lambda p: reads.append(1) or real(p))
    rows, want, got = _positions_row(ref, ours)
    with torch.no_grad():
        one = ours(input_ids=rows[1][None], position_ids=torch.arange(9)[None]).logits[0]
    assert (want.float() - got.float()).abs().max().item() < 2e-2
    assert (want[5:14].float() - one.float()).abs().max().item() < 2e-2
    assert "varlen" in fake.calls and fake.calls[-1] == "func"  # one sequence: dense
    assert len(reads) == 2, reads  # once per forward, not per layer


def test_packed_by_position_ids_alone_compiled(fake):
    """The same row under torch.compile: the bounds' host read is a graph break (as in
    transformers' flash path), and the sequences still attend to themselves only."""
    ref, ours = _twin("llama")
    torch._dynamo.reset()
    ours.forward = torch.compile(ours.forward, backend="aot_eager")
    _, want, got = _positions_row(ref, ours)
    assert (want.float() - got.float()).abs().max().item() < 2e-2
    assert "varlen" in fake.calls


def test_packed_position_ids_that_do_not_start_a_sequence_are_refused():
    """A row whose first token is not at the smallest position has tokens before its first
    sequence start: no bounds fit it."""
    pos = torch.tensor([[3, 4, 0, 1, 2]])
    with pytest.raises(ValueError, match=r"first restart is at token 2.*cu_seq_lens_q/k"):
        tf_sm7x._packing_of_positions(pos)
    cu, cu_k, longest, longest_k = tf_sm7x._packing_of_positions(torch.tensor([[0, 1, 0, 1, 2]]))
    assert cu.tolist() == [0, 2, 5] and cu.dtype == torch.int32 and cu_k is cu
    assert longest == longest_k == 3
    assert tf_sm7x._packing_of_positions(torch.tensor([[4, 5, 6]])) is None


@pytest.mark.parametrize("kind", ["llama", "gptoss"])  # gpt-oss: sinks, sliding layers
def test_continuous_batching_paged_matches_generate(fake, kind):
    ref, ours = _twin(kind)
    prompts = [[5, 9, 3, 7, 2, 11, 4, 8, 1, 6][:n] for n in (10, 4, 7)]
    gen_cfg = transformers.GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None,
                                            pad_token_id=0)
    with torch.no_grad():
        expect = [ref.generate(input_ids=torch.tensor([p]), generation_config=gen_cfg)[0,
                                                                                       len(p):]
                  for p in prompts]
        # pages of 4 tokens, at most 8 tokens a step: the 10-token prompt is prefilled in
        # chunks over its own cached pages, then every request decodes from its pages
        cb = transformers.ContinuousBatchingConfig(block_size=4, num_blocks=32,
                                                   max_batch_tokens=8)
        got = ours.generate_batch(inputs=prompts, generation_config=gen_cfg,
                                  continuous_batching_config=cb, progress_bar=False)
    for i, p in enumerate(prompts):
        out = next(r for r in got.values() if list(r.prompt_ids) == p)
        assert out.generated_tokens == expect[i].tolist(), (i, out.generated_tokens,
                                                             expect[i].tolist())
    assert ours.config._attn_implementation == "sm7x"  # restored after the batch
    assert "varlen+paged" in fake.calls, fake.calls


# ---------------------------------------------------------------------------------------
# what sm7x cannot do is refused, naming it and the way out


def test_bf16_is_refused_with_the_fix(fake):
    _, ours = _twin("llama")
    ours = ours.to(torch.bfloat16)
    ids, mask = _batch([4, 4])
    with pytest.raises(ValueError, match=r"float16 only.*dtype=torch.float16"):
        with torch.no_grad():
            ours(input_ids=ids, attention_mask=mask)


def test_output_attentions_is_refused(fake):
    _, ours = _twin("llama")
    ids, mask = _batch([4, 4])
    with pytest.raises(ValueError, match=r"output_attentions.*eager"):
        with torch.no_grad():
            ours(input_ids=ids, attention_mask=mask, output_attentions=True)


def test_custom_4d_mask_is_refused(fake):
    _, ours = _twin("llama")
    ids, _ = _batch([4, 4])
    mask4 = torch.ones(2, 1, 4, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"arbitrary attention mask.*sdpa"):
        with torch.no_grad():
            ours(input_ids=ids, attention_mask=mask4)


@pytest.mark.parametrize("bad, got", [({"cu_seq_lens_k": None}, "got nothing as cu_seq_lens_k"),
                                      ({"cu_seq_lens_q": [0, 4, 9]}, "got a list as cu_seq_lens_q"),
                                      ({"cu_seq_lens_k": torch.tensor([[0, 9]])},
                                       "got a 2-D tensor as cu_seq_lens_k")])
def test_padding_free_batch_with_bad_cu_seq_lens_is_refused(fake, bad, got):
    """A hand-built padding-free batch with one cu_seq_lens missing or not a 1-D tensor gets
    a message naming it, not a KeyError or AttributeError from inside the integration."""
    q, k, v = (torch.zeros(1, 9, 2, 16, dtype=torch.float16) for _ in range(3))
    kwargs = {"cu_seq_lens_q": torch.tensor([0, 4, 9]), "cu_seq_lens_k": torch.tensor([0, 4, 9])}
    kwargs.update(bad)
    opts = dict(softmax_scale=0.25, causal=True, window_size=(-1, -1), softcap=0.0)
    with pytest.raises(ValueError, match=got + r".*1-D integer tensors"):
        tf_sm7x._packed(q, k, v, {k_: v_ for k_, v_ in kwargs.items() if v_ is not None},
                        opts, 0)


# ---------------------------------------------------------------------------------------
# training: the forward's calls are differentiable


def _grads(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.float() for n, p in model.named_parameters()
                             if p.grad is not None}


def _compare_grads(ref, ours, what):
    a_loss, a = ref
    b_loss, b = ours
    assert abs(a_loss - b_loss) < 1e-2 * max(1.0, abs(a_loss)), (what, a_loss, b_loss)
    assert set(a) == set(b) and len(a) > 5, (what, sorted(set(a) ^ set(b)))
    for name in a:
        scale = max(a[name].abs().max().item(), 1e-4)
        err = (a[name] - b[name]).abs().max().item()
        assert err <= 3e-2 * scale, f"{what}: grad of {name}: max err {err} (max |grad| {scale})"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "gptoss"])
@pytest.mark.parametrize("side", ["none", "right"])
def test_training_gradients_match_eager(fake, kind, side):
    """model.train() + backward: no refusal, and every parameter's gradient matches eager
    attention's (the glue -- unpadding, casts, windows, softcap -- is differentiable)."""
    ref, ours = _twin(kind)
    ref.train(), ours.train()
    lens = [10, 10] if side == "none" else [10, 6]
    ids, mask = _batch(lens, "right")
    labels = ids.masked_fill(mask == 0, -100)
    _compare_grads(_grads(ref, ids, mask, labels), _grads(ours, ids, mask, labels), f"{kind} {side}")
    assert fake.calls[0] == ("func" if side == "none" else "varlen"), fake.calls


@pytest.mark.parametrize("side", ["none", "right", "packed", "packed_positions"])
def test_training_runs_sm7x_backward(monkeypatch, side):
    """The real sm7x.fa2 API (its autograd ops) on a CPU stand-in library: training calls
    the library's bwd / bwd_varlen, and the gradients match eager attention's. Packed:
    DataCollatorWithFlattening's row with cu_seq_lens, or with position_ids alone (its
    default), where the sequences' bounds come from the restarts of the positions."""
    import fa2_cpu_ops

    fa2_cpu_ops.use(monkeypatch)
    monkeypatch.setattr(tf_sm7x, "_layouts", {})
    ref, ours = _twin("llama")
    ref.train(), ours.train()
    if side.startswith("packed"):  # DataCollatorWithFlattening: one row of sequences
        ids, _ = _batch([5, 7])
        flat = ids.reshape(1, -1)
        pos = torch.cat([torch.arange(7), torch.arange(7)])[None]
        cu = torch.tensor([0, 7, 14], dtype=torch.int32)
        ref.zero_grad(set_to_none=True)  # eager: each sequence on its own, losses summed
        loss_a = sum(ref(input_ids=row[None], labels=row[None]).loss for row in ids)
        loss_a.backward()
        a = (loss_a.item(), {n: p.grad.float() for n, p in ref.named_parameters()})
        ours.zero_grad(set_to_none=True)
        bounds = (dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
                  if side == "packed" else {})
        logits = ours(input_ids=flat, position_ids=pos, **bounds).logits[0].float()
        loss_b = sum(torch.nn.functional.cross_entropy(logits[i * 7:i * 7 + 6],
                                                       flat[0, i * 7 + 1:(i + 1) * 7])
                     for i in range(2))
        loss_b.backward()
        b = (loss_b.item(), {n: p.grad.float() for n, p in ours.named_parameters()})
        _compare_grads(a, b, side)
        assert fa2_cpu_ops.ops("bwd_varlen") and not fa2_cpu_ops.ops("bwd")
        return
    ids, mask = _batch([10, 10] if side == "none" else [10, 6], "right")
    labels = ids.masked_fill(mask == 0, -100)
    _compare_grads(_grads(ref, ids, mask, labels), _grads(ours, ids, mask, labels), side)
    name = "bwd" if side == "none" else "bwd_varlen"
    assert len(fa2_cpu_ops.ops(name)) == 2, fa2_cpu_ops.CALLS  # one per layer


@pytest.mark.parametrize("how", ["default", "env", "torch"])
def test_training_deterministic_as_transformers_flash_path_asks(monkeypatch, how):
    """FLASH_ATTENTION_DETERMINISTIC=1 (transformers' enable_full_determinism() sets it;
    its flash path reads it) or torch.use_deterministic_algorithms(True): the backward
    calls ask the library for a fixed order of dQ sums; by default they do not."""
    import fa2_cpu_ops

    fa2_cpu_ops.use(monkeypatch)
    monkeypatch.setattr(tf_sm7x, "_layouts", {})
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    if how == "env":
        monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    elif how == "torch":  # (the flag itself, not the mode: CPU ops refuse some calls in it)
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    _, ours = _twin("llama")
    ours.train()
    for lens in ([10, 10], [10, 6]):  # dense, then unpadded (varlen)
        ids, mask = _batch(lens, "right")
        _grads(ours, ids, mask, ids.masked_fill(mask == 0, -100))
    calls = fa2_cpu_ops.ops("bwd") + fa2_cpu_ops.ops("bwd_varlen")
    assert len(calls) == 4, fa2_cpu_ops.CALLS
    assert all(c["deterministic"] is (how != "default") for c in calls), calls


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_training_on_data_collator_with_flattening(monkeypatch, flash_kwargs):
    """transformers' DataCollatorWithFlattening, as a Trainer would use it (its default row,
    and with return_flash_attn_kwargs=True): the loss and every gradient through sm7x (the
    real sm7x.fa2 API on the CPU stand-in library) match eager attention's over the same
    collated row (eager reads the sequences' bounds from position_ids when no cache is
    built: use_cache=False)."""
    import fa2_cpu_ops

    fa2_cpu_ops.use(monkeypatch)
    ref, ours = _twin("llama")
    ref.train(), ours.train()
    g = torch.Generator().manual_seed(3)
    features = [{"input_ids": torch.randint(1, 128, (n,), generator=g).tolist()}
                for n in (6, 11, 3, 8)]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
        features)
    grads = []
    for model in (ref, ours):
        model.zero_grad(set_to_none=True)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        grads.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()
                                    if p.grad is not None}))
    _compare_grads(*grads, f"DataCollatorWithFlattening, flash kwargs {flash_kwargs}")
    assert len(fa2_cpu_ops.ops("bwd_varlen")) == 2 and not fa2_cpu_ops.ops("bwd")


def test_training_fp32_weights_under_fp16_autocast(monkeypatch):
    """fp32 master weights, fp16 autocast: the fp32 q/k/v the layers hand over are cast to
    fp16 (differentiably) and the backward runs sm7x's op."""
    import fa2_cpu_ops

    fa2_cpu_ops.use(monkeypatch)
    monkeypatch.setattr(tf_sm7x, "_layouts", {})
    ref, ours = _twin("llama")
    ref.float().train(), ours.float().train()
    ids, mask = _batch([10, 6], "right")
    labels = ids.masked_fill(mask == 0, -100)
    with torch.autocast("cpu", dtype=torch.float16):
        a, b = _grads(ref, ids, mask, labels), _grads(ours, ids, mask, labels)
    _compare_grads(a, b, "autocast")
    assert len(fa2_cpu_ops.ops("bwd_varlen")) == 2
    assert all(p.grad.dtype == torch.float32 for p in ours.parameters() if p.grad is not None)


@pytest.mark.parametrize("reentrant", [False, True])
def test_training_with_gradient_checkpointing(monkeypatch, reentrant):
    import fa2_cpu_ops

    fa2_cpu_ops.use(monkeypatch)
    ref, ours = _twin("llama")
    ref.train(), ours.train()
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids, _ = _batch([9, 9])
    _compare_grads(_grads(ref, ids, None, ids), _grads(ours, ids, None, ids), "checkpointing")
    # each layer's attention ran twice (the recompute) and its backward once
    assert len(fa2_cpu_ops.ops("fwd")) == 4 and len(fa2_cpu_ops.ops("bwd")) == 2, fa2_cpu_ops.CALLS


def test_training_with_attention_dropout_is_refused(fake):
    _, ours = _twin("llama")
    ours.config.attention_dropout = 0.1
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = 0.1
    ours.train()
    ids, mask = _batch([4, 4])
    with pytest.raises(ValueError, match=r"no attention dropout.*attention_dropout to 0.0"):
        ours(input_ids=ids, attention_mask=mask)


def test_paged_without_cache_is_refused(fake):
    _, ours = _twin("llama")
    ours.set_attn_implementation("paged|sm7x")
    ids, _ = _batch([4])
    with pytest.raises(ValueError, match=r"without continuous batching"):
        with torch.no_grad():
            ours(input_ids=ids)


@pytest.mark.parametrize("kind,lens", [("llama", [9, 3, 6]), ("llama", [7, 7]),
                                       ("qwen2", [9, 3, 6]), ("gemma2", [9, 3, 6]),
                                       ("gptoss", [9, 3, 6])])
def test_static_cache_generate_compiles_fullgraph(fake, kind, lens):
    """Static-cache generate compiles its decode step (transformers' CompileConfig,
    fullgraph: any graph break fails the call). The mask layout and decode plans run inside
    the sm7x_transformers::cached_attention op; aot_eager traces the op's fake too. Same
    tokens as eager attention, padded or not, sliding window and softcap."""
    from torch._dynamo.utils import counters

    ref, ours = _twin(kind)
    ids, mask = _batch(lens)
    config = transformers.CompileConfig(fullgraph=True, backend="aot_eager")
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static",
              return_dict_in_generate=True, output_scores=True)
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        a = ref.generate(input_ids=ids, attention_mask=mask, **kw)
        b = ours.generate(input_ids=ids, attention_mask=mask, compile_config=config, **kw)
    assert counters["stats"]["unique_graphs"] >= 1, "generate compiled nothing"
    first = _first_difference(a, b)
    assert first is None, f"{kind}: tokens differ from eager first at step {first}"
    assert ("kvcache+leftpad" if len(set(lens)) > 1 else "kvcache") in fake.calls


def test_compiled_training_with_a_mask_still_runs(fake):
    """A compiled forward that needs gradients keeps the differentiable calls (the op has
    no backward): the mask layout is then a graph break, not an error."""
    ref, ours = _twin("llama")
    ours.train()
    ids, mask = _batch([9, 3, 6])
    ours.forward = torch.compile(ours.forward, backend="aot_eager")
    a = ref(input_ids=ids, attention_mask=mask).logits
    b = ours(input_ids=ids, attention_mask=mask).logits
    b.float().sum().backward()
    keep = mask.bool()
    torch.testing.assert_close(b[keep].float(), a[keep].float(), atol=2e-2, rtol=2e-2)
    assert "varlen" in fake.calls


# ---------------------------------------------------------------------------------------
# vision towers (non-causal, one call per image or window)


def _vision_tower(attn):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    config = transformers.Qwen2_5_VLConfig(vision_config=dict(
        depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=64,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
        fullatt_block_indexes=[1], in_channels=3)).vision_config
    torch.manual_seed(0)
    return modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel._from_config(
        config, attn_implementation=attn).half().eval()


def test_qwen2_5_vl_vision_tower_matches_eager(fake):
    """A Qwen2.5-VL-style vision tower (window attention in block 0, full in block 1) over
    two images: transformers calls a non-flash implementation once per window or image,
    non-causal; sm7x runs each as flash_attn_func."""
    ref, ours = _vision_tower("eager"), _vision_tower(tf_sm7x.NAME)
    grid = torch.tensor([[1, 8, 12], [1, 4, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14,
                         generator=torch.Generator().manual_seed(1)).half()
    with torch.no_grad():
        a, b = ref(pixels, grid_thw=grid), ours(pixels, grid_thw=grid)
    a, b = (getattr(x, "pooler_output", x) for x in (a, b))
    err = (a.float() - b.float()).abs().max().item()
    assert err < 2e-3, f"max |vision features - eager| = {err}"
    # one call per window (block 0) and per image (block 1), each the plain non-causal call
    assert set(fake.calls) == {"func"} and len(fake.calls) > 4, fake.calls
