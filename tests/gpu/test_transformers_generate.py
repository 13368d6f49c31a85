"""transformers models generating through sm7x's kernels, against transformers' own
attention, on a GPU.

Small fp16 models built from configs with random weights (no download): Llama-style GQA
(head dim 64), Qwen2-style with sliding-window layers (head dim 128), Gemma-2-style with
logit softcap and sliding window (head dim 256), Gemma-3-style (MQA, 5 sliding : 1 full
layers, head dim 256), Gemma-4-style (3 sliding layers of head dim 256 : 1 full layer of
head dim 512). Greedy generation of 64 tokens from a
batch of prompts of different lengths (left padded), with a dynamic and a static cache,
without padding, and through continuous batching (``generate_batch`` with
``"paged|sm7x"``, pages of 16 tokens, chunked prefill), compared with the same weights
under ``"sdpa"`` (``"eager"`` for Gemma 2: transformers' SDPA path has no softcap).

Equality: the generated tokens must be the same; where they are not, the logits of both
runs must agree within LOGIT_TOL at every step up to the first difference, and at that
step the reference's two candidate tokens must be within 2 * LOGIT_TOL of each other (a
near tie that fp16 rounding can flip). The first difference and the errors are printed
(-s) and written to $TRANSFORMERS_RESULTS_OUT (JSON) when set.

Marked `gpu`; on GPUs newer than Turing SM7X_FA2_FORCE must name a library:

    SM7X_FA2_FORCE=sm75 pytest -s tests/gpu/test_transformers_generate.py
"""

from __future__ import annotations

import json
import os

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x FA2 needs torch >= {torch_min()}")
if not torch.cuda.is_available():
    pytest.skip("torch.cuda.is_available() is False: no CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers", reason="needs transformers >= 5")

from sm7x.integrations import transformers as sm7x_tf  # noqa: E402

pytestmark = pytest.mark.gpu

NEW_TOKENS = 64
LOGIT_TOL = 0.05
PROMPTS = (37, 100, 5, 70)
RESULTS: list[dict] = []


def _config(kind: str):
    common = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                  max_position_embeddings=1024, pad_token_id=0, eos_token_id=None,
                  bos_token_id=None)
    if kind == "llama":  # GQA 4, head dim 64
        return transformers.LlamaConfig(**common, num_attention_heads=8, num_key_value_heads=2,
                                        head_dim=64), "sdpa"
    if kind == "qwen2":  # GQA 2, head dim 128, sliding window on layers 2 and 3
        cfg = transformers.Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2,
                                       use_sliding_window=True, sliding_window=32,
                                       max_window_layers=2)
        cfg.layer_types = ["full_attention"] * 2 + ["sliding_attention"] * 2
        return cfg, "sdpa"
    if kind == "gemma2":  # head dim 256, softcap 50, alternating sliding window 32
        return transformers.Gemma2Config(**common, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=256, sliding_window=32,
                                         attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0,
                                         query_pre_attn_scalar=256), "eager"
    if kind == "gemma3":  # head dim 256, 5 sliding (window 32, own rope base) : 1 full
        return transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 6}, num_attention_heads=4, num_key_value_heads=1,
            head_dim=256, sliding_window=32, query_pre_attn_scalar=256,
            layer_types=["sliding_attention"] * 5 + ["full_attention"]), "sdpa"
    if kind == "gemma4":  # head dim 512 on the full layer (dim split 4), 256 on 3 sliding
        return transformers.Gemma4TextConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
            global_head_dim=512, sliding_window=32, vocab_size_per_layer_input=1000,
            hidden_size_per_layer_input=64,
            layer_types=["sliding_attention"] * 3 + ["full_attention"]), "sdpa"
    raise AssertionError(kind)


_MODELS: dict = {}


def _model(kind: str):
    """(model, reference implementation); one set of weights per kind."""
    if kind not in _MODELS:
        cfg, ref = _config(kind)
        torch.manual_seed(0)
        with torch.device("cuda"):
            m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
        for layer in m.model.layers if kind == "gemma4" else ():
            with torch.no_grad():  # scores of std ~1 (Gemma 4 scales them by 1 after q/k
                # norms; random norms give std sqrt(head_dim), where fp16 SDPA is off by 0.03)
                layer.self_attn.q_norm.weight.mul_(layer.self_attn.head_dim ** -0.5)
        _MODELS[kind] = (m.eval(), ref)
    return _MODELS[kind]


def _prompts(lens, vocab=1000):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def _left_pad(prompts):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.cuda(), mask.cuda()


def _generate(model, impl, ids, mask, cache="dynamic", **kw):
    model.set_attn_implementation(impl)
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              cache_implementation=cache, return_dict_in_generate=True,
                              output_logits=True, **kw)


