"""The engine tests' random-weight models, checked on the CPU (transformers): that a model
tests what its engine test says it does."""

from __future__ import annotations

import pytest

from models import SCALED, write_model

FP16_MAX = 65504.0


def test_gemma2_overflow_passes_fp16_range_inside_the_model(tmp_path):
    """models.SCALED "gemma2-overflow": its residual stream passes float16's range entering
    a layer that has another layer after it (the token turns NaN in that layer's MLP, and
    the next layer's attention spreads it to the last position, whose logits vLLM
    computes: an overflow only entering the last layer leaves vLLM's float16 run finite),
    while every layer's own output stays inside it; transformers' float16 run of it gives
    non-finite logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path / "gemma2-overflow")
    write_model("gemma2-overflow", path)
    ids = torch.randint(4, 1000, (2, 300), generator=torch.Generator().manual_seed(0))

    def run(dtype):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        residual, own = [], []
        for layer in model.model.layers:
            layer.register_forward_hook(
                lambda m, a, out: residual.append(out[0] if isinstance(out, tuple) else out))
            layer.post_feedforward_layernorm.register_forward_hook(
                lambda m, a, out: own.append(out))
        with torch.no_grad():
            logits = model(ids).logits
        return ([r.abs().max().item() for r in residual], [o.abs().max().item() for o in own],
                logits)

    residual, own, logits = run(torch.float32)
    assert len(residual) == SCALED["gemma2-overflow"].overrides["num_hidden_layers"]
    assert max(residual[:-2]) > FP16_MAX, residual  # the stream entering layers 1 .. n - 2
    assert max(own) < FP16_MAX, own
    assert torch.isfinite(logits).all()
    _, _, logits16 = run(torch.float16)
    assert not torch.isfinite(logits16).all()


def test_every_engine_model_says_whether_its_float16_refusal_is_lifted():
    """The engine harness asks models.fp16_forced for every model it runs (decoders, the
    scaled ones and the vision-language ones alike): each has an answer, not a KeyError."""
    from models import MODELS, VL_MODELS, fp16_forced

    for name in [*MODELS, *SCALED, *VL_MODELS]:
        assert isinstance(fp16_forced(name), tuple), name
    assert fp16_forced("qwen25vl-d80") == ()
    assert fp16_forced("gemma2-overflow") == fp16_forced(SCALED["gemma2-overflow"].base)
