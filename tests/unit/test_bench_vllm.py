"""sm7x.bench vllm's arguments, ratios and plot, and the engine child's environment (the
engines themselves need a GPU and vLLM: tests/vllm_engine)."""

import pytest

pytest.importorskip("torch")
from sm7x.bench import _vllm_engine, vllm  # noqa: E402


def test_parse_cases():
    assert vllm.parse_cases("256x512x256, 8x16kx256") == [
        {"prompts": 256, "input": 512, "output": 256},
        {"prompts": 8, "input": 16384, "output": 256}]
    for bad in ("8x16k", "axbxc", "", "0x1x1"):
        with pytest.raises(ValueError):
            vllm.parse_cases(bad)


def _run(backend, tok_s, ttft_s):
    return {"backend": backend,
            "cases": [{"prompts": 8, "input": 16384, "output": 256, "output_tok_s": tok_s}],
            "ttft": [{"input": 2048, "seconds": ttft_s}]}


def test_ratios_against_each_baseline_skip_failed_runs():
    result = {"runs": [_run("sm7x", 800.0, 0.1), _run("TRITON_ATTN", 400.0, 0.3),
                       {"backend": "FLEX_ATTENTION", "error": "boom"}]}
    rows = vllm.ratios(result)
    assert rows == [{"baseline": "TRITON_ATTN", "what": "8x16k in / 256 out", "ratio": 2.0},
                    {"baseline": "TRITON_ATTN", "what": "TTFT 2k", "ratio": pytest.approx(3.0)}]
    assert vllm.ratios({"runs": [_run("TRITON_ATTN", 1.0, 1.0)]}) == []


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    result = {"vllm": "0.26.0", "device": "GPU", "fa2_library": "sm75",
              "runs": [_run("sm7x", 800.0, 0.1), _run("TRITON_ATTN", 400.0, 0.3)]}
    result["ratios"] = vllm.ratios(result)
    from sm7x.bench import _output

    _output.write(result, str(tmp_path / "r.json"), str(tmp_path / "r.png"), vllm._draw)
    assert (tmp_path / "r.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, why", [
    (["--backends", "TRITON_ATTN"], "must name sm7x"), (["--backends", "sm7x"], "must name sm7x"),
    (["--cases", "8x16k"], "PROMPTSxINPUTxOUTPUT"), (["--layers", "0"], ">= 1")])
def test_bad_arguments_exit_2(capsys, argv, why):
    assert vllm.main(argv) == 2
    assert why in capsys.readouterr().err


def test_child_env_forces_the_library_and_the_test_aid_only_where_needed(monkeypatch):
    monkeypatch.setenv("SM7X_FA2_FORCE", "sm70")  # the parent's own setting never leaks
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("SM7X_VLLM_FP32_RESIDUAL", raising=False)
    env = _vllm_engine.child_env({"backend": "sm7x", "arch": "sm75"}, (9, 0))
    assert env["SM7X_FA2_FORCE"] == "sm75" and env["SM7X_VLLM_TEST_ANY_GPU"] == "1"
    env = _vllm_engine.child_env({"backend": "sm7x", "arch": None}, (7, 5))
    assert "SM7X_FA2_FORCE" not in env and "SM7X_VLLM_TEST_ANY_GPU" not in env
    env = _vllm_engine.child_env({"backend": "TRITON_ATTN", "arch": "sm75"}, (9, 0))
    assert "SM7X_FA2_FORCE" not in env and "SM7X_VLLM_TEST_ANY_GPU" not in env
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    # an fp8 reference that keeps the query fp16: the patch must run in the engine core
    env = _vllm_engine.child_env({"backend": "TRITON_ATTN", "fp16_query": True}, (9, 0))
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # a spec's own variables reach its engine only
    env = _vllm_engine.child_env({"backend": "sm7x", "env": {"SM7X_VLLM_FP32_RESIDUAL": "1"}},
                                 (7, 5))
    assert env["SM7X_VLLM_FP32_RESIDUAL"] == "1"
    assert "SM7X_VLLM_FP32_RESIDUAL" not in _vllm_engine.child_env({"backend": "sm7x"}, (7, 5))


def test_failed_child_raises_with_its_log(tmp_path):
    spec = {"name": "x", "backend": "TRITON_ATTN", "model": str(tmp_path / "missing"),
            "task": "generate", "engine": {}}
    with pytest.raises(_vllm_engine.EngineError, match="failed"):
        _vllm_engine.run(spec, str(tmp_path), timeout=120)


def test_engine_images_are_the_same_in_every_engine():
    """The multimodal prompts' images are made from (height, width, seed) in each child."""
    import numpy as np

    a, b = _vllm_engine._image(56, 80, 3), _vllm_engine._image(56, 80, 3)
    assert a.size == (80, 56) and a.mode == "RGB"
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(_vllm_engine._image(56, 80, 4)))
