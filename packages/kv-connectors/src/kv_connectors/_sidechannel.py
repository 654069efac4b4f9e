"""The metadata side channel: length-prefixed JSON messages over TCP, bounded and with timeouts.

A worker that serves KV listens on one address (``127.0.0.1`` unless configured); each accepted
connection is one session with one peer and gets its own thread. Messages are small (layouts,
block ids, agent metadata); KV bytes never travel here.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "MAX_MESSAGE_BYTES",
    "SideChannelServer",
    "StaleSession",
    "connect",
    "recv_msg",
    "request",
    "send_msg",
]

MAX_MESSAGE_BYTES = 64 * 2**20
_LEN = struct.Struct("<I")


def send_msg(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"side-channel message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("side channel closed by the peer")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE_BYTES:
        raise ConnectionError(f"peer announced a {n}-byte message (limit {MAX_MESSAGE_BYTES})")
    msg = json.loads(_recv_exact(sock, n))
    if not isinstance(msg, dict):
        raise ConnectionError(f"side-channel message is a {type(msg).__name__}, not an object")
    return msg


def _no_delay(sock: socket.socket) -> None:
    # Request/reply of small messages: Nagle + delayed ACKs would add ~40 ms to every exchange.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class StaleSession(ConnectionError):
    """The peer closed or reset the connection before answering a request: a cached session whose
    peer restarted. Nothing of the request was done; a fresh session may retry it."""


def request(sock: socket.socket, msg: dict[str, Any]) -> dict[str, Any]:
    """Send ``msg`` and return the reply; a closed/reset connection raises :class:`StaleSession`
    (a timeout does not: a peer that stalls is not retried)."""
    try:
        send_msg(sock, msg)
        return recv_msg(sock)
    except TimeoutError:
        raise
    except (ConnectionError, OSError) as exc:
        raise StaleSession(f"side channel closed: {exc}") from exc


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.settimeout(timeout_s)
    _no_delay(sock)
    return sock


#: How long ``SideChannelServer.close`` waits for its sessions to end, all together.
_SESSION_JOIN_S = 10.0


class SideChannelServer:
    """Accepts sessions on ``(host, port)`` and runs ``handler(sock)`` for each on its own thread."""

    def __init__(
        self, host: str, port: int, handler: Callable[[socket.socket], None], *, name: str
    ) -> None:
        self._sock = socket.create_server((host, port))  # one address; never all interfaces
        self._sock.settimeout(0.2)  # the accept loop checks for close() this often
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._handler = handler
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._sessions: set[threading.Thread] = set()  # one per accepted connection, running
        self._lock = threading.Lock()
        self._name = name
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            _no_delay(conn)
            t = threading.Thread(
                target=self._serve, args=(conn,), name=f"{self._name}-session", daemon=True
            )
            with self._lock:
                self._conns.add(conn)
                self._sessions.add(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handler(conn)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._sessions.discard(threading.current_thread())
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2)
        # The sessions end with their sockets (a transfer in flight within its own bound). Joined
        # here, their transport objects (a torch process group each) are destroyed on their own
        # threads now, not at interpreter exit: a process that closed its connector and exited
        # at once sometimes died there with "terminate called without an active exception"
        # (bench_disagg's prefill process, 1 run in 4 on the CPU).
        deadline = time.monotonic() + _SESSION_JOIN_S
        with self._lock:
            sessions = list(self._sessions)
        for t in sessions:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
