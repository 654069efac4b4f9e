from __future__ import annotations

import importlib.util

import pytest
from kv_spec import DTYPE_BYTES, KVQuantMode, dtype_bytes, normalize_dtype, to_torch_dtype


def test_byte_sizes_are_the_published_ones() -> None:
    assert DTYPE_BYTES == {
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "fp8_e4m3": 1,
        "fp8_e5m2": 1,
        "int8": 1,
        "uint8": 1,
    }


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("bf16", "bfloat16"),
        ("torch.float16", "float16"),
        ("float8_e4m3fn", "fp8_e4m3"),
        ("int8", "int8"),
    ],
)
def test_aliases_map_to_canonical_names(given: str, canonical: str) -> None:
    assert normalize_dtype(given) == canonical


def test_unknown_dtype_names_the_value_and_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"dtype='float64' is not a known KV-cache dtype; use one of"
    ):
        dtype_bytes("float64")


def test_to_torch_dtype_is_lazy() -> None:
    if importlib.util.find_spec("torch") is None:
        with pytest.raises(ModuleNotFoundError):
            to_torch_dtype("bfloat16")
    else:
        import torch

        assert to_torch_dtype("fp8_e4m3") is torch.float8_e4m3fn
        assert to_torch_dtype("bf16") is torch.bfloat16


def test_quant_modes_parse_and_say_what_they_store() -> None:
    assert KVQuantMode.parse("int8_per_token_head") is KVQuantMode.INT8_PER_TOKEN_HEAD
    assert KVQuantMode.FP8_PER_TOKEN_HEAD.per_token_head
    assert not KVQuantMode.FP8_PER_TENSOR.per_token_head
    assert KVQuantMode.INT8_PER_TOKEN_HEAD.allowed_dtypes == {"int8"}
    with pytest.raises(ValueError, match="kv_quant='int4' is not a known quant mode"):
        KVQuantMode.parse("int4")
