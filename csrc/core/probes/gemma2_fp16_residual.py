"""Maintainers' probe, run by hand (in no package): where a Gemma 2 style model breaks in
float16, and whether keeping the residual stream in float32 (what sm7x.ops.fused_add_rms_norm
offers with a float32 residual) is enough to fix it.

A random-weight transformers Gemma2 (4 layers, hidden 256) is run on the CPU in float32
(the reference) and in float16 three ways: as transformers runs it (residual in fp16), with
the residual stream kept in fp32 between and inside the layers (the sublayers, norms'
outputs and weights stay fp16), and the same with the MLP's intermediate activations also
upcast. The post-feedforward norm weights are scaled by S so that the residual stream grows
past fp16's 65504, as large activations do in real bf16-trained models. Prints, per S, the
largest |residual| of the fp32 run and each fp16 variant's max |logits - fp32 logits| /
max |fp32 logits| (inf or nan where it broke).

    PYTHONPATH=python python csrc/core/probes/gemma2_fp16_residual.py
"""

from __future__ import annotations

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM
from transformers.models.gemma2 import modeling_gemma2 as g2

torch.manual_seed(0)
cfg = Gemma2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   max_position_embeddings=256, sliding_window=64,
                   attn_implementation="eager")
base = Gemma2ForCausalLM(cfg).eval()
ids = torch.randint(0, cfg.vocab_size, (1, 48))
ORIGINAL = g2.Gemma2DecoderLayer.forward


def fp32_residual_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                          position_ids=None, past_key_values=None, **kwargs):
    """Gemma2DecoderLayer.forward with the residual stream in fp32: the layer's input and
    output are fp32, its sublayers see fp16."""
    dt, mlp_dt = self.self_attn.q_proj.weight.dtype, self.mlp.gate_proj.weight.dtype
    residual = hidden_states.float()
    h = self.input_layernorm(residual).to(dt)
    h, _ = self.self_attn(hidden_states=h, position_embeddings=position_embeddings,
                          attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=past_key_values, **kwargs)
    residual = residual + self.post_attention_layernorm(h).float()
    h = self.mlp(self.pre_feedforward_layernorm(residual).to(mlp_dt))
    return residual + self.post_feedforward_layernorm(h).float()


def run(scale: float, dtype, residual32: bool, mlp32: bool = False):
    m = Gemma2ForCausalLM(cfg).eval()
    m.load_state_dict(base.state_dict())
    with torch.no_grad():
        for layer in m.model.layers:
            layer.post_feedforward_layernorm.weight.mul_(scale).add_(scale - 1)
    m = m.to(dtype)
    if mlp32:  # the MLP computed in fp32 too (its weights upcast)
        for layer in m.model.layers:
            layer.mlp.float()
    g2.Gemma2DecoderLayer.forward = fp32_residual_forward if residual32 else ORIGINAL
    peak = []
    hooks = [layer.register_forward_hook(lambda mod, i, o: peak.append(o.float().abs().max().item()))
             for layer in m.model.layers]
    if residual32:  # the final norm's output back to the model's dtype for lm_head
        hooks.append(m.model.norm.register_forward_hook(lambda mod, i, o: o.to(dtype)))
    try:
        with torch.no_grad():
            out = m(ids).logits.float()
    finally:
        g2.Gemma2DecoderLayer.forward = ORIGINAL
        for h in hooks:
            h.remove()
    return out, max(peak)


print("scale | max |residual| (fp32) | fp16 | fp16 + fp32 residual | + fp32 MLP   (max |logits - fp32| / max |fp32 logits|)")
for scale in (1, 100, 1000, 3000, 10000):
    ref, peak = run(scale, torch.float32, False)
    row = []
    for residual32, mlp32 in ((False, False), (True, False), (True, True)):
        out, _ = run(scale, torch.float16, residual32, mlp32)
        row.append((out - ref).abs().max().item() / ref.abs().max().item())
    print(f"{scale:>5} | {peak:12.1f} | " + " | ".join(f"{r:.2e}" for r in row))
