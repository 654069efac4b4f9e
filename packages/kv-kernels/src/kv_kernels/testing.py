"""The attention oracle, the tolerance rule and the planted-bug helpers every kernel and backend
test shares.

**Attention semantics** (the one definition; every backend, kernel and test agrees with it):

- *Positions.* Request ``r`` has ``seq_lens[r] = L`` tokens of context, its new tokens included;
  its ``q_len`` query tokens sit at the last ``q_len`` positions, so query ``i`` is at position
  ``p = L - q_len + i``. ``q_len > L`` is an input error (there is no position for the extra rows).
- *Visibility* of key position ``k`` to a query at ``p``:

  - causal: ``k <= p``;
  - sliding window ``w`` on a causal layer: also ``p - w < k`` (the window counts the query itself,
    so ``w = 1`` sees only the diagonal);
  - sliding window ``w`` on a non-causal layer: ``|p - k| < w`` (the window bounds both sides);
  - chunked-local attention with chunk ``c``: ``k // c == p // c`` and causal;
  - none of these: every key ``0 <= k < L``.

- *Logits.* ``s = scale * (q . k)`` (``scale`` defaults to ``1 / sqrt(head_size)``); with softcap
  ``c > 0``: ``s = c * tanh(s / c)`` (scale first, then the cap); with ALiBi:
  ``s += slope[h] * (k - p)`` after the cap; masked keys get ``-inf``.
- *Sinks.* One learned logit per query head joins the softmax denominator only:
  ``o = sum_k exp(s_k) v_k / (sum_k exp(s_k) + exp(sink))``; the sink carries no value.
- *LSE.* ``log(sum_k exp(s_k) [+ exp(sink)])`` in natural log. A row that sees no key has output 0
  and LSE ``-inf`` (or its sink logit).
- *GQA.* Query head ``h`` reads kv head ``h // (Hq // H)``.
- *head_size_v != head_size.* V has its own width; the output has ``head_size_v`` columns.
- *fp8 per-tensor (or per-kv-head) scales.* The cache stores ``x / scale``; a reader multiplies the
  stored value by the scale before the dot product (``attention_oracle_paged`` does this).

:func:`attention_oracle` computes exactly this in float64 over plain per-request K/V, independent of
any paging; :func:`attention_oracle_paged` first reads each request's K/V out of a cache through its
block table (use it when the test has no dense K/V of its own — it cannot see a block-table bug).

**Tolerance.** :func:`check_close_to_oracle` / :func:`assert_close_to_oracle` implement the
flash-attention parity rule, per output row ``(token, head)``::

    err_kernel <= rtol * err_lowprec + atol * max|oracle_row| + abs_floor

where ``err_lowprec`` is the error of a torch run in the kernel's dtype (when given). The bound
scales with each row's own magnitude, so a long-context decode row (values ~0.01) is held to ~0.01
of its size, not to a fixed ``atol = 2e-2`` larger than the row itself.

**Planted bugs.** :func:`plant_wrong_page` and :func:`drop_last_page` make the two paging bugs the
tolerance must catch, for negative tests.

**Builders** live beside this module, which they import (so it cannot re-export them):
:mod:`kv_kernels.testing_attention` (paged-attention batches over a nan-poisoned cache filled from
dense K/V, the oracle over that K/V, the feature table) and :mod:`kv_kernels.testing_cache`
(small layouts, random-byte storages, slot mappings, the write oracle, hard-to-quantize rows).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kv_spec import KVCacheLayout, KVQuantMode

__all__ = [
    "TOLERANCES",
    "OracleCheck",
    "Tolerance",
    "assert_close_to_oracle",
    "attention_lowprec",
    "attention_oracle",
    "attention_oracle_paged",
    "check_close_to_oracle",
    "drop_last_page",
    "gather_kv_per_request",
    "plant_wrong_page",
]


# ---- the oracle ----------------------------------------------------------------------------------


def _visible(
    q_pos: torch.Tensor,  # [q_len, 1]
    k_pos: torch.Tensor,  # [1, L]
    *,
    causal: bool,
    sliding_window: int | None,
    chunk_size: int | None,
) -> torch.Tensor:  # [q_len, L] bool
    vis = torch.ones(q_pos.shape[0], k_pos.shape[1], dtype=torch.bool)
    if causal or chunk_size is not None:
        vis &= k_pos <= q_pos
    if sliding_window is not None:
        if causal:
            vis &= k_pos > q_pos - sliding_window
        else:
            vis &= (q_pos - k_pos).abs() < sliding_window
    if chunk_size is not None:
        vis &= (k_pos // chunk_size) == (q_pos // chunk_size)
    return vis


def _masked_logits(
    qs: torch.Tensor,  # [Hq, q_len, D]: one request's queries
    k: torch.Tensor,  # [L, H, D] in qs's dtype and device
    v: torch.Tensor,  # [L, H, Dv]
    *,
    scale: float,
    softcap: float,
    alibi_slopes: torch.Tensor | None,  # [Hq] on qs's device
    causal: bool,
    sliding_window: int | None,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's logits ``[Hq, q_len, L]`` by the module's semantics (scale, softcap, ALiBi,
    ``-inf`` where a key is not visible), computed in ``qs``'s dtype, and its V per q head
    ``[Hq, L, Dv]``: the part :func:`attention_oracle` (float64) and :func:`attention_lowprec`
    (the input dtype) share. The query tokens are the last ``q_len`` of the sequence."""
    q_len, seq_len = qs.shape[1], k.shape[0]
    group = qs.shape[0] // k.shape[1]
    kh = k.transpose(0, 1).repeat_interleave(group, 0)  # [Hq, L, D]
    vh = v.transpose(0, 1).repeat_interleave(group, 0)  # [Hq, L, Dv]
    s = (qs @ kh.transpose(1, 2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]  # [q_len, 1]
    k_pos = torch.arange(seq_len)[None, :]  # [1, L]
    if alibi_slopes is not None:
        bias = alibi_slopes[:, None, None] * (k_pos - q_pos).to(alibi_slopes.device)
        s = s + bias.to(s.dtype)
    vis = _visible(
        q_pos, k_pos, causal=causal, sliding_window=sliding_window, chunk_size=chunk_size
    )
    return s.masked_fill(~vis.to(s.device), -math.inf), vh


def attention_oracle(
    q: torch.Tensor,  # [T, Hq, D]
    k_per_req: Sequence[torch.Tensor],  # each [L_r, H, D]
    v_per_req: Sequence[torch.Tensor],  # each [L_r, H, Dv]
    q_lens: Sequence[int],
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # [Hq]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention by the module's semantics over plain per-request K/V.

    Request ``r`` owns the next ``q_lens[r]`` rows of ``q`` (rows past ``sum(q_lens)`` are
    padding and come back as zeros) and keys ``k_per_req[r]`` (token-major ``[L_r, H, D]``, the
    shape ``reshape_and_cache`` takes). Returns ``(out [T, Hq, Dv] float64, lse [T, Hq] float64)``
    on the CPU.
    """
    if len(k_per_req) != len(q_lens) or len(v_per_req) != len(q_lens):
        raise ValueError(
            f"attention_oracle: {len(q_lens)} q_lens but {len(k_per_req)} K and "
            f"{len(v_per_req)} V tensors; pass one K and one V per request"
        )
    qd = q.detach().double().cpu()
    num_tokens, num_q_heads, head_size = qd.shape
    if sum(q_lens) > num_tokens:
        raise ValueError(f"attention_oracle: sum(q_lens)={sum(q_lens)} > q's {num_tokens} rows")
    scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
    head_size_v = v_per_req[0].shape[-1] if len(v_per_req) else head_size
    out = torch.zeros(num_tokens, num_q_heads, head_size_v, dtype=torch.float64)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=torch.float64)
    sink = None if sinks is None else sinks.detach().double().cpu()  # [Hq]
    slopes = None if alibi_slopes is None else alibi_slopes.detach().double().cpu()  # [Hq]
    start = 0
    for r, q_len in enumerate(q_lens):
        k = k_per_req[r].detach().double().cpu()  # [L, H, D]
        v = v_per_req[r].detach().double().cpu()  # [L, H, Dv]
        seq_len = k.shape[0]
        if q_len > seq_len:
            raise ValueError(
                f"attention_oracle: request {r} has q_len={q_len} > seq_len={seq_len}; "
                "query tokens are the last q_len of the sequence"
            )
        if q_len == 0:
            continue
        qs = qd[start : start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        s, vh = _masked_logits(
            qs, k, v, scale=scale, softcap=softcap, alibi_slopes=slopes, causal=causal,
            sliding_window=sliding_window, chunk_size=chunk_size,
        )  # fmt: skip
        terms = s if sink is None else torch.cat([s, sink[:, None, None].expand(-1, q_len, 1)], -1)
        row_lse = torch.logsumexp(terms, dim=-1)  # [Hq, q_len]
        finite = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)
        probs = torch.exp(s - finite[..., None])  # [Hq, q_len, L]; masked keys give 0
        out[start : start + q_len] = (probs @ vh).transpose(0, 1)
        lse[start : start + q_len] = row_lse.transpose(0, 1)
        start += q_len
    return out, lse


def attention_lowprec(
    q: torch.Tensor,  # [T, Hq, D] in the compute dtype
    k_per_req: Sequence[torch.Tensor],  # each [L_r, H, D]
    v_per_req: Sequence[torch.Tensor],  # each [L_r, H, Dv]
    q_lens: Sequence[int],
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:
    """:func:`attention_oracle`'s attention in plain torch at ``q.dtype`` (logits, softmax and
    P@V rounded to it), on ``q``'s device: ``err_lowprec`` of the parity rule
    (:func:`check_close_to_oracle`), what a correct kernel that rounds P to the input dtype may
    err by. ``[T, Hq, Dv]`` in ``q.dtype``, padding rows zero."""
    dt, dev = q.dtype, q.device
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    head_size_v = v_per_req[0].shape[-1] if len(v_per_req) else q.shape[-1]
    out = torch.zeros(q.shape[0], q.shape[1], head_size_v, dtype=dt, device=dev)
    start = 0
    slopes = None if alibi_slopes is None else alibi_slopes.to(dev)
    for k, v, q_len in zip(k_per_req, v_per_req, q_lens, strict=True):
        seq_len = k.shape[0]
        if q_len == 0:
            continue
        qs = q[start : start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        logits, vh = _masked_logits(
            qs, k.to(dev, dt), v.to(dev, dt), scale=scale, softcap=softcap, alibi_slopes=slopes,
            causal=causal, sliding_window=sliding_window, chunk_size=chunk_size,
        )  # fmt: skip
        if sinks is not None:
            sink = sinks.to(dev, dt)[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :seq_len]
        else:
            probs = torch.softmax(logits, -1)
        out[start : start + q_len] = (probs.to(dt) @ vh).transpose(0, 1)
        start += q_len
    return out


def _head_scale(scale: float | torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:  # [H]
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float64)
    if isinstance(scale, torch.Tensor):
        return scale.detach().double().cpu().reshape(-1).expand(num_kv_heads)
    return torch.full((num_kv_heads,), float(scale), dtype=torch.float64)


def gather_kv_per_request(
    kv_cache: torch.Tensor,  # [B, H, N, C] layer view
    layout: KVCacheLayout,
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    seq_lens: Sequence[int] | torch.Tensor,  # [num_reqs]
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each request's K ``[L, H, D]`` and V ``[L, H, Dv]`` read through its block-table row, in
    float64 and dequantized (``stored * scale``) for fp8 per-tensor caches."""
    lens = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    n = layout.block_size
    quant = layout.kv_quant is KVQuantMode.FP8_PER_TENSOR
    ks_deq = _head_scale(k_scale if quant else None, layout.num_kv_heads)  # [H]
    vs_deq = _head_scale(v_scale if quant else None, layout.num_kv_heads)  # [H]
    table = block_table.detach().cpu().to(torch.int64)
    if layout.v_range is None:
        raise ValueError("gather_kv_per_request: MLA layouts have no V range; attention reads K/V")
    (k0, k1), (v0, v1) = layout.k_range, layout.v_range
    ks, vs = [], []
    for r, seq_len in enumerate(lens):
        pages = table[r, : -(-seq_len // n)]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= layout.num_blocks):
            raise ValueError(
                f"gather_kv_per_request: block_table[{r}] holds ids outside "
                f"[0, {layout.num_blocks}) under seq_len={seq_len}: {pages.tolist()}"
            )
        kv = kv_cache[pages.to(kv_cache.device)].detach().cpu().double()  # [p, H, N, C]
        kv = kv.permute(0, 2, 1, 3).reshape(-1, layout.num_kv_heads, kv.shape[-1])[:seq_len]
        ks.append(kv[..., k0:k1] * ks_deq[None, :, None])  # [L, H, D]
        vs.append(kv[..., v0:v1] * vs_deq[None, :, None])  # [L, H, Dv]
    return ks, vs


def attention_oracle_paged(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [B, H, N, C] layer view
    layout: KVCacheLayout,
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_oracle` over K/V read from a paged cache (see :func:`gather_kv_per_request`).

    It trusts the block table, so it checks the attention arithmetic, never the paging: tests of
    paging compare against :func:`attention_oracle` over K/V they drew themselves."""
    ks, vs = gather_kv_per_request(
        kv_cache, layout, block_table, seq_lens, k_scale=k_scale, v_scale=v_scale
    )
    qsl = [int(x) for x in query_start_loc.tolist()]
    q_lens = [b - a for a, b in itertools.pairwise(qsl)]
    return attention_oracle(
        q,
        ks,
        vs,
        q_lens,
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        sinks=sinks,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )


# ---- the tolerance rule --------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """``err <= rtol * err_lowprec + atol * max|oracle_row| + abs_floor`` per output row."""

    rtol: float  # multiple of the low-precision torch run's own error
    atol: float  # relative to the row's magnitude (a few units of the dtype's rounding)
    abs_floor: float  # absolute slack for rows that are (near) zero, e.g. rows that see no key


#: Per output dtype. ``u`` is the unit roundoff (half an ulp at 1): fp32 2^-24, fp16 2^-11,
#: bf16 2^-8. A kernel rounds P to the input dtype before the PV product and rounds the output
#: once, so its error is ~1-2 ulps of the row; the atol column allows ~4 u (fp16/bf16) and the
#: rtol column 2x a same-dtype torch run, as flash-attention's tests do. fp32 allows ~2^-14 of the
#: row: tl.dot / matmul summation order over thousands of keys, not rounding of P. One wrong page
#: of 16 among L keys moves a decode row by ~sqrt(32 / L) of its size (0.06 at 9k keys, 0.03 at
#: 32k), several times these bounds; the old fixed atol = rtol = 2e-2 exceeds the whole row there.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rtol=2.0, atol=6e-5, abs_floor=1e-6),
    torch.float16: Tolerance(rtol=2.0, atol=4 * 2.0**-11, abs_floor=1e-5),
    torch.bfloat16: Tolerance(rtol=2.0, atol=2 * 2.0**-8, abs_floor=1e-4),
}


@dataclass(frozen=True)
class OracleCheck:
    """Result of :func:`check_close_to_oracle`: the worst row relative to its bound."""

    ok: bool
    worst_row: tuple[int, ...]  # index of the (token, head) row with the largest err / bound
    err: float  # that row's max |out - oracle|
    bound: float  # that row's allowed error
    rows_failed: int
    message: str


def _row_max(x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [...]
    return x.abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])


def check_close_to_oracle(
    out: torch.Tensor,  # [..., D] kernel output
    oracle: torch.Tensor,  # [..., D] float64 oracle
    *,
    lowprec_reference: torch.Tensor | None = None,  # [..., D] torch run in out's dtype
    dtype: torch.dtype | None = None,
    tolerance: Tolerance | None = None,
) -> OracleCheck:
    """Compare ``out`` to ``oracle`` by the per-row rule (see the module docstring)."""
    if out.shape != oracle.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != oracle shape {tuple(oracle.shape)}")
    dtype = out.dtype if dtype is None else dtype
    if tolerance is None:
        if dtype not in TOLERANCES:
            raise ValueError(
                f"no tolerance for dtype {dtype}; pass tolerance= or one of "
                f"{[str(d) for d in TOLERANCES]}"
            )
        tolerance = TOLERANCES[dtype]
    got = out.detach().double().cpu()
    want = oracle.detach().double().cpu()
    err = _row_max(got - want)  # [...]
    err = torch.where(torch.isfinite(got).all(dim=-1), err, torch.full_like(err, math.inf))
    bound = tolerance.atol * _row_max(want) + tolerance.abs_floor
    if lowprec_reference is not None:
        low = lowprec_reference.detach().double().cpu()
        if low.shape != want.shape:
            raise ValueError(f"lowprec_reference shape {tuple(low.shape)} != {tuple(want.shape)}")
        bound = bound + tolerance.rtol * _row_max(low - want)
    ratio = err / bound
    bad = ratio > 1
    if ratio.numel() == 0:
        return OracleCheck(True, (), 0.0, 0.0, 0, "empty output")
    flat = int(torch.nan_to_num(ratio, nan=math.inf).argmax())
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ratio.shape))
    e, b = float(err[worst]), float(bound[worst])
    msg = (
        f"{int(bad.sum())} of {ratio.numel()} rows exceed the oracle bound for {dtype}; worst row "
        f"{worst}: max|out - oracle| = {e:.3g} vs bound {b:.3g} (row max |oracle| = "
        f"{float(_row_max(want)[worst]):.3g}, {tolerance})"
    )
    return OracleCheck(not bool(bad.any()), worst, e, b, int(bad.sum()), msg)


def assert_close_to_oracle(
    out: torch.Tensor,
    oracle: torch.Tensor,
    *,
    lowprec_reference: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    tolerance: Tolerance | None = None,
) -> None:
    """Raise ``AssertionError`` unless :func:`check_close_to_oracle` passes."""
    res = check_close_to_oracle(
        out, oracle, lowprec_reference=lowprec_reference, dtype=dtype, tolerance=tolerance
    )
    if not res.ok:
        raise AssertionError(res.message)


# ---- planted paging bugs (negative tests) ---------------------------------------------------------


def plant_wrong_page(
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    seq_lens: Sequence[int] | torch.Tensor,
    block_size: int,
    num_blocks: int,
    *,
    request: int = 0,
    page: int | None = None,
) -> torch.Tensor:
    """A copy of ``block_table`` whose row ``request`` points page ``page`` (default: its middle
    page) at another allocated block id that the row does not use: one wrong page, as a buggy
    block-table builder or an off-by-one in a kernel's page walk would read."""
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    n_pages = -(-int(lens[request]) // block_size)
    if n_pages == 0:
        raise ValueError(f"request {request} has no pages (seq_len={lens[request]})")
    page = n_pages // 2 if page is None else page
    if not 0 <= page < n_pages:
        raise ValueError(f"page={page} outside the request's {n_pages} pages")
    table = block_table.clone()
    used = set(table[request, :n_pages].tolist())
    other = next((b for b in range(num_blocks) if b not in used), None)
    if other is None:
        raise ValueError(f"every one of the {num_blocks} blocks is in request {request}'s row")
    table[request, page] = other
    return table


def drop_last_page(
    seq_lens: torch.Tensor,  # [num_reqs]
    block_size: int,
    *,
    request: int = 0,
) -> torch.Tensor:
    """A copy of ``seq_lens`` in which request ``request`` forgets its last page (its length is
    cut to the start of that page), as a metadata builder that floors instead of ceils would."""
    lens = seq_lens.clone()
    seq_len = int(lens[request])
    n_pages = -(-seq_len // block_size)
    if n_pages < 2:
        raise ValueError(f"request {request} needs >= 2 pages to drop one (seq_len={seq_len})")
    lens[request] = (n_pages - 1) * block_size
    return lens
