"""TORCH_SDPA's step plan: what every layer of one step shares, made once per step.

A step's requests grouped by padded shape (:class:`_StepPlan`, found by :func:`_step_plan` on the
step's :class:`TorchSDPAMetadata`), each group's cache-block rows checked against the cache
(:func:`_block_rows`), and per causal and window rule its masks, per cache geometry its K/V row
index: where the row gather (:func:`kv_row_offsets`, :func:`kv_row_index`,
:func:`kv_row_array`) finds every token's K and V in a cache viewed as ``D``-element rows.
Split out of ``torch_sdpa.py`` by job (the plan here, the attention that reads it there);
:mod:`kv_backends.backends.torch_sdpa` re-exports the public names, their public home.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from kv_spec import KVCacheLayout

from kv_backends.backends._torch_ops import (
    PaddedMask,
    batch_columns,
    decode_masks,
    group_by_padded_shape,
    padded_groups,
    padded_mask,
)
from kv_backends.backends.torch_sdpa_decode import DecodeRun
from kv_backends.base import AttentionMetadata

__all__ = ["TorchSDPAMetadata", "kv_row_array", "kv_row_index", "kv_row_offsets"]


# -- the row gather's index: K/V rows of one layer view, addressed by strides only -------------


def kv_row_offsets(
    kv_cache: torch.Tensor, layout: KVCacheLayout
) -> tuple[int, torch.Tensor] | None:
    """``(rows_per_block, offsets)`` of :func:`kv_row_index`: token ``(b, h, n)``'s K row is
    ``b * rows_per_block + offsets[0, 0, h, 0, n]`` and its V row the same with ``offsets[1]``
    (``offsets`` int64 ``[2, 1, H, 1, N]``), so a batch's index is one broadcast add; ``None``
    where the cache is not a row array of ``D``-element rows."""
    k0, k1 = layout.k_range
    if layout.v_range is None or layout.v_range[1] - layout.v_range[0] != k1 - k0:
        return None
    d = k1 - k0
    sb, sh, sn, sc = kv_cache.stride()
    v_off = layout.v_range[0] - k0
    if sc != 1 or any(x % d for x in (sb, sh, sn, v_off)):
        return None
    _, h, n, _ = kv_cache.shape
    offsets = [
        kv + i * (sh // d) + j * (sn // d)
        for kv in (0, v_off // d)
        for i in range(h)
        for j in range(n)
    ]
    return sb // d, torch.tensor(offsets, device=kv_cache.device).view(2, 1, h, 1, n)


def kv_row_index(
    kv_cache: torch.Tensor, rows: torch.Tensor, layout: KVCacheLayout
) -> torch.Tensor | None:
    """Where :func:`gather_kv_rows` finds the padded contexts of ``rows`` ``[G, nblk]``: int64
    ``[2, G, H, nblk, N]``, the row of :func:`kv_row_array` holding each token's K, then its V,
    counted from the K range: token ``(b, h, n)`` is row ``(b * sb + h * sh + n * sn) / D``.
    ``None`` where the cache is not such a row array: V not as wide as K, or a stride (or V's
    offset from K) that is not a multiple of ``D``. The index depends on the strides only, so
    every layer view of one storage shares it."""
    geometry = kv_row_offsets(kv_cache, layout)
    if geometry is None:
        return None
    per_block, offsets = geometry
    return rows.long()[None, :, None, :, None] * per_block + offsets  # [2, G, H, nblk, N]


def kv_row_array(kv_cache: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """``kv_cache`` ``[B, H, N, C]`` as the ``[num_rows, D]`` row array :func:`kv_row_index`
    counts in (a view from the K range's start)."""
    b, h, n, _ = kv_cache.shape
    sb, sh, sn, _ = kv_cache.stride()
    k0, k1 = layout.k_range
    assert layout.v_range is not None
    last = (b - 1) * sb + (h - 1) * sh + (n - 1) * sn + layout.v_range[0] - k0  # last V's start
    d = k1 - k0
    return kv_cache.as_strided((last // d + 1, d), (d, 1), kv_cache.storage_offset() + k0)


class _StepPlan:
    """What every layer of one step shares: the request groups, their gather rows and (per causal
    and window rule, per cache geometry) their masks and K/V row indices. Made by the first layer
    that sees a step's metadata and kept on that metadata object (per-batch facts live on
    metadata instances, not in module state); ``key`` pins the block table's in-place version and
    the cache geometry, so a table edited in place never reuses a stale plan.

    Every per-request tensor is a view of one batch-wide tensor (requests in group order): a
    plan costs a fixed handful of ops, not a handful per group, since it is rebuilt every step.
    """

    def __init__(
        self,
        key: tuple[object, ...],
        metadata: AttentionMetadata,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.key = key
        qsl = (
            metadata.query_start_loc_cpu
            if metadata.query_start_loc_cpu is not None
            else metadata.query_start_loc.cpu()
        ).tolist()[: metadata.num_reqs + 1]
        seq_lens = (
            metadata.seq_lens_cpu if metadata.seq_lens_cpu is not None else metadata.seq_lens.cpu()
        ).tolist()[: metadata.num_reqs]
        # On the CPU, torch's bmm and SDPA pick their kernel per matrix shape, so a group's batch
        # size cannot change a request's bits (test_torch_sdpa_batched.py checks it). cuBLAS
        # heuristics also weigh the batch count (split-K among them), so elsewhere each request
        # keeps a call of its own, as before batching: invariant by construction, slower, and
        # TORCH_SDPA is not the GPU's fast path.
        shapes = group_by_padded_shape(
            qsl, seq_lens, block_size, one_request_per_group=device.type != "cpu"
        )
        columns = batch_columns(shapes, qsl, seq_lens, device)  # [4, R'], requests in group order
        self.groups = padded_groups(shapes, columns)
        self.bounds: list[tuple[int, int]] = []  # per group, its requests' range in ``columns``
        for _, _, reqs in shapes:
            g0 = self.bounds[-1][1] if self.bounds else 0
            self.bounds.append((g0, g0 + len(reqs)))
        self.num_rows = qsl[-1]  # query rows [0, num_rows) belong to some group
        # Only requests with query rows read their pages (as before batching: an idle row may be
        # stale), so only theirs are checked.
        width = max((sb // block_size for _, sb, _ in shapes), default=0)
        grouped_seq = [seq_lens[r] for _, _, reqs in shapes for r in reqs]
        self.table_rows = _block_rows(
            metadata.block_table, columns[0], grouped_seq, width, num_blocks, block_size
        )  # [R', width]
        self.rows = [  # per group, [G, nblk] int64 (views)
            self.table_rows[g0:g1, : g.seq_len // block_size]
            for g, (g0, g1) in zip(self.groups, self.bounds, strict=True)
        ]
        # per group, the query rows flat ([G] for a decode group, [G*Lb] for the rest)
        self.q_rows = [g.q_index.view(-1) for g in self.groups]
        # Decode groups sort first (Lb = 1); their query rows, in group order, let a layer
        # select all decode queries and place all their outputs with one op each.
        self.num_decode_groups = sum(lb == 1 for lb, _, _ in shapes)
        # per group: is every request's query its whole context (a fresh prompt), from the host
        self.whole_prompts = [
            all(qsl[r + 1] - qsl[r] == seq_lens[r] for r in reqs) for _, _, reqs in shapes
        ]
        num_decode = sum(len(reqs) for lb, _, reqs in shapes if lb == 1)
        self.decode_rows = columns[1, :num_decode]  # [R_decode]
        self.decode_seq_lens = columns[3, :num_decode]  # [R_decode]
        self.masks: dict[tuple[bool, int | None, int, int], list[PaddedMask]] = {}
        # per cache geometry: each group's row index (views of one flat index, group after
        # group, so one index_select gathers every group's K/V), or None (page gather)
        self.kv_rows: dict[tuple[object, ...], list[torch.Tensor] | None] = {}
        self.kv_index: dict[tuple[object, ...], torch.Tensor] = {}
        self.placements: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # per (geometry, mask rule, head size): the decode-only step's buffers and views
        self.decode_runs: dict[tuple[object, ...], DecodeRun] = {}
        self.table_copy: torch.Tensor | None = None  # (an inference-tensor table's, see _step_plan)

    def placement(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group ``i``'s (a prefill group's) real padded query rows, as the request and query
        indices ``[real rows]`` of each in ``[G, Lb]``, and the output rows they fill: found once
        per step (one ``nonzero``) and shared by the layers, each of which then places its
        output with one gather and one ``index_copy_``."""
        if i not in self.placements:
            group = self.groups[i]
            src_g, src_l = group.q_valid.nonzero().unbind(1)  # [real rows] each
            self.placements[i] = (src_g, src_l, group.q_index[src_g, src_l])
        return self.placements[i]

    def masks_for(
        self, causal: bool, sliding_window: int | None, num_kv_heads: int, q_per_kv: int
    ) -> list[PaddedMask]:
        rule = (causal, sliding_window, num_kv_heads, q_per_kv)
        masks = self.masks.get(rule)
        if masks is None:
            nd = self.num_decode_groups
            decode = [(g.reqs.numel(), g.seq_len) for g in self.groups[:nd]]
            masks = self.masks[rule] = (
                decode_masks(self.decode_seq_lens, decode, *rule[1:]) if decode else []
            ) + [
                padded_mask(g, *rule, whole_prompts=whole)
                for g, whole in zip(self.groups[nd:], self.whole_prompts[nd:], strict=True)
            ]
        return masks

    def kv_rows_for(
        self, geometry: tuple[object, ...], offsets: tuple[int, torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        """Per group, :func:`kv_row_index` flattened for the cache geometry ``geometry`` whose
        :func:`kv_row_offsets` are ``offsets`` (``None``: not a row array, gather pages
        instead); layer views of one storage share a geometry, so a step computes it once: one
        multiply for the batch and one broadcast add per group, each written into its slice of
        one flat index (:attr:`kv_index`), groups in order."""
        if geometry not in self.kv_rows:
            if offsets is None:
                self.kv_rows[geometry] = None
            else:
                per_block, token = offsets  # token: [2, 1, H, 1, N]
                # [1, R', 1, width, 1]: each block's first K row
                first = (self.table_rows * per_block)[None, :, None, :, None]
                sizes = [token.numel() * rows.numel() for rows in self.rows]
                flat = torch.empty(sum(sizes), dtype=torch.int64, device=token.device)
                views = list(flat.split(sizes)) if len(sizes) > 1 else [flat]
                for view, rows, (g0, g1) in zip(views, self.rows, self.bounds, strict=True):
                    torch.add(
                        first[:, g0:g1, :, : rows.shape[1]],
                        token,
                        out=view.view(2, g1 - g0, token.shape[2], rows.shape[1], token.shape[4]),
                    )  # [2, G, H, nblk, N]
                self.kv_rows[geometry] = views  # per group [2 * G * H * nblk * N]
                self.kv_index[geometry] = flat
        return self.kv_rows[geometry]


@dataclass(frozen=True, kw_only=True)
class TorchSDPAMetadata(AttentionMetadata):
    """:class:`AttentionMetadata` plus the step's plans, built once and shared by the group's
    layers (keyed by cache geometry; not part of equality)."""

    plans: dict[tuple[object, ...], _StepPlan] = field(
        default_factory=dict, compare=False, repr=False
    )


def _step_plan(
    metadata: AttentionMetadata, num_blocks: int, block_size: int, device: torch.device
) -> _StepPlan:
    table = metadata.block_table
    # An inference tensor (torch.inference_mode) has no version counter: its plan is kept
    # with a copy of the table, and reused while the table still equals it.
    inference = table.is_inference()
    key = (None if inference else table._version, num_blocks, block_size, device)
    plans = metadata.plans if isinstance(metadata, TorchSDPAMetadata) else {}
    plan = plans.get(key)
    if (
        plan is not None
        and inference
        and (plan.table_copy is None or not torch.equal(plan.table_copy, table))
    ):
        plan = None
    if plan is None:
        plan = plans[key] = _StepPlan(key, metadata, num_blocks, block_size, device)
        if inference:
            plan.table_copy = table.clone()
    return plan


def _block_rows(
    block_table: torch.Tensor,
    reqs: torch.Tensor,
    seq_lens: list[int],
    width: int,
    num_blocks: int,
    block_size: int,
) -> torch.Tensor:
    """int64 ``[R', width]``: the first ``width`` cache blocks of requests ``reqs`` ``[R']``
    (device) whose contexts are ``seq_lens`` (host, one per request of ``reqs``). Blocks past a
    request's context read block 0: they are masked, and a real block keeps the index in range.
    Raises unless every block a context needs is in its row and inside the cache (one host sync
    for the whole batch)."""
    need = [-(-s // block_size) for s in seq_lens]
    widest = max(need, default=0)
    if widest > block_table.shape[1]:
        i = need.index(widest)
        raise ValueError(
            f"request {int(reqs[i])}: seq_len={seq_lens[i]} needs {widest} blocks of {block_size} "
            f"tokens but block_table has {block_table.shape[1]} columns; widen the block table"
        )
    rows = block_table[:, :width].index_select(0, reqs).long()  # [R', <= width]
    if rows.shape[1] < width:  # the padded length may reach past the table's last column
        rows = F.pad(rows, (0, width - rows.shape[1]))
    need_t = torch.frombuffer(array("q", need), dtype=torch.int64) if need else torch.empty(0)
    past = (
        torch.arange(width, device=rows.device)[None, :]
        >= need_t.to(device=rows.device, dtype=torch.int64)[:, None]
    )  # [R', width]
    rows = rows.masked_fill_(past, 0)
    if rows.numel():
        lo, hi = torch.aminmax(rows)  # one reduction, one sync
        if int(lo) < 0 or int(hi) >= num_blocks:
            bad = rows[(rows < 0) | (rows >= num_blocks)]
            raise ValueError(
                f"block table references block {int(bad[0])} outside [0, {num_blocks}); "
                "every block a request's context covers must be a real cache block"
            )
    return rows
