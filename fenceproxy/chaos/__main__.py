"""``python -m fenceproxy.chaos``."""

import sys

from . import main

sys.exit(main())
