"""Sequence-block reservation: exclusive across threads and processes, resumes above stored events."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
from psycopg_pool import ConnectionPool

from otel_agentcap.clock import LamportClock
from otel_agentcap.exporters.postgres import Database, PostgresSequenceSource
from otel_agentcap.exporters.postgres.sequences import max_stored_sequence, reserve_sequence_block
from otel_agentcap.exporters.postgres.writer import EventWriter
from otel_agentcap.model import Batch, Event, event_id_for

pytestmark = pytest.mark.storage


def _assert_disjoint(starts: list[int], size: int) -> None:
    ordered = sorted(starts)
    for a, b in itertools.pairwise(ordered):
        assert b >= a + size, f"blocks overlap: {a} and {b} (size {size})"


def test_blocks_from_threads_never_overlap(pg_dsn: str) -> None:
    """Blocks reserved concurrently by 8 threads through one pool are pairwise disjoint."""
    with ConnectionPool(pg_dsn, min_size=2, max_size=8, open=True) as pool:

        def reserve(_: int) -> int:
            return reserve_sequence_block(pool, "run", "agent", at_least=0, size=10)

        with ThreadPoolExecutor(8) as ex:
            starts = list(ex.map(reserve, range(200)))
    assert len(set(starts)) == 200
    _assert_disjoint(starts, 10)


def _reserve_many(args: tuple[str, int]) -> list[int]:
    dsn, count = args
    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        return [
            reserve_sequence_block(pool, "run", "planner", at_least=0, size=7) for _ in range(count)
        ]


@pytest.mark.multiprocess
def test_blocks_from_processes_never_overlap(pg_dsn: str) -> None:
    """Blocks reserved concurrently by 4 processes are pairwise disjoint."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.map(_reserve_many, [(pg_dsn, 50)] * 4)
    starts = [s for r in results for s in r]
    assert len(starts) == 200
    _assert_disjoint(starts, 7)


def test_block_respects_at_least_and_is_per_agent(pg_dsn: str) -> None:
    """A block starts at or above at_least, and agents have independent marks."""
    with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool:
        assert reserve_sequence_block(pool, "r", "a", at_least=100, size=5) == 100
        assert reserve_sequence_block(pool, "r", "a", at_least=0, size=5) == 105
        assert reserve_sequence_block(pool, "r", "b", at_least=0, size=5) == 0
        assert reserve_sequence_block(pool, "r", "a", at_least=500, size=1) == 500


def test_resumption_starts_above_stored_max(pg_dsn: str) -> None:
    """An agent with stored events but no reservation mark starts above its largest stored seq."""
    now = datetime.now(UTC)
    events = tuple(
        Event(event_id_for("r", "planner", f"k{s}"), "r", "planner", s, "model_call", f"k{s}", now)
        for s in (3, 40, 41)
    )
    with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool:
        EventWriter(pool).write(Batch(events))
        assert max_stored_sequence(pool, "r", "planner") == 41
        assert max_stored_sequence(pool, "r", "nobody") is None
        assert reserve_sequence_block(pool, "r", "planner", at_least=0, size=10) == 42
        assert reserve_sequence_block(pool, "r", "planner", at_least=0, size=10) == 52


def test_reserve_with_a_plain_connection(pg_dsn: str) -> None:
    """A psycopg connection works as well as a pool, and the reservation is committed."""
    import psycopg

    with psycopg.connect(pg_dsn) as conn:
        assert reserve_sequence_block(conn, "r", "a", at_least=0, size=3) == 0
    with psycopg.connect(pg_dsn) as conn:
        assert reserve_sequence_block(conn, "r", "a", at_least=0, size=3) == 3


@pytest.mark.multiprocess
def test_a_clock_forked_while_it_holds_a_block_reserves_its_own(pg_dsn: str) -> None:
    """A process forked while an agent's clock holds a block (a pool worker forked inside an
    agent) reserves blocks of its own: parent and child never hand out the same sequence."""
    database = Database(pg_dsn)
    clock = LamportClock("run", "agent", PostgresSequenceSource(database))
    try:
        first = clock.tick()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.write(write, json.dumps([clock.tick() for _ in range(5)]).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            child = json.loads(pipe.read() or "[]")
        os.waitpid(pid, 0)
        parent = [clock.tick() for _ in range(5)]
    finally:
        database.close()
    assert len(child) == 5
    assert first not in child
    assert not set(child) & set(parent), (child, parent)
