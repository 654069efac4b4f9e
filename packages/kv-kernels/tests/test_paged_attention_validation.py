"""Paged attention's input checks: host-side validation errors (arguments, layouts, q_len >
seq_len), the device-side ``error_flag`` that counts bad metadata without host checks (and a fuzz
over any block table), and the registered custom op under ``opcheck`` and ``torch.compile``.
Batches and the oracle: ``kv_kernels.testing_attention``.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    # conftest does the same; repeated here so the module also runs on its own. Must precede the
    # first import of kv_kernels.paged_attention.triton (imported lazily by the api).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import paged_attention
from kv_kernels.testing_attention import (
    assert_lse_close,
    assert_rows_close,
    batch_oracle,
    make_paged_batch,
    run_batch,
)
from kv_spec import KVCacheLayout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------


def _small() -> dict:
    return make_paged_batch(q_lens=[2], seq_lens=[5], head_size=16, device="cpu")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b.update(q=b["q"][..., :8]), "head_size"),
        (lambda b: b.update(q=b["q"].double()), "float16/bfloat16/float32"),
        (lambda b: b.update(q=b["q"][:, :3]), "multiple"),
        (lambda b: b.update(block_table=b["block_table"].float()), "block_table"),
        (lambda b: b.update(seq_lens=b["seq_lens"][:0]), "seq_lens"),
        (lambda b: b.update(qsl=b["qsl"][:1]), "query_start_loc"),
        (lambda b: b.update(kv=b["kv"][:1]), "layer view"),
        (lambda b: b.update(max_query_len=1), "max_query_len"),
        (lambda b: b.update(seq_lens=torch.tensor([500], dtype=torch.int32)), "columns"),
    ],
)
def test_validation_errors(mutate, match: str) -> None:
    b = _small()
    mutate(b)
    with pytest.raises(ValueError, match=match):
        run_batch(b, "reference")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"impl": "cuda"}, "impl"),
        ({"sinks": torch.zeros(3)}, "sinks"),
        ({"alibi_slopes": torch.zeros(8, dtype=torch.float64)}, "alibi_slopes"),
        ({"softcap": -1.0}, "softcap"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"num_splits": 0}, "num_splits"),
        ({"k_scale": 1.0}, "not quantized"),
        ({"out": torch.empty(2, 8, 15)}, "out must be"),
    ],
)
def test_validation_errors_kwargs(kw: dict, match: str) -> None:
    b = _small()
    impl = kw.pop("impl", "reference")
    with pytest.raises(ValueError, match=match):
        run_batch(b, impl, **kw)


def test_unsupported_layouts_are_named() -> None:
    b = _small()
    mla = KVCacheLayout(
        order="LBNHC",
        num_layers=1,
        num_blocks=4,
        num_kv_heads=1,
        block_size=16,
        head_size=32,
        head_size_v=0,
        dtype="float32",
        is_mla=True,
    )
    with pytest.raises(ValueError, match="MLA layout .* needs kv_lora_rank"):
        paged_attention(b["q"], b["kv"], mla, b["block_table"], b["seq_lens"], b["qsl"], 2)
    # (per-token-head quantized caches are read since issue 12: test_paged_attention_quant.py)
    fp8 = KVCacheLayout(
        order="LBNHC",
        num_layers=1,
        num_blocks=b["layout"].num_blocks,
        num_kv_heads=2,
        block_size=16,
        head_size=16,
        head_size_v=16,
        dtype="fp8_e4m3",
        kv_quant="fp8_per_tensor",
    )
    kv8 = layer_view(allocate_kv_cache(fp8), fp8, 0)
    with pytest.raises(ValueError, match="k_scale is required"):
        paged_attention(b["q"], kv8, fp8, b["block_table"], b["seq_lens"], b["qsl"], 2)
    with pytest.raises(ValueError, match=r"\[2\]"):
        paged_attention(
            b["q"],
            kv8,
            fp8,
            b["block_table"],
            b["seq_lens"],
            b["qsl"],
            2,
            k_scale=torch.ones(3),
            v_scale=1.0,
        )


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_query_longer_than_sequence_is_an_error(impl: str) -> None:
    """q_len > seq_len used to return all-zero rows; it is an input error (DESIGN: attention
    semantics), named with the sequence, both lengths and the fix. Host-side lengths: CPU
    tensors (CUDA calls count it in ``error_flag`` instead, tested below)."""
    if impl == "triton" and DEVICE == "cuda":
        # the Triton kernels take CUDA tensors on a GPU machine (CPU ones only interpreted)
        pytest.skip("host-side length check of CPU tensors; the GPU path is the error flag's")
    b = make_paged_batch(q_lens=[1, 3], seq_lens=[6, 5], head_size=16, device="cpu")
    b["seq_lens"][1] = 2
    with pytest.raises(ValueError, match=r"sequence 1 has query_len=3 > seq_lens\[1\]=2"):
        run_batch(b, impl)


@pytest.mark.parametrize(
    "options",
    [
        {},  # causal (the default)
        {"causal": False, "sliding_window": 4},
        {"causal": False, "alibi_slopes": "alibi"},
    ],
    ids=["causal", "noncausal_window", "noncausal_alibi"],
)
def test_query_longer_than_sequence_needs_a_position_free_call(options: dict) -> None:
    """More queries than keys is cascade attention's prefix pass, allowed only where no rule
    reads a position (non-causal, no window, no ALiBi); with any such rule it stays an error
    whose message names the way out."""
    b = make_paged_batch(q_lens=[1, 3], seq_lens=[6, 5], head_size=16, device="cpu")
    b["seq_lens"][1] = 2
    kw = dict(options)
    if kw.get("alibi_slopes") == "alibi":
        kw["alibi_slopes"] = torch.full((b["q"].shape[1],), 0.1)
    with pytest.raises(ValueError, match=r"query_len=3 > seq_lens\[1\]=2.*causal=False"):
        run_batch(b, "reference", **kw)
    out = run_batch(b, "reference", causal=False)  # position-free: every query sees both keys
    assert torch.isfinite(out).all()


def test_error_flag_quiet_on_a_position_free_prefix_pass(triton_device: str) -> None:
    """A cascade's prefix pass (5 queries, 3 keys, non-causal) is valid: the flag stays 0; the
    same metadata on a causal call has no positions for its first rows and is counted."""
    b = make_paged_batch(q_lens=[5], seq_lens=[5], head_size=16, group=2)
    b["seq_lens"][0] = 3
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    run_batch(b, "triton", causal=False, error_flag=flag, validate=False)
    assert int(flag) == 0
    run_batch(b, "triton", causal=True, error_flag=flag, validate=False)
    assert int(flag) == 1


# ------------------------------------------------------------------------------------------
# the device-side error flag
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 64])  # tiles spanning pages / inside one page
def test_error_flag_counts_bad_metadata_without_host_checks(
    block_size: int, triton_device: str
) -> None:
    """validate=False is what CUDA tensors get by default: the kernel must neither crash nor read
    outside the cache on bad ids / q_len > seq_len, and it counts them in error_flag."""
    b = make_paged_batch(
        q_lens=[1, 2, 1], seq_lens=[140, 20, 30], head_size=16, group=2, block_size=block_size
    )
    nb = b["layout"].num_blocks
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    run_batch(b, "triton", error_flag=flag, validate=False)
    assert int(flag) == 0, "valid metadata must not raise the flag"
    bad = dict(b)
    table = b["block_table"].clone()
    table[0, 1] = nb + 10_000_000  # far past the cache: an unmasked read would fault
    table[2, 0] = -7
    bad["block_table"] = table
    out = run_batch(bad, "triton", error_flag=flag, validate=False)
    assert int(flag) > 0
    assert torch.isfinite(out[1:3]).all()  # the healthy request is untouched by its neighbours
    assert_rows_close(out[1:3], batch_oracle(b)[0][1:3], torch.float32)
    flag.zero_()
    short = dict(b, seq_lens=b["seq_lens"].clone())
    short["seq_lens"][1] = 1  # q_len 2 > seq_len 1
    run_batch(short, "triton", error_flag=flag, validate=False)
    assert int(flag) >= 1
    with pytest.raises(ValueError, match="outside"):
        run_batch(bad, "triton", validate=True)  # the debug mode checks on the host


def test_error_flag_is_validated() -> None:
    b = _small()
    with pytest.raises(ValueError, match="error_flag must be an int32"):
        run_batch(b, "reference", error_flag=torch.zeros(1))


# ------------------------------------------------------------------------------------------
# custom op
# ------------------------------------------------------------------------------------------


def test_custom_op_opcheck() -> None:
    b = make_paged_batch(q_lens=[3, 1], seq_lens=[20, 9], head_size=16, device="cpu")
    b["kv"].nan_to_num_(0.0)  # opcheck compares whole tensors across runs
    out = torch.empty(4, 8, 16)
    lse = torch.empty(4, 8)
    args = (
        b["q"],
        b["kv"],
        b["layout"].to_json(),
        b["block_table"],
        b["seq_lens"],
        b["qsl"],
        3,
        -1,
        0.25,
        True,
        -1,
        torch.randn(8),
        0.0,
        None,
        None,
        None,
        0,
        out,
        lse,
        "reference",
        None,  # error_flag: required (nullable), see kv_kernels._ops
    )
    torch.library.opcheck(torch.ops.kv_kernels.paged_attention.default, args)


def test_torch_compile_runs_the_custom_op() -> None:
    b = make_paged_batch(q_lens=[3, 1], seq_lens=[20, 9], head_size=16, device="cpu")

    def step(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return paged_attention(
            q,
            b["kv"],
            b["layout"],
            b["block_table"],
            b["seq_lens"],
            b["qsl"],
            3,
            sliding_window=6,
            return_lse=True,
            impl="reference",
        )

    out, lse = torch.compile(step, backend="eager", fullgraph=True)(b["q"])
    ref, ref_lse = batch_oracle(b, sliding_window=6)
    assert_rows_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse)


@settings(max_examples=int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "8")), deadline=None)
@given(
    ids=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=6, max_size=6),
    lens=st.lists(st.integers(1, 90), min_size=2, max_size=2),
)
def test_fuzz_kernel_never_leaves_the_cache(ids: list[int], lens: list[int]) -> None:
    """Any block table (ids anywhere in int32) and any seq_lens up to past the table's width: the
    kernel runs without a fault, writes finite rows, and the flag is nonzero exactly when some
    page under a sequence is invalid."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or the Triton interpreter")
    b = make_paged_batch(q_lens=[1, 1], seq_lens=[40, 40], head_size=16, group=2, block_size=16)
    b["kv"].nan_to_num_(0.0)
    nb = b["layout"].num_blocks
    table = torch.tensor(ids, dtype=torch.int32).reshape(2, 3).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = run_batch(
        dict(b, block_table=table, seq_lens=seq_lens), "triton", error_flag=flag, validate=False
    )
    assert torch.isfinite(out).all()
    bad = any(
        not 0 <= (ids[3 * s + p] if p < 3 else -1) < nb
        for s, L in enumerate(lens)
        for p in range(-(-L // 16))
    )
    assert (int(flag) > 0) == bad
