"""CUDA graphs of the engine's decode-only steps.

A decode step of a small model is almost all host work: Python, the model's ops and one kernel
launch each, per layer. :class:`DecodeGraphs` records the whole forward pass of a decode-only batch
(every request feeding exactly one token), the backends' metadata build included, once per
*capture size* (powers of two up to ``max_num_seqs``, and ``max_num_seqs`` itself), and replays it:
a step then costs a few copies into the graph's input buffers and one launch.

What a captured step reads, and how a smaller batch fills it. A step of ``R`` requests runs the
graph of the smallest capture size ``B >= R``. Its static inputs are token ids and positions
``[B]``, ``query_start_loc = arange(B + 1)`` (fixed: every row is one token), and per KV group
``seq_lens [B]``, a block table ``[B, W]`` and slots ``[B]``. Rows ``R..B-1`` are padding: one
token at position 0 with slot ``-1`` (the cache write skips it) and ``seq_len`` 1, so it attends
to the first block id of its table row, a stale but valid id (the buffers start at block 0 and
only ever hold ids a step used), and its logits are never read. The metadata's host bounds are
baked in at capture: ``max_query_len = 1`` and ``max_seq_len = max_model_len`` (it only steers
a kernel's split heuristic, so any context that fits the table is served).

Which backends. Every group's backend must declare CUDA-graph support (kv-backends'
``cudagraph_support``, tested there by capture and replay) and its builder must build from device
tensors without a host sync; a model whose forward syncs (gpt-oss's expert loop) is not captured.
:meth:`DecodeGraphs.reason_unsupported` says why not, and the runner reports it. A step the graphs
cannot take (a prefill, more requests than the largest size, a wider block table) runs eagerly:
the same kernels, so the same results up to a split count chosen from another ``max_seq_len``.

Which matmul library. cuBLAS and cublasLt pick different kernels for the same skinny GEMM, and
neither wins every decode shape (H200, ``docs/benchmarks/gemm_h200.md``, Llama-3-8B at 64 rows:
MLP down 36.3 us under cuBLAS against 31.8 under cublasLt, lm_head 298.8 against 274.9; at 256
rows the down projection is faster under cuBLAS). torch reads its preferred library at every
matmul, so a graph keeps the one it was captured under. ``blas="auto"`` (the default; the
environment's ``KVSTACK_GRAPH_BLAS`` sets it for the engine) captures each size under torch's
default and under cublasLt, times 3 replays of each, and keeps the faster
(:attr:`DecodeGraphs.blas` records both times); ``"default"`` captures once under torch's
preference, ``"cublaslt"`` once under cublasLt. The library changes which kernels multiply, not
what they compute: the same products, summed in another order (bf16 logits may differ in the
last bit, as between two batch sizes).

``capture=False`` keeps every buffer and replays by calling the recorded function again: the CPU
tests use it to check the buffer filling and padding rules without a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from kv_backends import CommonAttentionMetadata, get_backend
from kv_backends.capabilities import CUDAGRAPH_NEVER

if TYPE_CHECKING:
    from kvstack.engine.runner import ModelRunner

__all__ = ["BLAS_CHOICES", "DecodeGraphs", "capture_sizes", "default_graph_blas"]

#: what ``DecodeGraphs(blas=...)`` takes (module docstring)
BLAS_CHOICES = ("auto", "default", "cublaslt")


def default_graph_blas() -> str:
    """``KVSTACK_GRAPH_BLAS`` (``auto`` when unset), checked against :data:`BLAS_CHOICES`."""
    value = os.environ.get("KVSTACK_GRAPH_BLAS", "auto").strip().lower()
    if value not in BLAS_CHOICES:
        raise ValueError(
            f"KVSTACK_GRAPH_BLAS={value!r} is not one of {BLAS_CHOICES}; unset it or pick one"
        )
    return value


@contextlib.contextmanager
def _blas_library(name: str | None) -> Iterator[None]:
    """torch's preferred BLAS library set to ``name`` inside (``None``: left as it is)."""
    if name is None:
        yield
        return
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(prev)


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """Powers of two below ``max_batch``, then ``max_batch`` itself: ``8 -> (1, 2, 4, 8)``,
    ``48 -> (1, 2, 4, 8, 16, 32, 48)``."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r} must be an int >= 1 (the largest decode batch)")
    sizes = []
    b = 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


def reason_unsupported(runner: ModelRunner) -> str | None:
    """Why ``runner``'s decode steps cannot be captured, or ``None`` when they can."""
    if runner.device.type != "cuda":
        return f"the runner is on {runner.device.type}, CUDA graphs need a CUDA device"
    for gid, name in runner.backends.items():
        if get_backend(name).CAPABILITIES.cudagraph_support == CUDAGRAPH_NEVER:
            return f"group {gid}'s backend {name} declares no CUDA-graph support"
    if runner.model.host_synced_moe:
        return (
            "a mixture-of-experts layer picks its experts on the host (a sync per step; the "
            "grouped, sync-free experts need torch._grouped_mm: CUDA sm_90+, bf16 / fp16)"
        )
    return None


