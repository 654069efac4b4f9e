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

``max_seq_len`` is left out: it only steers the split count, computed per call (the launch key
carries the count). Value checks of the index tensors never run on CUDA by default, so nothing
value-dependent is skipped; ``validate=True`` or ``KV_KERNELS_VALIDATE=1`` take the full path.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

__all__ = ["call_key", "lookup", "remember"]


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


def call_key(
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
) -> tuple[Any, ...] | None:
    """The call's key, or None when an input is not what a key can describe (then the full
    path runs and raises its own error)."""
    try:
        return (
            id(layout), type(max_query_len), max_query_len, options,
            q.shape, q.stride(), q.dtype, q.get_device(), q.data_ptr() & 15,
            kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.get_device(),
            kv_cache.data_ptr() & 15, kv_cache.storage_offset() & 15,
            _tensor_key(block_table), _tensor_key(seq_lens), _tensor_key(query_start_loc),
            _tensor_key(sinks), _tensor_key(alibi_slopes), _scale_key(k_scale),
            _scale_key(v_scale), _tensor_key(out), _tensor_key(error_flag),
            tuple(map(_ENV_GET, _SWITCH_KEYS)),
        )  # fmt: skip
    except (AttributeError, TypeError):
        return None


class Entry:
    """A validated call: its normalized arguments (what the api passes the Triton launcher) and,
    once the launcher made it, its plan. ``serial`` names it in launch keys: unique for the
    process, where an ``id`` could come back after the entry is dropped."""

    __slots__ = ("head_size_v", "layout", "plan", "serial", "static")

    def __init__(self, layout: Any, static: dict[str, Any], head_size_v: int) -> None:
        self.layout = layout  # (keeps id(layout) in the key this layout's)
        self.static = static
        self.head_size_v = head_size_v
        self.plan: Any = None
        self.serial = next(_SERIALS)


_SERIALS = itertools.count()
_ENTRIES: dict[tuple[Any, ...], Entry] = {}


def remember(key: tuple[Any, ...], entry: Entry) -> None:
    """Store a call that passed validation (cleared when full: a shape sweep)."""
    if len(_ENTRIES) >= 512:
        _ENTRIES.clear()
    _ENTRIES[key] = entry


def lookup(key: tuple[Any, ...]) -> Entry | None:
    return _ENTRIES.get(key)
