"""The host fast path of :func:`.api.paged_attention` on CUDA: a call whose inputs match an earlier,
validated call in everything but the tensors' addresses (and ``max_seq_len``) skips validation,
the launch plan and Triton's argument binding.

Why. A decode step calls the same attention with the same shapes layer after layer; H200 host
(triton 3.6) paid 83-126 us a call, nearly all of it Python: checks, config and split choice,
then ``JITFunction.run``. The key below names every input property that the checks, the plan
(:class:`.triton._Plan`) or Triton's specialization read, so equal keys get the same answer from
all three:

- each tensor's shape, strides, dtype, device index and whether its address is 16-byte aligned
  (Triton specializes pointers on it; every integer argument of the kernels is a shape, a stride
  or an option below, so its class -- 1, a multiple of 16, 32 / 64 bits -- is fixed too);
- every option by value (scale, softcap, window, splits, ...; a float scale too: it is
  validated by value), ``max_query_len`` (it picks the prefill class) and the layout object
  (held by the cache entry, so its ``id`` stays its own);
- the environment switches of the sm_90 Gluon kernels (``KV_KERNELS_SM90_{DECODE,PREFILL,MLA}``),
  read per call as the full path reads them.

``max_seq_len`` is left out: it only steers the split count, read per call from the entry's
:class:`._bound.SplitTable` (the launch key carries the count). Value checks of the index tensors
never run on CUDA by default, so nothing value-dependent is skipped; ``validate=True``,
``KV_KERNELS_VALIDATE=1`` or ``KV_KERNELS_CALL_CACHE=0`` (:data:`kv_kernels._call_cache.ENABLED`)
take the full path.

A hit runs the entry's bound call for its split count (:mod:`._bound`: the launches with every
argument fixed but the pointers, which the key already read), else the described path with the
entry's plan (:func:`.triton.paged_attention_triton`, which binds the class for the next call).
The last hit's key is kept: a step's layers share one key, so most calls compare their key with
it once instead of hashing it.
"""

from __future__ import annotations

import functools
import itertools
import os
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

import torch

from kv_kernels import _launch
from kv_kernels.paged_attention._bound import BoundCall, Launch, SplitTable, split_steps

__all__ = ["Entry", "cached_call", "clear", "direct_scales", "lookup", "remember"]


#: the Gluon kernels' environment switches (kv_kernels._common.sm90_gluon_allowed reads them)
_SWITCHES = ("KV_KERNELS_SM90_DECODE", "KV_KERNELS_SM90_PREFILL", "KV_KERNELS_SM90_MLA")
# os.environ's own mapping (encoded keys, kept in step with os.environ by its setters): three
# lookups there cost ~0.2 us a call where three os.environ.get cost ~3 us on this machine's CPU
_ENV_GET: Any = os.environ.get
_SWITCH_KEYS: tuple[Any, ...] = _SWITCHES
if isinstance(getattr(os.environ, "_data", None), dict) and hasattr(os.environ, "encodekey"):
    _ENV_GET = os.environ._data.get  # type: ignore[attr-defined]
    _SWITCH_KEYS = tuple(os.environ.encodekey(k) for k in _SWITCHES)


def _tensor_key(t: Any) -> Any:
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15)


def _scale_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _tensor_key(x)
    return (type(x), x)


def _ptr(t: Any) -> int:
    return t.data_ptr() if isinstance(t, torch.Tensor) else 0


