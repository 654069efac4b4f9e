"""The trainer's side of "rollout equals trainer": dense attention over one request, made the
way the paged backends make it in batch-invariant mode, so an RL trainer computes the logprobs
of a rollout with exactly the numbers the rollout saw.

- :func:`flex_trainer_attention` — one ``flex_attention`` call over a request's dense K/V with
  the layer's :class:`~kv_backends.backends.flex.options.FlexOptions` (``q_block_size``,
  ``kv_block_size``, ``BLOCK_M``, ``BLOCK_N``), the same kernel options, the same KV tiles in
  the same (logical) order, the same mask and score mods and the same sink arithmetic as
  FLEX_ATTENTION with ``batch_invariant=True``.
- :func:`triton_trainer_attention` — kv-kernels' Triton paged-attention kernel over the
  request alone (its K/V laid into a private cache of the same kernel block size, identity
  block table), with the same fixed ``num_splits`` as the TRITON backend in batch-invariant mode.

The guarantee and its limits are in the kv-backends README ("FLEX_ATTENTION: rollout equals
trainer"): bitwise on CUDA for the compiled Flex template and the Triton kernel
(tested by the ``gpu``-marked tests in tests/test_flex_trainer.py); on the CPU only closeness is
checkable (eager Flex is dense masked math whose reductions run over the whole cache view).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from kv_backends.backends.flex.compiled import compiled_flex, flex_dynamo_limits
from kv_backends.backends.flex.mask_mods import make_score_mod
from kv_backends.backends.flex.options import FlexOptions

__all__ = ["flex_trainer_attention", "flex_trainer_block_mask", "triton_trainer_attention"]


def _check_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
            "[L, Hq, D], [S, H, D], [S, H, Dv] (one request, token-major)"
        )
    length, seq = q.shape[0], k.shape[0]
    if v.shape[0] != seq or k.shape[1] != v.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must share S and H, and q's head size "
            f"{q.shape[2]} must equal k's {k.shape[2]}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    if not 0 < length <= seq:
        raise ValueError(
            f"q has {length} rows for a request of {seq} tokens; need 1 <= L <= S (queries are "
            "the last L positions)"
        )
    return length, seq


def flex_trainer_block_mask(
    length: int,
    seq_len: int,
    options: FlexOptions,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> Any:
    """The dense call's ``BlockMask``: queries at positions ``seq_len - length ..`` in tiles of
    ``q_block_size``; each tile row lists the KV tiles (``kv_block_size`` tokens) its queries can
    see, in logical order, all as partial blocks (the mask mod runs on every visited tile, as in
    the paged call; no "full block" fast path whose code differs)."""
    from torch.nn.attention.flex_attention import BlockMask

    qbs, kvb = options.q_block_size, options.kv_block_size
    nqb = -(-length // qbs)
    first = torch.arange(nqb) * qbs + (seq_len - length)  # [nqb] first position of each tile
    last = torch.clamp(first + qbs - 1, max=seq_len - 1)
    hi = last if causal else torch.full_like(last, seq_len - 1)
    lo = torch.zeros_like(first)
    if sliding_window is not None:
        lo = (first - sliding_window + 1).clamp(min=0)
        if not causal:
            hi = torch.minimum(hi, last + sliding_window - 1)
    lo_t, hi_t = lo // kvb, hi // kvb
    num = (hi_t - lo_t + 1).to(torch.int32)  # [nqb]
    cols = int(num.max())
    idx = (lo_t[:, None] + torch.arange(cols)[None, :]).clamp(max=-(-seq_len // kvb) - 1)
    offset = torch.tensor(seq_len - length, device=device)
    w = sliding_window

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        qp = q_idx + offset
        ok = kv_idx < seq_len
        if causal:
            ok = ok & (kv_idx <= qp)
        if w is not None:
            ok = ok & ((qp - kv_idx).abs() < w)
        return ok

    return BlockMask.from_kv_blocks(
        num[None, None].to(device),
        idx.to(torch.int32)[None, None].to(device),
        BLOCK_SIZE=(qbs, kvb),
        mask_mod=mask_mod,
        seq_lengths=(length, seq_len),
        compute_q_blocks=False,
    )


def flex_trainer_attention(
    q: torch.Tensor,  # [L, Hq, D] the request's last L queries
    k: torch.Tensor,  # [S, H, D] the request's keys, position order
    v: torch.Tensor,  # [S, H, Dv]
    *,
    options: FlexOptions,
    causal: bool = True,
    sliding_window: int | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [Hq] float32 logits
    alibi_slopes: torch.Tensor | None = None,  # [Hq] float32
    compiled: bool | None = None,
    static: bool = True,
    kernel_options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Attention of one request, ``[L, Hq, Dv]``, as FLEX_ATTENTION computes it for that request
    in batch-invariant mode with the same ``options`` (give the layer's: the builder's
    ``FlexOptions``). ``L == S`` is a full training forward; ``L < S`` the last ``L`` positions.

    ``compiled`` (default: on CUDA) runs the same ``torch.compile``'d Flex as the backend;
    ``static`` compiles per shape (``dynamic=False``, as the backend's padded calls do), which
    keeps the kernel variant the same as the rollout's; pass ``False`` to let torch share a
    symbolic graph across lengths (faster compiles; not covered by the bitwise tests).
    ``kernel_options`` overrides the options the tiles give (pass the impl's override if it
    has one)."""
    from torch.nn.attention.flex_attention import flex_attention

    length, seq_len = _check_dense(q, k, v)
    hq, h = q.shape[1], k.shape[1]
    dev = q.device
    bm = flex_trainer_block_mask(
        length, seq_len, options, causal=causal, sliding_window=sliding_window, device=dev
    )
    scale_f = q.shape[2] ** -0.5 if scale is None else scale
    score_mod = _score_mod(softcap, alibi_slopes, seq_len - length, dev)
    use_compiled = dev.type == "cuda" if compiled is None else compiled
    if kernel_options is None and dev.type == "cuda":
        kernel_options = options.kernel_options(main_template=True, batch_invariant=True)
    need_lse = sinks is not None
    fn = compiled_flex(static=static or dev.type != "cuda") if use_compiled else flex_attention
    qx = q.transpose(0, 1)[None]  # [1, Hq, L, D]
    kx = k.transpose(0, 1)[None]  # [1, H, S, D]
    vx = v.transpose(0, 1)[None]  # [1, H, S, Dv]
    with warnings.catch_warnings(), flex_dynamo_limits():
        warnings.simplefilter("ignore", category=FutureWarning)
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        res = fn(
            qx,
            kx,
            vx,
            score_mod=score_mod,
            block_mask=bm,
            scale=scale_f,
            enable_gqa=hq != h,
            return_lse=need_lse,
            kernel_options=kernel_options,
        )
    if not need_lse:
        return res[0].transpose(0, 1)  # [L, Hq, Dv]
    o, lse = res
    assert sinks is not None
    # The backend's arithmetic: out * sigmoid(lse - sink) in float32, then the input dtype.
    gate = torch.sigmoid(lse[0].float() - sinks.to(dev, torch.float32)[:, None])  # [Hq, L]
    return (o[0].float() * gate[..., None]).transpose(0, 1).to(q.dtype)


