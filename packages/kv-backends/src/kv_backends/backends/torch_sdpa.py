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

from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from kv_backends.backends._torch_ops import (
    PaddedGroup,
    PaddedMask,
    attend_decode,
    attend_padded,
    check_block_table,
    gather_padded_kv,
    padded_block_rows,
    padded_mask,
    plan_padded_groups,
    write_kv_slots,
)
from kv_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata, MetadataBuilder
from kv_backends.capabilities import BackendCapabilities
from kv_backends.metadata import CommonAttentionMetadata

__all__ = ["TorchSDPABackend", "TorchSDPABuilder", "TorchSDPAImpl", "TorchSDPAMetadata"]


class _StepPlan:
    """What every layer of one step shares: the request groups, their gather rows and (per causal
    and window rule) their masks. Made by the first layer that sees a step's metadata and kept on
    that metadata object (per-batch facts live on metadata instances, not in module state);
    ``key`` pins the block table's in-place version and the cache geometry, so a table edited in
    place never reuses a stale plan."""

    def __init__(
        self, key: tuple[object, ...], groups: list[PaddedGroup], rows: list[torch.Tensor]
    ) -> None:
        self.key = key
        self.groups = groups
        self.rows = rows  # per group, [G, nblk] int64
        # per group, the query rows flat ([G] for a decode group, [G*Lb] for the rest)
        self.q_rows = [g.q_index.view(-1) for g in groups]
        self.masks: dict[tuple[bool, int | None, int, int], list[PaddedMask]] = {}

    def masks_for(
        self, causal: bool, sliding_window: int | None, num_kv_heads: int, q_per_kv: int
    ) -> list[PaddedMask]:
        rule = (causal, sliding_window, num_kv_heads, q_per_kv)
        if rule not in self.masks:
            self.masks[rule] = [padded_mask(g, *rule) for g in self.groups]
        return self.masks[rule]


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
        return TorchSDPAMetadata(**{f.name: getattr(md, f.name) for f in fields(md)})


def _step_plan(
    metadata: AttentionMetadata, num_blocks: int, block_size: int, device: torch.device
) -> _StepPlan:
    table = metadata.block_table
    key = (table._version, num_blocks, block_size, device)
    plans = metadata.plans if isinstance(metadata, TorchSDPAMetadata) else {}
    plan = plans.get(key)
    if plan is not None:
        return plan
    qsl = (
        metadata.query_start_loc_cpu
        if metadata.query_start_loc_cpu is not None
        else metadata.query_start_loc.cpu()
    ).tolist()[: metadata.num_reqs + 1]
    seq_lens = (
        metadata.seq_lens_cpu if metadata.seq_lens_cpu is not None else metadata.seq_lens.cpu()
    ).tolist()[: metadata.num_reqs]
    # On the CPU, torch's bmm and SDPA pick their kernel per matrix shape, so a group's batch size
    # cannot change a request's bits (test_torch_sdpa_batched.py checks it). cuBLAS heuristics
    # also weigh the batch count (split-K among them), so elsewhere each request keeps a call of
    # its own, as before batching: invariant by construction, slower, and TORCH_SDPA is not the
    # GPU's fast path.
    groups = plan_padded_groups(
        qsl, seq_lens, block_size, device, one_request_per_group=device.type != "cpu"
    )
    # Only requests with query rows read their pages (as before batching: an idle row may be stale).
    read = [s if qsl[r + 1] > qsl[r] else 0 for r, s in enumerate(seq_lens)]
    check_block_table(table, read, num_blocks, block_size)
    rows = [padded_block_rows(table, g, block_size) for g in groups]
    plan = plans[key] = _StepPlan(key, groups, rows)
    return plan


class TorchSDPAImpl(AttentionImpl):
    """Per-layer TORCH_SDPA attention (float32 math, output cast to the query dtype)."""

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
        the Triton and Flex writes are held to."""
        self.check_cache(kv_cache)
        if (
            kv_cache.device.type == "cpu"
            and value is not None
            and slot_mapping.numel()
            and write_kv_slots(key, value, kv_cache, slot_mapping, self.layout)
        ):
            return
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

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
        result = self.empty_output(q, out)
        cache, klayout = self.kernel_cache(kv_cache)  # [B*k, H, kbs, C]
        params = self.device_params(q.device)
        k_scale, v_scale = self.scales(layer, q.device)
        plan = _step_plan(metadata, cache.shape[0], klayout.block_size, q.device)
        num_kv_heads = cache.shape[1]
        masks = plan.masks_for(
            self.causal, self.sliding_window, num_kv_heads, self.num_q_heads // num_kv_heads
        )
        for group, rows, q_rows, mask in zip(
            plan.groups, plan.rows, plan.q_rows, masks, strict=True
        ):
            k, v = gather_padded_kv(cache, rows, klayout, k_scale, v_scale)  # [G, H, Sb, D|Dv]
            qg = q.index_select(0, q_rows)  # [G*Lb, Hq, D]
            if group.query_len == 1:  # decode: every row is real, no query-length axis
                o = attend_decode(
                    qg, k, v, mask, scale=self.scale, sinks=params.sinks,
                    softcap=self.softcap, alibi_slopes=params.alibi_slopes,
                )  # fmt: skip  # [G, Hq, Dv]
                result.index_copy_(0, q_rows, o.to(result.dtype))
                continue
            o = attend_padded(
                qg.view(*group.q_index.shape, *q.shape[1:]), k, v, mask, scale=self.scale,
                sinks=params.sinks, softcap=self.softcap, alibi_slopes=params.alibi_slopes,
            )  # fmt: skip  # [G, Lb, Hq, Dv]
            result[group.q_index[group.q_valid]] = o[group.q_valid].to(result.dtype)
        if q.shape[0] > metadata.num_actual_tokens:
            result[metadata.num_actual_tokens :] = 0
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
        mla=False,
        non_causal=True,
        batch_invariant=True,
        cudagraph_support="never",
        needs_gpu=False,
        notes="Reference: gathers pages in padded per-request shapes (one gather and one attention call per shape group), float32 math; CPU default and test oracle.",
    )
    builder_cls = TorchSDPABuilder
    impl_cls = TorchSDPAImpl
