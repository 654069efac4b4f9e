"""The engine's Python API (issues 27-28): requests leave the engine after ``stream`` (also when
the consumer stops early), ``abort_request``, and checked inputs -- token ids (a hypothesis
property), engine options. SamplingParams' checks are in test_sampling_params.py, the text API in
test_engine_text.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvstack.engine.engine import LLMEngine
from kvstack.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41], [99] * 20]
PARAMS = SamplingParams(max_new_tokens=4)


def engine_of(model_dir: Path, **kw: Any) -> LLMEngine:
    args: dict[str, Any] = dict(
        block_size=4, num_blocks=80, max_model_len=64, max_num_batched_tokens=32
    )
    args.update(kw)
    return LLMEngine(model_dir, **args)


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> LLMEngine:
    """One engine for tests that only add requests (they leave it empty)."""
    return engine_of(llama_dir)


def assert_empty(engine: LLMEngine) -> None:
    """No request left anywhere, every block back in the pool (block 0 is the null block)."""
    assert engine._seqs == {} and engine._rows.row_of == {}
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert not engine.scheduler.held
    assert engine.kv.num_free_blocks == engine.runner.kv_cache_config.num_blocks - 1


# -- stream leaves nothing behind (issue 27) ----------------------------------------------------


def test_stream_then_generate_then_stream_on_one_engine(llama_dir: Path) -> None:
    engine = engine_of(llama_dir)
    first = [(e.request_id, e.token_id) for e in engine.stream(PROMPTS, PARAMS)]
    assert_empty(engine)
    done = engine.generate(PROMPTS, PARAMS)  # raised "request id '0' is already in the engine"
    assert_empty(engine)
    again = [(e.request_id, e.token_id) for e in engine.stream(PROMPTS, PARAMS)]
    assert first == again
    for c in done:
        assert [t for r, t in first if r == c.request_id] == list(c.token_ids)


def test_a_stream_closed_early_frees_its_requests(llama_dir: Path) -> None:
    engine = engine_of(llama_dir)
    events = engine.stream(PROMPTS, SamplingParams(max_new_tokens=20))
    next(events)
    assert engine.scheduler.running  # mid-generation: blocks held
    events.close()
    assert_empty(engine)
    for _ in engine.stream(PROMPTS, PARAMS):  # a consumer that breaks out of its loop
        break
    assert_empty(engine)
    assert [c.request_id for c in engine.generate(PROMPTS, PARAMS)] == ["0", "1", "2"]


def test_a_failed_generate_leaves_no_request(llama_dir: Path) -> None:
    engine = engine_of(llama_dir)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 2], [1, 500]], PARAMS)  # the second prompt fails after the first
    assert_empty(engine)
    assert len(engine.generate([[1, 2], [3, 4]], PARAMS)) == 2


def test_stream_yields_only_its_own_requests(llama_dir: Path) -> None:
    engine = engine_of(llama_dir)
    engine.add_request("mine", [1, 2, 3], SamplingParams(max_new_tokens=30))
    ids = {e.request_id for e in engine.stream([[4, 5, 6]], PARAMS)}
    assert ids == {"0"}
    while engine.has_unfinished:
        engine.step()
    assert len(engine.completion("mine").token_ids) == 30
    assert_empty(engine)


# -- abort_request (issue 28) -------------------------------------------------------------------


def test_abort_a_running_request_frees_its_blocks_and_spares_the_others(llama_dir: Path) -> None:
    engine = engine_of(llama_dir)
    want = engine_of(llama_dir).generate([PROMPTS[1]], SamplingParams(max_new_tokens=8))[0]
    engine.add_request("a", PROMPTS[0], SamplingParams(max_new_tokens=30))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_new_tokens=8))
    engine.step()
    engine.step()
    free_before = engine.kv.num_free_blocks
    assert engine.abort_request("a") == ["a"]
    assert engine.kv.num_free_blocks > free_before
    assert [s.request_id for s in engine.scheduler.running] == ["b"]
    while engine.has_unfinished:
        engine.step()
    assert engine.completion("b").token_ids == want.token_ids
    with pytest.raises(ValueError, match="not a finished request"):
        engine.completion("a")
    assert_empty(engine)


def test_abort_waiting_held_and_finished_requests(llama_dir: Path) -> None:
    engine = engine_of(llama_dir)
    calls: list[tuple[str, int]] = []  # (request id, free blocks when the listener ran)
    engine.abort_listener = lambda rid: calls.append((rid, engine.kv.num_free_blocks))
    engine.add_request("held", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=1), hold_blocks=True)
    engine.add_request("done", [6, 7], SamplingParams(max_new_tokens=1))
    while engine.has_unfinished:
        engine.step()
    engine.add_request("waiting", [8, 9], PARAMS)
    held_free = engine.kv.num_free_blocks
    assert engine.abort_request(["held", "done", "waiting", "nobody"]) == [
        "held",
        "done",
        "waiting",
    ]
    # The listener ran for the held request before its blocks were freed, and for the waiting
    # one; not for the finished request that holds nothing.
    assert calls == [("held", held_free), ("waiting", engine.kv.num_free_blocks)]
    assert_empty(engine)


def test_aborting_a_streamed_request_mid_stream_ends_only_it(llama_dir: Path) -> None:
    engine = engine_of(llama_dir)
    seen: dict[str, int] = {}
    for ev in engine.stream(PROMPTS[:2], SamplingParams(max_new_tokens=10)):
        seen[ev.request_id] = seen.get(ev.request_id, 0) + 1
        if ev.request_id == "0" and ev.index == 2:
            assert engine.abort_request("0") == ["0"]
    assert seen == {"0": 3, "1": 10}
    assert_empty(engine)


def test_abort_of_an_unknown_id_is_a_no_op_and_a_non_str_id_an_error(engine: LLMEngine) -> None:
    assert engine.abort_request("never-added") == []
    with pytest.raises(TypeError, match=r"request id 3 is a int, not str"):
        engine.abort_request([3])  # type: ignore[list-item]
    assert_empty(engine)


# -- input checks (issue 28) --------------------------------------------------------------------


def test_token_ids_are_never_rounded_or_parsed(engine: LLMEngine) -> None:
    with pytest.raises(TypeError, match=r"prompt token 1 is 1.7 \(float\)"):
        engine.add_request("a", [1, 1.7])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"text prompt '12' needs a tokenizer: .* holds no"):
        engine.add_request("a", "12")  # no tokenizer: not parsed into [1, 2]
    with pytest.raises(TypeError, match=r"prompt token 0 is True \(bool\)"):
        engine.add_request("a", [True, 2])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"the prompt is a bytes"):
        engine.add_request("a", b"\x01\x02")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"prompt is a int .*\[\[1, 2, 3\]\] for one"):
        engine.generate([1, 2, 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"request_id=7 is a int"):
        engine.add_request(7, [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stop_token_ids \[128\] are outside .*\[0, 128\)"):
        engine.add_request("a", [1], SamplingParams(stop_token_ids=[128]))
    with pytest.raises(TypeError, match=r"hold_blocks=1 is a int"):
        engine.add_request("a", [1], hold_blocks=1)  # type: ignore[arg-type]
    np = pytest.importorskip("numpy")
    engine.add_request("np64", [np.int64(5), np.int32(6)])  # numpy ints are ints
    assert engine._seqs["np64"].token_ids == [5, 6]
    assert all(type(t) is int for t in engine._seqs["np64"].token_ids)
    engine.abort_request("np64")
    assert_empty(engine)


def test_a_misspelt_engine_option_names_the_closest(llama_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown option 'kv_cache_mem' \(did you mean "
                       r"'kv_cache_memory'\?\); valid options: .*max_num_seqs"):  # fmt: skip
        LLMEngine(llama_dir, kv_cache_mem=2**20)
    with pytest.raises(TypeError, match=r"unknown option 'enable_prefix_cache' \(did you mean "
                       r"'enable_prefix_caching'\?\)"):  # fmt: skip
        LLMEngine(llama_dir, enable_prefix_cache=False)
    with pytest.raises(TypeError, match=r"keep_logits=1 is a int; give True or False"):
        LLMEngine(llama_dir, keep_logits=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"max_num_seqs=2.0 is a float"):
        LLMEngine(llama_dir, max_num_seqs=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("num_blocks", 10.5, r"ModelRunner: num_blocks=10.5 is a float; give an int \(or None\)"),
        ("block_size", True, r"ModelRunner: block_size=True is a bool; give an int"),
        ("kv_cache_memory", 1.5e6, r"kv_cache_memory=1500000.0 is a float"),
        ("max_num_batched_tokens", "64", r"max_num_batched_tokens='64' is a str"),
        ("device", 3.0, r"device=3.0 is a float; give a str \('cpu'"),
        ("dtype", "float32", r"dtype='float32' is a str; give a torch.dtype"),
    ],
)
def test_runner_options_are_typed(llama_dir: Path, option: str, value: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        LLMEngine(llama_dir, **{option: value})


# -- add_request: hypothesis property -----------------------------------------------------------

TOKEN = st.one_of(
    st.integers(min_value=-5, max_value=140),
    st.booleans(),
    st.floats(min_value=-2, max_value=140),
    st.text(alphabet="0123456789", min_size=1, max_size=2),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(prompt=st.lists(TOKEN, min_size=1, max_size=6))
def test_add_request_stores_exactly_valid_ids_or_refuses(
    engine: LLMEngine, prompt: list[Any]
) -> None:
    vocab = engine.runner.arch.vocab_size
    valid = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)
    try:
        rid = engine.add_request("p", prompt, PARAMS)
    except (TypeError, ValueError) as e:
        assert not valid and "request 'p'" in str(e)
        assert "p" not in engine._seqs
        return
    try:
        assert valid
        assert engine._seqs[rid].token_ids == prompt
    finally:
        engine.abort_request(rid)


def test_completion_metrics_time_each_stage(llama_dir: Path) -> None:
    """``Completion.metrics``: added <= first scheduled <= first token <= finished. With one
    batch slot the second request waits for the first to finish: its time in the queue covers
    the first's whole run (a first-scheduled time taken at arrival would not)."""
    engine = engine_of(llama_dir, max_num_seqs=1)
    engine.add_request("a", PROMPTS[0], PARAMS)
    engine.add_request("b", PROMPTS[1], PARAMS)
    while engine.has_unfinished:
        engine.step()
    a, b = engine.completion("a").metrics, engine.completion("b").metrics
    for m in (a, b):
        assert m is not None and m.first_scheduled_time is not None
        assert m.first_token_time is not None and m.finished_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.time_to_first_token == m.first_token_time - m.arrival_time
    assert a is not None and b is not None and a.finished_time is not None
    assert b.first_scheduled_time is not None and b.first_scheduled_time >= a.finished_time
    assert b.time_in_queue is not None and a.time_in_queue is not None
    assert b.time_in_queue > a.time_in_queue
