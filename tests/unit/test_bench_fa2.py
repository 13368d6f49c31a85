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


# ---------------------------------------------------------------------------------------
# --backward: forward + backward through autograd


def test_flop_count_forward_and_backward():
    assert B.attention_flops(2, 4, 100, 64, False, False) == 4 * 2 * 4 * 100 * 100 * 64
    assert B.attention_flops(2, 4, 100, 64, True, False) == 2 * 2 * 4 * 100 * 100 * 64
    assert B.attention_flops(2, 4, 100, 64, True, True) == 3.5 * 2 * 2 * 4 * 100 * 100 * 64


def test_backward_run_on_cpu_writes_json_and_png(monkeypatch, tmp_path, capsys):
    """The whole --backward run on CPU tensors with the stand-in library of
    tests/unit/fa2_cpu_ops.py (d=256 has no backward kernel there: the fallback rows) and
    SDPA's math backend in place of the memory-efficient one (which CPUs do not have)."""
    import json

    import torch
    from torch.nn.attention import SDPBackend

    import fa2_cpu_ops
    from sm7x.bench import _output

    fa2_cpu_ops.use(monkeypatch)
    monkeypatch.setattr(B, "_baseline_backend", lambda: SDPBackend.MATH)
    result = B.run_backward(seqlens=(16, 40), head_dims=(16, 256), tokens=80, head_elems=32,
                            iters=1, repeats=1, gqa=((16, 4, 2),), device="cpu")
    rows = result["results"]
    assert result["mode"] == "forward+backward" and result["flop_factor"] == 3.5
    assert [(r["head_dim"], r["heads"], r["kv_heads"]) for r in rows[::4]] == [
        (16, 2, 2), (256, 1, 1), (16, 4, 2)]
    assert len(rows) == 3 * 2 * 2
    for r in rows:
        flops = B.attention_flops(r["batch"], r["heads"], r["seqlen"], r["head_dim"], r["causal"],
                                  True)
        assert r["batch"] == 80 // r["seqlen"]
        assert abs(r["sm7x_tflops"] - flops / r["sm7x_ms"] / 1e9) < 1e-9 * (1 + r["sm7x_tflops"])
        assert abs(r["ratio"] - r["sdpa_eff_ms"] / r["sm7x_ms"]) < 1e-9 * (1 + r["ratio"])
        assert r["grad_rel_diff"] < 2e-2, r  # sm7x's gradients agree with SDPA's
        assert r["backward"] == ("fallback" if r["head_dim"] == 256 else "kernel")
        assert ("fallback_reason" in r) == (r["head_dim"] == 256)
    # the op ran: forward and backward of the stand-in (kernel rows), never for d=256
    assert fa2_cpu_ops.ops("bwd") and all(c["dq_shape"][-1] == 16 for c in fa2_cpu_ops.ops("bwd"))

    out, png = tmp_path / "b.json", tmp_path / "b.png"
    B.print_table(result)
    try:
        import matplotlib  # noqa: F401
        plot = str(png)
    except ImportError:
        plot = None
    _output.write(result, str(out), plot, B.draw)
    text = capsys.readouterr().out
    assert "forward + backward (FLOP = 3.5x" in text and "fallback" in text and "grad diff" in text
    back = json.loads(out.read_text())
    assert back["results"] == json.loads(json.dumps(rows)) and back["mode"] == "forward+backward"
    if plot:
        assert png.stat().st_size > 0


def test_backward_cli_arguments(capsys):
    for argv in (["--backward", "--seqlens", "x"], ["--backward", "--head-dims", "0"],
                 ["--deterministic"]):
        with pytest.raises(SystemExit) as e:
            B.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--seqlens" in err and "--head-dims" in err and "--deterministic needs --backward" in err


def test_backward_cli_without_cuda(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert B.main(["--backward"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


def test_table_says_when_sm7x_runs_at_a_smaller_cards_occupancy(capsys):
    B.print_table(dict(_result(400.0), occupancy_of="t4"))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("sm7x's CTAs per SM capped at a T4's (64 KB shared memory, 1024 threads per "
                      "SM); SDPA runs uncapped")
    assert "library sm75" in out[1]


def test_table_with_sinks_and_the_flag(capsys):
    result = _result(400.0)
    result["results"] = [dict(r, sinks_time_ratio=1.04) for r in result["results"]]
    B.print_table(result)
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[-1] == "sinks" and out[2].split()[-1] == "1.04x"
    with pytest.raises(SystemExit) as e:
        B.main(["--sinks", "--backward"])
    assert e.value.code == 2 and "--sinks times the forward" in capsys.readouterr().err
