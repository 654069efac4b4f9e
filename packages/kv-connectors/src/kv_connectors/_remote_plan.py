"""A consumer's view of a producer, shared by the transfer connectors (:mod:`.transfer`):
the plan of one request's pull, how it is made, and what is kept per producer address."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kv_connectors.handshake import (
    HandshakeRefused,
    KVTransferParams,
    LayoutConversion,
    plan_conversion,
)
from kv_connectors.views import RegisteredKV

__all__ = ["Planner", "RemotePlan"]


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


class Planner:
    """A consumer's plans for the caches it registered (``kv``): whether and how a producer's
    params load here. What decides it -- the params' transport, model, layouts and TP position
    against this worker's -- repeats for every request of a producer, so each answer (its
    conversions, or the refusal's reason) is kept: parsing and hashing the producer's layouts
    cost ~0.1 ms a request. A new registration gets a new planner."""

    _KEEP = 64  # answers kept (producer layouts x TP positions); then all are dropped

    def __init__(
        self,
        kv: RegisteredKV,
        transport: str,
        model_fingerprint: str | None,
        tp: tuple[int, int],
    ) -> None:
        self.kv, self.transport, self.fingerprint, self.tp = kv, transport, model_fingerprint, tp
        self._memo: dict[tuple[Any, ...], tuple[LayoutConversion, ...] | str] = {}

    def plan(self, params: KVTransferParams) -> RemotePlan:
        """The plan of loading ``params`` here, or ``HandshakeRefused`` with the reason."""
        key = (
            params.transport, params.model_fingerprint, params.layouts_json,
            params.compatibility_hashes, params.tp_rank, params.tp_size,
        )  # fmt: skip
        hit = self._memo.get(key)
        if hit is None:
            try:
                hit = self._conversions(params)
            except HandshakeRefused as exc:
                hit = exc.reason
            if len(self._memo) >= self._KEEP:
                self._memo.clear()
            self._memo[key] = hit
        if isinstance(hit, str):
            raise HandshakeRefused(hit)
        return RemotePlan(params, hit)

    def _conversions(self, params: KVTransferParams) -> tuple[LayoutConversion, ...]:
        if params.transport != self.transport:
            raise HandshakeRefused(
                f"the params name transport {params.transport!r}, this is a {self.transport!r} "
                "connector; decode with the producer's transport"
            )
        if params.model_fingerprint != self.fingerprint:
            raise HandshakeRefused(
                f"producer serves model fingerprint {params.model_fingerprint!r}, this worker "
                f"{self.fingerprint!r}: KV of another model is never loaded; give both workers "
                "the same model (and model_fingerprint)"
            )
        remote = params.layouts()
        local = self.kv.layouts
        if len(remote) != len(local):
            raise HandshakeRefused(
                f"producer registered {len(remote)} caches, this worker {len(local)}"
            )
        convs = tuple(
            plan_conversion(r, lay, src_tp=(params.tp_rank, params.tp_size), dst_tp=self.tp)
            for r, lay in zip(remote, local, strict=True)
        )
        if len({(c.merge, c.split) for c in convs}) != 1:
            raise HandshakeRefused("registered caches convert block sizes by different ratios")
        need = max(c.sources_needed for c in convs)
        if need > 1:
            raise HandshakeRefused(
                f"each local block needs heads from {need} producer ranks; this connector reads "
                "one producer per request (run the consumer at TP >= the producer's)"
            )
        return convs
