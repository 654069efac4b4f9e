"""compute_slot_mapping / expand_block_table: reference vs a per-token oracle, Triton vs reference,
validation, -1 padding and slots past 2**31."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_kernels.slot_mapping import compute_slot_mapping, expand_block_table


def oracle(
    table: list[list[int]],
    positions: list[int],
    qsl: list[int],
    block_size: int,
    kbs: int,
    num_slots: int,
) -> list[int]:
    """Per token, from the contract: expand the manager block, then index the kernel block."""
    k = block_size // kbs
    out = [-1] * num_slots
    for r in range(len(qsl) - 1):
        for t in range(qsl[r], qsl[r + 1]):
            pos = positions[t]
            manager = table[r][pos // block_size]
            if manager < 0:
                continue
            kernel_block = manager * k + (pos // kbs) % k
            out[t] = kernel_block * kbs + pos % kbs
    return out


def random_batch(seed: int, reqs: int, block_size: int, max_blocks: int, dtype: torch.dtype):
    """A mixed batch: some requests prefill from 0, some decode one token, one is empty; the
    block table rows are shuffled, non-contiguous ids with -1 tails."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(reqs * max_blocks + 7, generator=g)
    table = torch.full((reqs, max_blocks), -1, dtype=dtype)
    positions: list[int] = []
    qsl = [0]
    for r in range(reqs):
        used = int(torch.randint(0, max_blocks + 1, (1,), generator=g))
        table[r, :used] = pool[r * max_blocks : r * max_blocks + used].to(dtype)
        ctx = used * block_size
        kind = int(torch.randint(0, 3, (1,), generator=g))
        if ctx == 0 or kind == 0:
            n = 0  # empty request
        elif kind == 1:
            n = 1  # decode: the last position
            positions.append(ctx - 1 - int(torch.randint(0, block_size, (1,), generator=g)))
        else:
            start = int(torch.randint(0, ctx, (1,), generator=g))
            n = ctx - start  # chunked prefill
            positions.extend(range(start, ctx))
        qsl.append(qsl[-1] + n)
    return table, torch.tensor(positions, dtype=torch.int64), torch.tensor(qsl, dtype=torch.int32)


