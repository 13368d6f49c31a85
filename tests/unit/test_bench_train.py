"""sm7x.bench train's batches, arithmetic and harness on the CPU (the timing itself needs a
GPU): the three layouts hold the same sequences, and a run through SDPA, the floor and sm7x
(its autograd ops on the CPU stand-in library, tests/unit/fa2_cpu_ops.py) gives one row per
cell with losses that agree."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from sm7x.bench import generate, train  # noqa: E402


def test_sequence_lengths():
    assert train.sequence_lengths(4096, 512, 0, full=True) == [512] * 8
    lens = train.sequence_lengths(4096, 512, 512, full=False)
    assert len(lens) == 8 and all(256 <= n <= 512 for n in lens) and len(set(lens)) > 1
    assert lens == train.sequence_lengths(4096, 512, 512, full=False)  # seeded
    assert train.sequence_lengths(100, 512, 0, full=True) == [512]  # at least one


def test_layouts_hold_the_same_sequences():
    lens = [3, 5, 2]
    padded = train.make_batch(torch, "padded", lens, 6, 50, "cpu")
    packed = train.make_batch(torch, "packed", lens, 6, 50, "cpu")
    assert padded["input_ids"].shape == (3, 6) and padded["attention_mask"].sum(1).tolist() == lens
    rows = [padded["input_ids"][i, :n] for i, n in enumerate(lens)]
    assert torch.equal(packed["input_ids"][0], torch.cat(rows))
    assert packed["cu_seq_lens_q"].tolist() == [0, 3, 8, 10]
    assert packed["cu_seq_lens_q"].dtype == torch.int32 and packed["max_length_q"] == 5
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert (packed["labels"][0] == -100).nonzero().view(-1).tolist() == [0, 3, 8]
    assert (padded["labels"] == -100).sum().item() == 18 - 10
    full = train.make_batch(torch, "full", [4, 4], 4, 50, "cpu")
    assert "attention_mask" not in full and torch.equal(full["labels"], full["input_ids"])


def test_account_and_line():
    r = {"layout": "padded", "seqlen": 512, "sequences": 8, "tokens": 3000,
         "sdpa_ms": None, "sdpa_expanded_ms": 30.0, "sm7x_ms": 20.0, "no_attention_ms": 15.0,
         "sm7x_loss": 10.0, "sdpa_expanded_loss": 10.01, "sm7x_tok_s": 150e3,
         "sdpa_expanded_tok_s": 100e3, "no_attention_tok_s": 200e3}
    a = train.account(r)
    assert a["x_sdpa"] is None and a["x_sdpa_expanded"] == pytest.approx(1.5)
    assert a["sm7x_attention_ms"] == pytest.approx(5.0) and a["sdpa_attention_ms"] is None
    assert a["loss_rel_diff"] == pytest.approx(0.01 / 10.01)
    line = train._line({**r, **a}, generate.IMPLS + (generate.NO_ATTENTION,))
    assert "sdpa OOM" in line and "xsdpa_expanded 1.50" in line and "150.0k tok/s" in line


def test_bad_arguments_exit_2(capsys):
    assert train.main(["--seqlens", "x"]) == 2
    assert train.main(["--layouts", "full,diagonal"]) == 2
    assert train.main(["--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "--layouts takes full, padded, packed" in err and "must be >= 1" in err


def test_run_on_cpu_through_every_layout(monkeypatch):
    """The harness end to end on a tiny model: SDPA, the expanded SDPA, the floor and sm7x
    (the real sm7x.fa2 API on the CPU stand-in library) on each layout; sm7x's first loss
    matches the expanded SDPA's (the same batch, the same weights)."""
    import fa2_cpu_ops

    from sm7x.integrations import transformers as tf_sm7x

    fa2_cpu_ops.use(monkeypatch)
    monkeypatch.setattr(tf_sm7x, "_layouts", {})
    generate._register_expanded_sdpa(transformers, torch)
    generate._register_no_attention(transformers)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).half().train()
    rows = train.run(torch, model, list(train.LAYOUTS), [16], 48, 1, 1, "native", "cpu",
                     ("sdpa", "sdpa_expanded", "no_attention", "sm7x"))
    assert [r["layout"] for r in rows] == list(train.LAYOUTS)
    for r in rows:
        assert all(r[f"{i}_ms"] > 0 for i in ("sdpa", "sdpa_expanded", "no_attention", "sm7x"))
        assert r["loss_rel_diff"] < 1e-4, r
        assert abs(r["sdpa_loss"] - r["sdpa_expanded_loss"]) < 1e-2 * r["sdpa_loss"], r
    assert fa2_cpu_ops.ops("bwd") and fa2_cpu_ops.ops("bwd_varlen")
