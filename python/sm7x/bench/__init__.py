"""Benchmarks of sm7x's kernels: ``python -m sm7x.bench core [--out F.json] [--plot F.png]``.

Importing this package imports nothing heavy; each benchmark imports torch itself.
"""
