"""Prefill rows of an MLA latent cache as ordinary attention over decompressed K/V (issue 29).

Why. The absorbed form (:mod:`kvstack.engine.mla`) costs ``H x (rank + rope + rank)``
multiply-adds a (query, key) pair, 1088 a head in DeepSeek-V3 (512 + 64 + 512), against ``H x
(nope + rope + v)`` = 320 over decompressed K/V. A decode row reads each latent row once and is
bound by memory, so it stays absorbed. A prefill has many queries per key: decompressing each
key once (``kv_b_proj``: ``2 x rank x H x (nope + v)`` FLOPs a key) and attending with head 192 /
V 128 does 3.4x fewer FLOPs a pair -- what vLLM's MLA backend does.

A mixed or prefill step, per MLA layer (:class:`MLAStep`, made by ``ModelRunner.forward_hidden``
for a step where some request has ``query_len > 1``):

1. every row's latent is written to the cache once (the impl's ``do_kv_cache_update``, as always);
2. decode rows (``query_len == 1``) are attended absorbed by the layer's backend (TRITON_MLA on a
   GPU, TORCH_SDPA on the CPU) over a sub-batch of the decode requests;
3. prefill rows: each request's whole context latent (prefix-cache hits and earlier chunks
   included: they are only in the cache) is gathered from the paged cache and decompressed into
   a scratch *workspace* laid out as a paged K/V cache (kv-spec's ``FullAttentionSpec`` with
   ``head_size = nope + rope``, ``head_size_v = v``: the DiffKV head pair; pages of
   :data:`WORKSPACE_BLOCK` consecutive tokens, one block-table row per request), the shared
   rotated rope key appended to every head's K; then kv-kernels' ``paged_attention`` of the
   un-absorbed queries ``[new, H, nope + rope]``, causal with ``query_len <= seq_len`` (Triton on
   a GPU -- 16-bit 192 / 128 is a head pair the sm_90 Gluon prefill kernel serves -- the torch
   reference on the CPU). ``paged_attention`` and not a kv-backends backend: a backend instance
   is bound to one cache layout and one selection, the workspace changes size every step, and
   the kernel's contract (any strides, ``head_size_v != head_size``, LSE) is all this needs;
4. both go back in row order, ``[T, H, v]``.

The latent cache stays the only KV state; the workspace lives for one step and is bounded
(``workspace_tokens``). A request whose context does not fit is attended in pieces: its last
``workspace_tokens`` keys causally (they hold its new tokens), the earlier ones by non-causal
passes (every earlier key precedes every query), merged by their log-sum-exps
(``merge_attn_states``), as vLLM's chunked context is. Requests are packed into as few passes
as fit.

Host and device. The plan (rows, pieces, gather positions, workspace block tables) is built on
the host from the metadata's host copies of ``query_start_loc`` and ``seq_lens`` (which
``BlockTables.build_common_metadata`` gives: no device read), once per step and KV group, and
sent in two non-blocking copies from pinned memory (int64 indices, int32 kernel tables). The
slots of the gathered rows are computed on the device from the step's block table. Pure-decode
steps never come here: they keep the absorbed path that CUDA graphs capture.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from kv_backends import CommonAttentionMetadata
from kv_kernels.paged_attention import merge_attn_states, paged_attention
from kv_spec import FullAttentionSpec, KVCacheLayout

from kvstack.engine.mla import MLAAttention, MLAParts

if TYPE_CHECKING:
    from kvstack.engine.runner import LayerBinding, ModelRunner

__all__ = [
    "DEFAULT_WORKSPACE_TOKENS",
    "WORKSPACE_BLOCK",
    "MLAPrefill",
    "MLAPrefillStats",
    "MLAStep",
    "Pass",
    "Piece",
    "attend_split",
    "context_slots",
    "fill_workspace",
    "plan_passes",
]

#: Tokens a workspace page: whole 128-token tiles, which the sm_90 prefill kernel loads by TMA.
WORKSPACE_BLOCK = 128
#: Default workspace bound, in tokens: DeepSeek-V3's 128 heads x (192 + 128) in bf16 are 80 KiB a
#: token, so 2.5 GiB, plus the gathered latent and ``kv_b_proj``'s output while it is filled.
DEFAULT_WORKSPACE_TOKENS = 32 * 1024

_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class Piece:
    """Keys ``[start, stop)`` of the context of the step's request ``req`` (its metadata row),
    attended by all of that request's queries."""

    req: int
    start: int
    stop: int


