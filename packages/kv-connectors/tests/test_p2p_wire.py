"""The P2P data path (``kv_connectors._p2p_wire``): chunk plans both sides agree on, cache views
that are the rows a gather would write (sent and received without staging), and pulls between
two in-process connectors over gloo that take the direct path and stay byte-exact."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kv_connectors import KVTransferParams, P2pConfig, P2pConnector, p2p, transfer
from kv_connectors._p2p_wire import Wire, plan_chunks, plan_layers
from kv_connectors._p2p_wire import time as p2p_wire_time
from kv_connectors.base import LoadSpec
from kv_connectors.testing import block_bytes, make_layout, random_cache, standard_layouts
from kv_connectors.views import RegisteredKV, is_run

TIMEOUT = 5.0


def test_plan_chunks_cover_every_block_once_per_segment() -> None:
    rows = plan_chunks(10, chunk_rows=4)
    assert [(c.segment, c.start, c.count) for c in rows] == [
        (None, 0, 4),
        (None, 4, 4),
        (None, 8, 2),
    ]
    segs = plan_chunks(5, segment_widths=[100, 300], chunk_bytes=250)  # 2 rows, then 1 row
    assert [(c.segment, c.start, c.count) for c in segs] == [
        (0, 0, 2), (0, 2, 2), (0, 4, 1), (1, 0, 1), (1, 1, 1), (1, 2, 1), (1, 3, 1), (1, 4, 1)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="chunk_rows=0 must be an int >= 1"):
        plan_chunks(3, chunk_rows=0)
    with pytest.raises(ValueError, match="chunk_bytes=None"):
        plan_chunks(3, segment_widths=[8])


def test_plan_layers_is_segment_major_over_the_requests() -> None:
    """Segment 0 of every request (in order), then segment 1 ...; a chunk never spans two
    requests; starts index the requests' concatenated block lists."""
    got = plan_layers([3, 1], segment_widths=[100, 300], chunk_bytes=250)
    assert [(c.segment, c.part, c.start, c.count) for c in got] == [
        (0, 0, 0, 2), (0, 0, 2, 1), (0, 1, 3, 1),
        (1, 0, 0, 1), (1, 0, 1, 1), (1, 0, 2, 1), (1, 1, 3, 1),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        plan_layers([1], segment_widths=[8], chunk_bytes=0)


def _gathered(kv: RegisteredKV, ids: list[int], segment: int | None) -> torch.Tensor:
    width = kv.row_bytes if segment is None else kv.segments[segment].row_bytes
    out = torch.empty(len(ids), width, dtype=torch.uint8)
    if segment is None:
        kv.gather(ids, out)
    else:
        kv.gather(ids, out, segments=range(segment, segment + 1), cols=False)
    return out


@pytest.mark.parametrize("name", list(standard_layouts()))
def test_contiguous_rows_are_exactly_what_a_gather_writes(name: str) -> None:
    layout = standard_layouts()[name]
    kv = RegisteredKV(random_cache(layout, seed=3), layout)
    ids = [3, 4, 5]
    segments: list[int | None] = [None, *range(len(kv.segments))]
    views = {seg: kv.contiguous_rows(ids, seg) for seg in segments}
    for seg, view in views.items():
        if view is not None:
            assert torch.equal(view, _gathered(kv, ids, seg)), (name, seg)
    # which layouts take the direct path: page-contiguous pages that fill the block stride
    direct = layout.order.page_contiguous and not layout.scale_plane
    if direct and layout.block_stride_bytes == layout.num_layers * layout.page_bytes:
        assert views[None] is not None  # cross-layer: whole rows are the slab itself
    if direct and layout.order.layer_outer and layout.block_stride_bytes == layout.page_bytes:
        assert all(views[s] is not None for s in range(len(kv.segments)))
    if not layout.order.page_contiguous:  # head-outer pages are H pieces: never one view
        assert all(v is None for v in views.values())
    assert kv.contiguous_rows([3, 5, 6], 0) is None  # not consecutive
    assert kv.contiguous_rows([3, 9, 5], 0) is None  # the ends of a run, not one inside
    assert kv.contiguous_rows([5, 4], 0) is None  # consecutive, but descending
    assert kv.contiguous_rows([], 0) is None
    last = [kv.num_blocks - 2, kv.num_blocks - 1]  # the cache's last rows, in place
    for seg in segments:
        view = kv.contiguous_rows(last, seg)
        if view is not None:
            assert torch.equal(view, _gathered(kv, last, seg)), (name, seg)
            # a run past the cache is refused, never clipped to the rows that exist
            with pytest.raises(ValueError, match="outside"):
                kv.contiguous_rows([kv.num_blocks - 1, kv.num_blocks], seg)


def test_is_run_takes_only_ascending_steps_of_one() -> None:
    assert is_run([5]) and is_run([3, 4, 5]) and is_run((7, 8))
    assert not is_run([]) and not is_run([3, 9, 5]) and not is_run([5, 4]) and not is_run([3, 3])


def test_contiguous_rows_check_can_fail() -> None:
    """Planted bug: a view one block off (what an offset without the block index gives) differs
    from the gather, so the comparison above would catch it."""
    layout = make_layout("BLNHC")
    kv = RegisteredKV(random_cache(layout, seed=3), layout)
    off_by_one = kv.contiguous_rows([4, 5, 6])
    assert off_by_one is not None
    assert not torch.equal(off_by_one, _gathered(kv, [3, 4, 5], None))


def _in_process_pair(layout: Any, buffer_bytes: int) -> tuple[P2pConnector, P2pConnector, Any, Any]:
    prod = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, buffer_bytes=buffer_bytes), block_size=layout.block_size
    )
    src = random_cache(layout, seed=1)
    prod.register_kv_caches(src, layout)
    cons = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, role="consumer", buffer_bytes=buffer_bytes),
        block_size=layout.block_size,
    )
    dst = random_cache(layout, seed=2)
    cons.register_kv_caches(dst, layout)
    return prod, cons, src, dst


