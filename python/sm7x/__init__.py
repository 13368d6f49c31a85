"""sm7x: FlashAttention-2 and inference kernels for Volta (sm70) and Turing (sm75) GPUs.

Importing this package is cheap on purpose: it loads neither torch nor any native
library. The kernels load on first use; ``python -m sm7x doctor`` shows what is
installed and which FA2 library each GPU would use.
"""

__version__ = "0.1.0"
