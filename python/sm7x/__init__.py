"""sm7x: FlashAttention-2 and inference kernels for Volta (sm70) and Turing (sm75) GPUs.

Importing this package is cheap on purpose: it loads neither torch nor any native
library. The kernels load on first use; ``python -m sm7x doctor`` shows what is
installed and which FA2 library each GPU would use.
"""

try:  # written at install time from the recipe's version (the one place it is said)
    from ._version import __version__
except ImportError:  # a source checkout on PYTHONPATH, never installed
    __version__ = "0+unknown"

# flash-attn's entry points, resolved on first use (PEP 562) so that `import sm7x` stays
# free of torch and native code.
_LAZY = {name: "sm7x.fa2" for name in (
    "flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func")}
__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sm7x' has no attribute {name!r}")
