"""The registered custom ops: ``torch.library.opcheck`` on the CPU, the public functions under
``torch.compile(fullgraph=True)``, and CUDA-graph capture on the GPU."""

from __future__ import annotations

import pytest
import torch
from kv_kernels import _ops, allocate_kv_cache, layer_view
from kv_kernels._common import layout_json
from kv_kernels.block_copy import copy_blocks, gather_blocks, scatter_blocks
from kv_kernels.reshape_and_cache import read_kv, reshape_and_cache
from kv_kernels.slot_mapping import compute_slot_mapping, expand_block_table
from kv_spec import KVCacheLayout


def _layout(order: str = "LBHNC", **kw) -> KVCacheLayout:
    fields = dict(
        order=order, num_layers=2, num_blocks=6, num_kv_heads=2, block_size=4, head_size=8, head_size_v=6,
        dtype="float32",
    )  # fmt: skip
    fields.update(kw)
    return KVCacheLayout(**fields)


def test_ops_are_registered_once() -> None:
    names = ["reshape_and_cache", "gather_blocks", "scatter_blocks", "copy_blocks"]
    names += ["compute_slot_mapping", "expand_block_table", "paged_attention"]
    for name in names:
        assert hasattr(torch.ops.kv_kernels, name)
    import importlib

    importlib.reload(_ops)  # a second import must not fail on re-registration either


@pytest.mark.parametrize(
    "layout",
    [
        _layout(),
        _layout("BHLNC", dtype="int8", kv_quant="int8_per_token_head"),
        _layout(
            num_kv_heads=1,
            is_mla=True,
            head_size_v=0,
            dtype="fp8_e5m2",
            kv_quant="fp8_per_token_head",
        ),
        KVCacheLayout.from_dict(
            {**_layout().to_dict(), "page_size_bytes": _layout().page_bytes + 64}
        ),
    ],
)
def test_layout_json_round_trip(layout: KVCacheLayout) -> None:
    """Every op carries the layout as the f-string JSON of _common.layout_json; it reads back equal."""
    assert KVCacheLayout.from_json(layout_json(layout)) == layout
    assert (
        KVCacheLayout.from_json(layout_json(layout)).compatibility_hash()
        == layout.compatibility_hash()
    )


# The ops take error_flag as a required (nullable) argument (kv_kernels._ops says why): every
# call below passes it, None here.


def test_opcheck_reshape_and_cache() -> None:
    layout = _layout()
    storage = allocate_kv_cache(layout)
    view = layer_view(storage, layout, 1)  # a permuted, non-contiguous view of the layer tensor
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 6)
    slots = torch.tensor([3, -1, 7, 20, 0])
    args = (key, value, view, slots, layout.to_json(), None, None, "reference", None)
    torch.library.opcheck(torch.ops.kv_kernels.reshape_and_cache.default, args)
    int8 = _layout(dtype="int8", kv_quant="int8_per_token_head")
    view8 = layer_view(allocate_kv_cache(int8), int8, 0)
    args8 = (key, value, view8, slots, int8.to_json(), None, None, "reference", None)
    torch.library.opcheck(torch.ops.kv_kernels.reshape_and_cache.default, args8)
    # fp8 caches with scale tensors: the schema check's value comparisons have no CPU fp8 kernels,
    # so check the fake/compile paths only
    fp8 = _layout(dtype="fp8_e4m3", kv_quant="fp8_per_tensor")
    view_fp8 = layer_view(allocate_kv_cache(fp8), fp8, 0)
    args_fp8 = (
        key,
        value,
        view_fp8,
        slots,
        fp8.to_json(),
        torch.tensor([0.5]),
        torch.tensor([2.0, 1.0]),
        "reference",
        None,
    )
    torch.library.opcheck(
        torch.ops.kv_kernels.reshape_and_cache.default,
        args_fp8,
        test_utils=("test_faketensor", "test_aot_dispatch_static"),
    )


@pytest.mark.parametrize("order", ["LBNHC", "BHLNC"])
def test_opcheck_block_copies(order: str) -> None:
    layout = _layout(order)
    storage = allocate_kv_cache(layout)
    tensors = [storage] if isinstance(storage, torch.Tensor) else list(storage)
    for t in tensors:
        t.copy_(torch.randn(t.shape))
    row = layout.num_layers * layout.page_bytes
    out = torch.zeros(2, row, dtype=torch.uint8)
    ids = torch.tensor([4, 1])
    js = layout.to_json()
    torch.library.opcheck(
        torch.ops.kv_kernels.gather_blocks.default, (tensors, js, ids, out, "reference", None)
    )
    buf = torch.randint(0, 255, (2, row), dtype=torch.uint8)
    torch.library.opcheck(
        torch.ops.kv_kernels.scatter_blocks.default, (buf, tensors, js, ids, "reference", None)
    )
    torch.library.opcheck(
        torch.ops.kv_kernels.copy_blocks.default,
        (tensors, js, torch.tensor([4]), torch.tensor([0]), "reference", None),
    )


