"""Disaggregated prefill → decode through a kv-connectors connector, between two processes.

The *prefill* process (``python -m kvstack.handoff prefill MODEL_DIR``, a child) runs a prompt
through its engine for one token with ``hold_blocks``, registers its paged cache with the
connector and publishes the request's blocks (``request_finished`` → transfer params JSON on
stdout). The *decode* process (the caller) admits the same request with the prompt's tokens
marked external: its scheduler allocates blocks, the connector pulls the producer's blocks into
them (``get_num_new_matched_tokens`` → ``update_state_after_alloc`` → ``start_load_kv``), and
decoding continues from the first token.

Blocks move whole with every layer slot, so one transfer carries every KV group (groups share one
block-id space; a block belongs to one group at a time). The pairs are taken position by position
per group; positions a sliding window already dropped (the null block) are skipped on both sides.
The connector is NIXL (UCX) when the ``nixl`` package works here, else P2P over gloo.
"""

from __future__ import annotations

import importlib.util
import json
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

from kvstack._hints import install_hint

__all__ = ["make_connector", "pair_blocks", "run_demo"]

BLOCK_SIZE = 16
TIMEOUT_S = 30.0
_MARK = "KVSTACK-HANDOFF "


@dataclass
class _Req:
    """What a connector needs of a request (``kv_connectors.RequestLike``). Every transferred
    block counts as a full block, including a partial last one: its bytes are what they are, and
    the decode side overwrites the slots past the prompt."""

    request_id: str
    block_hashes: list[bytes] = field(default_factory=list)


def make_connector(prefer_nixl: bool = True) -> tuple[Any, str]:
    """The connector for this machine and a sentence saying which and why."""
    from kv_connectors import P2pConfig, P2pConnector

    if prefer_nixl and importlib.util.find_spec("nixl") is None:
        # kv_connectors.nixl imports without nixl and fails only when an agent is made, later:
        # decide here (`uv run kvstack demo` does not install the nixl extra).
        why = f"the nixl package is not installed: {install_hint('nixl', 'kvstack demo')}"
    elif prefer_nixl:
        try:
            from kv_connectors import NixlConfig
            from kv_connectors.nixl import NixlConnector

            # No progress thread: both sides poll (get_finished), which spares two small cores.
            nixl = NixlConnector(
                NixlConfig(timeout_s=TIMEOUT_S, progress_thread=False), block_size=BLOCK_SIZE
            )
            return nixl, "NIXL (UCX), installed here"
        except Exception as e:
            why = f"NIXL unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    else:
        why = "NIXL not requested"
    p2p = P2pConnector(P2pConfig(timeout_s=TIMEOUT_S), block_size=BLOCK_SIZE)
    return p2p, f"P2P over gloo ({why})"


