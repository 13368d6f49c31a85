"""A fine-tuning step through transformers: ``attn_implementation="sdpa"`` against
``"sm7x"``, in one run, on one random-weight ~1B Llama-style model (``bench generate``'s).

``[SM7X_FA2_FORCE=sm75] python -m sm7x.bench train [--out train.json] [--plot train.png]
[--seqlens 512,2k] [--tokens 4k] [--layouts full,padded,packed] [--layers 16]
[--steps 5] [--repeats 3] [--sdpa turing|native] [--quick]``

A step is ``model(**batch, use_cache=False).loss.backward()`` with every weight trainable
(fp16, no optimizer step: that is the same for every implementation), ``--steps`` steps
between two syncs, the median of ``--repeats`` such groups after a warm-up step. Batches of
``--tokens`` token slots per step in sequences of up to ``seqlen`` (random ids, seeded):

- ``full``: tokens / seqlen sequences of exactly seqlen tokens, no mask.
- ``padded``: as many rows of seqlen slots, each sequence 1/2 to all of its row (right
  padding and an attention mask, what a padding collator gives; padded labels -100).
- ``packed``: the same sequences in one row without padding (DataCollatorWithFlattening with
  ``return_flash_attn_kwargs=True``: position_ids restarting per sequence, cu_seq_lens and
  max lengths, each sequence's first label -100). SDPA reads the bounds from position_ids
  (transformers builds it a block-causal mask); sm7x takes cu_seq_lens.

Per cell: ms per step, tokens/s over the real (non-padding) tokens, the peak of allocated
GPU memory, the first step's loss and each implementation's x against the SDPA baselines
(their step time / sm7x's). ``sdpa`` and ``sdpa_expanded`` are ``bench generate``'s (K/V
repeated to every query head first, so torch's memory-efficient kernel runs; transformers'
``sdpa`` passes GQA as enable_gqa, which on Volta/Turing runs SDPA's math path). OOM is
reported as such. ``no_attention`` (the query returned as the output) is the floor of a
step: each implementation's attention costs its step minus the floor. Its K and V
projections get no gradient (their outputs are unused), so the floor is a little low and
the attention shares a little high.

On a GPU newer than Turing sm7x runs the forced library's PTX: the ratios show what the
kernels do relative to SDPA's on that GPU, not a T4's or V100's speed.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time

from . import _output
from .decode import parse_sizes
from .generate import (BASELINES, IMPLS, MODEL, NO_ATTENTION, add_sdpa_argument, ratio,
                       sdpa_backends, setup)

LAYOUTS = ("full", "padded", "packed")
QUICK = dict(seqlens=(512,), tokens=2048, layers=4, steps=2, repeats=1)


def sequence_lengths(tokens: int, seqlen: int, seed: int, full: bool) -> list[int]:
    """The sequences of one step: tokens // seqlen of them (at least one), each seqlen
    tokens (full) or 1/2 to all of seqlen (seeded)."""
    import torch

    count = max(1, tokens // seqlen)
    if full:
        return [seqlen] * count
    g = torch.Generator().manual_seed(seed)
    return torch.randint(max(1, seqlen // 2), seqlen + 1, (count,), generator=g).tolist()


def make_batch(torch, layout: str, lens: list[int], seqlen: int, vocab: int, device) -> dict:
    """The model inputs of one step (``layout``: LAYOUTS) for sequences of ``lens`` tokens."""
    g = torch.Generator().manual_seed(sum(lens) + len(lens))
    seqs = [torch.randint(1, vocab, (n,), generator=g) for n in lens]
    if layout == "packed":
        ids = torch.cat(seqs)[None]
        labels = ids.clone()
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        labels[0, starts] = -100  # no token predicts a sequence's first
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        batch = dict(input_ids=ids, labels=labels,
                     position_ids=torch.cat([torch.arange(n) for n in lens])[None],
                     cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens),
                     max_length_k=max(lens))
    else:
        ids = torch.zeros(len(lens), seqlen, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, :len(s)], mask[i, :len(s)] = s, 1
        batch = dict(input_ids=ids, labels=ids.masked_fill(mask == 0, -100))
        if layout == "padded":
            batch["attention_mask"] = mask
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def time_steps(torch, model, batch: dict, steps: int, repeats: int, sync) -> tuple[float, float]:
    """(median seconds per step, the first step's loss): a warm-up step, then ``repeats``
    groups of ``steps`` forward + backward steps between syncs."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        return loss

    first = step().item()  # warm-up (JIT, autotune, allocator)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times), first


def account(r: dict) -> dict:
    """Each implementation's x against the baselines (their ms / sm7x's), its attention
    share (its step minus the no-attention floor) and sm7x's loss against sdpa_expanded's
    (relative): None where a run is missing (OOM)."""
    out = {f"x_{b}": ratio(r.get(f"{b}_ms"), r.get("sm7x_ms")) for b in BASELINES}
    floor = r.get(f"{NO_ATTENTION}_ms")
    for impl in IMPLS:
        ms = r.get(f"{impl}_ms")
        out[f"{impl}_attention_ms"] = ms - floor if ms and floor else None
    a, b = r.get("sm7x_loss"), r.get("sdpa_expanded_loss")
    out["loss_rel_diff"] = abs(a - b) / max(abs(b), 1e-6) if a is not None and b is not None \
        else None
    return out


def _parser():
    p = _output.argument_parser("train", __doc__.split("\n\n")[0],
                                plot="a PNG of tokens/s per layout and length")
    p.add_argument("--seqlens", default="512,2k", help="longest sequence per step")
    p.add_argument("--tokens", default="4k", help="token slots per step")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    p.add_argument("--steps", type=int, default=5, help="steps between two syncs")
    p.add_argument("--repeats", type=int, default=3)
    add_sdpa_argument(p)
    p.add_argument("--quick", action="store_true",
                   help="4 sequences of 512 tokens, full layout, on a 4-layer model (a smoke run)")
    return p


def _arguments(argv):
    """(args, seqlens, tokens, layouts) or an error message."""
    a = _parser().parse_args(argv)
    try:
        seqlens, tokens = parse_sizes(a.seqlens), parse_sizes(a.tokens)[0]
    except ValueError as exc:
        return str(exc)
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        return f"--layouts takes {', '.join(LAYOUTS)}, got {a.layouts!r}"
    if min(a.layers, a.steps, a.repeats) < 1:
        return "--layers, --steps and --repeats must be >= 1"
    if a.quick:
        seqlens, tokens, layouts = list(QUICK["seqlens"]), QUICK["tokens"], ["full"]
        a.layers, a.steps, a.repeats = QUICK["layers"], QUICK["steps"], QUICK["repeats"]
    return a, seqlens, tokens, layouts


def main(argv: list[str] | None = None) -> int:
    parsed = _arguments(sys.argv[1:] if argv is None else argv)
    if isinstance(parsed, str):
        print(f"sm7x.bench train: {parsed}", file=sys.stderr)
        return 2
    args, seqlens, tokens, layouts = parsed
    env = setup("train", args.sdpa)
    if env is None:
        return 2
    torch, transformers, sm7x_tf, cap, sdpa_mode, info = env
    cfg = transformers.LlamaConfig(**{**MODEL, "num_hidden_layers": args.layers},
                                   max_position_embeddings=max(seqlens), attention_dropout=0.0,
                                   pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).train()
    rows = run(torch, model, layouts, seqlens, tokens, args.steps, args.repeats, sdpa_mode,
               "cuda", IMPLS + (NO_ATTENTION,))
    result = {"benchmark": "train", "device": torch.cuda.get_device_name(),
              "capability": f"{cap[0]}.{cap[1]}", "fa2_library": info,
              "sdpa_backends": sdpa_mode, "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "model": {**MODEL, "num_hidden_layers": args.layers, "dtype": "float16",
                        "parameters": sum(p.numel() for p in model.parameters())},
              "steps": args.steps, "repeats": args.repeats,
              "attn_implementation": sm7x_tf.NAME, "results": rows}
    _output.write(result, args.out, args.plot, _draw)
    return 0


