"""Every ``SamplingParams`` field is checked (issue 28): hypothesis properties that exactly the
valid values are accepted (types: no bool as a number, no float as an int; ranges: seed within
64 bits, max_new_tokens >= 1, top_k >= 0, top_p in (0, 1], temperature 0 or >= 1e-5), and that
a refusal names the field; a misspelt option names the closest one."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstack.engine.sampling import MAX_SEED, MIN_TEMPERATURE, SamplingParams


def test_a_misspelt_option_names_the_closest() -> None:
    with pytest.raises(
        TypeError,
        match=r"SamplingParams: unknown option 'max_tokens' \(did you mean 'max_new_tokens'\?\)",
    ):
        SamplingParams(max_tokens=4)  # type: ignore[call-arg]


def test_bools_are_not_numbers_and_nothing_is_rounded() -> None:
    with pytest.raises(TypeError, match=r"SamplingParams.temperature=True is a bool"):
        SamplingParams(temperature=True)
    with pytest.raises(TypeError, match=r"SamplingParams.max_new_tokens=2.0 is a float"):
        SamplingParams(max_new_tokens=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"SamplingParams.stop_token_ids\[0\]=1.7 is a float"):
        SamplingParams(stop_token_ids=[1.7])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"SamplingParams.stop_token_ids='12' is a str"):
        SamplingParams(stop_token_ids="12")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"SamplingParams.seed=18446744073709551616 is outside"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match=r"temperature=1e-09 is below 1e-05"):
        SamplingParams(temperature=1e-9)


# -- hypothesis properties ------------------------------------------------------

ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(-3, 300), max_size=3),
)


def _valid(field: str, v: Any) -> bool:
    """What SamplingParams must accept for ``field`` (everything else is refused)."""
    is_int = isinstance(v, int) and not isinstance(v, bool)
    is_num = isinstance(v, (int, float)) and not isinstance(v, bool)
    if field == "max_new_tokens":
        return is_int and v >= 1
    if field == "temperature":
        if not is_num:
            return False
        try:
            f = float(v)
        except OverflowError:
            return False
        return math.isfinite(f) and (f == 0 or f >= MIN_TEMPERATURE)
    if field == "top_k":
        return is_int and v >= 0
    if field == "top_p":
        return is_num and 0 < v <= 1
    if field == "seed":
        return v is None or (is_int and 0 <= v <= MAX_SEED)
    if field in ("ignore_eos", "include_stop_str_in_output"):
        return isinstance(v, bool)
    if field == "stop_token_ids":
        return isinstance(v, list) and all(isinstance(t, int) and t >= 0 for t in v)
    raise AssertionError(field)


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(
        [
            "max_new_tokens",
            "temperature",
            "top_k",
            "top_p",
            "seed",
            "ignore_eos",
            "include_stop_str_in_output",
            "stop_token_ids",
        ]
    ),
    value=ANY,
)
def test_sampling_params_accept_exactly_the_valid_values(field: str, value: Any) -> None:
    valid = _valid(field, value)
    try:
        sp = SamplingParams(**{field: value})
    except (TypeError, ValueError) as e:
        assert not valid, f"{field}={value!r} refused: {e}"
        assert f"SamplingParams.{field}" in str(e)  # names the field (and the value)
        return
    assert valid, f"{field}={value!r} accepted"
    got = getattr(sp, field)
    if field in ("temperature", "top_p"):
        value = float(value)
    assert got == (tuple(value) if isinstance(value, list) else value)
    assert type(got) is not bool or isinstance(value, bool)  # no bool slips in as a number


@settings(max_examples=100, deadline=None)
@given(
    stop=st.one_of(
        st.text(max_size=4), st.lists(st.one_of(st.text(max_size=3), st.integers()), max_size=3)
    )
)
def test_stop_strings_are_non_empty_strings(stop: Any) -> None:
    items = [stop] if isinstance(stop, str) else stop
    valid = all(isinstance(s, str) and s for s in items)
    try:
        sp = SamplingParams(stop=stop)
    except (TypeError, ValueError) as e:
        assert not valid and "SamplingParams.stop" in str(e)
        return
    assert valid and sp.stop == tuple(items)
