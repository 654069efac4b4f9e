"""A prefill engine in its own process for ``test_engine_stream.py``: streams every prompt layer
by layer (``LLMEngine.stream_kv``) over a producer ``P2pConnector`` and steps until the consumer
has pulled everything.

Config: one JSON argument (``model_dir``, ``fingerprint``, ``engine`` options, ``prompts``:
request id -> token ids, ``timeout_s``, ``hold_last``). Prints, one line each (flushed):
``READY``; ``PARAMS <rid> <json>`` the moment a request's last prompt tokens are scheduled (before
the forward pass); with ``hold_last``, ``AT_LAST`` when the first streamed step reaches its last
layer, which it then computes only after reading ``GO`` on stdin (bounded), printing
``LAST <time.time()>``; ``FIRST <rid> <token>`` per request; ``ALL_SENT <free blocks>`` once no
pull holds a block. Exits when stdin closes.
"""

from __future__ import annotations

import json
import select
import sys
import time

import torch
from kv_connectors import P2pConfig, P2pConnector
from kvstack.engine import LLMEngine, SamplingParams


def say(*parts: str) -> None:
    print(" ".join(parts), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    cfg = json.loads(sys.argv[1])
    p2p = P2pConfig(
        role="producer",
        timeout_s=cfg["timeout_s"],
        model_fingerprint=cfg["fingerprint"],
        buffer_bytes=1 << 16,
    )
    conn = P2pConnector(p2p, block_size=cfg["engine"]["block_size"])
    engine = LLMEngine(cfg["model_dir"], kv_connector=conn, **cfg["engine"])
    driver = engine.connector
    assert driver is not None
    last = engine.runner.kv_cache_config.num_layer_slots - 1
    hold = [bool(cfg["hold_last"])]
    real_before = driver.before_attention

    def before_attention(slot: int) -> None:
        if hold[0] and slot == last:  # the producer has not computed its last layer
            hold[0] = False
            say("AT_LAST")
            ready, _, _ = select.select([sys.stdin], [], [], cfg["timeout_s"] * 3)
            line = sys.stdin.readline() if ready else ""
            if line.strip() != "GO":
                say("NO_GO", repr(line))
                sys.exit(3)
            say("LAST", repr(time.time()))
        real_before(slot)

    driver.before_attention = before_attention  # type: ignore[method-assign,assignment]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for rid, prompt in cfg["prompts"].items():
        engine.add_request(rid, prompt, one)
        engine.stream_kv(rid, lambda r, params: say("PARAMS", r, json.dumps(params)))
    say("READY")
    deadline = time.monotonic() + cfg["timeout_s"] * 4
    while engine.has_unfinished or engine.scheduler.has_pending_kv:
        if time.monotonic() > deadline:
            say("STUCK", repr(sorted(engine.scheduler.sending)))
            sys.exit(4)
        for ev in engine.step():
            say("FIRST", ev.request_id, str(ev.token_id))
        if not engine.has_unfinished:
            time.sleep(1e-3)  # only pulls left: leave the core to the session threads
    say("ALL_SENT", str(engine.kv.num_free_blocks))
    select.select([sys.stdin], [], [], 60)
    conn.close()


if __name__ == "__main__":
    main()
