"""``python -m sm7x.bench BENCHMARK [options]``; benchmarks: core, fa2, decode, generate, train, vllm (sm7x.bench.<name>)."""

from __future__ import annotations

import sys

BENCHMARKS = {
    "core": "sm7x core ops (rms_norm, ..., reshape_and_cache) vs plain torch",
    "fa2": "sm7x FA2 forward (--backward: forward + backward) vs torch SDPA's memory-efficient backend",
    "decode": "sm7x paged decode (split-KV) vs torch SDPA flash / memory-efficient",
    "generate": "transformers generate(): TTFT and decode tokens/s, sdpa vs sm7x",
    "train": "a transformers fine-tuning step (fwd+bwd): tokens/s and memory, sdpa vs sm7x",
    "vllm": "a real vLLM engine: throughput and TTFT, sm7x vs TRITON_ATTN / FLEX_ATTENTION",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: python -m sm7x.bench BENCHMARK [options]  (BENCHMARK --help for options)")
        for name, what in BENCHMARKS.items():
            print(f"  {name:<8} {what}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    return importlib.import_module(f"{__package__}.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
