"""The decode benchmark's report, from a results dict (a run's, or one read back from its
JSON): derived fields (fraction of copy bandwidth, warnings, goal lines), the tables
printed live and after the run (the 8-bit rows as lines under their fp16 row), the plot,
and the context table (markdown)."""

from __future__ import annotations

from .. import _output
from .arithmetic import (DECODE_BASELINES, ELEM, GOAL_BATCH, GOAL_FRAC_COPY, GOAL_KV8_POINTS,
                         GOAL_KV8_PREFILL, GOAL_KV8_STEP, GOAL_LEN, GOAL_VS_FLASH, KV_DTYPES,
                         KV_ELEM, PREFILL_NEW, PREFILL_PREFIX, WARN_DIFF)


def find_row(result: dict, batch: int, kv_len: int) -> dict | None:
    for r in result.get("results", []):
        if r.get("batch") == batch and r.get("kv_len") == kv_len:
            return r
    return None


def _fmt(x, spec: str, width: int) -> str:
    return f"{x:{width}{spec}}" if x is not None else f"{'-':>{width}}"


def _klen(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def kv8_formats(result: dict) -> list[str]:
    """The 8-bit cache formats a run measured (config.kv_dtypes, there only with
    --kv-dtype): none for a default run, whose report is then unchanged."""
    kinds = (result.get("config") or {}).get("kv_dtypes") or ["fp16"]
    return [k for k in kinds if k != "fp16"]


def fill_frac_of_copy(r: dict, copy: float | None, kv8=()) -> None:
    """frac_of_copy of the fp16 sm7x row, and of each 8-bit one (its own bytes' GB/s)."""
    if r.get("sm7x_gbps") and copy:
        r["frac_of_copy"] = r["sm7x_gbps"] / copy
    for fmt in kv8:
        if f"sm7x_{fmt}_gbps" in r:
            g = r[f"sm7x_{fmt}_gbps"]
            r[f"sm7x_{fmt}_frac_of_copy"] = g / copy if g and copy else None


def _met_at_most(x, goal) -> str:
    return "" if x is None else (" [met]" if x <= goal else " [missed]")


def _kv8_goal(label: str, r: dict | None, fmt: str, goal: float, what: str,
              missing: str) -> str:
    """One 8-bit goal line: the time ratio of row r's fmt rows against its fp16 sm7x row."""
    if r is None:
        return f"{label}: not measured ({missing})"
    if r.get("skipped") or r.get("kv8_skipped"):
        return f"{label}: skipped ({r.get('skipped') or r.get('kv8_skipped')})"
    x = r.get(f"sm7x_{fmt}_time_ratio")
    if x is None:
        why = ("sm7x fp16 did not run" if r.get("sm7x_us") is None
               else f"sm7x {fmt} did not run, see the notes")
        return f"{label}: {what} = n/a ({why}) (goal <= {goal:.2f})"
    how = r.get(f"sm7x_{fmt}_timing")
    how = f", {how}" if how and how != "graph" else ""
    return f"{label}: {what} = {x:.2f}{how} (goal <= {goal:.2f}){_met_at_most(x, goal)}"


def kv8_goal_lines(result: dict) -> list[str]:
    """The issue's 8-bit goals, per measured format: decode step time <= GOAL_KV8_STEP x
    fp16's at each GOAL_KV8_POINTS (batch, kv_len); chunked prefill over an 8-bit prefix
    <= GOAL_KV8_PREFILL x fp16's time, per prefill batch."""
    lines = []
    for fmt in kv8_formats(result):
        for batch, kv_len in GOAL_KV8_POINTS:
            lines.append(_kv8_goal(
                f"{fmt} cache, {_klen(kv_len)} x batch {batch}", find_row(result, batch, kv_len),
                fmt, GOAL_KV8_STEP, "step time / fp16",
                f"add --batches {batch} --lens {_klen(kv_len)}"))
        pre = result.get("prefill") or []
        if not pre:
            lines.append(_kv8_goal(f"{fmt} cache, chunked prefill", None, fmt, GOAL_KV8_PREFILL,
                                   "", "no --prefill-batches"))
        for r in pre:
            lines.append(_kv8_goal(
                f"{fmt} cache, chunked prefill batch {r['batch']} ({r.get('q_len', PREFILL_NEW)} q "
                f"/ {_klen(r.get('prefix', PREFILL_PREFIX))} prefix)", r, fmt, GOAL_KV8_PREFILL,
                "time / fp16", ""))
    return lines


def goal_lines(result: dict) -> list[str]:
    """The issue's goal line for 32k x batch 16."""
    label = f"{GOAL_LEN // 1024}k x batch {GOAL_BATCH}"
    r = find_row(result, GOAL_BATCH, GOAL_LEN)
    if r is None:
        return [f"{label}: not measured (add --batches {GOAL_BATCH} --lens {GOAL_LEN})"]
    if r.get("skipped"):
        return [f"{label}: skipped ({r['skipped']})"]
    vs = r.get("sm7x_over_sdpa_flash")
    frac = r.get("frac_of_copy")
    if vs is None:
        why = (result.get("baselines", {}).get("decode", {}).get("sdpa_flash", {}).get("note")
               or "not measured")
        vs_s = f"n/a (sdpa_flash: {why})"
    else:
        vs_s = f"{vs:.2f}"
    frac_s = f"{frac:.2f}" if frac is not None else "n/a"

    def met(x, goal):
        return "" if x is None else (" [met]" if x >= goal else " [missed]")

    return [f"{label}: sm7x/sdpa_flash = {vs_s} (goal >= {GOAL_VS_FLASH:.2f})"
            f"{met(vs, GOAL_VS_FLASH)}, "
            f"fraction of copy bandwidth = {frac_s} (goal >= {GOAL_FRAC_COPY:.2f})"
            f"{met(frac, GOAL_FRAC_COPY)}"]


def all_goal_lines(result: dict) -> list[str]:
    """goal_lines (32k x batch 16 against SDPA), the 8-bit ones (none by default), then the
    dense few-rows calls against flash_attn_with_kvcache."""
    return goal_lines(result) + kv8_goal_lines(result) + dense_goal_lines(result)


DENSE_GOAL = 0.90  # flash_attn_func's decode GB/s at least this fraction of with_kvcache's


def dense_goal_lines(result: dict) -> list[str]:
    """Per decode row: flash_attn_func with one query row per sequence (the serving kernel,
    chosen by sm7x.fa2) against flash_attn_with_kvcache on the same keys, both eager; the
    prefill kernel's time (SM7X_FA2_DENSE=prefill) beside it."""
    lines = []
    for r in result.get("results", []):
        dense, kvc = r.get("sm7x_dense_eager_gbps"), r.get("sm7x_kvcache_eager_gbps")
        if not dense or not kvc:
            continue
        frac = dense / kvc
        pre = r.get("sm7x_dense_prefill_eager_gbps")
        lines.append(
            f"flash_attn_func decode, {r['kv_len'] // 1024}k x batch {r['batch']}: "
            f"{dense:.0f} GB/s, {frac:.2f} of flash_attn_with_kvcache's {kvc:.0f} (goal >= "
            f"{DENSE_GOAL:.2f}) [{'met' if frac >= DENSE_GOAL else 'missed'}]"
            + (f"; the prefill kernel: {pre:.0f} GB/s" if pre else ""))
    return lines


# ---------------------------------------------------------------------------------------
# Tables.

DECODE_HEADER = (f"{'batch':>5} {'kv_len':>7} {'KV MB':>8} {'splits':>6} {'sm7x us':>9} "
                 f"{'sm7x GB/s':>9} {'eager us':>9} {'kvc us':>8} {'flash GB/s':>10} "
                 f"{'eff GB/s':>9} {'x flash':>7} {'x eff':>6} {'%copy':>6} {'max diff':>9}")


def format_decode_row(r: dict) -> str:
    head = f"{r['batch']:>5} {r['kv_len']:>7}"
    if r.get("skipped"):
        return f"{head}  skipped: {r['skipped']}"
    frac = r.get("frac_of_copy")
    flags = []
    if r.get("l2_resident"):
        flags.append("L2")
    for b in DECODE_BASELINES:
        if r.get(f"{b}_gqa") == "expanded":
            flags.append(f"{b.split('_')[1]}:expanded")
    if r.get("max_abs_diff") is not None and r["max_abs_diff"] > WARN_DIFF:
        flags.append("DIFF!")
    return (f"{head} {r['kv_mbytes']:>8.1f} {_fmt(r.get('num_splits'), 'd', 6)} "
            f"{_fmt(r.get('sm7x_us'), '.1f', 9)} {_fmt(r.get('sm7x_gbps'), '.0f', 9)} "
            f"{_fmt(r.get('sm7x_eager_us'), '.1f', 9)} "
            f"{_fmt(r.get('sm7x_kvcache_eager_us'), '.1f', 8)} "
            f"{_fmt(r.get('sdpa_flash_gbps'), '.0f', 10)} "
            f"{_fmt(r.get('sdpa_efficient_gbps'), '.0f', 9)} "
            f"{_fmt(r.get('sm7x_over_sdpa_flash'), '.2f', 7)} "
            f"{_fmt(r.get('sm7x_over_sdpa_efficient'), '.2f', 6)} "
            f"{_fmt(None if frac is None else 100 * frac, '.0f', 5)}% "
            f"{_fmt(r.get('max_abs_diff'), '.1e', 9)}" + (f"  {' '.join(flags)}" if flags else ""))


def format_kv8_lines(r: dict, kv8, prefill: bool = False) -> list[str]:
    """One line per 8-bit format under its fp16 row (decode: aligned with DECODE_HEADER's
    KV MB, sm7x us and GB/s columns, GB/s of the bytes that format reads; prefill: with
    PREFILL_HEADER's sm7x ms and TFLOP/s), then the step time over the fp16 row's."""
    if r.get("skipped"):
        return []
    lines = []
    for fmt in kv8:
        p = f"sm7x_{fmt}"
        short = fmt.split("_")[-1]
        if r.get("kv8_skipped"):
            lines.append(f"{'':>5} {short:>{4 if prefill else 7}}  skipped: {r['kv8_skipped']}")
            continue
        ratio = r.get(f"{p}_time_ratio")
        how = r.get(f"{p}_timing")
        tail = (f"  x{ratio:.2f} fp16 time" if ratio is not None else "  x- fp16 time") \
            + (f" ({how})" if how and how != "graph" else "")
        frac = r.get(f"{p}_frac_of_copy")
        if frac is not None:
            tail += f", {100 * frac:.0f}% copy"
        tail += (f", max diff {_fmt(r.get(f'{p}_max_abs_diff'), '.1e', 0).strip()}"
                 f" (vs fp16 {_fmt(r.get(f'{p}_diff_vs_fp16'), '.1e', 0).strip()})")
        d = r.get(f"{p}_max_abs_diff")
        if d is not None and d > WARN_DIFF:
            tail += "  DIFF!"
        if prefill:
            us = r.get(f"{p}_us")
            ms = None if us is None else us / 1e3
            lines.append(f"{'':>5} {short:>4} {'':>6} {_fmt(ms, '.3f', 8)} "
                         f"{_fmt(r.get(f'{p}_tflops'), '.1f', 7)}{tail}")
        else:
            mb = r["kv_mbytes"] * KV_ELEM[fmt] / ELEM
            lines.append(f"{'':>5} {short:>7} {mb:>8.1f} {'':>6} "
                         f"{_fmt(r.get(f'{p}_us'), '.1f', 9)} {_fmt(r.get(f'{p}_gbps'), '.0f', 9)}"
                         f"{tail}")
    return lines


PREFILL_HEADER = (f"{'batch':>5} {'q':>4} {'prefix':>6} {'sm7x ms':>8} {'TFLOP/s':>7} "
                  f"{'eff-mask ms':>11} {'TFLOP/s':>7} {'eff-lr ms':>9} {'TFLOP/s':>7} "
                  f"{'flash-lr ms':>11} {'TFLOP/s':>7} {'x eff-mask':>10} {'x eff-lr':>8} "
                  f"{'x flash-lr':>10} {'max diff':>9}")


def format_prefill_row(r: dict) -> str:
    head = f"{r['batch']:>5} {r['q_len']:>4} {r['prefix']:>6}"
    if r.get("skipped"):
        return f"{head}  skipped: {r['skipped']}"

    def ms(name):
        us = r.get(f"{name}_us")
        return None if us is None else us / 1e3

    cols = [f"{_fmt(ms('sm7x'), '.3f', 8)} {_fmt(r.get('sm7x_tflops'), '.1f', 7)}"]
    for b, w in (("sdpa_efficient", 11), ("sdpa_efficient_lr", 9), ("sdpa_flash_lr", 11)):
        cols.append(f"{_fmt(ms(b), '.3f', w)} {_fmt(r.get(f'{b}_tflops'), '.1f', 7)}")
    cols.append(f"{_fmt(r.get('sm7x_over_sdpa_efficient'), '.2f', 10)} "
                f"{_fmt(r.get('sm7x_over_sdpa_efficient_lr'), '.2f', 8)} "
                f"{_fmt(r.get('sm7x_over_sdpa_flash_lr'), '.2f', 10)} "
                f"{_fmt(r.get('max_abs_diff'), '.1e', 9)}")
    flag = "  DIFF!" if r.get("max_abs_diff") is not None and r["max_abs_diff"] > WARN_DIFF else ""
    return f"{head} " + " ".join(cols) + flag


def print_summary(result: dict) -> None:
    """Everything after the live rows: baselines, notes, warnings, goal lines."""
    print(f"\n{result['device']} (capability {result['capability']}, {result.get('sm_count')} SMs, "
          f"L2 {result.get('l2_mb')} MB), torch {result['torch']} (CUDA {result.get('cuda')}), "
          f"SM7X_FA2_FORCE={result['forced']}, sm7x library {result.get('library')}")
    c = result.get("copy") or {}
    if c.get("gbps"):
        print(f"device copy bandwidth: {c['gbps']:.0f} GB/s (dst.copy_(src), "
              f"{c['bytes'] / 2**30:.1f} GiB read + written, best of {len(c['samples_gbps'])})")
    for kind, bl in (result.get("baselines") or {}).items():
        for name, b in bl.items():
            how = b.get("gqa") or "unavailable"
            note = f": {b['note']}" if b.get("note") else ""
            print(f"{kind} baseline {name}: {how}{note}")
    for n in result.get("notes", []):
        print(f"note: {n}")
    for r in result.get("results", []):
        for n in r.get("notes", []):
            print(f"note (decode batch {r['batch']}, kv_len {r['kv_len']}): {n}")
    for r in result.get("prefill", []):
        for n in r.get("notes", []):
            print(f"note (prefill batch {r['batch']}): {n}")
    for w in result.get("warnings", []):
        print(f"WARNING: {w}")
    if result.get("aborted"):
        print(f"ABORTED: {result['aborted']}")
    for line in result.get("goal", []):
        print(line)


def print_table(result: dict) -> None:
    kv8 = kv8_formats(result)
    print(DECODE_HEADER)
    for r in result.get("results", []):
        print(format_decode_row(r))
        for line in format_kv8_lines(r, kv8):
            print(line)
    if result.get("prefill"):
        print("\n" + PREFILL_HEADER)
        for r in result["prefill"]:
            print(format_prefill_row(r))
            for line in format_kv8_lines(r, kv8, prefill=True):
                print(line)
    print_summary(result)


def finish(result: dict) -> None:
    """Derived fields that need the whole run: fraction of copy bandwidth (the best copy
    sample), warnings, goal lines."""
    copy = (result.get("copy") or {}).get("gbps")
    kv8 = kv8_formats(result)
    warns = result.setdefault("warnings", [])
    warns.clear()
    for r in result.get("results", []):
        fill_frac_of_copy(r, copy, kv8)
        d = r.get("max_abs_diff")
        if d is not None and d > WARN_DIFF:
            warns.append(f"decode batch {r['batch']} kv_len {r['kv_len']}: max abs diff sm7x vs "
                         f"SDPA = {d:.3e} > {WARN_DIFF} ({r.get('max_abs_diff_vs')})")
        if not r.get("skipped") and r.get("sm7x_us") is None:
            warns.append(f"decode batch {r['batch']} kv_len {r['kv_len']}: sm7x did not run")
    for r in result.get("prefill", []):
        d = r.get("max_abs_diff")
        if d is not None and d > WARN_DIFF:
            warns.append(f"prefill batch {r['batch']}: max abs diff sm7x vs SDPA = {d:.3e} > "
                         f"{WARN_DIFF} ({r.get('max_abs_diff_vs')})")
        if not r.get("skipped") and r.get("sm7x_us") is None:
            warns.append(f"prefill batch {r['batch']}: sm7x did not run")
    for fmt in kv8:
        for kind, rows in (("decode", result.get("results", [])),
                           ("prefill", result.get("prefill", []))):
            for r in rows:
                where = (f"{kind} batch {r['batch']}"
                         + (f" kv_len {r['kv_len']}" if kind == "decode" else ""))
                d = r.get(f"sm7x_{fmt}_max_abs_diff")
                if d is not None and d > WARN_DIFF:
                    warns.append(f"{where}: max abs diff sm7x over the {fmt} cache vs the "
                                 f"dequantized reference = {d:.3e} > {WARN_DIFF}")
                if (not r.get("skipped") and not r.get("kv8_skipped")
                        and r.get("sm7x_us") is not None and r.get(f"sm7x_{fmt}_us") is None):
                    warns.append(f"{where}: sm7x over the {fmt} cache did not run")
    skipped = [f"{r['batch']}x{r['kv_len']}" for r in result.get("results", []) if r.get("skipped")]
    if skipped:
        msg = f"skipped (memory budget): batch x kv_len {', '.join(skipped)}"
        if msg not in result.setdefault("notes", []):
            result["notes"].append(msg)
    result["goal"] = all_goal_lines(result)


def draw(result: dict, plt):
    """The PNG (see _output.write): decode GB/s vs kv_len, one panel per batch, one line
    per method, the copy bandwidth dotted; chunked prefill TFLOP/s in the last panel."""
    rows = [r for r in result.get("results", []) if not r.get("skipped")]
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    pre = [r for r in result.get("prefill", []) if not r.get("skipped")]
    n = len(batches) + (1 if pre else 0)
    fig, axes = plt.subplots(1, max(n, 1), figsize=(4.5 * max(n, 1), 4), squeeze=False)
    styles = {"sm7x_gbps": ("sm7x (graph)", "-", "o"), "sm7x_eager_gbps": ("sm7x eager", "--", "."),
              "sdpa_flash_gbps": ("SDPA flash", "-", "s"),
              "sdpa_efficient_gbps": ("SDPA mem-efficient", "-", "^")}
    # 8-bit caches (a --kv-dtype run; absent keys draw nothing): GB/s of the bytes the
    # format reads, so at fp16's GB/s it is twice as fast.
    for fmt, marker in zip(KV_DTYPES[1:], "dvP"):
        styles[f"sm7x_{fmt}_gbps"] = (f"sm7x {fmt} cache (its 1-byte K/V)", "-.", marker)
    copy = (result.get("copy") or {}).get("gbps")
    for ax, b in zip(axes[0], batches):
        rs = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["kv_len"])
        for key, (label, ls, marker) in styles.items():
            pts = [(r["kv_len"], r[key]) for r in rs if r.get(key)]
            if pts:
                exp = any(r.get(key.replace("_gbps", "_gqa")) == "expanded" for r in rs)
                ax.plot(*zip(*pts), ls, marker=marker,
                        label=label + (" (K/V expanded)" if exp else ""))
        if copy:
            ax.axhline(copy, ls=":", color="gray", label="device copy")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["kv_len"] for r in rs],
                      [f"{r['kv_len'] // 1024}k" if r["kv_len"] >= 1024 else str(r["kv_len"])
                       for r in rs])
        ax.set_title(f"decode, batch {b}")
        ax.set_xlabel("kv_len")
        ax.set_ylabel("GB/s of K/V read")
        ax.legend(fontsize=7)
    if pre:
        ax = axes[0][n - 1]
        series = {}
        for key, label in (("sm7x", "sm7x"), ("sdpa_efficient", "SDPA eff (bool mask)"),
                           ("sdpa_efficient_lr", "SDPA eff (lower-right)"),
                           ("sdpa_flash_lr", "SDPA flash (lower-right)"),
                           *((f"sm7x_{f}", f"sm7x {f} cache") for f in KV_DTYPES[1:])):
            vals = [r.get(f"{key}_tflops") or 0.0 for r in pre]
            if any(vals):
                series[label] = vals
        if series:
            _output.grouped_bars(ax, [f"batch {r['batch']}" for r in pre], series)
            ax.legend(fontsize=7)
        ax.set_title(f"chunked prefill {PREFILL_NEW} q / {PREFILL_PREFIX // 1024}k prefix")
        ax.set_ylabel("TFLOP/s")
    forced = f", SM7X_FA2_FORCE={result['forced']}" if result.get("forced") else ""
    cfg = result["config"]
    fig.suptitle(f"sm7x paged decode vs SDPA, {result['device']}{forced}, fp16, "
                 f"{cfg['heads']}/{cfg['kv_heads']} heads, d{cfg['head_dim']}, "
                 f"page {cfg['page_size']}")
    return fig


