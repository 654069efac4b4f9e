"""``MultiConnector``: several connectors as one — load from the one that has the blocks, save to all.

A typical stack is ``[OffloadingConnector, FilesystemConnector]``: hot prefixes come back from
pinned CPU memory, cold ones from disk after a restart, and every finished request is written to
both. For a request, the child that can supply the most tokens loads them (the earliest child wins
a tie, so order the list fastest first); the others are told nothing was matched. A request whose
blocks several children hold (``delay_free``) is reported in ``done_sending`` once *all* of them
have reported it; load errors and ``done_recving`` are the union over the children.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kv_kernels import KVCacheStorage
from kv_spec import KVCacheLayout

from kv_connectors.base import ConnectorCapabilities, ConnectorMetadata, KVConnector, RequestLike

__all__ = ["MultiConnector", "MultiConnectorMetadata"]


@dataclass(frozen=True)
class MultiConnectorMetadata(ConnectorMetadata):
    """Each child's metadata, in child order (``loads``/``saves`` hold the union, for reading)."""

    children: tuple[ConnectorMetadata, ...] = ()


class MultiConnector(KVConnector):
    """Loads from the child that has the blocks, saves to all; see the module docstring."""

    def __init__(self, connectors: Sequence[KVConnector]) -> None:
        children = list(connectors)
        if not children:
            raise ValueError("MultiConnector needs at least one connector")
        for i, c in enumerate(children):
            if not isinstance(c, KVConnector):
                raise TypeError(f"connectors[{i}] is a {type(c).__name__}, not a KVConnector")
        sizes = {c.block_size for c in children}
        if len(sizes) != 1:
            raise ValueError(f"child connectors count blocks of different sizes {sorted(sizes)}")
        super().__init__(block_size=sizes.pop())
        self.connectors = tuple(children)
        kinds = {c.capabilities.kind for c in children}
        self._capabilities = ConnectorCapabilities(  # what the children offer together
            kind=kinds.pop() if len(kinds) == 1 else "store",
            load_async=any(c.capabilities.load_async for c in children),
            converts_layouts=all(c.capabilities.converts_layouts for c in children),
            # a fault one child handles may be served by another child instead: only faults
            # every child handles are the multi's
            faults=tuple(sorted(set.intersection(*(set(c.capabilities.faults) for c in children)))),
        )
        self._chosen: dict[str, int] = {}
        self._sending: dict[str, set[int]] = {}  # request -> children still holding its blocks

    #: A MultiConnector's capabilities are its children's (:attr:`capabilities`).
    CAPABILITIES = ConnectorCapabilities(kind="store", load_async=False)

    @property
    def capabilities(self) -> ConnectorCapabilities:
        return self._capabilities

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self._check_computed(num_computed_tokens)
        best, best_i, best_async = 0, -1, False
        for i, c in enumerate(self.connectors):
            tokens, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens > best:
                best, best_i, best_async = tokens, i, load_async
        if best_i >= 0:
            self._chosen[request.request_id] = best_i
        return best, best_async

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        chosen = self._chosen.pop(request.request_id, -1)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(
                request, block_ids, num_external_tokens if i == chosen else 0
            )

    def build_connector_meta(self) -> MultiConnectorMetadata:
        metas = tuple(c.build_connector_meta() for c in self.connectors)
        return MultiConnectorMetadata(
            loads=tuple(s for m in metas for s in m.loads),
            saves=tuple(s for m in metas for s in m.saves),
            children=metas,
        )

    def blocks_computed(self, request: RequestLike, block_ids: Sequence[int]) -> None:
        for c in self.connectors:
            c.blocks_computed(request, block_ids)

    def request_finished(
        self, request: RequestLike, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        holders: set[int] = set()
        params: dict[str, Any] | None = None
        for i, c in enumerate(self.connectors):
            delay, p = c.request_finished(request, block_ids)
            if delay:
                holders.add(i)
            if params is None:
                params = p
        if holders:
            self._sending[request.request_id] = holders
        return bool(holders), params

    def abort_request(self, request_id: str) -> None:
        self._chosen.pop(request_id, None)
        for c in self.connectors:
            c.abort_request(request_id)

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(
        self,
        storages: KVCacheStorage | Sequence[KVCacheStorage],
        layouts: KVCacheLayout | Sequence[KVCacheLayout],
    ) -> None:
        for c in self.connectors:
            c.register_kv_caches(storages, layouts)
        self._worker.kv = self.connectors[0].kv  # (``kv``: the same caches, read as one)

    def _child_meta(self, meta: ConnectorMetadata, i: int) -> ConnectorMetadata:
        if not isinstance(meta, MultiConnectorMetadata) or len(meta.children) != len(
            self.connectors
        ):
            raise TypeError("MultiConnector takes the metadata its own build_connector_meta made")
        return meta.children[i]

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        for i, c in enumerate(self.connectors):
            c.start_load_kv(self._child_meta(meta, i))

    def wait_for_layer_load(self, layer: int) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, meta: ConnectorMetadata) -> None:
        for i, c in enumerate(self.connectors):
            c.save_kv_layer(layer, self._child_meta(meta, i))

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def handle_preemptions(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        for c in self.connectors:
            c.handle_preemptions(ids)

    def get_finished(self, finished_req_ids: Iterable[str] = ()) -> tuple[set[str], set[str]]:
        ids = list(finished_req_ids)
        sending: set[str] = set()
        recving: set[str] = set()
        for i, c in enumerate(self.connectors):
            s, r = c.get_finished(ids)
            recving |= r
            for rid in s:
                left = self._sending.get(rid)
                if left is None:
                    continue
                left.discard(i)
                if not left:
                    del self._sending[rid]
                    sending.add(rid)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        out: set[int] = set()
        for c in self.connectors:
            out |= c.get_block_ids_with_load_errors()
        return out

    def get_request_ids_with_save_errors(self) -> set[str]:
        out: set[str] = set()
        for c in self.connectors:
            out |= c.get_request_ids_with_save_errors()
        return out

    @property
    def save_error_reasons(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for c in self.connectors:
            out.update(c.save_error_reasons)
        return out

    @property
    def load_error_reasons(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for c in self.connectors:
            out.update(c.load_error_reasons)
        return out

    def close(self) -> None:
        for c in self.connectors:
            c.close()
