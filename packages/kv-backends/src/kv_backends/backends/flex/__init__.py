"""FLEX_ATTENTION: torch FlexAttention over the paged cache, with a block mask built per batch.

One module a job, talking through public names:

- :mod:`.backend`: the backend class and its ``CAPABILITIES`` literal;
- :mod:`.impl`: the per-layer impl (the Flex calls, sinks, window merges, the output);
- :mod:`.metadata`: per-batch metadata and the builder that owns the persistent index buffers;
- :mod:`.options`: the tiles (:class:`FlexOptions`) and the builder's tile options;
- :mod:`.geometry`: the kernel-block view as physical tokens, cut into 32-bit windows;
- :mod:`.entries`: a batch's block-mask entries (trimmed tiles, full tiles);
- :mod:`.mask_mods`: the exact per-token-pair mask mods and the score mod;
- :mod:`.span`: the per-row span mask mods, the default where exact;
- :mod:`.windows`: the flattened call's block masks, one per cache window;
- :mod:`.decode`: the decode call (decodes as a batch of their own);
- :mod:`.gather`: the gathered prefill (``prefill="gather"``);
- :mod:`.compiled`: the compiled entry point and its scoped Dynamo limits;
- :mod:`.trainer`: the trainer's dense calls ("rollout equals trainer").

``kv_backends.backends.flex_attention`` and ``kv_backends.backends.flex_trainer`` (the paths
before the package) re-export the same names.

How the cache is seen. The kernel-block view ``[B, H, n, C]`` of a token-major (NHD) order has a
token stride ``sn`` and a block stride ``sb = tpb * sn`` (``tpb = n`` for LBNHC, ``L * n`` for
BLNHC, more with padded pages). So the whole layer is one strided sequence of *physical tokens*:
K is ``[1, H, T_phys, D]`` with strides ``(sh, sn, 1)`` and physical token ``t`` is in-block token
``t % tpb`` of kernel block ``t // tpb`` (in-block tokens ``>= n`` belong to other layers or to
padding and are always masked). HND orders put heads outside tokens, so no such view exists: they
are rejected, and the reason says so.

The batch. Queries are flattened to ``[1, Hq, T, D]``; query block ``i`` is tokens
``[i * q_block_size, (i + 1) * q_block_size)`` and may span several requests. Its row of
``kv_indices`` lists every FlexAttention KV block (``kv_block_size`` physical tokens) any of its
requests needs, trimmed to the causal bound and the window. ``mask_mod`` then decides per token
pair: ``physical -> logical`` is a per-block table (``phys_to_logical[block]``, written for the
blocks of this batch only: O(tokens) per step, never O(batch x total blocks)), and ownership is
checked exactly, so blocks of other requests inside a KV tile, shared prefix blocks and stale
entries are all handled: where no block of the call is shared, by an interval of key numbers per
query row (the block's owning request and logical position folded into one key, see
:mod:`~kv_backends.backends.flex.span`), else by the table (``block_table[req, logical] ==
block``, one load per (query, key) pair); see :mod:`~kv_backends.backends.flex.windows`. Only columns a query of the batch
can see enter the table: a sliding-window row's columns before the window (the null block, or ids
the pool has reused) are never mapped. Tiles that every served row of a single-request query
block sees whole are listed as *full* blocks, on which Flex skips the mask mod (the interior of
the causal triangle; a decode's whole pages).

Static shapes (default on CUDA). The builder pads the flattened call's rows and the decode
call's batch to powers of 2 and the mask mods' tables to fixed sizes, and the impl compiles with
``dynamic=False``: a serving loop meets a few captured graphs, and the decode batch is a static
size, which Flex's split-KV decoding kernel needs (the impl asks for it on decode calls outside
batch invariance, GQA packed into its rows).

Decodes (``query_len == 1``) run as a batch of their own (:mod:`~kv_backends.backends.flex.decode`);
mixed batches make two Flex calls, each written into its own rows of ``out``. Under batch
invariance both calls stay on the main Flex template with the layer's ``BLOCK_M`` / ``BLOCK_N``
(the decode template's split count depends on the batch size), each request's KV tiles are
listed in logical order and none is full: a request's rows then equal, bitwise on CUDA,
:func:`~kv_backends.backends.flex.trainer.flex_trainer_attention` over that request alone.

Large caches. Torch's Flex templates compute element offsets in 32 bits, so a view over more
than 2^31 elements overflows. The view is cut into aligned *windows* of at most
``max_view_elements`` elements (default ``2**31 - 1``) and re-based onto each window's first
token (the base pointer carries the 64-bit offset). A batch whose blocks lie in one window (every
cache below 2^31 elements, and most batches over larger ones) runs one Flex call; otherwise one call
per window that holds blocks, merged exactly through their log-sum-exps.

Sinks are applied after the call from the log-sum-exp: ``out * sigmoid(lse - sink)`` equals a
softmax whose denominator has an extra ``exp(sink)``.

The output. ``forward`` keeps :meth:`AttentionImpl.forward`'s contract: a contiguous ``[T, Hq,
Dv]`` in q's dtype (``T = q.shape[0]``), rows past ``num_actual_tokens`` zero (the engine's model
reshapes it to ``[T, Hq * Dv]``: a strided view would only move the copy there). Flex lays its
output out in the query's stride order, and the flattened call's queries are a transposed
``[T, Hq, D]``, so its output already is a row-major ``[T_padded, Hq, Dv]``: without a caller
``out`` (the engine passes none) forward returns its first ``T`` rows, no copy, and a mixed batch's
decode call writes its rows into it. A copy remains where it must: a caller ``out``; sinks or
several windows (the output is computed anew and written once, in float32 rounded once); ``q``
longer than the padded call; an output Flex did not make row-major; autograd (in-place writes
into Flex's output would break its backward).
"""

from __future__ import annotations

from kv_backends.backends.flex.backend import FlexAttentionBackend
from kv_backends.backends.flex.compiled import FLEX_RECOMPILE_LIMIT
from kv_backends.backends.flex.entries import build_flex_block_indices
from kv_backends.backends.flex.impl import FlexAttentionImpl
from kv_backends.backends.flex.metadata import FlexAttentionMetadata, FlexMetadataBuilder
from kv_backends.backends.flex.options import FlexOptions

__all__ = [
    "FLEX_RECOMPILE_LIMIT",
    "FlexAttentionBackend",
    "FlexAttentionImpl",
    "FlexAttentionMetadata",
    "FlexMetadataBuilder",
    "FlexOptions",
    "build_flex_block_indices",
]
