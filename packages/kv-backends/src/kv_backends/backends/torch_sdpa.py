"""TORCH_SDPA: gathers the batch's pages and runs torch attention in float32.

The CPU default and the reference the other backends are read against: no tiling, no custom
kernels, so a reader can check it by eye. Requests are grouped by padded shape (a function of each
request's own query and context length, ``_torch_ops.padded_length``) and every group is one
gather and one attention call, instead of one of each per request per layer, which on small models
was most of a decode step. Prefill groups go through ``torch.nn.functional.
scaled_dot_product_attention``; decodes, sinks and softcap (which SDPA cannot take) through an
explicit ``bmm`` softmax with the sink as an extra logit column. Because a request's padded shape
never depends on its neighbours and each op computes batch elements independently, the output stays
bitwise batch invariant (``batch_invariant=True``; see ``_torch_ops`` for why decodes avoid SDPA).
Off the CPU each request keeps its own call (same padded shapes): cuBLAS picks kernels by batch
count too, and TORCH_SDPA is not the GPU's fast path.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from kv_spec import KVCacheLayout

from kv_backends.backends._torch_ops import (
    PaddedMask,
    attend_decode,
    attend_padded,
    batch_columns,
    decode_masks,
    gather_kv_rows,
    gather_padded_kv,
    group_by_padded_shape,
    padded_groups,
    padded_mask,
    split_kv_rows,
    write_kv_slots,
)
from kv_backends.backends.torch_sdpa_decode import DecodeRun
from kv_backends.backends.torch_sdpa_kept import KeptGather, cache_ledger, gather_kept
from kv_backends.backends.torch_sdpa_mla import attend_latent, latent_rank
from kv_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata, MetadataBuilder
from kv_backends.capabilities import BackendCapabilities
from kv_backends.config import AttentionConfig, Platform
from kv_backends.metadata import CommonAttentionMetadata

__all__ = [
    "TorchSDPABackend",
    "TorchSDPABuilder",
    "TorchSDPAImpl",
    "TorchSDPAMetadata",
    "kv_row_array",
    "kv_row_index",
    "kv_row_offsets",
]


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
        # per (geometry, previous index, slots): torch_sdpa_kept.refresh_rows's answer
        self.refreshes: dict[tuple[object, ...], tuple[object, ...]] = {}

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


class TorchSDPABuilder(MetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        md = super().build(common)
        # The frozen dataclass's fields are its instance dict (cheaper than dataclasses.fields).
        return TorchSDPAMetadata(**vars(md))


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


class TorchSDPAImpl(AttentionImpl):
    """Per-layer TORCH_SDPA attention (float32 math, output cast to the query dtype).

    ``keep_decode_gather_bytes=N`` (0, off, by default): on the CPU, each layer keeps its decode
    step's gathered K/V, when that buffer takes at most ``N`` bytes, and regathers only the rows
    that changed by the next decode step (a larger step gathers into the shared buffer and the
    layer keeps nothing). The caller must report cache writes that bypass torch's version
    counter (raw pointers, NIXL, numpy views) with ``torch.autograd.graph.increment_version``;
    :mod:`.torch_sdpa_kept` says why.

    MLA layers (``config.mla`` over an ``MLAAttentionSpec`` layout) take ``kv_lora_rank``
    (default :func:`~kv_backends.backends.triton_mla.default_kv_lora_rank`) and TRITON_MLA's
    contract: the latent row written once (``value=None``), absorbed queries, output ``[T, Hq,
    kv_lora_rank]`` (:mod:`.torch_sdpa_mla`). They keep no decode gather (the option is taken and
    ignored, so an engine passes the same options to every layer).
    """

    def __init__(
        self,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        keep_decode_gather_bytes: int = 0,
        kv_lora_rank: int | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(config, layout, **kw)
        #: MLA: the latent width V reads (the output width); ``None`` on K/V layers
        self.kv_lora_rank = latent_rank(config, layout, kv_lora_rank)
        if self.kv_lora_rank is not None:
            self.head_size_v = self.kv_lora_rank
        limit = keep_decode_gather_bytes
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise TypeError(
                f"TORCH_SDPA keep_decode_gather_bytes={limit!r} must be an int >= 0: the largest "
                "decode gather (bytes) a layer keeps between steps on the CPU, 0 to keep none"
            )
        self.keep_decode_gather_bytes = 0 if self.kv_lora_rank is not None else limit
        #: this layer's decode gather of its last step, when kept (:mod:`.torch_sdpa_kept`)
        self.kept_gather: KeptGather | None = None

    def _kv_row_offsets(
        self, cache: torch.Tensor, layout: KVCacheLayout
    ) -> tuple[tuple[object, ...], tuple[int, torch.Tensor] | None]:
        """``(geometry, kv_row_offsets(cache, layout))``, made once per cache geometry (a fact
        of the layout and strides, the same every step)."""
        geometry = (cache.shape, cache.stride(), layout.k_range, layout.v_range, cache.device)
        known: dict[tuple[object, ...], tuple[int, torch.Tensor] | None]
        known = self.__dict__.setdefault("_row_offsets", {})
        if geometry not in known:
            known[geometry] = kv_row_offsets(cache, layout)
        return geometry, known[geometry]

    def _row_array(self, cache: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
        """:func:`kv_row_array` of ``cache``, kept while the same tensor object views the same
        memory with the same strides (the runner hands each layer the same view every step)."""
        kept = self.__dict__.get("_rows_of")
        key = (cache.data_ptr(), cache.stride())
        if kept is None or kept[0] is not cache or kept[1] != key:
            kept = self.__dict__["_rows_of"] = (cache, key, kv_row_array(cache, layout))
        return kept[2]

    def _decode_only(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        plan: _StepPlan,
        metadata: AttentionMetadata,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
    ) -> bool:
        """Whether this layer's step takes :class:`DecodeRun`: every request one query row and
        every row of ``q`` one request's, float32 query and cache, no sinks, softcap, ALiBi or
        K/V scales (the general path handles all of those)."""
        return (
            plan.num_decode_groups == len(plan.groups)
            and q.shape[0] == plan.num_rows <= metadata.num_actual_tokens
            and q.dtype == torch.float32
            and cache.dtype == torch.float32
            and k_scale is None
            and v_scale is None
            and self.sinks is None
            and not self.softcap
            and self.alibi_slopes is None
        )

    def cache_write_impl(self) -> str:
        # The reference backend writes with the torch reference on every device, so it stays an
        # oracle that shares no Triton code with the backends it checks.
        return "reference"

    def do_kv_cache_update(
        self,
        layer: object,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """The reference write; on the CPU, an unquantized batch with no padding slots goes
        through :func:`~kv_backends.backends._torch_ops.write_kv_slots` instead: the same bytes
        in one ``index_copy_``, where the reference's checks and two index writes cost more than
        the copy on a decode step (kvstack's engine benchmark, 32 requests x 32 tokens, one
        thread: 19 ms of cache writes became 8). GPUs keep the reference: there it is the oracle
        the Triton and Flex writes are held to. An MLA layer writes its latent rows ``key``
        ``[T, 1, kv_lora_rank + rope]`` with ``value=None`` through the reference."""
        self.check_cache(kv_cache)
        if self.kv_lora_rank is not None:
            if value is not None:
                raise ValueError(
                    "TORCH_SDPA on an MLA layer stores one latent row per token: pass the latent "
                    "as key and value=None (V is the latent's first kv_lora_rank columns)"
                )
            super().do_kv_cache_update(layer, key, None, kv_cache, slot_mapping)
            return
        if kv_cache.device.type != "cpu":
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            return
        # With a kept decode gather the ledger sees the write, so the layer's next gather
        # knows which slots it touched (see torch_sdpa_kept).
        ledger = cache_ledger(kv_cache) if self.keep_decode_gather_bytes else None
        if ledger is not None:
            ledger.sync(kv_cache)
        if not (
            value is not None
            and slot_mapping.numel()
            and write_kv_slots(key, value, kv_cache, slot_mapping, self.layout)
        ):
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if ledger is not None:
            ledger.wrote(kv_cache, slot_mapping)

    def forward(
        self,
        layer: object,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.check_forward_inputs(q, kv_cache, metadata)
        cache, klayout = self.kernel_cache(kv_cache)  # [B*k, H, kbs, C]
        params = self.device_params(q.device)
        if self.kv_lora_rank is not None:
            return attend_latent(
                q, cache, klayout, metadata, kv_lora_rank=self.kv_lora_rank, scale=self.scale,
                causal=self.causal, sliding_window=self.sliding_window, softcap=self.softcap,
                params=params, out=self.empty_output(q, out, zeroed=False),
            )  # fmt: skip  # [T, Hq, kv_lora_rank]
        k_scale, v_scale = self.scales(layer, q.device)
        plan = _step_plan(metadata, cache.shape[0], klayout.block_size, q.device)
        # Every query row below plan.num_rows is written by its group, so only the rest is
        # cleared below (no zero fill of the whole output first).
        result = self.empty_output(q, out, zeroed=False)
        num_kv_heads = cache.shape[1]
        masks = plan.masks_for(
            self.causal, self.sliding_window, num_kv_heads, self.num_q_heads // num_kv_heads
        )
        geometry, offsets = self._kv_row_offsets(cache, klayout)
        kv_rows = plan.kv_rows_for(geometry, offsets)
        if kv_rows is not None and self._decode_only(q, cache, plan, metadata, k_scale, v_scale):
            rule = (geometry, self.causal, self.sliding_window, num_kv_heads, self.head_size)
            run = plan.decode_runs.get(rule)
            if run is None:
                run = plan.decode_runs[rule] = DecodeRun(
                    plan, plan.kv_index[geometry].numel(), masks, num_kv_heads,
                    self.num_q_heads // num_kv_heads, self.head_size, q.device,
                )  # fmt: skip
            if out is not None:
                self.empty_output(q, out)  # checks its shape and dtype
            row_array = self._row_array(cache, klayout)
            index = plan.kv_index[geometry]  # [rows]
            if q.device.type == "cpu" and self.keep_decode_gather_bytes:
                kept = None  # over the budget, or nothing provable: keep nothing
                if index.numel() * self.head_size * 4 <= self.keep_decode_gather_bytes:
                    assert offsets is not None
                    kept = gather_kept(
                        self.kept_gather, kv_cache, row_array, index, plan, geometry, offsets,
                        metadata.slot_mapping, run.new_buffer,
                    )  # fmt: skip
                self.kept_gather = kept
                if kept is not None:
                    return run.attend(kept.buffer, q, self.scale, out, kept=kept)
            buffer = torch.index_select(row_array, 0, index, out=run.shared_buffer())
            return run.attend(buffer, q, self.scale, out)
        gathered, start = None, 0
        if kv_rows is not None:
            # Every group's K/V rows in one index_select (group after group, each group's K
            # rows then its V rows): one gather per layer, not one per group.
            gathered = gather_kv_rows(self._row_array(cache, klayout), plan.kv_index[geometry])
        # Decode groups come first: their queries are selected, and their outputs placed, with
        # one op each for all of them (the groups read and write slices in between).
        num_decode = plan.decode_rows.numel()
        if num_decode:
            q_dec = q.index_select(0, plan.decode_rows)  # [R_decode, Hq, D]
            o_dec = torch.empty(num_decode, *result.shape[1:], dtype=torch.float32, device=q.device)
        for i, (group, (g0, g1), mask) in enumerate(
            zip(plan.groups, plan.bounds, masks, strict=True)
        ):
            if gathered is not None:
                assert kv_rows is not None
                n = kv_rows[i].numel()
                k, v = split_kv_rows(
                    gathered[start : start + n], (g1 - g0, num_kv_heads, group.seq_len),
                    self.head_size, k_scale, v_scale,
                )  # fmt: skip  # [G, H, Sb, D] each
                start += n
            else:
                k, v = gather_padded_kv(
                    cache, plan.rows[i], klayout, k_scale, v_scale
                )  # [G, H, Sb, D|Dv]
            if group.query_len == 1:  # decode: every row is real, no query-length axis
                attend_decode(
                    q_dec[g0:g1], k, v, mask, scale=self.scale, sinks=params.sinks,
                    softcap=self.softcap, alibi_slopes=params.alibi_slopes, out=o_dec[g0:g1],
                )  # fmt: skip  # [G, Hq, Dv]
                continue
            qg = q.index_select(0, plan.q_rows[i])  # [G*Lb, Hq, D]
            o = attend_padded(
                qg.view(*group.q_index.shape, *q.shape[1:]), k, v, mask, scale=self.scale,
                sinks=params.sinks, softcap=self.softcap, alibi_slopes=params.alibi_slopes,
            )  # fmt: skip  # [G, Lb, Hq, Dv]
            # the real rows of o ([G, Lb] positions, read through its strides), and their rows
            src_g, src_l, dst = plan.placement(i)
            real = o[src_g, src_l]  # [real rows, Hq, Dv]
            result.index_copy_(
                0, dst, real if real.dtype == result.dtype else real.to(result.dtype)
            )
        if num_decode:
            result.index_copy_(
                0,
                plan.decode_rows,
                o_dec if o_dec.dtype == result.dtype else o_dec.to(result.dtype),
            )
        tail = min(plan.num_rows, metadata.num_actual_tokens)
        if q.shape[0] > tail:
            result[tail:] = 0
        return result


class TorchSDPABackend(AttentionBackend):
    NAME: ClassVar[str] = "TORCH_SDPA"
    CAPABILITIES: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=("float32", "float16", "bfloat16"),
        kv_cache_dtypes=("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"),
        kv_quant_modes=("none", "fp8_per_tensor"),
        head_size_rule=(1, 1024, 1),
        supports_head_size_v_diff=True,
        kernel_block_size_multiple_of=1,
        supported_layouts=("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"),
        sinks=True,
        sliding_window=True,
        softcap=True,
        alibi=True,
        mla=True,
        non_causal=True,
        batch_invariant=True,
        cudagraph_support="never",
        needs_gpu=False,
        notes="Reference: gathers pages in padded per-request shapes (one gather and one attention call per shape group), float32 math; MLA absorbed over the latent cache through kv-kernels' paged_attention reference (unquantized latents); CPU default and test oracle.",
    )
    builder_cls = TorchSDPABuilder
    impl_cls = TorchSDPAImpl

    @classmethod
    def validate(
        cls,
        config: AttentionConfig,
        platform: Platform | None = None,
        *,
        layout: KVCacheLayout | None = None,
    ) -> list[str]:
        reasons = super().validate(config, platform, layout=layout)
        if config.mla and config.kv_quant != "none":
            # kv-kernels' paged_attention reads MLA latents unquantized only
            reasons.append(f"MLA latent with kv_quant {config.kv_quant} not supported (none only)")
        return reasons

    @classmethod
    def engine_impl_options(
        cls, *, device: torch.device, kv_cache_bytes: int, num_layers: int
    ) -> dict[str, Any]:
        """On the CPU, each layer keeps its decode gather between steps
        (``keep_decode_gather_bytes``, :mod:`.torch_sdpa_kept`; safe because the engine reports
        external writes), up to a quarter of the KV cache's bytes over all layers and at least
        1 MiB a layer: the kept float32 copies must not double the memory the engine planned."""
        if torch.device(device).type != "cpu":
            return {}
        return {"keep_decode_gather_bytes": max(kv_cache_bytes // (4 * max(num_layers, 1)), 2**20)}
