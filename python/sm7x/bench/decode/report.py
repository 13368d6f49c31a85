"""The decode benchmark's report, from a results dict (a run's, or one read back from its
JSON): derived fields (fraction of copy bandwidth, warnings, goal lines), the tables
printed live and after the run, and the plot."""

from __future__ import annotations

from .. import _output
from .arithmetic import (DECODE_BASELINES, GOAL_BATCH, GOAL_FRAC_COPY, GOAL_LEN, GOAL_VS_FLASH,
                         PREFILL_NEW, PREFILL_PREFIX, WARN_DIFF)


def find_row(result: dict, batch: int, kv_len: int) -> dict | None:
    for r in result.get("results", []):
        if r.get("batch") == batch and r.get("kv_len") == kv_len:
            return r
    return None


def _fmt(x, spec: str, width: int) -> str:
    return f"{x:{width}{spec}}" if x is not None else f"{'-':>{width}}"


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
    print(DECODE_HEADER)
    for r in result.get("results", []):
        print(format_decode_row(r))
    if result.get("prefill"):
        print("\n" + PREFILL_HEADER)
        for r in result["prefill"]:
            print(format_prefill_row(r))
    print_summary(result)


def finish(result: dict) -> None:
    """Derived fields that need the whole run: fraction of copy bandwidth (the best copy
    sample), warnings, goal lines."""
    copy = (result.get("copy") or {}).get("gbps")
    warns = result.setdefault("warnings", [])
    warns.clear()
    for r in result.get("results", []):
        if r.get("sm7x_gbps") and copy:
            r["frac_of_copy"] = r["sm7x_gbps"] / copy
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
    skipped = [f"{r['batch']}x{r['kv_len']}" for r in result.get("results", []) if r.get("skipped")]
    if skipped:
        msg = f"skipped (memory budget): batch x kv_len {', '.join(skipped)}"
        if msg not in result.setdefault("notes", []):
            result["notes"].append(msg)
    result["goal"] = goal_lines(result)


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
                           ("sdpa_flash_lr", "SDPA flash (lower-right)")):
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
