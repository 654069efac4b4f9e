"""MLA absorbed decode through ``paged_attention``: one latent row per token (``kv_lora_rank`` +
rope columns), K = the whole row, V = its first ``kv_lora_rank`` columns of the same storage.

DeepSeek-V3 is 128 query heads over a 512 + 64 latent at page 64; under the interpreter the
shapes are scaled down (latent 64 + 16, 8 or 32 heads) but take the same code paths: the head
split into a power-of-two main tile and a tail, V read from K's tile, and (forced here with a
small config) query heads split over programs. The oracle attends over the latent rows the test
itself drew (never the cache), with V sliced from them.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernels import testing_attention
from kv_kernels.paged_attention import paged_attention
from kv_kernels.paged_attention._tiles import pick_num_splits, select_config
from kv_kernels.testing import (
    assert_close_to_oracle,
    check_close_to_oracle,
    plant_wrong_page,
)
from kv_kernels.testing_attention import run_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RANK, ROPE = 64, 16


def make_mla_batch(**kw) -> dict:
    return testing_attention.make_mla_batch(**{"rank": RANK, "rope": ROPE, "device": DEVICE, **kw})


def run(b: dict, impl: str, **kw) -> torch.Tensor:
    return run_batch(b, impl, kv_lora_rank=b["rank"], scale=0.1, **kw)


def oracle(b: dict) -> torch.Tensor:
    return testing_attention.mla_oracle(b, 0.1)[0]


DECODE = dict(q_lens=[1, 1, 1, 1], seq_lens=[70, 1, 33, 16])


def test_reference_matches_oracle() -> None:
    b = make_mla_batch(q_lens=[1, 4, 1], seq_lens=[40, 20, 1])
    out = run(b, "reference")
    assert out.shape == (6, 8, RANK)
    assert_close_to_oracle(out.cpu(), oracle(b), dtype=torch.float32)


def test_triton_decode_matches_oracle(triton_device: str) -> None:
    b = make_mla_batch(**DECODE)
    want = oracle(b)
    assert_close_to_oracle(run(b, "triton").cpu(), want, dtype=torch.float32)
    assert_close_to_oracle(run(b, "triton", num_splits=2).cpu(), want, dtype=torch.float32)


def test_triton_chunked_prefill_and_fp16(triton_device: str) -> None:
    b = make_mla_batch(q_lens=[6, 1], seq_lens=[30, 17], dtype=torch.float16)
    assert_close_to_oracle(run(b, "triton").cpu(), oracle(b), dtype=torch.float16)


def test_triton_heads_split_over_programs(
    triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V3's 128 heads x 512 do not fit one program's accumulator, so the config gives
    each program a chunk of the heads; force that here with 32 heads in chunks of 16."""
    launcher = importlib.import_module("kv_kernels.paged_attention.triton")

    def small_chunks(kind: str, **shape):
        cfg = select_config(kind, **shape)
        return dataclasses.replace(cfg, block_m=16, block_q=1, heads_per_program=16)

    monkeypatch.setattr(launcher, "select_config", small_chunks)
    b = make_mla_batch(q_lens=[1, 1, 2], seq_lens=[40, 9, 20], num_heads=32)
    assert_close_to_oracle(run(b, "triton").cpu(), oracle(b), dtype=torch.float32)


def test_deepseek_v3_config_splits_heads() -> None:
    cfg = select_config("decode", head_size=576, head_size_v=512, group=128, block_size=64,
                        arch=90, v_from_k=True)  # fmt: skip
    # 64 of the 128 heads per program, over 8 warps: Hopper's warpgroup MMA (MLA is MMA-bound)
    assert (cfg.block_m, cfg.block_q, cfg.heads_per_program, cfg.num_warps) == (64, 1, 64, 8)
    # the latent tile is the only KV tile: no separate V row in the shared-memory budget; the
    # q tile (64 x 576) and two stages of 64-token latent tiles fill the SM's 227 KiB, and one
    # such program fills an SM
    assert cfg.tile_n == 64 and cfg.num_stages == 2 and cfg.waves == 1
    assert (cfg.num_stages * cfg.tile_n + cfg.block_m) * 576 * 2 <= 227 * 1024
    # an fp8 latent needs an fp16 copy of each tile: one stage of 32 tokens
    cfg8 = select_config("decode", head_size=576, head_size_v=512, group=128, block_size=64,
                         arch=90, v_from_k=True, elem_bytes=1)  # fmt: skip
    assert (cfg8.tile_n, cfg8.num_stages) == (32, 1)
    # without the warpgroup MMA (sm_80) the accumulator of 64 heads x 512 would not fit
    cfg80 = select_config("decode", head_size=576, head_size_v=512, group=128, block_size=64,
                          arch=80, v_from_k=True)  # fmt: skip
    assert (cfg80.block_m, cfg80.heads_per_program) == (32, 32)


