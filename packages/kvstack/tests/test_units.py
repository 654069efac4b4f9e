from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvstack.units import MAX_BYTES, format_bytes, parse_bytes, parse_count


@pytest.mark.parametrize(
    ("text", "n"),
    [("40GiB", 40 * 2**30), ("512 MiB", 2**29), ("1e9", 10**9), ("2kb", 2000), ("1.5KiB", 1536)],
)
def test_parse_bytes(text: str, n: int) -> None:
    assert parse_bytes(text) == n


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("abc", "cannot read 'abc' as a byte size"),
        ("-1", "is negative"),
        ("1e400", "is larger than"),
        ("2e18", "is larger than"),
        ("0", "is zero"),
        ("0.5b", "not a whole number of bytes"),
        ("12 parsecs", "cannot read"),
        ("", "cannot read"),
    ],
)
def test_parse_bytes_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_bytes(text)


@given(st.integers(min_value=1, max_value=MAX_BYTES))
def test_parse_bytes_round_trips_integers(n: int) -> None:
    assert parse_bytes(str(n)) == n


def test_parse_count() -> None:
    assert parse_count("32k") == 32768
    assert parse_count("16") == 16
    assert parse_count("0", minimum=0) == 0
    with pytest.raises(ValueError, match=r"--tp='abc' is not a whole number"):
        parse_count("abc", name="--tp")
    with pytest.raises(ValueError, match="must be at least 1"):
        parse_count("-1", name="--tp")
    with pytest.raises(ValueError, match="beyond 2\\^62"):
        parse_count("9" * 30)


def test_format_bytes() -> None:
    assert format_bytes(65536) == "64.00 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(12) == "12 B"


@pytest.mark.parametrize(
    ("extra", "window", "sliding"),
    [
        ({"model_type": "qwen3", "sliding_window": 8}, None, ()),  # Qwen3 as released: no window
        (
            {
                "model_type": "qwen3",
                "sliding_window": 8,
                "use_sliding_window": True,
                "max_window_layers": 1,
            },
            8,
            (1, 2, 3),
        ),
        ({"model_type": "gpt_oss", "sliding_window": 8}, 8, (0, 2)),
        ({"model_type": "mistral", "sliding_window": 8}, 8, None),  # None: every layer
        (
            {
                "model_type": "x",
                "sliding_window": 8,
                "layer_types": ["full_attention", "sliding_attention"] * 2,
            },
            8,
            (1, 3),
        ),
    ],
)
def test_hf_config_sliding_layers_follow_transformers(
    extra: dict[str, object], window: int | None, sliding: tuple[int, ...] | None
) -> None:
    from kvstack.planning import model_from_hf_config

    m = model_from_hf_config(
        {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64, **extra}
    )
    assert m.head_size == 16 and m.num_kv_heads == 4
    assert m.sliding_window == window and m.sliding_layers == sliding
    assert m.has_sinks == (extra["model_type"] == "gpt_oss")
