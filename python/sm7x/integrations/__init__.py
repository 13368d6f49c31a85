"""Glue between sm7x's kernels and the frameworks that run models.

Each integration is its own module and imports its framework only when it is imported
itself: ``import sm7x`` and ``import sm7x.integrations`` stay free of torch and of every
framework.

- :mod:`sm7x.integrations.transformers`: ``attn_implementation="sm7x"`` (and the paged
  ``"paged|sm7x"`` used by continuous batching) for Hugging Face transformers models.
"""
