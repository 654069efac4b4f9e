"""``python -m kvstack``: the ``kvstack`` command line (same as the ``kvstack`` script)."""

from __future__ import annotations

import sys

from kvstack.cli import main

sys.exit(main())
