"""A backend runs straight off BlockTables' metadata.

A tiny hybrid cache (a full-attention group and a sliding-window group sharing one block-id
space) is planned with kv_spec and allocated with kv_kernels. A toy scheduler runs two steps
(chunked prefill; then a finished request, a condensing move, a swap, decode plus the rest of a
prefill, and sliding-window blocks dropped to the null block). TORCH_SDPA writes K/V through our
slot mappings and attends through our kernel block tables; its output is held to a float64
oracle over the tokens as written, and to the same batch built with
``CommonAttentionMetadata.from_lists`` over a second cache. Also: ``from_config`` on MLA,
cross-layer and padded plans.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_backends import AttentionConfig, CommonAttentionMetadata, get_backend  # noqa: E402
from kv_blocktable.block_table import BlockTables  # noqa: E402
from kv_kernels import allocate_kv_cache, layer_view  # noqa: E402
from kv_spec import (  # noqa: E402
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    plan_kv_cache,
)

H, HQ, D, BS, WINDOW = 2, 4, 16, 16, 4
NULL = 0
NUM_BLOCKS = 12


def _plan(device: str) -> tuple[object, list[AttentionConfig]]:
    specs = {
        "layers.0": FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype="float32"),
        "layers.1": SlidingWindowSpec(
            block_size=BS, num_kv_heads=H, head_size=D, dtype="float32", sliding_window=WINDOW
        ),
    }
    page = BS * H * 2 * D * 4
    cfg = plan_kv_cache(specs, page * NUM_BLOCKS, max_model_len=64)
    assert cfg.num_blocks == NUM_BLOCKS and len(cfg.groups) == 2
    kbs = [BS // 2, BS]  # kernel-block ratio 2 on the full group, 1 on the window group
    configs = [
        AttentionConfig.from_spec(g.spec, num_q_heads=HQ, kernel_block_size=k)
        for g, k in zip(cfg.groups, kbs, strict=True)
    ]
    return cfg, configs


def _oracle(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, pos: int, window: int | None):
    """float64 attention of one query ``[HQ, D]`` at ``pos`` over keys ``[S, H, D]``."""
    s = ks.shape[0]
    kv_pos = torch.arange(s)
    ok = kv_pos <= pos
    if window is not None:
        ok &= kv_pos > pos - window
    out = torch.zeros(HQ, D, dtype=torch.float64)
    for h in range(HQ):
        logits = (ks[:, h // (HQ // H)].double() @ q[h].double()) * D**-0.5
        w = torch.softmax(logits.masked_fill(~ok, float("-inf")), 0)
        out[h] = w @ vs[:, h // (HQ // H)].double()
    return out


class _World:
    """A toy scheduler: requests, a block pool with null block 0, and the rows they sit in."""

    def __init__(self, device: str, impl: str, pin_memory: bool) -> None:
        self.device = device
        self.cfg, self.configs = _plan(device)
        kbs = [c.kernel_block_size for c in self.configs]
        self.tables = BlockTables.from_config(
            self.cfg,
            kbs,
            max_num_reqs=4,
            max_model_len=64,
            max_num_batched_tokens=64,
            device=device,
            pin_memory=pin_memory,
            impl=impl,
        )
        layout = self.cfg.layout(0)
        assert layout == self.cfg.layout(1)  # one page format, one block-id space
        self.layouts = [self.cfg.layout(g) for g in range(2)]
        # Cache A is written through BlockTables' slots; cache B through from_lists' slots.
        self.cache_a = layer_view(allocate_kv_cache(layout, device), layout, 0)
        self.cache_b = layer_view(allocate_kv_cache(layout, device), layout, 0)
        self.free = list(range(1, NUM_BLOCKS))
        random.Random(0).shuffle(self.free)
        self.blocks: dict[str, list[list[int]]] = {}  # request -> per group manager ids
        self.kv: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(0)
        backend = get_backend("TORCH_SDPA")
        self.impls = [
            backend.make_impl(c, lay) for c, lay in zip(self.configs, self.layouts, strict=True)
        ]
        self.builders = [
            backend.make_builder(c, lay, device=device, max_num_batched_tokens=64, max_num_seqs=4)
            for c, lay in zip(self.configs, self.layouts, strict=True)
        ]

    def grow(self, req: str, seq_len: int) -> list[list[int]]:
        """Allocate blocks so ``req`` holds ``seq_len`` tokens in both groups; returns the new ids."""
        have = self.blocks.setdefault(req, [[], []])
        new: list[list[int]] = [[], []]
        for g in range(2):
            while len(have[g]) * BS < seq_len:
                b = self.free.pop()
                have[g].append(b)
                new[g].append(b)
        return new

    def drop_out_of_window(self, req: str, first_query_pos: int) -> None:
        """Sliding-window group: blocks entirely before the window of the first query go back
        to the pool and become the null block in the row."""
        ids = self.blocks[req][1]
        for j, b in enumerate(ids):
            if b != NULL and (j + 1) * BS <= first_query_pos - WINDOW + 1:
                self.free.append(b)
                ids[j] = NULL

    def run_step(self, reqs: list[str], qlens: list[int], slens: list[int]) -> None:
        pad = sum(qlens) + 3  # padding tokens: slot -1, output rows zero
        mds = self.tables.build_common_metadata(len(reqs), qlens, slens, pad_tokens_to=pad)
        for g, md in enumerate(mds):
            window = WINDOW if g == 1 else None
            key = torch.zeros(pad, H, D)
            value = torch.zeros(pad, H, D)
            q = torch.zeros(pad, HQ, D)
            t = 0
            for req, ql, sl in zip(reqs, qlens, slens, strict=True):
                for pos in range(sl - ql, sl):
                    k_, v_ = torch.randn(2, H, D, generator=self.gen)
                    self.kv[(req, g, pos)] = (k_, v_)
                    key[t], value[t] = k_, v_
                    q[t] = torch.randn(HQ, D, generator=self.gen)
                    t += 1
            key, value, q = key.to(self.device), value.to(self.device), q.to(self.device)
            impl, builder = self.impls[g], self.builders[g]
            impl.do_kv_cache_update(None, key, value, self.cache_a, md.slot_mapping)
            out_a = impl.forward(None, q, self.cache_a, builder.build(md)).cpu()
            # The same batch by hand: kv-backends' from_lists over the model's own kernel rows.
            k = BS // self.configs[g].kernel_block_size
            rows = [[b * k + i for b in self.blocks[r][g] for i in range(k)] for r in reqs]
            width = max(len(r) for r in rows)
            ref = CommonAttentionMetadata.from_lists(
                query_lens=qlens,
                seq_lens=slens,
                block_table=[r + [0] * (width - len(r)) for r in rows],
                block_size=self.configs[g].kernel_block_size,
                device=self.device,
                pad_tokens_to=pad,
            )
            assert torch.equal(md.slot_mapping, ref.slot_mapping)
            impl.do_kv_cache_update(None, key, value, self.cache_b, ref.slot_mapping)
            out_b = impl.forward(None, q, self.cache_b, builder.build(ref)).cpu()
            torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
            assert out_a[t:].abs().sum() == 0  # padding rows
            t = 0
            for req, ql, sl in zip(reqs, qlens, slens, strict=True):
                ks = torch.stack([self.kv[(req, g, p)][0] for p in range(sl)])
                vs = torch.stack([self.kv[(req, g, p)][1] for p in range(sl)])
                for pos in range(sl - ql, sl):
                    want = _oracle(q[t].cpu(), ks, vs, pos, window)
                    torch.testing.assert_close(out_a[t].double(), want, rtol=1e-5, atol=1e-5)
                    t += 1


def _two_steps(device: str, impl: str, pin_memory: bool) -> None:
    w = _World(device, impl, pin_memory)
    tables = w.tables
    # Step 1: chunked prefill of three requests (A's prompt is 37 tokens, 20 this step).
    for row, (req, s) in enumerate((("A", 20), ("B", 12), ("C", 20))):
        tables.add_row(row, tuple(w.grow(req, s)))
    tables.commit(3)
    w.run_step(["A", "B", "C"], [20, 12, 20], [20, 12, 20])
    # Step 2: B finished; C moves into its row (condense); decodes go first (swap); A finishes
    # its prompt; the window group drops blocks that left every query's window.
    tables.clear_row(1)
    freed = w.blocks.pop("B")
    w.free += freed[0] + freed[1]
    tables.move_row(2, 1)
    tables.clear_row(2)
    tables.swap_rows(0, 1)  # row 0 = C (decode), row 1 = A
    tables.append_row(0, tuple(w.grow("C", 21)))
    tables.append_row(1, tuple(w.grow("A", 37)))
    for row, (req, first_pos) in enumerate((("C", 20), ("A", 20))):
        w.drop_out_of_window(req, first_pos)
        tables.add_row(row, (w.blocks[req][0], w.blocks[req][1]))
    assert w.blocks["A"][1][0] == NULL and w.blocks["C"][1][0] == NULL
    tables.commit(2)
    w.run_step(["C", "A"], [1, 17], [21, 37])
    # The exports of step 2 agree with the rows as the toy scheduler holds them.
    for g in range(2):
        kbs = w.configs[g].kernel_block_size
        k = BS // kbs
        indptr, indices, last = tables.csr(g)
        rows = [[b * k + i for b in w.blocks[r][g] for i in range(k)] for r in ("C", "A")]
        pages = [-(-21 // kbs), -(-37 // kbs)]
        assert indptr.tolist() == [0, pages[0], pages[0] + pages[1]]
        assert indices.tolist() == rows[0][: pages[0]] + rows[1][: pages[1]]
        assert last.tolist() == [21 - (pages[0] - 1) * kbs, 37 - (pages[1] - 1) * kbs]
        p2l = tables.flex_physical_to_logical(g).cpu()
        for r, n in zip(rows, pages, strict=True):
            for col, blk in enumerate(r[:n]):
                assert int(p2l[blk]) == (-1 if blk // k == NULL else col)


def test_torch_sdpa_runs_off_block_tables_cpu() -> None:
    _two_steps("cpu", "auto", pin_memory=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_sdpa_runs_off_block_tables_cuda() -> None:
    """On a GPU: pinned staging, asynchronous copies, the Triton expansion and slot mapping."""
    _two_steps("cuda", "auto", pin_memory=True)


# -- from_config: which plans can be addressed with smaller kernel blocks -----------------------


def test_from_config_mla_splits_into_kernel_blocks() -> None:
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16")
    cfg = plan_kv_cache({"layers.0": spec}, 64 * 576 * 2 * 8)
    t = BlockTables.from_config(
        cfg, [16], max_num_reqs=2, max_model_len=256, max_num_batched_tokens=16
    )
    assert t.kernel_blocks_per_block == (4,) and t.max_num_blocks_per_req == (4,)
    t.add_row(0, ([5, 2],))
    t.commit(1)
    (md,) = t.build_common_metadata(1, [3], [70])
    assert md.block_table[0, :8].tolist() == [20, 21, 22, 23, 8, 9, 10, 11]
    # slot = kernel block x 16 + offset = manager block x 64 + offset: one address either way
    assert md.slot_mapping.tolist() == [2 * 64 + p % 64 for p in (67, 68, 69)]


def test_from_config_refuses_cross_layer_kernel_split() -> None:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype="float16")
    cfg = plan_kv_cache({"a": spec, "b": spec}, 32 * 2 * 32 * 2 * 2 * 8, layout_order="BLNHC")
    kw: dict[str, Any] = dict(max_num_reqs=2, max_model_len=64, max_num_batched_tokens=16)
    BlockTables.from_config(cfg, [32], **kw)  # kernel block = block: always addressable
    with pytest.raises(ValueError, match=r"group 0: cannot address 32-token blocks .* BLNHC"):
        BlockTables.from_config(cfg, [16], **kw)


def test_from_config_refuses_padded_page_kernel_split() -> None:
    small = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float32")
    big = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=16, dtype="float32")
    cfg = plan_kv_cache({"a": small, "b": big}, 16 * 3 * 32 * 4 * 8)
    padded = [g.group_id for g in cfg.groups if g.spec.page_size_padded is not None]
    assert padded == [0]
    kw: dict[str, Any] = dict(max_num_reqs=2, max_model_len=64, max_num_batched_tokens=16)
    BlockTables.from_config(cfg, [16, 8], **kw)  # the unpadded group may split
    with pytest.raises(ValueError, match="group 0: .*padded pages"):
        BlockTables.from_config(cfg, [8, 16], **kw)
    with pytest.raises(ValueError, match="got 1 kernel_block_sizes for 2 KV groups"):
        BlockTables.from_config(cfg, [16], **kw)
