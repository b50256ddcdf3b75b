"""``python -m harness`` is ``rrh``."""

import sys

from harness.cli import main

sys.exit(main())
