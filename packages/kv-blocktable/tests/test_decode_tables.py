"""The decode fast paths of ``BlockTables`` against the general paths they skip (issue 32).

A pure-decode ``build_common_metadata`` (one lookup per group for the slots, the coverage check
and the null check; on host tables ``HostDecode``, which writes the step's buffers in place),
decode-shaped ``append_rows`` (one checked loop, the ids written one by one) and a commit that
copies appended entries instead of rows must give exactly what the general code gives: the same
tables, slots, positions and lengths — and for bad input the same error, type and message. Two
tables run the same random operations, one with the fast paths switched off.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kv_blocktable import _host_decode as hd_mod  # noqa: E402
from kv_blocktable import _table_commit as commit_mod  # noqa: E402
from kv_blocktable import attn_metadata as md_mod  # noqa: E402
from kv_blocktable import block_table as bt_mod  # noqa: E402
from kv_blocktable.block_table import BlockTables  # noqa: E402

EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "0"))
MAX_REQS = 6
MAX_TOKENS = 10
NUM_BLOCKS = 40


@contextmanager
def general_paths() -> Iterator[None]:
    """Switch the decode fast paths off: every step and append takes the general code."""
    with (
        mock.patch.object(md_mod, "_decode_step", return_value=None),
        mock.patch.object(md_mod, "decode_blocks", return_value=None),
        mock.patch.object(hd_mod.HostDecode, "build", return_value=None),
        mock.patch.object(bt_mod, "plan_decode_appends", return_value=None),
        mock.patch.object(bt_mod, "plan_single_appends", return_value=None),
        # appended ids and committed entries through index_copy_, never one by one
        mock.patch.object(commit_mod, "_ENTRY_WRITES", -1),
        mock.patch.object(commit_mod, "_ENTRY_COPIES", -1),
    ):
        yield


def outcome(fn: object) -> object:
    """``fn()``'s result, or its error as ``(type, message)``."""
    try:
        return ("ok", fn())  # type: ignore[operator]
    except (ValueError, TypeError) as e:
        return (type(e).__name__, str(e))


def snapshot(t: BlockTables, mds: tuple[object, ...]) -> list[object]:
    out: list[object] = []
    for md in mds:
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            out.append((name, getattr(md, name).tolist(), getattr(md, name).dtype))
        for name in ("query_start_loc_cpu", "seq_lens_cpu"):
            out.append((name, getattr(md, name).tolist(), getattr(md, name).dtype))
        for name in ("max_query_len", "max_seq_len", "num_actual_tokens"):
            out.append((name, getattr(md, name)))
    step = t._last_step
    assert step is not None
    for name in ("query_lens", "seq_lens", "positions", "token_reqs", "seq_lens_i32"):
        out.append((name, getattr(step, name).tolist(), getattr(step, name).dtype))
    out.append(("padded", step.padded_tokens))
    out.append(("positions", t.positions.tolist()))
    for g in range(t.num_groups):
        out.append(("csr", [x.tolist() for x in t.csr(g)]))
    return out


def tables_state(t: BlockTables) -> list[object]:
    return [
        t._host.tolist(),
        [r[:] for r in t._row_blocks],
        [t.kernel_table(g)[: t._committed or 0].tolist() for g in range(t.num_groups)],
    ]


# Odd values a caller may pass as a length or an id: each must be refused (or accepted) alike.
ODD = st.sampled_from([1.0, True, False, None, "1", -1, 2**31, 2**40, 2.5])


