"""kv_kernels.warmup: the launches a serving step makes, built before the first request.

On the CPU (CI): the call list and the argument checks (nothing compiles there: the interpreter).
On an sm_90 GPU (``-m gpu``): after :func:`warm_paged_ops`, a serving step of other lengths over
the same cache builds nothing more (Triton's post-compile hook counts every build, disk-cache
loads included), with one process and with child processes; a planted gap (a warmup that skips
the decode calls) is caught by the same count.
"""

from __future__ import annotations

import pytest
import torch
from kv_kernels import warmup
from kv_kernels.warmup import warm_paged_ops, warmup_calls
from kv_spec import KVCacheLayout


def _layout(**over) -> KVCacheLayout:
    kw = dict(order="LBNHC", num_layers=2, num_blocks=64, num_kv_heads=2, block_size=16,
              head_size=128, head_size_v=128, dtype="bfloat16")  # fmt: skip
    kw.update(over)
    return KVCacheLayout(**kw)


def test_calls_cover_write_prefill_decode_and_split_decode() -> None:
    calls = warmup_calls(_layout(), max_seq_len=4096, block_table_width=300)
    ops = [c.op for c in calls]
    assert ops.count("write") == 1 and ops.count("attention") == 7
    assert {c.width for c in calls if c.op == "attention"} == {300}
    q_lens = [q for c in calls for q, _ in c.seqs]
    assert max(q_lens) > 16 and 1 in q_lens  # both launch classes
    assert any(len(c.seqs) == 1 and c.seqs[0] == (1, 4096) for c in calls)  # batch 1, long
    assert any(len(c.seqs) > 1 and all(q == 1 for q, _ in c.seqs) for c in calls)
    # sequence counts of 1, neither, and a multiple of 16, in decode and in mixed steps
    assert {len(c.seqs) for c in calls if c.op == "attention"} >= {1, 2, 4, 16}
    assert any(len(c.seqs) == 16 and max(q for q, _ in c.seqs) > 16 for c in calls)
    # a mixed step whose decodes are long: the split decode beside a prompt (decode-only merge)
    assert any(
        max(q for q, _ in c.seqs) > 16 and (1, 4096) in c.seqs for c in calls if c.op != "write"
    )


def test_both_kinds_of_table_width_without_a_width() -> None:
    """Unknown table width: each attention call at an odd width and at a multiple of 16 (the
    kernels specialize it), every sequence fitting its table."""
    calls = warmup_calls(_layout(), max_seq_len=8192)
    widths = sorted({c.width for c in calls if c.op == "attention"})
    assert len(widths) == 2 and widths[0] % 2 == 1 and widths[1] % 16 == 0
    for c in calls:
        for _, seq_len in c.seqs:
            assert seq_len <= (c.width - 1) * 16


def test_narrow_tables_hold_every_sequence_and_keep_their_stride() -> None:
    calls = warmup_calls(_layout(), block_table_width=3, block_table_stride=40)
    for c in calls:
        assert all(s <= (c.width - 1) * 16 for _, s in c.seqs), c
        assert c.op == "write" or (c.width, c.row_stride) == (3, 40)


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"block_table_width": 8, "block_table_stride": 7}, "block_table_stride=7 must be an int >= "),
     ({"block_table_stride": 64}, "block_table_stride needs block_table_width")],
)  # fmt: skip
def test_bad_table_stride_is_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        warmup_calls(_layout(), **kw)


@pytest.mark.parametrize("width", [0, 1, 2.5, True, "64"])
def test_bad_table_width_is_refused(width: object) -> None:
    with pytest.raises(ValueError, match="block_table_width=.* must be an int >= 2"):
        warmup_calls(_layout(), block_table_width=width)  # type: ignore[arg-type]


def test_small_layout_keeps_stride_divisibility() -> None:
    """The child processes' caches: 64 blocks, so LHBNC's head stride (blocks x page) still
    divides by 16 and the children build the variant the real cache launches."""
    small = warmup._small_layout(_layout(order="LHBNC", num_blocks=1000))
    assert small.num_blocks == 64 and small.order.value == "LHBNC"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"jobs": 0}, r"jobs=0 must be an int >= 1"),
        ({"jobs": True}, r"jobs=True"),
        ({"scratch_block": 64}, r"scratch_block=64 must be a block id in \[0, 64\)"),
        ({"scratch_block": -1}, r"scratch_block=-1"),
        ({"scratch_block": 1.0}, r"scratch_block=1.0"),
    ],
)
def test_bad_arguments_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        warm_paged_ops(torch.zeros(1), _layout(), num_q_heads=8, **kw)


