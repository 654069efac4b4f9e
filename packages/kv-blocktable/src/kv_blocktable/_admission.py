"""Request admission checks of :class:`~kv_blocktable.kv_cache_manager.KVCacheManager`.

What the manager checks before it admits a request (a waiting request taking its first blocks,
maybe a prefix hit): the request runs nowhere and its id is free, the hit blocks are the pool's
blocks cached for this request's tokens, and how many free blocks the admission takes. The
manager's count check of ``allocate_slots``' arguments is here too. Split out of
``kv_cache_manager.py`` by job; the functions take the manager first and are its methods by
assignment (``KVCacheManager._check_admissible`` is :func:`check_admissible`), so a call costs
what it did. None of them runs on the decode step (``check_count`` runs once per call of
``allocate_decode_slots``). Scheduler side: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kv_spec import cdiv

if TYPE_CHECKING:
    from kv_blocktable.kv_cache_manager import KVCacheManager
    from kv_blocktable.request import Request

__all__ = ["admission_need", "check_admissible", "check_count", "check_hit_blocks"]


def check_count(name: str, value: object) -> None:
    if type(value) is not int or value < 0:  # bool is excluded on purpose
        raise (ValueError if type(value) is int else TypeError)(
            f"allocate_slots: {name}={value!r} must be an int >= 0; got {type(value).__name__}"
        )


def admission_need(
    mgr: KVCacheManager, total: int, computed: int, hit: Sequence[Sequence[int]]
) -> int:
    """Free-queue blocks an admission takes: its hit blocks no one holds, and fresh blocks
    for the positions after the hit that the window (if any) still needs."""
    ref = mgr.pool._ref
    need = 0
    for m, h in zip(mgr.managers, hit, strict=True):
        need += sum(1 for b in h if b and not ref[b])
        end = cdiv(total, m.block_size)
        skipped = m.num_skipped_tokens(computed) // m.block_size
        need += max(0, end - max(len(h), min(end, skipped)))
    return need


def check_admissible(mgr: KVCacheManager, request: Request, op: str) -> None:
    """``request`` may be admitted: it runs nowhere, and no running request has its id."""
    rid = request.request_id
    owner = request._kv_owner
    if owner is mgr:
        raise ValueError(
            f"{op}: request {rid!r} already holds blocks; admission is for a waiting request "
            "(free it first to re-admit, e.g. after preemption)"
        )
    if owner is not None:
        raise ValueError(
            f"{op}: request {rid!r} is running in another KVCacheManager; a request belongs "
            "to one manager (free it there first, or build a new Request)"
        )
    if rid in mgr._computed:
        raise ValueError(
            f"{op}: another request with id {rid!r} is running in this manager; request ids "
            "must be unique among running requests (finish or free it, or pick a new id)"
        )


def check_hit_blocks(
    mgr: KVCacheManager, request: Request, length: int, hit: tuple[tuple[int, ...], ...]
) -> None:
    """Every block of a ``length``-token hit is one this request may take: an id of the pool,
    real (not the null block) wherever a query past the hit reads it, and cached in its
    group under this request's hash at its position — so another request's blocks, blocks
    evicted since ``get_computed_blocks``, or blocks of other tokens are refused."""
    rid = request.request_id
    if not mgr.enable_prefix_caching:
        raise ValueError(
            f"allocate_slots: request {rid!r}: new_computed_blocks hold a {length}-token hit "
            "but prefix caching is off, so no block can be a hit; pass None"
        )
    pool = mgr.pool
    hashes = request.block_hashes
    for m, h in zip(mgr.managers, hit, strict=True):
        need = m.needed_from(length)
        for j, b in enumerate(h):
            if type(b) is not int or not 0 <= b < pool.num_blocks:
                raise ValueError(
                    f"allocate_slots: request {rid!r}: group {m.group_id} hit position {j} "
                    f"holds {b!r}, not a block id in [0, num_blocks={pool.num_blocks}); pass "
                    "get_computed_blocks' blocks unchanged"
                )
            if b == 0:
                if j >= need:
                    raise ValueError(
                        f"allocate_slots: request {rid!r}: group {m.group_id} hit position "
                        f"{j} is the null block, but a query past the {length}-token hit "
                        f"reads positions >= {need} of this group; pass get_computed_blocks' "
                        "blocks unchanged"
                    )
                continue
            k = (j + 1) * m.hash_ratio - 1
            want = hashes[k] if k < len(hashes) else None
            if want is None or pool._hash[b] != want or pool._group[b] != m.group_id:
                raise ValueError(
                    f"allocate_slots: request {rid!r}: group {m.group_id} hit block {b} "
                    f"(position {j}) is not cached for this request's tokens there (another "
                    "request's block, other tokens, or evicted since get_computed_blocks); "
                    "call get_computed_blocks again right before allocate_slots"
                )
