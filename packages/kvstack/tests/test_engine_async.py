"""The engine one step ahead (``async_scheduling=True``, :mod:`kvstack.engine._async`) against
the same engine in lockstep, on the CPU (the code path is the device's: tokens picked by an
argmax tensor, pending input rows filled from it by ``index_copy_``). Every request's tokens
must be the same, whatever the schedule: chunked prefills beside decodes, requests arriving
mid-run, stop tokens (a step too many runs and its token is dropped), budgets, aborts, a pool
too small to run without preempting, and requests that need their tokens on the host (sampling,
stop strings) joining a batch that runs ahead. A planted bug -- the pending rows filled from the
wrong row of the previous step's tokens -- must change tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kvstack.engine import _async
from kvstack.engine.engine import LLMEngine
from kvstack.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    list(range(5, 30)),
    [7, 8, 9],
    list(range(40, 100)),
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    [3] * 17,
]


def _engine(model_dir: Path, ahead: Any, **kw: Any) -> LLMEngine:
    args: dict[str, Any] = dict(
        block_size=4, num_blocks=120, max_model_len=160, max_num_batched_tokens=32,
        async_scheduling=ahead,
    )  # fmt: skip
    args.update(kw)
    return LLMEngine(model_dir, **args)


def _drive(
    engine: LLMEngine, plan: list[tuple[int, str, list[int], SamplingParams]]
) -> dict[str, list[int]]:
    """Add each request at its step, step until done; every request's tokens, from the events
    (which must come in order, one index at a time) and from its completion."""
    seen: dict[str, list[int]] = {}
    step = 0
    todo = sorted(plan, key=lambda x: x[0])
    while todo or engine.has_unfinished:
        while todo and todo[0][0] <= step:
            _, rid, prompt, params = todo.pop(0)
            engine.add_request(rid, prompt, params)
        for ev in engine.step():
            toks = seen.setdefault(ev.request_id, [])
            assert ev.index == len(toks), (ev, toks)
            toks.append(ev.token_id)
        step += 1
        assert step < 2000
    out = {}
    for _, rid, _, _ in plan:
        c = engine.completion(rid)
        assert list(c.token_ids) == seen[rid], rid
        out[rid] = list(c.token_ids)
    return out


def _plan(
    params: list[SamplingParams], arrive: list[int]
) -> list[tuple[int, str, list[int], SamplingParams]]:
    return [
        (a, str(i), p, sp) for i, (p, sp, a) in enumerate(zip(PROMPTS, params, arrive, strict=True))
    ]


def test_ahead_equals_lockstep_with_arrivals_chunks_and_budgets(llama_dir: Path) -> None:
    params = [SamplingParams(max_new_tokens=n) for n in (12, 3, 20, 1, 9)]
    plan = _plan(params, [0, 0, 2, 5, 6])
    ahead = _engine(llama_dir, True)
    got = _drive(ahead, plan)
    assert got == _drive(_engine(llama_dir, False), plan)
    assert [len(got[str(i)]) for i in range(5)] == [12, 3, 20, 1, 9]
    assert ahead._ahead > 20 and ahead._dropped == 0  # budgets are known ahead: nothing wasted
    assert ahead._inflight is None and all(s.num_pending == 0 for s in ahead._seqs.values())


def test_stop_tokens_drop_the_extra_step(llama_dir: Path) -> None:
    """Stop ids each request hits early: the step after the stop runs (ahead) and its token is
    dropped; tokens equal lockstep's and end at the stop."""
    lock = _drive(
        _engine(llama_dir, False), _plan([SamplingParams(max_new_tokens=12)] * 5, [0] * 5)
    )
    stops = [SamplingParams(max_new_tokens=12, stop_token_ids=(lock[str(i)][2],)) for i in range(5)]
    plan = _plan(stops, [0, 1, 1, 3, 4])
    ahead = _engine(llama_dir, True)
    got = _drive(ahead, plan)
    assert got == _drive(_engine(llama_dir, False), plan)
    for i in range(5):
        assert got[str(i)][-1] == lock[str(i)][2] and len(got[str(i)]) <= 3
    assert ahead._dropped > 0  # steps ran past a stop, their tokens dropped
    assert ahead.scheduler.kv.usage == 0  # every block back in the pool


def test_a_tight_pool_falls_back_to_lockstep_and_preempts(llama_dir: Path) -> None:
    params = [SamplingParams(max_new_tokens=30)] * 5
    plan = _plan(params, [0] * 5)
    ahead = _engine(llama_dir, True, num_blocks=45, max_model_len=120)
    got = _drive(ahead, plan)
    assert ahead.scheduler.stats.num_preemptions > 0 and ahead._ahead > 0
    assert got == _drive(_engine(llama_dir, False, num_blocks=45, max_model_len=120), plan)


