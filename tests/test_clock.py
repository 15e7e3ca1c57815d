"""LamportClock: tick and observe rules, thread safety, block reservation from a SequenceSource."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_agentcap.clock import ClockRegistry, LamportClock


class BlockSource:
    """A fake store that hands out disjoint blocks, above everything reserved so far."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next_free = 1
        self.blocks: list[tuple[int, int]] = []
        self.calls: list[tuple[int, int]] = []

    def reserve(self, run_id: str, agent_id: str, *, at_least: int, size: int) -> int:
        with self.lock:
            self.calls.append((at_least, size))
            start = max(self.next_free, at_least)
            self.blocks.append((start, start + size))
            self.next_free = start + size
            return start

    def owns(self, seq: int) -> bool:
        return any(lo <= seq < hi for lo, hi in self.blocks)


class FlakySource(BlockSource):
    """A BlockSource that raises while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def reserve(self, run_id: str, agent_id: str, *, at_least: int, size: int) -> int:
        if self.down:
            raise ConnectionError("store unreachable")
        return super().reserve(run_id, agent_id, at_least=at_least, size=size)


def test_tick_starts_at_one_and_increments():
    """A fresh clock hands out 1, 2, 3 and reports the last one."""
    clock = LamportClock("r", "a")
    assert [clock.tick(), clock.tick(), clock.tick()] == [1, 2, 3]
    assert clock.last == 3


def test_tick_after_jumps_past_parent():
    """tick(after) returns a value above after when after is ahead of the clock."""
    clock = LamportClock("r", "a")
    clock.tick()
    assert clock.tick(after=41) == 42
    assert clock.tick() == 43


def test_tick_after_below_last_does_not_go_back():
    """tick(after) with after below the clock's last still moves forward by one."""
    clock = LamportClock("r", "a")
    for _ in range(10):
        clock.tick()
    assert clock.tick(after=3) == 11


def test_observe_moves_forward_only():
    """observe raises last to a larger value and ignores a smaller one."""
    clock = LamportClock("r", "a")
    clock.observe(20)
    assert clock.last == 20
    clock.observe(5)
    assert clock.last == 20
    assert clock.tick() == 21


def test_block_size_must_be_positive():
    """A zero block size is rejected."""
    with pytest.raises(ValueError):
        LamportClock("r", "a", block_size=0)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("tick"), st.integers(0, 10_000)),
            st.tuples(st.just("observe"), st.integers(0, 10_000)),
        ),
        max_size=60,
    )
)
def test_lamport_rule_holds_for_any_sequence_of_operations(ops):
    """Every tick is above the previous tick, every observed value and its own after argument."""
    clock = LamportClock("r", "a")
    floor = 0
    for op, value in ops:
        if op == "tick":
            seq = clock.tick(value)
            assert seq > floor
            assert seq > value
            floor = seq
        else:
            clock.observe(value)
            floor = max(floor, value)
        assert clock.last == floor


def test_many_threads_ticking_get_unique_values():
    """Sequences handed to 16 threads ticking concurrently are all distinct and gap-free."""
    clock = LamportClock("r", "a")
    barrier = threading.Barrier(16)
    results: list[list[int]] = [[] for _ in range(16)]

    def worker(i: int) -> None:
        barrier.wait()
        for _ in range(2000):
            results[i].append(clock.tick())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [s for r in results for s in r]
    assert len(set(flat)) == len(flat) == 16 * 2000
    assert max(flat) == 16 * 2000
    for r in results:
        assert r == sorted(r) and len(set(r)) == len(r)


def test_many_threads_with_block_source_stay_in_blocks():
    """Concurrent ticks with a reserving source are unique and every one lies in a reserved block."""
    source = BlockSource()
    clock = LamportClock("r", "a", source, block_size=7)
    barrier = threading.Barrier(8)
    results: list[list[int]] = [[] for _ in range(8)]

    def worker(i: int) -> None:
        barrier.wait()
        for _ in range(300):
            results[i].append(clock.tick())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [s for r in results for s in r]
    assert len(set(flat)) == len(flat)
    assert all(source.owns(s) for s in flat)


def test_source_reserved_on_first_tick_and_values_stay_in_block():
    """The first tick reserves a block; the following ticks use it without calling the source."""
    source = BlockSource()
    source.next_free = 100  # another process already holds 1..99
    clock = LamportClock("r", "a", source, block_size=10)
    seqs = [clock.tick() for _ in range(10)]
    assert seqs == list(range(100, 110))
    assert len(source.calls) == 1
    assert all(source.owns(s) for s in seqs)


def test_source_re_reserved_when_block_exhausted():
    """The eleventh tick with a block of ten reserves a new block above the first."""
    source = BlockSource()
    clock = LamportClock("r", "a", source, block_size=10)
    seqs = [clock.tick() for _ in range(25)]
    assert len(source.calls) == 3
    assert seqs == sorted(seqs) and len(set(seqs)) == 25
    assert all(source.owns(s) for s in seqs)