class Entry:
    """A validated call: its normalized arguments (what the api passes the Triton launcher) and,
    once the launcher made them, its plan, its split counts and its bound calls (one per split
    count, :class:`._bound.BoundCall`; False where the class cannot be bound). ``serial`` names it
    in launch keys: unique for the process, where an ``id`` could come back after the entry is
    dropped. ``direct_scales``: the dequant scales reach the kernel as the caller's own tensors
    (or floats), so their pointers are the caller's."""

    __slots__ = (
        "bound", "direct_scales", "head_size_v", "layout", "plan", "serial", "splits", "static",
    )  # fmt: skip

    def __init__(
        self, layout: Any, static: dict[str, Any], head_size_v: int, direct_scales: bool = True
    ) -> None:
        self.layout = layout  # (keeps id(layout) in the key this layout's)
        self.static = static
        self.head_size_v = head_size_v
        self.direct_scales = direct_scales
        self.plan: Any = None
        self.splits: SplitTable | None = None
        self.bound: dict[int, BoundCall | bool] = {}
        self.serial = next(_SERIALS)

    def learn(
        self,
        splits: int,
        launches: list[Launch],
        tensors: tuple[Any, ...],
        splits_at: Callable[[int | None], int],
    ) -> None:
        """After the described path ran ``launches`` (``tensors``: :data:`._bound.SLOTS` order):
        keep the plan's split table (``splits_at``: its split count at a ``max_seq_len``) and
        bind the call at ``splits`` unless bound (or refused) already."""
        if self.splits is None:
            fixed = self.plan.splits if isinstance(self.plan.splits, int) else None
            steps = None if fixed is not None else split_steps(splits_at)
            self.splits = SplitTable(fixed, steps, splits_at(None))
        old = self.bound.get(splits)
        if old is False or (old and old.epoch == _launch.EPOCH):  # type: ignore[union-attr]
            return
        if not self.direct_scales:
            self.bound[splits] = False
            return
        if any(x.fast is not None and x.key and x.fast.bound(x.key, x.fast.current_device())
               is None for x in launches):  # fmt: skip
            return  # (not bound yet: the launch path was off, or a hook was set)
        kv = tensors[1]
        mod4 = kv.untyped_storage().nbytes() & 3 if self.static.get("scale_rows") else None
        built = BoundCall.build(launches, tensors, splits, mod4)
        self.bound[splits] = built if built is not None else False


_SERIALS = itertools.count()
_ENTRIES: dict[tuple[Any, ...], Entry] = {}
_LAST: list[tuple[Any, Any]] = [((), None)]  # the last hit (key, entry)


def remember(key: tuple[Any, ...], entry: Entry) -> None:
    """Store a call that passed validation (cleared when full: a shape sweep)."""
    if len(_ENTRIES) >= 512:
        clear()
    _ENTRIES[key] = entry


def lookup(key: tuple[Any, ...]) -> Entry | None:
    return _ENTRIES.get(key)


def clear() -> None:
    """Forget every validated call (the next call of each class takes the full path)."""
    _ENTRIES.clear()
    _LAST[0] = ((), None)


def direct_scales(k_scale: Any, v_scale: Any) -> bool:
    """Whether the dequant scales, as the caller passes them, reach the kernel as themselves
    (floats, or float32 tensors that :func:`_as_checked` returns as views at their own address):
    then a bound call may launch with the caller's pointers. A property of the key (dtype,
    shape, strides)."""
    return all(
        not isinstance(x, torch.Tensor)
        or (x.dtype == torch.float32 and (x.numel() == 1 or x.stride(-1) == 1))
        for x in (k_scale, v_scale)
    )


