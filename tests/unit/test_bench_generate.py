"""sm7x.bench generate's arithmetic and report lines (the timing itself needs a GPU)."""

import pytest

pytest.importorskip("torch")
from sm7x.bench import generate  # noqa: E402


def test_ratio_and_decode_rate():
    assert generate.ratio(2.0, 1.0) == 2.0
    assert generate.ratio(None, 1.0) is None and generate.ratio(1.0, None) is None
    # 8 sequences x 200 tokens in 4 s of decode (5 s total, 1 s to the first token)
    assert generate.decode_rate(5.0, 1.0, 8, 200) == pytest.approx(400.0)
    assert generate.decode_rate(1.0, 1.0, 8, 200) is None  # no decode time: no rate


def test_report_line_names_oom_and_ratios():
    r = {"kind": "ttft", "batch": 8, "prefix": 8192, "sdpa_s": None, "sdpa_expanded_s": 0.8,
         "sm7x_s": 0.4, "x_sdpa": None, "x_sdpa_expanded": 2.0}
    line = generate._line(r, "_s", 1e3, "ms")
    assert "OOM" in line and "800.0 ms" in line and "xsdpa_expanded 2.00" in line


def test_bad_arguments_exit_2(capsys):
    assert generate.main(["--prefixes", "x"]) == 2
    assert generate.main(["--decode-tokens", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_step_account_splits_a_decode_step():
    # batch 1: 50 tok/s is a 20 ms step; the floor (no attention) 25 ms steps -> 40 tok/s
    r = {"batch": 1, "no_attention_tok_s": 1e3 / 16, "sdpa_tok_s": None,
         "sdpa_expanded_tok_s": 1e3 / 20, "sm7x_tok_s": 1e3 / 18}
    a = generate.step_account(r)
    assert a["floor_ms"] == pytest.approx(16.0)
    assert a["sdpa_expanded_attention_ms"] == pytest.approx(4.0)
    assert a["sm7x_attention_ms"] == pytest.approx(2.0)
    assert a["sdpa_attention_ms"] is None  # OOM: nothing to split
    assert a["max_x_sdpa_expanded"] == pytest.approx(20 / 16)
    line = generate._account_line({**r, **a})
    assert "16.00 ms without attention" in line and "sm7x 2.00 ms" in line and "x1.25" in line
    # batch 8: tokens/s count every sequence, a step is batch / rate
    assert generate.step_account({**r, "batch": 8})["floor_ms"] == pytest.approx(128.0)


def test_no_attention_returns_the_query_as_output():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers import AttentionInterface

    generate._register_no_attention(transformers)
    q = torch.randn(2, 4, 3, 8)  # [batch, heads, seq, head_dim]
    out, weights = AttentionInterface()[generate.NO_ATTENTION](None, q, q, q, None)
    assert out.shape == (2, 3, 4, 8) and weights is None and out.data_ptr() == q.data_ptr()


@pytest.mark.parametrize("sdpa_gqa", [True, False])
def test_attention_calls_are_timed_per_implementation(monkeypatch, sdpa_gqa):
    """transformers' sdpa either passes GQA to torch or repeats K/V by the layer's
    num_key_value_groups (on CUDA under some transformers versions): both must run."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.integrations import sdpa_attention

    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", lambda *a, **k: sdpa_gqa)
    generate._register_no_attention(transformers)
    generate._register_expanded_sdpa(transformers, torch)
    impls = ("sdpa", "sdpa_expanded", generate.NO_ATTENTION)
    r = generate.time_attention_calls(torch, impls, 2, 40, 4, 2, 16, device="cpu", calls=3)
    assert set(r) == {f"{i}_call{w}_us" for i in impls for w in ("_host", "")}
    assert all(0 < r[f"{i}_call_host_us"] <= r[f"{i}_call_us"] for i in impls)
    line = generate._calls_line(r)
    assert "sdpa_expanded" in line and "no_attention" in line and "sm7x" not in line
    assert generate._calls_line({}) == "  one attention call: -"
