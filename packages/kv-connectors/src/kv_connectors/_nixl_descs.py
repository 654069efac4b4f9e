"""Descriptor lists of coalesced NIXL READs (:mod:`kv_connectors.nixl`): runs of consecutive
blocks, their spans, and when a READ through the staging buffer beats a direct one.

A READ's descriptors cost host time to post: on 2 x H200 (UCX over CUDA IPC, NIXL 1.5.1,
``bench_disagg.py --transport nixl --trace``) an 8k-token pull of a 16-layer per-layer cache, 512
blocks read straight into blocks in another order, was 8,192 descriptors and ``transfer()`` took
62 ms of it, GIL held (~7.6 us a descriptor), against 9 ms for the same bytes in runs. A decode
pool's free list hands blocks back in any order, so the producer's consecutive blocks rarely
pair with consecutive ones here; reading the producer's runs into the staging buffer and
scattering them with one kernel a segment costs a copy on this GPU instead
(:func:`staged_is_cheaper` weighs the two).
"""

from __future__ import annotations

from typing import Any

__all__ = ["staged_is_cheaper"]

#: host seconds to post one READ descriptor (the figure above)
DESC_S = 7.6e-6
#: seconds a staged piece adds besides its descriptors: its READ's completion seen on the host,
#: then its scatter drained before the next piece overwrites the buffer
PIECE_S = 2e-4
#: bytes a second the scatter moves from the staging buffer into the cache blocks (H200: the
#: block copy kernels' 0.84-1.76 TB/s, connectors.md; the low end)
SCATTER_BPS = 8e11


def staged_is_cheaper(
    direct_runs: int, producer_runs: int, pieces: int, nbytes: int, segments: int
) -> bool:
    """Whether a pull goes through the staging buffer: ``direct_runs`` runs consecutive on both
    sides (a direct READ posts one descriptor per run and segment) against ``producer_runs``
    runs of the producer's ids alone, read in ``pieces`` pieces of the buffer and scattered
    (``nbytes`` in all)."""
    direct = direct_runs * segments * DESC_S
    staged = producer_runs * segments * DESC_S + pieces * PIECE_S + nbytes / SCATTER_BPS
    return staged < direct


def _id_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(first id, count, first position)`` of the stretches of ``ids`` that go up by one."""
    out: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        if out:
            b0, n, p0 = out[-1]
            if b == b0 + n:
                out[-1] = (b0, n + 1, p0)
                continue
        out.append((b, 1, pos))
    return out


def _runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """``(local first, remote first, count)`` of the stretches where both sides' block ids go up
    by one."""
    out: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote, strict=True):
        if out:
            l0, r0, n = out[-1]
            if lb == l0 + n and rb == r0 + n:
                out[-1] = (l0, r0, n + 1)
                continue
        out.append((lb, rb, 1))
    return out


def _spans(pattern: list[dict[str, Any]]) -> bool:
    """Whether each range of a block fills its block stride, so the same range of consecutive
    blocks is one span of memory (a per-layer page-contiguous cache; not head-outer pages)."""
    return all(n == s["block_stride"] for s in pattern for _off, n in s["ranges"])


def _run_descs(
    pattern: list[dict[str, Any]], runs: list[tuple[int, int]], dev: int, num_blocks: int
) -> Any:
    """``int64 [len(runs) * R, 3]``: for each ``(first block, count)`` run and each range of the
    pattern, one descriptor over the run's blocks (:func:`_spans` must hold). A run outside
    ``[0, num_blocks)`` is refused: its span would reach past the registered cache."""
    import numpy as np

    for b0, n in runs:
        if b0 < 0 or n < 1 or b0 + n > num_blocks:
            raise ValueError(
                f"NIXL read run of blocks [{b0}, {b0 + n}) lies outside the cache's "
                f"num_blocks={num_blocks}; block ids must be in [0, {num_blocks})"
            )

    per = np.array(
        [(s["base"] + off, s["block_stride"], n) for s in pattern for off, n in s["ranges"]],
        dtype=np.int64,
    )  # [R, 3]
    first = np.array([b for b, _n in runs], dtype=np.int64)[:, None]
    count = np.array([n for _b, n in runs], dtype=np.int64)[:, None]
    out = np.empty((len(runs), len(per), 3), dtype=np.int64)
    out[:, :, 0] = per[None, :, 0] + first * per[None, :, 1]
    out[:, :, 1] = per[None, :, 2] * count
    out[:, :, 2] = dev
    return out.reshape(-1, 3)
