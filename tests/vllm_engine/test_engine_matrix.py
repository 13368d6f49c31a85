"""sm7x inside a real vLLM engine (``vllm.LLM``, offline), against the same engine with
vLLM's TRITON_ATTN backend: greedy tokens equal, or parting only at a near tie
(token_match.py says exactly what passes).

Every engine runs in its own process (sm7x.bench._vllm_engine), with random-weight models
written by models.py, float16, token-id prompts (no tokenizer). Each model is run:

- with vLLM's CUDA graphs as it captures them by default (piecewise for mixed batches,
  full graphs for decode batches), and again with ``enforce_eager`` (against TRITON_ATTN
  with ``enforce_eager`` too);
- with each FA2 library forced (sm75, sm70; on GPUs newer than Turing through their PTX
  and the test aid SM7X_VLLM_TEST_ANY_GPU, which sm7x.bench._vllm_engine sets there);
- on prompts of 5 to 2500 tokens (the longest spans 157 KV blocks of 16) with
  ``max_num_batched_tokens`` 256, so long prompts are prefilled in chunks next to other
  requests' decodes; then a second round whose prompts share prefixes with the first
  (prefix-cache hits, checked through vLLM's ``num_cached_tokens``);
- gpt-oss (random weights, unquantized MoE, every token to every expert) for attention
  sinks, against TRITON_ATTN, which takes sinks too (logprob tolerance: LP_TOL_OF);
- Gemma 4 (head dim 512 on the full layer beside 256): skipped where the installed vLLM
  cannot load it with any backend (``_loadable``);
- and Llama d128 once more with ngram speculative decoding (verification batches of 1 + 3
  queries per request, captured as full graphs);
- Gemma 2 with a residual stream past 65504 (models.SCALED) in float16 with
  SM7X_VLLM_FP32_RESIDUAL=1, against a float32 engine, and vLLM's own float16 run, which
  must break (test_fp32_residual_serves_gemma2_in_float16);
- Qwen2.5-VL (models.VL_MODELS): its vision tower through sm7x's MMEncoderAttention and its
  decoder through the sm7x backend, against TORCH_SDPA and TRITON_ATTN
  (test_vision_tower_matches_sdpa);
- and with 8-bit KV caches (``kv_cache_dtype`` fp8, int8_per_token_head: Llama
  d128 and d64 on sm75, d128 on sm70, CUDA graphs) against TRITON_ATTN over the same format
  (for fp8 with the query kept fp16 as sm7x keeps it: vLLM's Triton path would quantize it
  to fp8 on the sm89+ GPUs where it takes an fp8 cache), at the logprob tolerance
  LP_TOL_KV8 (two exact kernels drift apart over an 8-bit cache: csrc/fa2/probes/kv8_drift.py).

Needs a CUDA GPU, vLLM and sm7x installed where vLLM sees its entry points (``pip install
--no-deps -e .`` in vLLM's environment, or the conda packages), transformers to write the
models; skips cleanly otherwise. Run it (README, "Use it with vLLM"):

    pytest -p no:cacheprovider tests/vllm_engine -n 5 --dist loadgroup

(`-n`: pytest-xdist, one model's engines per worker (the ngram cases apart); several engines share the GPU, each
with a fixed 1 GiB KV cache.) $VLLM_ENGINE_OUT keeps each case's result, the engines'
logs and the models (default: a temporary directory); ``python
tests/vllm_engine/report.py $VLLM_ENGINE_OUT`` prints the matrix.
"""

from __future__ import annotations

import fcntl
import json
import os
import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the vLLM engine tests need a GPU", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM (a GPU build)")
pytest.importorskip("transformers", reason="writes its test models with transformers")

from models import (MODELS, SCALED, VL_MODELS, VOCAB, fp16_forced, image_prompt_ids,  # noqa: E402
                    write_model)
from token_match import compare  # noqa: E402

from sm7x.bench import _vllm_engine  # noqa: E402

pytestmark = pytest.mark.gpu