class _Seen:
    """A process group that records its sends and receives in ``log`` (and passes everything
    on)."""

    def __init__(self, pg: Any, log: list[str]) -> None:
        self._pg, self._log = pg, log

    def recv(self, *a: Any, **k: Any) -> Any:
        self._log.append("recv")
        return self._pg.recv(*a, **k)

    def send(self, *a: Any, **k: Any) -> Any:
        self._log.append("send")
        return self._pg.send(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)


@pytest.mark.parametrize("early", [False, True], ids=["answer_first", "post_first"])
@pytest.mark.parametrize("order", ["BLNHC", "LBNHC"])
def test_consecutive_blocks_move_without_staging_and_byte_exact(
    order: str,
    early: bool,
    make_request: Callable[..., Any],
    remote_load: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Consecutive producer blocks into consecutive local blocks: a cross-layer cache sends and
    receives straight from and into the slab (no gather, no scatter); a per-layer cache gathers
    whole rows (one view per layer would be a message per layer) but still lands byte-exact.
    Non-consecutive blocks go through staging. ``post_first``: the order connected NCCL
    sessions use (here over gloo, which takes it as well when the pull is admitted): the
    consumer asks, posts its first receive, then reads the answer; the producer posts its
    first send, then answers. A session's first pull waits for the answer on both sides (the
    communicator is made then). The logs hold each side's order, pull by pull."""
    layout = make_layout(order, num_blocks=16)
    row = layout.num_layers * layout.page_bytes
    prod, cons, src, dst = _in_process_pair(layout, buffer_bytes=6 * row)  # 3 rows a chunk
    cons._post_before_ask = prod._post_before_ask = early
    mine_log: list[str] = []  # the consumer's
    asked_on: list[str] = []  # the thread of each ask
    theirs_log: list[str] = []  # the producer's
    for name, what in (("_ask_pull", "ask"), ("_pull_answer", "answer")):
        original = getattr(P2pConnector, name)

        def logged(*a: Any, _o: Any = original, _w: str = what, **k: Any) -> Any:
            mine_log.append(_w)
            if _w == "ask":
                asked_on.append(threading.current_thread().name)
            return _o(*a, **k)

        static = name == "_pull_answer"  # (a staticmethod: patched as one)
        monkeypatch.setattr(P2pConnector, name, staticmethod(logged) if static else logged)
    send_msg = p2p.send_msg

    def replies(sock: Any, msg: dict[str, Any]) -> None:
        if "ok" in msg and "store_port" not in msg:  # a pull's answer (not the hello's)
            theirs_log.append("answer")
        send_msg(sock, msg)

    for module in (p2p, transfer):  # (the answer-first path answers from transfer's)
        monkeypatch.setattr(module, "send_msg", replies)
    init = Wire.__init__

    def seen(self: Wire, kv: Any, pg: Any, *a: Any) -> None:
        init(self, kv, pg, *a)
        self.pg = _Seen(pg, mine_log if kv is cons.kv else theirs_log)

    monkeypatch.setattr(Wire, "__init__", seen)
    calls = {"gather": 0, "scatter": 0}
    for name in calls:
        original = getattr(RegisteredKV, name)

        def counted(
            self: RegisteredKV, *a: Any, _o: Any = original, _n: str = name, **k: Any
        ) -> None:
            calls[_n] += 1
            _o(self, *a, **k)

        monkeypatch.setattr(RegisteredKV, name, counted)
    cases = [([2, 3, 4, 5, 6, 7, 8], [8, 9, 10, 11, 12, 13, 14]), ([9, 1, 6], [3, 0, 15])]
    for i, (theirs, mine) in enumerate(cases):
        for k in calls:
            calls[k] = 0
        _delay, params = prod.request_finished(make_request(f"p{i}", len(theirs), 4), theirs)
        assert params is not None
        want = [block_bytes(src, layout, b) for b in theirs]
        assert remote_load.start(cons, params, mine, f"c{i}") == len(theirs) * 4
        _t, errors = remote_load.finish(cons, f"c{i}", 3 * TIMEOUT + 10, poll_s=0.01)
        assert errors == set(), cons.load_error_reasons
        for b, w in zip(mine, want, strict=True):
            assert torch.equal(block_bytes(dst, layout, b), w)
        direct = order == "BLNHC" and i == 0
        assert (calls["gather"] == 0) is direct and (calls["scatter"] == 0) is direct, calls
        post_first = early and i > 0  # (then a message a chunk on each side)
        assert mine_log[:3] == (
            ["ask", "recv", "answer"] if post_first else ["ask", "answer", "recv"]
        ), mine_log
        want_theirs = ["send", "answer"] if post_first else ["answer", "send"]
        assert theirs_log[:2] == want_theirs, theirs_log
        assert mine_log.count("answer") == theirs_log.count("answer") == 1
        # a connected session's ask leaves from start_load_kv's thread (here the test's), not
        # the pull thread: it is on its way while the pull thread wakes
        caller = threading.current_thread().name
        assert (asked_on == [caller]) is post_first, asked_on
        asked_on.clear()
        mine_log.clear()
        theirs_log.clear()
    prod.close()
    cons.close()


