"""The attention callbacks of a runner step, and which layers write RoPE into the cache.

Per layer and step the runner writes the new K/V into the paged cache and attends over it:
:func:`step_attention` makes the ``attend(layer, q, k, v)`` callback the model calls
(:data:`~kvstack.engine.models.AttendFn`), with a KV connector's per-layer calls around it.

Where a layer's RoPE is the fused table lookup and its backend's cache write is kv-kernels'
``reshape_and_cache`` alone, the step's two launches for that layer become one: kv-kernels'
``fused.rope_and_cache`` rotates q and k in place and writes the rotated K, with V, to the cache
(issue 32: on an H200 profile of a Llama-3-8B-shaped decode step, 32 rotary and 32 cache-write
launches, each kernel boundary idle time inside the CUDA graph). The model then hands those
layers' q and k unrotated to a second callback with the step's RoPE
(:class:`~kvstack.engine.models.RopeAttend`). Which layers do is decided once, at build
(:func:`rope_cache_writes`), and said in one line (``ModelRunner.rope_cache_reason``):

- fused ops on (``ModelRunner(fused_ops=...)``): the fused RoPE's table is what the op reads;
- not MLA (its RoPE is interleaved, inside the latent row, and kept in torch);
- the backend reports a plain write (kv-backends' ``AttentionImpl.plain_cache_write``: an
  unquantized, non-MLA cache written by ``reshape_and_cache`` with no scales, not the
  backend's own write): the fused call passes that write's ``impl`` and ``error_flag``, so the
  same bytes land, counted in the same flag. fp8 caches (their scales), TORCH_SDPA (the
  reference write, an oracle that shares no Triton code; the CPU engine's kept gathers follow
  its writes) and MLA caches keep the two launches;
- that ``impl`` and the RoPE's run the same implementation on the device (one op runs one).

Everything else is as the two launches were: the slots, the connector's calls around each
layer (its save sees the layer after the write), padding (``-1`` slots write nothing), CUDA-graph
capture (``rope_and_cache`` launches without a host sync or a per-step allocation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from kv_backends import AttentionImpl
from kv_kernels.fused import rope_and_cache
from kv_spec import KVQuantMode

from kvstack.engine.models import AttendFn, Attention, CausalLM, RopeAttend
from kvstack.engine.rotary import FusedRope

if TYPE_CHECKING:
    from kvstack.engine.runner import KVLayerHooks, LayerBinding

__all__ = ["RopeWrite", "rope_cache_writes", "step_attention"]


class RopeWrite(NamedTuple):
    """A layer whose RoPE rides in its cache write: ``rope_and_cache``'s ``impl`` and
    ``error_flag`` (those of the backend's own ``reshape_and_cache`` call), decided for the
    model's fused RoPE of ``rope_impl``."""

    impl: str
    error_flag: torch.Tensor | None
    rope_impl: str


def _resolved(impl: str, device: torch.device) -> str:
    """kv-kernels' ``impl`` as it runs on ``device``: ``"auto"`` is Triton for CUDA tensors and
    the torch reference on the CPU."""
    if impl != "auto":
        return impl
    return "triton" if device.type == "cuda" else "reference"


def _layer_write(
    model: CausalLM, i: int, impl: AttentionImpl, device: torch.device
) -> RopeWrite | str:
    """Layer ``i``'s :class:`RopeWrite`, or why its RoPE and write stay two launches."""
    rope = model.fused_rope
    if rope is None:
        return "MLA keeps its interleaved RoPE in torch" if model.arch.is_mla else "fused ops off"
    if not isinstance(model.decoder_layers()[i].self_attn, Attention):
        return "MLA keeps its interleaved RoPE in torch"
    plain = impl.plain_cache_write(device)
    if plain is None:
        if impl.layout.kv_quant is not KVQuantMode.NONE:
            return f"the {impl.layout.dtype} cache's write needs its scales"
        return f"{type(impl).__name__} writes its cache its own way"
    if _resolved(plain.impl, device) != _resolved(rope, device):
        return (
            f"the cache write runs impl={plain.impl!r} and the RoPE impl={rope!r}, "
            f"not one implementation on {device.type}"
        )
    return RopeWrite(_resolved(rope, device), plain.error_flag, rope)


def rope_cache_writes(
    model: CausalLM, impls: Sequence[AttentionImpl], device: torch.device
) -> tuple[tuple[RopeWrite | None, ...], str]:
    """Per layer (``impls[i]`` is layer ``i``'s), its :class:`RopeWrite` or ``None``, and one
    line for people: ``"on: 32 of 32 layers ..."`` / ``"off: <why>"`` (the module docstring's
    rules). Call once, at build (outside CUDA-graph capture)."""
    found = [_layer_write(model, i, impl, device) for i, impl in enumerate(impls)]
    writes = tuple(w if isinstance(w, RopeWrite) else None for w in found)
    why = sorted({w for w in found if isinstance(w, str)})
    on = sum(w is not None for w in writes)
    if not on:
        return writes, "off: " + "; ".join(why or ["no layers"])
    line = f"on: {on} of {len(writes)} layers rotate q/k in their cache write (rope_and_cache)"
    return writes, line + (f"; the others not: {'; '.join(why)}" if why else "")


def step_attention(
    layers: Sequence[LayerBinding],
    built: Sequence[object],
    slots: Sequence[torch.Tensor],
    hooks: KVLayerHooks | None,
    latent: bool,
    writes: Sequence[RopeWrite | None],
    deferred: tuple[bool, ...],
) -> tuple[AttendFn, RopeAttend | None]:
    """One step's ``attend`` (write K/V with the layer's impl, attend) and, where some layer's
    RoPE rides in the write (``writes``, with ``deferred = tuple(w is not None ...)``), the
    :class:`RopeAttend` whose callback rotates, writes and attends. ``built``: each group's
    metadata, ``slots``: each group's slot mapping."""

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = layers[i]
        if hooks is not None:  # this layer's loaded KV is in place before it is read
            hooks.before_attention(b.layer_slot)
        # MLA latent: k is the latent row, written once (v is a view of it)
        b.impl.do_kv_cache_update(None, k, None if latent else v, b.kv_cache, slots[b.group_id])
        out = b.impl.forward(None, q, b.kv_cache, built[b.group_id])
        if hooks is not None:  # this layer's new KV is written: it may be saved
            hooks.after_attention(b.layer_slot)
        return out

    if not any(deferred):
        return attend, None

    def attend_rope(
        i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: FusedRope
    ) -> torch.Tensor:
        b, w = layers[i], writes[i]
        assert w is not None
        if hooks is not None:
            hooks.before_attention(b.layer_slot)
        slot_mapping = slots[b.group_id]
        if rope.impl == w.rope_impl:
            # one launch: q and k rotated in place, rotated K with V into the cache
            rope_and_cache(
                rope.positions, q, k, v, rope.cos_sin_cache, b.kv_cache, slot_mapping,
                b.impl.layout, is_neox=True, rotary_dim=rope.cos_sin_cache.shape[1],
                impl=w.impl, error_flag=w.error_flag,
            )  # fmt: skip
        else:  # the model's fused ops were switched since the build: the two launches
            rope.rotate(q, k)
            b.impl.do_kv_cache_update(None, k, v, b.kv_cache, slot_mapping)
        out = b.impl.forward(None, q, b.kv_cache, built[b.group_id])
        if hooks is not None:
            hooks.after_attention(b.layer_slot)
        return out

    return attend, RopeAttend(deferred, attend_rope)