def test_layout_must_be_a_layout() -> None:
    with pytest.raises(TypeError, match="KVCacheLayout"):
        warm_paged_ops(torch.zeros(1), {"order": "LBNHC"}, num_q_heads=8)  # type: ignore[arg-type]


def test_cpu_builds_nothing() -> None:
    assert warm_paged_ops(torch.zeros(1), _layout(), num_q_heads=8) == {}


@pytest.mark.parametrize("k_scale", [None, 0.5], ids=["stand-in", "layer's"])
def test_every_call_runs_over_an_fp8_mla_latent(k_scale: float | None) -> None:
    """Each warmup call's arguments over an fp8 latent (issue 31), run through the torch
    references on the CPU: the write and attention take the latent's one ``k_scale`` (the
    layer's, else a stand-in) and no ``v_scale``, which both ops refuse for an MLA latent;
    K/V caches keep both (the planted case: a stand-in ``v_scale`` on the latent is refused)."""
    from kv_kernels.cache import allocate_kv_cache, layer_view

    layout = _layout(num_layers=1, num_blocks=40, num_kv_heads=1, head_size=80, head_size_v=0,
                     dtype="fp8_e4m3", kv_quant="fp8_per_tensor", is_mla=True)  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout), layout, 0)
    kw: dict = {"kv_lora_rank": 64, **({} if k_scale is None else {"k_scale": k_scale})}
    calls = warmup_calls(layout, max_seq_len=96, block_table_width=8)
    assert {c.op for c in calls} >= {"write"} and len(calls) > 2
    for call in calls:
        warmup._run(call, kv, layout, num_q_heads=4, q_dtype=torch.float32, scratch_block=0,
                    attention_kwargs=dict(kw))  # fmt: skip
    assert warmup._scales(_layout(dtype="fp8_e4m3", kv_quant="fp8_per_tensor")) == {
        "k_scale": 1.0, "v_scale": 1.0,
    }  # fmt: skip
    with pytest.raises(ValueError, match="pass v_scale=None"):
        warmup._run(calls[-1], kv, layout, num_q_heads=4, q_dtype=torch.float32, scratch_block=0,
                    attention_kwargs={**kw, "v_scale": 1.0})  # fmt: skip


# ---- on an sm_90 GPU ---------------------------------------------------------------------------

_ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


#: the serving step's block-table width (the warmup is told it, as an engine would)
WIDTH = 512


