"""The sm_90 Gluon kernels over every layout a user can plan (on an H100 / H200, ``-m gpu``).

Each case runs ``paged_attention`` on a prefill + decode batch through the public api and holds
it to the float64 oracle: whatever the order, head pair, GQA group or page size, the launch must
either run the Gluon kernel to the oracle's bound or leave the class to the Triton kernel —
never fail to compile. (A user found the prefill kernel failing at ``gl.warp_specialize`` for
DiffKV heads in the LHBNC and BHLNC orders on an H200.)

The matrix: every order x every served head pair at group 4, page 16; every group x every page
size for DiffKV's 192 / 128 in two orders (one per-layer, one cross-layer) — the shapes whose
compiled variants differ (strides, constexprs); and fp16 over every order once. (The fp8
decode kernel's orders: ``test_sm90_decode.test_gpu_every_order``.)
"""

from __future__ import annotations

import pytest
import torch
from kv_kernels.testing_attention import (
    assert_triton_matches_oracle,
    counting_gluon_launches,
    make_paged_batch,
)

_ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _ON_SM90, reason="the Gluon kernels are built for sm_90"),
]

ORDERS = ("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC")
HEADS = ((64, 64), (128, 128), (192, 128))
GROUPS = (1, 2, 4, 8, 16)
PAGES = (16, 32, 64, 128)

# prefill chunks over context, a whole prompt and decode rows, lengths ending mid-page and mid-tile
_Q = [130, 1, 65, 1]
_L = [300, 200, 65, 17]


def _cases() -> list[tuple[str, int, int, int, int, int, str]]:
    """(order, head, head_v, kv heads, group, page, dtype)."""
    cases = {(o, d, dv, 2, 4, 16, "bfloat16") for o in ORDERS for d, dv in HEADS}
    cases |= {(o, 192, 128, 2 if g <= 8 else 1, g, n, "bfloat16") for o in ("LHBNC", "BHLNC")
              for g in GROUPS for n in PAGES}  # fmt: skip
    cases |= {(o, 192, 128, 1, 2, 16, "bfloat16") for o in ORDERS}  # one KV head
    cases |= {(o, 192, 128, 2, 2, 16, "float16") for o in ORDERS}
    return sorted(cases)


def _id(c: tuple) -> str:
    o, d, dv, h, g, n, dt = c
    return f"{o}-{d}x{dv}-h{h}-g{g}-n{n}-{dt}"


@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_prefill_serves_or_leaves_every_layout(case: tuple) -> None:
    order, d, dv, kv_heads, group, page, dtype = case
    b = make_paged_batch(
        q_lens=_Q, seq_lens=_L, num_kv_heads=kv_heads, group=group, head_size=d,
        head_size_v=dv, block_size=page, order=order, dtype=getattr(torch, dtype),
        num_layers=3, layer=1, device="cuda",
    )  # fmt: skip
    with counting_gluon_launches("prefill") as launches:
        assert_triton_matches_oracle(b)
    assert launches, f"{_id(case)}: the Gluon prefill kernel did not serve an eligible launch"