@dataclass(frozen=True)
class Pass:
    """One ``paged_attention`` call over the workspace: ``pieces`` side by side, each request at
    most once; ``causal`` pieces end at the request's last token, the others before its first
    new one."""

    causal: bool
    pieces: tuple[Piece, ...]


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def plan_passes(
    query_lens: Sequence[int], seq_lens: Sequence[int], *, block: int, capacity: int
) -> list[Pass]:
    """The workspace passes of a step's prefill requests (``query_len > 1``), in request order.

    A request whose context fits in ``capacity`` tokens (rounded up to whole ``block`` pages) is
    one causal piece ``[0, seq_len)``. Else its last ``capacity`` keys are a causal piece and the
    earlier ones non-causal pieces of at most ``capacity`` keys. Pieces are packed greedily into
    passes of at most ``capacity // block`` pages, causal and non-causal apart.
    """
    if len(query_lens) != len(seq_lens):
        raise ValueError(
            f"plan_passes: {len(query_lens)} query_lens and {len(seq_lens)} seq_lens; one each "
            "per request"
        )
    causal: list[Piece] = []
    earlier: list[Piece] = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if q <= 1:
            continue
        if q > capacity or q > s:
            raise ValueError(
                f"request {r}: query_len={q} must be <= seq_len={s} and <= the MLA prefill "
                f"workspace of {capacity} tokens (raise workspace_tokens to at least "
                "max_num_batched_tokens)"
            )
        tail = 0 if _blocks(s, block) * block <= capacity else s - capacity
        causal.append(Piece(r, tail, s))
        earlier += [Piece(r, a, min(a + capacity, tail)) for a in range(0, tail, capacity)]
    return _pack(causal, True, block, capacity) + _pack(earlier, False, block, capacity)


def _pack(pieces: list[Piece], causal: bool, block: int, capacity: int) -> list[Pass]:
    passes: list[Pass] = []
    current: list[Piece] = []
    used, limit = 0, capacity // block
    for p in pieces:
        n = _blocks(p.stop - p.start, block)
        if current and used + n > limit:
            passes.append(Pass(causal, tuple(current)))
            current, used = [], 0
        current.append(p)
        used += n
    if current:
        passes.append(Pass(causal, tuple(current)))
    # (pieces of one request but its last fill a pass: a pass never holds a request twice)
    assert all(len({p.req for p in x.pieces}) == len(x.pieces) for x in passes)
    return passes


@dataclass
class MLAPrefillStats:
    """What the decompressed prefill served (host counters)."""

    steps: int = 0  # steps (and KV groups) with prefill rows
    rows: int = 0  # prefill query rows attended over decompressed K/V
    passes: int = 0  # workspace attention calls a layer made, summed over steps
    split_requests: int = 0  # requests whose context took more than one pass
    cached_keys: int = 0  # context keys read from the cache besides the step's new tokens
    decode_rows: int = 0  # decode rows attended absorbed beside them (mixed steps)


