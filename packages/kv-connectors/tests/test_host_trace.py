"""``kv_connectors.host_trace``: the diagnostic's wrappers record entry and exit (and pass the
result and exceptions through), wrap once, and its timeline merges processes in time order."""

from __future__ import annotations

import pytest
from kv_connectors import host_trace


class _Thing:
    def work(self, x: int) -> int:
        host_trace.mark("inside")
        return x + 1

    def fail(self) -> None:
        raise KeyError("no")


def test_wrapped_calls_are_recorded_in_order_and_behave_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_trace, "EVENTS", [])
    monkeypatch.setattr(_Thing, "work", _Thing.work)  # (restored after the test)
    monkeypatch.setattr(_Thing, "fail", _Thing.fail)
    host_trace.wrap(_Thing, "work")
    host_trace.wrap(_Thing, "work")  # a second wrap is a no-op
    host_trace.wrap(_Thing, "fail")
    assert _Thing().work(1) == 2
    with pytest.raises(KeyError):
        _Thing().fail()
    names = [e for _t, _th, e in host_trace.EVENTS]
    assert names == ["work >", "inside", "work <", "fail >", "fail <"]
    times = [t for t, _th, _e in host_trace.EVENTS]
    assert times == sorted(times)


def test_timeline_merges_sides_from_a_start() -> None:
    a = [(10.0, "MainThread", "x >"), (10.003, "MainThread", "x <")]
    b = [(9.0, "T", "early"), (10.001, "T", "y")]
    lines = host_trace.timeline([("consumer", a), ("producer", b)], since=10.0)
    assert [ln.split()[-1] for ln in lines] == [">", "y", "<"]
    assert lines[1].split()[0] == "1.000" and "producer" in lines[1]
    assert host_trace.timeline([("a", [])]) == []