def test_opcheck_slot_mapping() -> None:
    table = torch.tensor([[3, 1], [0, -1]], dtype=torch.int32)
    positions = torch.tensor([0, 9, 2])
    qsl = torch.tensor([0, 2, 3])
    torch.library.opcheck(
        torch.ops.kv_kernels.compute_slot_mapping.default,
        (table, positions, qsl, 8, 4, 6, "reference"),
    )
    torch.library.opcheck(
        torch.ops.kv_kernels.compute_slot_mapping.default,
        (table, positions, qsl, 8, 4, None, "reference"),
    )
    torch.library.opcheck(
        torch.ops.kv_kernels.expand_block_table.default, (table, 8, 4, "reference")
    )


def test_public_functions_compile_fullgraph() -> None:
    """The plain api functions route through the custom ops under torch.compile: one graph, no
    breaks, same results as eager."""
    layout = _layout("BLNHC")

    def step(storage, key, value, table, positions, qsl, out):
        kernel_table = expand_block_table(table, 8, 4)
        slots = compute_slot_mapping(kernel_table, positions, qsl, 4, 4, num_slots=8)
        reshape_and_cache(key, value, layer_view(storage, layout, 1), slots, layout)
        copy_blocks(storage, layout, torch.tensor([0]), torch.tensor([5]))
        gather_blocks(storage, layout, torch.tensor([5, 2]), out)
        scatter_blocks(out, storage, layout, torch.tensor([3, 4]))
        return slots

    key, value = torch.randn(8, 2, 8), torch.randn(8, 2, 6)
    table = torch.tensor([[1, 0], [2, -1]], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1])
    qsl = torch.tensor([0, 5, 7])
    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        storage = allocate_kv_cache(layout)
        out = torch.zeros(2, layout.num_layers * layout.page_bytes, dtype=torch.uint8)
        slots = fn(storage, key, value, table, positions, qsl, out)
        results.append((slots, storage.clone(), out))
    (s0, c0, o0), (s1, c1, o1) = results
    assert torch.equal(s0, s1)
    assert torch.equal(c0, c1)
    assert torch.equal(o0, o1)
    assert s0.tolist() == [8, 9, 10, 11, 12, 16, 17, -1]
    # block 2 (slots 8..11) is not touched by the block copies that follow the write
    k, _ = read_kv(layer_view(c1, layout, 1), layout, s1[:4])
    assert torch.equal(k, key[:4])


@pytest.mark.gpu
def test_cuda_graph_capture_of_cache_write() -> None:
    """compute_slot_mapping + reshape_and_cache captured once, replayed with new inputs."""
    layout = _layout(
        "LBNHC", dtype="bfloat16", num_blocks=64, block_size=16, head_size=128, head_size_v=128
    )
    storage = allocate_kv_cache(layout, "cuda")
    view = layer_view(storage, layout, 0)
    key = torch.zeros(32, 2, 128, dtype=torch.bfloat16, device="cuda")
    value = torch.zeros_like(key)
    table = torch.zeros(4, 8, dtype=torch.int32, device="cuda")
    positions = torch.zeros(32, dtype=torch.int64, device="cuda")
    qsl = torch.zeros(5, dtype=torch.int32, device="cuda")

    def step() -> torch.Tensor:
        slots = compute_slot_mapping(table, positions, qsl, 16, 16, num_slots=32)
        reshape_and_cache(key, value, view, slots, layout)
        return slots

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up (compiles the kernels) outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slots_out = step()

    table.copy_(torch.arange(32, dtype=torch.int32).reshape(4, 8))
    qsl.copy_(torch.tensor([0, 3, 3, 10, 12]))
    positions.copy_(torch.tensor([0, 1, 2] + list(range(5, 12)) + [0, 1] + [0] * 20))
    key.copy_(torch.randn(32, 2, 128))
    value.copy_(torch.randn(32, 2, 128))
    graph.replay()
    torch.cuda.synchronize()
    expected = compute_slot_mapping(table.cpu(), positions.cpu(), qsl.cpu(), 16, 16, num_slots=32)
    assert torch.equal(slots_out.cpu(), expected)
    keep = expected >= 0
    k, v = read_kv(view, layout, expected[keep].cuda())
    assert torch.equal(k, key[keep.cuda()].float())
    assert torch.equal(v, value[keep.cuda()].float())
