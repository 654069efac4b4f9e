"""``append_decode_tokens`` (a decode step's sampled tokens, one call for the batch) against the
loop of ``Request.append_token_ids`` calls it replaces (issue 32): two copies of the same
requests take the same random steps, one a call per request, one a call per batch, and must
agree on every token list, every block hash and the hashing state — and for a bad token on the
error (type and message, naming the request) and on which requests got their tokens before it.

``test_a_batch_that_skips_a_hash_is_caught`` plants the bug a fast path invites (a completed
block left unhashed) and checks that the comparison catches it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_blocktable import BlockHasher, ExtraKeys, MultiModalHash, Request, append_decode_tokens
from kv_blocktable import request as request_mod

EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "0"))
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
ALGOS = ["sha256"] + (["xxhash128"] if importlib.util.find_spec("xxhash") else [])
Append = Callable[[Sequence[Request], Sequence[int]], None]


class Subclass(Request):  # a Request subclass: the batch must call its own method
    __slots__ = ("calls",)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.calls = 0

    def append_token_ids(self, token_ids: object) -> None:
        self.calls += 1
        super().append_token_ids(token_ids)  # type: ignore[arg-type]


def one_by_one(requests: Sequence[Request], tokens: Sequence[int]) -> None:
    for req, tok in zip(requests, tokens, strict=True):
        req.append_token_ids(tok)


def state(reqs: list[Request]) -> list[object]:
    return [(r.request_id, list(r.token_ids), list(r.block_hashes), r._next_hash_at) for r in reqs]


def outcome(fn: Append, reqs: list[Request], tokens: list[object]) -> object:
    try:
        fn(reqs, tokens)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        return (type(e).__name__, str(e))
    return "ok"


KEYS = [
    None,
    ExtraKeys(cache_salt="tenant"),
    ExtraKeys(lora_name="adapter"),
    ExtraKeys(mm_hashes=(MultiModalHash("img", 3, 6),)),
]


@st.composite
def scenario(draw: st.DrawFn) -> dict[str, Any]:
    num = draw(st.integers(1, 7))
    token = st.one_of(
        st.integers(0, 50),
        st.sampled_from([I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1, -1, 0, 2**30 - 1, 2**30]),
    )
    reqs = [
        (
            draw(st.lists(token, max_size=20)),
            draw(st.sampled_from(range(len(KEYS)))),
            draw(st.sampled_from(("bound", "bound", "bound", "unbound", "subclass"))),
        )
        for _ in range(num)
    ]
    bad = st.sampled_from([True, 1.0, I64_MAX + 1, I64_MIN - 1, "7", None, [1]])
    steps = []
    for _ in range(draw(st.integers(1, 40))):
        picks = draw(st.lists(st.integers(0, num - 1), max_size=num + 2))  # repeats allowed
        toks: list[object] = [draw(token) for _ in picks]
        if toks and draw(st.integers(0, 15)) == 0:
            toks[draw(st.integers(0, len(toks) - 1))] = draw(bad)
        steps.append((picks, toks))
    return {
        "block_size": draw(st.sampled_from((1, 2, 3, 4, 16))),
        "algo": draw(st.sampled_from(ALGOS)),
        "reqs": reqs,
        "steps": steps,
    }


def run_both(case: dict[str, Any], batched: Append) -> None:
    """The same steps through ``one_by_one`` and ``batched`` on two copies of the requests."""
    hasher = BlockHasher(case["block_size"], case["algo"])
    copies: list[list[Request]] = []
    for _ in range(2):
        reqs = []
        for i, (tokens, keys, kind) in enumerate(case["reqs"]):
            cls = Subclass if kind == "subclass" else Request
            bound = hasher if kind != "unbound" else None
            reqs.append(cls(f"r{i}", list(tokens), KEYS[keys], bound))
        copies.append(reqs)
    for picks, toks in case["steps"]:
        want = outcome(one_by_one, [copies[0][i] for i in picks], toks)
        got = outcome(batched, [copies[1][i] for i in picks], toks)
        assert got == want, (picks, toks)
        assert state(copies[1]) == state(copies[0]), (picks, toks)
    for a, b in zip(*copies, strict=True):
        if isinstance(a, Subclass):
            assert isinstance(b, Subclass) and a.calls == b.calls  # its own method ran
        if a.block_hasher is not None:  # the chain is what hashing the tokens afresh gives
            assert b.block_hashes == hasher.hash_blocks(b.token_ids, b.extra_keys)


@settings(
    max_examples=EXAMPLES or 200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario())
def test_batched_appends_equal_the_calls(case: dict[str, Any]) -> None:
    run_both(case, append_decode_tokens)


def test_batched_appends_by_example() -> None:
    h = BlockHasher(4, "sha256")
    a, b = Request("a", [1, 2, 3], block_hasher=h), Request("b", [9] * 6, block_hasher=h)
    append_decode_tokens([a, b], [I64_MAX, I64_MIN])
    assert a.token_ids == [1, 2, 3, I64_MAX] and b.token_ids == [9] * 6 + [I64_MIN]
    assert a.block_hashes == h.hash_blocks([1, 2, 3, I64_MAX])  # a's first block completed
    assert len(b.block_hashes) == 1  # b's second block is not full yet
    append_decode_tokens((a, b), (5, 6))  # tuples too
    assert b.block_hashes == h.hash_blocks(b.token_ids) and len(b.block_hashes) == 2
    append_decode_tokens([], [])  # an empty step is nothing


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (True, TypeError, r"request 'b': token id True \(index 0\) is a bool"),
        (1.0, TypeError, r"request 'b': token_ids=1.0 is a float"),
        (2**63, ValueError, r"request 'b': token id 9223372036854775808 \(index 0\) is outside"),
        (-(2**63) - 1, ValueError, r"request 'b': token id -9223372036854775809 \(index 0\)"),
        ("7", TypeError, r"request 'b': token_ids='7' is a str"),
    ],
)
def test_a_bad_token_raises_the_calls_error_after_the_requests_before_it(
    bad: object, error: type[Exception], match: str
) -> None:
    reqs = [Request(rid, [1]) for rid in "abc"]
    with pytest.raises(error, match=match) as got:
        append_decode_tokens(reqs, [7, bad, 8])  # type: ignore[list-item]
    assert [r.token_ids for r in reqs] == [[1, 7], [1], [1]]  # a got its token, c did not
    with pytest.raises(error) as want:
        one_by_one([Request(rid, [1]) for rid in "abc"], [7, bad, 8])  # type: ignore[list-item]
    assert str(got.value) == str(want.value)


def test_batch_shape_errors() -> None:
    reqs = [Request("a", [1])]
    with pytest.raises(ValueError, match="got 1 requests but 2 token ids"):
        append_decode_tokens(reqs, [1, 2])
    with pytest.raises(TypeError, match=r"token_ids \(str\) must be sequences"):
        append_decode_tokens(reqs, "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"requests \(generator\) and token_ids \(list\) must be"):
        append_decode_tokens((r for r in reqs), [1])  # type: ignore[arg-type]
    assert reqs[0].token_ids == [1]  # nothing appended


def _skips_a_hash(requests: Sequence[Request], tokens: Sequence[int]) -> None:
    """A planted bug: appends every token but never hashes the block it completes."""
    for req, tok in zip(requests, tokens, strict=True):
        req.token_ids.append(tok)


def _forgets_the_due_mark(requests: Sequence[Request], tokens: Sequence[int]) -> None:
    """A planted bug: hashes the completed block but leaves the next one's due mark behind,
    so the block after it is hashed a token early."""
    for req, tok in zip(requests, tokens, strict=True):
        req.token_ids.append(tok)
        if len(req.token_ids) >= req._next_hash_at:
            due = req._next_hash_at
            req._extend_hashes()
            req._next_hash_at = due + 1


@pytest.mark.parametrize("planted", [_skips_a_hash, _forgets_the_due_mark])
def test_a_batch_that_gets_the_hashes_wrong_is_caught(planted: Append) -> None:
    case = {
        "block_size": 4,
        "algo": "sha256",
        "reqs": [([1, 2, 3], 0, "bound"), ([5] * 7, 0, "bound")],
        "steps": [([0, 1], [4, 6]), ([0, 1], [7, 8]), ([0, 1], [9, 9]), ([0, 1], [1, 2])],
    }
    run_both(case, append_decode_tokens)  # the real one passes
    with pytest.raises(AssertionError):
        run_both(case, planted)


def test_the_inline_hash_is_the_one_block_path() -> None:
    """The batch's inline hash runs only where ``_extend_hashes`` would hash exactly one block:
    with extra keys (multimodal, a LoRA) the request's own method hashes, with its keys."""
    h = BlockHasher(2, "sha256")
    calls: list[str] = []
    real = request_mod.Request._extend_hashes

    def spy(self: Request) -> None:
        calls.append(self.request_id)
        real(self)

    plain = Request("plain", [1, 2, 3], block_hasher=h)
    lora = Request("lora", [1, 2, 3], ExtraKeys(lora_name="x"), h)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(request_mod.Request, "_extend_hashes", spy)
        append_decode_tokens([plain, lora], [4, 4])
    assert calls == ["lora"]
    assert plain.block_hashes == h.hash_blocks([1, 2, 3, 4])
    assert lora.block_hashes == h.hash_blocks([1, 2, 3, 4], ExtraKeys(lora_name="x"))
