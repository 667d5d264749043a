"""``python -m trainops.train``: the same as ``python -m trainops train``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
