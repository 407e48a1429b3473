"""``python -m tfport.tools.bench [options]``: the same as ``tfport bench [options]``."""

import sys

from .cli import main

sys.exit(main())
