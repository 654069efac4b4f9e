"""FLEX_ATTENTION over block tables as a real block manager leaves them: sliding-window rows
hold the null block (id 0) at the columns whose blocks fell out of the window, and ids the pool
has since handed to another request of the same batch. Only the columns a query can see may
enter the physical -> logical map."""

from __future__ import annotations

import pytest
import torch
from kv_backends import get_backend
from kv_backends.testing import make_paged_batch, oracle_attention, run_backend

# float32 on the CPU; differences are summation order only.
TOL = {"atol": 2e-5, "rtol": 1e-4}

WINDOW = 20
# A: a decode at 69 (sees 50..69: kernel columns 3-4 of 16), B: a prefill of 40 (all visible),
# C: a chunk of 10 at 50..59 (sees 31..59: columns 1-3), D: a decode at 18 (all visible).
QUERY_LENS = [1, 40, 10, 1]
SEQ_LENS = [70, 40, 60, 19]


def _manager_like_batch(*, block_size: int, kernel_block_size: int, seed: int, **kw):
    """A batch whose rows look like a sliding-window manager's: block 0 is the null block
    (never handed out), the invisible columns of A and C hold it, and one invisible column of
    A holds an id that B reads at a visible column (the pool reused it)."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-s // block_size) for s in SEQ_LENS)
    nb = need + 4
    blocks = (torch.randperm(nb - 1, generator=gen) + 1).tolist()  # 0 stays the null block
    b = make_paged_batch(
        query_lens=QUERY_LENS,
        seq_lens=SEQ_LENS,
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        num_blocks=nb,
        sliding_window=WINDOW,
        blocks=blocks,
        seed=seed,
        pad_tokens=2,
        **kw,
    )
    bt = b.common.block_table  # [R, M] kernel block ids
    n = kernel_block_size
    k = block_size // kernel_block_size
    first_col = {r: max(SEQ_LENS[r] - QUERY_LENS[r] - WINDOW + 1, 0) // n for r in range(4)}
    # Whole manager blocks fall out of the window (a manager frees blocks, not kernel blocks).
    for r in (0, 2):
        for mcol in range(first_col[r] // k):
            bt[r, mcol * k : (mcol + 1) * k] = torch.arange(k, dtype=bt.dtype)  # null block 0
    if first_col[0] // k >= 1:
        # A's first manager column now holds B's last block: freed by A, reused for B.
        bt[0, :k] = bt[1, (-(-SEQ_LENS[1] // n) - k) : -(-SEQ_LENS[1] // n)]
    return b


@pytest.mark.parametrize(
    ("block_size", "kernel_block_size", "kv_block_size", "batch_invariant"),
    [
        (16, 16, 16, False),
        (16, 16, 64, False),  # a KV tile spans 4 blocks, the null block's neighbours included
        (32, 16, 16, True),  # manager blocks of 2 kernel blocks; logical tile order
    ],
)
def test_flex_ignores_invisible_columns(
    block_size: int, kernel_block_size: int, kv_block_size: int, batch_invariant: bool
) -> None:
    b = _manager_like_batch(
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        seed=kv_block_size + block_size,
        batch_invariant=batch_invariant,
    )
    # The rows really do hold block 0 (only whole manager blocks fall out, so with blocks of 32
    # only A's first one does, reused) and a shared id at invisible columns.
    bt = b.common.block_table
    if block_size == kernel_block_size:
        assert (bt[0] == 0).any() and (bt[2] == 0).any()
    assert set(bt[0, :1].tolist()) <= set(bt[1].tolist())
    out = run_backend("FLEX_ATTENTION", b, builder_options={"kv_block_size": kv_block_size})
    t = b.common.num_actual_tokens
    torch.testing.assert_close(out[:t].double(), oracle_attention(b)[:t], **TOL)
    torch.testing.assert_close(out[:t], run_backend("TORCH_SDPA", b)[:t], **TOL)


def test_flex_maps_only_visible_blocks() -> None:
    b = _manager_like_batch(block_size=16, kernel_block_size=16, seed=5)
    builder = get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout, kv_block_size=16)
    builder.phys_to_logical.fill_(-7)  # a sentinel: anything the build writes shows
    builder.build(b.common)
    bt = b.common.block_table
    written = {int(i) for i in torch.nonzero(builder.phys_to_logical != -7).flatten()}
    want = set()
    for r, (ql, s) in enumerate(zip(QUERY_LENS, SEQ_LENS, strict=True)):
        lo = max(s - ql - WINDOW + 1, 0) // 16
        want |= {int(bt[r, c]) for c in range(lo, -(-s // 16))}
    assert written == want
    assert 0 not in written, "the null block must never get a logical position"


def test_flex_still_refuses_a_visible_block_at_two_positions() -> None:
    b = _manager_like_batch(block_size=16, kernel_block_size=16, seed=9)
    bt = b.common.block_table
    bt[3, 0] = bt[1, 1]  # D (all visible) reads B's block at another column: a real clash
    builder = get_backend("FLEX_ATTENTION").make_builder(b.config, b.layout)
    with pytest.raises(ValueError, match="two different logical positions"):
        builder.build(b.common)