def _serving_step(kv, layout, hq, **kw) -> None:
    """A step of other lengths than the warmup's: a chunk, decode rows, then decode alone."""
    from kv_kernels import paged_attention, reshape_and_cache

    dev = kv.device
    d, dv, h = layout.head_size, layout.head_size_v, layout.num_kv_heads
    slots = torch.arange(40, 80, device=dev)
    reshape_and_cache(
        torch.randn(40, h, d, device=dev, dtype=torch.bfloat16),
        torch.randn(40, h, dv, device=dev, dtype=torch.bfloat16),
        kv,
        slots,
        layout,
    )
    # (one token written; a decode batch of 16: counts of 1 and multiples of 16 specialize
    # unless the kernel says not to)
    reshape_and_cache(
        torch.randn(1, h, d, device=dev, dtype=torch.bfloat16),
        torch.randn(1, h, dv, device=dev, dtype=torch.bfloat16),
        kv,
        slots[:1],
        layout,
    )
    for q_lens, seq_lens in (([200, 1, 1], [700, 90, 33]), ([1] * 5, [5000, 17] + [900] * 3),
                             ([1], [6000]), ([1] * 16, [3000] * 16)):  # fmt: skip
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        table = torch.randint(1, layout.num_blocks, (len(q_lens), WIDTH),
                              dtype=torch.int32, device=dev)  # fmt: skip
        q = torch.randn(sum(q_lens), hq, d, device=dev, dtype=torch.bfloat16)
        paged_attention(q, kv, layout, table, torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                        qsl.to(dev), max(q_lens), **kw)  # fmt: skip
    torch.cuda.synchronize()


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every kernel build from here on (Triton's post-compile hook)."""
    from triton import knobs

    seen: list[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        seen.append(repr)

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    return seen


@pytest.mark.parametrize("jobs", [1, 3])
@pytest.mark.parametrize(
    ("heads", "kw"),
    [((128, 128), {}), ((192, 128), {"sliding_window": 128, "sinks": "sinks"})],
    ids=["llama", "mimo-swa"],
)
@pytest.mark.gpu
@pytest.mark.skipif(not _ON_SM90, reason="the builds warmed are sm_90's")
def test_gpu_no_build_after_warmup(
    heads: tuple[int, int], kw: dict, jobs: int, builds: list[str], monkeypatch, tmp_path
) -> None:
    from kv_kernels.cache import allocate_kv_cache, layer_view

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # cold: every variant builds
    layout = _layout(num_blocks=512, num_kv_heads=4, head_size=heads[0], head_size_v=heads[1])
    kv = layer_view(allocate_kv_cache(layout, "cuda"), layout, 1)
    hq = 32
    if kw.get("sinks"):
        kw = dict(kw, sinks=torch.zeros(hq, device="cuda"))
    times = warm_paged_ops(
        kv, layout, num_q_heads=hq, jobs=jobs, max_seq_len=8192, block_table_width=WIDTH, **kw
    )
    assert set(times) == {c.name for c in warmup_calls(layout, block_table_width=WIDTH)}
    builds.clear()
    _serving_step(kv, layout, hq, **kw)
    assert builds == [], f"built after the warmup: {builds}"


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_SM90, reason="the builds warmed are sm_90's")
def test_gpu_a_warmup_without_decode_is_caught(builds: list[str], monkeypatch, tmp_path) -> None:
    """The check above can fail: a warmup that leaves out the decode calls leaves builds."""
    from kv_kernels.cache import allocate_kv_cache, layer_view

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    real = warmup.warmup_calls
    monkeypatch.setattr(
        warmup,
        "warmup_calls",
        lambda layout, **k: [c for c in real(layout, **k) if "decode" not in c.name],
    )
    layout = _layout(num_blocks=512, num_kv_heads=4, head_size=64, head_size_v=64)
    kv = layer_view(allocate_kv_cache(layout, "cuda"), layout, 1)
    warm_paged_ops(kv, layout, num_q_heads=16, block_table_width=WIDTH)
    builds.clear()
    _serving_step(kv, layout, 16)
    assert builds, "a decode-only step built nothing although its variants were never warmed"


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_SM90, reason="the builds warmed are sm_90's")
def test_gpu_no_build_after_warming_an_fp8_mla_latent(
    builds: list[str], monkeypatch, tmp_path
) -> None:
    """DeepSeek-V3 at tensor-parallel 8 over an fp8 latent (issue 31): warmed with the layer's
    own ``k_scale`` tensor (what TRITON_MLA's warmup passes), a serving step of latent writes
    and MLA decode / prefill batches builds nothing more."""
    from kv_kernels import paged_attention, reshape_and_cache
    from kv_kernels.cache import allocate_kv_cache, layer_view

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    layout = _layout(num_layers=1, num_blocks=512, num_kv_heads=1, block_size=64, head_size=576,
                     head_size_v=0, dtype="fp8_e4m3", kv_quant="fp8_per_tensor", is_mla=True)  # fmt: skip
    kv = layer_view(allocate_kv_cache(layout, "cuda"), layout, 0)
    hq, k_scale = 16, torch.full((), 0.05, device="cuda")
    kw = dict(kv_lora_rank=512, k_scale=k_scale)
    warm_paged_ops(kv, layout, num_q_heads=hq, max_seq_len=8192, block_table_width=WIDTH, **kw)
    builds.clear()
    for n in (40, 1):
        latent = torch.randn(n, 1, 576, device="cuda", dtype=torch.bfloat16)
        reshape_and_cache(latent, None, kv, torch.arange(64, 64 + n, device="cuda"), layout,
                          k_scale)  # fmt: skip
    for q_lens, seq_lens in (([200, 1, 1], [700, 90, 33]), ([1] * 5, [5000, 17] + [900] * 3),
                             ([1], [6000]), ([1] * 16, [3000] * 16)):  # fmt: skip
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        table = torch.randint(1, layout.num_blocks, (len(q_lens), WIDTH),
                              dtype=torch.int32, device="cuda")  # fmt: skip
        q = torch.randn(sum(q_lens), hq, 576, device="cuda", dtype=torch.bfloat16)
        paged_attention(q, kv, layout, table, torch.tensor(seq_lens, dtype=torch.int32,
                        device="cuda"), qsl.cuda(), max(q_lens), **kw)  # fmt: skip
    torch.cuda.synchronize()
    assert builds == [], f"built after the warmup: {builds}"
