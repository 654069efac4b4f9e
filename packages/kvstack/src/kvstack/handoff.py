"""Disaggregated prefill → decode through a kv-connectors connector, between two processes.

Both processes drive the connector the way any engine does: through the contract, from
:class:`~kvstack.engine.LLMEngine` (``kv_connector=``; :mod:`kvstack.engine.connector_driver`).
The *prefill* process (``python -m kvstack.handoff prefill MODEL_DIR DEVICE nixl|p2p``, a child)
runs the prompt for one token with a producer connector: ``request_finished`` keeps the request's
blocks and returns its transfer params (JSON on stdout). The *decode* process (the caller) adds the
request with those params: its scheduler counts the producer's full blocks as external tokens
before allocating (``get_num_new_matched_tokens``), the request waits out of the batch while the
connector pulls them into its blocks (``update_state_after_alloc`` → ``start_load_kv`` →
``done_recving``), then computes the rest of the prompt and decodes. A failed pull is recomputed
(the demo then reports it). Blocks move whole with every layer slot; a model with one KV group (the
contract carries one block list per request). Both sides name the model with
:func:`~kvstack.engine.connector_driver.model_fingerprint`: a producer of another model is refused.
The connector is NIXL (UCX) when the ``nixl`` package works here, else P2P over gloo.
"""

from __future__ import annotations

import importlib.util
import json
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.markup import escape

from kvstack._hints import install_hint

__all__ = ["make_connector", "run_demo"]

BLOCK_SIZE = 16
TIMEOUT_S = 30.0
_MARK = "KVSTACK-HANDOFF "


def make_connector(
    prefer_nixl: bool = True, *, role: str = "both", fingerprint: str | None = None
) -> tuple[Any, str]:
    """The connector for this machine (``role``: ``producer`` / ``consumer`` / ``both``; the
    model's ``fingerprint``) and a sentence saying which and why."""
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
            cfg = NixlConfig(
                timeout_s=TIMEOUT_S, progress_thread=False, role=role,
                model_fingerprint=fingerprint,
            )  # fmt: skip
            return NixlConnector(cfg, block_size=BLOCK_SIZE), "NIXL (UCX), installed here"
        except Exception as e:
            why = f"NIXL unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    else:
        why = "NIXL not requested"
    cfg_p2p = P2pConfig(timeout_s=TIMEOUT_S, role=role, model_fingerprint=fingerprint)
    return P2pConnector(cfg_p2p, block_size=BLOCK_SIZE), f"P2P over gloo ({why})"


def _engine(model_dir: str | Path, device: str, connector: Any = None) -> Any:
    from kvstack.engine.engine import LLMEngine

    return LLMEngine(
        model_dir, device=device, block_size=BLOCK_SIZE, kv_cache_memory=2 * 2**20,
        max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4, kv_connector=connector,
    )  # fmt: skip


def _prefill_main(model_dir: str, device: str, transport: str) -> None:
    """The child: prefill the prompt read from stdin, publish its blocks, serve until stdin closes."""
    from kvstack.engine.connector_driver import model_fingerprint
    from kvstack.engine.sampling import SamplingParams

    job = json.loads(sys.stdin.readline())
    conn, _why = make_connector(
        transport == "nixl", role="producer", fingerprint=model_fingerprint(model_dir)
    )
    engine = _engine(model_dir, device, conn)
    done = engine.generate([job["prompt"]], SamplingParams(max_new_tokens=1, ignore_eos=True))[0]
    # A marker: libraries (NIXL, UCX) may print their own lines on stdout.
    out = {"first_token": done.token_ids[0], "params": done.kv_transfer_params}
    print(_MARK + json.dumps(out), flush=True)
    # Serve until the decode side has the blocks and says so, or closes stdin. Each idle step
    # polls the connector (which drives NIXL without a progress thread) and frees the blocks
    # once the consumer is done.
    deadline = time.monotonic() + 4 * TIMEOUT_S
    told = False
    while time.monotonic() < deadline and not (told and not engine.scheduler.sending):
        ready, _, _ = select.select([sys.stdin], [], [], 0.01)
        if ready:
            if not sys.stdin.readline().strip():
                break  # stdin closed: the decode side is gone
            told = True
        engine.step()
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
    from kvstack.engine.connector_driver import model_fingerprint
    from kvstack.engine.sampling import SamplingParams

    if expected is None:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        expected = list(_engine(model_dir, device).generate([prompt], params)[0].token_ids)
    conn, why = make_connector(role="consumer", fingerprint=model_fingerprint(model_dir))
    transport = "nixl" if why.startswith("NIXL") else "p2p"
    engine = _engine(model_dir, device, conn)
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
        t0 = time.perf_counter()
        engine.add_request(
            rid, [*prompt, first], SamplingParams(max_new_tokens=max_new_tokens - 1, ignore_eos=True),
            kv_transfer_params=msg["params"],
        )  # fmt: skip
        load_s = None
        while engine.has_unfinished:
            engine.step()
            if load_s is None and rid not in engine.scheduler.loading:
                load_s = time.perf_counter() - t0
        tokens = [first, *engine.completion(rid).token_ids]
        child.stdin.write("done\n")
        child.stdin.flush()
    finally:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
        conn.close()
    stats = engine.stats().kv_connector
    assert stats is not None
    page = (
        engine.runner.kv_cache_config.page_size_bytes
        * engine.runner.kv_cache_config.num_layer_slots
    )
    ok = tokens == expected and not stats.num_load_failures
    blocks = stats.loaded_blocks
    console.print(
        f"connector: {escape(why)}. The prefill process computed the {len(prompt)}-token prompt and its first "
        f"token ({first}); {blocks} full blocks ({blocks * page:,} bytes, every layer) moved to this process "
        f"in {(load_s or 0.0) * 1000:.0f} ms while the request waited out of the batch; this process "
        "computed the rest of the prompt and decoded."
    )
    if stats.num_load_failures:
        console.print(
            f"  [red]✗ the load failed and was recomputed: {escape(str(stats.reasons))}[/red]"
        )
    mark = "[green]✓ match[/green]" if ok else "[red]✗ MISMATCH[/red]"
    console.print(f"  handed-off tokens {tokens}\n  one-process tokens {expected}  {mark}")
    return ok


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "prefill":
        sys.exit("usage: python -m kvstack.handoff prefill MODEL_DIR DEVICE nixl|p2p")
    _prefill_main(sys.argv[2], sys.argv[3], sys.argv[4])
