"""Eviction policies as state machines (hypothesis): never more than ``capacity`` resident keys,
pinned keys never evicted, evicted keys really gone; LRU agrees with a reference model; ARC's
directory stays within its bounds. Plus config validation of the transports."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kv_connectors import NixlConfig, P2pConfig
from kv_connectors.policies import ARCPolicy, LRUPolicy, Policy

EXAMPLES = int(os.environ.get("KVSTACK_HYPOTHESIS_EXAMPLES", "40"))
KEYS = st.integers(0, 11)


class _PolicyMachine(RuleBasedStateMachine):
    kind: type[Policy] = LRUPolicy

    def __init__(self) -> None:
        super().__init__()
        self.pinned: set[int] = set()
        self.policy = self.kind(4, evictable=lambda k: k not in self.pinned)
        # driven by the same rules through insert only: what insert_many must agree with
        self.twin = self.kind(4, evictable=lambda k: k not in self.pinned)
        self.model: OrderedDict[int, None] = OrderedDict()  # LRU reference (used for LRU only)

    @rule(key=KEYS)
    def insert(self, key: int) -> None:
        before = set(self.policy.resident())
        evicted = self.policy.insert(key)
        assert self.twin.insert(key) == evicted
        if evicted is None:
            assert key not in self.policy and len(before) == self.policy.capacity
            assert before <= self.pinned  # refused only when every resident key is pinned
            assert set(self.policy.resident()) == before
            return
        for k in evicted:
            assert k not in self.pinned and k in before and k not in self.policy
        assert key in self.policy
        if self.kind is LRUPolicy:
            if key in self.model:
                self.model.move_to_end(key)
            else:
                if len(self.model) >= 4:
                    victim = next(k for k in self.model if k not in self.pinned)
                    del self.model[victim]
                    assert evicted == [victim]
                self.model[key] = None

    @rule(keys=st.lists(KEYS, max_size=6))
    def insert_many(self, keys: list[int]) -> None:
        """The batch insert (LRU's inline one) agrees with inserting one key at a time."""
        got = self.policy.insert_many(list(keys))
        want = Policy.insert_many(self.twin, list(keys))
        assert got == want and self.policy.resident() == self.twin.resident()
        done, _evicted = got
        if self.kind is LRUPolicy:  # the reference model takes the inserted keys one by one
            for key in keys[:done]:
                if key in self.model:
                    self.model.move_to_end(key)
                    continue
                if len(self.model) >= 4:
                    del self.model[next(k for k in self.model if k not in self.pinned)]
                self.model[key] = None

    @rule(key=KEYS)
    def touch(self, key: int) -> None:
        if key in self.policy:
            self.policy.touch(key)
            self.twin.touch(key)
            if self.kind is LRUPolicy:
                self.model.move_to_end(key)

    @rule(key=KEYS)
    def pin_or_unpin(self, key: int) -> None:
        self.pinned ^= {key}

    @rule(key=KEYS)
    def remove(self, key: int) -> None:
        self.policy.remove(key)
        self.twin.remove(key)
        self.model.pop(key, None)

    @invariant()
    def bounded(self) -> None:
        assert len(self.policy) <= self.policy.capacity
        assert len(set(self.policy.resident())) == len(self.policy)
        if self.kind is LRUPolicy:
            assert self.policy.resident() == list(self.model)
        if isinstance(self.policy, ARCPolicy):
            p = self.policy
            assert 0 <= p.p <= p.capacity
            assert len(p) + len(p.b1) + len(p.b2) <= 2 * p.capacity
            assert not (set(p.b1) | set(p.b2)) & set(p.resident())


class LRUMachine(_PolicyMachine):
    kind = LRUPolicy


class ARCMachine(_PolicyMachine):
    kind = ARCPolicy


TestLRU = LRUMachine.TestCase
TestLRU.settings = settings(max_examples=EXAMPLES, deadline=None)
TestARC = ARCMachine.TestCase
TestARC.settings = settings(max_examples=EXAMPLES, deadline=None)


@pytest.mark.parametrize("cls", [P2pConfig, NixlConfig])
def test_transports_never_listen_on_all_interfaces_by_default(cls: type) -> None:
    assert cls().host == "127.0.0.1"
    for host in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match="every interface"):
            cls(host=host)
    with pytest.raises(ValueError, match="port=70000"):
        cls(port=70000)
    with pytest.raises(ValueError, match="timeout_s=0"):
        cls(timeout_s=0)
    with pytest.raises(ValueError, match="mode='sideways'"):
        cls(mode="sideways")