def _compare(tag, ref, ours):
    """Tokens equal, or a near tie at the first difference with logits within LOGIT_TOL
    before it; returns the record."""
    width = ref.sequences.shape[1] - NEW_TOKENS
    rec = {"case": tag, "arch": os.environ.get("SM7X_FA2_FORCE"), "sequences": [],
           "max_logit_err": 0.0}
    for b in range(ref.sequences.shape[0]):
        diff = (ref.sequences[b, width:] != ours.sequences[b, width:]).nonzero()
        first = int(diff[0]) if diff.numel() else None
        upto = NEW_TOKENS if first is None else first + 1
        err = max((ref.logits[t][b].float() - ours.logits[t][b].float()).abs().max().item()
                  for t in range(upto))
        rec["max_logit_err"] = max(rec["max_logit_err"], err)
        seq = {"first_difference": first, "max_logit_err": err}
        if first is not None:
            lg = ref.logits[first][b].float()
            seq["tie_margin"] = (lg[ref.sequences[b, width + first]]
                                 - lg[ours.sequences[b, width + first]]).item()
        rec["sequences"].append(seq)
    _report(rec)
    assert rec["max_logit_err"] <= LOGIT_TOL, rec
    for s in rec["sequences"]:
        assert s["first_difference"] is None or s["tie_margin"] <= 2 * LOGIT_TOL, rec
    return rec