# ---------------------------------------------------------------------------------------
# The context table (arithmetic.context_table) as markdown.


def _int(n: int) -> str:
    return f"{n:,}"


def context_table_markdown(table: dict) -> str:
    """The largest context per card, model and KV format, a markdown table with its
    assumptions stated above it (arithmetic, not measured)."""
    util, reserve, page = table["utilization"], table["reserve_bytes"], table["page_size"]
    out = [
        "Largest KV context that fits (arithmetic from model config numbers, not measured).",
        "",
        f"KV bytes/token = 2 (K and V) x layers x kv_heads x (head_dim x bytes per element "
        f"+ bytes per row) (fp16: 2; 8-bit fp8_e4m3 / fp8_e5m2: 1; int8_per_token_head: 1, "
        f"plus a 4-byte scale per row). KV memory = card memory (as torch "
        f"reports it) x {util:g} (vLLM's default gpu_memory_utilization) - weights - "
        f"{reserve / 2**30:g} GiB reserve (activations, CUDA graphs, CUDA context: a stated "
        f"constant). Tokens: KV memory / bytes per token in whole {page}-token pages, all "
        f"sequences together; one sequence is also capped by the model's context length. "
        f"Where the fp16 weights leave nothing, a row with 8-bit weights (the fp16 bytes "
        f"halved) follows.",
        "",
        "| card | model | weights | weights GB | KV memory GB | fp16 KV tokens "
        "| 8-bit KV tokens | int8 KV tokens | one sequence, fp16 / 8-bit / int8 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table["rows"]:
        card = f"{r['card']} ({r['card_bytes'] / 2**30:.2f} GiB)"
        head = (f"| {card} | {r['model']} | {r['weights']} | {r['weights_bytes'] / 1e9:.2f} "
                f"| {r['kv_memory_bytes'] / 1e9:.2f} |")
        if not r["fits"]:
            out.append(f"{head} weights + reserve exceed {util:g} x card "
                       f"({r['usable_bytes'] / 1e9:.2f} GB): do not fit | do not fit | "
                       f"do not fit | - |")
            continue
        t, one = r["tokens"], r["one_sequence"]
        capped = " (model max)" if one["8-bit"] < t["8-bit"] else ""
        out.append(f"{head} {_int(t['fp16'])} | {_int(t['8-bit'])} | {_int(t['int8'])} "
                   f"| {_int(one['fp16'])} / {_int(one['8-bit'])} / {_int(one['int8'])}"
                   f"{capped} |")
    return "\n".join(out)
