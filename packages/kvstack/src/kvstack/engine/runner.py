"""``ModelRunner``: one forward step of a Hugging Face model over the paged KV cache.

It owns what a step needs and nothing about scheduling: the model (from the checkpoint), the KV
plan (kv-spec's ``plan_kv_cache`` over the model's per-layer specs), the cache storage
(kv-kernels' ``allocate_kv_cache``), one backend per KV group (kv-backends' selector, with its
reasons kept), one metadata builder per group and one impl per layer. :meth:`ModelRunner.execute`
takes a flat token batch plus one :class:`kv_backends.CommonAttentionMetadata` per group (what
kv-blocktable's ``BlockTables.build_common_metadata`` returns, or ``from_lists`` in tests) and
returns float32 logits of the rows asked for.

Per layer and step: K/V of the new tokens are written to their slots with the impl's
``do_kv_cache_update`` (kv-kernels' ``reshape_and_cache``), then ``impl.forward`` attends over the
pages (:mod:`kvstack.engine.attend`; with fused ops, RoPE rides in the write where the layer
allows: kv-kernels' ``rope_and_cache``, :attr:`ModelRunner.rope_cache_reason`). Groups share one block-id space and one set of layer slots (the planner's memory model), so
all groups view the same storage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from kv_backends import (
    AttentionConfig,
    AttentionImpl,
    CommonAttentionMetadata,
    MetadataBuilder,
    Platform,
    Selection,
    prepare_kernel_block_sizes,
    select_backend,
)
from kv_kernels import allocate_kv_cache, layer_view
from kv_kernels.cache import KVCacheStorage
from kv_spec import (
    NULL_BLOCKS,
    KVCacheConfig,
    KVCacheLayout,
    LayoutOrder,
    plan_kv_cache,
    to_torch_dtype,
)

from kvstack.engine._blas_warm import warm_model
from kvstack.engine.attend import RopeWrite, rope_cache_writes, step_attention
from kvstack.engine.graphs import DecodeGraphs, default_graph_blas, reason_unsupported
from kvstack.engine.hf_config import ArchConfig, load_arch_config
from kvstack.engine.kept_sdpa import EngineImpls
from kvstack.engine.kv_format import KVCacheDtype, mla_cache_choice, parse_kv_cache_dtype
from kvstack.engine.loader import load_model
from kvstack.engine.mla import MLAAttention
from kvstack.engine.mla_prefill import MLAPrefill
from kvstack.engine.models import CausalLM

__all__ = ["DEFAULT_CACHE_REQUESTS", "KVLayerHooks", "LayerBinding", "ModelRunner"]

#: With neither ``kv_cache_memory`` nor ``num_blocks``, the cache holds this many requests of
#: ``max_model_len`` tokens at once.
DEFAULT_CACHE_REQUESTS = 4

_TORCH_TO_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class KVLayerHooks(Protocol):
    """Per-layer calls around attention (a KV connector's layer-wise load and save:
    :mod:`kvstack.engine.connector_driver`). ``layer_slot`` is the layer's slot in the cache."""

    def before_attention(self, layer_slot: int) -> None: ...

    def after_attention(self, layer_slot: int) -> None: ...

    def before_replay(self) -> None:
        """A CUDA-graph replay runs every layer without the per-layer calls: wait for all now."""
        ...


@dataclass(frozen=True)
class LayerBinding:
    """Where one decoder layer's attention runs: its group, layer slot, cache view and impl."""

    name: str
    group_id: int
    layer_slot: int
    kv_cache: torch.Tensor  # [B, H, N, C] layer view of the shared storage
    impl: AttentionImpl


