"""MultiConnector over [OffloadingConnector, FilesystemConnector]: saves reach both, loads come from
the child that has the blocks (CPU tier first, disk after a restart), done_sending waits for all."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_connectors import (
    FilesystemConfig,
    FilesystemConnector,
    MultiConnector,
    OffloadingConfig,
    OffloadingConnector,
)
from kv_connectors.testing import block_bytes, make_layout, random_cache

LAYOUT = make_layout("BLNHC", num_blocks=12)
BS = LAYOUT.block_size


def _multi(root: Path, seed: int) -> tuple[MultiConnector, Any]:
    multi = MultiConnector(
        [
            OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=BS),
            FilesystemConnector(
                FilesystemConfig(root=root, model_fingerprint="model-a", fsync=False), block_size=BS
            ),
        ]
    )
    cache = random_cache(LAYOUT, seed=seed)
    multi.register_kv_caches(cache, LAYOUT)
    return multi, cache


def _step(multi: MultiConnector) -> None:
    meta = multi.build_connector_meta()
    multi.start_load_kv(meta)
    for layer in range(LAYOUT.num_layers):
        multi.wait_for_layer_load(layer)
        multi.save_kv_layer(layer, meta)
    multi.wait_for_save()


def test_saves_to_all_and_loads_from_the_first_that_has_the_blocks(
    tmp_path: Path, make_request: Callable[..., Any]
) -> None:
    multi, cache = _multi(tmp_path, seed=1)
    want = [block_bytes(cache, LAYOUT, b) for b in (1, 2)]
    req = make_request("a", 2, BS, seed=5)
    assert multi.request_finished(req, [1, 2]) == (True, None)
    _step(multi)
    assert multi.get_finished() == ({"a"}, set())  # both children reported it
    offload, disk = multi.connectors
    assert isinstance(disk, FilesystemConnector) and isinstance(offload, OffloadingConnector)
    disk.flush()
    assert all(disk.path_of(h).exists() for h in req.block_hashes)
    # hot: the CPU tier answers
    b = make_request("b", 2, BS, seed=5)
    assert multi.get_num_new_matched_tokens(b, 0) == (2 * BS, False)
    multi.update_state_after_alloc(b, [5, 6], 2 * BS)
    _step(multi)
    assert offload.stats.loaded_blocks == 2
    assert torch.equal(block_bytes(cache, LAYOUT, 6), want[1])
    multi.close()
    # restart: the CPU tier is empty, the disk answers
    again, other = _multi(tmp_path, seed=2)
    c = make_request("c", 2, BS, seed=5)
    assert again.get_num_new_matched_tokens(c, 0) == (2 * BS, False)
    again.update_state_after_alloc(c, [8, 9], 2 * BS)
    _step(again)
    assert again.get_block_ids_with_load_errors() == set()
    assert [
        torch.equal(block_bytes(other, LAYOUT, b), w) for b, w in zip([8, 9], want, strict=True)
    ] == [True, True]
    assert again.connectors[0].stats.loaded_blocks == 0  # type: ignore[attr-defined]
    again.close()


def test_children_must_agree_on_block_size() -> None:
    with pytest.raises(ValueError, match="different sizes"):
        MultiConnector(
            [
                OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=4),
                OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=8),
            ]
        )