class MLAPrefill:
    """A runner's decompressed MLA prefill: the workspace bound, counters, and :meth:`step`.

    ``max_query_len``: the most new tokens a request brings to a step (the runner's
    ``max_num_batched_tokens``); ``workspace_tokens`` (default :data:`DEFAULT_WORKSPACE_TOKENS`,
    at least ``max_query_len``): the workspace bound, a multiple of ``block`` (the workspace's
    page, :data:`WORKSPACE_BLOCK`)."""

    def __init__(
        self, *, max_query_len: int, workspace_tokens: int | None = None,
        block: int = WORKSPACE_BLOCK,
    ) -> None:  # fmt: skip
        for name, v in (("max_query_len", max_query_len), ("block", block)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"MLAPrefill: {name}={v!r} is a {type(v).__name__}; give an int")
            if v <= 0:
                raise ValueError(f"MLAPrefill: {name}={v} must be a positive int (tokens)")
        need = _blocks(max_query_len, block) * block
        if workspace_tokens is None:
            workspace_tokens = max(DEFAULT_WORKSPACE_TOKENS, need)
        if isinstance(workspace_tokens, bool) or not isinstance(workspace_tokens, int):
            raise TypeError(
                f"MLAPrefill: workspace_tokens={workspace_tokens!r} is a "
                f"{type(workspace_tokens).__name__}; give an int (tokens)"
            )
        if workspace_tokens < need or workspace_tokens % block:
            raise ValueError(
                f"MLAPrefill: workspace_tokens={workspace_tokens} must be a multiple of the "
                f"workspace page block={block} and >= {need} (max_query_len={max_query_len} "
                f"rounded up to whole pages: a request's new tokens are attended in one pass); "
                f"give {max(need, _blocks(workspace_tokens, block) * block)}"
            )
        self.block = block
        self.workspace_tokens = workspace_tokens
        self.stats = MLAPrefillStats()
        self._layouts: dict[tuple[Any, ...], KVCacheLayout] = {}

    def describe(self) -> str:
        return (
            "prefill rows (query_len > 1) attend decompressed K/V per head over a step "
            f"workspace of <= {self.workspace_tokens} tokens in pages of {self.block} "
            "(kv_kernels.paged_attention); decode rows absorbed"
        )

    def step(self, runner: ModelRunner, metadata: Sequence[CommonAttentionMetadata]) -> MLAStep:
        """The MLA layers' split for one step of ``runner`` over ``metadata`` (one per group)."""
        return MLAStep(self, runner, metadata)

    def warmup(self, attn: MLAAttention, dtype: torch.dtype, device: torch.device,
               max_seq_len: int, scale: float) -> dict[str, float]:  # fmt: skip
        """Build the workspace attention's kernels before the first request: the prefill and
        decode classes (a chunk of a few tokens), one and several pieces, and both kinds of
        block-table width, over contexts up to ``max_seq_len`` (``kv_kernels.warmup``; every
        call reads one scratch page, and ``num_blocks`` is no specialization, so one page
        serves). Seconds per launch; ``{}`` off CUDA (nothing compiles there)."""
        if device.type != "cuda":
            return {}
        from kv_kernels.cache import allocate_kv_cache, layer_view
        from kv_kernels.warmup import warm_paged_ops

        layout, kwargs = self.warmup_args(attn, dtype, max_seq_len, scale)
        view = layer_view(allocate_kv_cache(layout, device), layout, 0)
        return warm_paged_ops(view, layout, q_dtype=dtype, **kwargs)

    def warmup_args(
        self, attn: MLAAttention, dtype: torch.dtype, max_seq_len: int, scale: float
    ) -> tuple[KVCacheLayout, dict[str, Any]]:
        """The one-page workspace layout and ``warm_paged_ops``' keywords of :meth:`warmup`:
        the workspace attention's own options (:func:`attend_split`'s call)."""
        kwargs = dict(
            num_q_heads=attn.num_q_heads, max_seq_len=min(max_seq_len, self.workspace_tokens),
            scale=scale, causal=True,
        )  # fmt: skip
        return self.layout(1, attn, dtype), kwargs

    def layout(self, blocks: int, attn: MLAAttention, dtype: torch.dtype) -> KVCacheLayout:
        """The workspace layout of ``blocks`` pages (kept per shape: a step's host work else)."""
        key = (blocks, attn.num_q_heads, attn.head_dim, attn.v_head_dim, dtype)
        lay = self._layouts.get(key)
        if lay is None:
            spec = FullAttentionSpec(
                block_size=self.block, num_kv_heads=attn.num_q_heads, head_size=attn.head_dim,
                head_size_v=attn.v_head_dim, dtype=_NAMES[dtype],
            )  # fmt: skip
            lay = self._layouts[key] = KVCacheLayout.from_spec(spec, num_blocks=blocks)
        return lay


@dataclass(frozen=True)
class _DevicePass:
    causal: bool
    q_rows: torch.Tensor | None  # int64 [nq] step rows of the pass's queries (None: all, in order)
    blk: torch.Tensor  # int64 [n] manager block of each gathered latent row
    off: torch.Tensor  # int64 [n] its row in the block
    dst: torch.Tensor  # int64 [n] its workspace row
    block_table: torch.Tensor  # int32 [pieces, pages] workspace pages of each piece
    seq_lens: torch.Tensor  # int32 [pieces] keys of each piece
    query_start_loc: torch.Tensor  # int32 [pieces + 1]
    max_query_len: int
    max_seq_len: int


