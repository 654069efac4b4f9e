"""``python -m kvstack.cli``."""

from __future__ import annotations

import sys

from kvstack.cli import main

sys.exit(main())