def test_early_ask_falls_back_to_the_pull_thread(
    make_request: Callable[..., Any], remote_load: Any
) -> None:
    """``_ask_now`` asks only on a connected, idle session: with the session's lock held by
    another pull it leaves the ask to the pull thread (None, nothing sent); with the session's
    socket broken it drops the session and the pull thread makes a new one, which lands the
    request byte-exact."""
    layout = make_layout("BLNHC", num_blocks=16)
    prod, cons, src, dst = _in_process_pair(layout, 6 * layout.num_layers * layout.page_bytes)
    cons._post_before_ask = prod._post_before_ask = True

    def load(i: int, theirs: list[int], mine: list[int]) -> Any:
        _delay, params = prod.request_finished(make_request(f"p{i}", len(theirs), 4), theirs)
        want = [block_bytes(src, layout, b) for b in theirs]
        _load_exact(remote_load, cons, params, mine, want, dst, layout)
        return params

    params = load(0, [2, 3], [8, 9])  # the session's first pull: connected after it
    (sess,) = cons._peers.values()
    assert sess.wire.connected
    plan = cons._plan(KVTransferParams.from_dict(params))
    spec = LoadSpec("x", (8, 9), (), params=plan.params)
    with sess.lock:  # another pull holds the session
        assert cons._ask_now(spec, plan) is None
    sess.sock.close()  # the session broke: dropped, the pull thread makes a new one
    assert cons._ask_now(spec, plan) is None
    assert sess not in cons._peers.values()
    load(1, [4, 5, 6], [10, 11, 12])
    (fresh,) = cons._peers.values()
    assert fresh is not sess
    prod.close()
    cons.close()


