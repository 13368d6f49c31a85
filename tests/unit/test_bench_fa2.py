"""sm7x.bench fa2 without a GPU: its cases, the --gqa parser, the first-line note on GPUs
newer than Turing, and the table / plot of a result (the timed run needs CUDA)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="sm7x.bench needs torch")

from sm7x.bench import fa2 as B  # noqa: E402


def test_cases_are_the_head_dims_then_gqa():
    assert B.cases((64, 128)) == [(64, 32, 32), (128, 16, 16), (128, 32, 8)]
    assert B.cases((64,), gqa=()) == [(64, 32, 32)]
    # the default table has head dims 80 and 96 and the GQA 32/8 row
    assert {80, 96} <= {d for d, _, _ in B.cases(B.DEFAULT_HEAD_DIMS)}
    assert (128, 32, 8) in B.cases(B.DEFAULT_HEAD_DIMS)


def test_parse_gqa():
    assert B.parse_gqa("128:32/8, 64:16/2,") == ((128, 32, 8), (64, 16, 2))
    assert B.parse_gqa("") == ()
    for bad in ("128", "128:32", "x:32/8", "128:30/8", "128:0/0", "0:8/8"):
        with pytest.raises(ValueError, match="--gqa"):
            B.parse_gqa(bad)


def test_the_note_says_when_the_numbers_are_not_a_v100_or_t4s():
    assert B.gpu_note((7, 5), "sm75", None) is None
    assert B.gpu_note((7, 0), "sm70", None) is None
    note = B.gpu_note((9, 0), "sm75", "sm75")
    assert "newer than Turing" in note and "PTX" in note and "SM7X_FA2_FORCE=sm75" in note
    assert "emulated" in B.gpu_note((9, 0), "sm70", "sm70")


def _result(ceiling):
    row = {"head_dim": 128, "heads": 32, "kv_heads": 8, "seqlen": 2048, "batch": 8, "causal": True,
           "sm7x_tflops": 100.0, "sdpa_eff_tflops": 50.0, "ratio": 2.0,
           "pct_ceiling": 25.0 if ceiling else None}
    return {"device": "Tesla T4", "capability": [7, 5], "torch": "2.11", "forced": None,
            "library": "sm75", "note": None, "mma_ceiling_tflops": ceiling, "tokens": 16384,
            "results": [row, dict(row, kv_heads=32, causal=False)]}


@pytest.mark.parametrize("ceiling", [400.0, None])
def test_table(ceiling, capsys):
    B.print_table(_result(ceiling))
    out = capsys.readouterr().out.splitlines()
    assert "library sm75" in out[0]
    assert ("mma ceiling 400 TFLOP/s" in out[0]) if ceiling else ("no mma ceiling" in out[0])
    assert "% ceiling" in out[1]
    assert " 32/8 " in out[2] and ("25%" in out[2] if ceiling else "n/a" in out[2])
    assert out[2].split()[-1] == "2.00"


def test_plot(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = B.draw(_result(400.0), plt)
    assert [ax.get_title() for ax in fig.axes] == ["head dim 128, GQA 32/8", "head dim 128"]
    fig.savefig(tmp_path / "fa2.png")


def test_table_says_when_sm7x_runs_at_a_smaller_cards_occupancy(capsys):
    B.print_table(dict(_result(400.0), occupancy_of="t4"))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("sm7x's CTAs per SM capped at a T4's (64 KB shared memory, 1024 threads per "
                      "SM); SDPA runs uncapped")
    assert "library sm75" in out[1]
