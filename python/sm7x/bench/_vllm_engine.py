"""One real vLLM engine per child process, described by a JSON spec: what
``python -m sm7x.bench vllm`` times and what tests/vllm_engine compares.

Why a child per engine: vLLM keeps process-wide state (the platform, compiled graphs, the
CUDA context and its memory), so two engines with different attention backends or FA2
libraries are only comparable, and only cleanly torn down, in separate processes.

The parent calls :func:`run`; the child (``python -m sm7x.bench._vllm_engine SPEC OUT``)
builds ``vllm.LLM(**spec["engine"])`` and runs ``spec["task"]``:

- ``generate``: greedy generation of ``rounds`` (lists of token-id prompts, with images
  for a multimodal model: ``_prompts``; one ``LLM.generate`` call per round, so a later
  round hits the prefix cache of an earlier one), with the top ``logprobs`` of every
  step; returns tokens, logprobs and the prefix cache hits per prompt.
- ``throughput``: ``cases`` of (prompts, input length, output length): one untimed
  warm-up generate of the same shapes, then the timed one; and ``ttft`` lengths: the
  median latency of a one-token generate of one prompt of that length after a warm-up
  at the same length (Triton compiles per shape; prefix caching is off for these).

``fp16_query`` (a TRITON_ATTN reference over an fp8 cache): the query stays fp16, as in
sm7x, instead of vLLM quantizing it to fp8 for the Triton kernel. ``env``: variables set
in this engine's process only.

Backends: ``"sm7x"`` lets vLLM choose (with sm7x's platform plugin that is sm7x's
backend; the child checks the log line that says so), with ``arch`` forcing the FA2
library (SM7X_FA2_FORCE) and, on GPUs newer than Turing, the test aid
SM7X_VLLM_TEST_ANY_GPU; any other name is passed to vLLM as ``attention_backend``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

# Log lines worth keeping in a result: which backend vLLM took, and its CUDA graphs.
LOG_KEEP = re.compile(r"Using the sm7x FlashAttention-2|sm7x FlashAttention-2 backend not "
                      r"used|Using AttentionBackendEnum|Using \S+ backend|Capturing CUDA graphs"
                      r" \(.*100%|Graph capturing finished|Platform plugin|residual stream kept in "
                      r"float32|MMEncoderAttention|for vit attention")
SM7X_LOG = "Using the sm7x FlashAttention-2 attention backend"


class EngineError(RuntimeError):
    """The child engine failed; the message carries the end of its log."""


def child_env(spec: dict, capability: tuple[int, int] | None) -> dict:
    """The child's environment: the FA2 library forced for sm7x runs, the test aid on GPUs
    newer than Turing, vLLM's own sampler (no flashinfer needed)."""
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    for k in ("SM7X_FA2_FORCE", "SM7X_VLLM_TEST_ANY_GPU"):
        env.pop(k, None)
    if spec["backend"] == "sm7x":
        if spec.get("arch"):
            env["SM7X_FA2_FORCE"] = spec["arch"]
        if capability is not None and capability >= (8, 0):
            env["SM7X_VLLM_TEST_ANY_GPU"] = "1"
    if spec.get("fp16_query"):  # the patch (_keep_query_fp16) must reach the engine core
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(spec.get("env", {}))  # e.g. SM7X_VLLM_FP32_RESIDUAL for one engine
    return env


