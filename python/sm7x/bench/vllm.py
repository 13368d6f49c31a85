"""vLLM offline serving with sm7x's attention backend against vLLM's own backends for
Volta/Turing (TRITON_ATTN, and FLEX_ATTENTION where it runs), in one run, same engine
settings.

``[SM7X_FA2_FORCE=sm75] python -m sm7x.bench vllm [--out vllm.json] [--plot vllm.png]
[--backends sm7x,TRITON_ATTN,FLEX_ATTENTION] [--cases 256x512x256,8x16kx256,8x32kx256]
[--ttft 2k,8k,16k] [--layers 16] [--quick]``

Model: a Llama-style config (hidden 2048, 16 layers, GQA 32/8, head dim 128, MLP 8192,
vocab 32000: 1.2 B parameters), float16, weights drawn by vLLM (``load_format="dummy"``,
nothing to download); prompts are random token ids (no tokenizer), every request generates
exactly its output length (``ignore_eos``). Each backend runs in its own engine process
(sm7x.bench._vllm_engine) with vLLM's default CUDA graphs, prefix caching off.

- throughput, per case PROMPTSxINPUTxOUTPUT: output tokens/s of one ``LLM.generate`` of
  all prompts, after an untimed generate of the same shapes (compilation, Triton's
  autotuning per shape);
- TTFT per input length: the median latency of a one-token generate of one prompt (the
  prefill and the first token), after a warm-up at that length.

Ratios: sm7x's tokens/s over the baseline's, and the baseline's TTFT over sm7x's (> 1:
sm7x faster). On GPUs newer than Turing sm7x runs the forced library's PTX (the test aid
SM7X_VLLM_TEST_ANY_GPU is set for its engine): the ratios compare kernels on that GPU, not
a T4's or V100's absolute speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from . import _output
from .decode import parse_sizes

MODEL = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
             num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             intermediate_size=8192, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=500000.0,
             hidden_act="silu", tie_word_embeddings=False, torch_dtype="float16",
             bos_token_id=1, eos_token_id=2)
DEFAULT_BACKENDS = ("sm7x", "TRITON_ATTN", "FLEX_ATTENTION")
DEFAULT_CASES = "256x512x256,8x16kx256,8x32kx256"
QUICK = dict(cases="16x512x32,2x4kx32", ttft="2k", layers=2)


def parse_cases(text: str) -> list[dict]:
    """"256x512x256,8x16kx256" -> [{prompts, input, output}, ...] (k = 1024)."""
    cases = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        fields = part.lower().split("x")
        if len(fields) != 3:
            raise ValueError(f"case {part!r} is not PROMPTSxINPUTxOUTPUT (e.g. 8x16kx256)")
        n, lin, lout = (parse_sizes(f)[0] for f in fields)
        cases.append({"prompts": n, "input": lin, "output": lout})
    if not cases:
        raise ValueError("no cases given")
    return cases


def ratios(result: dict) -> list[dict]:
    """sm7x against each baseline: tokens/s ratio per case, TTFT ratio per length."""
    runs = {r["backend"]: r for r in result["runs"] if "error" not in r}
    ours = runs.get("sm7x")
    rows = []
    if ours is None:
        return rows
    for name, base in runs.items():
        if name == "sm7x":
            continue
        for a, b in zip(ours.get("cases", []), base.get("cases", [])):
            rows.append({"baseline": name, "what": _case_label(a),
                         "ratio": a["output_tok_s"] / b["output_tok_s"]})
        for a, b in zip(ours.get("ttft", []), base.get("ttft", [])):
            rows.append({"baseline": name, "what": f"TTFT {a['input'] // 1024}k",
                         "ratio": b["seconds"] / a["seconds"]})
    return rows


def _case_label(c: dict) -> str:
    k = lambda n: f"{n // 1024}k" if n % 1024 == 0 else str(n)  # noqa: E731
    return f"{c['prompts']}x{k(c['input'])} in / {c['output']} out"


def _parser() -> argparse.ArgumentParser:
    p = _output.argument_parser("vllm", __doc__.split("\n\n")[0], plot="a PNG of the ratios",
                        out="the results as JSON (rewritten after each backend)")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                   help="sm7x and vLLM attention backend names (the first baseline after "
                        "sm7x is the main one)")
    p.add_argument("--cases", default=DEFAULT_CASES, help="PROMPTSxINPUTxOUTPUT, comma-separated")
    p.add_argument("--ttft", default="2k,8k,16k", help="TTFT input lengths")
    p.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    p.add_argument("--repeats", type=int, default=3, help="TTFT samples per length")
    p.add_argument("--arch", default=None, help="FA2 library for sm7x (default: "
                   "$SM7X_FA2_FORCE, else sm75 on GPUs newer than Turing)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine")
    p.add_argument("--workdir", help="engine logs and the model config (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="small shapes, 2 layers (a smoke run)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.cases, args.ttft, args.layers = QUICK["cases"], QUICK["ttft"], QUICK["layers"]
    try:
        cases = parse_cases(args.cases)
        ttft = parse_sizes(args.ttft) if args.ttft.strip() else []
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        if "sm7x" not in backends or len(backends) < 2:
            raise ValueError("--backends must name sm7x and at least one vLLM backend")
        if args.layers < 1 or args.repeats < 1:
            raise ValueError("--layers and --repeats must be >= 1")
    except ValueError as exc:
        print(f"sm7x.bench vllm: {exc}", file=sys.stderr)
        return 2
    try:
        import torch
        import vllm
    except ImportError as exc:
        print(f"sm7x.bench vllm: needs vLLM and torch ({exc})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sm7x.bench vllm: needs a CUDA GPU", file=sys.stderr)
        return 2
    from . import _vllm_engine

    cap = tuple(torch.cuda.get_device_capability())
    arch = args.arch or os.environ.get("SM7X_FA2_FORCE") or (None if cap < (8, 0) else "sm75")
    work = args.workdir or tempfile.mkdtemp(prefix="sm7x-bench-vllm-")
    model_dir = os.path.join(work, "model")
    os.makedirs(model_dir, exist_ok=True)
    longest = max([c["input"] + c["output"] for c in cases] + [t + 1 for t in ttft])
    config = {**MODEL, "num_hidden_layers": args.layers, "max_position_embeddings": longest}
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    engine = dict(dtype="float16", load_format="dummy", skip_tokenizer_init=True, seed=0,
                  max_model_len=longest, enable_prefix_caching=False,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  max_num_seqs=max(c["prompts"] for c in cases))
    print(f"sm7x.bench vllm on {torch.cuda.get_device_name()} (sm{cap[0]}{cap[1]}), vLLM "
          f"{vllm.__version__}, sm7x FA2 library {arch or 'by capability'}"
          + ("  [a GPU newer than Turing runs the forced library's PTX]" if cap >= (8, 0) else ""),
          flush=True)
    result = {"benchmark": "vllm", "device": torch.cuda.get_device_name(),
              "capability": f"{cap[0]}.{cap[1]}", "vllm": vllm.__version__,
              "torch": torch.__version__, "fa2_library": arch,
              "model": {k: v for k, v in config.items() if k != "architectures"},
              "engine": engine, "runs": []}
    for backend in backends:
        spec = {"name": f"bench-{backend}", "model": model_dir, "backend": backend,
                "arch": arch, "task": "throughput", "vocab": MODEL["vocab_size"],
                "cases": cases, "ttft": ttft, "repeats": args.repeats, "engine": engine}
        try:
            run = _vllm_engine.run(spec, work, capability=cap, timeout=args.timeout)
        except _vllm_engine.EngineError as exc:
            run = {"backend": backend, "error": str(exc)[-2000:]}
            print(f"{backend}: FAILED\n{exc}", flush=True)
        result["runs"].append(run)
        for c in run.get("cases", []):
            print(f"{backend:>15} {_case_label(c):>24}: {c['output_tok_s']:9.0f} output tok/s "
                  f"({c['seconds']:.1f} s)", flush=True)
        for t in run.get("ttft", []):
            print(f"{backend:>15} {'TTFT ' + str(t['input']):>24}: {t['seconds'] * 1e3:9.1f} ms",
                  flush=True)
        result["ratios"] = ratios(result)
        _output.write(result, args.out, None, _draw)
    for r in result["ratios"]:
        print(f"sm7x vs {r['baseline']:>15} {r['what']:>24}: {r['ratio']:.2f}x")
    _output.write(result, None, args.plot, _draw)
    return 0 if all("error" not in r for r in result["runs"]) else 1


def _draw(result: dict, plt):
    rows = result.get("ratios", [])
    labels = list(dict.fromkeys(r["what"] for r in rows))
    series = {}
    for r in rows:
        series.setdefault(f"vs {r['baseline']}", {})[r["what"]] = r["ratio"]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(labels)), 4))
    if series:
        _output.grouped_bars(ax, labels, {k: [v.get(x, 0) for x in labels]
                                          for k, v in series.items()})
        ax.legend()
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("sm7x speed-up (tokens/s ratio; TTFT: baseline / sm7x)")
    ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"vLLM {result['vllm']}, {result['device']}, FA2 {result['fa2_library']}")
    return fig


if __name__ == "__main__":
    sys.exit(main())
