"""Small random-weight models that vLLM loads from a directory (safetensors + config, no
hub): each exercises one attention feature of the sm7x backend inside a real engine.

Weights are transformers' own initialisation (seed 0) with a larger ``initializer_range``
than a trained model's 0.02, so the next-token distribution is peaked enough that greedy
decoding is not a string of near ties. A WordLevel tokenizer (``w0`` .. ``wN``) is written
too, so the same directory serves ``vllm serve`` with text prompts; the offline tests pass
token ids (``skip_tokenizer_init``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

VOCAB = 1024
COMMON = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
              max_position_embeddings=8192, initializer_range=0.12, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

# name -> (transformers config class, its arguments, model types vLLM must be told to take
# in float16, what it covers)
MODELS = {
    "llama-d128": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2,
                                        head_dim=128), (), "GQA 8/2, head dim 128"),
    "llama-d64": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=1,
                                       head_dim=64), (), "MQA 8/1, head dim 64"),
    "mistral-sw": ("MistralConfig", dict(num_attention_heads=8, num_key_value_heads=4,
                                          head_dim=128, sliding_window=256), (),
                   "sliding window 256 on every layer, GQA 8/4, head dim 128"),
    # vLLM 0.26 refuses float16 for model type gemma2 ("numerical instability"); forced for
    # this test (the point is the kernel's softcap at d256, not the model's stability)
    "gemma2-softcap": ("Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=256, sliding_window=128,
                                             attn_logit_softcapping=50.0,
                                             final_logit_softcapping=30.0,
                                             query_pre_attn_scalar=256,
                                             tie_word_embeddings=True,
                                             # its embeddings are scaled by sqrt(hidden):
                                             # 0.12 gives next-token probabilities of ~1
                                             initializer_range=0.03),
                       ("gemma2",), "softcap 50, head dim 256, sliding 128 on alternate layers"),
    # gpt-oss: attention sinks (vLLM's own backends take them only through FA3, sm90) on
    # every layer, sliding window 128 on alternate ones; unquantized MoE (vLLM's
    # _load_weights_other path); vLLM's gpt-oss always applies YaRN, so its defaults stay.
    # Every token goes to all 4 experts: with top-2 of 4, a router near-tie that rounding
    # flips changes one step's logprobs by up to 1.5 with the same tokens (measured between
    # vLLM's eager and compiled runs with one attention backend, and between sm7x's two
    # libraries), far above what the test tolerates; top-4 of 4 leaves no discrete choice
    "gptoss-sinks": ("GptOssConfig", dict(num_attention_heads=8, num_key_value_heads=2,
                                           head_dim=64, sliding_window=128,
                                           layer_types=["sliding_attention", "full_attention",
                                                        "sliding_attention"],
                                           num_local_experts=4, num_experts_per_tok=4),
                     (), "attention sinks, head dim 64, sliding 128 on alternate layers, MoE"),
    # Gemma 4: head dim 512 on the full-attention layer (global_head_dim), 256 on the two
    # sliding ones, so one engine holds KV caches of two head sizes; no per-layer inputs.
    # Its scores are q_norm(q) . k_norm(k) unscaled: write_model scales q_norm by
    # head_dim^-0.5 so random weights give scores of std ~1, not ~sqrt(head_dim)
    "gemma4-d512": ("Gemma4TextConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=256, global_head_dim=512,
                                             sliding_window=128, hidden_size_per_layer_input=0,
                                             layer_types=["sliding_attention",
                                                          "sliding_attention",
                                                          "full_attention"]),
                    (), "head dim 512 (full layer) beside 256 (sliding 128), GQA 4/2"),
}


# Models built from one of MODELS with some weights scaled, outside the matrix: name ->
# Scaled. gemma2-overflow:
# each post-feedforward norm's (1 + weight) times 1e4 pushes the residual stream past
# float16's 65504 while every layer's own output stays below it. Five layers, not the
# base's three: a token whose stream overflows turns NaN inside the next layer's MLP
# (vLLM stores the sum in float16 at that layer's input norm, and the norm after its
# attention reads inf), and only a later layer's attention spreads that to the positions
# vLLM computes logits for. With three layers the stream passed 65504 only entering the
# last layer (transformers, float32, the matrix's first-round prompts of 5-2500 tokens:
# at most 53k, 68k, 82k after layers 0-2), so vLLM's own float16 run stayed finite
# (measured, vLLM 0.26) where transformers' (logits at every position) gave NaN; with
# five: 48k, 70k, 83k, 105k, 110k, past 65504 from layer 1 on prompts of 300 tokens and
# more. The case vLLM refuses float16 for, which sm7x's float32 residual
# (SM7X_VLLM_FP32_RESIDUAL) is for.
class Scaled(NamedTuple):
    base: str       # the MODELS entry it is built from
    norm: str       # the norm whose (1 + weight) is scaled
    factor: float
    overrides: dict  # config arguments over the base's
    about: str      # what it covers


SCALED = {
    "gemma2-overflow": Scaled("gemma2-softcap", "post_feedforward_layernorm", 1.0e4,
                              {"num_hidden_layers": 5},
                              "Gemma 2 whose residual stream passes fp16's range"),
}


def write_tokenizer(path: str, special: tuple[str, ...] = ()):
    """The WordLevel tokenizer (``w4`` .. ``w1023``), with ``special`` tokens after the
    vocabulary (ids VOCAB, VOCAB + 1, ...); returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    vocab.update({t: VOCAB + i for i, t in enumerate(special)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>",
                                   additional_special_tokens=list(special))
    fast.save_pretrained(path)
    return fast


# Vision-language models, outside the decoder matrix: name -> what it covers. qwen25vl-d80:
# a Qwen2.5-VL vision tower of head size 80 (Qwen2.5-VL's own: 1280 / 16), 4 blocks, two
# of them over 112-pixel windows (8 x 8 patches) and two over whole images, before a GQA
# 8/2 d64 decoder with M-RoPE.
VL_MODELS = {"qwen25vl-d80": "Qwen2.5-VL vision tower (head size 80, windowed and full "
                             "layers) before a GQA d64 decoder"}
VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def vl_token_id(token: str) -> int:
    """A vision token's id: after the vocabulary, in VL_TOKENS' order (write_tokenizer)."""
    return VOCAB + VL_TOKENS.index(token)


def image_prompt_ids(words: list[int], images: int) -> list[int]:
    """A prompt's token ids: the words, then per image vision_start, image_pad, vision_end
    (vLLM expands each image_pad to the image's tokens)."""
    ids = [vl_token_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    return list(words) + ids * images


def _write_qwen25vl(path: str) -> None:
    import torch
    import transformers

    fast = write_tokenizer(path, VL_TOKENS)
    ids = {t: vl_token_id(t) for t in VL_TOKENS}
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB + 8, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=8192, initializer_range=0.12,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=4, hidden_size=320, intermediate_size=640, num_heads=4,
                           out_hidden_size=512, fullatt_block_indexes=[1, 3], window_size=112,
                           initializer_range=0.12),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.float16)
    model.save_pretrained(path, safe_serialization=True)
    # images of 56 x 56 to 224 x 224 pixels: 16 to 256 patches (4 to 64 tokens) each
    images = transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=224 * 224)
    transformers.Qwen2_5_VLProcessor(image_processor=images, tokenizer=fast,
                                     video_processor=transformers.Qwen2VLVideoProcessor()
                                     ).save_pretrained(path)


