"""kv-connectors (layer 4): moving KV-cache blocks between GPUs, hosts, disks and machines.

Not built yet. This package will hold the connector contract (scheduler side and worker side),
CPU offload, a disk tier, P2P over torch.distributed (NCCL/gloo) and NIXL (UCX) transfer — all
reading only the ``kv_spec.KVCacheLayout`` descriptor and its ``compatibility_hash``, never a backend
or model kind. Its issue is filed once the layers below are checked. Until then it exports only its
version.
"""

from __future__ import annotations

__version__ = "0.2.0"

__all__ = ["__version__"]
