"""The engine driving a KV connector through the contract (issue 30): a CPU tier and a disk tier
behind the prefix cache, a producer -> consumer split with asynchronous loads (P2P over gloo, both
engines in this process), load failures recomputed, save errors counted, aborts that keep blocks
under a transfer. Every test holds the tokens to an engine that computes everything itself."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_connectors import (
    FilesystemConfig,
    FilesystemConnector,
    MultiConnector,
    OffloadingConfig,
    OffloadingConnector,
    P2pConfig,
    P2pConnector,
)
from kvstack.engine.connector_driver import model_fingerprint
from kvstack.engine.engine import LLMEngine
from kvstack.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 4
#: A 20-block pool (19 usable): one 40-token request fills half of it.
SMALL = dict(block_size=BS, num_blocks=20, max_model_len=64, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
HISTORY = [(7 * i + 3) % 120 + 1 for i in range(24)]  # 6 blocks of a conversation so far
FLOOD = [[(11 * i + k) % 120 + 1 for i in range(36)] for k in (5, 9)]  # other conversations


def _engine(model_dir: Path, connector: Any = None) -> LLMEngine:
    return LLMEngine(model_dir, kv_connector=connector, **SMALL)  # type: ignore[arg-type]


def _junk(engine: LLMEngine, seed: int) -> None:
    """Fill the engine's whole pool with finite junk (what a pool holds after other requests;
    raw random bytes would hold NaNs, which the reference backend's masked slots do not hide)."""
    gen = torch.Generator().manual_seed(seed)
    storage = engine.runner.kv_caches[0]
    for t in [storage] if isinstance(storage, torch.Tensor) else storage:
        t.copy_(torch.randn(t.shape, generator=gen) * 3)


def _row_bytes(engine: LLMEngine) -> int:
    cfg = engine.runner.kv_cache_config
    return cfg.page_size_bytes * cfg.num_layer_slots


def _recomputed(model_dir: Path, prompt: list[int], params: SamplingParams = GREEDY) -> tuple:
    return _engine(model_dir).generate([prompt], params)[0].token_ids


def _evict_history(engine: LLMEngine) -> None:
    """Run other conversations until the pool has evicted the history's blocks."""
    for prompt in FLOOD:
        engine.generate([prompt], GREEDY)
    assert engine.kv.get_computed_blocks(_request([*HISTORY, 1]))[1] == 0  # gone from the pool


def _hashes(engine: LLMEngine, tokens: list[int]) -> list[bytes]:
    req = _request(tokens)
    req.bind_hasher(engine.kv.hasher)
    return req.block_hashes


def _request(tokens: list[int]) -> Any:
    from kv_blocktable import Request

    return Request("probe", tokens)


@pytest.mark.parametrize("tiers", ["cpu", "cpu+disk"])
def test_cpu_tier_serves_a_prefix_the_pool_evicted(
    llama_dir: Path, tmp_path: Path, tiers: str
) -> None:
    tier = OffloadingConnector(OffloadingConfig(cpu_bytes=64 * 2048), block_size=BS)
    connector: Any = tier
    if tiers == "cpu+disk":  # saved to both, loaded from the CPU tier (the first child)
        connector = MultiConnector([tier, _disk(tmp_path, llama_dir)])
    engine = _engine(llama_dir, connector)
    assert engine.connector is not None
    engine.connector.before_replay()  # (what a CUDA-graph step calls: no load pending, no-op)
    assert _row_bytes(engine) == 2048  # the tier above holds 64 blocks
    first = engine.generate([HISTORY], GREEDY)[0]
    _evict_history(engine)
    turn2 = [*HISTORY, *first.token_ids, 17, 18, 19]  # the next turn: history + reply + more
    before = engine.stats()
    t0 = time.perf_counter()
    got = engine.generate([turn2], GREEDY)[0]
    wall = time.perf_counter() - t0
    after = engine.stats()
    assert got.token_ids == _recomputed(llama_dir, turn2)
    assert got.num_cached_prompt_tokens == 0  # nothing from the pool: it came from the tier
    assert after.kv_connector is not None and before.kv_connector is not None
    loaded = after.kv_connector.loaded_tokens - before.kv_connector.loaded_tokens
    assert loaded == 24  # the history's 6 blocks (the reply's tokens were never a full block)
    assert after.scheduler.external_hit_tokens == 24  # (the only tier hit of the run)
    assert tier.stats.hit_blocks == 6 and after.kv_connector.num_load_failures == 0
    # the worker side's host time is counted per direction, inside the call's wall time
    a, b = after.kv_connector, before.kv_connector
    assert 0 < a.load_host_s - b.load_host_s < wall and 0 < a.save_host_s - b.save_host_s < wall
    if tiers == "cpu+disk":
        assert isinstance(connector, MultiConnector)
        disk = connector.connectors[1]
        assert isinstance(disk, FilesystemConnector)
        disk.flush()
        assert disk.path_of(_hashes(engine, HISTORY)[5]).is_file()  # the history is on disk too
    connector.close()