def _score_mod(
    softcap: float, slopes: torch.Tensor | None, offset: int, device: torch.device
) -> Any:
    """Softcap then ALiBi: the backend's own score mod (:func:`make_score_mod`), with a query's
    position ``q_idx + offset`` and a key's ``kv_idx``."""
    if not softcap and slopes is None:
        return None
    slopes_f = None if slopes is None else slopes.to(device, torch.float32)
    off = torch.tensor(offset, device=device)

    def distance(b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx - (q_idx + off)

    return make_score_mod(softcap, slopes_f, device, distance)


def triton_trainer_attention(
    q: torch.Tensor,  # [L, Hq, D] the request's last L queries
    k: torch.Tensor,  # [S, H, D]
    v: torch.Tensor,  # [S, H, Dv]
    *,
    kernel_block_size: int,
    num_splits: int = 1,
    causal: bool = True,
    sliding_window: int | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [Hq] float32
    alibi_slopes: torch.Tensor | None = None,  # [Hq] float32
    impl: str = "triton",
) -> torch.Tensor:
    """Attention of one request, ``[L, Hq, Dv]``, through the TRITON backend's kernel: the
    request's K/V go into a private cache of ``kernel_block_size``-token blocks (block ``i``
    holds positions ``i * n ..``), and the kernel runs over that one sequence with
    ``num_splits`` (the backend's under batch invariance: 1 unless the impl was given another).

    The kernel picks its tile shapes by each sequence's own query length (a "decode" class up to
    a small ``block_q``, a "prefill" class above), never by the batch: so this equals the
    rollout's rows of a step that had the *same* ``L`` queries of this request. A rollout that
    decoded token by token equals this called with ``L = 1`` per position, not one ``L = S``
    call (that one equals a rollout that prefilled all ``S`` tokens at once)."""
    from kv_kernels import allocate_kv_cache, layer_view
    from kv_kernels.paged_attention import paged_attention
    from kv_spec import FullAttentionSpec, KVCacheLayout, normalize_dtype

    length, seq_len = _check_dense(q, k, v)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 1 (the backend's: 1)")
    n = kernel_block_size
    h, d, dv = k.shape[1], k.shape[2], v.shape[2]
    nb = -(-seq_len // n)
    spec = FullAttentionSpec(
        block_size=n, num_kv_heads=h, head_size=d, head_size_v=dv, dtype=normalize_dtype(k.dtype)
    )
    layout = KVCacheLayout.from_spec(spec, num_blocks=nb, num_layers=1, order="LBNHC")
    cache = layer_view(allocate_kv_cache(layout, q.device), layout, 0)  # [nb, H, n, D + Dv]
    pos = torch.arange(seq_len, device=q.device)
    cache[pos // n, :, pos % n, :d] = k
    cache[pos // n, :, pos % n, d : d + dv] = v
    dev = q.device
    out = paged_attention(
        q,
        cache,
        layout,
        torch.arange(nb, dtype=torch.int32, device=dev)[None],
        torch.tensor([seq_len], dtype=torch.int32, device=dev),
        torch.tensor([0, length], dtype=torch.int32, device=dev),
        length,
        max_seq_len=seq_len,
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
        sinks=None if sinks is None else sinks.to(dev, torch.float32),
        softcap=softcap,
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.to(dev, torch.float32),
        num_splits=num_splits,
        impl=impl,
    )
    assert isinstance(out, torch.Tensor)
    return out
