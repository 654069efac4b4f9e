"""Shared knobs for kv-blocktable's tests.

Property and state-machine tests run a CI-sized number of examples by default; set
``KVSTACK_HYPOTHESIS_EXAMPLES`` (and optionally ``KVSTACK_HYPOTHESIS_STEPS``) for a longer run::

    KVSTACK_HYPOTHESIS_EXAMPLES=500 KVSTACK_HYPOTHESIS_STEPS=1000 \\
        .venv/bin/python -m pytest packages/kv-blocktable/tests -m slow -q
"""

from __future__ import annotations

import os


def hypothesis_examples(default: int) -> int:
    return int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", default))


def hypothesis_steps(default: int) -> int:
    return int(os.environ.get("KVSTACK_HYPOTHESIS_STEPS", default))
