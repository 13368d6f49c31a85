"""The solve/install benchmark runs end to end and records what each node kind got (no
timing is asserted: the figures are for reading, with their same-run baseline ratios)."""

import json

from pkgtest import CHANNELS

from sm7x_tools.envs import __main__ as envs_cli
from sm7x_tools.envs import bench


def test_bench_envs_writes_cases_with_baseline_ratios(tmp_path, capsys):
    out = tmp_path / "envs.json"
    assert bench.main(["--runs", "1", "--out", str(out)] + [f"--channel={c}" for c in CHANNELS]) == 0
    result = json.loads(out.read_text())
    cases = result["cases"]
    assert list(cases) == ["7.0", "7.5", "8.0", "absent", "empty"]
    # a 7.0 node may also hold Turing GPUs: its build brings both libraries
    assert cases["7.0"]["fa2_packages"] == ["sm7x-fa2-sm70", "sm7x-fa2-sm75"]
    assert cases["7.0"]["selector_build"].startswith("sm70_")
    assert cases["8.0"]["fa2_packages"] == ["sm7x-fa2-sm75"]
    assert cases["empty"]["fa2_packages"] == ["sm7x-fa2-sm70", "sm7x-fa2-sm75"]
    for c in cases.values():
        assert len(c["case_solve_ms"]) == len(c["baseline_install_ms"]) == 1
        assert c["ratio"]["solve_ms"] > 0 and c["ratio"]["install_ms"] > 0
        assert c["packages"] > c["baseline_packages"]  # the selector and its library(ies) on top
    assert "on the same node, interleaved" in capsys.readouterr().out


def test_bad_channel_or_spec_is_a_message_not_a_traceback(tmp_path, capsys):
    assert bench.main(["--runs", "1", "--channel", str(tmp_path)]) == 1
    assert "is not an indexed channel" in capsys.readouterr().err
    assert envs_cli.main([str(tmp_path / "env"), "nosuchpkg"] + [f"--channel={c}" for c in CHANNELS]) == 1
    assert "nosuchpkg" in capsys.readouterr().err and not (tmp_path / "env").exists()