def test_connector_tokens_equal_recomputing_under_preemption(llama_dir: Path) -> None:
    """Three conversations at once in a pool that holds two: preemptions and resumes while the
    tier loads and saves; every request's tokens equal recomputing."""
    tier = OffloadingConnector(OffloadingConfig(cpu_bytes=64 * 2048), block_size=BS)
    engine = _engine(llama_dir, tier)
    prompts = [HISTORY, *FLOOD]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = [_recomputed(llama_dir, p, params) for p in prompts]
    for _ in range(2):  # the second round hits the tier
        assert [c.token_ids for c in engine.generate(prompts, params)] == want
    stats = engine.stats()
    assert stats.scheduler.num_preemptions > 0 and stats.kv_connector is not None
    assert stats.kv_connector.loaded_tokens > 0


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "one-step-ahead"])
def test_cpu_tier_saves_a_running_requests_blocks(llama_dir: Path, ahead: bool) -> None:
    """The engine tells the tier of each block a request completes (``blocks_computed``): the
    prompt's blocks are stored while the request still decodes, the reply's as they fill, and
    at the finish only the last is left to copy. The stored blocks serve the next turn, whose
    tokens equal recomputing it. One step ahead, the steps that save are left in flight too
    (their saves handed off as they are left) and the counts trail by that step."""
    tier = OffloadingConnector(OffloadingConfig(cpu_bytes=64 * 2048), block_size=BS)
    engine = LLMEngine(llama_dir, kv_connector=tier, async_scheduling=ahead, **SMALL)  # type: ignore[arg-type]
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    rid = engine.add_request(None, HISTORY, params)
    tokens: list[int] = []
    stored: list[int] = []
    while engine.has_unfinished:
        tokens += [e.token_id for e in engine.step() if e.request_id == rid]
        stored.append(tier.stats.stored_blocks)
    # 24 prompt tokens: 6 blocks after the prefill; the reply's 8 fed tokens fill 2 more
    assert stored[0] == 0 and stored[1] == 6  # the prompt's, in the first decode step
    assert stored[-2] == 7 and tier.stats.stored_blocks == 8
    assert (engine._ahead > 0) == ahead  # (the saving steps themselves went ahead)
    _evict_history(engine)
    turn2 = [*HISTORY, *tokens, 17, 18, 19]
    got = engine.generate([turn2], GREEDY)[0]
    assert got.token_ids == _recomputed(llama_dir, turn2)
    assert got.num_cached_prompt_tokens == 0 and tier.stats.hit_blocks == 8
    tier.close()


def _disk(root: Path, model_dir: Path) -> FilesystemConnector:
    cfg = FilesystemConfig(root=root, model_fingerprint=model_fingerprint(model_dir), fsync=False)
    return FilesystemConnector(cfg, block_size=BS)


