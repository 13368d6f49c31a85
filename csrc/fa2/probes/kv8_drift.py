"""Maintainers' probe, run by hand (in no package): does an 8-bit KV cache turn the
last-bit differences between two correct fp16 attention kernels into the logprob drift
the real-vLLM engine matrix saw over 8-bit caches (0.07-0.21 before the first differing
token, where the fp16 matrix stays within 0.036)?

The engine matrix's llama-d128 model (tests/vllm_engine/models.py: random weights, 3
layers, GQA 8/2, head dim 128, fp16) generates greedily on the CPU from the matrix's
first-round prompts (5 to 2500 tokens, 64 new tokens) with an attention of its own, in two
variants that are both exact up to fp16 rounding and differ only in summation order, as
two kernels do:

- "one pass": fp32 scores and softmax over all keys, P rounded to fp16, P V accumulated in
  fp32, the output rounded to fp16 (the FA2 kernels' roundings);
- "two halves": the same over the first and second half of the keys separately (each half
  rounds its P against its own row max), the halves combined in fp32 (split-KV).

Each variant reads K/V as the cache would hold them: fp16; E4M3 with scale 1 (vLLM's
default ``k_scale``); int8 with a scale per (token, head) = amax / 127 (vLLM's
``int8_per_token_head``). Prints, per cache format and prompt, how the two variants'
runs compare by the engine matrix's own rule and tolerances (tests/vllm_engine/
token_match.py: the worst logprob error of a chosen token before the first differing
token, and whether that difference is a near tie).

    PYTHONPATH=python:tests/vllm_engine python csrc/fa2/probes/kv8_drift.py
"""

from __future__ import annotations

import random
import sys

import torch
import transformers
from models import COMMON, MODELS, VOCAB
from token_match import compare
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

LENGTHS, NEW_TOKENS, TOPK = (5, 33, 300, 1000, 2500), 64, 5
LP_TOL, TIE_TOL = 0.05, 0.1  # the engine matrix's (test_engine_matrix.py)
STATE = {"format": "fp16", "variant": "one pass"}


def _cache_view(x: torch.Tensor) -> torch.Tensor:
    """K or V [batch, kv_heads, keys, head_dim] as the cache format reads it back (fp32)."""
    fmt = STATE["format"]
    if fmt == "fp16":
        return x.float()
    if fmt == "e4m3":  # scale 1, saturating at E4M3's 448
        return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()
    scale = x.float().abs().amax(-1, keepdim=True) / 127  # int8, a scale per (token, head)
    return (x.float() / scale.clamp_min(1e-30)).round().clamp(-127, 127) * scale


def _partial(s: torch.Tensor, v: torch.Tensor):
    """(row max, row sum, unnormalised output) of scores s over values v, P in fp16."""
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m.clamp_min(-1e30)).half().float()  # a row with no key: p = 0
    return m, p.sum(-1, keepdim=True), p @ v


def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    groups = query.shape[1] // key.shape[1]
    k = _cache_view(key).repeat_interleave(groups, 1)
    v = _cache_view(value).repeat_interleave(groups, 1)
    s = (query.float() @ k.transpose(-1, -2)) * scaling
    lq, lk = s.shape[-2], s.shape[-1]
    causal = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]
    s = s.masked_fill(~causal, float("-inf"))
    if STATE["variant"] == "one pass" or lk < 2:
        m, l, o = _partial(s, v)
        out = o / l
    else:  # two halves, combined in fp32 (a fully masked half contributes nothing)
        h = lk // 2
        parts = [_partial(s[..., a:b], v[:, :, a:b]) for a, b in ((0, h), (h, lk))]
        m = torch.maximum(parts[0][0], parts[1][0])
        w = [torch.exp(pm - m) for pm, _, _ in parts]  # 0 for a half with no key
        l = sum(wi * pl for wi, (_, pl, _) in zip(w, parts))
        out = sum(wi * po for wi, (_, _, po) in zip(w, parts)) / l
    return out.half().transpose(1, 2).contiguous(), None


def generate(model, prompt: list[int]) -> dict:
    """Greedy tokens and each step's top logprobs, as the engine matrix records a run."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    steps = []
    for x in out.logits:
        lp = torch.log_softmax(x[0].float(), -1)
        top = lp.topk(TOPK)
        steps.append(dict(zip(top.indices.tolist(), top.values.tolist())))
    return {"tokens": out.sequences[0, len(prompt):].tolist(), "logprobs": steps}


def main() -> int:
    AttentionInterface.register("kv8_probe", attention)
    AttentionMaskInterface.register("kv8_probe", sdpa_mask)
    cls, kw, _, _ = MODELS["llama-d128"]
    cfg = getattr(transformers, cls)(**{**COMMON, **kw})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).eval()
    model.set_attn_implementation("kv8_probe")
    model.generation_config.eos_token_id = None  # every run 64 tokens (vLLM's ignore_eos)
    rng = random.Random(0)  # the engine matrix's first round (test_engine_matrix._prompts)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in LENGTHS]
    print("format  prompt  the two variants (tests/vllm_engine/token_match.compare)")
    with torch.inference_mode():
        for fmt in ("fp16", "e4m3", "int8"):
            STATE["format"] = fmt
            for n, p in zip(LENGTHS, prompts):
                runs = []
                for variant in ("one pass", "two halves"):
                    STATE["variant"] = variant
                    runs.append(generate(model, p))
                m = compare(*runs, lp_tol=LP_TOL, tie_tol=TIE_TOL)
                print(f"{fmt:6}  {n:6}  {'passes' if m.ok else 'fails '} at the matrix's "
                      f"tolerances: {m.describe()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