def test_an_abort_does_not_cancel_a_pull_whose_ask_left(
    make_request: Callable[..., Any], remote_load: Any
) -> None:
    """A pull whose ask left from ``start_load_kv`` holds its session's lock until its pull
    thread runs: an abort while it waits in the pool must not cancel it (a cancelled one would
    never release the lock, and the producer serves the ask anyway). It runs, lands, is
    reported, and the next pull on the session lands too. Planted: cancelling it leaves the next
    pull waiting on the lock until the test's limit."""
    layout = make_layout("BLNHC", num_blocks=16)
    prod, cons, src, dst = _in_process_pair(layout, 6 * layout.num_layers * layout.page_bytes)
    cons._post_before_ask = prod._post_before_ask = True

    def start(i: int, theirs: list[int], mine: list[int]) -> list[torch.Tensor]:
        _delay, params = prod.request_finished(make_request(f"p{i}", len(theirs), 4), theirs)
        assert remote_load.start(cons, params, mine, f"c{i}") == len(theirs) * 4
        return [block_bytes(src, layout, b) for b in theirs]

    def landed(i: int, mine: list[int], want: list[torch.Tensor]) -> None:
        _t, errors = remote_load.finish(cons, f"c{i}", 3 * TIMEOUT + 10, poll_s=0.01)
        assert errors == set(), cons.load_error_reasons
        for b, w in zip(mine, want, strict=True):
            assert torch.equal(block_bytes(dst, layout, b), w)

    landed(0, [8, 9], start(0, [2, 3], [8, 9]))  # the session's first pull: connected after it
    gate = threading.Event()
    held = [cons._executor.submit(gate.wait, 30) for _ in range(4)]  # every pull thread busy
    want = start(1, [4, 5], [10, 11])
    (fut,) = cons._futures
    assert fut in cons._asked and not fut.running()  # asked, queued behind the held threads
    cons.abort_request("c1")
    assert not fut.cancelled()
    gate.set()
    for h in held:
        h.result(timeout=10)
    landed(1, [10, 11], want)
    landed(2, [12, 13], start(2, [6, 7], [12, 13]))
    prod.close()
    cons.close()


def _count(monkeypatch: pytest.MonkeyPatch, module: Any, names: list[str]) -> dict[str, int]:
    """Count calls of ``module.<name>`` (the block copies the views launch, the wire's
    messages) from now on."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(module, name)

        def counted(*a: Any, _o: Any = original, _n: str = name, **k: Any) -> Any:
            calls[_n] += 1
            return _o(*a, **k)

        monkeypatch.setattr(module, name, counted)
    return calls


def _load_exact(
    remote_load: Any,
    cons: P2pConnector,
    params: Any,
    mine: list[int],
    want: list[torch.Tensor],
    dst: Any,
    layout: Any,
) -> None:
    """Load ``params`` into blocks ``mine`` of ``dst``: no load error, each block's bytes
    ``want`` (block-size 4 requests)."""
    assert remote_load.start(cons, params, mine, "c") == len(mine) * 4
    _t, errors = remote_load.finish(cons, "c", 3 * TIMEOUT + 10, poll_s=0.01)
    assert errors == set(), cons.load_error_reasons
    for b, w in zip(mine, want, strict=True):
        assert torch.equal(block_bytes(dst, layout, b), w)


@pytest.mark.parametrize(
    ("order", "theirs", "mine", "messages", "staged"),
    [
        ("BLNHC", list(range(2, 9)), list(range(8, 15)), 1, 0),  # direct both sides: one message
        # 3 rows a chunk; the last chunk is one block, its own memory on both sides (direct)
        ("BLNHC", [9, 1, 6, 4, 12, 2, 7], [3, 0, 15, 5, 11, 8, 1], 3, 2),
        ("LBNHC", list(range(2, 9)), list(range(8, 15)), 3, 3),  # per-layer rows are staged
        ("LBNHC", [9, 1, 6, 4, 12, 2, 7], [3, 0, 15, 5, 11, 8, 1], 3, 3),
    ],
)
def test_a_pull_is_one_copy_launch_per_chunk_and_the_fewest_messages(
    order: str,
    theirs: list[int],
    mine: list[int],
    messages: int,
    staged: int,
    make_request: Callable[..., Any],
    remote_load: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 30: a per-layer cache moved each chunk as one block copy per layer (32 launches and
    their host checks per chunk on the H200: 0.04x of NCCL). Now each chunk is one gather on the
    producer and one scatter on the consumer whatever the layer count, and a request whose
    blocks are the caches' own memory on both sides is one message however small the buffer."""
    import kv_connectors.views as views
    from kv_connectors._p2p_wire import Wire

    layout = make_layout(order, num_layers=4, num_blocks=16)
    row = layout.num_layers * layout.page_bytes
    prod, cons, src, dst = _in_process_pair(layout, buffer_bytes=6 * row)  # 3 rows a chunk
    copies = _count(monkeypatch, views, ["gather_blocks", "scatter_blocks"])
    sent: list[int] = []
    original_recv = Wire.recv

    def recv(self: Wire, src_rank: int, chunks: Any, *a: Any, **k: Any) -> None:
        sent.append(len(chunks))
        original_recv(self, src_rank, chunks, *a, **k)

    monkeypatch.setattr(Wire, "recv", recv)
    _delay, params = prod.request_finished(make_request("p", len(theirs), 4), theirs)
    assert params is not None
    want = [block_bytes(src, layout, b) for b in theirs]
    _load_exact(remote_load, cons, params, mine, want, dst, layout)
    assert sent == [messages]
    assert copies == {"gather_blocks": staged, "scatter_blocks": staged}, copies
    prod.close()
    cons.close()


