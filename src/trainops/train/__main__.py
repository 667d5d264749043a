"""``python -m trainops.train``: the same as ``python -m trainops train``."""

import sys

from .cli import main

sys.exit(main())