NEW_TOKENS = 64
LP_TOL, TIE_TOL = 0.05, 0.1
# gpt-oss (sinks ~N(0, 2), MoE): the logprob error of either sm7x library against
# TRITON_ATTN (CUDA graphs) reached 0.055 (median 0.011), about as far as sm7x's two
# libraries are from each other (0.064), while vLLM's eager and compiled runs with
# TRITON_ATTN alone are up to 0.34 apart (H100, vLLM 0.26); the tolerance is about twice
# the spread between the two libraries
LP_TOL_OF = {"gptoss-sinks": 0.1}
# Over an 8-bit cache two attention kernels that are both exact up to fp16 rounding drift
# apart: a last-bit difference in one layer's output moves the next layer's K/V across an
# 8-bit code step (E4M3: 6%, int8: 1/127 of the row). csrc/fa2/probes/kv8_drift.py
# measures it on this matrix's llama-d128 and first-round prompts (CPU, two summation
# orders of the same float32 attention): over an fp16 cache the two stay equal within
# 0.023, over E4M3 they reach 0.10 and over int8 0.062 before parting at near ties (gaps
# <= 0.08). The 8-bit variants' tolerance is 2.5x that spread, for the logprobs and for
# the near ties where the tokens part (a drift of 0.2 flips a tie of that size): in the
# engines (H100, vLLM 0.26) logprobs drifted up to 0.21 and the tokens parted at gaps up
# to 0.18 (E4M3)
LP_TOL_KV8 = 0.25
TOPK = 5  # logprobs per step: a near tie of three tokens is still seen
# 1 GiB of KV cache whatever the GPU: engines of several xdist workers share it
ENGINE = dict(dtype="float16", max_model_len=4096, max_num_batched_tokens=256, max_num_seqs=16,
              enable_prefix_caching=True, skip_tokenizer_init=True, seed=0,
              gpu_memory_utilization=0.08, kv_cache_memory_bytes=1 << 30,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
# prompt_lookup_min 1: a random-weight model never continues a repeated motif, so longer
# n-grams never match its output (0 drafts, measured); the last token alone nearly always
# occurs earlier in a long prompt, so drafts are proposed and verified at most steps
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1}
LENGTHS = (5, 33, 300, 1000, 2500)
# (name, FA2 library, engine settings on top of ENGINE)
VARIANTS = {
    "sm75-graphs": ("sm75", {}),
    "sm75-eager": ("sm75", {"enforce_eager": True}),
    "sm70-graphs": ("sm70", {}),
    "sm70-eager": ("sm70", {"enforce_eager": True}),
}
# 8-bit KV caches (--kv-cache-dtype), against TRITON_ATTN over the same format: both
# engines quantize their own cache with the same rounding. The GQA-4 d128 and MQA d64
# models (decode: the sm75 decode kernel), with CUDA graphs. Not fp8_e5m2: vLLM 0.26's
# Triton backend views every fp8 cache as current_platform.fp8_dtype() (E4M3), so its
# "fp8_e5m2" stores and reads E4M3 codes and is no reference for an E5M2 cache.
KV8 = {"kv-fp8": "fp8", "kv-int8": "int8_per_token_head"}
VARIANTS.update({f"{arch}-{name}": (arch, {"kv_cache_dtype": dtype})
                 for arch in ("sm75", "sm70") for name, dtype in KV8.items()})
CASES = ([(m, v) for m in MODELS for v in ("sm75-graphs", "sm75-eager", "sm70-graphs", "sm70-eager")]
         + [("llama-d128", "sm75-ngram"), ("llama-d128", "sm70-ngram")]
         + [(m, f"sm75-{name}") for m in ("llama-d128", "llama-d64") for name in KV8]
         + [("llama-d128", f"sm70-{name}") for name in KV8])


def _prompts() -> list[list[list[int]]]:
    """Two rounds: mixed lengths, then prompts sharing prefixes with the first round's."""
    rng = random.Random(0)
    first = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in LENGTHS]
    tail = lambda n: [rng.randrange(4, VOCAB) for _ in range(n)]  # noqa: E731
    second = [first[3][:800] + tail(50), first[4][:2000] + tail(7), list(first[2]),
              first[1][:16] + tail(3)]
    return [first, second]


def _ngram_prompts() -> list[list[list[int]]]:
    """Repetitive prompts, so the ngram proposer finds matches to propose."""
    rng = random.Random(1)
    motif = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (7, 12, 20)]
    return [[m * reps for m, reps in zip(motif, (3, 30, 100))]]


