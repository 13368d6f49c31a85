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