@pytest.mark.parametrize(("block_size", "kbs"), [(16, 16), (64, 16), (48, 16), (6, 3), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_reference_and_triton_match_oracle(
    block_size: int, kbs: int, dtype: torch.dtype, triton_device: str
) -> None:
    table, positions, qsl = random_batch(
        block_size * 31 + kbs, reqs=5, block_size=block_size, max_blocks=4, dtype=dtype
    )
    num_tokens = positions.numel()
    num_slots = num_tokens + 5
    expected = oracle(table.tolist(), positions.tolist(), qsl.tolist(), block_size, kbs, num_slots)
    ref = compute_slot_mapping(
        table, positions, qsl, block_size, kbs, num_slots=num_slots, impl="reference"
    )
    assert ref.dtype == torch.int64
    assert ref.tolist() == expected
    dev = triton_device
    tri = compute_slot_mapping(
        table.to(dev),
        positions.to(dev),
        qsl.to(dev),
        block_size,
        kbs,
        num_slots=num_slots,
        impl="triton",
    )
    assert tri.dtype == torch.int64
    assert tri.cpu().tolist() == expected


def test_padding_tokens_and_tail_are_minus_one(triton_device: str) -> None:
    table = torch.tensor([[3, -1], [0, 2]], dtype=torch.int32)
    positions = torch.tensor([0, 17, 5, 16, 99, 99])  # tokens 4, 5 are CUDA-graph padding
    qsl = torch.tensor([0, 2, 4])
    expected = [48, -1, 5, 32, -1, -1, -1, -1]
    for impl, dev in (("reference", "cpu"), ("triton", triton_device)):
        got = compute_slot_mapping(
            table.to(dev), positions.to(dev), qsl.to(dev), 16, 8, num_slots=8, impl=impl
        )
        assert got.cpu().tolist() == expected
        empty = compute_slot_mapping(
            table[:0].to(dev), positions[:0].to(dev), qsl[:1].to(dev), 16, 8, num_slots=3, impl=impl
        )
        assert empty.cpu().tolist() == [-1, -1, -1]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    reqs=st.integers(0, 6),
    k=st.sampled_from([1, 2, 4]),
    kbs=st.sampled_from([1, 2, 16]),
    extra=st.integers(0, 3),
)
def test_reference_property(seed: int, reqs: int, k: int, kbs: int, extra: int) -> None:
    block_size = k * kbs
    table, positions, qsl = random_batch(
        seed, reqs=reqs, block_size=block_size, max_blocks=3, dtype=torch.int64
    )
    if reqs == 0:
        table = torch.empty(0, 3, dtype=torch.int64)
    num_slots = positions.numel() + extra
    got = compute_slot_mapping(
        table, positions, qsl, block_size, kbs, num_slots=num_slots, impl="reference"
    )
    assert got.tolist() == oracle(
        table.tolist(), positions.tolist(), qsl.tolist(), block_size, kbs, num_slots
    )


def test_slots_past_2_31(triton_device: str) -> None:
    """int32 block ids whose slots need int64."""
    table = torch.tensor([[2**27, 2**28 - 1]], dtype=torch.int32)
    positions = torch.tensor([0, 31, 40])
    qsl = torch.tensor([0, 3])
    expected = [2**27 * 32, 2**27 * 32 + 31, (2**28 - 1) * 32 + 8]
    assert max(expected) > 2**31
    for impl, dev in (("reference", "cpu"), ("triton", triton_device)):
        got = compute_slot_mapping(table.to(dev), positions.to(dev), qsl.to(dev), 32, 16, impl=impl)
        assert got.cpu().tolist() == expected


def test_expand_block_table(triton_device: str) -> None:
    table = torch.tensor([[4, 0, -1], [7, 2, 1]], dtype=torch.int32)
    expected = [[12, 13, 14, 0, 1, 2, -1, -1, -1], [21, 22, 23, 6, 7, 8, 3, 4, 5]]
    for impl, dev in (("reference", "cpu"), ("triton", triton_device)):
        got = expand_block_table(table.to(dev), 48, 16, impl=impl)
        assert got.dtype == torch.int32
        assert got.cpu().tolist() == expected
    # the expanded table gives the same slots as the manager table
    positions = torch.tensor([0, 47, 48, 100])
    qsl = torch.tensor([0, 4])
    via_manager = compute_slot_mapping(table[1:], positions, qsl, 48, 16)
    via_kernel = compute_slot_mapping(expand_block_table(table[1:], 48, 16), positions, qsl, 16, 16)
    assert torch.equal(via_manager, via_kernel)


def test_validation_errors() -> None:
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    positions = torch.tensor([0, 1])
    qsl = torch.tensor([0, 2])
    with pytest.raises(ValueError, match="must divide block_size"):
        compute_slot_mapping(table, positions, qsl, 16, 6)
    with pytest.raises(ValueError, match="must divide block_size"):
        expand_block_table(table, 16, 6)
    with pytest.raises(ValueError, match="num_slots=1 must be an int >= the 2 tokens"):
        compute_slot_mapping(table, positions, qsl, 16, 16, num_slots=1)
    with pytest.raises(ValueError, match="needs block-table column 2"):
        compute_slot_mapping(table, torch.tensor([0, 32]), qsl, 16, 16)
    with pytest.raises(ValueError, match="must be >= 0"):
        compute_slot_mapping(table, torch.tensor([0, -3]), qsl, 16, 16)
    with pytest.raises(ValueError, match="non-decreasing"):
        compute_slot_mapping(torch.tensor([[1], [2]]), positions, torch.tensor([0, 2, 1]), 16, 16)
    with pytest.raises(ValueError, match="exceeds the 2 positions"):
        compute_slot_mapping(table, positions, torch.tensor([0, 3]), 16, 16)
    with pytest.raises(ValueError, match=r"pass block_table\[:1\]"):
        compute_slot_mapping(torch.tensor([[1], [2]]), positions, qsl, 16, 16)
    with pytest.raises(ValueError, match="int32 or int64"):
        compute_slot_mapping(table.float(), positions, qsl, 16, 16)
    with pytest.raises(ValueError, match="overflows int32"):
        expand_block_table(torch.tensor([[2**30]], dtype=torch.int32), 64, 16)
    with pytest.raises(ValueError, match="is not a valid implementation"):
        compute_slot_mapping(table, positions, qsl, 16, 16, impl="cuda")


def test_out_buffer_is_written_and_checked(triton_device: str) -> None:
    """``out=``: the slots land in the caller's buffer (stale values overwritten, -1 tail) and
    a buffer of the wrong dtype, length, device or stride is refused."""
    table = torch.tensor([[3, -1], [0, 2]], dtype=torch.int32)
    positions = torch.tensor([0, 17, 5, 16, 99])
    qsl = torch.tensor([0, 2, 4])
    expected = [48, -1, 5, 32, -1, -1]
    for impl, dev in (("reference", "cpu"), ("triton", triton_device)):
        buf = torch.full((8,), 12345, dtype=torch.int64, device=dev)
        got = compute_slot_mapping(
            table.to(dev), positions.to(dev), qsl.to(dev), 16, 8, num_slots=6, impl=impl,
            out=buf[:6],
        )  # fmt: skip
        assert got.data_ptr() == buf.data_ptr()
        assert buf.cpu().tolist() == [*expected, 12345, 12345]  # nothing past num_slots
    args = (table, positions, qsl, 16, 8)
    with pytest.raises(ValueError, match=r"out is torch.int32 of shape \(6,\); slots need int64"):
        compute_slot_mapping(*args, num_slots=6, out=torch.empty(6, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"shape \(5,\); slots need int64 of shape \(6,\)"):
        compute_slot_mapping(*args, num_slots=6, out=torch.empty(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="out must be contiguous"):
        compute_slot_mapping(*args, num_slots=6, out=torch.empty(12, dtype=torch.int64)[::2])
    with pytest.raises(ValueError, match="out must be a torch.Tensor"):
        compute_slot_mapping(*args, num_slots=6, out=[0] * 6)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="out is on cuda"):
            compute_slot_mapping(
                *args, num_slots=6, out=torch.empty(6, dtype=torch.int64, device="cuda")
            )
