"""``python -m pipeline ...`` is ``stagewire ...``; local workers are started this way."""

import sys

from pipeline._cli import main

sys.exit(main())
