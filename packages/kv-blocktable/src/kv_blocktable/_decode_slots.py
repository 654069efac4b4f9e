"""A decode step's slots for a batch: :meth:`KVCacheManager.allocate_decode_slots` and the
:class:`DecodeSlots` it returns.

Split out of ``kv_cache_manager.py`` by job; :func:`allocate_decode_slots` takes the manager
first and is its method by assignment, so a call costs what it did. Scheduler side: no torch.

With one full-attention group it is ``allocate_slots``' decode path with its locals bound once
per batch, and one comparison per request for the common case: each running ``Request`` carries
``_kv_due``, a computed-token count below which a step has nothing to do for it but count — no
new block (the row holds slots up to its blocks' end), no length error (``max_model_len``), no
block to enter in the prefix cache (the next one fills at ``(cached + 1) * block_size``). It is
set after the request's checked path ran, from those three bounds, and stays a lower bound of
them while the request runs: a full-attention row and its cached count only grow, and the
length bound is the manager's. Admission sets it to 0 (always checked), so a request freed and
admitted again, here or in another manager, starts checked. A request under its mark costs an
attribute read and a comparison instead of the checks (256 requests: ~37 -> ~17 us a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kv_blocktable._admission import check_count
from kv_blocktable.pool import NULL_BLOCK_ID

if TYPE_CHECKING:
    from kv_blocktable.kv_cache_manager import KVCacheManager
    from kv_blocktable.request import Request

__all__ = ["DecodeSlots", "allocate_decode_slots"]


class DecodeSlots(NamedTuple):
    """What :meth:`KVCacheManager.allocate_decode_slots` did, in the form a block table and a
    step's metadata take.

    - ``num_scheduled``: requests ``[0, num_scheduled)`` got their slots. Fewer than were passed:
      the pool could not serve request ``num_scheduled`` (it and the ones after it are
      unchanged); preempt and call again with the rest.
    - ``rows`` / ``new_block_ids``: the indices (into the requests passed) of the requests that
      got new blocks, and those blocks per group (``KVCacheBlocks.get_block_ids``' form): what
      ``BlockTables.append_rows(rows, new_block_ids)`` takes when request ``i`` is row ``i``.
    - ``num_computed_tokens``: per scheduled request, its tokens with slots after the call —
      for a decode step, the request's ``seq_len``.
    """

    num_scheduled: int
    rows: list[int]
    new_block_ids: list[tuple[list[int], ...]]
    num_computed_tokens: list[int]


def allocate_decode_slots(
    self: KVCacheManager, requests: Sequence[Request], num_new_tokens: int = 1
) -> DecodeSlots:
    """``allocate_slots(req, num_new_tokens)`` for each request in order, stopping at the
    first the pool cannot serve — the same blocks, counts and errors as that loop — in one
    call: a decode step of a few hundred running requests costs one Python loop here
    instead of a call per request (with one full-attention group; other configurations run
    the loop of ``allocate_slots`` calls).

    A request this manager does not run takes ``allocate_slots``' own path (admission
    without a prefix hit, or its error). An error for request ``i`` leaves requests before
    it with their slots, as the loop would.
    """
    if not isinstance(requests, (list, tuple)):
        raise TypeError(
            f"allocate_decode_slots: requests is a {type(requests).__name__}; pass a list "
            "of the running Requests"
        )
    check_count("num_new_tokens", num_new_tokens)
    n = num_new_tokens
    rows: list[int] = []
    ids: list[tuple[list[int], ...]] = []
    counts: list[int] = []
    computed = self._computed
    if not self._single_full:
        for i, req in enumerate(requests):
            got = self.allocate_slots(req, n)
            if got is None:
                return DecodeSlots(i, rows, ids, counts)
            if got:
                rows.append(i)
                ids.append(got.get_block_ids())
            counts.append(computed[req.request_id])
        return DecodeSlots(len(requests), rows, ids, counts)
    # allocate_slots' decode fast path, its locals bound once for the whole batch.
    m = self.managers[0]
    bs, held, cached = m.block_size, m.blocks, m.num_cached
    pool, max_len, caching = self.pool, self._max_len, self.enable_prefix_caching
    count = counts.append
    # cache_blocks' one-block case inline (what a decode step caches: the block its token
    # filled), bound once: the two calls per block (cache_blocks, pool._cache_block) were
    # most of its cost. Events on, or anything unusual, takes cache_blocks itself.
    one_block = caching and not pool.enable_events
    ratio, group = m.hash_ratio, m.group_id
    prefix, block_hash, ref = pool._cache[group], pool._hash, pool._ref
    past_len = max_len + 1  # the first count that raises
    null = NULL_BLOCK_ID
    for req in requests:
        try:
            owned = req._kv_owner is self
        except AttributeError:  # not a Request: allocate_slots names it
            owned = False
        if not owned:
            i = len(counts)  # the request's index: every request before it was counted
            got = self.allocate_slots(req, n)
            if got is None:
                return DecodeSlots(i, rows, ids, counts)
            if got:
                rows.append(i)
                ids.append(got.get_block_ids())
            counts.append(computed[req.request_id])
            continue
        done = req._kv_computed + n
        if done < req._kv_due:  # nothing due (module docstring): count the tokens
            req._kv_computed = done
            count(done)
            continue
        rid = req.request_id
        blocks = held[rid]
        if done > max_len:
            self._raise_too_long(rid, done - n, n, 0)
        elif done > len(blocks) * bs:  # past its last block's slots: new blocks
            need = -(-done // bs) - len(blocks)
            if need > pool._num_free:
                return DecodeSlots(len(counts), rows, ids, counts)
            front = pool._front
            if need == 1 and front and not pool._num_stale:
                # BlockPool.allocate(1)'s common case inline (the top of the stack of
                # uncached free blocks: nothing to evict), the call being most of its cost.
                b = front.pop()
                ref[b] = 1
                pool._num_free -= 1
                blocks.append(b)
                new = [b]
            else:
                new = pool.allocate(need)
                blocks.extend(new)
            rows.append(len(counts))
            ids.append((new,))
        req._kv_computed = done
        count(done)
        due = len(blocks) * bs + 1  # the first count past the row's slots
        if past_len < due:
            due = past_len
        if not caching:
            req._kv_due = due
            continue
        # A block fills when both the computed and the known tokens reach its end:
        # min(len(token_ids), done) // bs > cached.
        c = cached[rid]
        at = (c + 1) * bs
        if done >= at and len(req.token_ids) >= at:
            known = len(req.token_ids)
            if done < known:
                known = done
            full = known // bs
            b = blocks[c]
            if full == c + 1 and one_block and b != null:
                h = req._block_hashes[full * ratio - 1]
                if h not in prefix and ref[b] and block_hash[b] is None:
                    # pool._cache_block's success path; its refusals (a hash already
                    # cached: no-op; a free or cached block: errors) run it.
                    prefix[h] = b
                    block_hash[b] = h
                    pool._group[b] = group
                    pool._num_cached += 1
                else:
                    pool._cache_block(group, b, h)
                cached[rid] = full
                at = at + bs  # (full + 1) * bs: full is c + 1
            else:
                m.cache_blocks(req, known)
                at = (cached[rid] + 1) * bs
        req._kv_due = at if at < due else due
    return DecodeSlots(len(requests), rows, ids, counts)
