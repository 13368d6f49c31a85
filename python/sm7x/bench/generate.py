"""End-to-end generation through transformers: ``attn_implementation="sdpa"`` against
``"sm7x"``, in one run, on one random-weight ~1B Llama-style model.

``[SM7X_FA2_FORCE=sm75] python -m sm7x.bench generate [--out generate.json]
[--plot generate.png] [--prefixes 2k,8k,13k] [--batches 1,8] [--decode-tokens 200]
[--decode-prefix 13k] [--sdpa turing|native] [--quick]``

Model (from a config, no download): hidden 2048, 16 layers, 32 query heads / 8 KV heads
(GQA 4), head dim 128, MLP 8192, vocab 32000 (1.2 B parameters), fp16, random weights;
both implementations run the same weights (``set_attn_implementation`` between them).
Prompts are random token ids, every sequence of a batch the same length (no padding).

- TTFT: ``generate(max_new_tokens=1)`` on a batch of prompts of ``prefix`` tokens (the
  prefill and the first token), median of ``--repeats`` after a warm-up.
- decode tokens/s: ``generate`` of ``1 + decode_tokens`` new tokens after a
  ``decode_prefix``-token prompt, minus the TTFT of that prompt, per sequence and for the
  batch: what a user of ``generate()`` sees, transformers' Python overhead included.

Baselines, both through torch SDPA:

- ``sdpa``: transformers' own ``attn_implementation="sdpa"``. Without a padding mask it
  passes GQA as ``enable_gqa=True``, which torch's memory-efficient kernel does not take:
  on Volta/Turing (no flash backend) SDPA then runs its math path, which materializes the
  [batch, heads, q, k] scores. A shape where that runs out of memory is reported as OOM.
- ``sdpa_expanded``: the same call with K/V expanded to all query heads first (what
  transformers does whenever a padding mask is present), so the memory-efficient kernel
  runs: the strongest SDPA baseline a T4/V100 has.

Where a decode step goes: each decode row is also run with an attention implementation that
launches nothing (``no_attention``: the query returned as the output; the tokens are
meaningless, the step's other work, KV cache updates and transformers' Python included, is
the same). Its step time is the floor every implementation shares; each one's attention
costs its step time minus the floor, and ``max_x_sdpa_expanded`` = sdpa_expanded's step /
the floor is the most sm7x could gain over it if its attention cost nothing.

And each decode row times one attention call per implementation at its shape (a query
row per sequence against ``decode_prefix`` keys, no mask, as an unpadded generate passes
it): ``<impl>_call_host_us`` is the host's time per call over ``CALLS`` calls launched
back to back, ``<impl>_call_us`` the same with the GPU's work waited for; where the two
agree the call is bound by the host (Python, checks, launches), not the kernel.

``--sdpa turing`` (the default on GPUs newer than Turing) restricts SDPA to the backends it
has on Volta/Turing (memory-efficient and math; its flash backend needs sm80), so the
ratios are the ones a T4/V100 user would compare with; ``--sdpa native`` lets torch
choose. On a GPU newer than Turing sm7x runs the forced library's PTX: the ratios
show what the kernels do relative to SDPA's memory-efficient kernel on that GPU, not a
T4's or V100's absolute speed (a T4 has ~1/10 of an H200's fp16 tensor throughput and
~1/15 of its memory bandwidth, and transformers' per-token Python cost weighs more next
to a faster GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time

from . import _output
from .decode import parse_sizes

MODEL = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, intermediate_size=8192, vocab_size=32000)
IMPLS = ("sdpa", "sdpa_expanded", "sm7x")
BASELINES = IMPLS[:2]
NO_ATTENTION = "no_attention"  # the decode floor (_register_no_attention)
DEFAULT_PREFIXES, DEFAULT_BATCHES = (2048, 8192, 13312), (1, 8)
QUICK = dict(prefixes=(2048,), batches=(1,), decode_tokens=32, decode_prefix=2048, layers=4)


def ratio(base: float | None, ours: float | None) -> float | None:
    """How many times faster sm7x is: base time / sm7x time (or sm7x rate / base rate)."""
    return base / ours if base and ours else None


def decode_rate(t_total: float, t_first: float, batch: int, tokens: int) -> float | None:
    """Tokens/s of the batch over the decode steps: (total - TTFT) covers `tokens` steps."""
    dt = t_total - t_first
    return batch * tokens / dt if dt > 0 else None


def step_account(r: dict) -> dict:
    """A decode row's step times (ms per step) and each implementation's attention share:
    step minus the no-attention floor; and the most sm7x could gain over sdpa_expanded
    (its step / the floor). None where a run is missing (OOM)."""
    def step_ms(rate):
        return 1e3 * r["batch"] / rate if rate else None

    floor = step_ms(r.get(f"{NO_ATTENTION}_tok_s"))
    out = {"floor_ms": floor}
    for impl in IMPLS:
        step = step_ms(r.get(f"{impl}_tok_s"))
        out[f"{impl}_step_ms"] = step
        out[f"{impl}_attention_ms"] = step - floor if step and floor else None
    out["max_x_sdpa_expanded"] = ratio(out["sdpa_expanded_step_ms"], floor)
    return out


CALLS = 200


def time_attention_calls(torch, impls, batch: int, kv_len: int, heads: int, kv_heads: int,
                         head_dim: int, device: str = "cuda", calls: int = CALLS) -> dict:
    """{impl}_call_host_us / {impl}_call_us: one decode-shaped call of each registered
    attention implementation (``query [batch, heads, 1, head_dim]``, ``key``/``value
    [batch, kv_heads, kv_len, head_dim]``, fp16, no mask), per call."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, 1, head_dim, generator=g, device=device, dtype=torch.float16)
    k, v = (torch.randn(batch, kv_heads, kv_len, head_dim, generator=g, device=device,
                        dtype=torch.float16) for _ in range(2))
    module = torch.nn.Module()  # what the implementations read from an attention layer
    module.is_causal, module.layer_idx = True, 0
    module.num_key_value_groups = heads // kv_heads  # transformers' sdpa repeats K/V by it
    out = {}
    for impl in impls:
        fn = ALL_ATTENTION_FUNCTIONS[impl]
        try:
            for _ in range(10):  # warm-up: plans, allocator, autotune
                fn(module, q, k, v, None, scaling=head_dim ** -0.5)
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(module, q, k, v, None, scaling=head_dim ** -0.5)
            host = time.perf_counter() - t0
            sync()
            total = time.perf_counter() - t0
        except torch.OutOfMemoryError:  # no entry: the report says which is missing
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        out[f"{impl}_call_host_us"] = host / calls * 1e6
        out[f"{impl}_call_us"] = total / calls * 1e6
    return out


