"""Layer-wise disaggregated prefill through the engines (issue 30): a prefill engine in another
process (``stream_peer.py``) streams each prompt with ``LLMEngine.stream_kv`` while computing it;
a decode engine here, with ``P2pConfig(layerwise=True)``, loads it inside its step, layer by layer
(P2P over gloo on 127.0.0.1). Every request's tokens are held to one engine computing everything
itself; the producer is held before its last layer until the decode engine has loaded layer 0
(so the decode side provably ran a layer before the producer computed its last one), in a step
that streams one request and in one that streams three (the decode step loads all three from
the one producer, segment-major); planted bugs (no per-layer wait, a wait for the whole
request) and a producer killed mid-stream."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_connectors import OffloadingConfig, OffloadingConnector, P2pConfig, P2pConnector
from kvstack.engine.connector_driver import model_fingerprint
from kvstack.engine.engine import LLMEngine
from kvstack.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PEER = Path(__file__).with_name("stream_peer.py")
BS = 4
ENGINE = dict(block_size=BS, num_blocks=40, max_model_len=64, max_num_batched_tokens=32)
#: With 32 tokens a step the producer streams r0 in its first step, r1 (chunked) and r2 in its
#: second, r3 in its third. r1 is a whole number of blocks: the decode engine takes one block
#: less and computes its last token.
PROMPTS = {
    f"r{k}": [(7 * i + 3 * k + 1) % 120 + 1 for i in range(n)]
    for k, n in enumerate((27, 24, 10, 30))
}
DECODE = SamplingParams(max_new_tokens=6, ignore_eos=True)
TIMEOUT = 20.0


class Peer:
    """The prefill process, its stdout lines read by a thread (every read bounded)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("READY", timeout_s=120)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line.rstrip("\n"))
        self.lines.put("EOF")

    def next(self, timeout_s: float) -> str | None:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if line == "EOF":
            raise RuntimeError(f"the prefill process exited: {''.join(self.log)[-3000:]}")
        return line

    def expect(self, prefix: str, *, timeout_s: float, seen: list[str] | None = None) -> str:
        """The next line starting with ``prefix``; lines before it go to ``seen``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.next(max(0.01, deadline - time.monotonic()))
            if line is None:
                continue
            if line.startswith(prefix):
                return line
            if seen is not None:
                seen.append(line)
        raise TimeoutError(f"no {prefix!r} in {timeout_s}s: {''.join(self.log)[-3000:]}")

    def logged(self, prefix: str, *, timeout_s: float) -> str:
        """The first line starting with ``prefix`` the process printed (read or not)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.log):
                if line.startswith(prefix):
                    return line.rstrip("\n")
            time.sleep(0.01)
        raise TimeoutError(f"no {prefix!r} in {timeout_s}s: {''.join(self.log)[-3000:]}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def peer(llama_dir: Path) -> Iterator[Callable[..., Peer]]:
    peers: list[Peer] = []

    def spawn(prompts: dict[str, list[int]], hold_last: bool = True, **engine: Any) -> Peer:
        cfg = {
            "model_dir": str(llama_dir),
            "fingerprint": model_fingerprint(llama_dir),
            "engine": {**ENGINE, **engine},
            "prompts": prompts,
            "timeout_s": TIMEOUT,
            "hold_last": hold_last,
        }
        p = Peer(cfg)
        peers.append(p)
        return p

    yield spawn
    for p in peers:
        p.stop()


@pytest.fixture(scope="module")
def want(llama_dir: Path) -> dict[str, tuple[int, ...]]:
    """Each prompt's tokens from one engine that computes everything."""
    engine = LLMEngine(llama_dir, **ENGINE)  # type: ignore[arg-type]
    done = engine.generate(list(PROMPTS.values()), DECODE)
    return {rid: c.token_ids for rid, c in zip(PROMPTS, done, strict=True)}


def _decode_engine(llama_dir: Path, timeout_s: float = TIMEOUT) -> tuple[LLMEngine, P2pConnector]:
    cfg = P2pConfig(
        role="consumer",
        layerwise=True,
        timeout_s=timeout_s,
        model_fingerprint=model_fingerprint(llama_dir),
        buffer_bytes=1 << 16,
    )
    conn = P2pConnector(cfg, block_size=BS)
    engine = LLMEngine(llama_dir, kv_connector=conn, **ENGINE)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(4)  # finite junk where the loads land (as after reuse)
    storage = engine.runner.kv_caches[0]
    for t in [storage] if isinstance(storage, torch.Tensor) else storage:
        t.copy_(torch.randn(t.shape, generator=gen) * 3)
    return engine, conn


def _at_layer_0(engine: LLMEngine, then: Callable[[], None], bug: str | None = None) -> list[float]:
    """After the decode engine's first ``before_attention(0)`` (layer 0 of the step's loads is in
    place), record the time and run ``then`` (once). ``bug``: ``"no_wait"`` skips every per-layer
    wait; ``"whole"`` waits for every layer at layer 0 (a per-request wait)."""
    driver = engine.connector
    assert driver is not None
    real = driver.before_attention
    layers = engine.runner.kv_cache_config.num_layer_slots
    when: list[float] = []

    def before_attention(slot: int) -> None:
        if bug is None:
            real(slot)
        elif bug == "whole" and slot == 0:
            for s in range(layers):
                real(s)
        if slot == 0 and not when:
            when.append(time.time())
            then()

    driver.before_attention = before_attention  # type: ignore[method-assign,assignment]
    return when


def _params_until(peer: Peer, marker: str) -> dict[str, dict[str, Any]]:
    seen: list[str] = []
    peer.expect(marker, timeout_s=60, seen=seen)
    out = {}
    for line in seen:
        if line.startswith("PARAMS "):
            _tag, rid, text = line.split(" ", 2)
            out[rid] = json.loads(text)
    return out


def _run_decode(
    engine: LLMEngine, peer: Peer, params: dict[str, dict[str, Any]], total: int
) -> dict[str, tuple[int, ...]]:
    """Add requests as their params arrive (the bare prompt: the decode engine computes the rest
    and samples every token itself) and step until ``total`` have finished."""
    got: dict[str, tuple[int, ...]] = {}
    added: set[str] = set()
    deadline = time.monotonic() + 120
    while len(got) < total:
        assert time.monotonic() < deadline, f"stuck: {''.join(peer.log)[-2000:]}"
        for rid, p in params.items():
            if rid not in added:
                engine.add_request(rid, PROMPTS[rid], DECODE, kv_transfer_params=p)
                added.add(rid)
        params = {}
        if engine.has_unfinished:
            for ev in engine.step():
                if ev.finished:
                    got[ev.request_id] = engine.completion(ev.request_id).token_ids
        while (line := peer.next(0 if engine.has_unfinished else 0.01)) is not None:
            if line.startswith("PARAMS "):
                _tag, rid, text = line.split(" ", 2)
                params[rid] = json.loads(text)
    return got


@pytest.mark.parametrize(
    ("step_tokens", "held"), [(32, ["r0"]), (64, ["r0", "r1", "r2"])], ids=["one", "three"]
)
def test_decode_engine_loads_layer_by_layer_while_the_producer_computes(
    llama_dir: Path,
    peer: Callable[..., Peer],
    want: dict[str, tuple[int, ...]],
    step_tokens: int,
    held: list[str],
) -> None:
    """``held``: the requests the producer streams in the step it holds before its last layer
    (32 tokens a step: r0; 64: r0, r1 and r2). The decode engine's first step loads all of
    them; before issue 30's segment-major pull, r1 and r2 queued behind r0's whole pull (which
    waits for the held layer) and that step's layer 0 never came for them."""
    p = peer(PROMPTS, max_num_batched_tokens=step_tokens)
    decode, conn = _decode_engine(llama_dir)
    try:
        first = _params_until(p, "AT_LAST")  # the producer waits before its last layer
        assert sorted(first) == held  # handed over before their forward pass ran
        # the session to the producer exists, as after earlier requests (pulls racing to make
        # the first one would each make their own and never contend for it)
        conn._peer(first["r0"]["host"], first["r0"]["port"])
        at_go: list[list[str]] = []

        def go() -> None:  # layer 0 of every load of this decode step is in place
            at_go.append(sorted(conn._step_arriving))
            p.send("GO")

        layer0 = _at_layer_0(decode, go)
        got = _run_decode(decode, p, first, total=len(PROMPTS))
        assert got == want  # planted bugs: see the twins below
        stats = decode.stats().kv_connector
        assert stats is not None
        assert stats.num_load_failures == 0, stats.reasons
        # full blocks past the last token: 6 + 5 (24 tokens: one left to compute) + 2 + 7
        assert stats.loaded_tokens == (6 + 5 + 2 + 7) * BS
        assert decode.stats().scheduler.num_async_loads == 0  # every load ran inside a step
        assert layer0  # the decode engine loaded and attended layer 0 ...
        assert at_go == [held]  # ... of every request the producer held, in one step ...
        t_last = float(p.logged("LAST ", timeout_s=1).split()[1])
        assert layer0[0] < t_last  # ... before the producer began its last layer
        free = p.logged("ALL_SENT", timeout_s=60).split()[1]
        assert int(free) == ENGINE["num_blocks"] - 1  # every producer block back after the pulls
    finally:
        conn.close()


@pytest.mark.parametrize("bug", ["no_wait", "whole"])
def test_planted_bugs_are_caught(
    llama_dir: Path, peer: Callable[..., Peer], want: dict[str, tuple[int, ...]], bug: str
) -> None:
    """``no_wait``: the decode engine attends without waiting for the loaded layers; the producer
    computes its last layer only after the decode engine finished its step, so those blocks
    hold junk when read: the tokens differ. ``whole``: a wait for every layer before layer 0
    (whole-request loading) never sees the last layer before the producer is let go: the load
    times out (recomputed; tokens right, overlap lost), which the failure count catches."""
    prompts = {r: PROMPTS[r] for r in ("r0", "r1", "r2")}
    p = peer(prompts)
    decode, conn = _decode_engine(llama_dir, timeout_s=3.0)
    try:
        first = _params_until(p, "AT_LAST")
        driver = decode.connector
        assert driver is not None
        if bug == "no_wait":  # let the producer go once this decode step has ended
            _at_layer_0(decode, lambda: None, bug)
            real_end = driver.end_forward

            def end_forward() -> dict[str, int]:
                if not released:
                    released.append(True)
                    p.send("GO")
                return real_end()

            released: list[bool] = []
            driver.end_forward = end_forward  # type: ignore[method-assign]
        else:
            _at_layer_0(decode, lambda: p.send("GO"), bug)
        got = _run_decode(decode, p, first, total=len(prompts))
        stats = decode.stats().kv_connector
        assert stats is not None
        if bug == "no_wait":
            assert got != {r: want[r] for r in prompts}  # the token check catches it
        else:
            assert got == {r: want[r] for r in prompts}  # recomputed ...
            assert stats.num_load_failures == 1  # ... but the overlap check catches it (r0)
        p.proc.kill()  # (its send of r0's last layer waits out its own timeout otherwise)
    finally:
        conn.close()


def test_producer_killed_mid_stream_is_recomputed(
    llama_dir: Path, peer: Callable[..., Peer], want: dict[str, tuple[int, ...]]
) -> None:
    """The producer streams r0, r1 and r2 in one step (64 tokens a step) and is killed while it
    waits before its last layer, the decode engine's step under way (one pull carries the three
    loads, their first layer landed): each load fails once and is recomputed."""
    prompts = {r: PROMPTS[r] for r in ("r0", "r1", "r2")}
    p = peer(prompts, max_num_batched_tokens=64)
    decode, conn = _decode_engine(llama_dir)
    try:
        first = _params_until(p, "AT_LAST")
        assert set(first) == set(prompts)

        def kill() -> None:  # the last layer never comes
            time.sleep(0.3)  # (r0's first layer lands meanwhile)
            p.proc.kill()

        driver = decode.connector
        assert driver is not None
        real = driver.before_attention
        killer = threading.Thread(target=kill, daemon=True)

        def before_attention(slot: int) -> None:
            if not killer.is_alive() and killer.ident is None:
                killer.start()
            real(slot)

        driver.before_attention = before_attention  # type: ignore[method-assign,assignment]
        start = time.monotonic()
        got: dict[str, tuple[int, ...]] = {}
        for rid, params in first.items():
            decode.add_request(rid, prompts[rid], DECODE, kv_transfer_params=params)
        while decode.has_unfinished:
            for ev in decode.step():
                if ev.finished:
                    got[ev.request_id] = decode.completion(ev.request_id).token_ids
        assert time.monotonic() - start < TIMEOUT  # detected when the group broke, not later
        assert p.proc.wait(timeout=10) != 0
        assert got == {r: want[r] for r in prompts}
        stats = decode.stats().kv_connector
        assert stats is not None
        assert stats.num_load_failures == 3, stats.reasons
        assert stats.loaded_tokens == 0  # nothing counted as loaded
    finally:
        conn.close()


def test_stream_kv_refusals_name_the_fix(llama_dir: Path) -> None:
    fp = model_fingerprint(llama_dir)
    prod = P2pConnector(P2pConfig(role="producer", model_fingerprint=fp), block_size=BS)
    tier = OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=BS)
    try:
        engine = LLMEngine(llama_dir, kv_connector=prod, **ENGINE)  # type: ignore[arg-type]
        one = SamplingParams(max_new_tokens=1)

        def keep(rid: str, params: dict[str, Any]) -> None:
            pass

        with pytest.raises(ValueError, match="no such request"):
            engine.stream_kv("x", keep)
        engine.add_request("long", PROMPTS["r0"], SamplingParams(max_new_tokens=4))
        with pytest.raises(ValueError, match="max_new_tokens=4.*give max_new_tokens=1"):
            engine.stream_kv("long", keep)
        engine.add_request("short", [1, 2, 3], one)
        with pytest.raises(ValueError, match="no full block of 4"):
            engine.stream_kv("short", keep)
        engine.add_request("ok", PROMPTS["r0"], one)
        with pytest.raises(TypeError, match="not callable"):
            engine.stream_kv("ok", None)  # type: ignore[arg-type]
        engine.stream_kv("ok", keep)
        with pytest.raises(ValueError, match="already streamed"):
            engine.stream_kv("ok", keep)
        engine.abort_request(["long", "short", "ok"])
        engine.add_request("late", PROMPTS["r1"], one)
        engine.step()
        with pytest.raises(ValueError, match="already scheduled"):
            engine.stream_kv("late", keep)
        with pytest.raises(ValueError, match="no kv_connector"):
            LLMEngine(llama_dir, **ENGINE).stream_kv("x", keep)  # type: ignore[arg-type]
        other = LLMEngine(llama_dir, kv_connector=tier, **ENGINE)  # type: ignore[arg-type]
        other.add_request("t", PROMPTS["r0"], one)
        with pytest.raises(TypeError, match="OffloadingConnector cannot stream"):
            other.stream_kv("t", keep)
    finally:
        prod.close()
        tier.close()