def test_disk_tier_survives_a_restart_and_a_corrupt_block_is_recomputed(
    llama_dir: Path, tmp_path: Path
) -> None:
    disk = _disk(tmp_path, llama_dir)
    engine = _engine(llama_dir, disk)
    engine.generate([HISTORY], GREEDY)
    while engine.scheduler.has_pending_kv:  # the saves run in the next step
        engine.step()
    disk.flush()
    disk.close()
    # a restarted engine: a fresh pool full of junk, the same files
    disk2 = _disk(tmp_path, llama_dir)
    engine2 = _engine(llama_dir, disk2)
    _junk(engine2, seed=3)
    req = _request(HISTORY)
    req.bind_hasher(engine2.kv.hasher)
    third = disk2.path_of(req.block_hashes[2])
    third.write_bytes(third.read_bytes()[:-1] + b"\x00")  # one byte of block 2 damaged
    prompt = [*HISTORY, 5, 6]
    got = engine2.generate([prompt], GREEDY)[0]
    assert got.token_ids == _recomputed(llama_dir, prompt)  # planted bug: use junk -> differs
    stats = engine2.stats().kv_connector
    assert stats is not None
    assert (stats.loaded_blocks, stats.num_load_failures, stats.failed_blocks) == (2, 1, 4)
    assert "checksum" in stats.reasons["0"] or "corrupt" in stats.reasons["0"]
    disk2.close()


def test_save_errors_are_counted(llama_dir: Path, tmp_path: Path, monkeypatch: Any) -> None:
    import kv_connectors.filesystem as fs

    def refuse(*_a: Any, **_k: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs, "write_block_file", refuse)
    disk = _disk(tmp_path, llama_dir)
    engine = _engine(llama_dir, disk)
    engine.generate([HISTORY], GREEDY)
    engine.step()  # the save is handed off (and its blocks freed) ...
    disk.flush()
    engine.step()  # ... and its failure collected
    stats = engine.stats().kv_connector
    assert stats is not None and stats.num_save_errors == 1
    assert "No space left" in stats.reasons["0"]
    disk.close()


def _p2p(role: str, fingerprint: str, transport: str = "p2p") -> Any:
    if transport == "nixl":  # NIXL agents over UCX, in DRAM (both engines in this process)
        pytest.importorskip("nixl")
        from kv_connectors import NixlConfig
        from kv_connectors.nixl import NixlConnector

        nixl = NixlConfig(
            role=role, timeout_s=20.0, model_fingerprint=fingerprint, progress_thread=False
        )
        return NixlConnector(nixl, block_size=BS)
    cfg = P2pConfig(role=role, timeout_s=20.0, model_fingerprint=fingerprint, buffer_bytes=1 << 16)
    return P2pConnector(cfg, block_size=BS)


def _prefill(model_dir: Path, prompt: list[int], producer: P2pConnector) -> tuple[LLMEngine, Any]:
    engine = _engine(model_dir, producer)
    done = engine.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))[0]
    assert done.kv_transfer_params is not None  # what a decode engine loads from
    assert engine.scheduler.sending  # its blocks are kept for the consumer
    return engine, done


