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

An impl keeps nothing between calls but facts of its own cache geometry: every forward gathers
what it reads from the cache as it is at that call, so the reference needs no report of how the
cache was written. An engine that wants more (kvstack's kept decode gathers) subclasses the impl
and overrides :meth:`TorchSDPAImpl.decode_gather`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from kv_spec import KVCacheLayout

from kv_backends.backends._torch_ops import (
    attend_decode,
    attend_padded,
    gather_kv_rows,
    gather_padded_kv,
    split_kv_rows,
    write_kv_slots,
)
from kv_backends.backends.torch_sdpa_decode import DecodeRun, KVViews
from kv_backends.backends.torch_sdpa_mla import attend_latent, latent_rank
from kv_backends.backends.torch_sdpa_plan import (
    TorchSDPAMetadata,
    _step_plan,
    _StepPlan,
    kv_row_array,
    kv_row_index,
    kv_row_offsets,
)
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


class TorchSDPABuilder(MetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        md = super().build(common)
        # The frozen dataclass's fields are its instance dict (cheaper than dataclasses.fields).
        return TorchSDPAMetadata(**vars(md))


class TorchSDPAImpl(AttentionImpl):
    """Per-layer TORCH_SDPA attention (float32 math, output cast to the query dtype). Stateless
    across calls: each forward reads the cache as it is (see the module docstring).

    MLA layers (``config.mla`` over an ``MLAAttentionSpec`` layout) take ``kv_lora_rank``
    (default :func:`~kv_backends.backends.triton_mla.default_kv_lora_rank`) and TRITON_MLA's
    contract: the latent row written once (``value=None``), absorbed queries, output ``[T, Hq,
    kv_lora_rank]`` (:mod:`.torch_sdpa_mla`).
    """

    def __init__(
        self,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        kv_lora_rank: int | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(config, layout, **kw)
        #: MLA: the latent width V reads (the output width); ``None`` on K/V layers
        self.kv_lora_rank = latent_rank(config, layout, kv_lora_rank)
        if self.kv_lora_rank is not None:
            self.head_size_v = self.kv_lora_rank

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
        if not (
            kv_cache.device.type == "cpu"
            and value is not None
            and slot_mapping.numel()
            and write_kv_slots(key, value, kv_cache, slot_mapping, self.layout)
        ):
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def decode_gather(
        self,
        kv_cache: torch.Tensor,
        row_array: torch.Tensor,
        plan: _StepPlan,
        geometry: tuple[object, ...],
        offsets: tuple[int, torch.Tensor],
        metadata: AttentionMetadata,
        run: DecodeRun,
    ) -> tuple[torch.Tensor, KVViews | None]:
        """A decode-only step's K/V rows: rows ``plan.kv_index[geometry]`` ``[rows]`` of
        ``row_array`` (:func:`kv_row_array` of the layer's cache view ``kv_cache``, in kernel
        blocks, whose :func:`kv_row_offsets` are ``offsets``) in a float32 ``[rows, D]`` buffer
        of ``run``'s shape, and that buffer's :meth:`DecodeRun.views` where the caller keeps
        them (``None``: ``run`` makes them). The reference gathers every row into the step's
        shared buffer. The seam for a subclass that keeps state across steps (kvstack's
        ``KeptGatherSDPAImpl``); ``plan`` and ``run`` are TORCH_SDPA's internal step types, so
        such a subclass pins kv-backends' minor version."""
        index = plan.kv_index[geometry]  # [rows]
        return torch.index_select(row_array, 0, index, out=run.shared_buffer()), None

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
                k_scale=self.scales(layer, q.device)[0],
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
            assert offsets is not None  # (kv_rows is not None)
            buffer, views = self.decode_gather(
                kv_cache, self._row_array(cache, klayout), plan, geometry, offsets, metadata, run
            )  # [rows, D]
            return run.attend(buffer, q, self.scale, out, views)
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
        notes="Reference: gathers pages in padded per-request shapes (one gather and one attention call per shape group), float32 math; MLA absorbed over the latent cache through kv-kernels' paged_attention reference (unquantized or fp8 per-tensor latents, one k_scale); CPU default and test oracle.",
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
        if config.mla and config.kv_quant not in ("none", "fp8_per_tensor"):
            # kv-kernels' paged_attention reads MLA latents unquantized or fp8 per tensor
            reasons.append(
                f"MLA latent with kv_quant {config.kv_quant} not supported (none or fp8_per_tensor)"
            )
        return reasons
