"""BlockTables fed by the scheduler side: rows follow KVCacheManager's block ids step by step.

A toy continuous-batching loop over a hybrid plan (full, sliding-window and chunked-local groups
in one block-id space) admits requests with shared prefixes (prefix hits), prefills them in
chunks, decodes, finishes and condenses rows, as an engine would: a row is written once on
admission (``add_row(get_block_ids(req))``) and then only appended to with each step's new blocks.
Blocks that leave a window go back to the pool (and may be handed to another request) while the
worker's row still holds their old ids; the checks say that this never mis-addresses a write and
never confuses FlexAttention's physical → logical map.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kv_blocktable import NULL_BLOCK_ID, KVCacheManager, Request  # noqa: E402
from kv_blocktable.block_table import BlockTables  # noqa: E402
from kv_spec import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    plan_kv_cache,
)

BS, MAX_LEN, CHUNK = 8, 96, 11


def _plan() -> object:
    kw = dict(block_size=BS, num_kv_heads=1, head_size=8, dtype="float32")
    specs = {
        "full": FullAttentionSpec(**kw),  # type: ignore[arg-type]
        "swa": SlidingWindowSpec(sliding_window=6, **kw),  # type: ignore[arg-type]
        "chunk": ChunkedLocalAttentionSpec(attention_chunk_size=16, **kw),  # type: ignore[arg-type]
    }
    page = BS * 2 * 8 * 4
    return plan_kv_cache(specs, page * 40, max_model_len=MAX_LEN)


def test_rows_follow_the_manager() -> None:
    cfg = _plan()
    mgr = KVCacheManager(cfg)  # type: ignore[arg-type]
    tables = BlockTables.from_config(
        cfg,  # type: ignore[arg-type]
        [BS // 2, BS, BS // 4],  # kernel-block ratios 2, 1, 4
        max_num_reqs=3,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=64,
    )
    prefix = [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    waiting = [Request(f"r{i}", prefix + [i] * (5 + 3 * i)) for i in range(5)]
    rows: list[Request] = []  # batch order: request in row i
    computed: dict[str, int] = {}
    prompt_len = {r.request_id: r.num_tokens for r in waiting}
    hits = steps = 0
    while (waiting or rows) and steps < 40:
        steps += 1
        qlens: list[int] = []
        # Admit while there is a free row; its row is written once, from the manager's ids.
        while waiting and len(rows) < tables.max_num_reqs:
            req = waiting[0]
            hit, n_hit = mgr.get_computed_blocks(req)
            n_new = min(CHUNK, req.num_tokens - n_hit)
            if mgr.allocate_slots(req, n_new, n_hit, hit) is None:
                break
            waiting.pop(0)
            hits += n_hit > 0
            computed[req.request_id] = n_hit
            tables.add_row(len(rows), mgr.get_block_ids(req))
            rows.append(req)
            qlens.append(n_new)
        # Running requests (admitted before this step) get their new blocks appended.
        for i, req in enumerate(rows[: len(rows) - len(qlens)]):
            rid = req.request_id
            n_new = min(CHUNK, req.num_tokens - computed[rid])
            new = mgr.allocate_slots(req, n_new)
            assert new is not None, "the toy plan is sized so running requests always fit"
            tables.append_row(i, new.get_block_ids())
            qlens.insert(i, n_new)
        num_reqs = len(rows)
        tables.commit(num_reqs)
        slens = [computed[r.request_id] + q for r, q in zip(rows, qlens, strict=True)]
        mds = tables.build_common_metadata(num_reqs, qlens, slens, pad_tokens_to=sum(qlens) + 1)
        for g, md in enumerate(mds):
            want = []
            for r, q, s in zip(rows, qlens, slens, strict=True):
                ids = mgr.get_block_ids(r)[g]
                assert tables.num_blocks_of_row(rows.index(r))[g] == len(ids)
                row = tables.host_table(g)[rows.index(r), : len(ids)].tolist()
                # The row equals the manager's list except where the manager dropped a block.
                assert all(a == b for a, b in zip(row, ids, strict=True) if b != NULL_BLOCK_ID)
                for pos in range(s - q, s):
                    assert ids[pos // BS] != NULL_BLOCK_ID
                    want.append(ids[pos // BS] * BS + pos % BS)
            assert md.slot_mapping.tolist() == [*want, -1]
            # Flex's map: every block a query can see sits at its column, nothing else.
            p2l = tables.flex_physical_to_logical(g)
            k = tables.kernel_blocks_per_block[g]
            seen = (p2l >= 0).nonzero().flatten().tolist()
            for r, q, s in zip(rows, qlens, slens, strict=True):
                ids = mgr.get_block_ids(r)[g]
                kbs = tables.kernel_block_sizes[g]
                window = tables.key_windows[g]
                first = 0 if window is None else int(window.first_visible(torch.tensor(s - q)))
                for col in range(first // kbs, -(-s // kbs)):
                    blk = ids[col // k] * k + col % k
                    assert ids[col // k] != NULL_BLOCK_ID
                    assert int(p2l[blk]) == col
                    if blk in seen:
                        seen.remove(blk)
            assert seen == [], f"group {g} maps blocks no query reads: {seen}"
        # The model ran: the computed counts advance; finished prompts get one output token.
        for r, q in zip(rows, qlens, strict=True):
            computed[r.request_id] += q
            if computed[r.request_id] >= prompt_len[r.request_id]:
                r.append_token_ids(3)
        # Requests with 4 generated tokens finish; the last row moves into the hole.
        for i in reversed(range(len(rows))):
            r = rows[i]
            if r.num_tokens - prompt_len[r.request_id] >= 4:
                mgr.free(r)
                last = len(rows) - 1
                if i != last:
                    tables.move_row(last, i)
                    rows[i] = rows[last]
                tables.clear_row(last)
                rows.pop()
    assert not waiting and not rows, f"the loop did not drain in {steps} steps"
    assert hits >= 3, "prefix hits: later requests reuse the shared prefix blocks"