def _out_dir(tmp_path_factory) -> str:
    out = os.environ.get("VLLM_ENGINE_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        return out
    return str(tmp_path_factory.getbasetemp().parent / "vllm_engine")


@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    return _Engines(_out_dir(tmp_path_factory))


class _Engines:
    """Runs each engine once per worker (the reference of a model is shared by its
    variants, which run on one xdist worker: --dist loadgroup)."""

    def __init__(self, out: str):
        self.out, self.cache = out, {}
        self.cap = tuple(torch.cuda.get_device_capability())

    def model(self, name: str) -> str:
        path = os.path.join(self.out, "models", name)
        os.makedirs(path, exist_ok=True)
        with open(path + ".lock", "w") as lock:  # xdist workers may ask at once
            fcntl.flock(lock, fcntl.LOCK_EX)
            return write_model(name, path)

    def result(self, model: str, backend: str, arch: str | None, extra: dict,
               tag: str, fp16_query: bool = False, env: dict | None = None,
               allow_fp16: bool = True, rounds: list | None = None) -> dict:
        """``allow_fp16``: lift vLLM's float16 refusal of the model in the harness (False: the
        engine must get float16 some other way); ``env``: this engine's own variables;
        ``rounds``: its prompts (default: the matrix's, or the ngram ones)."""
        key = (model, backend, arch, tag)
        if key not in self.cache:
            ngram = "ngram" in tag
            spec = {"name": f"{model}.{tag}", "model": self.model(model), "backend": backend,
                    "arch": arch, "task": "generate", "max_tokens": NEW_TOKENS, "logprobs": TOPK,
                    "rounds": rounds or (_ngram_prompts() if ngram else _prompts()),
                    "env": env or {},
                    "allow_fp16_models": list(fp16_forced(model)) if allow_fp16 else [],
                    "fp16_query": fp16_query,
                    "engine": {**ENGINE, **extra,
                               **({"speculative_config": NGRAM, "disable_log_stats": False}
                                  if ngram else {})}}
            self.cache[key] = _vllm_engine.run(spec, os.path.join(self.out, "runs"),
                                               capability=self.cap)
        return self.cache[key]


def _loadable(model: str, path: str) -> None:
    """Skips a model that the installed vLLM cannot load whatever the attention backend.
    vLLM 0.26's Gemma 4 sizes its full-attention layers from ``config.global_head_dim``;
    transformers 5.16 and later (5.16.1's source) fold that into ``per_layer_config``, so
    vLLM builds them at the sliding layers' head dim and refuses the checkpoint (measured on
    the H100 with TRITON_ATTN under transformers 5.17: "Attempted to load weight
    (torch.Size([512])) into parameter (torch.Size([256]))"). Under transformers 5.14.1 it
    loads and runs."""
    if MODELS[model][0] != "Gemma4TextConfig":
        return
    import transformers
    import vllm

    if not hasattr(transformers.AutoConfig.from_pretrained(path), "global_head_dim"):
        pytest.skip(f"vLLM {vllm.__version__} cannot load Gemma 4 under transformers "
                    f"{transformers.__version__} (config.global_head_dim is gone: "
                    "transformers keeps it in per_layer_config), with any attention backend")


def _compare_runs(ours: dict, ref: dict, *, lp_tol: float, tie_tol: float):
    """Every prompt of every round compared (token_match.compare): the rows of the record and
    the failures' descriptions."""
    assert len(ours["rounds"]) == len(ref["rounds"])
    rows, failures = [], []
    for r, (ref_round, our_round) in enumerate(zip(ref["rounds"], ours["rounds"])):
        for i, (a, b) in enumerate(zip(our_round, ref_round)):
            m = compare(a, b, lp_tol=lp_tol, tie_tol=tie_tol)
            rows.append({"round": r, "prompt": i, "ok": m.ok,
                         "equal": m.equal, "first_difference": m.first_difference,
                         "max_logprob_error": m.max_logprob_error, "tie_gap": m.tie_gap,
                         "cached_tokens": a["cached_tokens"],
                         "ref_cached_tokens": b["cached_tokens"], "what": m.describe(),
                         # both runs' top logprobs where they part
                         "at_difference": None if m.first_difference is None else {
                             "ours": a["logprobs"][m.first_difference],
                             "ref": b["logprobs"][m.first_difference]}})
            if not m.ok:
                failures.append(f"round {r} prompt {i}: {m.describe()}")
    return rows, failures


def _record(engines, model: str, covers: str, variant: str, arch: str | None, ours: dict,
            ref: dict, rows: list, **more) -> None:
    """result.MODEL.VARIANT.json, which report.py prints (``more``: kept beside the rows)."""
    record = {"model": model, "covers": covers, "variant": variant,
              "arch": arch, "device": ours["device"], "vllm": ours["vllm"],
              "startup_s": {"sm7x": ours["startup_s"], "triton": ref["startup_s"]},
              "spec_decode": {"sm7x": ours.get("spec_decode"), "triton": ref.get("spec_decode")},
              "log_lines": ours["log_lines"], "ref_log_lines": ref["log_lines"], "rows": rows,
              **more}
    with open(os.path.join(engines.out, f"result.{model}.{variant}.json"), "w") as f:
        json.dump(record, f, indent=1)


@pytest.mark.parametrize("model,variant", [
    pytest.param(m, v, marks=pytest.mark.xdist_group(  # a worker per reference engine
        m + ("-ngram" if "ngram" in v else "") + "".join(f"-{k}" for k in KV8 if v.endswith(k))))
    for m, v in CASES])
def test_engine_matches_triton(engines, model, variant):
    arch, extra = VARIANTS.get(variant, (variant.split("-")[0], {}))
    ngram = variant.endswith("ngram")
    kv = extra.get("kv_cache_dtype")
    # over an fp8 cache vLLM's Triton kernel would also quantize the query: the reference
    # keeps it fp16 as sm7x does (_vllm_engine's fp16_query)
    # An eager variant's reference is eager too: without torch.compile vLLM runs its own
    # custom ops instead of the compiled graph, so only the attention backend differs (a
    # random-weight MoE's routing turns those other differences into logprob errors > 0.1)
    eager = bool(extra.get("enforce_eager"))
    _loadable(model, engines.model(model))
    ref_extra = {"kv_cache_dtype": kv} if kv else {"enforce_eager": True} if eager else {}
    ref = engines.result(model, "TRITON_ATTN", None, ref_extra,
                         "triton-ngram" if ngram else f"triton-{kv}" if kv
                         else "triton-eager" if eager else "triton",
                         fp16_query=bool(kv and kv.startswith("fp8")))
    ours = engines.result(model, "sm7x", arch, extra, variant)
    tol = LP_TOL_KV8 if kv else LP_TOL_OF.get(model, LP_TOL)
    rows, failures = _compare_runs(ours, ref, lp_tol=tol, tie_tol=LP_TOL_KV8 if kv else TIE_TOL)
    _record(engines, model, MODELS[model][3], variant, arch, ours, ref, rows)
    if ngram:  # drafts were proposed and verified (acceptance is the random model's)
        assert ours["spec_decode"].get("spec_decode_num_draft_tokens", 0) > 0, ours["spec_decode"]
    else:  # the second round reuses the first one's prefixes wherever the reference does
        # (a model with sliding-window layers caches in larger blocks: Gemma 4's 16-token
        # shared prefix is shorter than one, in either engine)
        hits = [(row["cached_tokens"], row["ref_cached_tokens"]) for row in rows
                if row["round"] == 1]
        assert any(h for h, _ in hits) and all(h > 0 for h, ref_h in hits if ref_h > 0), \
            f"prefix-cache hits in round 2 (sm7x, reference): {hits}"
    graphs = [ln for ln in ours["log_lines"] if "Capturing CUDA graphs" in ln]
    if extra.get("enforce_eager"):
        assert not graphs, graphs
    else:
        assert any("FULL" in ln for ln in graphs), f"no full CUDA graph captured: {graphs}"
    assert not failures, "\n".join(failures)


# float16 against float32 engines (all of the model's rounding, not one kernel's): the
# same tolerance as the gpt-oss case
LP_TOL_FP32 = 0.1


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.xdist_group("gemma2-overflow"))
                                  for a in ("sm75", "sm70")])
