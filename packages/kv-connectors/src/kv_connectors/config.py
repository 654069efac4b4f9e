"""Typed, validated settings: one frozen config object per connector.

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` naming the config,
the field, the value, the bound and the fix. Nothing is clamped. Transports bind to ``127.0.0.1``
unless a config says otherwise: listening on all interfaces is never a default.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TypeVar

__all__ = [
    "DEFAULT_HOST",
    "EvictionPolicy",
    "FilesystemConfig",
    "KVRole",
    "NixlConfig",
    "OffloadingConfig",
    "P2pConfig",
    "TransferMode",
    "parse_address",
]

DEFAULT_HOST = "127.0.0.1"

_E = TypeVar("_E", bound=Enum)


def _parse_enum(
    cls: type[_E],
    value: object,
    *,
    owner: str,
    field: str,
    choices: str | None = None,
    aliases: dict[str, str] | None = None,
) -> _E:
    """``value`` as a member of ``cls`` (a member, or its value in any case, or an alias)."""
    if isinstance(value, cls):
        return value
    text = str(value).lower()
    try:
        return cls((aliases or {}).get(text, text))
    except ValueError:
        expected = choices if choices is not None else [m.value for m in cls]
        raise ValueError(f"{owner}.{field}={value!r} is not one of {expected}") from None


class EvictionPolicy(str, Enum):
    """Which stored block an offload tier drops when its byte budget is full."""

    LRU = "lru"  # least recently used
    ARC = "arc"  # adaptive replacement cache (recency + frequency lists with ghost lists)

    @classmethod
    def parse(cls, value: object, *, owner: str) -> EvictionPolicy:
        return _parse_enum(cls, value, owner=owner, field="policy")


class KVRole(str, Enum):
    """What a disaggregated worker does: serve finished requests, load them, or both."""

    PRODUCER = "producer"  # prefill: serves every finished request, never loads
    CONSUMER = "consumer"  # decode: loads requests that carry producer params, never serves
    BOTH = "both"  # serves the finished requests it did not load from a producer

    @classmethod
    def parse(cls, value: object, *, owner: str) -> KVRole:
        return _parse_enum(cls, value, owner=owner, field="role")


class TransferMode(str, Enum):
    """Who starts a disaggregated transfer: the consumer pulls (``READ``, the default) or the
    producer pushes into blocks the consumer announced (``WRITE``)."""

    READ = "read"
    WRITE = "write"

    @classmethod
    def parse(cls, value: object, *, owner: str) -> TransferMode:
        return _parse_enum(
            cls,
            value,
            owner=owner,
            field="mode",
            choices="read (pull) / write (push)",
            aliases={"pull": "read", "push": "write"},
        )


def _check_timeout(owner: str, field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{owner}.{field}={value!r} must be a number of seconds")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{owner}.{field}={value!r} must be finite and > 0: every transfer has a timeout"
        )
    return float(value)


def _check_int(owner: str, field: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{field}={value!r} must be an int >= {minimum}")
    if value < minimum:
        raise ValueError(f"{owner}.{field}={value} must be >= {minimum}")
    return value


def _check_host(owner: str, field: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{owner}.{field}={value!r} must be a host name or IP address")
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return value  # a host name: resolved by the socket layer
    if ip.is_unspecified:
        raise ValueError(
            f"{owner}.{field}={value!r} listens on every interface; give the one address the "
            f"peers use (default {DEFAULT_HOST})"
        )
    return value


def parse_address(owner: str, field: str, value: object) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``, checked (IPv6 hosts in brackets: ``"[::1]:5000"``)."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"{owner}.{field}={value!r} must be 'host:port'")
    host, _, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{owner}.{field}={value!r}: port must be in [1, 65535]")
    return _check_host(owner, field, host), int(port)


@dataclass(frozen=True, kw_only=True)
class OffloadingConfig:
    """GPU <-> (pinned) CPU offload.

    ``cpu_bytes`` is the byte budget of the CPU tier (never exceeded; rounded *down* to whole
    blocks, and at least one block must fit). ``pin_memory`` pins the tier when the cache is on CUDA
    (asynchronous copies need pinned pages). ``staging_bytes``: the GPU buffer a CUDA cache's
    blocks are gathered into before one contiguous copy to the tier (and back); larger transfers
    move in pieces. ``timeout_s`` bounds every wait on a copy.
    """

    cpu_bytes: int
    policy: EvictionPolicy | str = EvictionPolicy.LRU
    pin_memory: bool = True
    staging_bytes: int = 64 * 2**20
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        owner = "OffloadingConfig"
        _check_int(owner, "cpu_bytes", self.cpu_bytes, minimum=1)
        _check_int(owner, "staging_bytes", self.staging_bytes, minimum=1)
        object.__setattr__(self, "policy", EvictionPolicy.parse(self.policy, owner=owner))
        object.__setattr__(self, "timeout_s", _check_timeout(owner, "timeout_s", self.timeout_s))


@dataclass(frozen=True, kw_only=True)
class FilesystemConfig:
    """Blocks as files under ``root`` (one file per block hash, written atomically).

    ``fsync`` makes each file durable before it becomes visible (turn off only for tests
    on throwaway directories). ``timeout_s`` bounds each load.
    """

    root: Path | str
    fsync: bool = True
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        owner = "FilesystemConfig"
        if not isinstance(self.root, str | Path) or not str(self.root):
            raise ValueError(f"{owner}.root={self.root!r} must be a directory path")
        object.__setattr__(self, "root", Path(self.root))
        object.__setattr__(self, "timeout_s", _check_timeout(owner, "timeout_s", self.timeout_s))


def _check_endpoint(cfg: P2pConfig | NixlConfig, owner: str) -> None:
    """The side-channel address, engine id, mode and role of a disaggregated config (P2P, NIXL)."""
    _check_host(owner, "host", cfg.host)
    _check_int(owner, "port", cfg.port, minimum=0)
    if cfg.port > 65535:
        raise ValueError(f"{owner}.port={cfg.port} must be <= 65535")
    if not isinstance(cfg.engine_id, str) or not cfg.engine_id:
        raise ValueError(f"{owner}.engine_id={cfg.engine_id!r} must be a non-empty string")
    object.__setattr__(cfg, "mode", TransferMode.parse(cfg.mode, owner=owner))
    object.__setattr__(cfg, "role", KVRole.parse(cfg.role, owner=owner))


def _check_timeouts(cfg: P2pConfig | NixlConfig, owner: str) -> None:
    object.__setattr__(cfg, "timeout_s", _check_timeout(owner, "timeout_s", cfg.timeout_s))
    object.__setattr__(
        cfg, "abandon_after_s", _check_timeout(owner, "abandon_after_s", cfg.abandon_after_s)
    )


@dataclass(frozen=True, kw_only=True)
class P2pConfig:
    """Direct transfer between two workers over ``torch.distributed`` point-to-point.

    ``host``/``port``: where this worker's side channel listens (port 0 = pick a free one).
    ``role``: ``producer``, ``consumer`` or ``both`` (see :mod:`kv_connectors._disagg`).
    ``backend``: ``"gloo"`` (CPU tensors), ``"nccl"`` (CUDA tensors) or ``"auto"`` (from the cache's
    device). ``buffer_bytes`` bounds the staging buffer of one transfer chunk on each side (a
    transfer larger than it moves in several chunks). ``timeout_s`` bounds every send, receive
    and side-channel reply.
    """

    host: str = DEFAULT_HOST
    port: int = 0
    engine_id: str = "p2p"
    role: KVRole | str = KVRole.BOTH
    mode: TransferMode | str = TransferMode.READ
    backend: str = "auto"
    buffer_bytes: int = 64 * 2**20
    push_to: str | None = None
    receive_bytes: int = 2**30
    timeout_s: float = 30.0
    abandon_after_s: float = 120.0

    def __post_init__(self) -> None:
        owner = "P2pConfig"
        _check_endpoint(self, owner)
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"{owner}.backend={self.backend!r} must be 'auto', 'gloo' or 'nccl'")
        _check_int(owner, "buffer_bytes", self.buffer_bytes, minimum=1)
        _check_int(owner, "receive_bytes", self.receive_bytes, minimum=1)
        if self.push_to is not None:
            parse_address(owner, "push_to", self.push_to)
        _check_timeouts(self, owner)


@dataclass(frozen=True, kw_only=True)
class NixlConfig:
    """NVIDIA NIXL agents (UCX) moving blocks in place between registered caches.

    ``host``/``port``: this worker's side channel (handshake: layout, agent metadata, descriptors).
    ``role``: ``producer``, ``consumer`` or ``both``, as for P2P.
    ``mode``: ``READ`` (the consumer pulls from the producer; default); ``WRITE`` is not
    implemented for NIXL yet and raises. ``timeout_s`` bounds the handshake and every transfer;
    ``abandon_after_s`` as for P2P.
    ``staging_bytes``: the registered buffer a converting pull reads producer rows into (layouts
    that differ; identical layouts are read in place). ``progress_thread``: NIXL's own progress thread (on by default); off, transfers progress when
    the connector polls them (``get_finished``), which spares CPU on small hosts and in tests.
    """

    host: str = DEFAULT_HOST
    port: int = 0
    engine_id: str = "nixl"
    role: KVRole | str = KVRole.BOTH
    mode: TransferMode | str = TransferMode.READ
    backends: tuple[str, ...] = ("UCX",)
    staging_bytes: int = 64 * 2**20
    timeout_s: float = 30.0
    abandon_after_s: float = 120.0
    progress_thread: bool = True

    def __post_init__(self) -> None:
        owner = "NixlConfig"
        _check_endpoint(self, owner)
        if not self.backends or not all(isinstance(b, str) and b for b in self.backends):
            raise ValueError(f"{owner}.backends={self.backends!r} must name at least one plugin")
        object.__setattr__(self, "backends", tuple(self.backends))
        _check_int(owner, "staging_bytes", self.staging_bytes, minimum=1)
        _check_timeouts(self, owner)
