"""FLEX_ATTENTION's per-batch metadata and the builder that owns its persistent index buffers.

``q_req`` / ``q_pos`` / ``kv_num_blocks`` / ``kv_indices`` (and the ``full_*`` pair of full
tiles) are allocated once per builder and sized by ``max_num_batched_tokens`` (query blocks), not
by ``max_model_len``; the decode path's ``dec_*`` buffers by ``max_num_seqs``; each ``*_indices``
grows its column count (by powers of 2) when a batch needs more (outside CUDA-graph capture: this
backend does not support graphs, its builder syncs once per step). With static shapes, the block
tables and lengths the mask mods read are copied into ``[max_num_seqs, 2^k]`` buffers too, so
their shapes stay fixed across steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from kv_spec import KVCacheLayout

from kv_backends.backends.flex.decode import FlexDecode, build_decode_call, decode_kv_block_size
from kv_backends.backends.flex.entries import FlexEntries, build_flex_block_entries
from kv_backends.backends.flex.gather import build_gathered_window, check_prefill
from kv_backends.backends.flex.geometry import INT32_LIMIT, CacheGeometry, cache_geometry
from kv_backends.backends.flex.options import FlexOptions, pow2_at_least, resolve_builder_options
from kv_backends.backends.flex.span import SPAN_NO_KEY, SpanInputs, span_stride, write_row_spans
from kv_backends.backends.flex.windows import MASK_MODES, FlexWindow, MaskInputs, build_windows
from kv_backends.base import AttentionMetadata, MetadataBuilder, kernel_block_view
from kv_backends.config import AttentionConfig
from kv_backends.metadata import CommonAttentionMetadata

__all__ = ["FlexAttentionMetadata", "FlexMetadataBuilder", "FlexWindow"]


@dataclass(frozen=True, kw_only=True)
class FlexAttentionMetadata(AttentionMetadata):
    """Per-batch Flex metadata: the common fields plus per-token lookups, one block mask per
    cache window the flattened call touches (none when every request takes the decode call) and
    the decode call (``None`` when the batch has no decode request or runs flattened)."""

    q_req: torch.Tensor  # [padded_tokens] int32 (padding rows: request 0)
    q_pos: torch.Tensor  # [padded_tokens] int32 (padding rows: a position no key is <=)
    phys_to_logical: torch.Tensor  # [num_kernel_blocks] int32, valid for this batch's blocks
    windows: tuple[FlexWindow, ...]
    tpb: int
    options: FlexOptions
    decode: FlexDecode | None = None
    #: Query rows of the flattened call: ``num_actual_tokens``, or that padded up to one of a
    #: few captured sizes when the builder keeps shapes static (rows past the real ones are
    #: computed and dropped).
    padded_tokens: int = 0
    #: The builder padded shapes to captured sizes: compile with ``dynamic=False``.
    static_shapes: bool = False
    #: Layer kinds (``FlexAttentionImpl.compile_key``) whose compiled calls over this metadata
    #: have run: a later layer of the kind finds its graphs compiled, so its forward skips
    #: raising Dynamo's limits (compiled.py). Fresh per instance (``init=False``: not carried
    #: over by ``dataclasses.replace``), so a new batch starts with none.
    compiled_keys: set[tuple[object, ...]] = field(
        default_factory=set, init=False, compare=False, repr=False
    )


class FlexMetadataBuilder(MetadataBuilder):
    """Builds block masks; owns the persistent index buffers of one KV group.

    Options: ``q_block_size``, ``kv_block_size``, ``block_m``, ``block_n`` (see
    :class:`FlexOptions`), or ``options=`` one :class:`FlexOptions` value (the per-layer tile
    config, shared with the impl and the trainer's dense call); ``max_view_elements`` (window
    cut, default ``2**31 - 1``; tests lower it to exercise the split path on small caches);
    ``static_shapes`` (default: on for CUDA): pad every shape a compiled Flex call sees — the
    flattened call's query rows to a power of 2, the decode call's batch to a power of 2, the
    block tables to ``max_num_seqs`` rows and a power-of-2 column count — so a serving loop hits
    a handful of captured graphs instead of recompiling (or going symbolic, which also keeps
    decodes off Flex's split-KV decoding kernel: it needs a static batch size);
    ``decode_tiles`` (``"auto"``, default, or ``"kv"``): the decode call's KV tiles (see
    :mod:`~kv_backends.backends.flex.decode`); ``mask`` (``"auto"``, default, ``"owner"`` or
    ``"table"``): the flattened call's mask mod: the per-row span test where it is exact
    (falling back to the owner test, then the table test); the per-column owner test where it
    is exact (the default before the span test, kept for A/B runs); or always the block-table
    test (see :mod:`~kv_backends.backends.flex.windows`); ``prefill`` (``"auto"``,
    default, ``"paged"`` or ``"gather"``): whether the flattened call reads the paged cache or a
    gathered copy of the batch's context (:mod:`~kv_backends.backends.flex.gather`); ``"auto"``
    gathers where a KV tile is wider than a page (H200, 4 x 4096 causal at page 16: 48 -> 321
    TFLOP/s, dense Flex 385) unless batch invariance or ALiBi rule it out.
    """

    def __init__(
        self,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        device: torch.device,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        q_block_size: int | None = None,
        kv_block_size: int | None = None,
        block_m: int | None = None,
        block_n: int | None = None,
        options: FlexOptions | None = None,
        max_view_elements: int = INT32_LIMIT,
        static_shapes: bool | None = None,
        prefill: str = "auto",
        decode_tiles: str = "auto",
        mask: str = "auto",
    ) -> None:
        super().__init__(
            config,
            layout,
            device=device,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        )
        assert config.kernel_block_size is not None
        self.n = config.kernel_block_size
        self.options = resolve_builder_options(
            config, options, q_block_size, kv_block_size, block_m, block_n
        )
        if static_shapes is not None and not isinstance(static_shapes, bool):
            raise TypeError(f"static_shapes={static_shapes!r} must be a bool or None")
        self.static_shapes = device.type == "cuda" if static_shapes is None else static_shapes
        self.prefill = check_prefill(prefill, config, self.options.kv_block_size > self.n)
        decode_kv_block_size(decode_tiles, self.options.kv_block_size, self.n)  # validates
        self.decode_tiles = decode_tiles
        if mask not in MASK_MODES:
            raise ValueError(f"FLEX_ATTENTION mask={mask!r} must be one of {MASK_MODES}")
        # The owner and span mask mods (windows.py): never under batch invariance, whose mask
        # mod stays the one its bitwise equality with the trainer was established with.
        self.owner_mask = mask in ("auto", "owner") and not config.batch_invariant
        self.span_mask = mask == "auto" and not config.batch_invariant
        if max_view_elements > INT32_LIMIT:
            raise ValueError(
                f"max_view_elements={max_view_elements} exceeds 2**31 - 1: Flex templates use 32-bit offsets"
            )
        self.max_view_elements = max_view_elements
        self.num_kernel_blocks = layout.num_blocks * config.kernel_blocks_per_block
        qbs = self.options.q_block_size
        max_q_blocks = -(-max_num_batched_tokens // qbs)
        # The decode call's query-block size: its query length is 1, so any size works; Flex's
        # decoding kernel packs the GQA group into BLOCK_M rows and needs that to divide it.
        self.decode_q_block_size = max(qbs, 1 << (config.num_queries_per_kv - 1).bit_length())
        # Persistent buffers, sized by the batch bound (query blocks), never by max_model_len.
        # Token buffers round up to whole query blocks: the padded call reads up to there.
        self.q_req = torch.zeros(max_q_blocks * qbs, dtype=torch.int32, device=device)
        self.q_pos = torch.zeros(max_q_blocks * qbs, dtype=torch.int32, device=device)
        # The span mask's interval of key numbers per query row (span.py).
        self.row_lo = torch.zeros(max_q_blocks * qbs, dtype=torch.int32, device=device)
        self.row_hi = torch.zeros(max_q_blocks * qbs, dtype=torch.int32, device=device)
        self.phys_to_logical = torch.zeros(self.num_kernel_blocks, dtype=torch.int32, device=device)
        # The owner mask's request of each block: this batch's blocks hold theirs, every other
        # block -1 (the previous batch's entries are reset, O(blocks in the batch)), so the mask
        # is exact on every pair, listed tile or not (eager Flex evaluates all of them).
        self.block_req = torch.full((self.num_kernel_blocks,), -1, dtype=torch.int32, device=device)
        self._owned = torch.zeros(0, dtype=torch.long, device=device)
        # The span mask's key base of each block: this batch's blocks hold theirs, every other
        # block SPAN_NO_KEY (reset like block_req).
        self.block_key = torch.full(
            (self.num_kernel_blocks,), SPAN_NO_KEY, dtype=torch.int32, device=device
        )
        self._keyed = torch.zeros(0, dtype=torch.long, device=device)
        self.kv_num_blocks = torch.zeros(max_q_blocks, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(max_q_blocks, 64, dtype=torch.int32, device=device)
        # Tiles every query of a block sees whole: Flex skips the mask mod on them. Not under
        # batch invariance (Flex visits them after the partial tiles; see entries.py).
        self.full_blocks = not config.batch_invariant and self.options.kv_block_size <= self.n
        self.full_kv_num_blocks = torch.zeros_like(self.kv_num_blocks)
        self.full_kv_indices = torch.zeros_like(self.kv_indices)
        # The decode call's rows: one per decode request.
        self.dec_num_blocks = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.dec_indices = torch.zeros(max_num_seqs, 64, dtype=torch.int32, device=device)
        self.dec_full_num_blocks = torch.zeros_like(self.dec_num_blocks)
        self.dec_full_indices = torch.zeros_like(self.dec_indices)
        # Static shapes: block tables / lengths padded to fixed rows (columns grow by powers of
        # 2), for the flattened call and the decode call (made on first use).
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._dec_pos = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        # Gathered prefill: the buffer's physical -> logical map and token list (grown on use).
        self._g_ptl = torch.zeros(0, dtype=torch.int32, device=device)
        self._g_tokens = torch.zeros(0, dtype=torch.long, device=device)
        self._g_req = torch.zeros(0, dtype=torch.int32, device=device)
        self._geometry: CacheGeometry | None = None

    # -- static shapes ---------------------------------------------------------------------

    def padded_tokens(self, num_tokens: int) -> int:
        """Query rows of the flattened call: ``num_tokens``, or with static shapes the smallest
        power of 2 >= it (and >= ``q_block_size``), capped at the buffers' size."""
        if not self.static_shapes:
            return num_tokens
        return min(pow2_at_least(max(num_tokens, self.options.q_block_size)), self.q_req.numel())

    def decode_rows(self, num_decodes: int) -> int:
        """Batch rows of the decode call (static shapes: a power of 2 capped at max_num_seqs)."""
        if not self.static_shapes:
            return num_decodes
        return min(pow2_at_least(num_decodes), self.max_num_seqs)

    def gathered_pages(self, pages: int) -> int:
        """Pages of the gathered prefill buffer: ``pages``, or a power of 2 (static shapes)."""
        return pow2_at_least(pages) if self.static_shapes else pages

    def gathered_phys_to_logical(self, pages: int) -> torch.Tensor:
        """The gathered buffer's page -> logical column map, ``[pages]`` int32 (persistent)."""
        if self._g_ptl.numel() < pages:
            self._g_ptl = torch.zeros(pow2_at_least(pages), dtype=torch.int32, device=self.device)
        return self._g_ptl[:pages]

    def gathered_block_req(self, pages: int) -> torch.Tensor:
        """The gathered buffer's page -> request map, ``[pages]`` int32 (persistent)."""
        if self._g_req.numel() < pages:
            self._g_req = torch.zeros(pow2_at_least(pages), dtype=torch.int32, device=self.device)
        return self._g_req[:pages]

    def gathered_token_buffer(self, tokens: int) -> torch.Tensor:
        """The gathered buffer's physical token list, ``[tokens]`` int64 (persistent)."""
        if self._g_tokens.numel() < tokens:
            self._g_tokens = torch.zeros(
                pow2_at_least(tokens), dtype=torch.long, device=self.device
            )
        return self._g_tokens[:tokens]

    def padded_table(
        self, key: str, seq_lens: torch.Tensor, block_table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq_lens`` ``[max_num_seqs]`` and ``block_table`` ``[max_num_seqs, C]`` (``C`` a
        power of 2 >= 16) holding the batch's rows; rows past them have length 0."""
        r, m = block_table.shape
        sl, bt = self._tables.get(key, (None, None))
        if sl is None or bt is None or bt.shape[1] < m:
            cols = pow2_at_least(max(m, 16))
            sl = torch.zeros(self.max_num_seqs, dtype=torch.int32, device=self.device)
            bt = torch.zeros(self.max_num_seqs, cols, dtype=torch.int32, device=self.device)
            self._tables[key] = (sl, bt)
        sl.zero_()
        sl[:r] = seq_lens
        bt[:r].zero_()
        bt[:r, :m] = block_table
        return sl, bt

    def padded_decode_rows(
        self,
        seq_lens: torch.Tensor,  # [R] int32
        block_table: torch.Tensor,  # [R, M] int32
        pos: torch.Tensor,  # [R] int32
        rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode call's lengths, table and positions padded to ``rows`` batch rows."""
        sl, bt = self.padded_table("decode", seq_lens, block_table)
        r = pos.numel()
        self._dec_pos[:rows].zero_()
        self._dec_pos[:r] = pos
        return sl[:rows], bt[:rows], self._dec_pos[:rows]

    def geometry_for(self, kv_cache_kernel_view: torch.Tensor) -> CacheGeometry:
        return cache_geometry(
            kv_cache_kernel_view, self.options.kv_block_size, self.max_view_elements
        )

    def _layout_geometry(self) -> CacheGeometry:
        # The geometry depends only on the layout; build it from a meta tensor of its strides.
        if self._geometry is None:
            lay = self.layout
            meta = torch.empty_strided(
                (lay.num_blocks, lay.num_kv_heads, lay.block_size, lay.content_size),
                lay.strides[1:],
                device="meta",
            )
            view, _ = kernel_block_view(meta, lay, self.n)
            self._geometry = self.geometry_for(view)
        return self._geometry

    def _used_blocks(
        self, base: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel block ids this batch reads, their logical positions and the request
        reading each (``[U]`` each; a shared block comes once per request),
        checked against the cache: an id outside ``[0, num_kernel_blocks)`` would index the
        physical->logical table out of bounds (or, negative, silently wrap).

        Only the columns a query of the batch can see are mapped: from the first new token's
        window start (sliding window) to the last context block, and nothing of a request
        without queries. A block manager leaves the columns before a request's window holding
        the null block (at many columns of many rows) or an id the pool has since handed to
        another request; mapping those would put one block at two positions."""
        bt = base.block_table.long()
        sl = base.seq_lens.long()
        qsl = base.query_start_loc.long()
        q_len = qsl[1:] - qsl[:-1]  # [R]
        hi = torch.where(q_len > 0, (sl + self.n - 1) // self.n, 0)  # [R] exclusive
        lo = torch.zeros_like(hi)
        w = self.config.sliding_window
        if w is not None:
            # The first new token sits at seq_len - query_len; it sees keys from w - 1 back.
            lo = (sl - q_len - w + 1).clamp(min=0) // self.n
        cols = torch.arange(bt.shape[1], device=bt.device)
        used = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])  # [R, M]
        phys, logical = bt[used], cols.expand_as(bt)[used]
        req = torch.arange(bt.shape[0], device=bt.device)[:, None].expand_as(bt)[used]
        if phys.numel():
            # One host sync; this builder syncs once per step anyway (see the module docstring).
            lo_id, hi_id = torch.stack([phys.min(), phys.max()]).tolist()
            if lo_id < 0 or hi_id >= self.num_kernel_blocks:
                bad = lo_id if lo_id < 0 else hi_id
                raise ValueError(
                    f"block_table holds kernel block id {bad} outside [0, {self.num_kernel_blocks}) "
                    f"(the cache has {self.layout.num_blocks} blocks of {self.layout.block_size} "
                    f"tokens = {self.num_kernel_blocks} kernel blocks of {self.n}); fix the "
                    "block table or build the layout with more blocks"
                )
        return phys, logical, req

    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        base = super().build(common)
        opts, geo, cfg = self.options, self._layout_geometry(), self.config
        num_tokens = common.num_actual_tokens
        padded = self.padded_tokens(num_tokens)
        phys, logical, req = self._used_blocks(base)
        decode, served = build_decode_call(self, common, base, geo) if num_tokens else (None, None)
        if self.prefill == "gather":
            return self._metadata(
                base,
                padded,
                opts,
                geo,
                decode,
                self._gathered(base, served, padded, geo, phys, logical),
            )
        ent = build_flex_block_entries(
            query_start_loc=base.query_start_loc,
            seq_lens=base.seq_lens,
            block_table=base.block_table,
            num_tokens=num_tokens,
            n=self.n,
            tpb=geo.tpb,
            q_block_size=opts.q_block_size,
            kv_block_size=opts.kv_block_size,
            causal=cfg.causal,
            sliding_window=cfg.sliding_window,
            exclude_reqs=served,
            logical_order=cfg.batch_invariant,
            full_blocks=self.full_blocks,
        )
        self.write_queries(ent.q_req, ent.q_pos, padded)
        # physical -> logical for the blocks of this batch only (O(blocks in the batch)).
        self.phys_to_logical[phys] = logical.int()
        conflict = (self.phys_to_logical[phys].long() != logical).any()
        if self.static_shapes:
            seq_lens, table = self.padded_table("flat", base.seq_lens, base.block_table)
        else:
            seq_lens, table = base.seq_lens, base.block_table
        masks = MaskInputs(seq_lens, table, self.phys_to_logical, self.n)
        if self.owner_mask:
            masks = self._owner_masks(base, ent, served, padded, phys, logical, req, masks)
        windows = build_windows(self, padded, geo, ent, conflict, masks, full=self.full_blocks)
        return self._metadata(base, padded, opts, geo, decode, windows)

    def _owner_masks(
        self,
        base: AttentionMetadata,
        ent: FlexEntries,
        served: torch.Tensor | None,  # [R] bool, requests the decode call serves
        padded: int,
        phys: torch.Tensor,  # [U] blocks the batch reads, their logical columns and requests
        logical: torch.Tensor,
        req: torch.Tensor,
        masks: MaskInputs,
    ) -> MaskInputs:
        """The span mask's inputs (span.py) where its keys fit int32, else the owner mask's;
        either is exact unless a block has two users among the flattened call's requests
        (``owner_ok``). Decode requests, served by their own call, do not count: their blocks
        read as no request's."""
        if served is not None:
            keep = ~served[req]
            phys, logical, req = phys[keep], logical[keep], req[keep]
        stride = None
        if self.span_mask:
            stride = span_stride(
                base.block_table.shape[1],
                self.n,
                int(base.max_seq_len),
                base.num_reqs,
                self._layout_geometry().tpb,
            )
        if stride is None:
            self.block_req[self._owned] = -1
            self.block_req[phys] = req.int()
            self._owned = phys
            shared = (self.block_req[phys].long() != req).any()
            return dataclasses.replace(masks, block_req=self.block_req, owner_ok=~shared)
        key = req * stride + logical * self.n
        self.block_key[self._keyed] = SPAN_NO_KEY
        self.block_key[phys] = key.int()
        self._keyed = phys
        shared = (self.block_key[phys].long() != key).any()
        offset = torch.arange(base.num_reqs, device=key.device) * stride
        lo, hi = write_row_spans(
            self.row_lo,
            self.row_hi,
            ent.q_req,
            ent.q_pos,
            base.seq_lens,
            offset,
            None if served is None else ~served,
            padded,
            causal=self.config.causal,
            sliding_window=self.config.sliding_window,
        )
        span = SpanInputs(lo, hi, self.block_key)
        return dataclasses.replace(masks, owner_ok=~shared, span=span)

    def write_queries(self, q_req: torch.Tensor, q_pos: torch.Tensor, padded: int) -> None:
        """Per query row its request and position; padding rows: request 0 at a position no
        causal key is <= (non-causal layers let them attend; their rows are dropped either
        way, and rows never affect each other)."""
        t = q_req.numel()
        self.q_req[:t] = q_req
        self.q_pos[:t] = q_pos
        self.q_req[t:padded] = 0
        self.q_pos[t:padded] = -(2**30)

    def _gathered(
        self,
        base: AttentionMetadata,
        served: torch.Tensor | None,
        padded: int,
        geo: CacheGeometry,
        phys: torch.Tensor,
        logical: torch.Tensor,
    ) -> tuple[FlexWindow, ...]:
        # The decode call still reads the paged cache through the physical -> logical map.
        self.phys_to_logical[phys] = logical.int()
        if bool((self.phys_to_logical[phys].long() != logical).any()):
            raise ValueError(
                "a physical block appears at two different logical positions in this batch; the "
                "Flex backend's physical->logical table needs one position per block per step"
            )
        return build_gathered_window(self, base, served, padded, geo)

    def _metadata(
        self,
        base: AttentionMetadata,
        padded: int,
        opts: FlexOptions,
        geo: CacheGeometry,
        decode: FlexDecode | None,
        windows: tuple[FlexWindow, ...],
    ) -> FlexAttentionMetadata:
        num_tokens = base.num_actual_tokens
        return FlexAttentionMetadata(
            query_start_loc=base.query_start_loc,
            seq_lens=base.seq_lens,
            block_table=base.block_table,
            slot_mapping=base.slot_mapping,
            max_query_len=base.max_query_len,
            max_seq_len=base.max_seq_len,
            num_actual_tokens=num_tokens,
            num_reqs=base.num_reqs,
            query_start_loc_cpu=base.query_start_loc_cpu,
            seq_lens_cpu=base.seq_lens_cpu,
            q_req=self.q_req[:padded],
            q_pos=self.q_pos[:padded],
            phys_to_logical=self.phys_to_logical,
            windows=windows,
            tpb=geo.tpb,
            options=opts,
            decode=decode,
            padded_tokens=padded,
            static_shapes=self.static_shapes,
        )

    def grow_index_buffer(
        self, name: str, cols: int, *, kv_len: int = 0, kv_block: int = 0
    ) -> None:
        """Widen the persistent index buffer ``name`` to hold ``cols`` columns (powers of 2).

        On the CPU also to ``kv_len / kv_block`` columns: inductor's C++ Flex template refuses a
        block mask narrower than the K/V view it is called with ("KV seqlen must be smaller than
        the block_mask size"), which a call over a large cache window with few tiles per row
        would be."""
        if self.device.type == "cpu" and kv_block:
            cols = max(cols, -(-kv_len // kv_block))
        buf = getattr(self, name)
        if cols > buf.shape[1]:
            grown = 1 << (cols - 1).bit_length()
            setattr(self, name, buf.new_zeros(buf.shape[0], grown))