def run(torch, model, layouts, seqlens, tokens: int, steps: int, repeats: int,
        sdpa_mode: str, device: str, impls) -> list[dict]:
    """One row per (layout, seqlen): every implementation in ``impls`` on the same batch."""
    cuda = device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    rows = []
    for layout in layouts:
        for seqlen in seqlens:
            lens = sequence_lengths(tokens, seqlen, seqlen, layout == "full")
            batch = make_batch(torch, layout, lens, seqlen, model.config.vocab_size, device)
            r = {"layout": layout, "seqlen": seqlen, "sequences": len(lens),
                 "tokens": sum(lens)}
            for impl in impls:
                model.set_attn_implementation(impl)
                model.zero_grad(set_to_none=True)  # the last one's gradients out of the peak
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                try:
                    with sdpa_backends(impl, sdpa_mode):
                        t, loss = time_steps(torch, model, batch, steps, repeats, sync)
                except torch.OutOfMemoryError:
                    model.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                    continue  # no entry: the report says OOM
                r[f"{impl}_ms"], r[f"{impl}_loss"] = t * 1e3, loss
                r[f"{impl}_tok_s"] = r["tokens"] / t
                if cuda:
                    r[f"{impl}_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            r.update(account(r))
            rows.append(r)
            print(_line(r, impls), flush=True)
    return rows


def _line(r: dict, impls) -> str:
    def cell(impl):
        ms = r.get(f"{impl}_ms")
        if ms is None:
            return f"{impl} OOM"
        mem = r.get(f"{impl}_peak_gb")
        return (f"{impl} {ms:.1f} ms ({r[impl + '_tok_s'] / 1e3:.1f}k tok/s"
                + (f", {mem:.1f} GB" if mem is not None else "") + ")")

    xs = "  ".join(f"x{b} " + (f"{r['x_' + b]:.2f}" if r.get("x_" + b) else "-")
                   for b in BASELINES)
    diff = r.get("loss_rel_diff")
    return (f"train {r['layout']:<6} {r['seqlen']:>5} ({r['sequences']} seqs, {r['tokens']} "
            f"tokens): " + "  ".join(cell(i) for i in impls) + f"  sm7x {xs}"
            + (f"  loss vs sdpa_expanded {diff:.1e}" if diff is not None else ""))


def _draw(result: dict, plt):
    rows = result["results"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    labels = [f"{r['layout']} {r['seqlen']}" for r in rows]
    _output.grouped_bars(ax, labels, {i: [(r.get(f"{i}_tok_s") or 0) / 1e3 for r in rows]
                                      for i in IMPLS})
    ax.set_ylabel("training tokens/s (thousands; 0: OOM)")
    ax.legend()
    fig.suptitle(f"transformers fwd+bwd, {result['device']}, FA2 {result['fa2_library']}")
    return fig


if __name__ == "__main__":
    sys.exit(main())
