"""``NixlConnector``: KV moved in place between registered caches by NVIDIA NIXL agents (UCX).

At registration each worker registers its caches' memory with a NIXL agent (``DRAM`` for CPU
caches, ``VRAM`` for CUDA ones) and prepares its descriptor list *once*: descriptor
``b * R + r`` is byte range ``r`` of block ``b`` (``R`` ranges per block: one per segment for
block-contiguous orders, one per head and segment for LHBNC), read from the layout's strides.

Handshake (side channel, per producer): the consumer sends ``hello``; the producer answers with its
agent metadata, its live compatibility hashes and the compact shape of its descriptor list
(per segment: base address, block stride, ranges); the consumer adds the remote agent and prepares
the remote descriptor list once per producer. A pull (``READ``, the default): the consumer asks the
producer to hold the request's blocks for a *lease* (``pull`` with ``lease_s``, its ``timeout_s``;
the producer checks it still holds them and grants at most its own ``timeout_s``), then posts one
READ of all the request's descriptors with a notification naming the pull; the producer sees the
notification and reports the request in ``done_sending``. The blocks stay pinned until that
notification arrives or the lease ends (a consumer that died mid-READ). The consumer measures
its lease from *before* it asked, so its lease ends no later than the producer's, and a READ
it sees complete after its lease ended is a load error, never a success: bytes that may have
changed under a READ never reach the engine as loaded KV. A pull that fails with no READ in flight
(a READ in state ``ERR``, a conversion error) sends ``kv-end`` so the producer unpins at once;
one that timed out sends nothing (its READ may still run) and the lease bounds it.

Descriptor ranges are in *row order* (:meth:`~kv_connectors.views.CacheSegment.chunk_ranges`):
read one after the other they are the block's row. Caches with the same compatibility hash are
read in place, straight into the consumer's blocks; otherwise the consumer reads producer rows into
a registered staging buffer (``staging_bytes``, in pieces) and converts them
(:func:`~kv_connectors.handshake.convert_rows`: orders, block sizes, TP head splits) before the
scatter. The completion notification rides on the last READ.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from kv_connectors._sidechannel import recv_msg, send_msg
from kv_connectors.base import LoadSpec, log
from kv_connectors.config import NixlConfig, TransferMode
from kv_connectors.handshake import HandshakeRefused
from kv_connectors.transfer import RemotePlan, TransferConnector
from kv_connectors.views import RegisteredKV

__all__ = ["NixlConnector"]


def _pattern(kv: RegisteredKV) -> list[dict[str, Any]]:
    """Per segment: base address, block stride and the ``(offset, length)`` ranges of block 0."""
    out = []
    for seg in kv.segments:
        ranges = seg.chunk_ranges(0)
        base = seg.tensor.data_ptr()
        out.append(
            {
                "base": base,
                "block_stride": seg.layout.block_stride_bytes,
                "ranges": [[addr - base, n] for addr, n in ranges],
            }
        )
    return out


def _descs(pattern: list[dict[str, Any]], num_blocks: int, dev: int) -> Any:
    """``int64 [num_blocks * R, 3]`` (address, length, device): row ``b * R + r`` is range ``r``
    of block ``b`` (segments in order). Built with numpy: a large cache has millions of ranges."""
    import numpy as np  # a dependency of nixl itself

    per_block = np.array(
        [(s["base"] + off, s["block_stride"], n) for s in pattern for off, n in s["ranges"]],
        dtype=np.int64,
    )  # [R, 3]: first address, block stride, length
    blocks = np.arange(num_blocks, dtype=np.int64)[:, None]  # [B, 1]
    out = np.empty((num_blocks, len(per_block), 3), dtype=np.int64)
    out[:, :, 0] = per_block[None, :, 0] + blocks * per_block[None, :, 1]
    out[:, :, 1] = per_block[None, :, 2]
    out[:, :, 2] = dev
    return out.reshape(-1, 3)


def _runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """``(local first, remote first, count)`` of the stretches where both sides' block ids go up
    by one."""
    out: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote, strict=True):
        if out:
            l0, r0, n = out[-1]
            if lb == l0 + n and rb == r0 + n:
                out[-1] = (l0, r0, n + 1)
                continue
        out.append((lb, rb, 1))
    return out


def _spans(pattern: list[dict[str, Any]]) -> bool:
    """Whether each range of a block fills its block stride, so the same range of consecutive
    blocks is one span of memory (a per-layer page-contiguous cache; not head-outer pages)."""
    return all(n == s["block_stride"] for s in pattern for _off, n in s["ranges"])


def _run_descs(
    pattern: list[dict[str, Any]], runs: list[tuple[int, int]], dev: int, num_blocks: int
) -> Any:
    """``int64 [len(runs) * R, 3]``: for each ``(first block, count)`` run and each range of the
    pattern, one descriptor over the run's blocks (:func:`_spans` must hold). A run outside
    ``[0, num_blocks)`` is refused: its span would reach past the registered cache."""
    import numpy as np

    for b0, n in runs:
        if b0 < 0 or n < 1 or b0 + n > num_blocks:
            raise ValueError(
                f"NIXL read run of blocks [{b0}, {b0 + n}) lies outside the cache's "
                f"num_blocks={num_blocks}; block ids must be in [0, {num_blocks})"
            )

    per = np.array(
        [(s["base"] + off, s["block_stride"], n) for s in pattern for off, n in s["ranges"]],
        dtype=np.int64,
    )  # [R, 3]
    first = np.array([b for b, _n in runs], dtype=np.int64)[:, None]
    count = np.array([n for _b, n in runs], dtype=np.int64)[:, None]
    out = np.empty((len(runs), len(per), 3), dtype=np.int64)
    out[:, :, 0] = per[None, :, 0] + first * per[None, :, 1]
    out[:, :, 1] = per[None, :, 2] * count
    out[:, :, 2] = dev
    return out.reshape(-1, 3)


@dataclass
class _Remote:
    agent: str
    handle: Any  # prepared remote descriptor list
    range_lens: list[int]  # byte length of each range of one block, row order
    hashes: tuple[str, ...]
    sock: socket.socket
    lock: threading.Lock
    staging: Any = None
    identity: tuple[Any, ...] = ()  # (engine id, hashes, model fingerprint), by the handshake
    pattern: list[dict[str, Any]] | None = None  # the producer's ranges (coalesced READs)
    dev: int = 0
    mem_type: str = "DRAM"
    num_blocks: int = 0  # the producer's (coalesced READs stay inside its cache)

    @property
    def ranges_per_block(self) -> int:
        return len(self.range_lens)

    @property
    def row_bytes(self) -> int:
        return sum(self.range_lens)


class NixlConnector(TransferConnector):
    """Producer and consumer of KV over NIXL; see the module docstring."""

    transport = "nixl"

    def __init__(
        self, config: NixlConfig, *, block_size: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        if not isinstance(config, NixlConfig):
            raise TypeError(f"config must be a NixlConfig, got {type(config).__name__}")
        if config.mode is not TransferMode.READ:
            raise ValueError(
                "NixlConfig.mode=write is not implemented yet; use mode='read' (decode pulls)"
            )
        super().__init__(config, block_size=block_size, tp_rank=tp_rank, tp_size=tp_size)
        self.config: NixlConfig = config
        self._agent: Any = None
        self._agent_lock = threading.Lock()
        self._mem_type = "DRAM"
        self._dev = 0

    def _setup_transport(self, kv: RegisteredKV) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise ImportError(
                "NixlConnector needs the nixl package: pip install 'kv-connectors[nixl]'"
            ) from exc
        self._mem_type = "VRAM" if kv.device.type == "cuda" else "DRAM"
        self._dev = (kv.device.index or 0) if kv.device.type == "cuda" else 0
        name = f"{self.config.engine_id}-{uuid.uuid4().hex[:12]}"
        self._agent = nixl_agent(
            name,
            nixl_agent_config(
                enable_prog_thread=self.config.progress_thread, backends=list(self.config.backends)
            ),
        )
        self._name = name
        regions = []
        for seg in kv.segments:
            t = seg.tensor
            start = t.storage_offset() * t.element_size()
            nbytes = t.untyped_storage().nbytes() - start
            regions.append((t.data_ptr(), nbytes, self._dev, ""))
        self._reg = self._agent.register_memory(regions, self._mem_type)
        self._pattern = _pattern(kv)
        self._range_lens = [int(n) for seg in self._pattern for _off, n in seg["ranges"]]
        self._ranges_per_block = len(self._range_lens)
        local = _descs(self._pattern, kv.num_blocks, self._dev)
        self._local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._agent.get_xfer_descs(local, self._mem_type)
        )
        # Converting pulls read producer rows into this buffer, then convert and scatter them.
        self._staging = torch.empty(self.config.staging_bytes, dtype=torch.uint8, device=kv.device)
        staging = [(self._staging.data_ptr(), self.config.staging_bytes, self._dev, "")]
        self._staging_reg = self._agent.register_memory(staging, self._mem_type)

    @staticmethod
    def _indices(block_ids: list[int], per_block: int) -> Any:
        """Descriptor indices ``b * per_block + r`` of ``block_ids``, as the int32 array NIXL
        takes (a Python list of every (block, range) pair cost ~1 ms per 16k descriptors on the
        pull thread, GIL held, for a per-layer cache of 32 layers and 512 blocks)."""
        import numpy as np  # a dependency of nixl itself

        ids = np.asarray(block_ids, dtype=np.int64)[:, None] * per_block
        out = (ids + np.arange(per_block, dtype=np.int64)[None, :]).reshape(-1)
        if out.size and int(out.max()) >= 2**31:
            raise ValueError(
                f"NIXL descriptor index {int(out.max())} (block x {per_block} ranges) exceeds "
                "int32, what NIXL's index lists hold; register fewer blocks per cache"
            )
        return out.astype(np.int32)

    # -- producer ------------------------------------------------------------------------------

    def _serve_session(self, sock: socket.socket) -> None:
        try:
            self._recv_hello(sock)
            with self._agent_lock:
                meta = self._agent.get_agent_metadata()
            send_msg(
                sock,
                {
                    **self._hello_reply(),
                    "agent_metadata": base64.b64encode(meta).decode(),
                    "pattern": self._pattern,
                    "num_blocks": self.kv.num_blocks,
                    "mem_type": self._mem_type,
                    "dev": self._dev,
                },
            )
            while True:
                try:
                    msg = recv_msg(sock)
                except (ConnectionError, OSError):
                    return
                if msg.get("op") == "pull":
                    self._serve_pull(sock, msg)
        except Exception as exc:
            log.warning("nixl session ended: %s: %s", type(exc).__name__, exc)

    def _serve_pull(self, sock: socket.socket, msg: dict[str, Any]) -> None:
        asked = msg.get("lease_s")
        lease = self.config.timeout_s
        if isinstance(asked, int | float) and not isinstance(asked, bool) and 0 < asked < lease:
            lease = float(asked)
        self._accept_pull(sock, str(msg["request_id"]), msg.get("block_ids"), lease_s=lease)

    def _poll(self) -> None:
        if self._agent is not None:
            with self._agent_lock:
                notifs = self._agent.get_new_notifs()
            for messages in notifs.values():
                for m in messages:
                    text = m.decode(errors="replace")
                    kind, _, rest = text.partition(":")
                    token, _, rid = rest.partition(":")
                    if not (token.isascii() and token.isdigit()):
                        continue
                    if kind == "kv-done":  # the last READ completed: the consumer has the bytes
                        self._mark_sent(rid, int(token))
                    elif kind == "kv-end":  # the pull failed with no READ in flight
                        self._end_pull(rid, int(token))
        super()._poll()

    # -- consumer ------------------------------------------------------------------------------

    def _plan(self, params: Any) -> RemotePlan:
        plan = super()._plan(params)
        row = self.producer_row_bytes(plan)
        if not plan.identity and self.config.staging_bytes // row < plan.merge:
            raise HandshakeRefused(
                f"converting needs {plan.merge} producer rows of {row} bytes in the staging buffer; "
                f"NixlConfig.staging_bytes={self.config.staging_bytes} is too small"
            )
        return plan

    def _open_peer(self, host: str, sock: socket.socket, reply: dict[str, Any]) -> _Remote:
        """Add the producer's agent and prepare its descriptor list (once per producer)."""
        with self._agent_lock:
            agent = self._agent.add_remote_agent(base64.b64decode(reply["agent_metadata"]))
            remote = _descs(reply["pattern"], int(reply["num_blocks"]), int(reply["dev"]))
            handle = self._agent.prep_xfer_dlist(
                agent, self._agent.get_xfer_descs(remote, reply["mem_type"])
            )
        lens = [int(n) for seg in reply["pattern"] for _off, n in seg["ranges"]]
        return _Remote(
            agent, handle, lens, tuple(reply["hashes"]), sock, threading.Lock(),
            pattern=reply["pattern"], dev=int(reply["dev"]), mem_type=reply["mem_type"],
            num_blocks=int(reply["num_blocks"]),
        )  # fmt: skip

    def _release_peer(self, rem: _Remote) -> None:
        with self._agent_lock, contextlib.suppress(Exception):
            self._agent.release_dlist_handle(rem.handle)
            if rem.staging is not None:
                self._agent.release_dlist_handle(rem.staging)
            self._agent.remove_remote_agent(rem.agent)

    def _pull_in(self, rem: _Remote, spec: LoadSpec, plan: RemotePlan) -> None:
        params = plan.params
        start = self._clock()  # before asking: this lease ends no later than the producer's
        ids, reply = self._ask_pull(rem.sock, params, lease_s=self.config.timeout_s)
        lease, token = reply.get("lease_s"), reply.get("pull")
        if not isinstance(lease, int | float) or isinstance(lease, bool) or lease <= 0:
            raise ConnectionError(f"producer granted no READ lease (lease_s={lease!r})")
        deadline = start + lease
        try:
            self._reads(rem, spec, plan, ids, deadline, f"{token}:{params.request_id}")
        except TimeoutError:
            raise  # a READ may still be in flight: the producer keeps the blocks to the lease's end
        except Exception:
            # No READ of this pull is in flight (each ended, failed or was never posted): tell the
            # producer, so it frees the blocks now rather than at the lease's end.
            with self._agent_lock, contextlib.suppress(Exception):
                self._agent.send_notif(rem.agent, f"kv-end:{token}:{params.request_id}".encode())
            raise

    def _reads(
        self,
        rem: _Remote,
        spec: LoadSpec,
        plan: RemotePlan,
        ids: list[int],
        deadline: float,
        pull: str,
    ) -> None:
        """The READs of one pull (``pull``: ``"<token>:<request id>"``), the last one notifying."""
        notif = f"kv-done:{pull}".encode()
        if plan.identity and rem.range_lens == self._range_lens:
            runs = _runs(list(spec.block_ids), ids)
            if (
                len(runs) < len(ids)
                and rem.pattern is not None
                and _spans(self._pattern)
                and _spans(rem.pattern)
            ):
                # consecutive blocks on both sides: one descriptor per run and range, not one
                # per block and range (on 2 x H200 an 8k-token request of a 16-layer per-layer
                # cache was 8k descriptors of 16 KiB and took 73-88 ms over CUDA IPC)
                local = _run_descs(
                    self._pattern, [(lb, n) for lb, _rb, n in runs], self._dev, self.kv.num_blocks
                )
                remote = _run_descs(
                    rem.pattern, [(rb, n) for _lb, rb, n in runs], rem.dev, rem.num_blocks
                )
                with self._agent_lock:
                    xfer = self._agent.initialize_xfer(
                        "READ",
                        self._agent.get_xfer_descs(local, self._mem_type),
                        self._agent.get_xfer_descs(remote, rem.mem_type),
                        rem.agent,
                        notif,
                    )
                    state = self._agent.transfer(xfer)
                self._wait_read(xfer, state, deadline)
                return
        remote_idx = self._indices(ids, rem.ranges_per_block)
        if plan.identity and rem.range_lens == self._range_lens:
            # same bytes in the same ranges: read straight into the cache blocks
            local_idx = self._indices(list(spec.block_ids), self._ranges_per_block)
            self._read(self._local, local_idx, rem.handle, remote_idx, notif, deadline)
            return
        # Converting: producer rows into the staging buffer, piece by piece, then convert+scatter.
        row = rem.row_bytes
        cap = self.config.staging_bytes // row
        step = cap - cap % plan.merge
        if rem.staging is None:
            rem.staging = self._prep_staging(rem, cap)
        local, done = list(spec.block_ids), 0
        r = rem.ranges_per_block
        for a in range(0, len(ids), step):
            k = min(step, len(ids) - a)
            last = a + k == len(ids)
            self._read(
                rem.staging,
                self._indices(list(range(k)), r),
                rem.handle,
                remote_idx[a * r : (a + k) * r],
                notif if last else b"",
                deadline,
            )
            rows = self._staging[: k * row].view(k, row)  # [k, producer row bytes]
            m = plan.convs[0].num_dst_blocks(k)
            self._apply_rows(rows, plan, local[done : done + m])
            self.kv.host_sync()  # the next piece overwrites the staging rows
            done += m

    def _prep_staging(self, rem: _Remote, rows: int) -> Any:
        """Local descriptors ``i * R + r``: staging row ``i``, range ``r`` of a producer block."""
        import numpy as np

        lens = np.array(rem.range_lens, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        base = self._staging.data_ptr() + np.arange(rows, dtype=np.int64)[:, None] * rem.row_bytes
        descs = np.empty((rows, len(lens), 3), dtype=np.int64)
        descs[:, :, 0] = base + starts[None, :]
        descs[:, :, 1] = lens[None, :]
        descs[:, :, 2] = self._dev
        with self._agent_lock:
            return self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self._agent.get_xfer_descs(descs.reshape(-1, 3), self._mem_type)
            )

    def _read(
        self,
        local: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        notif: bytes,
        deadline: float,
    ) -> None:
        """One READ, polled until done, failed or past ``deadline`` (the lease's end: a READ seen
        done only after it is refused, since the producer may have freed the blocks)."""
        with self._agent_lock:
            xfer = self._agent.make_prepped_xfer(
                "READ", local, local_idx, remote, remote_idx, notif
            )
            state = self._agent.transfer(xfer)
        self._wait_read(xfer, state, deadline)

    def _wait_read(self, xfer: Any, state: str, deadline: float) -> None:
        """Poll a posted READ until done, failed or past ``deadline`` (see :meth:`_read`); its
        handle is released either way."""
        try:
            while state not in ("DONE", "ERR"):
                if self._clock() > deadline:
                    raise TimeoutError(
                        f"NIXL READ exceeded its lease (timeout_s={self.config.timeout_s})"
                    )
                time.sleep(1e-4)
                with self._agent_lock:
                    state = self._agent.check_xfer_state(xfer)
            if state == "ERR":
                raise ConnectionError("NIXL READ failed (peer gone or memory unregistered)")
            if self._clock() > deadline:
                raise TimeoutError(
                    "NIXL READ completed after its lease ended: the producer may have freed the "
                    "blocks, so its bytes are not trusted"
                )
        finally:
            with self._agent_lock, contextlib.suppress(Exception):
                self._agent.release_xfer_handle(xfer)

    def close(self) -> None:
        super().close()  # drops the remote agents too
        if self._agent is not None:
            with self._agent_lock, contextlib.suppress(Exception):
                self._agent.release_dlist_handle(self._local)
                self._agent.deregister_memory(self._reg)
                self._agent.deregister_memory(self._staging_reg)
            self._agent = None