def sdpa_backends(impl: str, mode: str):
    """The context a run of ``impl`` goes in: for the SDPA baselines under ``--sdpa turing``,
    torch SDPA limited to the backends Volta/Turing have (memory-efficient and math)."""
    if impl not in BASELINES or mode == "native":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def setup(bench: str, sdpa: str | None):
    """What a transformers benchmark (generate, train) starts from, printed: (torch,
    transformers, the sm7x integration, the GPU's capability, the SDPA backends' mode, the
    FA2 library in use), with the baselines and the floor registered; None (said on stderr)
    without a CUDA GPU or transformers."""
    import torch

    if not torch.cuda.is_available():
        print(f"sm7x.bench {bench}: needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return None
    try:
        import transformers

        from ..integrations import transformers as sm7x_tf
    except ImportError as exc:
        print(f"sm7x.bench {bench}: {exc}", file=sys.stderr)
        return None
    from .. import _select

    _register_expanded_sdpa(transformers, torch)
    _register_no_attention(transformers)
    cap = torch.cuda.get_device_capability()
    sdpa_mode = sdpa or ("turing" if cap >= (8, 0) else "native")
    sel = _select.select_fa2_library(_select.Device(torch.cuda.current_device(),
                                                    torch.cuda.get_device_name(), tuple(cap)))
    info = sel.arch + (" (forced)" if sel.forced else "")
    print(f"sm7x.bench {bench} on {torch.cuda.get_device_name()} (sm{cap[0]}{cap[1]}), "
          f"FA2 library {info}; sdpa backends: {sdpa_mode}"
          + ("  [a GPU newer than Turing runs the forced library's PTX]" if cap > (7, 5) else ""))
    return torch, transformers, sm7x_tf, cap, sdpa_mode, info


def _register_no_attention(transformers) -> None:
    """``attn_implementation="no_attention"``: returns the query as the output ([batch,
    seq, heads, head_dim], a view: no kernel), so a step costs everything but attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def forward(module, query, key, value, attention_mask, **kwargs):
        return query.transpose(1, 2), None

    AttentionInterface.register(NO_ATTENTION, forward)
    AttentionMaskInterface.register(NO_ATTENTION, sdpa_mask)


def _register_expanded_sdpa(transformers, torch) -> None:
    """``attn_implementation="sdpa_expanded"``: K/V repeated to every query head, then SDPA
    with transformers' SDPA mask (None or a boolean mask; causal when None)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                is_causal=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        causal = attention_mask is None and query.shape[2] > 1 and (
            is_causal if is_causal is not None else getattr(module, "is_causal", True))
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=causal)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("sdpa_expanded", forward)
    AttentionMaskInterface.register("sdpa_expanded", sdpa_mask)