def _drain(*engines: LLMEngine, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while any(e.scheduler.has_pending_kv for e in engines) and time.monotonic() < deadline:
        for e in engines:
            e.step()
        time.sleep(1e-3)
    assert not any(e.scheduler.has_pending_kv for e in engines)


@pytest.mark.parametrize("transport", ["p2p", "nixl"])
def test_prefill_engine_hands_a_request_to_a_decode_engine(llama_dir: Path, transport: str) -> None:
    fp = model_fingerprint(llama_dir)
    prompt = [*HISTORY, 9, 8, 7]  # 27 tokens: 6 full blocks move, the rest is computed
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = _recomputed(llama_dir, prompt, params)
    prod, cons = _p2p("producer", fp, transport), _p2p("consumer", fp, transport)
    try:
        prefill, first = _prefill(llama_dir, prompt, prod)
        again = prefill.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
        assert again[0].request_id.startswith("0-")  # "0" is still held for its consumer
        prefill.abort_request(again[0].request_id)  # (no consumer will come for this one)
        decode = _engine(llama_dir, cons)
        _junk(decode, seed=4)
        rid = decode.add_request(
            "r",
            [*prompt, *first.token_ids],
            SamplingParams(max_new_tokens=5, ignore_eos=True),
            kv_transfer_params=first.kv_transfer_params,
        )
        decode.step()
        assert rid in decode.scheduler.loading  # out of the batch while its KV arrives
        while decode.has_unfinished:
            decode.step()
            prefill.step()  # the producer collects the consumer's "done" and frees its blocks
        got = decode.completion(rid)
        assert (*first.token_ids, *got.token_ids) == want
        stats = decode.stats()
        assert stats.kv_connector is not None and stats.kv_connector.loaded_tokens == 24
        assert stats.scheduler.num_async_loads == 1 and got.num_cached_prompt_tokens == 0
        _drain(prefill, decode)
        assert prefill.kv.num_free_blocks == SMALL["num_blocks"] - 1  # every block back
    finally:
        prod.close()
        cons.close()


def test_a_failed_remote_load_is_recomputed(llama_dir: Path) -> None:
    fp = model_fingerprint(llama_dir)
    prompt = [*HISTORY, 9, 8, 7]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = _recomputed(llama_dir, prompt, params)
    prod, cons = _p2p("producer", fp), _p2p("consumer", fp)
    try:
        prefill, first = _prefill(llama_dir, prompt, prod)
        prefill.abort_request(first.request_id)  # gone before it was pulled: the pull is refused
        decode = _engine(llama_dir, cons)
        _junk(decode, seed=4)
        decode.add_request(
            "r",
            [*prompt, *first.token_ids],
            SamplingParams(max_new_tokens=5, ignore_eos=True),
            kv_transfer_params=first.kv_transfer_params,
        )
        while decode.has_unfinished:
            decode.step()
        assert (*first.token_ids, *decode.completion("r").token_ids) == want
        stats = decode.stats().kv_connector
        assert stats is not None and stats.num_load_failures == 1 and stats.loaded_tokens == 0
        assert "not held" in stats.reasons["r"]
    finally:
        prod.close()
        cons.close()


def test_abort_of_a_loading_request_keeps_its_blocks_until_the_pull_ends(
    llama_dir: Path,
) -> None:
    fp = model_fingerprint(llama_dir)
    prompt = [*HISTORY, 9, 8, 7]
    prod, cons = _p2p("producer", fp), _p2p("consumer", fp)
    release, started = threading.Event(), threading.Event()
    real = cons._pull_in

    def held_pull(*args: Any) -> None:
        started.set()
        assert release.wait(30)
        real(*args)

    cons._pull_in = held_pull
    try:
        prefill, first = _prefill(llama_dir, prompt, prod)
        decode = _engine(llama_dir, cons)
        free = decode.kv.num_free_blocks
        decode.add_request(
            "r", [*prompt, *first.token_ids], GREEDY, kv_transfer_params=first.kv_transfer_params
        )
        decode.step()
        assert started.wait(30)  # the pull is under way, writing into the request's blocks
        assert decode.abort_request("r") == ["r"]
        decode.step()
        assert decode.kv.num_free_blocks < free  # planted bug (freed under the pull) fails here
        release.set()
        _drain(decode, prefill)
        assert decode.kv.num_free_blocks == free and not decode.has_unfinished
        stats = decode.stats().kv_connector
        # an aborted request's load is neither a failure nor loaded KV of a request
        assert stats is not None and stats.num_load_failures == 0 and stats.loaded_tokens == 0
    finally:
        release.set()
        prod.close()
        cons.close()


def test_connector_refusals_name_the_fix(llama_dir: Path, tmp_path: Path) -> None:
    import json

    from kvstack.demo import DEMO_CONFIG, write_random_checkpoint

    with pytest.raises(TypeError, match="kv_connectors.KVConnector"):
        _engine(llama_dir, object())
    wrong = OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=8)
    with pytest.raises(ValueError, match="block_size=4"):
        _engine(llama_dir, wrong)
    hybrid = write_random_checkpoint(tmp_path / "qwen3", DEMO_CONFIG)
    tier = OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=16)
    with pytest.raises(ValueError, match="one KV-cache group"):
        LLMEngine(hybrid, kv_connector=tier, block_size=16, num_blocks=40, max_model_len=64)
    mistral = write_random_checkpoint(
        tmp_path / "mistral",
        {
            **json.loads((llama_dir / "config.json").read_text()),
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "sliding_window": 16,
        },
    )
    with pytest.raises(ValueError, match="SlidingWindowSpec"):  # one group, but it drops blocks
        _engine(mistral, OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=BS))
    with pytest.raises(ValueError, match="no kv_connector"):
        _engine(llama_dir).add_request("x", [1, 2], kv_transfer_params={"a": 1})


