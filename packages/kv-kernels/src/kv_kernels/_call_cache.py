"""Call caches of the hot ops on CUDA: a call alike an earlier, validated one skips the api's
checks and reuses its launch plan (the grid, the constexprs, the launch key).

Why. A decode step calls each op with the same shapes layer after layer, and the api checks cost
more host time than the launch (issue 32: <= 20 us a launch). :mod:`.paged_attention._fast` did
it first for attention; this module holds what the other ops share.

The rule of a key: it names every input property that a check, the launch plan or Triton's
specialization reads -- each tensor's type, shape, strides, dtype, device index and whether its
address is 16-byte aligned (:func:`tensor_key`), and every option by type and value -- and
nothing that changes per call without changing those answers. A check that reads an address
(the fused ops' overlap rules) or a value (CPU-side slot and position ranges; they never run on
CUDA) is not part of a cached decision: it runs per call, or is the kernel's guarantee (slots
< 0 skipped, nothing written outside the cache). Only CUDA calls are cached, and only after the
full path validated them; ``KV_KERNELS_VALIDATE=1`` (read per call) or :data:`ENABLED` set to
False take the full path every time.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from typing import Any

__all__ = ["ENABLED", "CallCache", "Entry", "fast_path_allowed", "scalar_key", "tensor_key"]

#: False: every call takes the full path (benchmarks' "plain" runs, the GPU parity tests)
ENABLED = os.environ.get("KV_KERNELS_CALL_CACHE", "1").strip().lower() not in ("0", "false", "off")

# os.environ's own mapping (encoded keys): one lookup there costs ~0.1 us where os.environ.get
# costs ~1 us (it encodes the key and decodes the value)
_ENV_GET: Any = None
_VALIDATE: Any = "KV_KERNELS_VALIDATE"
if isinstance(getattr(os.environ, "_data", None), dict) and hasattr(os.environ, "encodekey"):
    _ENV_GET = os.environ._data.get  # type: ignore[attr-defined]
    _VALIDATE = os.environ.encodekey(_VALIDATE)
_TRUE = ("1", "true", "on", "yes")


def fast_path_allowed() -> bool:
    """Whether a call may use its op's cache: :data:`ENABLED` and ``KV_KERNELS_VALIDATE`` not
    set (as :func:`kv_kernels._common.host_validation_requested` reads it)."""
    if not ENABLED:
        return False
    raw = _ENV_GET(_VALIDATE) if _ENV_GET is not None else os.environ.get(_VALIDATE)
    if raw is None:
        return True
    text = raw.decode() if isinstance(raw, bytes) else raw
    return text.strip().lower() not in _TRUE


def tensor_key(t: Any) -> Any:
    """What the checks and Triton read of a tensor (``None`` stays ``None``): type, shape,
    strides, dtype, device index (-1 on the CPU) and the address's 16-byte alignment.
    ``AttributeError`` / ``TypeError`` for what is not a tensor (the caller then takes the full
    path, which raises its own error)."""
    if t is None:
        return None
    return (type(t), t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15)


def scalar_key(x: Any) -> Any:
    """An option by type and value (``1`` is not ``1.0`` nor ``True`` to a check)."""
    return (type(x), x)


class Entry:
    """A validated call: what its op's fast path needs (``static``) and, once the launcher made
    it, its launch plan. ``serial`` is unique for the process (an ``id`` could come back)."""

    __slots__ = ("plan", "serial", "static")

    def __init__(self, static: Any = None) -> None:
        self.static = static
        self.plan: Any = None
        self.serial = next(_SERIALS)


_SERIALS = itertools.count()


class CallCache:
    """Validated calls of one op by key (cleared when full: a sweep of shapes; a serving process
    has a few per op)."""

    __slots__ = ("_entries", "capacity", "name")

    def __init__(self, name: str, capacity: int = 512) -> None:
        self.name = name
        self.capacity = capacity
        self._entries: dict[Any, Entry] = {}

    def get(self, key: Any) -> Entry | None:
        """The entry of ``key`` (None for None, or for a key with an unhashable option)."""
        try:
            return self._entries.get(key) if key is not None else None
        except TypeError:
            return None

    def put(self, key: Any, entry: Entry) -> Entry:
        """Keep ``entry`` under ``key`` (a call the full path validated); returns it."""
        if len(self._entries) >= self.capacity:
            self._entries.clear()
        with contextlib.suppress(TypeError):  # (an unhashable option: never cached)
            self._entries[key] = entry
        return entry

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