def test_params_come_before_the_forward_pass_and_blocks_stay_until_pulled(
    llama_dir: Path,
) -> None:
    """In one process, no consumer: ``on_params`` runs before the step's first layer; the
    request finishes after its prefill with the same params, its blocks held (the consumer has
    not pulled); aborting it frees them."""
    fp = model_fingerprint(llama_dir)
    prod = P2pConnector(P2pConfig(role="producer", model_fingerprint=fp), block_size=BS)
    try:
        engine = LLMEngine(llama_dir, kv_connector=prod, **ENGINE)  # type: ignore[arg-type]
        driver = engine.connector
        assert driver is not None
        events: list[str] = []
        real = driver.before_attention

        def before_attention(slot: int) -> None:
            events.append(f"layer {slot}")
            real(slot)

        driver.before_attention = before_attention  # type: ignore[method-assign,assignment]
        got: dict[str, Any] = {}

        def on_params(rid: str, params: dict[str, Any]) -> None:
            events.append(f"params {rid}")
            got[rid] = params

        free = engine.kv.num_free_blocks
        engine.add_request("p", PROMPTS["r0"], SamplingParams(max_new_tokens=1, ignore_eos=True))
        engine.stream_kv("p", on_params)
        engine.step()
        assert events[:2] == ["params p", "layer 0"]
        assert len(got["p"]["block_ids"]) == 6  # the 27-token prompt's full blocks
        done = engine.completion("p")
        assert done.kv_transfer_params == got["p"] and len(done.token_ids) == 1
        assert engine.stats().kv_connector.num_streamed == 1  # type: ignore[union-attr]
        engine.step()
        assert engine.kv.num_free_blocks < free  # held: a consumer may still pull them
        engine.abort_request("p")
        for _ in range(3):
            engine.step()
        assert engine.kv.num_free_blocks == free
    finally:
        prod.close()