def test_fp32_residual_serves_gemma2_in_float16(engines, arch):
    """Gemma 2 whose residual stream passes 65504 (models.SCALED), in float16 with
    SM7X_VLLM_FP32_RESIDUAL=1, which lifts vLLM's float16 refusal itself (the harness does
    not; CUDA graphs), against a float32 engine (TRITON_ATTN) at LP_TOL_FP32; and vLLM's own
    float16 run of the model (TRITON_ATTN, its refusal lifted by the harness) must break
    (NaN or an engine failure), or the model does not test what the option is for."""
    from sm7x.integrations.vllm import FP32_RESIDUAL_ENV

    model = "gemma2-overflow"
    ref = engines.result(model, "TRITON_ATTN", None, {"dtype": "float32"}, "triton-fp32")
    try:
        plain = engines.result(model, "TRITON_ATTN", None, {}, "triton")
        plain_rows, _ = _compare_runs(plain, ref, lp_tol=LP_TOL_FP32, tie_tol=LP_TOL_FP32)
        plain_fp16 = {"ok": all(r["ok"] for r in plain_rows),
                      "worst_logprob_error": max(r["max_logprob_error"] for r in plain_rows)}
    except _vllm_engine.EngineError as e:
        plain_fp16 = {"ok": False, "engine_failed": str(e)[-300:]}
    ours = engines.result(model, "sm7x", arch, {}, f"{arch}-graphs-fp32-residual",
                          env={FP32_RESIDUAL_ENV: "1"}, allow_fp16=False)
    rows, failures = _compare_runs(ours, ref, lp_tol=LP_TOL_FP32, tie_tol=LP_TOL_FP32)
    _record(engines, model, SCALED[model].about, f"{arch}-fp32-residual-vs-float32", arch, ours,
            ref, rows, plain_fp16=plain_fp16)
    assert any("residual stream kept in float32" in ln for ln in ours["log_lines"]), \
        "the sm7x plugin did not say it lifted vLLM's float16 refusal"
    assert any("FULL" in ln for ln in ours["log_lines"] if "Capturing CUDA graphs" in ln)
    assert not failures, "\n".join(failures)
    assert not plain_fp16["ok"], f"vLLM's own float16 run did not overflow: {plain_fp16}"