def test_requests_that_need_the_host_join_a_batch_running_ahead(llama_dir: Path) -> None:
    params = [
        SamplingParams(max_new_tokens=10),
        SamplingParams(max_new_tokens=8, temperature=0.8, seed=3),  # sampled on the host
        SamplingParams(max_new_tokens=10),
        SamplingParams(max_new_tokens=6, temperature=1.0, top_k=5, seed=9),
        SamplingParams(max_new_tokens=10),
    ]
    plan = _plan(params, [0, 3, 0, 7, 1])
    assert _drive(_engine(llama_dir, True), plan) == _drive(_engine(llama_dir, False), plan)


def test_abort_while_a_step_is_in_flight(llama_dir: Path) -> None:
    engine = _engine(llama_dir, True)
    p = SamplingParams(max_new_tokens=20)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, p)
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None  # a step is in flight
    assert engine.abort_request("1") == ["1"]
    events = []
    while engine.has_unfinished:
        events += engine.step()
    assert all(ev.request_id != "1" for ev in events)
    assert len(engine.completion("0").token_ids) == 20
    assert engine.scheduler.kv.usage == 0


def test_planted_bug_wrong_pending_row_changes_tokens(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan([SamplingParams(max_new_tokens=10)] * 5, [0] * 5)
    want = _drive(_engine(llama_dir, False), plan)
    real = torch.Tensor.index_select

    def shifted(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.int64 and self.dim() == 1 and index.numel() > 1:  # the pending rows
            index = index.roll(1)
        return real(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", shifted)
    assert _drive(_engine(llama_dir, True), plan) != want


def test_async_scheduling_is_checked_and_defaults_to_the_device(llama_dir: Path) -> None:
    assert _engine(llama_dir, None).async_scheduling is False  # the CPU: lockstep by default
    for bad in ("yes", 1, 0.5):
        with pytest.raises(TypeError, match="async_scheduling"):
            _engine(llama_dir, bad)


def test_graphs_mode_runs_ahead_only_after_replayed_steps(llama_dir: Path) -> None:
    """``"graphs"``: a step goes in flight only when it replayed a CUDA graph -- here the
    runner's graph stand-in that replays by calling the captured step again (capture=False):
    decode steps run ahead, prefill and mixed steps in lockstep; tokens as lockstep's."""
    from kvstack.engine.graphs import DecodeGraphs

    plan = _plan([SamplingParams(max_new_tokens=n) for n in (12, 3, 20, 1, 9)], [0, 0, 2, 5, 6])
    engine = _engine(llama_dir, "graphs")
    engine.runner.graphs = DecodeGraphs(engine.runner, 8, capture=False)
    try:
        got = _drive(engine, plan)
        replays = engine.runner.graphs.num_replays
    finally:
        engine.runner.graphs = None
    assert got == _drive(_engine(llama_dir, False), plan)
    assert replays > 0 and 0 < engine._ahead <= replays  # ahead only after a replayed step
    assert _async.TokenReader(torch.device("cpu"), 4).launch(torch.eye(3))[0].tolist() == [0, 1, 2]


def test_ahead_with_a_quiet_kv_connector_equals_lockstep(llama_dir: Path) -> None:
    """With a KV connector the engine goes one step ahead only while the connector is quiet and
    no request waits (then nothing needs a step's end before the next is scheduled): a CPU tier
    that saves finished requests and serves a later request's prefix from them keeps every token
    of the lockstep run without a connector, and steps did go ahead in between."""
    from kv_connectors import OffloadingConfig, OffloadingConnector

    params = [SamplingParams(max_new_tokens=n) for n in (12, 3, 20, 1, 9)]
    # request 4 arrives late with request 0's prompt: a prefix the tier saved at its finish
    arrive = [0, 0, 2, 5, 30]
    prompts = [*PROMPTS[:4], PROMPTS[0]]
    plan = [
        (a, str(i), p, sp) for i, (a, p, sp) in enumerate(zip(arrive, prompts, params, strict=True))
    ]
    want = _drive(_engine(llama_dir, False), plan)
    tier = OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=4)
    engine = _engine(llama_dir, True, kv_connector=tier, enable_prefix_caching=False)
    assert _drive(engine, plan) == want
    stats = engine.stats().kv_connector
    assert stats is not None and stats.loaded_tokens > 0, "the late request missed the tier"
    assert engine._ahead > 0, "no step went ahead beside the connector"


def test_a_busy_connector_keeps_the_engine_in_lockstep(llama_dir: Path) -> None:
    """The check above can fail: a driver that never reports quiet leaves no step ahead."""
    from kv_connectors import OffloadingConfig, OffloadingConnector
    from kvstack.engine.connector_driver import KVConnectorDriver

    tier = OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=4)
    engine = _engine(llama_dir, True, kv_connector=tier)
    assert isinstance(engine.connector, KVConnectorDriver)
    engine.connector.quiet = lambda: False  # type: ignore[method-assign]
    _drive(engine, [(0, str(i), PROMPTS[i], SamplingParams(max_new_tokens=6)) for i in (0, 1)])
    assert engine._ahead == 0
