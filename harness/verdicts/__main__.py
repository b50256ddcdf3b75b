"""``python -m harness.verdicts``: see ``harness.verdicts.command``."""

import sys

from harness.verdicts.command import main

sys.exit(main())
