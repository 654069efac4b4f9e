"""Byte views of registered caches: NIXL's row-order ranges are exactly the gather rows for every
order; several registered caches (KV-cache groups sharing block ids) move as one row; bad
registrations are refused with the reason."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kv_connectors import OffloadingConfig, OffloadingConnector, RegisteredKV
from kv_connectors.testing import block_bytes, make_layout, random_cache, standard_layouts

LAYOUTS = standard_layouts(num_blocks=5)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_row_order_ranges_read_back_the_gather_row(name: str) -> None:
    layout = LAYOUTS[name]
    kv = RegisteredKV(random_cache(layout, seed=1), layout)
    rows = kv.new_rows(1)
    kv.gather([3], rows)
    ranges = kv.block_ranges(3)
    assert sum(n for _a, n in ranges) == kv.row_bytes
    got = b"".join(ctypes.string_at(addr, n) for addr, n in ranges)
    assert got == rows[0].numpy().tobytes()


def test_two_groups_share_block_ids_and_move_as_one_row(make_request: Callable[..., Any]) -> None:
    full = make_layout("LBNHC", num_blocks=8, num_layers=2)
    window = make_layout("BLHNC", num_blocks=8, num_layers=1, num_kv_heads=1, head_size=16)
    caches = [random_cache(full, seed=1), random_cache(window, seed=2)]
    conn = OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=full.block_size)
    conn.register_kv_caches(caches, [full, window])
    assert conn.kv.row_bytes == 2 * full.page_bytes + window.page_bytes
    want = [block_bytes(c, lay, 2) for c, lay in zip(caches, [full, window], strict=True)]
    req = make_request("a", 1, full.block_size)
    conn.request_finished(req, [2])
    conn.start_load_kv(meta := conn.build_connector_meta())
    conn.wait_for_save()
    b = make_request("b", 1, full.block_size, prefix=list(req.token_ids))
    tokens, _ = conn.get_num_new_matched_tokens(b, 0)
    conn.update_state_after_alloc(b, [6], tokens)
    conn.start_load_kv(conn.build_connector_meta())
    for layer in range(conn.kv.num_layers):  # (a load lands layer by layer, as they are waited)
        conn.wait_for_layer_load(layer)
    assert meta.saves and tokens == full.block_size
    for c, lay, w in zip(caches, [full, window], want, strict=True):
        assert torch.equal(block_bytes(c, lay, 6), w)


def test_bad_registrations_say_why() -> None:
    lay = make_layout("LBNHC")
    with pytest.raises(ValueError, match="one tensor per layer slot"):
        RegisteredKV(random_cache(make_layout("BLNHC"), seed=0), lay)
    with pytest.raises(ValueError, match="different num_blocks"):
        RegisteredKV(
            [random_cache(lay, seed=0), random_cache(make_layout("LBNHC", num_blocks=3), seed=0)],
            [lay, make_layout("LBNHC", num_blocks=3)],
        )
    with pytest.raises(ValueError, match="2 storages and 1 layouts"):
        RegisteredKV([random_cache(lay, seed=0), random_cache(lay, seed=0)], [lay])
    with pytest.raises(TypeError, match="KVCacheLayout"):
        RegisteredKV([random_cache(lay, seed=0)], ["LBNHC"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("ids", "bad"), [([1, 16], "16"), ([1, -1], "-1"), ([1, True], "True"), ([1, 2.0], "2.0")]
)
def test_check_block_ids_names_the_first_bad_id(ids: list[Any], bad: str) -> None:
    """The one-pass check of plain ints in range (a pull's ids, on the producer's critical path)
    refuses what the id-by-id walk refused and names the bad id and the bound."""
    layout = make_layout("BLNHC", num_blocks=16)
    kv = RegisteredKV(random_cache(layout, seed=1), layout)
    kv.check_block_ids(list(range(16)), what="pull block_ids")
    kv.check_block_ids([], what="pull block_ids")
    with pytest.raises(ValueError, match=rf"holds block id {bad}, outside \[0, num_blocks=16\)"):
        kv.check_block_ids(ids, what="pull block_ids")