def _report(rec):
    RESULTS.append(rec)
    firsts = [s["first_difference"] for s in rec["sequences"]]
    same = sum(f is None for f in firsts)
    print(f"\n{rec['case']} [{rec['arch']}]: {same}/{len(firsts)} sequences token-equal over "
          f"{NEW_TOKENS} tokens, first differences {firsts}, max |logit diff| "
          f"{rec['max_logit_err']:.2e}")
    out = os.environ.get("TRANSFORMERS_RESULTS_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(RESULTS, f, indent=1)


KINDS = ["llama", "qwen2", "gemma2", "gemma3", "gemma4"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_padded_batch(kind, cache):
    model, ref_impl = _model(kind)
    ids, mask = _left_pad(_prompts(PROMPTS))
    ref = _generate(model, ref_impl, ids, mask, cache)
    ours = _generate(model, sm7x_tf.NAME, ids, mask, cache)
    _compare(f"{kind} left-padded batch {list(PROMPTS)}, {cache} cache", ref, ours)


@pytest.mark.parametrize("kind", KINDS)
def test_unpadded_batch(kind):
    model, ref_impl = _model(kind)
    ids, mask = _left_pad(_prompts((48, 48, 48)))
    ref = _generate(model, ref_impl, ids, None)
    ours = _generate(model, sm7x_tf.NAME, ids, None)
    _compare(f"{kind} batch of 3 x 48, no padding", ref, ours)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bounds", ["cu_seq_lens", "position_ids"])
def test_packed_row(kind, bounds):
    """A padding-free row (DataCollatorWithFlattening: sequences of 37, 100, 5 and 70 tokens
    in one row, positions restarting per sequence; with cu_seq_lens, or position_ids alone,
    its default): logits within LOGIT_TOL of each sequence run alone under the reference."""
    model, ref_impl = _model(kind)
    prompts = [torch.tensor(p, device="cuda") for p in _prompts(PROMPTS)]
    row = torch.cat(prompts)[None]
    pos = torch.cat([torch.arange(len(p), device="cuda") for p in prompts])[None]
    kw = {}
    if bounds == "cu_seq_lens":
        cu = torch.tensor([0, *torch.tensor(PROMPTS).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(PROMPTS),
                  max_length_k=max(PROMPTS))
    with torch.no_grad():
        model.set_attn_implementation(ref_impl)
        want = torch.cat([model(input_ids=p[None], use_cache=False).logits[0] for p in prompts])
        model.set_attn_implementation(sm7x_tf.NAME)
        got = model(input_ids=row, position_ids=pos, use_cache=False, **kw).logits[0]
    err = (want.float() - got.float()).abs().max().item()
    print(f"\n{kind} packed row {list(PROMPTS)}, bounds from {bounds}: max |logit diff| "
          f"{err:.2e}")
    assert err < LOGIT_TOL, err


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_static_cache_generate_compiled_fullgraph(mode, padded):
    """Static-cache generate with its decode step compiled by transformers (torch.compile,
    inductor, fullgraph: a graph break inside sm7x's attention fails the call) gives the
    tokens of the same generate run eagerly. reduce-overhead (transformers' default) runs
    CUDA graphs around sm7x's attention op, which reads the mask on the host."""
    from torch._dynamo.utils import counters

    model, _ = _model("llama")
    ids, mask = _left_pad(_prompts(PROMPTS if padded else (48, 48, 48)))
    mask = mask if padded else None
    eager = _generate(model, sm7x_tf.NAME, ids, mask, "static", disable_compile=True)
    torch._dynamo.reset()
    counters.clear()
    config = transformers.CompileConfig(fullgraph=True, mode=mode)
    compiled = _generate(model, sm7x_tf.NAME, ids, mask, "static", compile_config=config)
    assert counters["stats"]["unique_graphs"] >= 1, "generate compiled nothing"
    _compare(f"llama static cache, decode compiled (fullgraph, {mode}), "
             f"{'left-padded' if padded else 'unpadded'}", eager, compiled)


def _paged_cache_sizes(config) -> None:
    """Skips where transformers' own paged cache cannot size itself for the model: in
    transformers 5.17 it reads one global head_dim, which Gemma 4 (512 on full layers, 256
    on sliding ones) refuses with AmbiguousGlobalPerLayerAttributeError before any
    attention implementation runs (PagedAttentionCache.__init__ -> find_head_dim)."""
    try:
        from transformers.generation.continuous_batching.cache import find_head_dim
    except ImportError:
        return  # another layout of transformers: let generate_batch say what it can do
    try:
        find_head_dim(config)
    except Exception as exc:  # noqa: BLE001 - transformers' own error, named in the skip
        pytest.skip(f"transformers {transformers.__version__}'s continuous batching cannot "
                    f"size its paged cache for this model: {type(exc).__name__}")


@pytest.mark.parametrize("kind", KINDS)
def test_continuous_batching(kind):
    """generate_batch through paged|sm7x against one reference generate per prompt."""
    _paged_cache_sizes(_config(kind)[0])
    model, ref_impl = _model(kind)
    prompts = _prompts(PROMPTS)
    gen = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(block_size=16, num_blocks=64,
                                               max_batch_tokens=64)
    model.set_attn_implementation(sm7x_tf.NAME)
    # no_grad, not inference_mode: the batching thread updates the cache in place outside
    # the caller's inference mode (transformers refuses that for any implementation)
    with torch.no_grad():
        got = model.generate_batch(inputs=prompts, generation_config=gen,
                                   continuous_batching_config=cb, progress_bar=False)
    rec = {"case": f"{kind} continuous batching {list(PROMPTS)}, pages of 16, 64 tokens/step",
           "arch": os.environ.get("SM7X_FA2_FORCE"), "sequences": [], "max_logit_err": None}
    by_prompt = {tuple(r.prompt_ids): r.generated_tokens for r in got.values()}
    model.set_attn_implementation(ref_impl)
    for p in prompts:
        toks = by_prompt[tuple(p)]
        with torch.inference_mode():
            ref = model.generate(input_ids=torch.tensor([p], device="cuda"),
                                 generation_config=gen)[0, len(p):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), None)
        seq = {"first_difference": first}
        if first is not None:  # the reference's logits at that prefix: a near tie?
            prefix = torch.tensor([p + ref[:first]], device="cuda")
            with torch.inference_mode():
                lg = model(input_ids=prefix).logits[0, -1].float()
            seq["tie_margin"] = (lg[ref[first]] - lg[toks[first]]).item()
        rec["sequences"].append(seq)
        assert len(toks) == NEW_TOKENS
    _report({**rec, "max_logit_err": float("nan")})
    for s in rec["sequences"]:
        assert s["first_difference"] is None or s["tie_margin"] <= 2 * LOGIT_TOL, rec


@pytest.mark.parametrize("heads, head_dim", [(16, 80), (16, 72)])  # Qwen2.5-VL, Qwen3-VL-like
def test_vision_tower(heads, head_dim):
    """A Qwen2.5-VL-style vision tower (window attention, then full) over two images under
    sm7x against sdpa: transformers calls the attention once per window or image,
    non-causal; head dim 72 runs padded to a compiled one."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    config = transformers.Qwen2_5_VLConfig(vision_config=dict(
        depth=4, hidden_size=heads * head_dim, num_heads=heads, intermediate_size=1024,
        out_hidden_size=512, window_size=112, fullatt_block_indexes=[1, 3])).vision_config
    outs = {}
    for impl in ("sdpa", sm7x_tf.NAME):
        torch.manual_seed(0)
        tower = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel._from_config(
            config, attn_implementation=impl).half().cuda().eval()
        grid = torch.tensor([[1, 32, 44], [1, 16, 16]], device="cuda")
        g = torch.Generator(device="cuda").manual_seed(1)
        pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, device="cuda",
                             generator=g).half()
        with torch.no_grad():
            out = tower(pixels, grid_thw=grid)
        outs[impl] = getattr(out, "pooler_output", out).float()
    err = (outs["sdpa"] - outs[sm7x_tf.NAME]).abs().max().item()
    scale = outs["sdpa"].abs().max().item()
    assert err <= 1e-2 * max(scale, 1.0), f"max |features - sdpa| = {err} (max {scale})"
