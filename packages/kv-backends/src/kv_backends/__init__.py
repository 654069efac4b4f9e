"""kv-backends: attention backends over the paged KV cache, capability manifests, and a selector
that explains itself.

Pick a backend for a catalogue model's layers and read why::

    from kv_backends import Platform, configs_for_model, select_backend
    for name, cfg in configs_for_model("gpt-oss-120b").items():
        print(select_backend(cfg, Platform.cuda((9, 0), installed={"flash_attn.cute"})))
"""

from __future__ import annotations

from kv_backends.base import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    LayerParams,
    MetadataBuilder,
    kernel_block_view,
    kernel_split_problem,
)
from kv_backends.capabilities import CUDAGRAPH_LEVELS, BackendCapabilities
from kv_backends.config import (
    AttentionConfig,
    Platform,
    check_tensor_parallel,
    configs_for_model,
)
from kv_backends.metadata import CommonAttentionMetadata
from kv_backends.registry import BACKEND_CLASSES, BACKEND_PRIORITY, backend_names, get_backend
from kv_backends.selector import (
    NoBackendError,
    Rejection,
    Selection,
    describe_config,
    prepare_kernel_block_sizes,
    select_backend,
)

__version__ = "0.4.0"

__all__ = [
    "BACKEND_CLASSES",
    "BACKEND_PRIORITY",
    "CUDAGRAPH_LEVELS",
    "AttentionBackend",
    "AttentionConfig",
    "AttentionImpl",
    "AttentionMetadata",
    "BackendCapabilities",
    "CommonAttentionMetadata",
    "LayerParams",
    "MetadataBuilder",
    "NoBackendError",
    "Platform",
    "Rejection",
    "Selection",
    "backend_names",
    "check_tensor_parallel",
    "configs_for_model",
    "describe_config",
    "get_backend",
    "kernel_block_view",
    "kernel_split_problem",
    "prepare_kernel_block_sizes",
    "select_backend",
]
