"""Check an importable ``flash_mla`` on this GPU against a float32 torch reference: dense MLA
decode, page 64, 576 / 512 latent, 16 and 128 heads, a few lengths (one not a multiple of 64).
Prints one line per case; exits 1 if any differs beyond bf16 tolerance. Run on the GPU machine
(``tools/flashmla/build_on_device.sh`` runs it after building)."""

from __future__ import annotations

import sys

import torch


def reference(q, blocked_k, table, lens, dv: int, scale: float) -> torch.Tensor:
    """[batch, 1, heads, dv] in float32: softmax(q k^T * scale) v, v the latent's first dv dims."""
    out = torch.empty(*q.shape[:3], dv, dtype=torch.float32, device=q.device)
    block = blocked_k.shape[1]
    for i, n in enumerate(lens.tolist()):
        kv = blocked_k[table[i, : -(-n // block)].long()].reshape(-1, blocked_k.shape[-1])[:n]
        s = (q[i, 0].float() @ kv.float().T) * scale  # [heads, n]
        out[i, 0] = torch.softmax(s, dim=-1) @ kv[:, :dv].float()
    return out


def main() -> int:
    import flash_mla

    torch.manual_seed(0)
    dev = "cuda"
    ok = True
    for heads in (16, 128):
        for batch, ctx in ((2, 300), (4, 4096)):
            block, d, dv = 64, 576, 512
            pages = -(-ctx // block)
            num_blocks = batch * pages + 1
            blocked_k = (torch.randn(num_blocks, block, 1, d, device=dev) / 10).to(torch.bfloat16)
            perm = torch.randperm(num_blocks - 1, device=dev)[: batch * pages] + 1
            table = perm.view(batch, pages).to(torch.int32)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            q = (torch.randn(batch, 1, heads, d, device=dev) / 10).to(torch.bfloat16)
            scale = 1.0 / 192**0.5
            meta, _ = flash_mla.get_mla_metadata()
            out, _lse = flash_mla.flash_mla_with_kvcache(
                q, blocked_k, table, lens, dv, meta, None, softmax_scale=scale, causal=False
            )
            ref = reference(q, blocked_k, table, lens, dv, scale)
            err = (out.float() - ref).abs().max().item()
            good = torch.allclose(out.float(), ref, atol=2e-3, rtol=2e-2)
            ok &= good
            print(
                f"flashmla check heads={heads} batch={batch} ctx={ctx}: max abs diff {err:.3g} "
                f"(|ref| max {ref.abs().max().item():.3g}) {'ok' if good else 'MISMATCH'}",
                flush=True,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