def add_sdpa_argument(p) -> None:
    """--sdpa, read by setup(): the SDPA baselines' backends."""
    p.add_argument("--sdpa", choices=("turing", "native"), default=None,
                   help="SDPA backends: those of Volta/Turing (default on newer GPUs) or "
                        "torch's choice")


def _parser() -> argparse.ArgumentParser:
    p = _output.argument_parser("generate", __doc__.split("\n\n")[0],
                                plot="a PNG of TTFT and decode rates")
    p.add_argument("--prefixes", default="2k,8k,13k", help="TTFT prompt lengths")
    p.add_argument("--batches", default="1,8", help="batch sizes")
    p.add_argument("--decode-tokens", type=int, default=200)
    p.add_argument("--decode-prefix", default="13k", help="prompt length before decoding")
    p.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    p.add_argument("--repeats", type=int, default=3)
    add_sdpa_argument(p)
    p.add_argument("--quick", action="store_true",
                   help="one short shape on a 4-layer model (a smoke run)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        prefixes, batches = parse_sizes(args.prefixes), parse_sizes(args.batches)
        decode_prefix = parse_sizes(args.decode_prefix)[0]
    except ValueError as exc:
        print(f"sm7x.bench generate: {exc}", file=sys.stderr)
        return 2
    if args.decode_tokens < 1 or args.repeats < 1 or args.layers < 1:
        print("sm7x.bench generate: --decode-tokens, --repeats and --layers must be >= 1",
              file=sys.stderr)
        return 2
    layers, decode_tokens = args.layers, args.decode_tokens
    if args.quick:
        prefixes, batches = QUICK["prefixes"], QUICK["batches"]
        decode_tokens, decode_prefix, layers = (QUICK["decode_tokens"], QUICK["decode_prefix"],
                                                QUICK["layers"])
    env = setup("generate", args.sdpa)
    if env is None:
        return 2
    torch, transformers, sm7x_tf, cap, sdpa_mode, info = env

    cfg = transformers.LlamaConfig(**{**MODEL, "num_hidden_layers": layers},
                                   max_position_embeddings=max(prefixes + [decode_prefix]) + 1024,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).eval()
    params = sum(p.numel() for p in model.parameters())

    def sdpa_ctx(impl):
        return sdpa_backends(impl, sdpa_mode)

    def timed_generate(impl, batch, prefix, new_tokens, repeats):
        model.set_attn_implementation(impl)
        g = torch.Generator(device="cuda").manual_seed(prefix + batch)
        ids = torch.randint(1, cfg.vocab_size, (batch, prefix), device="cuda", generator=g)
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
        times = []
        try:
            with torch.inference_mode(), sdpa_ctx(impl):
                model.generate(ids, **kw)  # warm-up (JIT, autotune, allocator)
                for _ in range(repeats):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = model.generate(ids, **kw)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            return None  # reported as OOM
        finally:
            torch.cuda.empty_cache()
        assert out.shape[1] == prefix + new_tokens
        return statistics.median(times)

    rows = []
    for batch in batches:
        for prefix in prefixes:
            r = {"kind": "ttft", "batch": batch, "prefix": prefix}
            for impl in IMPLS:
                r[f"{impl}_s"] = timed_generate(impl, batch, prefix, 1, args.repeats)
            for base in BASELINES:
                r[f"x_{base}"] = ratio(r[f"{base}_s"], r["sm7x_s"])
            rows.append(r)
            print(_line(r, "_s", 1e3, "ms"), flush=True)
        r = {"kind": "decode", "batch": batch, "prefix": decode_prefix, "tokens": decode_tokens}
        for impl in IMPLS + (NO_ATTENTION,):
            first = timed_generate(impl, batch, decode_prefix, 1, 1)
            total = timed_generate(impl, batch, decode_prefix, 1 + decode_tokens, 1)
            r[f"{impl}_tok_s"] = (decode_rate(total, first, batch, decode_tokens)
                                  if first and total else None)
        for base in BASELINES:
            r[f"x_{base}"] = ratio(r["sm7x_tok_s"], r[f"{base}_tok_s"])
        r.update(step_account(r))
        with torch.inference_mode(), sdpa_ctx("sdpa_expanded"):
            r.update(time_attention_calls(torch, IMPLS + (NO_ATTENTION,), batch, decode_prefix,
                                          cfg.num_attention_heads, cfg.num_key_value_heads,
                                          MODEL["head_dim"]))
        rows.append(r)
        print(_line(r, "_tok_s", 1, "tok/s"), flush=True)
        print(_account_line(r), flush=True)
        print(_calls_line(r), flush=True)
    result = {"benchmark": "generate", "device": torch.cuda.get_device_name(),
              "capability": f"{cap[0]}.{cap[1]}", "fa2_library": info,
              "sdpa_backends": sdpa_mode, "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "model": {**MODEL, "num_hidden_layers": layers, "parameters": params,
                        "dtype": "float16"},
              "attn_implementation": sm7x_tf.NAME, "results": rows}
    _output.write(result, args.out, args.plot, _draw)
    return 0