# The vision-language engines: tokenizer on (vLLM's multimodal processor needs it), up to
# two images per prompt, and the tower's attention named: vLLM would pick FLASH_ATTN on the
# H100 (TORCH_SDPA on V100 / T4, where sm7x replaces it), which the test's vLLM lacks
VL_ENGINE = dict(skip_tokenizer_init=False, limit_mm_per_prompt={"image": 2},
                 mm_encoder_attn_backend="TORCH_SDPA")


def _vl_prompts() -> list[list]:
    """One round: images of several sizes (16-256 patches; windows of 8 x 8 patches cut at
    their edges), two images of different sizes in one prompt, and a text-only prompt
    batched with them."""
    rng = random.Random(2)
    words = lambda n: [rng.randrange(4, VOCAB) for _ in range(n)]  # noqa: E731
    return [[{"token_ids": image_prompt_ids(words(5), 1), "images": [[150, 200, 0]]},
             {"token_ids": image_prompt_ids(words(30), 2), "images": [[56, 56, 1], [224, 168, 2]]},
             words(40),
             {"token_ids": image_prompt_ids(words(3), 1), "images": [[224, 224, 3]]}]]


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.xdist_group("qwen25vl"))
                                  for a in ("sm75", "sm70")])
def test_vision_tower_matches_sdpa(engines, arch):
    """Qwen2.5-VL (models.VL_MODELS) with the sm7x platform: the vision tower's attention
    through sm7x (Sm7xMMEncoderAttention in MMEncoderAttention's place, one varlen call per
    layer over the images' patches or windows) and the decoder's through the sm7x backend,
    CUDA graphs; against the same engine with TORCH_SDPA for the tower and TRITON_ATTN for
    the decoder, at the matrix's tolerances."""
    pytest.importorskip("torchvision", reason="transformers' Qwen2.5-VL video processor")
    model = "qwen25vl-d80"
    ref = engines.result(model, "TRITON_ATTN", None, VL_ENGINE, "triton-sdpa",
                         rounds=_vl_prompts())
    ours = engines.result(model, "sm7x", arch, VL_ENGINE, f"{arch}-graphs", rounds=_vl_prompts())
    rows, failures = _compare_runs(ours, ref, lp_tol=LP_TOL, tie_tol=TIE_TOL)
    _record(engines, model, VL_MODELS[model], f"{arch}-graphs", arch, ours, ref, rows)
    tower = [ln for ln in ours["log_lines"] if "MMEncoderAttention" in ln]
    assert any("Using sm7x FlashAttention-2 for MMEncoderAttention (head size 80)" in ln
               for ln in tower), f"the vision tower did not run on sm7x: {tower}"
    assert not failures, "\n".join(failures)
