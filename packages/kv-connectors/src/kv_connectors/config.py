"""Typed, validated settings: one frozen config object per connector.

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` naming the config,
the field, the value, the bound and the fix. Nothing is clamped. Transports bind to ``127.0.0.1``
unless a config says otherwise: listening on all interfaces is never a default.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Sequence
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
    "check_bool",
    "check_fingerprint",
    "check_int",
    "check_str",
    "check_timeout",
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
    """``value`` as a member of ``cls`` (a member, or its value as a string in any case, or an
    alias); anything else (another type, an unknown name) is refused, never coerced."""
    expected = choices if choices is not None else " / ".join(repr(m.value) for m in cls)
    if isinstance(value, cls):
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"{owner}.{field}={value!r} is a {type(value).__name__}; give one of {expected} "
            f"(a string or a {cls.__name__} member)"
        )
    text = value.lower()
    try:
        return cls((aliases or {}).get(text, text))
    except ValueError:
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


def check_timeout(owner: str, field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            f"{owner}.{field}={value!r} is a {type(value).__name__}; give a number of seconds "
            "> 0 (e.g. 30.0)"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{owner}.{field}={value!r} must be finite and > 0: every transfer has a timeout"
        )
    return float(value)


def check_int(
    owner: str, field: str, value: object, *, minimum: int, maximum: int | None = None
) -> int:
    bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{owner}.{field}={value!r} is a {type(value).__name__}; give an int {bound} "
            "(no float, bool or string is converted)"
        )
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{owner}.{field}={value} is out of range; give an int {bound}")
    return value


def check_ids(owner: str, field: str, values: Sequence[object]) -> None:
    """Every item of ``values`` an int >= 0 (block ids). One pass over plain ints first: a
    request's ids are checked a few times a step on the scheduler's thread, and the per-id
    :func:`check_int` cost ~0.5 ms for 512 blocks; only a list that fails it is checked id by
    id, for the error naming the first bad one (``field[i]``)."""
    ints = [v for v in values if type(v) is int]  # bool and other types fall to the loop
    if len(ints) == len(values) and (not ints or min(ints) >= 0):
        return
    for i, v in enumerate(values):
        check_int(owner, f"{field}[{i}]", v, minimum=0)


def check_bool(owner: str, field: str, value: object) -> bool:
    """A real ``bool`` (``"no"``, ``0`` or ``None`` are refused, never read as truthy/falsy)."""
    if not isinstance(value, bool):
        raise ValueError(
            f"{owner}.{field}={value!r} is a {type(value).__name__}; give True or False"
        )
    return value


def check_str(owner: str, field: str, value: object, *, what: str) -> str:
    """A non-empty ``str`` without surrounding whitespace."""
    if not isinstance(value, str) or not value or value != value.strip():
        raise ValueError(
            f"{owner}.{field}={value!r} must be a non-empty string without surrounding "
            f"whitespace ({what})"
        )
    return value


def check_fingerprint(owner: str, value: object, *, required: bool) -> str | None:
    """``model_fingerprint``: a non-empty string naming the model whose KV this is (a digest of
    its config and weights); ``None`` only where ``required`` is false."""
    if value is None and not required:
        return None
    if value is None:
        raise ValueError(
            f"{owner}.model_fingerprint=None: KV stored under a shared key must name its model, "
            "or two models with the same layout read each other's KV; pass model_fingerprint="
            "a digest of the model's config and weights (e.g. its checkpoint's content hash)"
        )
    return check_str(
        owner, "model_fingerprint", value, what="a digest of the model's config and weights"
    )


def _check_host(owner: str, field: str, value: object) -> str:
    if not isinstance(value, str) or not value or value != value.strip():
        raise ValueError(
            f"{owner}.{field}={value!r} must be a host name or IP address (e.g. {DEFAULT_HOST})"
        )
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
        raise ValueError(f"{owner}.{field}={value!r} must be a string 'host:port'")
    host, _, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
        raise ValueError(f"{owner}.{field}={value!r}: the port must be a decimal int in [1, 65535]")
    return _check_host(owner, field, host), int(port)


@dataclass(frozen=True, kw_only=True)
class OffloadingConfig:
    """GPU <-> (pinned) CPU offload.

    ``cpu_bytes`` is the byte budget of the CPU tier (never exceeded; rounded *down* to whole
    blocks, and at least one block must fit). ``pin_memory`` (a bool) pins the tier when the cache
    is on CUDA (asynchronous copies need pinned pages). ``staging_bytes``: the GPU buffer a CUDA
    cache's blocks are gathered into before one contiguous copy to the tier (and back), split
    between saves and loads, each double-buffered (pieces of a quarter: it must hold four of the
    widest segment rows); larger transfers move in pieces, each a block-copy launch and its
    events per segment: the default's 64 MiB halves hold a Llama-3-8B layer of a 16k-token
    history in one piece (a 4k-token history in two pieces, 2 x 32 layer segments a CPU-tier
    hit, took an H200 host 0.3-0.6 ms a segment to enqueue, inside the forward). ``timeout_s``
    bounds ``close()``'s wait for saves still copying. The tier lives in this process, so it
    never holds another model's KV: it needs no model fingerprint.
    """

    cpu_bytes: int
    policy: EvictionPolicy | str = EvictionPolicy.LRU
    pin_memory: bool = True
    staging_bytes: int = 256 * 2**20
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        owner = "OffloadingConfig"
        check_int(owner, "cpu_bytes", self.cpu_bytes, minimum=1)
        check_int(owner, "staging_bytes", self.staging_bytes, minimum=1)
        check_bool(owner, "pin_memory", self.pin_memory)
        object.__setattr__(self, "policy", EvictionPolicy.parse(self.policy, owner=owner))
        object.__setattr__(self, "timeout_s", check_timeout(owner, "timeout_s", self.timeout_s))


@dataclass(frozen=True, kw_only=True)
class FilesystemConfig:
    """Blocks as files under ``root`` (one file per block hash, written atomically).

    ``model_fingerprint`` (required): what the KV depends on beyond its layout — a digest of the
    model's config and weights. It is part of every file's key, so two models with the same
    layout sharing a root never read each other's KV; there is no default, because a shared key
    that names no model is exactly that bug. ``fsync`` makes each file durable before it becomes
    visible (turn off only for tests on throwaway directories). ``timeout_s`` bounds each load.
    ``stale_tmp_s``: a temporary file (a save in progress) older than this is a dead writer's
    and is removed (see :meth:`~kv_connectors.FilesystemConnector.clean_stale_temporaries`).
    ``staging_bytes``: pinned host memory, allocated once at registration (CUDA caches), that
    saves gather into while their files are written, in four slabs (a save larger than a slab
    moves in several); a save that finds every slab writing gets fresh pinned memory, whose
    allocation stops the host (~50 ms for 256 MiB on an H200 host). 0: no slabs.
    """

    root: Path | str
    model_fingerprint: str
    fsync: bool = True
    timeout_s: float = 30.0
    stale_tmp_s: float = 3600.0
    staging_bytes: int = 512 * 2**20

    def __post_init__(self) -> None:
        owner = "FilesystemConfig"
        if not isinstance(self.root, str | Path) or not str(self.root):
            raise ValueError(
                f"{owner}.root={self.root!r} must be a directory path (a non-empty str or Path)"
            )
        object.__setattr__(self, "root", Path(self.root))
        check_fingerprint(owner, self.model_fingerprint, required=True)
        check_bool(owner, "fsync", self.fsync)
        object.__setattr__(self, "timeout_s", check_timeout(owner, "timeout_s", self.timeout_s))
        object.__setattr__(
            self, "stale_tmp_s", check_timeout(owner, "stale_tmp_s", self.stale_tmp_s)
        )
        check_int(owner, "staging_bytes", self.staging_bytes, minimum=0)


def _check_endpoint(cfg: P2pConfig | NixlConfig, owner: str) -> None:
    """The side-channel address, engine id, mode, role and model fingerprint of a disaggregated
    config (P2P, NIXL)."""
    _check_host(owner, "host", cfg.host)
    check_int(owner, "port", cfg.port, minimum=0, maximum=65535)
    check_str(owner, "engine_id", cfg.engine_id, what="this worker's engine id")
    object.__setattr__(cfg, "mode", TransferMode.parse(cfg.mode, owner=owner))
    object.__setattr__(cfg, "role", KVRole.parse(cfg.role, owner=owner))
    check_fingerprint(owner, cfg.model_fingerprint, required=False)


def _check_timeouts(cfg: P2pConfig | NixlConfig, owner: str) -> None:
    object.__setattr__(cfg, "timeout_s", check_timeout(owner, "timeout_s", cfg.timeout_s))
    object.__setattr__(
        cfg, "abandon_after_s", check_timeout(owner, "abandon_after_s", cfg.abandon_after_s)
    )


@dataclass(frozen=True, kw_only=True)
class P2pConfig:
    """Direct transfer between two workers over ``torch.distributed`` point-to-point.

    ``host``/``port``: where this worker's side channel listens (port 0 = pick a free one).
    ``role``: ``producer``, ``consumer`` or ``both`` (see :mod:`kv_connectors.transfer`).
    ``backend``: ``"gloo"`` (CPU tensors), ``"nccl"`` (CUDA tensors) or ``"auto"`` (from the cache's
    device). ``buffer_bytes`` bounds the staging buffer of one transfer chunk on each side (a
    transfer larger than it moves in several chunks). ``timeout_s`` bounds every send, receive
    and side-channel reply. ``abandon_after_s``: a finished request no pull has *started* for by
    then is given up on (a started pull keeps its blocks until it ends). ``model_fingerprint``:
    the model whose KV this worker serves or loads (a digest of its config and weights); a
    consumer refuses a producer whose fingerprint differs (``None`` matches only ``None``).
    ``layerwise``: a consumer's pulls between identical layouts load *inside* the forward pass
    (``load_async=False``), segment by segment: ``wait_for_layer_load(i)`` waits for layer ``i``
    only, while a streaming producer (``P2pConnector.stream_request``) is still computing the
    later layers. Converting pulls stay asynchronous (whole requests).
    """

    host: str = DEFAULT_HOST
    port: int = 0
    engine_id: str = "p2p"
    role: KVRole | str = KVRole.BOTH
    mode: TransferMode | str = TransferMode.READ
    backend: str = "auto"
    #: 256 MiB (two 128 MiB messages in flight): each chunk costs a gather and a scatter launch
    #: and a wait on each side's host (~0.3-0.5 ms on an H200 host), so an 8k-token request of a
    #: 16-layer model (268 MB) moved in 8 chunks at 64 MiB was host-bound (~54 GB/s, bench_disagg
    #: --trace); vLLM's P2P NCCL connector keeps a 1 GB buffer. Staging grows only as needed.
    buffer_bytes: int = 256 * 2**20
    push_to: str | None = None
    receive_bytes: int = 2**30
    timeout_s: float = 30.0
    abandon_after_s: float = 120.0
    model_fingerprint: str | None = None
    layerwise: bool = False

    def __post_init__(self) -> None:
        owner = "P2pConfig"
        if not isinstance(self.layerwise, bool):
            raise TypeError(
                f"{owner}.layerwise={self.layerwise!r} is a {type(self.layerwise).__name__}; "
                "give True or False"
            )
        _check_endpoint(self, owner)
        if not isinstance(self.backend, str) or self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"{owner}.backend={self.backend!r} must be 'auto', 'gloo' or 'nccl'")
        check_int(owner, "buffer_bytes", self.buffer_bytes, minimum=1)
        check_int(owner, "receive_bytes", self.receive_bytes, minimum=1)
        if self.push_to is not None:
            parse_address(owner, "push_to", self.push_to)
        _check_timeouts(self, owner)


@dataclass(frozen=True, kw_only=True)
class NixlConfig:
    """NVIDIA NIXL agents (UCX) moving blocks in place between registered caches.

    ``host``/``port``: this worker's side channel (handshake: layout, agent metadata, descriptors).
    ``role``: ``producer``, ``consumer`` or ``both``, as for P2P.
    ``mode``: ``READ`` (the consumer pulls from the producer; default); ``WRITE`` is not
    implemented for NIXL yet and raises. ``backends``: a tuple (or list) of NIXL plugin names
    (a bare string is refused: it is not a list of names). ``timeout_s`` bounds the handshake
    and every transfer, and is the lease a consumer asks for its READs (see :mod:`kv_connectors.nixl`);
    ``abandon_after_s`` and ``model_fingerprint`` as for P2P.
    ``staging_bytes``: the registered buffer a converting pull reads producer rows into (layouts
    that differ; identical layouts are read in place). ``progress_thread`` (a bool): NIXL's own
    progress thread (on by default); off, transfers progress when the connector polls them
    (``get_finished``), which spares CPU on small hosts and in tests.
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
    model_fingerprint: str | None = None

    def __post_init__(self) -> None:
        owner = "NixlConfig"
        _check_endpoint(self, owner)
        backends = self.backends
        if not isinstance(backends, tuple | list) or not backends:
            raise ValueError(
                f"{owner}.backends={backends!r} must be a non-empty tuple of plugin names, "
                "e.g. ('UCX',) (a bare string is not a tuple of names)"
            )
        for i, b in enumerate(backends):
            check_str(owner, f"backends[{i}]", b, what="a NIXL plugin name such as 'UCX'")
        object.__setattr__(self, "backends", tuple(backends))
        check_int(owner, "staging_bytes", self.staging_bytes, minimum=1)
        check_bool(owner, "progress_thread", self.progress_thread)
        _check_timeouts(self, owner)