@dataclass
class _Captured:
    step: Callable[[], torch.Tensor]
    logits: torch.Tensor  # [B, vocab] float32, rewritten by every replay
    graph: torch.cuda.CUDAGraph | None  # None: replay by calling ``step`` again (capture=False)

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self.step()


class DecodeGraphs:
    """Captured decode steps of one :class:`~kvstack.engine.runner.ModelRunner` (module docstring).

    ``max_batch``: the largest decode batch to capture (the engine's ``max_num_seqs``).
    :attr:`num_captures` / :attr:`num_replays` count what happened (tests and benchmarks read
    them: a step the graphs took is a replay).
    """

    def __init__(
        self, runner: ModelRunner, max_batch: int, *, capture: bool = True, blas: str = "auto"
    ) -> None:
        if blas not in BLAS_CHOICES:
            raise ValueError(f"blas={blas!r} is not one of {BLAS_CHOICES}")
        if capture:
            why = reason_unsupported(runner)
            if why is not None:
                raise ValueError(f"cannot capture CUDA graphs here: {why}")
        budget = runner.max_num_batched_tokens
        if isinstance(max_batch, int) and max_batch > budget:
            raise ValueError(
                f"max_batch={max_batch} exceeds the runner's max_num_batched_tokens={budget}: a "
                f"decode step of {max_batch} requests (one token each) cannot be built; pass "
                f"max_batch <= {budget} (the engine uses min(max_num_seqs, max_num_batched_tokens))"
            )
        self.runner = runner
        self.capture = capture
        self.sizes = capture_sizes(max_batch)
        dev, big = runner.device, self.sizes[-1]
        self._ids = torch.zeros(big, dtype=torch.int64, device=dev)
        self._pos = torch.zeros(big, dtype=torch.int64, device=dev)
        self._qsl = torch.arange(big + 1, dtype=torch.int32, device=dev)
        self._seq: list[torch.Tensor] = []
        self._slots: list[torch.Tensor] = []
        self._tables: list[torch.Tensor] = []  # made on the first step: its table widths
        self._graphs: dict[int, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        # The capture's own stream, on the runner's device: torch.cuda.graph's default capture
        # stream is one per process, made on whichever device was current at its first use, so
        # an engine on cuda:1 after one on cuda:0 captured on cuda:0's stream (an empty graph,
        # then Triton refusing cuda:1's pointers: the 2 x H200 device test).
        self._stream = torch.cuda.Stream(dev) if capture else None
        self.num_captures = 0
        self.num_replays = 0
        #: the matmul library each captured size kept, and (``blas="auto"``) the ms of 3
        #: replays under each library it tried: ``{size: {"picked": name, "ms": {name: ms}}}``
        self.blas: dict[int, dict[str, object]] = {}
        self._blas_mode = blas

    # -- when ------------------------------------------------------------------------------------

    def size_for(self, num_tokens: int, metadata: Sequence[CommonAttentionMetadata]) -> int | None:
        """The capture size that serves this step, or ``None`` (then it runs eagerly)."""
        if num_tokens == 0 or num_tokens > self.sizes[-1]:
            return None
        for gid, md in enumerate(metadata):
            # Pure decode: every request one token, no padding tokens.
            if md.max_query_len != 1 or md.num_reqs != num_tokens:
                return None
            if md.num_actual_tokens != num_tokens or md.slot_mapping.numel() < num_tokens:
                return None
            if self._tables and md.block_table.shape[1] > self._tables[gid].shape[1]:
                return None
        return next(b for b in self.sizes if b >= num_tokens)

    # -- running ---------------------------------------------------------------------------------

    def run(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Sequence[CommonAttentionMetadata],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Fill the buffers with this step (``size`` from :meth:`size_for`), replay, and return
        float32 logits ``[R, vocab]`` of rows ``logits_indices`` (a tensor of its own)."""
        if not self._tables:
            self._make_group_buffers(metadata)
        self._fill(size, input_ids, positions, metadata)
        step = self._graphs.get(size)
        if step is None:
            step = self._capture(size)
        step.replay()
        self.num_replays += 1
        return step.logits.index_select(0, logits_indices.to(step.logits.device))

    def _fill(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Sequence[CommonAttentionMetadata],
    ) -> None:
        """Copy the step into the buffers; rows past it become padding (module docstring)."""
        n = input_ids.numel()
        self._ids[:n].copy_(input_ids, non_blocking=True)
        self._ids[n:size].zero_()
        self._pos[:n].copy_(positions, non_blocking=True)
        self._pos[n:size].zero_()
        for gid, md in enumerate(metadata):
            self._seq[gid][:n].copy_(md.seq_lens)
            self._seq[gid][n:size].fill_(1)
            self._tables[gid][:n, : md.block_table.shape[1]].copy_(md.block_table)
            self._slots[gid][:n].copy_(md.slot_mapping[:n])
            self._slots[gid][n:size].fill_(-1)

    def _make_group_buffers(self, metadata: Sequence[CommonAttentionMetadata]) -> None:
        self._make_buffers([md.block_table.shape[1] for md in metadata])

    def _make_buffers(self, widths: Sequence[int]) -> None:
        dev, big = self.runner.device, self.sizes[-1]
        for width in widths:
            self._seq.append(torch.ones(big, dtype=torch.int32, device=dev))
            self._slots.append(torch.full((big,), -1, dtype=torch.int64, device=dev))
            self._tables.append(torch.zeros(big, width, dtype=torch.int32, device=dev))

    @torch.no_grad()
    def capture_all(self, table_widths: Sequence[int]) -> int:
        """Capture every size not captured yet, before the first request (the engine's start:
        :attr:`~kvstack.engine.runner.ModelRunner.startup_seconds` ``["graphs"]``), largest
        first, as vLLM does; returns how many were captured.

        ``table_widths``: each KV group's block-table width, the width the steps' tables have
        (the engine's ``BlockTables`` kernel tables). Every row is padding while nothing has
        been filled (token 0 at position 0, ``seq_len`` 1 over block 0, slot ``-1``: the cache
        write skips it), so the capture's own runs write nothing to the cache; a later step
        fills the buffers and replays. Without it a size is captured in the first step that
        needs it, inside a request's time to its next token."""
        if not self._tables:
            self._make_buffers(table_widths)
        elif [t.shape[1] for t in self._tables] != list(table_widths):
            raise ValueError(
                f"capture_all: table_widths={list(table_widths)} differ from the buffers' "
                f"{[t.shape[1] for t in self._tables]} made by an earlier step"
            )
        todo = [b for b in reversed(self.sizes) if b not in self._graphs]
        # No KV connector calls at startup: no step is under way (its per-layer save would have
        # no step's metadata), and a replay runs none of them (``before_replay`` waits instead).
        hooks, self.runner.kv_layer_hooks = self.runner.kv_layer_hooks, None
        try:
            for size in todo:
                self._capture(size)
        finally:
            self.runner.kv_layer_hooks = hooks
        return len(todo)

    def _metadata(self, size: int) -> list[CommonAttentionMetadata]:
        return [
            CommonAttentionMetadata(
                query_start_loc=self._qsl[: size + 1],
                seq_lens=self._seq[gid][:size],
                block_table=self._tables[gid][:size],
                slot_mapping=self._slots[gid][:size],
                max_query_len=1,
                max_seq_len=self.runner.max_model_len,
                num_actual_tokens=size,
            )
            for gid in range(len(self._tables))
        ]

    def _capture(self, size: int) -> _Captured:
        runner, metadata = self.runner, self._metadata(size)

        def step() -> torch.Tensor:
            hidden = runner.forward_hidden(self._ids[:size], self._pos[:size], metadata)
            return runner.model.compute_logits(hidden)  # [size, vocab]

        self.num_captures += 1
        if not self.capture:
            return self._graphs.setdefault(size, _Captured(step, step(), None))
        # (torch's enum prints as "_BlasBackend.Cublas")
        default = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()
        if self._blas_mode == "default" or (self._blas_mode == "auto" and default == "cublaslt"):
            tries: list[str | None] = [None]
        elif self._blas_mode == "cublaslt":
            tries = ["cublaslt"]
        else:
            tries = [None, "cublaslt"]
        kept: tuple[str, torch.cuda.CUDAGraph, torch.Tensor] | None = None
        times: dict[str, float] = {}  # (one library: nothing to time)
        for lib in tries:
            graph, logits = self._record(step, lib)
            name = lib or default
            if len(tries) > 1:
                times[name] = self._time(graph)
            if kept is None or times[name] < times[kept[0]]:
                if kept is not None:
                    kept[1].reset()  # the slower graph's memory back to the pool
                kept = (name, graph, logits)
            else:
                graph.reset()
        assert kept is not None
        self.blas[size] = {"picked": kept[0], "ms": times}
        return self._graphs.setdefault(size, _Captured(step, kept[2], kept[1]))

    def _record(
        self, step: Callable[[], torch.Tensor], lib: str | None
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """``step`` captured under matmul library ``lib`` (``None``: torch's preference)."""
        # Warm up on a side stream (kernel compiles, per-device parameters), then record.
        side = self._stream
        assert side is not None
        with _blas_library(lib):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=side):
                logits = step()
        return graph, logits

    def _time(self, graph: torch.cuda.CUDAGraph, reps: int = 3) -> float:
        """ms of ``reps`` replays of ``graph`` after one (CUDA events on the capture stream).
        The replays run what the buffers hold: at startup every row is padding (no cache write,
        one-token attention), so the matmuls, the part the library changes, are most of it; in
        a step that captures lazily, that step's own inputs (the same writes again)."""
        side = self._stream
        assert side is not None
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(side)
            for _ in range(reps):
                graph.replay()
            end.record(side)
        end.synchronize()
        torch.cuda.current_stream().wait_stream(side)
        return float(start.elapsed_time(end))
