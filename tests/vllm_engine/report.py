"""Prints the engine test matrix from the result.*.json files that test_engine_matrix.py
writes into $VLLM_ENGINE_OUT: one row per model and variant, per prompt "=" (equal tokens)
or "dN" (first difference at token N, a near tie), the worst logprob error and the vLLM
log lines that name the backend and the CUDA graphs.

    python tests/vllm_engine/report.py DIR [--logs]
"""

from __future__ import annotations

import glob
import json
import os
import sys


def main(argv: list[str]) -> int:
    if not argv or not os.path.isdir(argv[0]):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    files = sorted(glob.glob(os.path.join(argv[0], "result.*.json")))
    if not files:
        print(f"no result.*.json in {argv[0]}", file=sys.stderr)
        return 1
    print("| model | covers | variant | tokens per prompt (round 1; round 2) | worst logprob "
          "error | prefix-cache hits (round 2) | ok |")
    print("|---|---|---|---|---|---|---|")
    for path in files:
        r = json.load(open(path))
        rounds: dict[int, list[str]] = {}
        for row in r["rows"]:
            rounds.setdefault(row["round"], []).append(
                "=" if row["equal"] else f"d{row['first_difference']}")
        hits = [row["cached_tokens"] for row in r["rows"] if row["round"] == 1]
        worst = max(row["max_logprob_error"] for row in r["rows"])
        ok = all(row["ok"] for row in r["rows"])
        print(f"| {r['model']} | {r['covers']} | {r['variant']} | "
              f"{'; '.join(' '.join(v) for v in rounds.values())} | {worst:.2e} | "
              f"{' '.join(map(str, hits)) or '-'} | {'yes' if ok else 'NO'} |")
    if "--logs" in argv:
        for path in files:
            r = json.load(open(path))
            print(f"\n{r['model']} {r['variant']} ({r['device']}, vLLM {r['vllm']}):")
            if (r.get("spec_decode") or {}).get("sm7x"):
                print(f"    speculative decoding counters: {r['spec_decode']}")
            for line in dict.fromkeys(r["log_lines"]):
                print("   ", line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
