"""A consumer's view of a producer, shared by the transfer connectors (:mod:`.transfer`):
the plan of one request's pull and what is kept per producer address."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kv_connectors.handshake import KVTransferParams, LayoutConversion

__all__ = ["RemotePlan"]


class _Peer(Protocol):
    """What the consumer keeps per producer address: the side-channel socket, the producer's live
    compatibility hashes, its identity (engine id, hashes, model fingerprint) and a lock that
    serializes pulls (P2P sessions, NIXL remote agents)."""

    sock: socket.socket
    hashes: tuple[str, ...]
    identity: tuple[Any, ...]
    lock: threading.Lock


def _identity(engine_id: str, hashes: Sequence[str], fingerprint: str | None) -> tuple[Any, ...]:
    return (engine_id, tuple(hashes), fingerprint)


@dataclass(frozen=True)
class RemotePlan:
    """A consumer's plan for one request: which producer blocks fill which local blocks, how."""

    params: KVTransferParams  # block_ids: the producer blocks to read, in request order
    convs: tuple[LayoutConversion, ...]  # one per registered cache

    @property
    def identity(self) -> bool:
        return all(c.identity for c in self.convs)

    @property
    def merge(self) -> int:
        return self.convs[0].merge

    @property
    def split(self) -> int:
        return self.convs[0].split
