"""Glue between sm7x's kernels and the frameworks that run models (one module or
subpackage per framework).

Importing this package imports neither torch nor any framework; each integration imports
its framework only when it is imported itself, or when the framework's plugin loader
loads it:

- :mod:`sm7x.integrations.transformers`: ``attn_implementation="sm7x"`` (and the paged
  ``"paged|sm7x"`` used by continuous batching) for Hugging Face transformers models.
- :mod:`sm7x.integrations.vllm`: an attention backend for upstream vLLM, loaded through
  its ``vllm.general_plugins`` / ``vllm.platform_plugins`` entry points.
"""

from __future__ import annotations


def flash_window(sliding_window: int | None, causal: bool = True) -> tuple[int, int]:
    """A framework's sliding window W (a query sees W keys, itself included; None or 0: no
    window) as flash-attn's (left, right) window_size."""
    if not sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)