def test_source_re_reserved_when_after_jumps_past_block():
    """tick(after) beyond the current block asks the source for a block starting above after."""
    source = BlockSource()
    clock = LamportClock("r", "a", source, block_size=10)
    assert clock.tick() == 1
    seq = clock.tick(after=500)
    assert seq > 500
    assert source.owns(seq)
    assert source.calls[-1][0] == 501
    assert len(source.calls) == 2


def test_two_clocks_sharing_a_source_never_collide():
    """Two clocks for one agent (two processes) backed by one source never hand out the same value."""
    source = BlockSource()
    one = LamportClock("r", "a", source, block_size=4)
    two = LamportClock("r", "a", source, block_size=4)
    seen: list[int] = []
    for i in range(50):
        seen.append(one.tick())
        seen.append(two.tick(after=i if i % 7 == 0 else 0))
    assert len(set(seen)) == len(seen)


@settings(max_examples=60, deadline=None)
@given(
    block=st.integers(1, 16),
    ops=st.lists(st.tuples(st.integers(0, 3000), st.booleans()), min_size=1, max_size=80),
)
def test_block_source_property(block, ops):
    """Any mix of ticks, jumps and store outages keeps ticks monotonic and, while the store is up,
    inside reserved blocks."""
    source = FlakySource()
    clock = LamportClock("r", "a", source, block_size=block)
    last = 0
    for after, down in ops:
        source.down = down
        seq = clock.tick(after)
        assert seq > last and seq > after
        if not down:
            assert source.owns(seq)
        last = seq


def test_source_failure_falls_back_without_raising(caplog):
    """A source that raises yields a local sequence, logs a warning and stays monotonic."""
    source = FlakySource()
    clock = LamportClock("r", "a", source, block_size=2)
    clock.tick()
    first = clock.tick()  # the block [1, 3) is used up, so the next tick must reserve
    source.down = True
    fallback = [clock.tick() for _ in range(3)]
    assert first < fallback[0] < fallback[1] < fallback[2]
    assert "could not reserve" in caplog.text
    source.down = False
    recovered = clock.tick()
    assert recovered > fallback[-1]
    assert source.owns(recovered)
    assert source.calls[-1][0] == fallback[-1] + 1


def test_source_returning_below_request_is_not_trusted_and_does_not_raise(caplog):
    """A source that returns a start below at_least is logged and ignored; ticks stay monotonic."""

    class Broken:
        def reserve(self, run_id, agent_id, *, at_least, size):
            return 1

    clock = LamportClock("r", "a", Broken(), block_size=5)
    clock.observe(10)
    seqs = [clock.tick() for _ in range(3)]
    assert 10 < seqs[0] < seqs[1] < seqs[2]
    assert "could not reserve" in caplog.text


def test_registry_returns_one_clock_per_agent_and_forgets_runs():
    """The registry gives one shared clock per (run, agent) and drops a run's clocks on request."""
    registry = ClockRegistry()
    a = registry.get("r", "a")
    assert registry.get("r", "a") is a
    assert registry.get("r", "b") is not a
    assert registry.get("r2", "a") is not a
    registry.forget_run("r")
    assert registry.get("r", "a") is not a


def test_registry_configure_applies_source_to_new_clocks():
    """Clocks created after configure() reserve from the configured source."""
    registry = ClockRegistry()
    source = BlockSource()
    source.next_free = 1000
    registry.configure(source, block_size=3)
    assert registry.get("r", "a").tick() == 1000


def test_local_fallback_stays_near_and_logs_once_per_outage(caplog):
    """While the source fails, every clock continues in a local block at most LOCAL_JUMP above
    what it needed, without a gap inside the block and without a new jump per tick; the outage
    is logged once for all clocks, and its end once."""
    import logging

    from otel_agentcap.clock import LOCAL_JUMP

    source = FlakySource()
    clocks_ = [LamportClock("r", agent, source, block_size=4) for agent in ("a", "b", "c")]
    for clock in clocks_:
        for _ in range(4):  # use up the block the source gave
            clock.tick()
    source.down = True
    with caplog.at_level(logging.WARNING):
        for clock in clocks_:
            before = clock.last
            ticks = [clock.tick() for _ in range(4)]
            assert before < ticks[0] <= before + 1 + LOCAL_JUMP
            assert ticks == list(range(ticks[0], ticks[0] + 4))
        source.down = False
        for clock in clocks_:
            assert source.owns(clock.tick())
    messages = [r.getMessage() for r in caplog.records]
    assert sum("could not reserve" in m for m in messages) == 1
    assert sum("from the source again" in m for m in messages) == 1
