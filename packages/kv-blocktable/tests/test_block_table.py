"""BlockTables against a plain-Python model: rows as lists, slots and exports computed by hand.

The state machine adds, appends, clears, moves and swaps rows over 1-3 groups with kernel-block
ratios 1/2/4/8, then builds a step (random lengths, random padding) and checks every output
against the model and against ``CommonAttentionMetadata.from_lists``. Bad input is checked to
raise ``ValueError`` naming what was wrong.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    # The Triton interpreter is picked when kv-kernels' Triton module is first imported (lazily,
    # on the first impl="triton" call), so setting it here is early enough.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kv_backends import CommonAttentionMetadata  # noqa: E402
from kv_blocktable.block_table import BlockTables, KeyWindow  # noqa: E402

EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "0"))
NULL = 0

# -- the plain-Python model ---------------------------------------------------------------------


def model_kernel_row(ids: list[int], k: int, width: int) -> list[int]:
    """Manager blocks -> kernel blocks ``b * k + i``, padded with -1 to ``width`` columns."""
    row = [b * k + i for b in ids for i in range(k)]
    return row + [-1] * (width - len(row))


def model_slots(
    rows: list[list[int]], qlens: list[int], slens: list[int], bs: int, kbs: int, pad: int
) -> list[int]:
    k = bs // kbs
    out = []
    for ids, q, s in zip(rows, qlens, slens, strict=True):
        for pos in range(s - q, s):
            kernel_block = ids[pos // bs] * k + (pos % bs) // kbs
            out.append(kernel_block * kbs + pos % kbs)
    return out + [-1] * (pad - len(out))


def model_csr(
    rows: list[list[int]], slens: list[int], bs: int, kbs: int
) -> tuple[list[int], list[int], list[int]]:
    k = bs // kbs
    indptr, indices, last = [0], [], []
    for ids, s in zip(rows, slens, strict=True):
        pages = -(-s // kbs)
        indices += model_kernel_row(ids, k, 0)[:pages]
        indptr.append(indptr[-1] + pages)
        last.append(s - (pages - 1) * kbs)
    return indptr, indices, last


def model_first_visible(window: tuple[str, int] | None, pos: int) -> int:
    if window is None:
        return 0
    kind, size = window
    return max(pos - size + 1, 0) if kind == "sliding_window" else pos // size * size


def model_flex(
    rows: list[list[int]],
    qlens: list[int],
    slens: list[int],
    bs: int,
    kbs: int,
    num_blocks: int,
    window: tuple[str, int] | None,
) -> list[int] | None:
    """The map, or None when a non-null block sits at two columns (BlockTables must raise).
    Columns before the window of a request's first query are not read, so not mapped."""
    k = bs // kbs
    out = [-1] * (num_blocks * k)
    for ids, q, s in zip(rows, qlens, slens, strict=True):
        first_col = model_first_visible(window, s - q) // kbs
        for col, blk in enumerate(model_kernel_row(ids, k, 0)[: -(-s // kbs)]):
            if col < first_col or NULL * k <= blk < NULL * k + k:
                continue
            if out[blk] not in (-1, col):
                return None
            out[blk] = col
    return out


# -- the state machine --------------------------------------------------------------------------

RATIOS = (1, 2, 4, 8)
MAX_REQS = 5
MAX_TOKENS = 48
NUM_BLOCKS = 24
WINDOW_KINDS = ("sliding_window", "chunked_local")


def _distinct_real(ids: list[int]) -> list[int]:
    """``ids`` without repeats of a real block (the null block may repeat)."""
    seen: set[int] = set()
    out = []
    for b in ids:
        if b == NULL or b not in seen:
            out.append(b)
            seen.add(b)
    return out


class BlockTablesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[list[int]]] = []

    @initialize(
        groups=st.lists(
            st.tuples(
                st.sampled_from((8, 16)),
                st.sampled_from(RATIOS),
                st.integers(1, 5),
                st.one_of(
                    st.none(),
                    st.tuples(st.sampled_from(WINDOW_KINDS), st.integers(1, 24)),
                ),
            ),
            min_size=1,
            max_size=3,
        )
    )
    def setup(self, groups: list[tuple[int, int, int, tuple[str, int] | None]]) -> None:
        self.bs = [b for b, _, _, _ in groups]
        self.kbs = [b // k for b, k, _, _ in groups]
        self.maxb = [m for _, _, m, _ in groups]
        self.windows = [w for _, _, _, w in groups]
        self.bt = BlockTables(
            self.bs,
            self.kbs,
            MAX_REQS,
            self.maxb,
            max_num_batched_tokens=MAX_TOKENS,
            num_blocks=NUM_BLOCKS,
            key_windows=[None if w is None else KeyWindow(*w) for w in self.windows],
        )
        self.rows = [[[] for _ in groups] for _ in range(MAX_REQS)]

    def _ids(self, data: st.DataObject, room: list[int]) -> tuple[list[int], ...]:
        # Mostly real blocks, sometimes the null block (a sliding-window hole).
        # A list names a real block at most once (BlockTables refuses repeats); NULL may repeat.
        block = st.one_of(st.integers(1, NUM_BLOCKS - 1), st.just(NULL))
        return tuple(
            data.draw(st.lists(block, max_size=max(r, 0)).map(_distinct_real)) for r in room
        )

    @rule(data=st.data(), row=st.integers(0, MAX_REQS - 1))
    def add_row(self, data: st.DataObject, row: int) -> None:
        ids = self._ids(data, self.maxb)
        self.bt.add_row(row, ids)
        self.rows[row] = [list(x) for x in ids]

    @rule(data=st.data(), row=st.integers(0, MAX_REQS - 1))
    def append_row(self, data: st.DataObject, row: int) -> None:
        room = [m - len(r) for m, r in zip(self.maxb, self.rows[row], strict=True)]
        ids = self._ids(data, room)
        self.bt.append_row(row, ids)
        self.rows[row] = [r + list(x) for r, x in zip(self.rows[row], ids, strict=True)]

    @rule(data=st.data(), rows=st.lists(st.integers(0, MAX_REQS - 1), max_size=4))
    def append_rows(self, data: st.DataObject, rows: list[int]) -> None:
        # A row may repeat: its appends apply in order, so each draw leaves room for the next.
        model = [list(map(list, r)) for r in self.rows]
        batch = []
        for row in rows:
            room = [m - len(r) for m, r in zip(self.maxb, model[row], strict=True)]
            ids = self._ids(data, room)
            batch.append(ids)
            model[row] = [r + list(x) for r, x in zip(model[row], ids, strict=True)]
        self.bt.append_rows(rows, batch)
        self.rows = model

    @rule(row=st.integers(0, MAX_REQS - 1))
    def append_too_many(self, row: int) -> None:
        g = 0
        ids = tuple(
            list(range(1, 1 + self.maxb[i] - len(self.rows[row][i]) + (i == g)))
            for i in range(len(self.bs))
        )
        with pytest.raises(ValueError, match="max_num_blocks_per_req"):
            self.bt.append_row(row, ids)  # nothing written: the model is unchanged

    @rule(row=st.integers(0, MAX_REQS - 1))
    def clear_row(self, row: int) -> None:
        self.bt.clear_row(row)
        self.rows[row] = [[] for _ in self.bs]

    @rule(src=st.integers(0, MAX_REQS - 1), dst=st.integers(0, MAX_REQS - 1))
    def move_row(self, src: int, dst: int) -> None:
        self.bt.move_row(src, dst)
        self.rows[dst] = [list(x) for x in self.rows[src]]

    @rule(a=st.integers(0, MAX_REQS - 1), b=st.integers(0, MAX_REQS - 1))
    def swap_rows(self, a: int, b: int) -> None:
        self.bt.swap_rows(a, b)
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        num_reqs = data.draw(st.integers(0, MAX_REQS), label="num_reqs")
        self.bt.commit(num_reqs)
        rows = self.rows[:num_reqs]
        slens, qlens = [], []
        for r in rows:
            cap = min(len(ids) * bs for ids, bs in zip(r, self.bs, strict=True))
            s = data.draw(st.integers(0, cap))
            slens.append(s)
            qlens.append(data.draw(st.integers(0, min(s, MAX_TOKENS // MAX_REQS))))
        total = sum(qlens)
        pad = data.draw(st.one_of(st.none(), st.integers(total, MAX_TOKENS)), label="pad")
        padded = total if pad is None else pad
        null_write = any(
            ids[pos // bs] == NULL
            for r, q, s in zip(rows, qlens, slens, strict=True)
            for ids, bs in zip(r, self.bs, strict=True)
            for pos in range(s - q, s)
        )
        if null_write:
            with pytest.raises(ValueError, match="null block"):
                self.bt.build_common_metadata(num_reqs, qlens, slens, pad_tokens_to=pad)
            return
        mds = self.bt.build_common_metadata(num_reqs, qlens, slens, pad_tokens_to=pad)
        assert len(mds) == len(self.bs)
        for g, md in enumerate(mds):
            bs, kbs = self.bs[g], self.kbs[g]
            grows = [r[g] for r in rows]
            width = self.maxb[g] * (bs // kbs)
            assert md.block_table.tolist() == [
                model_kernel_row(ids, bs // kbs, width) for ids in grows
            ]
            assert md.slot_mapping.tolist() == model_slots(grows, qlens, slens, bs, kbs, padded)
            assert md.num_actual_tokens == total
            assert md.max_query_len == max(qlens, default=0)
            assert md.max_seq_len == max(slens, default=0)
            # The second oracle: kv-backends' own by-hand builder over the same kernel table.
            ref = CommonAttentionMetadata.from_lists(
                query_lens=qlens,
                seq_lens=slens,
                block_table=md.block_table,
                block_size=kbs,
                pad_tokens_to=padded,
            )
            for name in ("query_start_loc", "seq_lens", "slot_mapping"):
                assert torch.equal(getattr(md, name).long(), getattr(ref, name).long()), name
            assert torch.equal(md.query_start_loc_cpu, ref.query_start_loc_cpu)
            assert torch.equal(md.seq_lens_cpu, ref.seq_lens_cpu)
            indptr, indices, last = self.bt.csr(g)
            assert (indptr.tolist(), indices.tolist(), last.tolist()) == model_csr(
                grows, slens, bs, kbs
            )
            want = model_flex(grows, qlens, slens, bs, kbs, NUM_BLOCKS, self.windows[g])
            if want is None:
                with pytest.raises(ValueError, match="logical columns"):
                    self.bt.flex_physical_to_logical(g)
            else:
                assert self.bt.flex_physical_to_logical(g).tolist() == want

    @invariant()
    def host_rows_match(self) -> None:
        for g in range(len(self.rows[0]) if self.rows else 0):
            table = self.bt.host_table(g).tolist()
            for r, row in enumerate(self.rows):
                assert table[r] == row[g] + [-1] * (self.maxb[g] - len(row[g]))
                assert self.bt.num_blocks_of_row(r)[g] == len(row[g])


BlockTablesMachine.TestCase.settings = settings(
    max_examples=EXAMPLES or 50,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_block_tables_match_model = BlockTablesMachine.TestCase


class _Long(BlockTablesMachine):
    pass


_Long.TestCase.settings = settings(
    max_examples=EXAMPLES or 60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_block_tables_match_model_long = pytest.mark.slow(_Long.TestCase)


# -- bad input ----------------------------------------------------------------------------------


def _tables(**kw: object) -> BlockTables:
    args: dict[str, object] = dict(max_num_batched_tokens=32, num_blocks=10)
    args.update(kw)
    return BlockTables([16, 32], [8, 8], 3, [4, 2], **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda t: t.add_row(3, ([1], [2])), r"row=3 is not a row in \[0, max_num_reqs=3\)"),
        (lambda t: t.add_row(-1, ([1], [2])), "row=-1"),
        (lambda t: t.add_row(0, ([1],)), "tuple of 2 lists"),
        (lambda t: t.add_row(0, ([1, -2], [2])), "block id -2 is negative"),
        (lambda t: t.add_row(0, ([1], [10])), "block id 10 is >= num_blocks=10"),
        (lambda t: t.add_row(0, ([1, 2, 3, 4, 5], [2])), "5 blocks .* max_num_blocks_per_req=4"),
        (lambda t: t.move_row(0, 7), "dst=7"),
        (lambda t: t.swap_rows(True, 1), "a=True"),
        (lambda t: t.commit(4), r"num_reqs=4 must be an int in \[0, 3\]"),
        (lambda t: t.csr(2), r"group=2 is not in \[0, 2\)"),
    ],
)
def test_bad_rows_raise(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(_tables())  # type: ignore[operator]


def test_failed_append_writes_nothing() -> None:
    t = _tables()
    t.add_row(0, ([1, 2], [3]))
    with pytest.raises(ValueError, match="max_num_blocks_per_req=2"):
        t.append_row(0, ([4], [5, 6]))  # group 0 fits, group 1 does not
    assert t.num_blocks_of_row(0) == (2, 1)
    assert t.host_table(0)[0].tolist() == [1, 2, -1, -1]


def test_failed_append_rows_writes_nothing() -> None:
    t = _tables()
    t.add_row(0, ([1, 2], [3]))
    t.add_row(1, ([4], []))
    with pytest.raises(ValueError, match="row 0 group 1 would hold 3 blocks"):
        t.append_rows([1, 0], [([5], [6]), ([7], [8, 9])])  # row 1 fits, row 0 does not
    with pytest.raises(ValueError, match="block id 10 is >= num_blocks=10"):
        t.append_rows([1, 0], [([5], [6]), ([10], [])])
    with pytest.raises(ValueError, match="row=3"):
        t.append_rows([1, 3], [([5], [6]), ([7], [])])
    with pytest.raises(ValueError, match="2 rows but 1 block-id tuples"):
        t.append_rows([1, 0], [([5], [6])])
    assert (t.num_blocks_of_row(0), t.num_blocks_of_row(1)) == ((2, 1), (1, 0))
    assert t.host_table(0)[:2].tolist() == [[1, 2, -1, -1], [4, -1, -1, -1]]


def test_append_rows_matches_append_row() -> None:
    one, many = _tables(), _tables()
    for t in (one, many):
        t.add_row(0, ([1], [2]))
        t.add_row(2, ([3, 4], []))
    batch = [(2, ([5], [6])), (0, ([], [7])), (2, ([8], [])), (0, (torch.tensor([9]), []))]
    for row, ids in batch:
        one.append_row(row, ids)
    many.append_rows([r for r, _ in batch], [ids for _, ids in batch])
    for g in range(2):
        assert torch.equal(one.host_table(g), many.host_table(g))
    assert [many.num_blocks_of_row(r) for r in range(3)] == [(2, 2), (0, 0), (4, 1)]
    many.append_rows([], [])  # nothing to do
    assert many.host_table(0)[2].tolist() == [3, 4, 5, 8]


def test_slot_mapping_past_the_table_still_raises() -> None:
    # On the host only the columns the positions reach go to the reference; a position past the
    # table must still be refused with the full table's column count.
    t = _tables()
    t.add_row(0, ([1, 2, 3, 4], [5, 6]))
    t.commit(1)
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    slots = t.compute_slot_mapping(qsl, torch.tensor([17, 63]))
    assert [s.tolist() for s in slots] == [[2 * 16 + 1, 4 * 16 + 15], [5 * 32 + 17, 6 * 32 + 31]]
    with pytest.raises(ValueError, match="block_table has 4 columns"):
        t.compute_slot_mapping(qsl, torch.tensor([3, 64]))


@pytest.mark.parametrize(
    ("qlens", "slens", "pad", "match"),
    [
        ([2, 1], [1, 1], None, r"request 0: query_len=2 must be in \[0, seq_len=1\]"),
        ([1], [1, 1], None, r"query_lens has shape \(1,\); expected \(2,\)"),
        ([1, -1], [1, 1], None, "request 1: query_len=-1"),
        ([1, 1], [1, 40], None, "request 1: seq_len=40 needs 3 blocks of group 0"),
        ([1, 1], [1, 200], None, "max_num_blocks_per_req=4 cannot hold it"),
        ([1, 1], [1, 1], 1, "padded to 1"),
        ([20, 20], [20, 20], None, "max_num_batched_tokens=32"),
    ],
)
def test_bad_lengths_raise(qlens: list[int], slens: list[int], pad: int | None, match: str) -> None:
    t = _tables()
    t.add_row(0, ([1, 2], [3]))
    t.add_row(1, ([4, 5], [6]))
    t.commit(2)
    with pytest.raises(ValueError, match=match):
        t.build_common_metadata(2, qlens, slens, pad_tokens_to=pad)


def test_stale_tables_are_refused() -> None:
    t = _tables()
    t.add_row(0, ([1], [2]))
    with pytest.raises(ValueError, match="call commit"):
        t.build_common_metadata(1, [1], [1])
    t.commit(1)
    t.build_common_metadata(1, [1], [1])
    t.append_row(0, ([3], []))  # a row change after the commit makes the device copy stale
    with pytest.raises(ValueError, match="rows changed since the last commit"):
        t.csr(0)
    t.commit(1)
    with pytest.raises(ValueError, match=r"only 1 rows were committed; call commit\(2\)"):
        t.build_common_metadata(2, [1, 1], [1, 1])


def test_new_token_in_null_block_is_refused() -> None:
    t = _tables()
    t.add_row(0, ([NULL, 4], [5]))  # a sliding-window row: block 0 fell out of the window
    t.commit(1)
    md = t.build_common_metadata(1, [1], [20])  # position 19: block 4, fine
    assert md[0].slot_mapping.tolist() == [4 * 16 + 3]
    with pytest.raises(ValueError, match="position 15 maps to the null block 0"):
        t.build_common_metadata(1, [5], [20])


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="kernel_block_size=12 does not divide block_size=16"):
        BlockTables([16], [12], 2, [4], max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="one of each per KV group"):
        BlockTables([16, 16], [16], 2, [4, 4], max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="int32 range"):
        BlockTables([16], [1], 2, [4], max_num_batched_tokens=8, num_blocks=2**28)
    with pytest.raises(ValueError, match="impl='cuda'"):
        BlockTables([16], [16], 2, [4], max_num_batched_tokens=8, impl="cuda")
    t = BlockTables([16], [16], 2, [4], max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="past the int32 range"):
        t.add_row(0, ([2**31],))  # no num_blocks to check against: int32 still never wraps
    with pytest.raises(ValueError, match="needs num_blocks"):
        t.flex_physical_to_logical(0)


def test_triton_interpreter_matches_reference() -> None:
    """The Triton expansion and slot mapping (interpreted on the CPU) give the same tables, also
    after ``warmup`` launched both on the fresh tables (it must leave nothing a step reads)."""
    pytest.importorskip("numpy", reason="the Triton interpreter needs numpy")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET was not 1 when kv-kernels' Triton module was imported")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for impl in ("reference", "triton", "warm"):
        t = BlockTables(
            [16, 32],
            [4, 8],
            3,
            [4, 3],
            max_num_batched_tokens=40,
            num_blocks=16,
            impl="triton" if impl == "warm" else impl,
            device=device,
        )
        if impl == "warm":
            t.warmup()
        t.add_row(0, ([3, 1, 7], [2, 9]))
        t.add_row(1, ([5], [11]))
        t.add_row(2, ([8, 6], [4]))
        t.swap_rows(0, 2)
        t.commit(3)
        mds = t.build_common_metadata(3, [5, 2, 20], [30, 16, 40], pad_tokens_to=33)
        out[impl] = [(m.block_table.cpu(), m.slot_mapping.cpu()) for m in mds]
    for impl in ("triton", "warm"):
        for (bt_r, sm_r), (bt_t, sm_t) in zip(out["reference"], out[impl], strict=True):
            assert torch.equal(bt_r, bt_t)
            assert torch.equal(sm_r, sm_t)


# -- fast paths: rows committed incrementally, pure-decode steps ---------------------------------


@pytest.mark.parametrize(
    ("block_sizes", "kernel_block_sizes"),
    [([16], [16]), ([16], [4]), ([16, 32], [16, 8])],  # aliased kernel table, expanded, two groups
)
def test_incremental_commit_never_leaves_a_stale_row(
    block_sizes: list[int], kernel_block_sizes: list[int]
) -> None:
    """Host tables commit only the rows written since their last commit: after every commit, the
    committed and kernel tables of rows [0, n) equal a full copy and expansion of the host rows,
    also for rows written while they were past n and for moves, swaps and clears. The batch is
    wide enough that a few changed rows take the gather path, not the whole-range copy."""
    g = torch.Generator().manual_seed(0)
    ngroups, r = len(block_sizes), 40
    t = BlockTables(block_sizes, kernel_block_sizes, r, [5] * ngroups, max_num_batched_tokens=8)

    def ids() -> tuple[list[int], ...]:
        # Two distinct ids per group (a row names a block once).
        return tuple((torch.randperm(49, generator=g)[:2] + 1).tolist() for _ in range(ngroups))

    def check(n: int) -> None:
        for grp, (bs, kbs) in enumerate(zip(block_sizes, kernel_block_sizes, strict=True)):
            host = t.host_table(grp)[:n].tolist()
            assert t.device_table(grp)[:n].tolist() == host
            assert t.kernel_table(grp)[:n].tolist() == [
                model_kernel_row([b for b in row if b >= 0], bs // kbs, 5 * (bs // kbs))
                for row in host
            ]

    for row in range(r):
        t.add_row(row, ids())
    t.commit(r)
    check(r)
    ops = [
        lambda: t.append_rows([1, 34], [ids(), ids()]),  # row 34 past the next commit's n
        lambda: t.commit(30),
        lambda: t.swap_rows(0, 35),
        lambda: t.move_row(2, 1),
        lambda: t.commit(20),
        lambda: t.clear_row(0),
        lambda: t.add_row(3, ids()),
        lambda: t.commit(r),  # rows 34 and 35 were written while past n: committed now
        lambda: t.append_row(39, ids()),
        lambda: t.commit(r),
    ]
    for op in ops:
        op()
        if t._committed is not None:
            check(t._committed)
    check(r)


def test_pure_decode_step_slots_and_positions() -> None:
    """A step of one token per request takes the decode shortcut (positions = seq_len - 1); a
    step with as many tokens as requests but uneven query lengths must not."""
    t = _tables()
    t.add_row(0, ([1, 2], [3]))
    t.add_row(1, ([4, 5], [6]))
    t.add_row(2, ([7, 8, 9], [9, 8]))
    t.commit(3)
    rows = [[[1, 2], [3]], [[4, 5], [6]], [[7, 8, 9], [9, 8]]]
    for qlens, slens in (
        ([1, 1, 1], [17, 32, 40]),
        ([0, 2, 1], [5, 32, 40]),
        ([2, 0, 1], [2, 9, 1]),
    ):
        mds = t.build_common_metadata(3, qlens, slens, pad_tokens_to=5)
        for g, (bs, kbs) in enumerate(((16, 8), (32, 8))):
            grows = [r[g] for r in rows]
            assert mds[g].slot_mapping.tolist() == model_slots(grows, qlens, slens, bs, kbs, 5)
        want_pos = [p for q, s in zip(qlens, slens, strict=True) for p in range(s - q, s)]
        assert t._last_step.positions.tolist() == want_pos
        assert mds[0].query_start_loc.tolist() == [0, qlens[0], qlens[0] + qlens[1], sum(qlens)]


def test_row_counts_follow_move_swap_and_clear() -> None:
    """The per-row block counts (Python lists the coverage check reads every step) move with
    their rows and never alias: a moved row grows alone, a swapped row's count goes with its
    ids, a cleared row covers nothing."""
    t = _tables()
    t.add_row(0, ([1], [2]))
    t.add_row(1, ([3, 4], [5]))
    t.move_row(0, 2)
    t.add_row(2, ([6, 7], [8]))  # row 2 is rewritten, then grows; row 0, its source, must not
    t.append_row(2, ([9], []))
    assert [t.num_blocks_of_row(r) for r in range(3)] == [(1, 1), (2, 1), (3, 1)]
    t.commit(3)
    with pytest.raises(ValueError, match="request 0: seq_len=17 needs 2 blocks of group 0"):
        t.build_common_metadata(3, [1, 1, 1], [17, 17, 17])
    t.swap_rows(0, 1)  # row 0 now holds two blocks of group 0, row 1 one
    assert [t.num_blocks_of_row(r) for r in range(2)] == [(2, 1), (1, 1)]
    t.commit(3)
    t.build_common_metadata(3, [1, 1, 1], [17, 16, 32])
    with pytest.raises(ValueError, match="request 1: seq_len=17 needs 2 blocks of group 0"):
        t.build_common_metadata(3, [1, 1, 1], [17, 17, 17])
    t.clear_row(0)
    t.commit(3)
    assert t.num_blocks_of_row(0) == (0, 0)
    with pytest.raises(ValueError, match="request 0: seq_len=1 needs 1 blocks of group 0"):
        t.build_common_metadata(3, [1, 1, 1], [1, 16, 32])


def test_decode_steps_of_changing_sizes_get_their_own_ranges() -> None:
    """Decode steps share ``token_reqs`` / ``query_start_loc`` per batch size: steps of 3, 2, 3
    requests with a prefill between must each see their own ranges, and ``positions`` must be
    the last built step's (the engine feeds them to the model)."""
    t = _tables()
    t.add_row(0, ([1, 2], [3]))
    t.add_row(1, ([4, 5], [6]))
    t.add_row(2, ([7, 8], [9]))
    t.commit(3)
    steps = [
        (3, [1, 1, 1], [17, 32, 20]),
        (2, [1, 1], [18, 30]),
        (3, [3, 1, 2], [19, 31, 22]),
        (3, [1, 1, 1], [20, 32, 23]),
        (2, [1, 1], [21, 5]),
    ]
    for n, qlens, slens in steps:
        mds = t.build_common_metadata(n, qlens, slens)
        want_pos = [p for q, s in zip(qlens, slens, strict=True) for p in range(s - q, s)]
        assert t.positions.tolist() == want_pos
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        assert mds[0].query_start_loc.tolist() == qsl
        assert mds[0].query_start_loc_cpu.tolist() == qsl
        assert mds[0].seq_lens_cpu.tolist() == slens
        step = t._last_step
        assert step is not None and step.token_reqs.tolist() == [
            r for r, q in enumerate(qlens) for _ in range(q)
        ]
        for g, (bs, kbs) in enumerate(((16, 8), (32, 8))):
            rows = [[[1, 2], [3]], [[4, 5], [6]], [[7, 8], [9]]][:n]
            want = model_slots([r[g] for r in rows], qlens, slens, bs, kbs, sum(qlens))
            assert mds[g].slot_mapping.tolist() == want


@pytest.mark.parametrize(
    ("block_sizes", "kernel_block_sizes"),
    [([16], [16]), ([16], [4]), ([16, 32], [16, 8]), ([32, 16, 64], [8, 16, 16])],
)
def test_host_slots_equal_the_kv_kernels_slot_mapping(
    block_sizes: list[int], kernel_block_sizes: list[int]
) -> None:
    """Host tables take the slots from the null check's lookup (``host_slot_mapping``) instead of
    kv-kernels' ``compute_slot_mapping``: the same int64 values on random batches (shuffled
    rows, empty requests, prefill chunks, decodes, CUDA-graph padding, big block ids)."""
    from kv_kernels.slot_mapping import compute_slot_mapping

    g = torch.Generator().manual_seed(0)
    ngroups, rows, cols = len(block_sizes), 12, 6
    t = BlockTables(
        block_sizes, kernel_block_sizes, rows, [cols] * ngroups, max_num_batched_tokens=512
    )
    for _ in range(20):
        n = int(torch.randint(1, rows + 1, (1,), generator=g))
        for r in range(n):
            ids = tuple(
                torch.randint(1, 2**28, (cols,), generator=g).tolist() for _ in range(ngroups)
            )
            t.add_row(r, ids)
        t.commit(n)
        slens = [int(x) for x in torch.randint(1, 16 * cols + 1, (n,), generator=g)]
        qlens = [
            min(s, int(torch.randint(0, 3, (1,), generator=g)) or 1 if k % 3 else s % 20)
            for k, s in enumerate(slens)
        ]
        pad = sum(qlens) + int(torch.randint(0, 4, (1,), generator=g))
        mds = t.build_common_metadata(n, qlens, slens, pad_tokens_to=pad)
        assert t._last_step is not None
        for grp, (bs, kbs) in enumerate(zip(block_sizes, kernel_block_sizes, strict=True)):
            want = compute_slot_mapping(
                t.device_table(grp)[:n], t._last_step.positions, mds[grp].query_start_loc,
                bs, kbs, num_slots=pad, impl="reference",
            )  # fmt: skip
            assert mds[grp].slot_mapping.dtype == torch.int64
            assert torch.equal(mds[grp].slot_mapping, want), (grp, qlens, slens)
        # ids near 2**28 times block sizes of 16-64: slots past the int32 range stay exact.
        assert max(int(md.slot_mapping.max()) for md in mds) > 2**31