def test_tensor_parallel_mla_config_fills_one_wave_of_two_programs_an_sm() -> None:
    # DeepSeek-V3 at TP 8 (16 heads): bandwidth-bound; 64-token tiles, and the splits fill one
    # wave of two-per-SM slots (the split counts the graph-timed sweeps found best on both cards)
    cfg = select_config("decode", head_size=576, head_size_v=512, group=16, block_size=64,
                        arch=90, v_from_k=True)  # fmt: skip
    assert (cfg.tile_n, cfg.num_warps, cfg.num_stages) == (64, 4, 2)
    assert (cfg.waves, cfg.programs_per_sm, cfg.max_registers) == (1, 2, 0)
    kw = dict(num_kv_heads=1, tile_n=cfg.tile_n, num_sms=132, waves=1)
    # 64 x 4k: 4 splits make 256 programs (<= 264 slots); 8 would need two waves
    assert pick_num_splits(num_seqs=64, max_seq_len=4096, programs_per_sm=2, **kw) == 4
    # 8 x 32k: 32 splits (256 programs, 16 tiles each)
    assert pick_num_splits(num_seqs=8, max_seq_len=32768, programs_per_sm=2, **kw) == 32
    # one program an SM (MLA at 128 heads): half the programs
    assert pick_num_splits(num_seqs=64, max_seq_len=4096, programs_per_sm=1, **kw) == 2


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_wrong_page_fails_the_check(impl: str, request: pytest.FixtureRequest) -> None:
    if impl == "triton":
        request.getfixturevalue("triton_device")
    b = make_mla_batch(q_lens=[1, 1], seq_lens=[64, 20])
    b["kv"].nan_to_num_(0.0)  # the spare page is read on purpose here
    b["block_table"] = plant_wrong_page(
        b["block_table"].cpu(), [64, 20], 16, b["layout"].num_blocks
    ).to(DEVICE)
    assert not check_close_to_oracle(run(b, impl).cpu(), oracle(b), dtype=torch.float32).ok


def test_mla_arguments_are_checked() -> None:
    b = make_mla_batch(q_lens=[1], seq_lens=[5])
    with pytest.raises(ValueError, match="kv_lora_rank"):
        paged_attention(b["q"], b["kv"], b["layout"], b["block_table"], b["seq_lens"], b["qsl"], 1)
    with pytest.raises(ValueError, match="kv_lora_rank=80 must be <"):
        run(dict(b, rank=80), "reference")
    with pytest.raises(ValueError, match="power-of-two latent"):
        run(dict(b, rank=48), "triton")


@pytest.mark.gpu
def test_gpu_deepseek_v3_shapes_bf16() -> None:
    """DeepSeek-V3 decode at its real shapes (128 heads, 512 + 64, page 64, bf16): the compiled
    kernel (heads split over programs, split KV) against the oracle, with the bf16 torch run as
    the low-precision reference; one wrong page must fail the same check."""
    b = make_mla_batch(q_lens=[1, 1, 1], seq_lens=[3000, 700, 64], num_heads=128, rank=512,
                       rope=64, block_size=64, dtype=torch.bfloat16)  # fmt: skip
    b["kv"].nan_to_num_(0.0)
    want = oracle(b)
    low = run(b, "reference").cpu()  # float32 math, rounded to bf16 once
    assert_close_to_oracle(run(b, "triton").cpu(), want, lowprec_reference=low)
    bad = dict(b, block_table=plant_wrong_page(b["block_table"].cpu(), [3000, 700, 64], 64,
                                               b["layout"].num_blocks).to(DEVICE))  # fmt: skip
    assert not check_close_to_oracle(run(bad, "triton").cpu(), want, lowprec_reference=low).ok