@dataclass(frozen=True)
class _GroupPlan:
    decode_rows: torch.Tensor | None  # int64 [nd] step rows of the decode requests
    decode_md: Any  # the backend's metadata of the decode sub-batch
    passes: list[_DevicePass]
    merged: bool  # some request split over passes: outputs merged by their LSEs
    zeroed: bool  # rows no request owns (padding), or merging: the output starts at zero
    workspace: torch.Tensor  # [pages * block, H, nope + rope + v]
    view: torch.Tensor  # [pages, H, block, C] the same memory as paged_attention reads it
    layout: KVCacheLayout


def _ranges(starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(segment, offset)`` of every element of the ranges ``[starts[k], starts[k] + lens[k])``
    laid end to end (int64, host). numpy, as all of a step's per-token host arithmetic: torch's
    CPU index and repeat_interleave enter its OpenMP pool at these sizes (kv-blocktable's
    ``StepInputs.from_lengths`` says what that cost on the H200 host)."""
    seg = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
    first = np.cumsum(lens) - lens
    off = np.arange(int(lens.sum()), dtype=np.int64) - first[seg]
    return seg, off


def context_slots(
    block_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, kernel_block: int
) -> torch.Tensor:
    """int64 cache slots of positions ``pos`` of the step's requests ``req`` (both int64 ``[n]``)
    through the step's kernel ``block_table`` ``[R, blocks]``: ``kernel block * kbs + pos % kbs``,
    the same token index as in the manager blocks the layer view has."""
    blocks = block_table[req, pos // kernel_block].long()
    return blocks * kernel_block + pos % kernel_block


def fill_workspace(
    ws: torch.Tensor, dst: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor
) -> None:
    """Write decompressed rows into the workspace ``ws`` ``[rows, H, nope + rope + v]`` at rows
    ``dst`` ``[n]``: K = each head's ``k_nope`` ``[n, H, nope]`` then the shared rotated rope key
    ``k_pe`` ``[n, 1, rope]`` (every head the same), V = ``v`` ``[n, H, v]``."""
    nope, hd = k_nope.shape[-1], k_nope.shape[-1] + k_pe.shape[-1]
    ws[:, :, :nope].index_copy_(0, dst, k_nope)
    ws[:, :, nope:hd].index_copy_(0, dst, k_pe.expand(-1, ws.shape[1], -1))
    ws[:, :, hd:].index_copy_(0, dst, v)


def _to_device(
    parts: list[np.ndarray], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Host arrays on ``device`` in ``dtype`` (int32 / int64; the values fit: positions, rows and
    page numbers of one step), written into one host buffer by numpy: on CUDA a pinned one and
    one non-blocking copy (a pageable copy would wait for the stream, see
    ``engine/_staging.py``).

    Each part starts 16-byte aligned: Triton specializes a pointer argument on it, and the
    warmup's tensors are aligned, so a part at an odd offset compiled a new attention variant
    inside serving (DeepSeek-V3's prefill steps on the H200: seconds, steps 1, 3 and 9)."""
    align = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    offsets, total = [], 0
    for p in parts:
        offsets.append(total)
        total += -(-p.size // align) * align
    cuda = device.type == "cuda"
    host = torch.empty(total, dtype=dtype, pin_memory=cuda)
    buf = host.numpy()
    for o, p in zip(offsets, parts, strict=True):
        buf[o : o + p.size] = p.reshape(-1)
    dev = host.to(device, non_blocking=True) if cuda else host  # (the pinned block is kept
    # until the copy ran)
    return [dev[o : o + p.size].view(p.shape) for o, p in zip(offsets, parts, strict=True)]


class MLAStep:
    """One step's :data:`~kvstack.engine.mla.MLASplitFn`: called by every MLA layer with its
    latent parts, returns ``[T, H, v]`` (module docstring). The plan of each KV group is made at
    its first layer and shared by the rest."""

    def __init__(
        self, prefill: MLAPrefill, runner: ModelRunner, metadata: Sequence[CommonAttentionMetadata]
    ) -> None:
        self.prefill = prefill
        self.runner = runner
        self.metadata = metadata
        self._plans: dict[int, _GroupPlan] = {}

    def __call__(self, i: int, attn: MLAAttention, parts: MLAParts) -> torch.Tensor:
        b = self.runner.layers[i]
        plan = self._plans.get(b.group_id)
        if plan is None:
            plan = self._plans[b.group_id] = self._plan(b, attn, parts)
        hooks = self.runner.kv_layer_hooks
        if hooks is not None:  # this layer's loaded KV is in place before it is read
            hooks.before_attention(b.layer_slot)
        md = self.metadata[b.group_id]
        b.impl.do_kv_cache_update(None, parts.row, None, b.kv_cache, md.slot_mapping)
        out = attend_split(plan, b, attn, parts, scale=self.runner.model.scale)
        if hooks is not None:  # this layer's new KV is written: it may be saved
            hooks.after_attention(b.layer_slot)
        return out

    def _plan(self, b: LayerBinding, attn: MLAAttention, parts: MLAParts) -> _GroupPlan:
        prefill, g = self.prefill, b.group_id
        md = self.metadata[g]
        block, device = prefill.block, parts.row.device
        qsl = md.host_query_start_loc().tolist()  # host copies: no device read
        seq = md.host_seq_lens().tolist()
        qlens = [b1 - a for a, b1 in itertools.pairwise(qsl)]
        passes = plan_passes(qlens, seq, block=block, capacity=prefill.workspace_tokens)
        num_rows = parts.row.shape[0]
        decode = [r for r, q in enumerate(qlens) if q == 1]

        def arr(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64)

        longs = [arr(decode), arr([qsl[r] for r in decode])]
        ints = [np.arange(len(decode) + 1, dtype=np.int64)]
        host: list[tuple[bool, int, int, bool]] = []
        pieces_of: dict[int, int] = {}
        max_pages = 1
        for p in passes:
            req = arr([x.req for x in p.pieces])
            start = arr([x.start for x in p.pieces])
            n = arr([x.stop - x.start for x in p.pieces])
            q_start = arr([qsl[x.req] for x in p.pieces])
            q_len = arr([qlens[x.req] for x in p.pieces])
            n_pages = (n + block - 1) // block
            base = np.cumsum(n_pages) - n_pages
            max_pages = max(max_pages, int(n_pages.sum()))
            seg, within = _ranges(start, n)
            qseg, qoff = _ranges(q_start, q_len)
            q_rows = q_start[qseg] + qoff
            col = np.arange(int(n_pages.max()), dtype=np.int64)
            table = np.where(col[None] < n_pages[:, None], base[:, None] + col[None], 0)
            longs += [q_rows, req[seg], start[seg] + within, base[seg] * block + within]
            ints += [table, n, np.concatenate([arr([0]), np.cumsum(q_len)])]
            whole = q_rows.size == num_rows and bool((q_rows == np.arange(num_rows)).all())
            host.append((p.causal, int(q_len.max()), int(n.max()), whole))
            for x in p.pieces:
                pieces_of[x.req] = pieces_of.get(x.req, 0) + 1
        dev_longs = _to_device(longs, torch.int64, device)
        dev_ints = _to_device(ints, torch.int32, device)
        kbs = self.runner.kernel_block_sizes[g]
        n_block = b.kv_cache.shape[2]  # the layer view's (manager) block
        dev_passes = []
        for k, (causal, max_q, max_s, whole) in enumerate(host):
            rows_d, src_req, src_pos, dst = dev_longs[2 + 4 * k : 6 + 4 * k]
            table_d, n_d, qsl_p = dev_ints[1 + 3 * k : 4 + 3 * k]
            slots = context_slots(md.block_table, src_req, src_pos, kbs)
            rows = None if whole else rows_d
            blk, off = slots // n_block, slots % n_block
            dev_passes.append(
                _DevicePass(causal, rows, blk, off, dst, table_d, n_d, qsl_p, max_q, max_s)
            )
        decode_rows, decode_md = None, None
        if decode:
            dec_req, decode_rows = dev_longs[0], dev_longs[1]
            seq_cpu = md.host_seq_lens()[torch.tensor(decode)].to(torch.int32)
            sub = CommonAttentionMetadata(
                query_start_loc=dev_ints[0], seq_lens=md.seq_lens.index_select(0, dec_req),
                block_table=md.block_table.index_select(0, dec_req),
                slot_mapping=md.slot_mapping.index_select(0, decode_rows), max_query_len=1,
                max_seq_len=max(seq[r] for r in decode), num_actual_tokens=len(decode),
                query_start_loc_cpu=torch.arange(len(decode) + 1, dtype=torch.int32),
                seq_lens_cpu=seq_cpu,
            )  # fmt: skip
            decode_md = self.runner.builders[g].build(sub)
        # pages rounded up to a power of two (within the bound): few distinct layouts to keep
        pages = min(1 << (max_pages - 1).bit_length(), prefill.workspace_tokens // block)
        dtype = parts.q_pe.dtype
        layout = prefill.layout(pages, attn, dtype)
        width = attn.head_dim + attn.v_head_dim
        ws = torch.empty(pages * block, attn.num_q_heads, width, dtype=dtype, device=device)
        view = ws.view(pages, block, attn.num_q_heads, width).permute(0, 2, 1, 3)
        merged = any(c > 1 for c in pieces_of.values())
        stats = prefill.stats
        stats.steps += 1
        stats.rows += sum(qlens[r] for r in pieces_of)
        stats.passes += len(passes)
        stats.split_requests += sum(c > 1 for c in pieces_of.values())
        stats.cached_keys += sum(seq[r] - qlens[r] for r in pieces_of)
        stats.decode_rows += len(decode)
        zeroed = merged or sum(qlens) < num_rows
        return _GroupPlan(decode_rows, decode_md, dev_passes, merged, zeroed, ws, view, layout)


def attend_split(
    plan: _GroupPlan, b: LayerBinding, attn: MLAAttention, parts: MLAParts, *, scale: float
) -> torch.Tensor:
    """Layer ``b``'s output ``[T, H, v]`` over its cache, the step's rows already written:
    decode rows absorbed by the layer's impl, prefill rows over the decompressed workspace."""
    q_nope, q_pe = parts.q_nope, parts.q_pe  # [T, H, nope], [T, H, rope]
    shape = (q_pe.shape[0], attn.num_q_heads, attn.v_head_dim)
    out = (torch.zeros if plan.zeroed else torch.empty)(shape, dtype=q_pe.dtype, device=q_pe.device)
    if plan.decode_rows is not None:
        rows = plan.decode_rows
        q = attn.absorb_query(q_nope.index_select(0, rows), q_pe.index_select(0, rows))
        o_latent = b.impl.forward(None, q, b.kv_cache, plan.decode_md)  # [nd, H, rank]
        out.index_copy_(0, rows, attn.absorb_out(o_latent))
    lse = None
    if plan.merged:  # (a row no pass has reached yet weighs nothing in the merge)
        lse = torch.full(shape[:2], float("-inf"), dtype=torch.float32, device=q_pe.device)
    latent = b.kv_cache[:, 0]  # [B, N, rank + rope]: the one latent "head"
    # an fp8 latent is stored as x / k_scale (its one per-tensor scale): read back as x
    k_scale = b.impl.scales(None, q_pe.device)[0] if latent.dtype != q_pe.dtype else None
    for p in plan.passes:
        rows = latent[p.blk, p.off]  # [n, rank + rope] the pieces' context, new tokens included
        if latent.dtype != q_pe.dtype:
            # (never None: the impl's cache write refuses an fp8 cache without a k_scale first)
            assert k_scale is not None
            rows = rows.float() * k_scale
            rows = rows.to(q_pe.dtype)
        k_nope, v = attn.decompress(rows[:, : attn.rank])  # [n, H, nope], [n, H, v]
        fill_workspace(plan.workspace, p.dst, k_nope, rows[:, None, attn.rank :], v)
        if p.q_rows is None:
            q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, nope + rope]
        else:
            q = torch.cat([q_nope.index_select(0, p.q_rows), q_pe.index_select(0, p.q_rows)], -1)
        res = paged_attention(
            q, plan.view, plan.layout, p.block_table, p.seq_lens, p.query_start_loc,
            p.max_query_len, max_seq_len=p.max_seq_len, scale=scale, causal=p.causal,
            return_lse=lse is not None,
        )  # fmt: skip
        if lse is None:
            assert isinstance(res, torch.Tensor)
            if p.q_rows is None:
                out = res  # (no decode rows, no padding: every row is this pass's)
            else:
                out.index_copy_(0, p.q_rows, res)
            continue
        assert isinstance(res, tuple)
        if p.q_rows is None:
            out, lse = merge_attn_states(out, lse, *res)
        else:
            merged, m_lse = merge_attn_states(
                out.index_select(0, p.q_rows), lse.index_select(0, p.q_rows), *res
            )
            out.index_copy_(0, p.q_rows, merged)
            lse.index_copy_(0, p.q_rows, m_lse)
    return out
