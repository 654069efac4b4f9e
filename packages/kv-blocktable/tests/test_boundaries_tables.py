"""Issue 28, the worker side (the ``torch`` extra): ``BlockTables`` and the step's lengths refuse
values they would silently change (a float block id truncated to a block, float lengths) and
duplicate block ids in a row, naming the field, the value and the bound; a refused call writes
nothing. Property tests (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_blocktable.block_table import BlockTables

from .conftest import hypothesis_examples

SETTINGS = settings(
    max_examples=hypothesis_examples(30),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
NUM_BLOCKS = 40


def tables() -> BlockTables:
    # two groups: 8-token blocks with 4-token kernel blocks, and 16-token blocks
    return BlockTables(
        [8, 16], [4, 16], 3, [6, 4], max_num_batched_tokens=32, num_blocks=NUM_BLOCKS
    )


def snapshot(t: BlockTables) -> tuple[object, ...]:
    return (t._host.clone(), [list(r) for r in t._row_blocks])


ids_lists = st.lists(st.integers(1, NUM_BLOCKS - 1), unique=True, max_size=4)


@SETTINGS
@given(
    good=ids_lists,
    bad=st.one_of(
        st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f)),
        st.just(2.0),
        st.booleans(),
        st.text(max_size=2),
        st.none(),
    ),
    at=st.integers(0, 4),
    append=st.booleans(),
)
def test_a_block_id_is_never_truncated(good: list[int], bad: object, at: int, append: bool) -> None:
    t = tables()
    t.add_row(0, ([1, 2], [3]))
    before = snapshot(t)
    ids = [*good[:at], bad, *good[at:]]
    call = t.append_row if append else t.add_row
    with pytest.raises((TypeError, ValueError), match=r"group 0 block ids for row 0") as e:
        call(0, (ids, []))  # type: ignore[arg-type]
    assert repr(bad) in str(e.value) or type(bad).__name__ in str(e.value)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(snapshot(t), before, strict=True))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_float_and_bool_tensors_of_ids_are_refused(dtype: torch.dtype) -> None:
    t = tables()
    with pytest.raises(TypeError, match=f"dtype {dtype}"):
        t.add_row(0, (torch.tensor([1, 2.5]).to(dtype), []))


def test_the_reported_add_row_truncation() -> None:
    t = tables()
    with pytest.raises(TypeError, match=r"hold 2\.5 \(float\)"):
        t.add_row(0, ([1, 2.5], []))  # used to store block 2
    assert t.num_blocks_of_row(0) == (0, 0)


@SETTINGS
@given(ids=st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=1, max_size=5), data=st.data())
def test_a_block_named_twice_in_a_row_is_refused(ids: list[int], data: st.DataObject) -> None:
    t = tables()
    dup = data.draw(st.sampled_from(ids))
    pos = data.draw(st.integers(0, len(ids)))
    row = [*ids[:pos], dup, *ids[pos:]][:6]
    if len(set(row)) == len(row):
        return  # the cut dropped the repeat
    before = snapshot(t)
    for call in (t.add_row, t.append_row):
        with pytest.raises(ValueError, match=r"group 0 row 1: block id \d+ appears twice"):
            call(1, (row, []))
    with pytest.raises(ValueError, match="appears twice"):
        t.add_row(1, (torch.tensor(row), []))
    assert torch.equal(snapshot(t)[0], before[0])  # type: ignore[arg-type]


def test_the_null_block_may_repeat() -> None:
    # a sliding-window row holds the null block wherever blocks fell out of the window
    t = tables()
    t.add_row(0, ([0, 0, 0, 5], [0, 7]))
    t.append_row(0, ([0, 6], []))
    assert t.num_blocks_of_row(0) == (6, 2)


# (a bool in a list of lengths is read as 0 / 1 on the per-step fast path: see _host_lengths)
@pytest.mark.parametrize("bad", [[1.5, 1], [None, 1], torch.tensor([1.0, 1.0])])
def test_step_lengths_are_never_truncated(bad: object) -> None:
    t = tables()
    t.add_row(0, ([1], [2]))
    t.add_row(1, ([3], [4]))
    t.commit(2)
    with pytest.raises(TypeError, match=r"query_lens (holds|has dtype)"):
        t.build_common_metadata(2, bad, [2, 2])  # type: ignore[arg-type]


def test_tensor_arguments_are_checked() -> None:
    t = tables()
    t.add_row(0, ([1], [2]))
    t.commit(1)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(TypeError, match="positions is a list"):
        t.compute_slot_mapping(qsl, [0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="positions has dtype torch.float32"):
        t.compute_slot_mapping(qsl, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="pin_memory=1 must be a bool"):
        BlockTables([8], [8], 1, [2], max_num_batched_tokens=8, pin_memory=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kv_cache_config is a dict"):
        BlockTables.from_config(
            {},
            max_num_reqs=1,
            max_model_len=8,
            max_num_batched_tokens=8,  # type: ignore[arg-type]
        )


def test_step_and_export_arguments_are_named() -> None:
    from kv_blocktable.attn_metadata import csr_from_table, physical_to_logical

    t = tables()
    t.add_row(0, ([1], [2]))
    t.commit(1)
    with pytest.raises(ValueError, match="num_reqs='1' must be an int"):
        t.build_common_metadata("1", [1], [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rows \\(int\\)"):
        t.append_rows(0, [([3], [])])  # type: ignore[arg-type]
    table = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([3])
    with pytest.raises(ValueError, match="kernel_block_size=0 must be a positive int"):
        csr_from_table(table, lens, 0)
    with pytest.raises(ValueError, match="num_kernel_blocks=2.0 must be a positive int"):
        physical_to_logical(table, lens, 2, num_kernel_blocks=2.0)  # type: ignore[arg-type]


def test_a_bad_device_is_named() -> None:
    with pytest.raises(ValueError, match="device=-1 is not a torch device"):
        BlockTables([8], [8], 1, [2], max_num_batched_tokens=8, device=-1)  # type: ignore[arg-type]
