"""Input validation at the public boundary (issue 28): every field of every config and of
KVTransferParams refuses a non-conforming value with a ValueError naming the class and the field
(nothing coerced: no ``int("5")``, no ``tuple("UCX")``, no truthy strings), and every conforming
value is kept as given (KVTransferParams: round-trips through its dict and JSON).

Property runs are CI-sized; ``KVSTACK_HYPOTHESIS_EXAMPLES`` raises the example count for longer runs."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_connectors import (
    EvictionPolicy,
    FilesystemConfig,
    KVRole,
    KVTransferParams,
    NixlConfig,
    OffloadingConfig,
    P2pConfig,
    TransferMode,
)

EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None)

# -- strategies ----------------------------------------------------------------------------------

_other = st.one_of(st.none(), st.lists(st.integers(), max_size=2), st.binary(max_size=4))


def bad_int(lo: int, hi: int | None = None) -> st.SearchStrategy[Any]:
    out = [
        st.integers(max_value=lo - 1),
        st.booleans(),
        st.floats(allow_nan=True),
        st.integers(min_value=lo, max_value=lo + 9).map(str),  # "5" is not 5
        _other,
    ]
    if hi is not None:
        out.append(st.integers(min_value=hi + 1))
    return st.one_of(*out)


def good_int(lo: int, hi: int | None = None) -> st.SearchStrategy[int]:
    return st.integers(min_value=lo, max_value=hi if hi is not None else lo + 2**40)


bad_timeout = st.one_of(
    st.floats(max_value=0),
    st.just(float("nan")),
    st.just(float("inf")),
    st.booleans(),
    st.floats(min_value=0.1, max_value=9).map(str),
    _other,
)
good_timeout = st.one_of(
    st.floats(min_value=1e-3, max_value=1e6, allow_nan=False), st.integers(1, 10**6)
)
bad_bool = st.one_of(st.integers(0, 1), st.sampled_from(["no", "yes", "false", "", "0"]), _other)
good_bool = st.booleans()
clean_text = st.text(min_size=1, max_size=20).filter(lambda s: s == s.strip())
bad_text = st.one_of(st.just(""), st.text(max_size=5).map(lambda s: f" {s}"), st.integers(), _other)


def bad_enum(valid: set[str]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.text(max_size=8).filter(lambda s: s.lower() not in valid), st.integers(), _other
    )


def enum_value(cls: type[Any], aliases: tuple[str, ...] = ()) -> st.SearchStrategy[Any]:
    names = [m.value for m in cls] + list(aliases)
    return st.one_of(
        st.sampled_from(list(cls)),
        st.sampled_from(names).flatmap(lambda s: st.sampled_from([s, s.upper(), s.title()])),
    )


bad_host = st.one_of(st.sampled_from(["", "0.0.0.0", "::", " 127.0.0.1"]), st.integers(), _other)
good_host = st.sampled_from(["127.0.0.1", "localhost", "::1", "10.1.2.3", "node-7.cluster"])
bad_fingerprint_opt = bad_text.filter(lambda v: v is not None)  # None: allowed where optional
good_fingerprint_opt = st.one_of(st.none(), clean_text)

# class -> field -> (bad values, good values); fields not named keep their defaults
ENDPOINT: dict[str, tuple[Any, Any]] = {
    "host": (bad_host, good_host),
    "port": (bad_int(0, 65535), good_int(0, 65535)),
    "engine_id": (bad_text, clean_text),
    "role": (bad_enum({"producer", "consumer", "both"}), enum_value(KVRole)),
    "mode": (
        bad_enum({"read", "write", "pull", "push"}),
        enum_value(TransferMode, ("pull", "push")),
    ),
    "timeout_s": (bad_timeout, good_timeout),
    "abandon_after_s": (bad_timeout, good_timeout),
    "model_fingerprint": (bad_fingerprint_opt, good_fingerprint_opt),
}
FIELDS: dict[type[Any], dict[str, tuple[Any, Any]]] = {
    OffloadingConfig: {
        "cpu_bytes": (bad_int(1), good_int(1)),
        "staging_bytes": (bad_int(1), good_int(1)),
        "pin_memory": (bad_bool, good_bool),
        "policy": (bad_enum({"lru", "arc"}), enum_value(EvictionPolicy)),
        "timeout_s": (bad_timeout, good_timeout),
    },
    FilesystemConfig: {
        "root": (st.one_of(st.just(""), st.integers(), _other), st.sampled_from(["/tmp/kv", "kv"])),
        "model_fingerprint": (st.one_of(st.none(), bad_text), clean_text),
        "fsync": (bad_bool, good_bool),
        "timeout_s": (bad_timeout, good_timeout),
        "stale_tmp_s": (bad_timeout, good_timeout),
        "staging_bytes": (bad_int(0), good_int(0)),
    },
    P2pConfig: {
        **ENDPOINT,
        "backend": (
            st.one_of(
                st.text(max_size=6).filter(lambda s: s not in ("auto", "gloo", "nccl")),
                st.integers(),
                _other,
            ),
            st.sampled_from(["auto", "gloo", "nccl"]),
        ),
        "buffer_bytes": (bad_int(1), good_int(1)),
        "receive_bytes": (bad_int(1), good_int(1)),
        "push_to": (
            st.one_of(
                st.text(max_size=8).filter(lambda s: ":" not in s),
                st.sampled_from(
                    [
                        "127.0.0.1:0",
                        "127.0.0.1:65536",
                        "127.0.0.1:x",
                        ":5000",
                        "0.0.0.0:5000",
                        "127.0.0.1:\u0661\u0662",
                    ]
                ),
                st.integers(),
            ),
            st.one_of(st.none(), good_int(1, 65535).map(lambda p: f"127.0.0.1:{p}")),
        ),
    },
    NixlConfig: {
        **ENDPOINT,
        "backends": (
            st.one_of(
                st.text(max_size=5),  # a bare string: ("U", "C", "X") once
                st.just(()),
                st.lists(bad_text, min_size=1, max_size=3),
                st.integers(),
                st.none(),
            ),
            st.lists(clean_text, min_size=1, max_size=3).flatmap(
                lambda xs: st.sampled_from([xs, tuple(xs)])
            ),
        ),
        "staging_bytes": (bad_int(1), good_int(1)),
        "progress_thread": (bad_bool, good_bool),
    },
}
REQUIRED: dict[type[Any], dict[str, Any]] = {
    OffloadingConfig: {"cpu_bytes": 1 << 20},
    FilesystemConfig: {"root": "/tmp/kv", "model_fingerprint": "m"},
    P2pConfig: {},
    NixlConfig: {},
}


@pytest.mark.parametrize("cls", list(FIELDS), ids=lambda c: c.__name__)
@SETTINGS
@given(data=st.data())
def test_config_refuses_any_bad_field_naming_it(cls: type[Any], data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(FIELDS[cls])), label="field")
    value = data.draw(FIELDS[cls][name][0], label="value")
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{re.escape(name)}"):
        cls(**{**REQUIRED[cls], name: value})


@pytest.mark.parametrize("cls", list(FIELDS), ids=lambda c: c.__name__)
@SETTINGS
@given(data=st.data())
def test_config_keeps_any_good_value(cls: type[Any], data: st.DataObject) -> None:
    values = {n: data.draw(good, label=n) for n, (_bad, good) in FIELDS[cls].items()}
    cfg = cls(**{**REQUIRED[cls], **values})
    for n, v in values.items():
        got = getattr(cfg, n)
        if isinstance(got, EvictionPolicy | KVRole | TransferMode):
            assert got is type(got).parse(v, owner="x")
        elif n == "root":
            assert got == Path(v)
        elif isinstance(v, list):
            assert got == tuple(v)
        else:
            assert got == v and type(got) is (float if n.endswith("_s") else type(v))


# -- KVTransferParams ----------------------------------------------------------------------------

_hashes = st.lists(st.text("0123456789abcdef", min_size=8, max_size=32), min_size=1, max_size=3)


@st.composite
def good_params(draw: Callable[..., Any]) -> dict[str, Any]:
    hashes = draw(_hashes)
    size = draw(st.integers(1, 8))
    return {
        "request_id": draw(clean_text),
        "engine_id": draw(clean_text),
        "transport": draw(st.sampled_from(["p2p", "nixl"])),
        "host": draw(good_host),
        "port": draw(good_int(1, 65535)),
        "block_ids": draw(st.lists(st.integers(0, 2**40), max_size=6)),
        "layouts_json": [draw(clean_text) for _ in hashes],
        "compatibility_hashes": hashes,
        "tp_rank": draw(st.integers(0, size - 1)),
        "tp_size": size,
        "model_fingerprint": draw(good_fingerprint_opt),
    }


PARAM_BAD: dict[str, Any] = {
    "request_id": bad_text,
    "engine_id": bad_text,
    "transport": bad_text,
    "host": st.one_of(st.just(""), st.integers(), _other),
    "port": bad_int(1, 65535),
    "block_ids": st.one_of(
        st.text(min_size=1, max_size=4),  # "12" is not [1, 2]
        st.lists(
            st.one_of(st.integers(max_value=-1), st.booleans(), st.floats(), st.text()),
            min_size=1,
            max_size=3,
        ),
        st.integers(),
        st.none(),
    ),
    "layouts_json": st.one_of(st.text(min_size=1, max_size=4), st.integers(), st.none()),
    "compatibility_hashes": st.one_of(st.text(min_size=1, max_size=4), st.integers(), st.none()),
    "tp_rank": st.one_of(
        st.integers(min_value=8),
        st.integers(max_value=-1),
        st.booleans(),
        st.just("0"),
        st.floats(),
    ),
    "tp_size": st.one_of(st.integers(max_value=0), st.booleans(), st.just("1"), st.floats()),
    "model_fingerprint": bad_fingerprint_opt,
}


@SETTINGS
@given(params=good_params(), data=st.data())
def test_transfer_params_refuse_any_bad_field_naming_it(
    params: dict[str, Any], data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(PARAM_BAD)), label="field")
    value = data.draw(PARAM_BAD[name], label="value")
    if name == "tp_rank":
        params["tp_size"] = 8
    bad = {**params, name: value}
    # the field itself, or (for a list field of the wrong length) the layouts/hashes pairing
    pattern = rf"KVTransferParams(\.{name}|\.tp_rank| has \d+ layouts)"
    with pytest.raises(ValueError, match=pattern):
        KVTransferParams.from_dict(bad)
    with pytest.raises(ValueError, match=pattern):
        KVTransferParams(**bad)


@SETTINGS
@given(params=good_params())
def test_transfer_params_round_trip(params: dict[str, Any]) -> None:
    p = KVTransferParams.from_dict(params)
    assert p.to_dict() == params
    assert KVTransferParams.from_json(p.to_json()) == p
    assert KVTransferParams.from_dict(p.to_dict()) == p


@SETTINGS
@given(params=good_params(), data=st.data())
def test_transfer_params_from_a_partial_or_padded_dict_names_the_keys(
    params: dict[str, Any], data: st.DataObject
) -> None:
    required = [
        "block_ids",
        "compatibility_hashes",
        "engine_id",
        "host",
        "layouts_json",
        "port",
        "request_id",
        "transport",
    ]
    drop = data.draw(st.lists(st.sampled_from(required), min_size=1, unique=True))
    partial = {k: v for k, v in params.items() if k not in drop}
    with pytest.raises(ValueError, match=re.escape(f"missing keys {sorted(drop)}")):
        KVTransferParams.from_dict(partial)
    with pytest.raises(ValueError, match=r"unknown keys \['blocks'\]"):
        KVTransferParams.from_dict({**params, "blocks": [1]})
    with pytest.raises(ValueError, match="takes a dict"):
        KVTransferParams.from_dict(list(params.items()))  # type: ignore[arg-type]


def test_issue_examples() -> None:
    with pytest.raises(ValueError, match=r"NixlConfig\.backends='UCX'"):
        NixlConfig(backends="UCX")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"OffloadingConfig\.pin_memory='no'.*True or False"):
        OffloadingConfig(cpu_bytes=1 << 20, pin_memory="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"KVTransferParams\.from_dict: missing keys"):
        KVTransferParams.from_dict({"request_id": "r", "port": 1})
    with pytest.raises(ValueError, match=r"KVTransferParams\.port='abc'.*\[1, 65535\]"):
        KVTransferParams(
            request_id="r",
            engine_id="e",
            transport="p2p",
            host="127.0.0.1",
            port="abc",
            block_ids=(),
            layouts_json=("{}",),
            compatibility_hashes=("h",),
        )  # type: ignore[arg-type]


# -- public methods --------------------------------------------------------------------------------


def test_connector_methods_check_their_arguments(make_request: Callable[..., Any]) -> None:
    from kv_connectors import OffloadingConnector, P2pConnector

    with pytest.raises(ValueError, match=r"OffloadingConnector\.block_size=True"):
        OffloadingConnector(OffloadingConfig(cpu_bytes=1 << 20), block_size=True)
    with pytest.raises(ValueError, match=r"P2pConnector\.tp_rank='0'"):
        P2pConnector(P2pConfig(), block_size=4, tp_rank="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"P2pConnector\.tp_rank=2 is out of range.*\[0, 1\]"):
        P2pConnector(P2pConfig(), block_size=4, tp_rank=2, tp_size=2)
    conn = P2pConnector(P2pConfig(), block_size=4)
    req = make_request("r", 2, 4)
    with pytest.raises(ValueError, match=r"get_num_new_matched_tokens\.num_computed_tokens=1\.5"):
        conn.get_num_new_matched_tokens(req, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"num_external_tokens='8'"):
        conn.update_state_after_alloc(req, [0, 1], "8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"add_remote_request\.request_id=5"):
        conn.add_remote_request(5, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="give the KVTransferParams"):
        conn.add_remote_request("r", "params")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"KVTransferParams\.from_dict: missing keys"):
        conn.add_remote_request("r", {"request_id": "r"})
    conn.close()


@SETTINGS
@given(
    which=st.sampled_from(["src_tp", "dst_tp"]),
    tp=st.one_of(
        st.tuples(st.integers(), st.integers()).filter(lambda t: not 0 <= t[0] < t[1]),
        st.tuples(st.booleans(), st.integers(1, 4)),
        st.tuples(st.integers(0, 3).map(float), st.integers(4, 8)),
        st.just((0,)),
        st.just("01"),
        st.none(),
    ),
)
def test_plan_conversion_refuses_bad_tp_naming_it(which: str, tp: Any) -> None:
    from kv_connectors import plan_conversion
    from kv_connectors.testing import make_layout

    with pytest.raises(ValueError, match=rf"plan_conversion\.{which}"):
        plan_conversion(make_layout(), make_layout(), **{which: tp})


@SETTINGS
@given(capacity=bad_int(1))
def test_policies_refuse_a_bad_capacity(capacity: Any) -> None:
    from kv_connectors import ARCPolicy, LRUPolicy

    for cls in (LRUPolicy, ARCPolicy):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.capacity"):
            cls(capacity)


def test_waits_refuse_a_bad_timeout(tmp_path: Path) -> None:
    from kv_connectors import FilesystemConnector, P2pConnector

    conn = P2pConnector(P2pConfig(), block_size=4)
    for bad in (0, -1.0, float("nan"), "5"):
        with pytest.raises(ValueError, match=r"wait_for_loads\.timeout_s"):
            conn.wait_for_loads(bad)  # type: ignore[arg-type]
    conn.close()
    fs = FilesystemConnector(
        FilesystemConfig(root=tmp_path, model_fingerprint="m", fsync=False), block_size=4
    )
    with pytest.raises(ValueError, match=r"FilesystemConnector\.flush\.timeout_s"):
        fs.flush(0)
    fs.close()