def _view_storage(base: KVCacheStorage, layout: KVCacheLayout) -> KVCacheStorage:
    """The storage allocated for one group, re-viewed with another group's layout (same bytes:
    the planner gave every group the same page size and block count)."""
    dtype = to_torch_dtype(layout.dtype)

    def reinterpret(
        t: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]
    ) -> torch.Tensor:
        flat = torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage())
        return flat.as_strided(shape, strides)

    if layout.order.layer_outer:
        assert not isinstance(base, torch.Tensor)
        strides = tuple(
            s for d, s in zip(layout.order.value, layout.physical_strides, strict=True) if d != "L"
        )
        return [reinterpret(t, layout.layer_shape, strides) for t in base]
    assert isinstance(base, torch.Tensor)
    return reinterpret(base, layout.physical_shape, layout.physical_strides)


class ModelRunner:
    """Load a checkpoint, plan and allocate its paged KV cache, and run forward steps over it.

    - ``block_size``: manager block size of every group (the planner may grow a group's block
      size to unify page sizes; each group's spec says what it got).
    - ``kv_cache_memory`` (bytes) or ``num_blocks`` size the cache; with neither, it holds
      :data:`DEFAULT_CACHE_REQUESTS` requests of ``max_model_len`` tokens.
    - ``max_model_len`` defaults to ``max_position_embeddings`` and may pass it only with
      ``allow_long_max_model_len=True`` (as vLLM's override).
    - ``backend`` forces one backend name for every group (the selector's ``prefer``: an error
      with its reasons if it cannot serve a group, never a silent fallback).
    - ``layout_order``: the physical KV-cache order (kv-spec's six names).
    - ``cuda_graphs``: replay decode-only steps from CUDA graphs (:mod:`kvstack.engine.graphs`).
      ``None`` (default): on where they can run (CUDA, every group's backend capturable, no
      host-synced layer), else off with :attr:`cuda_graphs_reason` saying why; ``True``: on,
      or a ``ValueError`` with the reason; ``False``: off.
    - ``fused_ops``: run RMSNorm (with the residual add), SiLU/GELU-and-mul and RoPE through
      kv-kernels' fused ops (:meth:`~kvstack.engine.models.CausalLM.use_fused_ops`). ``None``
      (default): on CUDA (Triton), off on the CPU (the torch code the parity tests hold);
      ``True`` on the CPU runs the ops' torch references (tests). With them, a layer whose
      backend writes its cache through ``reshape_and_cache`` alone rotates q/k in the write
      (one launch, :mod:`kvstack.engine.attend`; :attr:`rope_cache_reason` says which).
    - ``kv_cache_dtype``: ``"auto"`` (the model dtype), ``"fp8"`` (= ``"fp8_e4m3"``) or
      ``"fp8_e5m2"``: K/V stored in fp8 with per-tensor scales of 1.0, as vLLM's option
      (:mod:`kvstack.engine.kv_format`); only backends that declare ``fp8_per_tensor`` serve it.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        backend: str | None = None,
        layout_order: LayoutOrder | str = "LBNHC",
        cuda_graphs: bool | None = None,
        allow_long_max_model_len: bool = False,
        fused_ops: bool | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs={cuda_graphs!r} must be None, True or False")
        if fused_ops is not None and not isinstance(fused_ops, bool):
            raise TypeError(f"fused_ops={fused_ops!r} must be None, True or False")
        for name, v, optional in (
            ("block_size", block_size, False),
            ("kv_cache_memory", kv_cache_memory, True),
            ("num_blocks", num_blocks, True),
            ("max_model_len", max_model_len, True),
            ("max_num_batched_tokens", max_num_batched_tokens, False),
            ("max_num_seqs", max_num_seqs, False),
        ):
            if (v is not None or not optional) and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(
                    f"ModelRunner: {name}={v!r} is a {type(v).__name__}; give an int"
                    + (" (or None)" if optional else "")
                )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"ModelRunner: dtype={dtype!r} is a {type(dtype).__name__}; give a torch.dtype, "
                f"one of {list(_TORCH_TO_NAME)}"
            )
        if not isinstance(device, (str, torch.device)):
            raise TypeError(
                f"ModelRunner: device={device!r} is a {type(device).__name__}; give a str "
                "('cpu', 'cuda', 'cuda:0') or a torch.device"
            )
        if dtype not in _TORCH_TO_NAME:
            raise ValueError(f"dtype={dtype} is not supported; use one of {list(_TORCH_TO_NAME)}")
        if kv_cache_memory is not None and num_blocks is not None:
            raise ValueError(
                f"give kv_cache_memory={kv_cache_memory} or num_blocks={num_blocks}, not both"
            )
        #: What the cache holds (``kv_cache_dtype`` resolved)
        self.kv_cache_dtype: KVCacheDtype = parse_kv_cache_dtype(kv_cache_dtype)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Tensors report "cuda:N"; compare devices against the same spelling.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        self.model_dir = Path(model_dir)
        self.arch: ArchConfig = load_arch_config(model_dir)
        self.max_model_len = (
            max_model_len if max_model_len is not None else self.arch.max_position_embeddings
        )
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len={self.max_model_len} must be positive")
        if not isinstance(allow_long_max_model_len, bool):
            raise TypeError(
                f"ModelRunner: allow_long_max_model_len={allow_long_max_model_len!r} is a "
                f"{type(allow_long_max_model_len).__name__}; give True or False"
            )
        mpe = self.arch.max_position_embeddings
        if self.max_model_len > mpe and not allow_long_max_model_len:
            # (vLLM's rule: positions the model was not trained for, only when asked)
            raise ValueError(
                f"max_model_len={self.max_model_len} is above the model's "
                f"max_position_embeddings={mpe} (config.json); give at most {mpe}, or pass "
                "allow_long_max_model_len=True to run positions the model was not trained for"
            )
        self.max_num_batched_tokens = max_num_batched_tokens
        t0 = time.perf_counter()
        self.model: CausalLM = load_model(
            model_dir, dtype=dtype, device=self.device, arch=self.arch
        )
        self.fused_ops = self.device.type == "cuda" if fused_ops is None else fused_ops
        if self.fused_ops:  # (the RoPE table covers every position this runner serves)
            self.model.use_fused_ops("auto", max_positions=self.max_model_len)
        t1 = time.perf_counter()
        self.platform = Platform.detect(self.device)
        #: MLA models (DeepSeek-V3): cache one latent row per token, attended absorbed, where a
        #: backend serves MLA here (``mla_cache_reason`` says which, or why K/V are decompressed).
        self.mla_latent, self.mla_cache_reason = mla_cache_choice(
            self.arch, self.platform, self.kv_cache_dtype, block_size=block_size,
            dtype=_TORCH_TO_NAME[self.dtype], layout_order=layout_order, backend=backend,
        )  # fmt: skip
        self.kv_cache_config: KVCacheConfig = self._plan(
            block_size, kv_cache_memory, num_blocks, layout_order
        )
        self.selections: dict[int, Selection] = {}
        for g in self.kv_cache_config.groups:
            self.selections[g.group_id] = select_backend(
                self._attention_config(g.group_id, layout_order), self.platform, prefer=backend
            )
        self.backends: dict[int, str] = {gid: s.name for gid, s in self.selections.items()}
        self.kernel_block_sizes: tuple[int, ...] = tuple(
            prepare_kernel_block_sizes(
                list(self.kv_cache_config.groups),
                [[self.selections[g.group_id]] for g in self.kv_cache_config.groups],
            )
        )
        self.layouts: dict[int, KVCacheLayout] = {
            g.group_id: self.kv_cache_config.layout(g.group_id) for g in self.kv_cache_config.groups
        }
        base = allocate_kv_cache(self.layouts[0], self.device)
        self.kv_caches: dict[int, KVCacheStorage] = {
            gid: base if gid == 0 else _view_storage(base, lay) for gid, lay in self.layouts.items()
        }
        self.builders: dict[int, MetadataBuilder] = {}
        self.layers: list[LayerBinding] = []
        self.max_num_seqs = max_num_seqs
        self._bind(layout_order, max_num_seqs)
        #: Per layer, how its RoPE rides in its cache write (None: two launches), and why
        self.rope_writes: tuple[RopeWrite | None, ...]
        self.rope_writes, self.rope_cache_reason = rope_cache_writes(
            self.model, [b.impl for b in self.layers], self.device
        )
        self._rope_deferred = tuple(w is not None for w in self.rope_writes)
        #: MLA latent: steps with prefill rows attend them over decompressed K/V (decode rows
        #: absorbed, :mod:`kvstack.engine.mla_prefill`); ``None`` attends every row absorbed.
        self.mla_prefill = (
            MLAPrefill(max_query_len=max_num_batched_tokens) if self.mla_latent else None
        )
        #: Seconds each stage of the start took (``load``, ``plan``; ``graphs``, ``compile``
        #: where they ran): :attr:`EngineStats.startup_seconds`.
        self.startup_seconds: dict[str, float] = {
            "load": t1 - t0,
            "plan": time.perf_counter() - t1,
        }
        #: Set by an engine that drives a KV connector (None: no calls).
        self.kv_layer_hooks: KVLayerHooks | None = None
        self.graphs: DecodeGraphs | None = None
        why = "cuda_graphs=False" if cuda_graphs is False else reason_unsupported(self)
        if why is None:
            t2 = time.perf_counter()
            # A decode step holds one token a request: no step is larger than the token budget.
            max_decode = min(max_num_seqs, max_num_batched_tokens)
            self.graphs = DecodeGraphs(self, max_decode, blas=default_graph_blas())
            self.startup_seconds["graphs"] = time.perf_counter() - t2
            self.cuda_graphs_reason = (
                f"on: decode-only steps of up to {max_decode} requests replay CUDA graphs "
                f"(sizes {', '.join(map(str, self.graphs.sizes))})"
            )
        elif cuda_graphs:
            raise ValueError(f"cuda_graphs=True, but CUDA graphs cannot run here: {why}")
        else:
            self.cuda_graphs_reason = f"off: {why}"

    # -- construction ------------------------------------------------------------------------

    def _plan(
        self,
        block_size: int,
        kv_cache_memory: int | None,
        num_blocks: int | None,
        layout_order: LayoutOrder | str,
    ) -> KVCacheConfig:
        specs = self.kv_cache_dtype.specs(
            self.arch.kv_specs(
                block_size=block_size, dtype=_TORCH_TO_NAME[self.dtype], mla_latent=self.mla_latent
            )
        )  # fp8: one byte an element, scales outside the pages
        kw: dict[str, Any] = dict(
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            layout_order=layout_order,
        )
        if kv_cache_memory is not None:
            return plan_kv_cache(specs, kv_cache_memory, **kw)
        # Plan once for one block to learn the page size and the layer slots, then size it.
        probe = plan_kv_cache(specs, 2**62, **kw)
        per_block = probe.page_size_bytes * probe.num_layer_slots
        need = probe.blocks_per_request(self.max_model_len)
        if num_blocks is None:
            num_blocks = DEFAULT_CACHE_REQUESTS * need + NULL_BLOCKS
        if num_blocks < need + NULL_BLOCKS:
            raise ValueError(
                f"num_blocks={num_blocks} cannot hold one request of max_model_len="
                f"{self.max_model_len}: it needs {need} blocks over {len(probe.groups)} KV "
                f"group(s) besides the allocator's null block, so at least {need + NULL_BLOCKS}; "
                "give more blocks or a smaller max_model_len"
            )
        return plan_kv_cache(specs, num_blocks * per_block, **kw)

    def _attention_config(self, group_id: int, layout_order: LayoutOrder | str) -> AttentionConfig:
        group = self.kv_cache_config.groups[group_id]
        names = set(group.layer_names)
        # Sinks are per layer (MiMo-V2-Flash: sliding layers only); a group shares one spec, so
        # its layers agree.
        sinks = any(
            self.arch.layer_has_sinks(i)
            for i in range(self.arch.num_layers)
            if self.arch.layer_name(i) in names
        )
        return AttentionConfig.from_spec(
            group.spec,
            num_q_heads=self.arch.num_q_heads,
            dtype=_TORCH_TO_NAME[self.dtype],
            has_sinks=sinks,
            softcap=self.arch.attn_softcap,
            layout_order=layout_order,
        )

    def _bind(self, layout_order: LayoutOrder | str, max_num_seqs: int) -> None:
        cfg = self.kv_cache_config
        for g in cfg.groups:
            sel = self.selections[g.group_id]
            config = sel.config.with_kernel_block_size(self.kernel_block_sizes[g.group_id])
            layout = self.layouts[g.group_id]
            self.builders[g.group_id] = sel.backend.make_builder(
                config,
                layout,
                device=self.device,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
            )
        # TORCH_SDPA on the CPU keeps each layer's decode gather (kept_sdpa; safe because
        # note_external_writes reports the writes torch's version counter misses)
        impls = EngineImpls(
            device=self.device,
            kv_cache_bytes=self.kv_cache_config.total_bytes,
            num_layers=self.arch.num_layers,
        )
        for i in range(self.arch.num_layers):
            name = self.arch.layer_name(i)
            g = cfg.group_of(name)
            sel = self.selections[g.group_id]
            config = sel.config.with_kernel_block_size(self.kernel_block_sizes[g.group_id])
            layout = self.layouts[g.group_id]
            slot = cfg.layer_slot(name)
            sinks = self.model.layer_sinks(i)
            # An MLA impl reads V as the latent row's first kv_lora_rank columns.
            mla: dict[str, Any] = (
                {"kv_lora_rank": self.arch.mla_kv_lora_rank} if self.mla_latent else {}
            )
            impl = impls.make_impl(
                sel.backend,
                config,
                layout,
                scale=self.model.scale,
                sinks=None if sinks is None else sinks.detach().float(),
                **mla,
                **self.kv_cache_dtype.layer_scales(self.device),  # fp8: this layer's K/V scales
            )
            view = layer_view(self.kv_caches[g.group_id], layout, slot)
            self.layers.append(LayerBinding(name, g.group_id, slot, view, impl))

    def warm_kernels(self, kernel_table: Callable[[int], torch.Tensor]) -> dict[str, float]:
        """Build every group's kernels before the first request (``AttentionImpl.warmup``,
        through the null block 0, over the block tables ``kernel_table(group)`` the steps pass:
        their width and row pitch are part of what the kernels specialize on). Returns seconds
        per group (and on CUDA ``matmuls``: cuBLAS's kernels, :mod:`._blas_warm`) and adds their
        sum to :attr:`startup_seconds` as ``compile``. One layer a group: a group's layers share
        its spec, backend and options."""
        done: dict[str, float] = {}
        for b in self.layers:
            key = f"group {b.group_id}"
            if key in done:
                continue
            table = kernel_table(b.group_id)
            t0 = time.perf_counter()
            b.impl.warmup(
                b.kv_cache, block_table_width=table.shape[1], block_table_stride=table.stride(0)
            )
            done[key] = time.perf_counter() - t0
        mla = self.mla_prefill
        attns = (lay.self_attn for lay in self.model.decoder_layers())
        attn = next((a for a in attns if isinstance(a, MLAAttention)), None)
        if mla is not None and attn is not None:  # the decompressed prefill's workspace kernels
            t0 = time.perf_counter()
            mla.warmup(attn, self.dtype, self.device, self.max_model_len, self.model.scale)
            done["mla prefill workspace"] = time.perf_counter() - t0
        if self.device.type == "cuda":  # cuBLAS's kernels for the steps' sizes (_blas_warm)
            t0 = time.perf_counter()
            warm_model(self.model, self.max_num_batched_tokens, self.max_num_seqs)
            done["matmuls"] = time.perf_counter() - t0
        self.startup_seconds["compile"] = sum(done.values())
        return done

    # -- stepping ----------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_config.groups)

    def note_external_writes(self) -> None:
        """Report KV written into the caches outside torch's in-place ops (a connector's load
        through NIXL or a socket) by moving their version counters, so no layer reuses a kept
        gather of the old bytes (:mod:`kvstack.engine.kept_sdpa`). Call after such a write,
        before the next step."""
        for storage in self.kv_caches.values():
            for t in [storage] if isinstance(storage, torch.Tensor) else storage:
                if not t.is_inference():  # (those keep no counter, and nothing is kept)
                    torch.autograd.graph.increment_version(t)

    def describe(self) -> str:
        """The plan and every group's backend selection, for people."""
        cfg = self.kv_cache_config
        lines = [
            f"{self.arch.architecture}: {self.arch.num_layers} layers, {cfg.num_blocks} blocks x "
            f"{cfg.page_size_bytes} B pages x {cfg.num_layer_slots} layer slots, {cfg.layout_order.value}"
        ]
        for g in cfg.groups:
            lines.append(
                f"group {g.group_id} ({len(g.layer_names)} layers, block {g.spec.block_size}, "
                f"kernel block {self.kernel_block_sizes[g.group_id]}): {self.selections[g.group_id]}"
            )
        if self.mla_cache_reason is not None:
            lines.append(f"MLA: {self.mla_cache_reason}")
        if self.mla_prefill is not None:
            lines.append(f"MLA prefill: {self.mla_prefill.describe()}")
        lines.append(f"RoPE in the cache write {self.rope_cache_reason}")
        lines.append(f"CUDA graphs {self.cuda_graphs_reason}")
        return "\n".join(lines)

    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Sequence[CommonAttentionMetadata],
        logits_indices: torch.Tensor,
    ) -> None:
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if t.dim() != 1 or t.dtype != torch.int64:
                raise ValueError(
                    f"{name} must be int64 [num_tokens]; got {t.dtype} {tuple(t.shape)}"
                )
        n = input_ids.numel()
        if positions.numel() != n:
            raise ValueError(f"positions has {positions.numel()} entries; input_ids has {n}")
        if n > self.max_num_batched_tokens:
            raise ValueError(
                f"the batch has {n} tokens; this runner was built for "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        if len(metadata) != self.num_groups:
            raise ValueError(
                f"got {len(metadata)} metadata objects; the model has {self.num_groups} KV groups "
                "(one CommonAttentionMetadata per group, in group order)"
            )
        for gid, md in enumerate(metadata):
            if md.slot_mapping.device != self.device or md.block_table.device != self.device:
                raise ValueError(
                    f"group {gid}: metadata lives on {md.slot_mapping.device}; this runner's cache "
                    f"is on {self.device} (build it with device={str(self.device)!r})"
                )
            if md.slot_mapping.numel() != n:
                raise ValueError(
                    f"group {gid}: slot_mapping has {md.slot_mapping.numel()} entries; input_ids "
                    f"has {n} (pad slot_mapping with -1 for padding tokens)"
                )
        if logits_indices.dim() != 1 or logits_indices.dtype != torch.int64:
            raise ValueError(
                f"logits_indices must be int64 [R]; got {logits_indices.dtype} {tuple(logits_indices.shape)}"
            )
        if logits_indices.numel():
            lo, hi = torch.aminmax(logits_indices)  # one reduction, not two
            ok = bool(((lo >= 0) & (hi < n)).item())
        else:
            ok = True
        if not ok:
            raise ValueError(f"logits_indices must lie in [0, {n}) (token rows of this batch)")
        self._check_positions(positions, metadata[0])

    @staticmethod
    def _check_positions(positions: torch.Tensor, md: CommonAttentionMetadata) -> None:
        # Request r's new tokens sit at seq_len - query_len .. seq_len - 1: a position that
        # disagrees would rotate q/k for one place and write/attend for another.
        # Token t of request r sits at seq_lens[r] - query_len(r) + (t - qsl[r]), which is
        # t + (seq_lens[r] - qsl[r + 1]): one per-request shift, spread over its tokens.
        qsl = md.host_query_start_loc().to(torch.int64)
        seq = md.host_seq_lens().to(torch.int64)
        shift = torch.repeat_interleave(seq - qsl[1:], qsl.diff())  # [qsl[-1]]
        expect = torch.arange(shift.numel()) + shift
        got = positions[: md.num_actual_tokens].cpu()
        if got.numel() != expect.numel() or not torch.equal(got, expect):
            bad = (got != expect).nonzero()
            where = f" (first at token {int(bad[0])})" if bad.numel() else ""
            raise ValueError(
                "positions disagree with the metadata: request r's new tokens must sit at "
                f"seq_lens[r] - query_len(r) .. seq_lens[r] - 1{where}"
            )

    @torch.no_grad()
    def execute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Sequence[CommonAttentionMetadata],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """One forward step: float32 logits ``[R, vocab]`` of rows ``logits_indices`` ``[R]``.

        ``input_ids`` / ``positions``: int64 ``[num_tokens]`` (padding tokens allowed past each
        group's ``num_actual_tokens``, with ``-1`` slots); ``metadata``: one per KV group, in
        group order (layer ``name`` uses ``metadata[kv_cache_config.group_of(name).group_id]``).
        """
        self._check_inputs(input_ids, positions, metadata, logits_indices)
        return self.execute_trusted(input_ids, positions, metadata, logits_indices)

    @torch.no_grad()
    def execute_trusted(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Sequence[CommonAttentionMetadata],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`execute` without its input checks, for a caller whose own construction
        guarantees them: :class:`~kvstack.engine.LLMEngine` builds the metadata with
        ``BlockTables.build_common_metadata`` (which checks the lengths and rows on the host)
        and the positions and logits rows from the same lengths. The checks cost a host pass
        over the positions every step; anything else should call :meth:`execute`."""
        graphs = self.graphs
        if graphs is not None:
            size = graphs.size_for(input_ids.numel(), metadata)
            if size is not None:
                if self.kv_layer_hooks is not None:
                    self.kv_layer_hooks.before_replay()
                return graphs.run(size, input_ids, positions, metadata, logits_indices)
        hidden = self.forward_hidden(input_ids, positions, metadata)  # [T, hidden]
        # index_select, not hidden[...]: advanced indexing runs as a parallel region however
        # few the rows, index_select only past a size threshold.
        rows = hidden.index_select(0, logits_indices.to(self.device))  # [R, hidden]
        return self.model.compute_logits(rows)

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Sequence[CommonAttentionMetadata],
    ) -> torch.Tensor:
        """The last hidden states ``[T, hidden]`` of a step: every group's metadata built, the new
        K/V written and attended per layer (what a captured decode step records)."""
        built = [self.builders[gid].build(md) for gid, md in enumerate(metadata)]
        slots = [md.slot_mapping for md in metadata]
        latent = self.mla_latent
        attend, rope_attend = step_attention(
            self.layers, built, slots, self.kv_layer_hooks, latent, self.rope_writes,
            self._rope_deferred,
        )  # fmt: skip

        # A step with prefill rows (never a captured decode step) splits MLA layers' rows.
        mla = self.mla_prefill
        split = None
        if mla is not None and any(md.max_query_len > 1 for md in metadata):
            split = mla.step(self, metadata)
        return self.model(
            input_ids.to(self.device), positions.to(self.device), attend, mla_latent=latent,
            mla_split=split, rope_attend=rope_attend,
        )  # fmt: skip