def write_model(name: str, path: str) -> str:
    """Writes model ``name`` into ``path`` (once: an existing complete directory is kept)."""
    done = os.path.join(path, ".complete")
    if os.path.exists(done):
        return path
    if name in VL_MODELS:
        _write_qwen25vl(path)
    else:
        _write_decoder(name, path)
    open(done, "w").close()
    return path


def _base(name: str) -> str:
    """The MODELS entry a model is built from (itself, or a SCALED model's base)."""
    return SCALED[name].base if name in SCALED else name


def _write_decoder(name: str, path: str) -> None:
    import torch
    import transformers

    scaled = SCALED.get(name)
    cls, kw, _, _ = MODELS[_base(name)]
    cfg = getattr(transformers, cls)(**{**COMMON, **kw, **(scaled.overrides if scaled else {})})
    cfg.torch_dtype = "float16"
    if cfg.model_type == "gemma4_text":  # vLLM 0.26 reads one global head_dim (its layers
        # take their own): transformers 5.17 refuses that unless the config allows it
        cfg.allow_global_per_layer_attribute_access = True
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    with torch.no_grad():  # sinks that matter (transformers initialises them near 0)
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 2.0)
        if cfg.model_type == "gemma4_text":
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.mul_(layer.self_attn.head_dim ** -0.5)
        if scaled:  # Gemma norms scale by (1 + weight)
            for layer in model.model.layers:
                getattr(layer, scaled.norm).weight.add_(1.0).mul_(scaled.factor).sub_(1.0)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)


def fp16_forced(name: str) -> tuple[str, ...]:
    """The architectures whose float16 refusal the harness lifts for this model (none for the
    vision-language models: vLLM takes Qwen2.5-VL in float16)."""
    return () if name in VL_MODELS else MODELS[_base(name)][2]