@st.composite
def scenario(draw: st.DrawFn) -> dict[str, object]:
    groups = draw(
        st.lists(
            st.tuples(st.sampled_from((4, 8)), st.sampled_from((1, 2, 4)), st.integers(1, 5)),
            min_size=1,
            max_size=3,
        )
    )
    null = draw(st.sampled_from((0, None)))
    rows = draw(st.integers(1, MAX_REQS))
    staged = draw(st.booleans())
    ops: list[tuple[object, ...]] = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(
            st.sampled_from(("add", "append", "append", "append", "clear", "swap", "step", "step"))
        )
        if kind == "add":
            r = draw(st.integers(0, rows - 1))
            ids = tuple(
                draw(st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=m, unique=True))
                for _, _, m in groups
            )
            ops.append(("add", r, ids))
        elif kind == "append":
            rs = draw(
                st.lists(st.integers(0, rows - (draw(st.integers(0, 4)) > 0)), max_size=rows + 1)
            )
            if draw(st.booleans()):  # allocate_decode_slots' order: increasing, no repeats
                rs = sorted(set(rs))
            decode_shaped = draw(st.integers(0, 4)) > 0  # mostly what a decode step appends
            single = st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=1)
            odd = st.one_of(
                single,
                st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=2, max_size=2),
                st.lists(ODD, min_size=1, max_size=1),
            )
            batch = []
            for _ in rs:
                per = [draw(single if decode_shaped else odd) for _g in groups]
                batch.append(tuple(per) if decode_shaped or draw(st.booleans()) else per)
            if draw(st.integers(0, 9)) == 0 and batch:
                batch[0] = batch[0][:-1]  # a tuple short of a group
            ops.append(("append", rs, batch))
        elif kind == "clear":
            ops.append(("clear", draw(st.integers(0, rows - 1))))
        elif kind == "swap":
            ops.append(("swap", draw(st.integers(0, rows - 1)), draw(st.integers(0, rows - 1))))
        else:
            n = draw(st.integers(0, rows))
            cap = max(m * b for b, _, m in groups)
            slens: list[object] = [draw(st.integers(0, cap + 8)) for _ in range(n)]
            qlens: list[object] = [1] * n
            if n and draw(st.integers(0, 4)) == 0:
                qlens[draw(st.integers(0, n - 1))] = draw(st.one_of(ODD, st.integers(0, 3)))
            if n and draw(st.integers(0, 4)) == 0:
                slens[draw(st.integers(0, n - 1))] = draw(ODD)
            pad = draw(st.one_of(st.none(), st.integers(n - 1, MAX_TOKENS + 1), ODD))
            commit = draw(st.integers(n, rows))
            ops.append(("step", commit, n, qlens, slens, pad, draw(st.booleans())))
    return {"groups": groups, "null": null, "rows": rows, "ops": ops, "staged": staged}


