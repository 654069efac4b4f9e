"""FLEX_ATTENTION's per-batch metadata and the builder that owns its persistent index buffers.

``q_req`` / ``q_pos`` / ``kv_num_blocks`` / ``kv_indices`` are allocated once per builder and
sized by ``max_num_batched_tokens`` (query blocks), not by ``max_model_len``; the decode path's
``dec_num_blocks`` / ``dec_indices`` by ``max_num_seqs``; each ``*_indices`` grows its column
count when a batch needs more (outside CUDA-graph capture: this backend does not support graphs,
its builder syncs once per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kv_backends.backends.flex_decode import FlexDecode, build_decode_call
from kv_backends.backends.flex_mask import (
    INT32_LIMIT,
    CacheGeometry,
    FlexOptions,
    build_flex_block_indices,
    cache_geometry,
    make_mask_mod,
)
from kv_backends.base import AttentionMetadata, MetadataBuilder, kernel_block_view
from kv_backends.config import AttentionConfig
from kv_backends.metadata import CommonAttentionMetadata

__all__ = ["FlexAttentionMetadata", "FlexMetadataBuilder", "FlexWindow"]


@dataclass(frozen=True)
class FlexWindow:
    """One flattened Flex call: the cache window it reads and its block mask."""

    base_token: int  # first physical token of the window
    length: int  # physical tokens in the window
    block_mask: Any  # torch BlockMask


@dataclass(frozen=True, kw_only=True)
class FlexAttentionMetadata(AttentionMetadata):
    """Per-batch Flex metadata: the common fields plus per-token lookups, one block mask per
    cache window the flattened call touches (none when every request takes the decode call) and
    the decode call (``None`` when the batch has no decode request or runs flattened)."""

    q_req: torch.Tensor  # [num_tokens] int32
    q_pos: torch.Tensor  # [num_tokens] int32
    phys_to_logical: torch.Tensor  # [num_kernel_blocks] int32, valid for this batch's blocks
    windows: tuple[FlexWindow, ...]
    tpb: int
    options: FlexOptions
    decode: FlexDecode | None = None


class FlexMetadataBuilder(MetadataBuilder):
    """Builds block masks; owns the persistent index buffers of one KV group.

    Options: ``q_block_size``, ``kv_block_size``, ``block_m``, ``block_n`` (see
    :class:`FlexOptions`) and ``max_view_elements`` (window cut, default ``2**31 - 1``; tests
    lower it to exercise the split path on small caches).
    """

    def __init__(
        self,
        config: AttentionConfig,
        layout: Any,
        *,
        device: torch.device,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        q_block_size: int | None = None,
        kv_block_size: int | None = None,
        block_m: int | None = None,
        block_n: int | None = None,
        max_view_elements: int = INT32_LIMIT,
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
        self.options = FlexOptions.resolve(
            self.n,
            batch_invariant=config.batch_invariant,
            q_block_size=q_block_size,
            kv_block_size=kv_block_size,
            block_m=block_m,
            block_n=block_n,
        )
        if max_view_elements > INT32_LIMIT:
            raise ValueError(
                f"max_view_elements={max_view_elements} exceeds 2**31 - 1: Flex templates use 32-bit offsets"
            )
        self.max_view_elements = max_view_elements
        self.num_kernel_blocks = layout.num_blocks * config.kernel_blocks_per_block
        max_q_blocks = -(-max_num_batched_tokens // self.options.q_block_size)
        # Persistent buffers, sized by the batch bound (query blocks), never by max_model_len.
        self.q_req = torch.zeros(max_num_batched_tokens, dtype=torch.int32, device=device)
        self.q_pos = torch.zeros(max_num_batched_tokens, dtype=torch.int32, device=device)
        self.phys_to_logical = torch.zeros(self.num_kernel_blocks, dtype=torch.int32, device=device)
        self.kv_num_blocks = torch.zeros(max_q_blocks, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(max_q_blocks, 64, dtype=torch.int32, device=device)
        # The decode call's rows: one per decode request.
        self.dec_num_blocks = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.dec_indices = torch.zeros(max_num_seqs, 64, dtype=torch.int32, device=device)
        self._geometry: CacheGeometry | None = None

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

    def _used_blocks(self, base: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel block ids this batch reads and their logical positions (``[U]`` each),
        checked against the cache: an id outside ``[0, num_kernel_blocks)`` would index the
        physical->logical table out of bounds (or, negative, silently wrap)."""
        bt = base.block_table.long()
        nblk = (base.seq_lens.long() + self.n - 1) // self.n  # [R]
        cols = torch.arange(bt.shape[1], device=bt.device)
        used = cols[None, :] < nblk[:, None]  # [R, M]
        phys, logical = bt[used], cols.expand_as(bt)[used]
        if phys.numel():
            # One host sync; this builder syncs once per step anyway (see the module docstring).
            lo, hi = torch.stack([phys.min(), phys.max()]).tolist()
            if lo < 0 or hi >= self.num_kernel_blocks:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"block_table holds kernel block id {bad} outside [0, {self.num_kernel_blocks}) "
                    f"(the cache has {self.layout.num_blocks} blocks of {self.layout.block_size} "
                    f"tokens = {self.num_kernel_blocks} kernel blocks of {self.n}); fix the "
                    "block table or build the layout with more blocks"
                )
        return phys, logical

    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        base = super().build(common)
        opts, geo, cfg = self.options, self._layout_geometry(), self.config
        num_tokens = common.num_actual_tokens
        phys, logical = self._used_blocks(base)
        decode, served = build_decode_call(self, common, base, geo) if num_tokens else (None, None)
        q_req, q_pos, e_qb, e_f = build_flex_block_indices(
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
        )
        self.q_req[:num_tokens] = q_req
        self.q_pos[:num_tokens] = q_pos
        # physical -> logical for the blocks of this batch only (O(blocks in the batch)).
        self.phys_to_logical[phys] = logical.int()
        conflict = (self.phys_to_logical[phys].long() != logical).any()
        windows = self._build_windows(base, geo, e_qb, e_f, conflict)
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
            q_req=self.q_req[:num_tokens],
            q_pos=self.q_pos[:num_tokens],
            phys_to_logical=self.phys_to_logical,
            windows=windows,
            tpb=geo.tpb,
            options=opts,
            decode=decode,
        )

    def _build_windows(
        self,
        base: AttentionMetadata,
        geo: CacheGeometry,
        e_qb: torch.Tensor,  # [E] int64 query block of each entry
        e_f: torch.Tensor,  # [E] int64 global Flex KV block of each entry
        conflict: torch.Tensor,  # 0-d bool: a block at two logical positions
    ) -> tuple[FlexWindow, ...]:
        """Cut the entries into cache windows; one block mask per window that holds entries."""
        opts = self.options
        num_tokens = base.num_actual_tokens
        kv_per_window = geo.window_tokens // opts.kv_block_size
        e_w = e_f // kv_per_window
        nqb = -(-num_tokens // opts.q_block_size)
        windows_present = torch.unique(e_w) if e_w.numel() else e_w
        w_list = windows_present.tolist()
        per_qb_w = torch.zeros(
            max(len(w_list), 1), max(nqb, 1), dtype=torch.long, device=e_qb.device
        )
        w_rank = torch.searchsorted(windows_present, e_w) if e_w.numel() else e_w
        per_qb_w.index_put_((w_rank, e_qb), torch.ones_like(e_qb), accumulate=True)
        # One host sync for every count this step needs.
        max_cols, has_conflict = int(per_qb_w.max()), bool(conflict)
        if has_conflict:
            raise ValueError(
                "a physical block appears at two different logical positions in this batch; the "
                "Flex backend's physical->logical table needs one position per block per step"
            )
        if max_cols > self.kv_indices.shape[1]:
            grown = 1 << (max_cols - 1).bit_length()
            self.kv_indices = torch.zeros(
                self.kv_indices.shape[0], grown, dtype=torch.int32, device=self.device
            )
        row_key = w_rank * max(nqb, 1) + e_qb
        windows: list[FlexWindow] = []
        for rank, w in enumerate(w_list):
            sel = w_rank == rank
            num, idx = self._window_rows(
                nqb, e_qb[sel], e_f[sel] - w * kv_per_window, row_key[sel], fresh=rank > 0
            )
            windows.append(self._window(base, geo, w, num, idx))
        return tuple(windows)

    def _window_rows(
        self,
        nqb: int,
        qbs: torch.Tensor,  # [E_w] query block of each entry of this window
        fs: torch.Tensor,  # [E_w] window-relative Flex KV block
        rk: torch.Tensor,  # [E_w] (window, query block) row key, sorted
        *,
        fresh: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_num_blocks`` ``[nqb]`` and ``kv_indices`` ``[nqb, cols]`` of one window."""
        # Position of each entry within its (window, query block) row; entries are sorted by
        # (query block, global KV block), so within one (window, qb) they are contiguous.
        first = torch.ones_like(rk, dtype=torch.bool)
        first[1:] = rk[1:] != rk[:-1]
        ar = torch.arange(rk.numel(), device=rk.device)
        group_start = torch.cummax(torch.where(first, ar, 0), 0).values
        pos = ar - group_start
        num = self.kv_num_blocks[:nqb]
        idx = self.kv_indices[:nqb]
        if fresh:
            # Each window needs its own buffers (the block masks live together in one step).
            num, idx = num.clone(), idx.clone()
        num.zero_()
        num.index_put_((qbs,), torch.ones_like(qbs, dtype=torch.int32), accumulate=True)
        idx.zero_()
        idx[qbs, pos] = fs.int()
        return num, idx

    def _window(
        self,
        base: AttentionMetadata,
        geo: CacheGeometry,
        w: int,
        num: torch.Tensor,
        idx: torch.Tensor,
    ) -> FlexWindow:
        from torch.nn.attention.flex_attention import BlockMask

        opts, cfg = self.options, self.config
        num_tokens = base.num_actual_tokens
        length = geo.window_len(w)
        mask = BlockMask.from_kv_blocks(
            num[None, None],
            idx[None, None],
            BLOCK_SIZE=(opts.q_block_size, opts.kv_block_size),
            mask_mod=make_mask_mod(
                q_req=self.q_req[:num_tokens],
                q_pos=self.q_pos[:num_tokens],
                phys_to_logical=self.phys_to_logical,
                block_table=base.block_table,
                seq_lens=base.seq_lens,
                n=self.n,
                tpb=geo.tpb,
                base_block=w * geo.window_tokens // geo.tpb,
                causal=cfg.causal,
                sliding_window=cfg.sliding_window,
            ),
            seq_lengths=(num_tokens, length),
            compute_q_blocks=False,
        )
        return FlexWindow(w * geo.window_tokens, length, mask)