def pair_blocks(
    producer: tuple[list[int], ...], consumer: tuple[list[int], ...], num_tokens: int
) -> tuple[list[int], list[int]]:
    """Producer and consumer block ids holding tokens ``[0, num_tokens)``, paired by group and
    position. Positions the consumer's window no longer needs (null block 0: admitted with
    ``num_tokens`` computed, it drops what no future query reads) are skipped."""
    src: list[int] = []
    dst: list[int] = []
    n = -(-num_tokens // BLOCK_SIZE)
    for p, c in zip(producer, consumer, strict=True):
        for a, b in zip(p[:n], c[:n], strict=True):
            if a and b:
                src.append(a)
                dst.append(b)
            elif b:  # the consumer needs a block the producer's window already dropped
                raise ValueError(
                    f"the consumer needs block position {len(src)} that the producer dropped; "
                    "their sliding windows differ"
                )
    return src, dst


def _engine(model_dir: str | Path, device: str) -> Any:
    from kvstack.engine.engine import LLMEngine

    return LLMEngine(
        model_dir, device=device, block_size=BLOCK_SIZE, kv_cache_memory=2 * 2**20,
        max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4,
    )  # fmt: skip


def _prefill_main(model_dir: str, device: str, transport: str) -> None:
    """The child: prefill the prompt read from stdin, publish its blocks, serve until stdin closes."""
    from kvstack.engine.sampling import SamplingParams

    job = json.loads(sys.stdin.readline())
    engine = _engine(model_dir, device)
    conn, _why = make_connector(prefer_nixl=transport == "nixl")
    conn.register_kv_caches(engine.runner.kv_caches[0], engine.runner.layouts[0])
    rid = job["request_id"]
    engine.add_request(
        rid, job["prompt"], SamplingParams(max_new_tokens=1, ignore_eos=True), hold_blocks=True
    )
    while engine.has_unfinished:
        engine.step()
    first = engine.completion(rid).token_ids[0]
    # Publish what a decode worker admitted with the prompt computed will read: a sliding-window
    # group drops the positions no future query sees (the manager's own rule), so they stay home.
    num = len(job["prompt"])
    n = -(-num // BLOCK_SIZE)
    blocks = [
        [0 if j < m.num_skipped_tokens(num) // BLOCK_SIZE else b for j, b in enumerate(group[:n])]
        for m, group in zip(engine.kv.managers, engine.block_ids(rid), strict=True)
    ]
    ids = [b for group in blocks for b in group if b]
    _ok, params = conn.request_finished(_Req(rid, [b""] * len(ids)), ids)
    # A marker: libraries (NIXL, UCX) may print their own lines on stdout.
    print(
        _MARK + json.dumps({"first_token": first, "blocks": blocks, "params": params}), flush=True
    )
    # Serve until the decode side has the blocks (polling drives NIXL without a progress thread)
    # or closes stdin; then the blocks go back to the pool.
    deadline = time.monotonic() + 4 * TIMEOUT_S
    sent = told = False
    while time.monotonic() < deadline and not (sent and told):
        ready, _, _ = select.select([sys.stdin], [], [], 0.01)
        if ready:
            if not sys.stdin.readline().strip():
                break  # stdin closed: the decode side is gone
            told = True
        sent |= rid in conn.get_finished()[0]
    engine.release(rid)
    conn.close()


def run_demo(
    console: Any,
    model_dir: Path,
    prompt: list[int],
    max_new_tokens: int,
    expected: list[int] | None,
    device: str = "cpu",
) -> bool:
    """Prefill ``prompt`` in a child process, decode here; True when the tokens equal ``expected``
    (``None``: this process's own one-process run of ``prompt`` on ``device``)."""
    from kvstack.engine.sampling import SamplingParams

    if expected is None:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        expected = list(_engine(model_dir, device).generate([prompt], params)[0].token_ids)
    conn, why = make_connector()
    transport = "nixl" if why.startswith("NIXL") else "p2p"
    engine = _engine(model_dir, device)
    conn.register_kv_caches(engine.runner.kv_caches[0], engine.runner.layouts[0])
    child = subprocess.Popen(
        [sys.executable, "-m", "kvstack.handoff", "prefill", str(model_dir), device, transport],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert child.stdin is not None and child.stdout is not None
        rid = "handoff-0"
        child.stdin.write(json.dumps({"request_id": rid, "prompt": prompt}) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        while line and not line.startswith(_MARK):
            line = child.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the prefill process exited ({child.wait()}) without publishing its blocks"
            )
        msg = json.loads(line[len(_MARK) :])
        first = int(msg["first_token"])
        loaded: dict[str, Any] = {}

        def load(request_id: str, block_ids: tuple[list[int], ...], num_tokens: int) -> None:
            t0 = time.perf_counter()
            src, dst = pair_blocks(tuple(msg["blocks"]), block_ids, num_tokens)
            conn.add_remote_request(request_id, msg["params"])
            req = _Req(request_id)
            tokens, _async = conn.get_num_new_matched_tokens(req, 0)
            if tokens != len(src) * BLOCK_SIZE:
                raise RuntimeError(
                    f"the connector matched {tokens} tokens, expected {len(src) * BLOCK_SIZE}: {conn.load_error_reasons}"
                )
            conn.update_state_after_alloc(req, dst, tokens)
            conn.start_load_kv(conn.build_connector_meta())
            done: set[str] = set()
            deadline = time.monotonic() + 2 * TIMEOUT_S
            while request_id not in done and time.monotonic() < deadline:
                done |= conn.get_finished()[1]
                time.sleep(0.005)
            errors = conn.get_block_ids_with_load_errors()
            if request_id not in done or errors:
                raise RuntimeError(
                    f"KV load failed: {conn.load_error_reasons.get(request_id, 'timed out')}"
                )
            loaded.update(blocks=len(src), seconds=time.perf_counter() - t0)

        engine.external_loader = load
        engine.add_request(
            rid, [*prompt, first], SamplingParams(max_new_tokens=max_new_tokens - 1, ignore_eos=True),
            num_external_tokens=len(prompt),
        )  # fmt: skip
        while engine.has_unfinished:
            engine.step()
        tokens = [first, *engine.completion(rid).token_ids]
        child.stdin.write("done\n")
        child.stdin.flush()
    finally:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
        conn.close()
    page = (
        engine.runner.kv_cache_config.page_size_bytes
        * engine.runner.kv_cache_config.num_layer_slots
    )
    ok = tokens == expected
    console.print(
        f"connector: {escape(why)}. The prefill process computed the {len(prompt)}-token prompt and its first "
        f"token ({first}); {loaded['blocks']} blocks ({loaded['blocks'] * page:,} bytes, every layer and "
        f"KV group) moved to this process in {loaded['seconds'] * 1000:.0f} ms; this process decoded the rest."
    )
    mark = "[green]✓ match[/green]" if ok else "[red]✗ MISMATCH[/red]"
    console.print(f"  handed-off tokens {tokens}\n  one-process tokens {expected}  {mark}")
    return ok


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "prefill":
        sys.exit("usage: python -m kvstack.handoff prefill MODEL_DIR DEVICE nixl|p2p")
    _prefill_main(sys.argv[2], sys.argv[3], sys.argv[4])
