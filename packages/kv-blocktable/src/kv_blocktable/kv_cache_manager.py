"""The scheduler-facing KV-cache manager over a kv-spec plan: admission, prefix hits, slots, free.

One :class:`KVCacheManager` drives every group of a ``kv_spec.KVCacheConfig`` over one shared
:class:`~kv_blocktable.pool.BlockPool` (one block-id space, block 0 the null block). A step of a
scheduler, per request::

    blocks, n_hit = mgr.get_computed_blocks(req)          # only when admitting (waiting -> running)
    new = mgr.allocate_slots(req, num_new_tokens, n_hit, blocks)   # None: does not fit, retry later
    ...                                                    # run the model; append sampled tokens:
    req.append_token_ids(tok)
    mgr.free(req)                                          # finished or preempted

The manager tracks each request's *computed* tokens itself: after ``allocate_slots(req, n)``
succeeds it assumes those ``n`` tokens are computed by the next call for ``req`` (pass
``num_computed_tokens=`` to override, e.g. after rejected speculative tokens).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from kv_spec import NULL_BLOCKS, KVCacheConfig
from kv_spec._checks import check_bool

from kv_blocktable._admission import admission_need, check_admissible, check_hit_blocks
from kv_blocktable._admission import check_count as _check_count
from kv_blocktable._decode_slots import DecodeSlots, allocate_decode_slots
from kv_blocktable.events import KVEvent
from kv_blocktable.hashing import BlockHasher
from kv_blocktable.managers import FullAttentionManager, GroupManager, make_group_manager
from kv_blocktable.pool import BlockPool
from kv_blocktable.request import Request

__all__ = ["DecodeSlots", "KVCacheBlocks", "KVCacheManager"]


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """Block ids per KV-cache group, in group order (a value: tuples, never mutated).

    From ``get_computed_blocks`` it holds the prefix hit; from ``allocate_slots`` it holds only the
    blocks that call added, which the engine appends to the request's block-table rows.
    """

    blocks: tuple[tuple[int, ...], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(map(list, self.blocks))  # fresh lists (the scheduler calls it per request)

    @property
    def num_groups(self) -> int:
        return len(self.blocks)

    def __bool__(self) -> bool:
        return any(self.blocks)


class _ComputedCounts(Mapping[str, int]):
    """request id -> tokens computed, read from the running requests (a read-only view)."""

    def __init__(self, requests: dict[str, Request]) -> None:
        self._requests = requests

    def __getitem__(self, request_id: str) -> int:
        return self._requests[request_id]._kv_computed

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests


class KVCacheManager:
    """Block allocation and prefix caching for every group of ``kv_cache_config``.

    - ``enable_prefix_caching``: full blocks are hashed (``hash_algo``: ``"sha256"`` or
      ``"xxhash128"``) and reused across requests with the same prefix and extra keys.
    - Hash block size: the gcd of the groups' block sizes (``hash_block_size``); see
      ``docs/block_hash.md``.
    - With ``kv_cache_config.max_model_len`` set, the plan must hold one request of that length
      besides the null block, counted with kv-spec's ``max_memory_usage_bytes`` per group (a
      sliding window needs only its window plus a step's tokens); otherwise ``ValueError``.
    - ``enable_events``: record ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` for
      ``take_events()``.
    - ``reset_prefix_cache()`` raises :class:`~kv_blocktable.pool.PrefixCacheBusyError` while any
      block is held (it cannot drop hashes of blocks that requests still use) and returns True
      once the cache is empty.
    - Sliding-window and chunked-local groups drop the blocks no future query reads: in
      ``get_block_ids`` those positions hold the null block id 0 (the position is kept, so index
      ``j`` is always tokens ``[j * block_size, (j + 1) * block_size)``) and the blocks go back to
      the pool. A block-table builder that still holds the old id at such a position may keep it:
      no query reads that position again, and nothing writes there.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        enable_events: bool = False,
        medium: str = "GPU",
    ) -> None:
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise TypeError(
                f"kv_cache_config is a {type(kv_cache_config).__name__}; pass the "
                "kv_spec.KVCacheConfig that kv_spec.plan_kv_cache returns"
            )
        cfg = kv_cache_config
        check_bool("KVCacheManager", "enable_prefix_caching", enable_prefix_caching)
        check_bool("KVCacheManager", "enable_events", enable_events)
        if cfg.num_blocks < 2:
            raise ValueError(
                f"kv_cache_config.num_blocks={cfg.num_blocks} leaves no usable block: block 0 is "
                "the null block; plan with more memory"
            )
        self.kv_cache_config = cfg
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = cfg.max_model_len
        self._max_len = cfg.max_model_len if cfg.max_model_len is not None else sys.maxsize
        self.block_sizes = tuple(g.spec.block_size for g in cfg.groups)
        self.hash_block_size = math.gcd(*self.block_sizes)
        self.hasher = BlockHasher(self.hash_block_size, hash_algo)
        self.pool = BlockPool(
            cfg.num_blocks,
            enable_caching=enable_prefix_caching,
            num_groups=len(cfg.groups),
            enable_events=enable_events,
            medium=medium,
        )
        self.managers: tuple[GroupManager, ...] = tuple(
            make_group_manager(
                self.pool, g.group_id, g.spec, self.hash_block_size, enable_prefix_caching
            )
            for g in cfg.groups
        )
        if cfg.max_model_len is not None:
            need = cfg.blocks_per_request()
            if need > cfg.num_blocks - NULL_BLOCKS:
                # kv-spec's planner refuses such a plan; a config built by hand can still be one
                raise ValueError(
                    f"kv_cache_config.num_blocks={cfg.num_blocks} cannot hold one request of "
                    f"max_model_len={cfg.max_model_len}: it needs {need} blocks and block 0 is the "
                    f"null block, so plan at least {need + NULL_BLOCKS} blocks (more memory or a "
                    "shorter max_model_len)"
                )
        # Single full-attention group: the decode fast path in allocate_slots applies.
        self._single_full = len(self.managers) == 1 and type(self.managers[0]) is (
            FullAttentionManager
        )
        #: request id -> the running Request (its ``_kv_owner`` is this manager).
        self._requests: dict[str, Request] = {}
        #: request id -> tokens computed (or scheduled) so far (each Request's ``_kv_computed``).
        self._computed: Mapping[str, int] = _ComputedCounts(self._requests)
        self._empty = KVCacheBlocks(tuple(() for _ in self.managers))

    # -- properties ----------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by running requests (cached free blocks count as free)."""
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_running_requests(self) -> int:
        return len(self._requests)

    def num_computed_tokens(self, request_id: str) -> int:
        rid = self._check_known(request_id, "num_computed_tokens")
        return self._requests[rid]._kv_computed

    # -- prefix hits ---------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of ``request`` valid for every group, and its token count.

        Call it when admitting a request (it must hold no blocks). The hit stops at least one token
        short of the prompt's end (the last token must be computed to get logits); it is a
        multiple of every group's block size. Nothing is reserved: pass the result to
        ``allocate_slots``, which takes the blocks.
        """
        if not isinstance(request, Request):
            raise TypeError(f"request is a {type(request).__name__}; pass a kv_blocktable.Request")
        self._check_admissible(request, "get_computed_blocks")
        if not self.enable_prefix_caching or request.num_tokens <= 1:
            return self._empty, 0
        request.bind_hasher(self.hasher)
        hashes = request.block_hashes
        length = request.num_tokens - 1
        hits: list[list[int]] = [[] for _ in self.managers]
        # Each group can only shorten the hit; repeat until every group accepts the same length.
        while True:
            changed = False
            for i, m in enumerate(self.managers):
                hits[i], n = m.find_longest_cache_hit(hashes, length)
                if n != length:
                    length, changed = n, True
            if not changed or length == 0:
                break
        if length == 0:
            return self._empty, 0
        return KVCacheBlocks(tuple(tuple(h) for h in hits)), length

    # -- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        *,
        num_computed_tokens: int | None = None,
    ) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens (plus lookahead slots).

        On admission pass the prefix hit of ``get_computed_blocks``: ``new_computed_blocks`` and
        ``num_new_computed_tokens`` (tokens beyond the hit, e.g. loaded by a connector, get fresh
        blocks). Returns the blocks this call added per group (append them to the block table),
        or None when the pool cannot serve the whole request now — then nothing changed except
        that blocks out of a sliding window were returned to the pool.
        """
        # The decode fast path: a running request, one full-attention group, no extras. It is
        # what a scheduler calls for every running request every step, so it stays inline.
        # "Running" is by identity: a request this manager admitted (another Request object with
        # the same id takes the checked path below, which refuses it).
        try:
            owned = request._kv_owner is self
        except AttributeError:  # not a Request: the checked path says so
            owned = False
        if (
            owned
            and self._single_full
            and new_computed_blocks is None
            and not num_new_computed_tokens
            and not num_lookahead_tokens
            and num_computed_tokens is None
            and type(num_new_tokens) is int
            and num_new_tokens >= 0
        ):
            rid = request.request_id
            computed = request._kv_computed
            done = computed + num_new_tokens
            if done > self._max_len:
                self._raise_too_long(rid, computed, num_new_tokens, 0)
            m = self.managers[0]
            blocks = m.blocks[rid]
            end = -(-done // m.block_size)
            new: list[int] = []
            if end > len(blocks):
                if end - len(blocks) > self.pool._num_free:
                    return None
                new = self.pool.allocate(end - len(blocks))
                blocks.extend(new)
            request._kv_computed = done
            if self.enable_prefix_caching:
                known = len(request.token_ids)
                if done < known:
                    known = done
                if known // m.block_size > m.num_cached[rid]:
                    m.cache_blocks(request, known)
            return KVCacheBlocks((tuple(new),)) if new else self._empty
        return self._allocate(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_computed_tokens,
        )

    # The batched decode step (kv_blocktable._decode_slots): a method by assignment.
    allocate_decode_slots = allocate_decode_slots

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        num_computed_tokens: int | None,
    ) -> KVCacheBlocks | None:
        if not isinstance(request, Request):
            raise TypeError(f"request is a {type(request).__name__}; pass a kv_blocktable.Request")
        rid = request.request_id
        _check_count("num_new_tokens", num_new_tokens)
        _check_count("num_new_computed_tokens", num_new_computed_tokens)
        _check_count("num_lookahead_tokens", num_lookahead_tokens)
        admitting = request._kv_owner is not self
        computed: int | None = None
        if admitting:
            self._check_admissible(request, "allocate_slots")
            if num_new_computed_tokens > request.num_tokens:
                raise ValueError(
                    f"allocate_slots: request {rid!r}: num_new_computed_tokens="
                    f"{num_new_computed_tokens} is more than its {request.num_tokens} tokens; "
                    "only known tokens can be computed (pass get_computed_blocks' count, plus "
                    "any tokens a connector loads, at most the prompt)"
                )
        else:
            computed = request._kv_computed
        if not admitting and (num_new_computed_tokens or new_computed_blocks is not None):
            raise ValueError(
                f"request {rid!r} is running; num_new_computed_tokens={num_new_computed_tokens} "
                "and new_computed_blocks are only for admitting a request"
            )
        if num_computed_tokens is not None:
            _check_count("num_computed_tokens", num_computed_tokens)
            if admitting:
                raise ValueError(
                    f"num_computed_tokens={num_computed_tokens} overrides a running request's "
                    f"count; request {rid!r} is being admitted (pass num_new_computed_tokens)"
                )
            slots = min(len(m.blocks[rid]) * m.block_size for m in self.managers)
            bound = min(slots, request.num_tokens)
            if num_computed_tokens > bound:
                raise ValueError(
                    f"allocate_slots: request {rid!r}: num_computed_tokens={num_computed_tokens} "
                    f"is more than min(its {request.num_tokens} tokens, the {slots} it holds "
                    f"slots for) = {bound}; computed tokens are known tokens with slots (e.g. "
                    "the accepted ones after speculative decoding)"
                )
            computed = num_computed_tokens
        if admitting and self.enable_prefix_caching:  # without caching, hashes are wasted work
            request.bind_hasher(self.hasher)
        hit = self._check_hit(request, num_new_computed_tokens, new_computed_blocks)
        if admitting:
            computed = num_new_computed_tokens
        assert computed is not None
        total = computed + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            self._raise_too_long(rid, computed, num_new_tokens, num_lookahead_tokens)

        if not admitting:
            for m in self.managers:
                m.remove_skipped_blocks(rid, computed)
        if admitting:
            need = self._admission_need(total, computed, hit)
        else:
            need = sum(m.num_new_blocks(rid, total, computed) for m in self.managers)
        if need > self.pool.num_free_blocks:
            return None

        if admitting:
            for m, h in zip(self.managers, hit, strict=True):
                held = [b for b in h if b]
                if held:
                    self.pool.touch(held)
                m.add_computed_blocks(rid, h)
                m.remove_skipped_blocks(rid, computed)
        new = tuple(tuple(m.allocate(rid, total, computed)) for m in self.managers)
        done = computed + num_new_tokens
        request._kv_computed = done
        if admitting:
            self._requests[rid] = request
            request._kv_owner = self
            request._kv_due = 0  # allocate_decode_slots checks it until it sets a mark
        if self.enable_prefix_caching:
            known = min(done, request.num_tokens)
            for m in self.managers:
                m.cache_blocks(request, known)
        return KVCacheBlocks(new) if any(new) else self._empty

    # Admission checks (kv_blocktable._admission): methods by assignment, no wrapper.
    _admission_need = admission_need
    _check_admissible = check_admissible
    _check_hit_blocks = check_hit_blocks

    def _check_hit(
        self, request: Request, num_new_computed_tokens: int, blocks: KVCacheBlocks | None
    ) -> tuple[tuple[int, ...], ...]:
        rid = request.request_id
        if blocks is None:
            return tuple(() for _ in self.managers)
        if not isinstance(blocks, KVCacheBlocks) or blocks.num_groups != len(self.managers):
            raise ValueError(
                f"request {rid!r}: new_computed_blocks must be the KVCacheBlocks that "
                f"get_computed_blocks returned ({len(self.managers)} groups); got {blocks!r}"
            )
        lengths = {len(b) * m.block_size for b, m in zip(blocks.blocks, self.managers, strict=True)}
        if len(lengths) != 1 or max(lengths) > num_new_computed_tokens:
            raise ValueError(
                f"request {rid!r}: new_computed_blocks cover {sorted(lengths)} tokens per group, "
                f"which must be one length <= num_new_computed_tokens={num_new_computed_tokens}; "
                "pass get_computed_blocks' (blocks, num_computed_tokens) unchanged"
            )
        length = lengths.pop()
        if length:
            self._check_hit_blocks(request, length, blocks.blocks)
        return blocks.blocks

    def _raise_too_long(self, rid: str, computed: int, new: int, lookahead: int) -> None:
        raise ValueError(
            f"request {rid!r}: {computed} computed + {new} new + {lookahead} lookahead tokens = "
            f"{computed + new + lookahead} exceeds max_model_len={self.max_model_len}; finish or "
            "truncate the request"
        )

    # -- free / queries ------------------------------------------------------------------------

    def free(self, request: Request | str) -> None:
        """Release every block the request holds (finished or preempted). Its cached blocks stay
        in the prefix cache until evicted, so a re-admitted request hits them."""
        rid = self._check_known(request, "free")
        self._requests.pop(rid)._kv_owner = None
        for m in self.managers:
            m.free(rid)

    def get_block_ids(self, request: Request | str) -> tuple[list[int], ...]:
        """The request's block ids per group, by position (0 where a window dropped a block).
        The lists are copies."""
        rid = self._check_known(request, "get_block_ids")
        return tuple(list(m.blocks.get(rid, ())) for m in self.managers)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; raises ``PrefixCacheBusyError`` while blocks are held."""
        self.pool.reset_prefix_cache()
        return True

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def _check_known(self, request: Request | str, op: str) -> str:
        """The id of ``request`` (a running Request, or a running request's id)."""
        if isinstance(request, Request):
            rid = request.request_id
        elif isinstance(request, str):
            rid = request
        else:
            raise TypeError(
                f"{op}: request={request!r} is a {type(request).__name__}; pass the Request or "
                "its request_id (a str)"
            )
        if rid not in self._computed:
            raise ValueError(
                f"{op}: request {rid!r} holds no blocks in this manager (never allocated, or "
                f"already freed); {len(self._computed)} requests are running"
            )
        if isinstance(request, Request) and self._requests[rid] is not request:
            raise ValueError(
                f"{op}: request {rid!r} is another Request object than the running one with "
                "that id; pass the running Request (or its id)"
            )
        return rid