def test_model_fingerprint_names_config_and_weight_shapes(llama_dir: Path, tmp_path: Path) -> None:
    import json

    from kvstack.demo import write_random_checkpoint

    config = json.loads((llama_dir / "config.json").read_text())

    fp = model_fingerprint(llama_dir)
    assert fp.startswith("sha256:") and fp == model_fingerprint(llama_dir)
    other_seed = write_random_checkpoint(tmp_path / "a", config, seed=5)
    assert model_fingerprint(other_seed) == fp  # same config and shapes: same name
    wider = write_random_checkpoint(tmp_path / "b", {**config, "intermediate_size": 128})
    assert model_fingerprint(wider) != fp
    with pytest.raises(ValueError, match="no config.json"):
        model_fingerprint(tmp_path)


def test_a_load_the_connector_cannot_plan_is_recomputed(llama_dir: Path) -> None:
    """The producer's blocks hold 8 tokens, the consumer's 4 (one producer block fills two). The
    decode engine is given the bare prompt, so it leaves the last token to compute and takes 7
    of the 8 blocks offered: half a producer block, which the connector refuses at allocation.
    The request recomputes them (planted bug: the refusal escaped step() and the engine stuck)."""
    fp = model_fingerprint(llama_dir)
    prompt = [(5 * i + 1) % 120 + 1 for i in range(32)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = _recomputed(llama_dir, prompt, params)
    prod = P2pConnector(
        P2pConfig(role="producer", timeout_s=20.0, model_fingerprint=fp), block_size=8
    )
    cons = _p2p("consumer", fp)
    try:
        prefill = LLMEngine(
            llama_dir, kv_connector=prod, block_size=8, num_blocks=12, max_model_len=64
        )
        first = prefill.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))[0]
        decode = _engine(llama_dir, cons)
        decode.add_request("r", prompt, params, kv_transfer_params=first.kv_transfer_params)
        while decode.has_unfinished:
            decode.step()
        assert decode.completion("r").token_ids == want
        stats = decode.stats().kv_connector
        assert stats is not None and stats.num_load_failures == 1 and stats.loaded_tokens == 0
        assert "refused the load" in stats.reasons["r"]
        assert not decode.scheduler.has_pending_kv
    finally:
        prod.close()
        cons.close()


def test_an_engine_with_a_connector_frees_its_runner_without_a_collection(
    llama_dir: Path,
) -> None:
    """The connector's driver and the runner (and the scheduler) hold each other; a freed
    engine lets go of the driver, so its runner (weights, KV cache) is freed by reference
    counting alone: with the heap frozen (``freeze_gc``), a cycle would keep it until every
    engine is gone."""
    import gc
    import weakref

    tier = OffloadingConnector(OffloadingConfig(cpu_bytes=64 * 2048), block_size=BS)
    engine = _engine(llama_dir, tier)
    engine.generate([HISTORY], GREEDY)
    runner = weakref.ref(engine.runner)
    gc.disable()  # (only reference counting may free it)
    try:
        del engine
        assert runner() is None
    finally:
        gc.enable()
        tier.close()
