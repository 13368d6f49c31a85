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