def _build(
    groups: list[tuple[int, int, int]], null: int | None, rows: int, staged: bool = False
) -> BlockTables:
    t = BlockTables(
        [b for b, _, _ in groups],
        [b // k for b, k, _ in groups],
        rows,
        [m for _, _, m in groups],
        max_num_batched_tokens=MAX_TOKENS,
        num_blocks=NUM_BLOCKS,
        null_block=null,
    )
    return _staged(t) if staged else t


def _staged(t: BlockTables) -> BlockTables:
    """``t`` with HostDecode's CUDA form on the CPU: the step's staging buffers (and a slot
    staging buffer per group) apart from the buffers the metadata reads, the host table as the
    lookup's source, and the copies between them (plain CPU copies here) — what a GPU's pinned
    staging runs, checkable without one."""
    sb = t._step
    sb.direct = False
    sb.host_qsl, sb.host_seq, sb.host_pos = (torch.zeros_like(x) for x in (sb.qsl, sb.seq, sb.pos))
    t._host_decode = hd_mod.HostDecode(
        sb,
        t._host_flat,
        t._kernel,
        t._slots,
        t._col,
        t.block_sizes,
        t.max_num_blocks_per_req,
        t.max_num_batched_tokens,
        t.null_block,
        staged=True,
    )
    t._host_decode._pack_h.fill_(7)  # stale until written
    t._host_decode._pack_d.fill_(7)
    return t


def _apply(t: BlockTables, op: tuple[object, ...]) -> object:
    kind = op[0]
    if kind == "add":
        return outcome(lambda: t.add_row(op[1], op[2]))  # type: ignore[arg-type]
    if kind == "append":
        return outcome(lambda: t.append_rows(op[1], op[2]))  # type: ignore[arg-type]
    if kind == "clear":
        return outcome(lambda: t.clear_row(op[1]))  # type: ignore[arg-type]
    if kind == "swap":
        return outcome(lambda: t.swap_rows(op[1], op[2]))  # type: ignore[arg-type]
    _, commit, n, qlens, slens, pad, tuple_lens = op
    t.commit(commit)  # type: ignore[arg-type]
    if tuple_lens:
        qlens, slens = tuple(qlens), tuple(slens)  # type: ignore[arg-type]
    got = outcome(lambda: t.build_common_metadata(n, qlens, slens, pad_tokens_to=pad))  # type: ignore[arg-type]
    if got[0] == "ok":  # type: ignore[index]
        return ("ok", snapshot(t, got[1]))  # type: ignore[index]
    return got


@settings(
    max_examples=EXAMPLES or 150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario())
def test_fast_paths_equal_the_general_paths(case: dict[str, object]) -> None:
    groups, null, rows = case["groups"], case["null"], case["rows"]
    fast = _build(groups, null, rows, case["staged"])  # type: ignore[arg-type]
    slow = _build(groups, null, rows)  # type: ignore[arg-type]
    slow._track_entries = False  # commit copies whole rows, as before
    for op in case["ops"]:  # type: ignore[attr-defined]
        got = _apply(fast, op)
        with general_paths():
            want = _apply(slow, op)
        assert got == want, op
        assert tables_state(fast) == tables_state(slow), op
        if fast._committed is not None:
            n = fast._committed
            assert fast._dev[:n].tolist() == fast._host[:n].tolist()


_decode_plan = bt_mod.plan_decode_appends  # the real one (the planted twins wrap it)


def _wrong_block_id(rows, new_block_ids, *args):  # type: ignore[no-untyped-def]
    """A planted bug: plans the decode appends, then writes each id off by one."""
    got = _decode_plan(rows, new_block_ids, *args)
    return got and (got[0], got[1], [b + 1 for b in got[2]])


def _count_not_grown(rows, new_block_ids, *args):  # type: ignore[no-untyped-def]
    """A planted bug: writes the ids but leaves the rows' block counts where they were."""
    got = _decode_plan(rows, new_block_ids, *args)
    return got and ([], got[1], got[2])


@pytest.mark.parametrize("planted", [_wrong_block_id, _count_not_grown])
def test_a_decode_append_plan_that_gets_a_row_wrong_is_caught(planted: object) -> None:
    """The comparison above catches a decode append that writes a wrong block id or forgets a
    row's count: the real plan passes the same steps, each planted twin fails them."""
    groups, rows = [(16, 1, 4)], 3
    ops = [
        ("add", 0, ([1],)),
        ("add", 1, ([2],)),
        ("append", [0, 2], [([5],), ([6],)]),
        ("step", 3, 3, [1, 1, 1], [17, 16, 1], None, False),
    ]

    def run(plan: object) -> None:
        fast, slow = _build(groups, 0, rows), _build(groups, 0, rows)
        with mock.patch.object(bt_mod, "plan_decode_appends", plan):
            got = [_apply(fast, op) for op in ops]
        with general_paths():
            want = [_apply(slow, op) for op in ops]
        assert got == want
        assert tables_state(fast) == tables_state(slow)

    run(_decode_plan)
    with pytest.raises(AssertionError):
        run(planted)


def test_decode_appends_in_row_order_take_the_decode_plan() -> None:
    """``allocate_decode_slots``' rows (increasing) take ``plan_decode_appends``; a repeated or
    out-of-order row, or two groups, fall through to the checked loops, with the same tables."""
    t = BlockTables([16], [16], 4, [4], max_num_batched_tokens=8, num_blocks=64)
    for r in range(4):
        t.add_row(r, ([10 + r],))
    with mock.patch.object(bt_mod, "plan_single_appends", side_effect=AssertionError("loop")):
        t.append_rows([0, 2, 3], [([20],), ([],), ([23],)])
    assert t.num_blocks_of_row(0) == (2,) and t.num_blocks_of_row(2) == (1,)
    assert t.host_table(0)[:, :2].tolist() == [[10, 20], [11, -1], [12, -1], [13, 23]]
    spy = mock.patch.object(bt_mod, "plan_single_appends", wraps=bt_mod.plan_single_appends)
    with spy as loop:
        t.append_rows([1, 1], [([21],), ([31],)])  # a repeated row: appends in order
        t.append_rows([3, 0], [([33],), ([30],)])  # out of order
    assert loop.call_count == 2
    assert t.host_table(0)[:, :3].tolist() == [
        [10, 20, 30],
        [11, 21, 31],
        [12, -1, -1],
        [13, 23, 33],
    ]


def _copies_dropped(self, n, padded):  # type: ignore[no-untyped-def]
    """A planted bug: the staged build writes the staging block but copies it only up to the
    slots (seq_lens and positions reach the device, the slots stay stale)."""
    size = _real_size(self, n, padded)
    return size._replace(packed=hd_mod._packed_layout(n, padded, 1)[2])


def _stale_positions(self, *args):  # type: ignore[no-untyped-def]
    """A planted bug: the staged build hands out the staging positions, not the device ones."""
    size = _real_size(self, *args)
    return size._replace(positions=size.pos.clone())


_real_size = hd_mod.HostDecode._size


@pytest.mark.parametrize("planted", [_copies_dropped, _stale_positions])
def test_a_staged_decode_that_skips_a_copy_is_caught(planted: object) -> None:
    """The staged (CUDA-form) decode against the general path on the same steps: the real one
    passes, a twin that leaves the device slots stale (or positions where the device does not
    read them) fails."""
    groups, rows = [(16, 1, 4)], 3
    ops = [
        ("add", 0, ([1, 2],)),
        ("add", 1, ([3],)),
        ("add", 2, ([4, 5],)),
        ("step", 3, 3, [1, 1, 1], [17, 16, 20], None, False),
        ("append", [1], [([6],)]),
        ("step", 3, 3, [1, 1, 1], [18, 17, 21], 4, False),
    ]

    def run(size: object) -> None:
        fast, slow = _build(groups, 0, rows, staged=True), _build(groups, 0, rows)
        with mock.patch.object(hd_mod.HostDecode, "_size", size):
            got = [_apply(fast, op) for op in ops]
        with general_paths():
            want = [_apply(slow, op) for op in ops]
        assert got == want

    run(_real_size)
    with pytest.raises(AssertionError):
        run(planted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decode_steps_staged_equal_the_general_path() -> None:
    """On a GPU with pinned staging: random decode steps through HostDecode's staged form and
    through the general path (the kv-kernels slot mapping) give the same metadata, step after
    step on the same persistent buffers."""
    gen = torch.Generator().manual_seed(0)
    rows, width, bs = 6, 6, 16  # rows * width distinct ids below NUM_BLOCKS
    tables = [
        BlockTables([bs], [bs], rows, [width], device="cuda", pin_memory=True,
                    max_num_batched_tokens=16, num_blocks=NUM_BLOCKS)
        for _ in range(2)
    ]  # fmt: skip
    assert tables[0]._host_decode is not None and tables[0]._host_decode._staged
    ids = torch.randperm(NUM_BLOCKS - 1, generator=gen)[: rows * width].add(1).view(rows, width)
    for t in tables:
        for r in range(rows):
            t.add_row(r, (ids[r].tolist(),))
    for _ in range(20):
        n = int(torch.randint(1, rows + 1, (1,), generator=gen))
        slens = torch.randint(1, width * bs + 1, (n,), generator=gen).tolist()
        pad = [None, n, 16][int(torch.randint(0, 3, (1,), generator=gen))]
        for t in tables:
            t.commit(n)
        got = snapshot(
            tables[0], tables[0].build_common_metadata(n, [1] * n, slens, pad_tokens_to=pad)
        )
        with general_paths():
            want = snapshot(
                tables[1], tables[1].build_common_metadata(n, [1] * n, slens, pad_tokens_to=pad)
            )
        assert got == want


def _decode_tables() -> BlockTables:
    t = BlockTables([16], [16], 4, [4], max_num_batched_tokens=8, num_blocks=64)
    for r, ids in enumerate(([1, 2], [3], [4, 5, 6], [0, 7])):
        t.add_row(r, (ids,))
    t.commit(4)
    return t


def test_a_decode_step_takes_the_fast_path_and_matches_by_hand() -> None:
    t = _decode_tables()
    with mock.patch.object(
        md_mod, "check_rows_cover", side_effect=AssertionError("general path taken")
    ):
        (md,) = t.build_common_metadata(4, [1, 1, 1, 1], [20, 16, 33, 17], pad_tokens_to=6)
    assert md.slot_mapping.tolist() == [2 * 16 + 3, 3 * 16 + 15, 6 * 16 + 0, 7 * 16 + 0, -1, -1]
    assert t.positions.tolist() == [19, 15, 32, 16]
    assert md.seq_lens.tolist() == [20, 16, 33, 17] and md.max_seq_len == 33
    assert md.query_start_loc_cpu.tolist() == [0, 1, 2, 3, 4]


def test_host_tables_build_a_decode_in_place_and_a_refused_one_changes_nothing() -> None:
    """On host tables a decode step takes ``HostDecode`` (not the general decode path), its
    metadata of one batch size reuses the same buffers, and a step its checks refuse (then
    refused by the general path too) leaves the last built step as it was: its lengths,
    positions, slots and exports."""
    t = _decode_tables()
    with mock.patch.object(md_mod, "_decode_step", side_effect=AssertionError("general path")):
        (a,) = t.build_common_metadata(4, [1, 1, 1, 1], [20, 16, 33, 17])
        (b,) = t.build_common_metadata(4, [1, 1, 1, 1], [21, 16, 34, 17])
    assert a.slot_mapping.data_ptr() == b.slot_mapping.data_ptr()
    assert b.max_seq_len == 34 and a.max_seq_len == 33  # a copy per step, not one object
    assert b.slot_mapping.tolist() == [2 * 16 + 4, 3 * 16 + 15, 6 * 16 + 1, 7 * 16 + 0]
    before = snapshot(t, (b,))
    for bad in ([21, 16, 34, 49], [21, 0, 34, 17], [21, 16, 34, 2**40]):
        with pytest.raises(ValueError):
            t.build_common_metadata(4, [1, 1, 1, 1], bad)
        assert snapshot(t, (b,)) == before, bad
    # A step that fills more slots and another query_start_loc, then a decode padded by one:
    # the padding slot is -1 again and query_start_loc 0..R again.
    t.build_common_metadata(2, [3, 4], [20, 16])
    (c,) = t.build_common_metadata(4, [1, 1, 1, 1], [21, 16, 34, 17], pad_tokens_to=5)
    assert c.slot_mapping.tolist() == [*b.slot_mapping.tolist()[:4], -1]
    assert c.query_start_loc.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("qlens", "slens", "match"),
    [
        ([1, 1, 1, 1], [20, 33, 33, 17], "request 1: seq_len=33 needs 3 blocks"),
        ([1, 1, 1, 1], [20, 16, 33, 16], "position 15 maps to the null block 0"),
        ([1, 1, 1, 1], [20, 16, 65, 17], "max_num_blocks_per_req=4 cannot hold it"),
        ([1, 1, 1, 1], [20, 0, 33, 17], r"request 1: query_len=1 must be in \[0, seq_len=0\]"),
        ([1, 1.0, 1, 1], [20, 16, 33, 17], r"query_lens holds 1.0 \(float\)"),
        ([1, 1, 1, 1], [20, 16.0, 33, 17], r"seq_lens holds 16.0 \(float\)"),
        ([1, 1, 1, 1], [20, 16, 2**31, 17], "exceeds the int32 range"),
    ],
)
def test_bad_decode_steps_raise_the_general_error(
    qlens: list[object], slens: list[object], match: str
) -> None:
    t = _decode_tables()
    with pytest.raises((ValueError, TypeError), match=match):
        t.build_common_metadata(4, qlens, slens)  # type: ignore[arg-type]


def test_commit_copies_appended_entries_and_leaves_rows_past_n_pending() -> None:
    """Appended entries of rows past ``n`` stay pending (the device row is not touched) until a
    commit covers them, as whole dirty rows do."""
    t = BlockTables([16], [16], 4, [4], max_num_batched_tokens=8, num_blocks=64)
    for r in range(4):
        t.add_row(r, ([10 + r],))
    t.commit(4)
    t.append_rows([0, 3], [([20],), ([23],)])
    assert t._pending and not t._dirty
    t.commit(2)
    assert t.device_table(0)[:, :2].tolist() == [[10, 20], [11, -1], [12, -1], [13, -1]]
    t.commit(4)
    assert t.device_table(0)[:, :2].tolist() == [[10, 20], [11, -1], [12, -1], [13, 23]]
    assert not t._pending


@pytest.mark.parametrize("block_size", [1, 3, 12, 16, 24, 64])
def test_decode_slots_for_any_block_size_equal_the_general_path(block_size: int) -> None:
    """The decode lookup divides by shifts and masks for a power-of-two block size and by
    ``//`` and ``%`` otherwise: both give the general path's slots and positions."""
    gen = torch.Generator().manual_seed(block_size)
    rows, width = 5, 6
    tables = [
        BlockTables(
            [block_size],
            [block_size],
            rows,
            [width],
            max_num_batched_tokens=8,
            num_blocks=NUM_BLOCKS,
        )
        for _ in range(2)
    ]
    ids = torch.randperm(NUM_BLOCKS - 1, generator=gen)[: rows * width].add(1).view(rows, width)
    for t in tables:
        for r in range(rows):
            t.add_row(r, (ids[r].tolist(),))
        t.commit(rows)
    slens = torch.randint(1, width * block_size + 1, (rows,), generator=gen).tolist()
    got = snapshot(
        tables[0], tables[0].build_common_metadata(rows, [1] * rows, slens, pad_tokens_to=7)
    )
    with general_paths():
        want = snapshot(
            tables[1], tables[1].build_common_metadata(rows, [1] * rows, slens, pad_tokens_to=7)
        )
    assert got == want
    (md,) = tables[0].build_common_metadata(rows, [1] * rows, slens)
    by_hand = [
        int(ids[r, (s - 1) // block_size]) * block_size + (s - 1) % block_size
        for r, s in enumerate(slens)
    ]
    assert md.slot_mapping.tolist() == by_hand


class _Event:
    """A CUDA event's two calls, recorded (the CPU has no events)."""

    def __init__(self, done: bool) -> None:
        self.done, self.calls = done, []  # type: ignore[var-annotated]

    def query(self) -> bool:
        self.calls.append("query")
        return self.done

    def synchronize(self) -> None:
        self.calls.append("synchronize")


@pytest.mark.parametrize(("done", "calls"), [(True, ["query"]), (False, ["query", "synchronize"])])
def test_staging_waits_ask_the_event_first(done: bool, calls: list[str]) -> None:
    """A staged copy's event is waited on only when it has not run: the commit's before a row is
    written, the step's before its staging buffers are (HostDecode and the general path)."""
    t = _decode_tables()
    for what, write in (
        ("copy", lambda: t.append_rows([0], [([9],)])),
        ("step", lambda: t.build_common_metadata(4, [1, 1, 1, 1], [20, 16, 33, 17])),
        ("step", lambda: t.build_common_metadata(2, [3, 4], [20, 16])),  # the general path
    ):
        t.commit(4)
        events = {"copy": _Event(done), "step": _Event(done)}
        t._copy_event, t._step_event = events["copy"], events["step"]
        write()
        assert events[what].calls == calls, what
        assert not events["copy" if what == "step" else "step"].calls
    assert t._copy_event is events["copy"]  # the last write waited on the step's alone


@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize(("n", "padded"), [(1, 1), (3, 8), (5, 5), (255, 256), (256, 8192)])
def test_the_packed_staging_parts_are_aligned_and_apart(groups: int, n: int, padded: int) -> None:
    """Each part of a staged step's block starts 16-byte aligned (kernels specialize pointers on
    it: a misaligned part compiled them again while serving) and ends before the next begins;
    the largest step's block bounds every smaller one."""
    *offsets, used = hd_mod._packed_layout(n, padded, groups)
    sizes = [4 * n, 8 * n, *[8 * padded] * groups]
    assert all(o % 16 == 0 for o in offsets)
    assert all(
        o + size <= nxt for o, size, nxt in zip(offsets, sizes, [*offsets[1:], used], strict=True)
    )
    assert used <= hd_mod._packed_layout(256, 8192, groups)[-1]
    views = hd_mod._packed_views(torch.zeros(used, dtype=torch.uint8), n, padded, offsets)
    assert [v.numel() for v in views] == [n, n, *[padded] * groups]
    assert [v.dtype for v in views] == [torch.int32, torch.int64, *[torch.int64] * groups]


def test_a_step_records_one_event_for_its_commit_and_its_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Staged tables (pinned, CUDA's form; events faked on the CPU): the commit's copy gets no
    event of its own, the metadata built after it records one, which the next row write waits
    on; a row written after a commit with no metadata built records its own first."""
    t = _decode_tables()
    t._track_rows, t._pinned = False, True  # (the commit's staged copy, as on a GPU)
    made: list[_Event] = []

    def record() -> _Event:
        made.append(_Event(True))
        return made[-1]

    monkeypatch.setattr(t, "_record_event", record)
    t.commit(4)
    assert t._copy_event is commit_mod.UNRECORDED and not made
    t.build_common_metadata(4, [1, 1, 1, 1], [20, 16, 33, 17])
    assert len(made) == 1 and t._copy_event is made[0] is t._step_event
    t.append_rows([0], [([9],)])
    assert made[0].calls == ["query"] and t._copy_event is None
    t.commit(4)
    t.append_rows([1], [([10],)])  # no metadata since the commit: an event of its own
    assert len(made) == 2 and made[1].calls == ["query"]
