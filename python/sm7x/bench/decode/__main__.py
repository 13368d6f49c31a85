"""``python -m sm7x.bench.decode [options]``: the same as ``python -m sm7x.bench decode``."""

import sys

from .cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