def test_a_late_error_report_of_a_settled_load_fails_no_later_load(llama_dir: Path) -> None:
    """A layer-wise pull reports its blocks at the failed layer and may again when its thread
    ends, after the engine settled (and recomputed) that load. Such a report -- here every block
    of the pool, reported while no load is pending -- must not fail a later load into the same
    (reused) blocks: a CPU-tier hit after it loads clean (planted bug: the engine keeps every
    reported block -> one failure)."""
    tier = OffloadingConnector(OffloadingConfig(cpu_bytes=64 * 2048), block_size=BS)
    small = {**ENGINE, "num_blocks": 20}
    try:
        engine = LLMEngine(llama_dir, kv_connector=tier, **small)  # type: ignore[arg-type]
        history = PROMPTS["r0"][:24]
        one = SamplingParams(max_new_tokens=1, ignore_eos=True)
        engine.generate([history], one)
        for k in (5, 9):  # other conversations: the pool evicts the history's blocks
            engine.generate([[(11 * i + k) % 120 + 1 for i in range(36)]], one)
        real = tier.get_block_ids_with_load_errors
        tier.get_block_ids_with_load_errors = lambda: set(range(20))  # type: ignore[method-assign]
        engine.step()  # (idle: collects the stale report)
        tier.get_block_ids_with_load_errors = real  # type: ignore[method-assign]
        prompt = [*history, 3, 2]
        got = engine.generate([prompt], DECODE)[0]
        stats = engine.stats().kv_connector
        assert stats is not None and stats.loaded_tokens > 0  # the history came from the tier
        assert stats.num_load_failures == 0, stats.reasons
        ref = LLMEngine(llama_dir, **small).generate([prompt], DECODE)[0]  # type: ignore[arg-type]
        assert got.token_ids == ref.token_ids
    finally:
        tier.close()
