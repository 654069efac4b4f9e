"""torch's paged-Flex recipe, the decode baseline of ``bench_flex.py`` (run there in a child
process, ``--recipe-case``, so a device-side assert in the recipe cannot poison the main run)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["recipe_fn"]


def recipe_fn(
    c: Any, hq: int, h: int, d: int, device: str, flex: Callable[..., Any]
) -> Callable[[], Any]:
    """torch's paged-Flex recipe (attention-gym ``PagedAttention``, PyTorch's paged-attention
    tests), written out here: a *logical* block mask over each request's ``[0, max_len)`` with
    ``BLOCK_SIZE = page``, converted to the physical cache by mapping each ``kv_indices`` entry
    through the page table and wrapping the mask mod in a physical -> logical lookup. K and V are
    separate ``[1, H, pages * page, D]`` caches (its own layout); pages are shuffled. ``c`` is a
    decode case (``seq_lens``, ``block``); ``flex`` the (compiled) ``flex_attention``."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    r, page = len(c.seq_lens), c.block
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    logical_pages = -(-max(c.seq_lens) // page)
    num_pages = r * logical_pages
    k = torch.randn(1, h, num_pages * page, d, dtype=dt, device=device)
    v = torch.randn_like(k)
    q = torch.randn(r, hq, 1, d, dtype=dt, device=device)
    page_table = torch.randperm(num_pages, device=device).view(r, logical_pages)  # [R, P]
    phys_to_log = torch.empty(r, num_pages, dtype=torch.long, device=device)
    phys_to_log.fill_(-1)
    rows = torch.arange(r, device=device)[:, None].expand(r, logical_pages)
    phys_to_log[rows, page_table] = torch.arange(logical_pages, device=device)[None].expand(r, -1)
    seq_lens = torch.tensor(c.seq_lens, device=device)

    def logical_mask(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return kv_idx < seq_lens[b]

    lbm = create_block_mask(
        logical_mask, r, None, 1, logical_pages * page, device=device, BLOCK_SIZE=(page, page)
    )
    # Physical kv_indices: page_table[b, logical block]; the logical block size is the page.
    phys_idx = torch.gather(
        page_table[:, None, None, :].expand(-1, 1, lbm.kv_indices.shape[2], -1),
        3,
        lbm.kv_indices.long(),
    ).int()
    # ... widened to one column per physical page, as attention-gym's conversion does:
    # BlockMask.from_kv_blocks sizes its dense block grid by the indices' last dim, so physical
    # ids past the logical width index out of bounds there (the device-side assert every
    # recipe case hit on torch 2.11 / H100).
    wide = torch.zeros(*phys_idx.shape[:3], num_pages, dtype=torch.int32, device=device)
    wide[..., : phys_idx.shape[3]] = phys_idx
    phys_idx = wide

    def physical_mask(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        # Flex may evaluate the mask past the last page of a partial KV block: clamp the index
        # (those positions are masked by the logical mask anyway).
        log_page = phys_to_log[b, torch.clamp(kv_idx // page, max=num_pages - 1)]
        log_kv = log_page * page + kv_idx % page
        return torch.where(log_page >= 0, logical_mask(b, h, q_idx, log_kv), False)

    pbm = BlockMask.from_kv_blocks(
        lbm.kv_num_blocks,
        phys_idx,
        BLOCK_SIZE=(page, page),
        mask_mod=physical_mask,
        seq_lengths=(1, num_pages * page),
    )
    # Flex's decoding kernel walks BLOCK_N-token steps inside each sparse KV block; pages below
    # its default BLOCK_N (64) need BLOCK_N = page (torch 2.11, H100: a device-side assert at
    # page 16 without it), as the FLEX_ATTENTION backend sets for its own one-page tiles.
    opts = {"BLOCK_N": page} if page < 64 else None
    return lambda: flex(q, k, v, block_mask=pbm, enable_gqa=True, kernel_options=opts)
