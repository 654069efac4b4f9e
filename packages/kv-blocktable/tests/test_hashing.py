"""Block hashes: the published test vectors, an independent plain encoder, chain properties."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_blocktable import (
    HASH_ENCODING_VERSION,
    BlockHasher,
    ExtraKeys,
    MultiModalHash,
    Request,
    encode_block,
    hash_block_tokens,
)

VECTORS = json.loads((Path(__file__).parent / "data" / "block_hash_vectors.json").read_text())
HAS_XXHASH = importlib.util.find_spec("xxhash") is not None
ALGOS = [
    "sha256",
    pytest.param(
        "xxhash128", marks=pytest.mark.skipif(not HAS_XXHASH, reason="xxhash not installed")
    ),
]


def plain_encode(parent: bytes | None, tokens: list[int], extra: list[list[str]]) -> bytes:
    """docs/block_hash.md written out with struct, one field at a time (the spec, not the code)."""
    p = parent or b""
    out = struct.pack("<B", len(p)) + p
    out += struct.pack("<I", len(tokens))
    for t in tokens:
        out += struct.pack("<q", t)
    out += struct.pack("<I", len(extra))
    for kind, value in extra:
        for s in (kind, value):
            b = s.encode("utf-8")
            out += struct.pack("<I", len(b)) + b
    return out


def plain_digest(algo: str, message: bytes) -> bytes:
    if algo == "sha256":
        return hashlib.sha256(message).digest()
    import xxhash

    return bytes.fromhex(xxhash.xxh3_128(message).hexdigest())  # canonical big-endian


def test_vectors_are_version_1() -> None:
    assert VECTORS["encoding_version"] == HASH_ENCODING_VERSION == 1
    assert {v["algo"] for v in VECTORS["vectors"]} == {"sha256", "xxhash128"}


@pytest.mark.parametrize("algo", ALGOS)
def test_vectors(algo: str) -> None:
    rows = [v for v in VECTORS["vectors"] if v["algo"] == algo]
    assert len(rows) >= 7
    for v in rows:
        parent = None if v["parent_hash"] is None else bytes.fromhex(v["parent_hash"])
        extra = tuple(tuple(kv) for kv in v["extra_keys"])
        msg = plain_encode(parent, v["token_ids"], v["extra_keys"])
        assert msg.hex() == v["message"], v["name"]
        assert encode_block(parent, v["token_ids"], extra) == msg, v["name"]
        assert plain_digest(algo, msg).hex() == v["digest"], v["name"]
        assert hash_block_tokens(parent, v["token_ids"], extra, algo=algo).hex() == v["digest"]


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=70),
    bs=st.integers(1, 9),
    salt=st.none() | st.text(min_size=1, max_size=5),
    lora=st.none() | st.text(min_size=1, max_size=5),
)
def test_chain_matches_block_by_block(
    algo: str, tokens: list[int], bs: int, salt: str | None, lora: str | None
) -> None:
    extra = ExtraKeys(cache_salt=salt, lora_name=lora) if (salt or lora) else None
    chain = BlockHasher(bs, algo).hash_blocks(tokens, extra)
    assert len(chain) == len(tokens) // bs
    parent = None
    for j, h in enumerate(chain):
        keys = extra.for_block(j * bs, (j + 1) * bs) if extra else None
        parent = hash_block_tokens(parent, tokens[j * bs : (j + 1) * bs], keys, algo=algo)
        assert h == parent
        want = plain_digest(
            algo,
            plain_encode(
                None if j == 0 else chain[j - 1],
                tokens[j * bs : (j + 1) * bs],
                [list(kv) for kv in keys or ()],
            ),
        )
        assert h == want


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 50), max_size=40),
    appends=st.lists(st.lists(st.integers(0, 50), max_size=7), max_size=8),
    bs=st.integers(1, 6),
)
def test_request_hashes_stay_current_as_tokens_arrive(
    prompt: list[int], appends: list[list[int]], bs: int
) -> None:
    h = BlockHasher(bs)
    req = Request("r", prompt, block_hasher=h)
    for ids in appends:
        if len(ids) == 1:
            req.append_token_ids(ids[0])
        else:
            req.append_token_ids(ids)
        assert req.block_hashes == h.hash_blocks(req.token_ids)
    # Binding later computes the same chain.
    late = Request("r2", req.token_ids)
    late.bind_hasher(h)
    assert late.block_hashes == req.block_hashes


def test_prefix_property_and_sensitivity() -> None:
    h = BlockHasher(4)
    a = h.hash_blocks(list(range(12)))
    b = h.hash_blocks([*range(8), 99, 9, 10, 11])
    assert a[:2] == b[:2] and a[2] != b[2]
    # A change in the first block changes every later hash (the chain).
    c = h.hash_blocks([99, *range(1, 12)])
    assert all(x != y for x, y in zip(a, c, strict=True))
    # Salt changes block 0 and hence everything; lora enters every block; mm only overlapping ones.
    salted = h.hash_blocks(list(range(12)), ExtraKeys(cache_salt="s"))
    assert all(x != y for x, y in zip(a, salted, strict=True))
    mm = ExtraKeys(mm_hashes=(MultiModalHash("img", offset=9, length=2),))
    assert mm.for_block(8, 12) == (("mm_hash", "img"),) and mm.for_block(0, 4) == ()
    with_mm = h.hash_blocks(list(range(12)), mm)
    assert with_mm[:2] == a[:2] and with_mm[2] != a[2]
    assert ExtraKeys(cache_salt="s", lora_name="l").for_block(4, 8) == (("lora_name", "l"),)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="xxhash128|sha256"):
        BlockHasher(4, "md5")
    with pytest.raises(ValueError, match="block_size=0"):
        BlockHasher(0)
    with pytest.raises(TypeError, match=r"token id 1\.5"):
        Request("r", [1, 1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="2\\*\\*63"):
        Request("r", [2**63])
    with pytest.raises(ValueError, match="request_id"):
        Request("", [1])
    with pytest.raises(ValueError, match="parent_hash"):
        BlockHasher(2).hash_blocks([1, 2, 3, 4], start_block=1)
    with pytest.raises(ValueError, match="255"):
        encode_block(b"x" * 256, [1])
    with pytest.raises(ValueError, match="cache_salt"):
        ExtraKeys(cache_salt="")
    req = Request("r", [1, 2], block_hasher=BlockHasher(2))
    with pytest.raises(ValueError, match="one manager"):
        req.bind_hasher(BlockHasher(4))


def test_missing_xxhash_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ImportError, match=r"kv-blocktable\[xxhash\]"):
        hash_block_tokens(None, [1], algo="xxhash128")


def test_doc_example_is_a_vector() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "block_hash.md").read_text()
    first = next(v for v in VECTORS["vectors"] if v["algo"] == "sha256")
    assert first["token_ids"] == [1, 2, 3, 4]
    assert first["digest"] in doc
    assert "block_hash_vectors.json" in doc


@pytest.mark.parametrize("algo", ALGOS)
def test_decode_appends_hash_as_the_chain(algo: str) -> None:
    """One token at a time (the decode path: Request -> BlockHasher._hash_next's one-struct
    message) gives the chain hash_blocks computes, int64 extremes and odd block sizes included."""
    for bs in (1, 3, 16):
        h = BlockHasher(bs, algo)
        tokens = [-(2**63), 2**63 - 1, 0, -1, 7, 2**31, -(2**31) - 1] * 9
        req = Request("r", tokens[:bs], block_hasher=h)
        for t in tokens[bs:]:
            req.append_token_ids(t)
        assert req.block_hashes == h.hash_blocks(tokens)
        # A parent of another length (not this hasher's digest) takes the general encoding.
        parent = b"\x01" * 5
        want = h.hash_blocks(tokens[: 3 * bs], parent_hash=parent, start_block=2)[0]
        assert h._hash_next(tokens, parent, 2) == want