def _line(r: dict, suffix: str, scale: float, unit: str) -> str:
    what = (f"TTFT   batch {r['batch']:>2} prefix {r['prefix']:>6}" if r["kind"] == "ttft"
            else f"decode batch {r['batch']:>2} after  {r['prefix']:>6}")
    vals = "  ".join(f"{i} " + (f"{r[i + suffix] * scale:9.1f} {unit}" if r[i + suffix]
                                else f"{'OOM':>9} {unit}") for i in IMPLS)
    xs = "  ".join(f"x{b} " + (f"{r['x_' + b]:.2f}" if r["x_" + b] else "-") for b in BASELINES)
    return f"{what}: {vals}  sm7x {xs}"


def _account_line(r: dict) -> str:
    def ms(x):
        return f"{x:.2f} ms" if x is not None else "-"

    most = r["max_x_sdpa_expanded"]
    return (f"  decode step: {ms(r['floor_ms'])} without attention; attention adds "
            + ", ".join(f"{i} {ms(r[i + '_attention_ms'])}" for i in IMPLS)
            + (f"; at most x{most:.2f} over sdpa_expanded if sm7x's attention cost nothing"
               if most else ""))


def _calls_line(r: dict) -> str:
    impls = [i for i in IMPLS + (NO_ATTENTION,) if f"{i}_call_us" in r]
    if not impls:
        return "  one attention call: -"
    return ("  one attention call (host / with the GPU): "
            + ", ".join(f"{i} {r[i + '_call_host_us']:.0f} / {r[i + '_call_us']:.0f} us"
                        for i in impls))


def _draw(result: dict, plt):
    ttft = [r for r in result["results"] if r["kind"] == "ttft"]
    dec = [r for r in result["results"] if r["kind"] == "decode"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"b{r['batch']} {r['prefix'] // 1024}k" for r in ttft]
    _output.grouped_bars(a, labels, {i: [(r[f"{i}_s"] or 0) * 1e3 for r in ttft] for i in IMPLS})
    a.set_ylabel("time to first token (ms; 0: OOM)")
    a.legend()
    labels = [f"b{r['batch']} after {r['prefix'] // 1024}k" for r in dec]
    _output.grouped_bars(b, labels, {i: [r[f"{i}_tok_s"] or 0 for r in dec] for i in IMPLS})
    b.set_ylabel("decode tokens/s (batch)")
    b.legend()
    fig.suptitle(f"transformers generate, {result['device']}, FA2 {result['fa2_library']}")
    return fig


if __name__ == "__main__":
    sys.exit(main())