@pytest.mark.parametrize("name", [*standard_layouts(), "hybrid"])
def test_whole_row_copies_are_one_call_per_cache_and_equal_the_per_segment_ones(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole rows gathered (and scattered back) in one call per registered cache are byte for
    byte the rows the per-segment copies write; a hybrid registration (two caches) is two."""
    import kv_connectors.views as views

    if name == "hybrid":
        lays = [make_layout("LBNHC", num_layers=3), make_layout("BLNHC", num_layers=2)]
        kv = RegisteredKV([random_cache(lay, seed=i) for i, lay in enumerate(lays)], lays)
    else:
        layout = standard_layouts()[name]
        kv = RegisteredKV(random_cache(layout, seed=3), layout)
    ids = [5, 1, 3]
    per_segment = torch.empty(len(ids), kv.row_bytes, dtype=torch.uint8)
    kv.gather(ids, per_segment, segments=range(len(kv.segments)))
    copies = _count(monkeypatch, views, ["gather_blocks", "scatter_blocks"])
    whole = torch.empty_like(per_segment)
    kv.gather(ids, whole)
    assert torch.equal(whole, per_segment)
    kv.scatter(whole.flip(0).contiguous(), ids)  # blocks 5 and 3 swap their bytes
    back = torch.empty_like(whole)
    kv.gather(ids, back, segments=range(len(kv.segments)))
    assert torch.equal(back, per_segment.flip(0))
    whole_calls = len(kv.layouts)  # the per-segment read back above adds one per segment
    assert copies == {
        "gather_blocks": whole_calls + len(kv.segments),
        "scatter_blocks": whole_calls,
    }


def test_whole_row_check_and_counts_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bugs: whole rows with two layers' columns swapped differ from the per-segment
    gather, and the per-segment path counts one call per layer (what the old whole-row copy
    made), so the tests above would catch either."""
    import kv_connectors.views as views

    layout = make_layout("LBNHC", num_layers=4)
    kv = RegisteredKV(random_cache(layout, seed=3), layout)
    ids = [5, 1, 3]
    good = torch.empty(len(ids), kv.row_bytes, dtype=torch.uint8)
    kv.gather(ids, good)
    page = layout.page_bytes
    swapped = torch.cat([good[:, page : 2 * page], good[:, :page], good[:, 2 * page :]], 1)
    assert not torch.equal(swapped, good)
    copies = _count(monkeypatch, views, ["gather_blocks"])
    kv.gather(ids, good, segments=range(len(kv.segments)))
    assert copies["gather_blocks"] == layout.num_layers


@pytest.mark.parametrize(
    ("order", "ids", "messages"),
    [("BLNHC", [4, 5, 6, 7, 8], 1), ("BLNHC", [4, 9, 6, 7, 8], 3), ("LBNHC", [4, 5, 6, 7, 8], 3)],
)
def test_a_push_of_the_caches_own_memory_is_one_message(
    order: str,
    ids: list[int],
    messages: int,
    make_request: Callable[..., Any],
    remote_load: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A push whose blocks are the producer cache's own memory (consecutive ids of a slab) is one
    message (the consumer always receives into its receive buffer); other pushes keep chunks of
    ``buffer_bytes / 2``; both land byte-exact."""
    from kv_connectors._p2p_wire import Wire

    layout = make_layout(order, num_layers=4, num_blocks=16)
    row = layout.num_layers * layout.page_bytes
    cons = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, mode="write", role="consumer", buffer_bytes=4 * row),
        block_size=layout.block_size,
    )
    dst = random_cache(layout, seed=2)
    cons.register_kv_caches(dst, layout)
    host, port = cons.address
    prod = P2pConnector(
        P2pConfig(timeout_s=TIMEOUT, mode="write", push_to=f"{host}:{port}", buffer_bytes=4 * row),
        block_size=layout.block_size,
    )  # 2 rows a chunk
    src = random_cache(layout, seed=1)
    prod.register_kv_caches(src, layout)
    sent: list[int] = []
    original_send = Wire.send

    def send(self: Wire, dst_rank: int, block_ids: Any, chunks: Any, **k: Any) -> None:
        sent.append(len(chunks))
        original_send(self, dst_rank, block_ids, chunks, **k)

    monkeypatch.setattr(Wire, "send", send)
    _delay, params = prod.request_finished(make_request("p", len(ids), 4), ids)
    assert params is not None
    want = [block_bytes(src, layout, b) for b in ids]
    prod.wait_for_save()
    deadline = time.monotonic() + 3 * TIMEOUT
    while "p" not in prod.get_finished()[0]:
        assert time.monotonic() < deadline, "the push ends"
        time.sleep(0.005)
    mine = [10, 3, 12, 0, 7]
    _load_exact(remote_load, cons, params, mine, want, dst, layout)
    assert sent == [messages]
    prod.close()
    cons.close()


class _RecordingGroup:
    """A process group stand-in that records when each receive is posted (gloo-like work)."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        log = self.log
        log.append(("post", tensors[0].shape[0]))

        class _Done:
            def wait(self, timeout: Any = None) -> bool:
                return True

        return _Done()


def test_every_landing_is_preloaded_before_the_first_receive_is_posted() -> None:
    """``Wire.recv(preload=...)`` hands every staged chunk's rows to ``preload`` before it posts
    any receive: on CUDA a landing kernel first loaded under a pending NCCL receive waits for
    that receive (the 2 x H200 layer-wise pull whose producer held its last layer until the
    first had landed hung in Triton's module load). The order check fails for a wire that
    preloads lazily, chunk by chunk."""
    from kv_connectors._p2p_wire import Wire

    layout = make_layout("LBNHC")
    kv = RegisteredKV(random_cache(layout, seed=1), layout)
    log: list[tuple[str, int]] = []
    wire = Wire(kv, _RecordingGroup(log), "gloo", TIMEOUT)
    widths = [seg.row_bytes for seg in kv.segments]
    chunks = plan_layers([3, 1], segment_widths=widths, chunk_bytes=2 * max(widths))
    shapes: list[tuple[int, int]] = []

    def preload(ch: Any, rows: torch.Tensor) -> None:
        shapes.append(tuple(rows.shape))
        log.append(("preload", ch.count))

    landed: list[tuple[int, int]] = []
    wire.recv(0, chunks, lambda ch: widths[ch.segment or 0], direct=lambda ch: None,
              land=lambda ch, rows: landed.append(tuple(rows.shape)), preload=preload)  # fmt: skip
    kinds = [k for k, _n in log]
    assert kinds.count("preload") == len(chunks) and kinds.count("post") == len(chunks)
    assert kinds.index("post") > max(i for i, k in enumerate(kinds) if k == "preload")
    assert shapes == landed  # the rows each landing gets, preloaded with the same shape


def test_drain_polls_back_off_to_the_given_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain sleeps 20 us, then twice as long each poll, never more than ``poll_s``: a long
    one (a layer-wise transfer's, ~11 ms) polls ~a dozen times instead of ~500."""
    polls = {"left": 9}

    class Event:  # completes on its tenth query
        def record(self, stream: Any) -> None:
            pass

        def query(self) -> bool:
            polls["left"] -= 1
            return polls["left"] < 0

    sleeps: list[float] = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(p2p_wire_time, "sleep", sleeps.append)
    wire = Wire.__new__(Wire)
    wire.stream, wire.timeout_s = object(), TIMEOUT
    wire.drain(time.monotonic() + 60, poll_s=3e-4)
    want = [2e-5, 4e-5, 8e-5, 1.6e-4, 3e-4, 3e-4, 3e-4, 3e-4, 3e-4]
    assert sleeps == pytest.approx(want)
    polls["left"], sleeps[:] = 3, []
    wire.drain(time.monotonic() + 60)  # the default: 20 us throughout
    assert sleeps == pytest.approx([2e-5] * 3)
    polls["left"] = 10**9
    with pytest.raises(TimeoutError, match="exceeded timeout_s"):
        wire.drain(time.monotonic() - 1)
