"""The bounded registries that link model calls, tool_use ids and tool results."""

from __future__ import annotations

from otel_agentcap.model import EventRef
from otel_agentcap.pipeline.causal_links import _Bounded


def _ref(n: int) -> EventRef:
    return EventRef(f"event-{n}", n, "a")


def test_keeps_the_most_recent_entries_and_forgets_the_oldest_first():
    registry = _Bounded(limit=3)
    for n in range(5):
        registry.put(("r", f"k{n}"), _ref(n))
    assert [registry.get(("r", f"k{n}")) for n in range(5)] == [
        None,
        None,
        _ref(2),
        _ref(3),
        _ref(4),
    ]


def test_putting_a_key_again_makes_it_the_most_recent():
    registry = _Bounded(limit=3)
    for n in range(3):
        registry.put(("r", f"k{n}"), _ref(n))
    registry.put(("r", "k0"), _ref(10))  # k0 is now the newest; k1 is the oldest
    registry.put(("r", "k3"), _ref(3))
    assert registry.get(("r", "k0")) == _ref(10)
    assert registry.get(("r", "k1")) is None
    assert registry.get(("r", "k2")) == _ref(2)


def test_a_full_registry_stays_bounded_over_many_evictions():
    registry = _Bounded(limit=100)
    for n in range(10_000):
        registry.put(("r", f"k{n}"), _ref(n))
    assert len(registry) == 100
    assert registry.get(("r", "k9899")) is None
    assert registry.get(("r", "k9900")) == _ref(9900)


def test_forget_run_drops_only_that_run():
    registry = _Bounded(limit=10)
    registry.put(("r1", "k"), _ref(1))
    registry.put(("r2", "k"), _ref(2))
    registry.forget_run("r1")
    assert registry.get(("r1", "k")) is None
    assert registry.get(("r2", "k")) == _ref(2)
