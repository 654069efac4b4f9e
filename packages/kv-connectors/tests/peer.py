"""A producer worker in its own process, for the two-process tests (run as a script, not collected).

    python peer.py CONFIG_JSON

CONFIG_JSON: {"transport": "p2p"|"nixl", "timeout_s": float, "fault": null|"die"|"stall",
"mode": "read"|"write" and "push_to": "host:port" (P2P push), "buffer_bytes" (P2P chunk bound),
"port" (side-channel port, default any),
"device": "cpu" | "cuda:N" (default cpu), "producers": [{"name", "layout" (layout JSON), "seed",
"block_ids", "tp": [rank, size], "stream": bool, "requests": [block ids, ...]}]}.
For each producer it builds a cache filled from ``seed``, registers a connector, finishes one
request holding ``block_ids`` and prints ``PARAMS <name> <params JSON>``; then ``READY``. It serves
until its stdin closes (or 120 s pass). Faults: ``die`` prints ``CHUNK`` once a transfer is under
way (P2P: the first chunk sent; NIXL: the pull received) and waits to be killed; ``stall`` never
sends (never answers). ``stream``: the request is served with ``stream_request`` while its
layers are "computed": every layer but the last is saved at once, the last when a ``SAVE_LAST``
line arrives on stdin (then ``SAVED`` is printed). ``requests`` (with ``stream``): several
requests streamed by the one connector in one step, ``req-<name>-<k>`` holding
``requests[k]``, their params printed as ``PARAMS <name>-<k>``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Req:
    request_id: str
    block_hashes: list[bytes] = field(default_factory=list)


def _hashed(request_id: str, ids: list[int]) -> _Req:
    return _Req(request_id, [bytes([i]) * 32 for i in range(len(ids))])


def _connector(cfg: dict[str, Any], prod: dict[str, Any]) -> Any:
    from kv_connectors import NixlConfig, P2pConfig, P2pConnector

    bs = json.loads(prod["layout"])["block_size"]
    rank, size = prod.get("tp", [0, 1])
    if cfg["transport"] == "p2p":
        return P2pConnector(
            P2pConfig(
                timeout_s=cfg["timeout_s"],
                buffer_bytes=cfg.get("buffer_bytes", 1 << 20),
                mode=cfg.get("mode", "read"),
                push_to=cfg.get("push_to"),
                port=cfg.get("port", 0),
            ),
            block_size=bs,
            tp_rank=rank,
            tp_size=size,
        )
    from kv_connectors.nixl import NixlConnector

    return NixlConnector(
        NixlConfig(timeout_s=cfg["timeout_s"], progress_thread=False, port=cfg.get("port", 0)),
        block_size=bs,
        tp_rank=rank,
        tp_size=size,
    )


def _inject(conn: Any, fault: str | None) -> None:
    if fault is None:
        return
    if hasattr(conn, "_serve_pull"):  # NIXL: the producer's part of a pull is its reply

        def hang(*_a: Any) -> None:
            if fault == "die":
                print("CHUNK", flush=True)
            time.sleep(3600)

        conn._serve_pull = hang
        return
    if fault == "stall":
        conn._send_blocks = lambda *a, **k: time.sleep(3600)
        return
    from kv_connectors._p2p_wire import Wire

    original = Wire.wait

    def wait_then_die(wire: Any, work: Any, deadline: float | None = None) -> None:
        original(wire, work, deadline)
        print("CHUNK", flush=True)
        time.sleep(3600)  # the test kills this process now, mid-transfer

    Wire.wait = wait_then_die  # type: ignore[method-assign,assignment]


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if str(cfg.get("device", "cpu")).startswith("cuda"):
        import torch

        torch.cuda.set_device(cfg["device"])
    from kv_connectors.testing import random_cache
    from kv_spec import KVCacheLayout

    conns = []
    streaming: list[Any] = []
    for prod in cfg["producers"]:
        layout = KVCacheLayout.from_json(prod["layout"])
        conn = _connector(cfg, prod)
        device = cfg.get("device", "cpu")
        conn.register_kv_caches(random_cache(layout, seed=prod["seed"], device=device), layout)
        _inject(conn, cfg.get("fault"))
        ids = prod["block_ids"]
        req = _hashed(f"req-{prod['name']}", ids)
        if prod.get("stream"):
            named = [(prod["name"], req, ids)]
            if "requests" in prod:  # several requests in the one step
                named = [
                    (f"{prod['name']}-{k}", _hashed(f"req-{prod['name']}-{k}", b), b)
                    for k, b in enumerate(prod["requests"])
                ]
            said = [(name, conn.stream_request(r, b)) for name, r, b in named]
            meta = conn.build_connector_meta()
            conn.start_load_kv(meta)
            for name, params in said:
                print("PARAMS", name, json.dumps(params), flush=True)
            for layer in range(layout.num_layers - 1):
                conn.save_kv_layer(layer, meta)
            reqs = [(r, b) for _name, r, b in named]
            streaming.append((conn, meta, layout.num_layers - 1, reqs))
            conns.append(conn)
            continue
        delay, params = conn.request_finished(req, ids)
        assert delay and params is not None
        print("PARAMS", prod["name"], json.dumps(params), flush=True)
        conn.wait_for_save()  # push mode: starts pushing to cfg["push_to"]; pull mode: no-op
        conns.append(conn)
    print("READY", flush=True)
    deadline = time.monotonic() + 120
    import select

    while time.monotonic() < deadline:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        line = sys.stdin.readline() if ready else None
        if line == "":
            break
        if line is not None and line.strip() == "SAVE_LAST":
            for conn, meta, last, reqs in streaming:
                conn.save_kv_layer(last, meta)
                conn.wait_for_save()
                for req, ids in reqs:
                    conn.request_finished(req, ids)
            print("SAVED", flush=True)
        for conn in conns:
            for rid in conn.get_finished()[0]:
                print("SENT", rid, flush=True)
    for conn in conns:
        conn.close()


if __name__ == "__main__":
    main()