def _keep_query_fp16() -> None:
    """A reference over an fp8 cache as sm7x computes it: vLLM's Triton backend quantizes
    the query to fp8 too where the GPU has fp8 tensor cores (sm89+: the only GPUs where it
    takes an fp8 cache at all), sm7x keeps it fp16 (V100 / T4 have no fp8 MMA). The spec's
    ``fp16_query`` turns that quantization off in this engine (run in-process, child_env)."""
    from vllm.v1.attention.backends import triton_attn

    init = triton_attn.TritonAttentionImpl.__init__

    def init_fp16_query(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.supports_quant_query_input = False

    triton_attn.TritonAttentionImpl.__init__ = init_fp16_query


def run(spec: dict, workdir: str, *, capability: tuple[int, int] | None = None,
        timeout: float = 900) -> dict:
    """Runs one engine in a child process; returns its result with ``log_lines`` (the
    kept vLLM log lines) and ``log`` (the log file). Raises EngineError on failure."""
    os.makedirs(workdir, exist_ok=True)
    name = spec["name"]
    spec_path, out_path = (os.path.join(workdir, f"{name}.{x}") for x in ("spec.json", "out.json"))
    log_path = os.path.join(workdir, f"{name}.log")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if os.path.exists(out_path):
        os.remove(out_path)
    with open(log_path, "w") as log:
        # its own process group, ended whole afterwards: vLLM's engine-core process (and its
        # GPU memory) must not outlive the engine, whatever way the child ended
        proc = subprocess.Popen([sys.executable, "-m", __name__, spec_path, out_path],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=child_env(spec, capability))
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    text = open(log_path, errors="replace").read()
    if rc != 0 or not os.path.exists(out_path):
        raise EngineError(f"vLLM engine {name} ({spec['backend']}) failed (exit {rc}); log "
                          f"{log_path}, last lines:\n" + "\n".join(text.splitlines()[-40:]))
    with open(out_path) as f:
        result = json.load(f)
    result["log_lines"] = [ln.strip()[-300:] for ln in text.splitlines() if LOG_KEEP.search(ln)]
    result["log"] = log_path
    if spec["backend"] == "sm7x" and not any(SM7X_LOG in ln for ln in result["log_lines"]):
        raise EngineError(f"vLLM engine {name}: vLLM did not choose the sm7x backend (no "
                          f"'{SM7X_LOG}' in {log_path}); is sm7x installed where vLLM sees "
                          f"its entry points (pip install -e . or the conda package)?")
    return result


# ----------------------------------------------------------------------------- the child


def _sampling(max_tokens: int, logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=logprobs, detokenize=False)


def _image(height: int, width: int, seed: int):
    """A random RGB image (PIL), the same for a (height, width, seed) in every engine."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3),
                                                               dtype=np.uint8))


def _prompts(rows):
    """Token-id prompts: a list of ids, or {"token_ids": [...], "images": [[height, width,
    seed], ...]} for a multimodal model (the ids hold its image placeholders)."""
    from vllm.inputs import TokensPrompt

    out = []
    for r in rows:
        if isinstance(r, dict):
            prompt = TokensPrompt(prompt_token_ids=list(r["token_ids"]))
            prompt["multi_modal_data"] = {"image": [_image(*i) for i in r["images"]]}
            out.append(prompt)
        else:
            out.append(TokensPrompt(prompt_token_ids=list(r)))
    return out


def _generate(llm, spec: dict) -> dict:
    rounds = []
    for prompts in spec["rounds"]:
        outs = llm.generate(_prompts(prompts), _sampling(spec["max_tokens"], spec["logprobs"]),
                            use_tqdm=False)
        rows = []
        for o in outs:
            c = o.outputs[0]
            steps = [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]
            rows.append({"tokens": list(c.token_ids), "logprobs": steps,
                         "cached_tokens": o.num_cached_tokens or 0})
        rounds.append(rows)
    return {"rounds": rounds, "spec_decode": _spec_decode_counts(llm)}


def _spec_decode_counts(llm) -> dict:
    """vLLM's speculative-decoding counters (drafts, draft and accepted tokens), when the
    engine speculates and keeps stats; {} otherwise."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # stats off (vLLM's default offline) or an API that moved
        return {}
    return {m.name.removeprefix("vllm:"): getattr(m, "value", None)
            for m in metrics if "spec_decode_num" in m.name and hasattr(m, "value")}


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def _throughput(llm, spec: dict) -> dict:
    vocab = spec["vocab"]
    cases = []
    for case in spec.get("cases", []):
        n, lin, lout = case["prompts"], case["input"], case["output"]
        warm = _random_prompts(n, lin, vocab, seed=1)
        llm.generate(_prompts(warm), _sampling(lout), use_tqdm=False)  # compile, autotune
        prompts = _random_prompts(n, lin, vocab, seed=2)
        t0 = time.perf_counter()
        outs = llm.generate(_prompts(prompts), _sampling(lout), use_tqdm=False)
        dt = time.perf_counter() - t0
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        cases.append({**case, "seconds": dt, "output_tokens": generated,
                      "output_tok_s": generated / dt, "total_tok_s": (generated + n * lin) / dt})
    ttft = []
    for length in spec.get("ttft", []):
        llm.generate(_prompts(_random_prompts(1, length, vocab, seed=3)), _sampling(1),
                     use_tqdm=False)  # warm-up at this shape
        times = []
        for r in range(spec.get("repeats", 3)):
            p = _prompts(_random_prompts(1, length, vocab, seed=10 + r))
            t0 = time.perf_counter()
            llm.generate(p, _sampling(1), use_tqdm=False)
            times.append(time.perf_counter() - t0)
        times.sort()
        ttft.append({"input": length, "seconds": times[len(times) // 2], "all": times})
    return {"cases": cases, "ttft": ttft}


def _child(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("allow_fp16_models"):
        # vLLM refuses float16 for some model types ("numerical instability", e.g. Gemma 2);
        # the tests force it where the point is the attention kernel, and say so.
        from vllm.config import model as model_config

        for t in spec["allow_fp16_models"]:
            model_config._FLOAT16_NOT_SUPPORTED_MODELS.pop(t, None)
    if spec.get("fp16_query"):
        _keep_query_fp16()
    from vllm import LLM

    engine = dict(spec["engine"])
    if spec["backend"] != "sm7x":
        engine["attention_backend"] = spec["backend"]
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **engine)
    startup = time.perf_counter() - t0
    task = {"generate": _generate, "throughput": _throughput}[spec["task"]]
    result = {"name": spec["name"], "backend": spec["backend"], "arch": spec.get("arch"),
              "startup_s": startup, **task(llm, spec)}
    import torch
    import vllm

    result.update(vllm=vllm.__version__, torch=torch.__version__,
                  device=torch.cuda.get_device_name(),
                  capability=".".join(map(str, torch.cuda.get_device_capability())))
    with open(out_path + ".partial", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".partial", out_path)
    try:
        llm.llm_engine.engine_core.shutdown()  # the engine-core process and its GPU memory
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # vLLM's engine teardown at interpreter exit can hang or crash: skip it


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m sm7x.bench._vllm_engine SPEC.json OUT.json")
    sys.exit(_child(sys.argv[1], sys.argv[2]))