def _as_checked(value: Any) -> Any:
    """A dequant scale as :func:`kv_kernels._common.check_scale` returns it (the key already
    holds the value or the tensor's shape, dtype and device it checked)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(torch.float32).contiguous()
    return None if value is None else float(value)


def cached_call(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: Any,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: Any,
    options: tuple[Any, ...],  # scale, causal, sliding_window, softcap, num_splits, ...
    sinks: Any,
    alibi_slopes: Any,
    k_scale: Any,
    v_scale: Any,
    out: Any,
    error_flag: Any,
    max_seq_len: int | None,
) -> tuple[Any, tuple[Any, ...] | None]:
    """``(result, key)`` of a call alike an earlier validated one (its key's entry: through its
    bound call, :mod:`._bound`, where it has one, else the described path with the entry's
    plan); ``(None, key)`` for a call to validate, ``(None, None)`` for one that no key can
    describe (then the full path runs and raises its own error).

    The key (module notes) reads each tensor's ``data_ptr`` for its alignment; the bound call
    launches with those same pointers (:data:`._bound.SLOTS` order, q .. out; 0 where absent)."""
    try:
        qp, kp, bp = q.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr()
        sp, lp = seq_lens.data_ptr(), query_start_loc.data_ptr()
        op = out.data_ptr() if out is not None else 0
        key: tuple[Any, ...] = (
            id(layout), type(max_query_len), max_query_len, options,
            q.shape, q.stride(), q.dtype, q.get_device(), qp & 15,
            kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.get_device(),
            kp & 15, kv_cache.storage_offset() & 15,
            block_table.shape, block_table.stride(), block_table.dtype,
            block_table.get_device(), bp & 15,
            seq_lens.shape, seq_lens.stride(), seq_lens.dtype, seq_lens.get_device(), sp & 15,
            query_start_loc.shape, query_start_loc.stride(), query_start_loc.dtype,
            query_start_loc.get_device(), lp & 15,
            None if out is None else (out.shape, out.stride(), out.dtype, out.get_device(), op & 15),
            _ENV_GET(_SWITCH_KEYS[0]), _ENV_GET(_SWITCH_KEYS[1]), _ENV_GET(_SWITCH_KEYS[2]),
        )  # fmt: skip
        if sinks is None and alibi_slopes is None and error_flag is None and k_scale is None:
            ptrs = (qp, kp, bp, sp, lp, 0, 0, 0, 0, 0, op)
            if v_scale is not None:  # (a key of another length: never equal to one without)
                key += (_scale_key(v_scale),)
                ptrs = (qp, kp, bp, sp, lp, 0, 0, 0, _ptr(v_scale), 0, op)
        else:
            key += (
                _tensor_key(sinks), _tensor_key(alibi_slopes), _scale_key(k_scale),
                _scale_key(v_scale), _tensor_key(error_flag),
            )  # fmt: skip
            ptrs = (qp, kp, bp, sp, lp, _ptr(sinks), _ptr(alibi_slopes), _ptr(k_scale),
                    _ptr(v_scale), _ptr(error_flag), op)  # fmt: skip
    except (AttributeError, TypeError):
        return None, None
    # (a decode step calls every layer with one key: the last hit saves hashing it)
    last = _LAST[0]
    if key == last[0]:
        entry = last[1]
    else:
        try:
            entry = _ENTRIES.get(key)
        except TypeError:  # (an unhashable option: the full path names it)
            return None, None
        if entry is None:
            return None, key
        _LAST[0] = (key, entry)
    # validated before with inputs alike in all the checks read (module notes)
    if out is None:
        out = torch.empty(
            (q.shape[0], q.shape[1], entry.head_size_v), dtype=q.dtype, device=q.device
        )
        ptrs = (*ptrs[:10], out.data_ptr())
    table = entry.splits  # (SplitTable.__call__, inline)
    bound = table and entry.bound.get(
        table.default
        if max_seq_len is None
        else table.values[bisect_right(table.lows, max_seq_len)]
    )
    if bound:
        describe = None
        if _launch.CHECK:  # (check mode: the bound call compares itself with the described path)
            describe = functools.partial(
                _describe, entry, q, kv_cache, block_table, seq_lens, query_start_loc, sinks,
                alibi_slopes, k_scale, v_scale, out, error_flag, max_seq_len,
            )  # fmt: skip
        result = bound(ptrs, q, kv_cache, out, describe)
        if result is not None:
            return result, key
    result = triton_launcher()(
        q, kv_cache, block_table=block_table, seq_lens=seq_lens,
        query_start_loc=query_start_loc, sinks=sinks, alibi_slopes=alibi_slopes,
        k_scale=_as_checked(k_scale), v_scale=_as_checked(v_scale), out=out,
        max_seq_len=max_seq_len, error_flag=error_flag, plan_slot=entry, **entry.static,
    )  # fmt: skip
    return result, key


def _describe(
    entry: Entry,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sinks: Any,
    alibi_slopes: Any,
    k_scale: Any,
    v_scale: Any,
    out: torch.Tensor,
    error_flag: Any,
    max_seq_len: int | None,
    lse: Any,
    part_out: Any,
    part_lse: Any,
) -> list[Launch]:
    """The launches the described path makes for this call on these tensors (check mode)."""
    from kv_kernels.paged_attention.triton import describe_launches

    ks, vs = _as_checked(k_scale), _as_checked(v_scale)
    if entry.static["v_from_k"] and vs is None:
        vs = ks  # (as paged_attention_triton: an fp8 latent's one scale)
    return describe_launches(
        entry.plan, entry.splits(max_seq_len), entry, q, kv_cache,  # type: ignore[misc]
        block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc,
        sinks=sinks, alibi_slopes=alibi_slopes, k_scale=ks, v_scale=vs, out=out, lse=lse,
        part_out=out if part_out is None else part_out,
        part_lse=out if part_lse is None else part_lse, error_flag=error_flag, **entry.static,
    )  # fmt: skip


_TRITON: list[Any] = []


def triton_launcher() -> Any:
    """:func:`.triton.paged_attention_triton` (imported on first use: Triton stays unimported
    for reference-only callers)."""
    if not _TRITON:
        from kv_kernels.paged_attention.triton import paged_attention_triton

        _TRITON.append(paged_attention_triton)
    return _TRITON[0]
