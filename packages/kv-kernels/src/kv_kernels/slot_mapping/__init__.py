"""Slot mapping (``compute_slot_mapping``) and manager -> kernel block-table expansion
(``expand_block_table``)."""

from __future__ import annotations

from kv_kernels.slot_mapping.api import compute_slot_mapping, expand_block_table

__all__ = ["compute_slot_mapping", "expand_block_table"]
