"""``python -m sm7x doctor [--json]``; also the ``sm7x`` console script."""

import sys

from .doctor import main

if __name__ == "__main__":
    sys.exit(main())
