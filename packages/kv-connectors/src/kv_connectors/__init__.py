"""kv-connectors (layer 4): moving KV-cache blocks between GPUs, hosts, disks and machines.

Every connector speaks one contract (:class:`KVConnector`: a scheduler side and a worker side),
takes its settings as one typed config object, and reads only the ``kv_spec.KVCacheLayout``
descriptor of the caches it moves — never a backend name, a model kind or a tensor shape. Blocks
move whole, as byte rows (every layer slot's page, inline quantization scales included). Two
workers exchange the layout JSON and ``compatibility_hash`` in the handshake
(:class:`KVTransferParams`) and convert orders, block sizes and TP head splits where an exact
conversion exists, refusing with a reason otherwise.

Connectors: :class:`OffloadingConnector` (GPU <-> pinned CPU), :class:`FilesystemConnector` (disk,
survives restarts), :class:`P2pConnector` (torch.distributed: gloo/NCCL), :class:`NixlConnector`
(NIXL over UCX; ``from kv_connectors.nixl import NixlConnector``, needs the ``nixl`` extra) and :class:`MultiConnector`.
P2P and NIXL share :class:`TransferConnector` (:mod:`kv_connectors.transfer`), the base of a
producer -> consumer transport.
"""

from __future__ import annotations

from kv_connectors.base import (
    FAULTS,
    ConnectorCapabilities,
    ConnectorMetadata,
    KVConnector,
    LoadSpec,
    RequestLike,
    SaveSpec,
    transfer_params_of,
)
from kv_connectors.config import (
    EvictionPolicy,
    FilesystemConfig,
    KVRole,
    NixlConfig,
    OffloadingConfig,
    P2pConfig,
    TransferMode,
)
from kv_connectors.filesystem import BlockFileError, FilesystemConnector
from kv_connectors.handshake import (
    HandshakeRefused,
    KVTransferParams,
    LayoutConversion,
    convert_rows,
    plan_conversion,
)
from kv_connectors.multi import MultiConnector, MultiConnectorMetadata
from kv_connectors.offloading import OffloadingConnector, OffloadStats
from kv_connectors.p2p import P2pConnector
from kv_connectors.policies import ARCPolicy, LRUPolicy, Policy
from kv_connectors.transfer import RemotePlan, TransferConnector
from kv_connectors.views import CacheSegment, RegisteredKV

__version__ = "0.4.0"

__all__ = [
    "FAULTS",
    "ARCPolicy",
    "BlockFileError",
    "CacheSegment",
    "ConnectorCapabilities",
    "ConnectorMetadata",
    "EvictionPolicy",
    "FilesystemConfig",
    "FilesystemConnector",
    "HandshakeRefused",
    "KVConnector",
    "KVRole",
    "KVTransferParams",
    "LRUPolicy",
    "LayoutConversion",
    "LoadSpec",
    "MultiConnector",
    "MultiConnectorMetadata",
    "NixlConfig",
    "OffloadStats",
    "OffloadingConfig",
    "OffloadingConnector",
    "P2pConfig",
    "P2pConnector",
    "Policy",
    "RegisteredKV",
    "RemotePlan",
    "RequestLike",
    "SaveSpec",
    "TransferConnector",
    "TransferMode",
    "__version__",
    "convert_rows",
    "plan_conversion",
    "transfer_params_of",
]
