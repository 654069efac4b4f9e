"""The trainer's dense calls at their import path before :mod:`kv_backends.backends.flex`
(:mod:`kv_backends.backends.flex.trainer`), re-exported."""

from __future__ import annotations

from kv_backends.backends.flex.trainer import (
    flex_trainer_attention,
    flex_trainer_block_mask,
    triton_trainer_attention,
)

__all__ = ["flex_trainer_attention", "flex_trainer_block_mask", "triton_trainer_attention"]
