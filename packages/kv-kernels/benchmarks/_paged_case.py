"""The paged-attention benchmark's batch (``Case``): a shuffled paged cache of random values and
the call of each implementation over it (ours, FA4, FlexAttention, dense torch SDPA), for
``bench_paged_attention.py`` and its tile sweep (``_tune_tiles.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import paged_attention
from kv_spec import KVCacheLayout, KVQuantMode, LayoutOrder

__all__ = ["DTYPE", "HQ", "Case", "D", "H", "triton_kernel_only"]

HQ, H, D = 32, 8, 128
DTYPE = torch.bfloat16


class Case:
    """A batch over a paged cache filled with random values (never zeros: they hide bugs).

    ``q_lens`` (one per sequence; default ``q_len`` each): a mixed batch of chunked prefills
    (``q < ctx``: the rest of the sequence is cached context) and decodes (``q = 1``)."""

    def __init__(
        self,
        *,
        batch: int,
        ctx: int,
        block: int,
        q_len: int,
        seed: int = 0,
        dtype: torch.dtype = DTYPE,
        q_lens: list[int] | None = None,
        kv_dtype: torch.dtype | None = None,
        heads: tuple[int, int] = (D, D),
    ) -> None:
        torch.manual_seed(seed)
        kv_dtype = kv_dtype or dtype
        fp8 = kv_dtype == torch.float8_e4m3fn
        self.q_lens = q_lens or [q_len] * batch
        self.batch, self.ctx, self.block, self.q_len = batch, ctx, block, max(self.q_lens)
        self.dtype = dtype
        self.uniform = len(set(self.q_lens)) == 1
        pages = ctx // block
        num_blocks = batch * pages + 1
        self.layout = KVCacheLayout(
            order=LayoutOrder.LBNHC,
            num_layers=1,
            num_blocks=num_blocks,
            num_kv_heads=H,
            block_size=block,
            head_size=heads[0],
            head_size_v=heads[1],
            dtype="fp8_e4m3" if fp8 else str(dtype).removeprefix("torch."),
            kv_quant=KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE,
        )
        self.kv = layer_view(allocate_kv_cache(self.layout, "cuda", zero=False), self.layout, 0)
        if fp8:  # (no normal_ for fp8: drawn in bf16, a block chunk at a time)
            for lo in range(0, self.kv.shape[0], 1024):
                chunk = self.kv[lo : lo + 1024]
                chunk.copy_(torch.randn(chunk.shape, device="cuda", dtype=dtype).to(kv_dtype))
        else:
            self.kv.normal_()
        # fp8 per tensor: scale 1 (the values as stored), so FA4's fp8 path, if it has one,
        # computes the same attention without descale arguments
        self.scales: dict[str, Any] = {"k_scale": 1.0, "v_scale": 1.0} if fp8 else {}
        perm = torch.randperm(num_blocks - 1, device="cuda")[: batch * pages] + 1
        self.block_table = perm.view(batch, pages).to(torch.int32)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.qsl = torch.tensor(
            [0, *torch.tensor(self.q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
        )
        tokens = sum(self.q_lens)
        self.dk, self.dv = heads  # K / V head sizes (DiffKV: 192 / 128)
        self.q = torch.randn(tokens, HQ, self.dk, dtype=dtype, device="cuda")
        self.out = torch.empty(tokens, HQ, self.dv, dtype=dtype, device="cuda")

    # bytes and flops -----------------------------------------------------------------------
    def kv_bytes(self) -> int:
        return self.batch * self.ctx * H * (self.dk + self.dv) * 2

    def causal_flops(self) -> int:
        """QK^T and PV over the keys each query sees: a query at position ``p`` sees ``p + 1``
        (a full causal prefill counted as half the square, as FA's benchmarks do)."""
        if self.uniform and self.q_len == self.ctx:
            return 2 * self.batch * HQ * self.ctx * self.ctx * (self.dk + self.dv) // 2
        seen = sum(q * (self.ctx - q) + q * (q + 1) // 2 for q in self.q_lens)
        return 2 * HQ * (self.dk + self.dv) * seen

    # implementations ------------------------------------------------------------------------
    def ours(self, **kw: Any) -> Callable[[], Any]:
        def fn() -> Any:
            return paged_attention(
                self.q,
                self.kv,
                self.layout,
                self.block_table,
                self.seq_lens,
                self.qsl,
                self.q_len,
                max_seq_len=self.ctx,
                out=self.out,
                impl="triton",
                **self.scales,
                **kw,
            )

        return fn

    def ours_triton_kernel(self) -> Callable[[], Any]:
        """Ours with the Triton kernel serving every class (on sm_90 the Gluon kernels serve the
        prefill and fp8 decode otherwise), the same-process baseline of that kernel."""
        return triton_kernel_only(self.ours())

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous [batch, H, ctx, D] K and V gathered from the pages (for SDPA)."""
        pages = self.kv[self.block_table.long()]  # [batch, pages, H, N, C]
        kv = pages.permute(0, 2, 1, 3, 4).reshape(self.batch, H, self.ctx, self.dk + self.dv)
        return kv[..., : self.dk].contiguous(), kv[..., self.dk :].contiguous()

    def sdpa(self) -> Callable[[], Any]:
        k, v = self.dense_kv()
        q = self.q.view(self.batch, self.q_len, HQ, self.dk).transpose(1, 2)
        causal = self.q_len > 1

        def fn() -> Any:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=True
            )

        return fn

    def flex(self) -> Callable[[], Any]:
        """FlexAttention over the paged cache: K/V as one physical sequence [1, H, B*N, D]
        (broadcast over the batch), a mask through the inverse block table."""
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        nb, n = self.layout.num_blocks, self.block
        # LBNHC: B and N merge
        phys = self.kv.permute(1, 0, 2, 3).reshape(H, nb * n, self.dk + self.dv)
        k = phys[None, :, :, : self.dk]
        v = phys[None, :, :, self.dk :]
        inv = torch.full((self.batch, nb), -1, dtype=torch.int32, device="cuda")
        rows = torch.arange(self.batch, device="cuda")[:, None].expand_as(self.block_table)
        inv[rows, self.block_table.long()] = torch.arange(
            self.block_table.shape[1], device="cuda", dtype=torch.int32
        )
        ctx, q_len = self.ctx, self.q_len

        def mask_mod(b, h, q_idx, kv_idx):
            lb = inv[b, kv_idx // n]
            pos = lb * n + kv_idx % n
            return (lb >= 0) & (pos <= ctx - q_len + q_idx)

        q = self.q.view(self.batch, q_len, HQ, self.dk).transpose(1, 2)
        compiled = torch.compile(flex_attention, dynamic=False)
        err: Exception | None = None
        # KV blocks of one page make the block mask exact; Flex may reject blocks that small,
        # then 128-token blocks (pages of several sequences, masked inside).
        for kv_block in dict.fromkeys((n, 128)):
            try:
                bm = create_block_mask(
                    mask_mod,
                    self.batch,
                    None,
                    q_len,
                    nb * n,
                    device="cuda",
                    BLOCK_SIZE=(128, kv_block),
                )
                compiled(q, k, v, block_mask=bm, enable_gqa=True)
            except Exception as e:
                err = e
                continue

            def fn(bm=bm) -> Any:
                return compiled(q, k, v, block_mask=bm, enable_gqa=True)

            return fn
        assert err is not None
        raise err

    def fa4(self) -> Callable[[], Any]:
        from flash_attn.cute import flash_attn_varlen_func

        kv = self.kv.permute(0, 2, 1, 3)  # [B, N, H, C]: FA's paged NHD view, no copy
        k, v = kv[..., : self.dk], kv[..., self.dk :]
        causal = self.q_len > 1

        def fn() -> Any:
            return flash_attn_varlen_func(
                self.q,
                k,
                v,
                cu_seqlens_q=self.qsl,
                max_seqlen_q=self.q_len,
                seqused_k=self.seq_lens,
                page_table=self.block_table,
                causal=causal,
            )

        return fn


def triton_kernel_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the Triton kernel serving every class (``KV_KERNELS_SM90_{PREFILL,DECODE,MLA}
    =0``): the same-process baseline of the sm_90 Gluon kernels."""

    def run(*a: Any, **kw: Any) -> Any:
        names = ("KV_KERNELS_SM90_PREFILL", "KV_KERNELS_SM90_DECODE", "KV_KERNELS_SM90_MLA")
        old = {n: os.environ.get(n) for n in names}
        os.environ.update(dict.fromkeys(names, "0"))
        try:
            return fn(*a, **kw)
        finally:
            for n, v in old.items():
                if v is None:
                    del os.environ[n]
                else:
                    os.environ[n] = v

    return run
