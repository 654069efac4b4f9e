"""kvstack: the paged KV-cache layer of LLM inference, as one install.

The umbrella over ``kv_spec`` (specs, layouts, planner), ``kv_kernels`` (cache ops and paged
attention), ``kv_backends`` (attention backends and the selector), ``kv_blocktable`` and
``kv_connectors``: the reference engine (:mod:`kvstack.engine`: Hugging Face checkpoints of real
architectures, continuous batching, held to transformers token for token) and the ``kvstack``
command line (``demo``, ``generate``, ``plan``, ``backends``, ``bench``, ``models``).
"""

from __future__ import annotations

__version__ = "0.4.0"

__all__ = ["__version__"]
