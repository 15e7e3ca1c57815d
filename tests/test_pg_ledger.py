"""The PostgreSQL tool ledger: exactly-once tool bodies across processes and threads, replays of the
recorded outcome, crash policies after a SIGKILL inside a body, and what a replay returns."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from anthropic_support import stored  # noqa: F401 (fixture)

import otel_agentcap as ac
from otel_agentcap.capture.ledger import LedgerCall, PickleCodec, set_tool_ledger
from otel_agentcap.capture.tools import current_invocation, invocations
from otel_agentcap.errors import RecordedToolError, ToolOutcomeUnknown
from otel_agentcap.exporters.postgres import Database
from otel_agentcap.exporters.postgres import ledger as ledger_module
from otel_agentcap.exporters.postgres.errors import ConnectionFailed
from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger, ToolLedgerUnavailable
from otel_agentcap.testing import capture_events

pytestmark = pytest.mark.storage

# A worker process: configure() on the DSN (so the ledger comes from configure), a lease as given,
# then THREADS threads of one agent calling effect.invoke for each invocation id, appending every
# body run to the side-effect file (opened for append, so runs from every process land there).
_WORKER = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    dsn, run_id, effects, ids, threads, lease, start_at = sys.argv[1:8]
    ids, threads, lease, start_at = int(ids), int(threads), float(lease), float(start_at)
    agentcap = configure(dsn, announce=False)
    try:
        from otel_agentcap.capture.ledger import set_tool_ledger
        from otel_agentcap.exporters.postgres import Database
        from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger
        set_tool_ledger(PostgresToolLedger(Database(dsn, max_size=threads + 2), lease=lease))
    except ImportError:
        pass  # a version without the ledger

    @ac.tool
    def effect(n):
        with open(effects, "a") as f:
            f.write(f"{n}\\n")
        time.sleep(0.02)
        return {"n": n, "by": os.getpid()}

    results = []
    lock = threading.Lock()

    def work():
        with ac.run(run_id, resume=True), ac.agent("worker"):
            for i in range(ids):
                value = effect.invoke(f"inv-{i}", i)
                with lock:
                    results.append([i, value])

    while time.time() < start_at:
        time.sleep(0.001)
    pool = [ac.start_thread(work) for _ in range(threads)]
    for t in pool:
        t.join()
    # Everything delivered before the test reads the log: a slow machine may need longer than
    # the default shutdown timeout, and what a shutdown leaves queued would read as lost.
    report = agentcap.shutdown(timeout=150)
    if report is not None and (report.spans_left or report.adopted_left or report.spans_lost):
        sys.exit(f"shutdown left spans undelivered: {report}")
    print(json.dumps(results))
    """
)


def _spawn_workers(
    dsn: str, run_id: str, effects: Path, *, processes: int, threads: int, ids: int, lease: float
) -> list[subprocess.Popen[str]]:
    start_at = time.time() + 3.0  # every process imports and configures before the first call
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER,
                dsn,
                run_id,
                str(effects),
                str(ids),
                str(threads),
                str(lease),
                str(start_at),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]


def _rows(dsn: str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, params).fetchall()


@pytest.fixture()
def ledger(pg_dsn: str) -> Iterator[PostgresToolLedger]:
    """A ledger on a fresh database, installed for this test's tool calls."""
    database = Database(pg_dsn)
    installed = PostgresToolLedger(database, lease=2.0)
    set_tool_ledger(installed)
    try:
        yield installed
    finally:
        set_tool_ledger(None)
        installed.close()
        database.close()


def _run_id() -> str:
    return f"ledger-{uuid.uuid4().hex[:12]}"


@pytest.mark.multiprocess
def test_processes_and_threads_retrying_the_same_ids_run_each_body_once(pg_dsn, tmp_path):
    """4 processes x 4 threads invoking the same 25 invocation ids of one agent: every body runs
    exactly once (counted in a file every process appends to), and every caller, in every
    process, gets the one recorded result."""
    effects = tmp_path / "effects.txt"
    effects.touch()
    run_id = _run_id()
    procs = _spawn_workers(pg_dsn, run_id, effects, processes=4, threads=4, ids=25, lease=30.0)
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out))
    runs = Counter(effects.read_text().split())
    assert runs == Counter({str(i): 1 for i in range(25)})
    by_id: dict[int, set[str]] = {}
    for results in outputs:
        assert len(results) == 4 * 25
        for i, value in results:
            assert value["n"] == i
            by_id.setdefault(i, set()).add(json.dumps(value, sort_keys=True))
    assert all(len(values) == 1 for values in by_id.values())
    ledger_rows = _rows(
        pg_dsn,
        "SELECT status, attempt, count(*) FROM agentcap.tool_ledger WHERE run_id = %s "
        "GROUP BY status, attempt",
        run_id,
    )
    assert ledger_rows == [("succeeded", 1, 25)]


# A process that runs one protected call whose body appends "start" to a file and then sleeps for
# ever (it is SIGKILLed there), after a first call that completes.
_KILLED = textwrap.dedent(
    """
    import sys, time
    import otel_agentcap as ac
    from otel_agentcap.configure import configure
    from otel_agentcap.capture.ledger import set_tool_ledger
    from otel_agentcap.exporters.postgres import Database
    from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger

    dsn, run_id, effects, policy = sys.argv[1:5]
    agentcap = configure(dsn, announce=False)
    set_tool_ledger(PostgresToolLedger(Database(dsn), lease=1.5))

    @ac.tool
    def quick(n):
        with open(effects, "a") as f:
            f.write(f"quick-{n}\\n")
        return n

    @ac.tool(crash_policy=policy)
    def slow(n):
        with open(effects, "a") as f:
            f.write("slow-start\\n")
        time.sleep(3600)

    with ac.run(run_id, resume=True), ac.agent("worker"):
        quick.invoke("q", 1)
        slow.invoke("s", 1)
    """
)


def _start_and_kill(dsn: str, run_id: str, effects: Path, policy: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, dsn, run_id, str(effects), policy],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while "slow-start" not in effects.read_text():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _retry_tools(policy: str, effects: Path) -> tuple[ac.Tool[..., Any], ac.Tool[..., Any]]:
    @ac.tool(name="quick")
    def quick(n: int) -> int:
        with effects.open("a") as f:
            f.write(f"quick-{n}\n")
        return n

    @ac.tool(name="slow", crash_policy=policy)  # type: ignore[call-overload]
    def slow(n: int) -> str:
        with effects.open("a") as f:
            f.write("slow-start\n")
        return "finished here"

    return quick, slow


@pytest.mark.multiprocess
@pytest.mark.fault
def test_sigkill_inside_a_body_at_least_once_runs_it_again_after_the_lease(pg_dsn, tmp_path):
    """A process SIGKILLed inside a tool body: a retry in another process waits for the claim's
    lease to expire and runs the body again (attempt 2); the call that had completed is replayed,
    not run again; a later retry replays attempt 2."""
    effects = tmp_path / "effects.txt"
    effects.touch()
    run_id = _run_id()
    _start_and_kill(pg_dsn, run_id, effects, "at_least_once")
    database = Database(pg_dsn)
    set_tool_ledger(PostgresToolLedger(database, lease=1.5))
    quick, slow = _retry_tools("at_least_once", effects)
    try:
        started = time.monotonic()
        with capture_events() as captured, ac.run(run_id, resume=True), ac.agent("worker"):
            assert quick.invoke("q", 1) == 1
            assert slow.invoke("s", 1) == "finished here"
            waited = time.monotonic() - started
        invocations.forget_run(run_id)
        with ac.run(run_id, resume=True), ac.agent("worker"):
            assert slow.invoke("s", 1) == "finished here"
    finally:
        set_tool_ledger(None)
        database.close()
    assert effects.read_text().split() == ["quick-1", "slow-start", "slow-start"]
    assert waited < 10
    (event,) = captured.of_type("tool_invocation")
    assert event.payload["attempt"] == 2
    assert event.idempotency_key == "tool:s\x1fattempt2:invocation"
    assert _rows(
        pg_dsn,
        "SELECT invocation_id, attempt, status FROM agentcap.tool_ledger WHERE run_id = %s "
        "ORDER BY invocation_id",
        run_id,
    ) == [("q", 1, "succeeded"), ("s", 2, "succeeded")]


@pytest.mark.multiprocess
@pytest.mark.fault
def test_sigkill_inside_a_body_at_most_once_raises_outcome_unknown(pg_dsn, tmp_path):
    """An at_most_once tool whose process died inside its body is not run again: every retry, in
    any process, raises ToolOutcomeUnknown naming the invocation."""
    effects = tmp_path / "effects.txt"
    effects.touch()
    run_id = _run_id()
    _start_and_kill(pg_dsn, run_id, effects, "at_most_once")
    database = Database(pg_dsn)
    set_tool_ledger(PostgresToolLedger(database, lease=1.5))
    quick, slow = _retry_tools("at_most_once", effects)
    try:
        with ac.run(run_id, resume=True), ac.agent("worker"):
            assert quick.invoke("q", 1) == 1
            with pytest.raises(ToolOutcomeUnknown) as info:
                slow.invoke("s", 1)
            assert info.value.invocation_id == "s" and info.value.tool == "slow"
            assert "'s'" in str(info.value)
        invocations.forget_run(run_id)
        with ac.run(run_id, resume=True), ac.agent("worker"), pytest.raises(ToolOutcomeUnknown):
            slow.invoke("s", 1)
    finally:
        set_tool_ledger(None)
        database.close()
    assert effects.read_text().split() == ["quick-1", "slow-start"]


def test_a_protected_call_costs_two_round_trips(ledger):
    """Claim and complete: two statements per protected call on the success path."""

    @ac.tool
    def add(a: int, b: int) -> int:
        return a + b

    with ac.run(_run_id()), ac.agent("a"):
        add.invoke("warm", 1, 2)
        before = ledger.stats().round_trips
        for i in range(20):
            assert add.invoke(f"c{i}", i, 1) == i + 1
        after = ledger.stats().round_trips
    assert after - before == 40


def test_a_ledger_that_does_not_wait_for_the_flush_protects_calls_the_same_way(pg_dsn):
    """durable=False changes only how the ledger's statements commit: a call still runs once, is
    replayed from the ledger, and costs two statements."""
    database = Database(pg_dsn)
    fast = PostgresToolLedger(database, lease=2.0, durable=False)
    set_tool_ledger(fast)
    calls: list[int] = []

    @ac.tool
    def work(n: int) -> int:
        calls.append(n)
        return n * 2

    run_id = _run_id()
    try:
        with ac.run(run_id, resume=True), ac.agent("a"):
            assert work.invoke("w", 4) == 8
        with ac.run(run_id, resume=True), ac.agent("a"):
            assert work.invoke("w", 4) == 8
    finally:
        set_tool_ledger(None)
        fast.close()
        database.close()
    assert calls == [4]
    assert fast.stats().round_trips == 3  # claim and complete, then one claim that replays
    assert _rows(pg_dsn, "SELECT status FROM agentcap.tool_ledger WHERE run_id = %s", run_id) == [
        ("succeeded",)
    ]


def test_a_reused_id_with_other_input_is_its_own_row(ledger, pg_dsn):
    """The same invocation id with another input runs, has its own ledger row (ordinal 1) and its
    own events, each replayed on its own after the in-process registry is gone."""
    calls: list[int] = []

    @ac.tool
    def double(x: int) -> int:
        calls.append(x)
        return 2 * x

    run_id = _run_id()
    with ac.run(run_id, resume=True), ac.agent("a"):
        assert double.invoke("toolu_1", 1) == 2
        assert double.invoke("toolu_1", 5) == 10
    with (
        ac.run(run_id, resume=True),
        ac.agent("a"),
    ):  # a new scope: the run was released in this process
        assert double.invoke("toolu_1", 5) == 10
        assert double.invoke("toolu_1", 1) == 2
    assert calls == [1, 5]
    assert _rows(
        pg_dsn,
        "SELECT ordinal, status, result FROM agentcap.tool_ledger WHERE run_id = %s "
        "ORDER BY ordinal",
        run_id,
    ) == [(0, "succeeded", 2), (1, "succeeded", 10)]


class _NotImportedError(Exception):
    """An error type the replaying process can rebuild (its module is imported)."""


def test_errors_replay_with_their_type_or_as_recorded_tool_error(ledger, pg_dsn):
    """A recorded error is re-raised from the ledger as its own type when it can be rebuilt here,
    else as RecordedToolError with the type's name and the message."""

    @ac.tool
    def fails(kind: str) -> None:
        if kind == "key":
            raise KeyError("missing")
        raise _NotImportedError("rebuilt")

    run_id = _run_id()
    with ac.run(run_id, resume=True), ac.agent("a"):
        for kind in ("key", "own"):
            with pytest.raises((KeyError, _NotImportedError)):
                fails.invoke(f"e-{kind}", kind)
    # Another process would not have this test module: the stored type names it.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE agentcap.tool_ledger SET error = jsonb_set(error, '{module}', "
            "'\"not_imported_anywhere\"') WHERE run_id = %s AND invocation_id = 'e-own'",
            (run_id,),
        )
    with ac.run(run_id, resume=True), ac.agent("a"):
        with pytest.raises(KeyError) as key_error:
            fails.invoke("e-key", "key")
        assert key_error.value.args == ("missing",)
        with pytest.raises(RecordedToolError) as recorded:
            fails.invoke("e-own", "own")
    assert recorded.value.error_type == "not_imported_anywhere._NotImportedError"
    assert recorded.value.message == "rebuilt"
    assert str(recorded.value) == "not_imported_anywhere._NotImportedError: rebuilt"


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad \x00 value"),
        ValueError("lone \ud800 surrogate"),
        KeyError("k\x00"),
        ValueError("two", "x\x00"),
    ],
    ids=["nul", "surrogate", "key-nul", "args-nul"],
)
def test_an_error_whose_text_jsonb_cannot_hold_is_recorded_and_replayed(
    ledger, pg_dsn, caplog, error
):
    """A message with NUL or a lone surrogate (jsonb text holds neither) is recorded in the
    ledger, not lost with an error: the call's row is completed as failed, and a replay raises
    the error with the same type, arguments and message."""

    @ac.tool
    def fails() -> None:
        raise error

    run_id = _run_id()
    with ac.run(run_id, resume=True), ac.agent("a"), pytest.raises(type(error)):
        fails.invoke("e")
    assert "could not record" not in caplog.text
    with psycopg.connect(pg_dsn) as conn:
        states = conn.execute(
            "SELECT status FROM agentcap.tool_ledger WHERE run_id = %s", (run_id,)
        ).fetchall()
    assert states == [("failed",)]
    with ac.run(run_id, resume=True), ac.agent("a"), pytest.raises(type(error)) as replayed:
        fails.invoke("e")
    assert replayed.value is not error
    assert replayed.value.args == error.args
    assert str(replayed.value) == str(error)


def test_a_replay_from_the_ledger_is_the_callers_own_value(ledger):
    """Mutating a value replayed from the ledger changes neither later replays nor the log."""

    @ac.tool
    def make() -> dict[str, list[int]]:
        return {"items": [1, 2]}

    run_id = _run_id()
    with capture_events() as captured, ac.run(run_id, resume=True), ac.agent("a"):
        make.invoke("m")
    with ac.run(run_id, resume=True), ac.agent("a"):
        first = make.invoke("m")
        first["items"].append(3)
        assert make.invoke("m") == {"items": [1, 2]}
    assert captured.of_type("tool_result")[0].payload["result"] == {"items": [1, 2]}


def test_what_a_replay_in_another_process_returns(ledger):
    """The default codec brings back what JSON holds exactly (and bytes, NaN, NUL strings, long
    ints, non-string keys through their markers); tuples come back as lists and other objects as
    their repr marker. The pickle codec brings back the value itself."""

    class Point:
        def __init__(self, x: int) -> None:
            self.x = x

        def __repr__(self) -> str:
            return f"Point({self.x})"

    value = {
        "text": "a\x00b",
        "raw": b"\x00\xff",
        "big": 10**5000,
        "nan": float("inf"),
        "pair": (1, 2),
        "keys": {1: "one"},
        "obj": Point(3),
    }

    @ac.tool
    def produce() -> dict[str, Any]:
        return value

    @ac.tool(codec=PickleCodec())
    def produce_pickled() -> tuple[int, ...]:
        return (1, 2)

    run_id = _run_id()
    with ac.run(run_id, resume=True), ac.agent("a"):
        assert produce.invoke("p") is value
        produce_pickled.invoke("q")
    with ac.run(run_id, resume=True), ac.agent("a"):
        replayed = produce.invoke("p")
        assert produce_pickled.invoke("q") == (1, 2)
    assert replayed["text"] == "a\x00b" and replayed["raw"] == b"\x00\xff"
    assert replayed["big"] == 10**5000 and replayed["nan"] == float("inf")
    assert replayed["pair"] == [1, 2]
    assert replayed["keys"] == {"1": "one"}
    assert replayed["obj"]["$agentcap.repr"] == "Point(3)"


def test_the_invocation_id_and_an_idempotency_key_are_readable_inside_the_tool(ledger):
    """current_invocation() inside a body gives its invocation id and a key that is the same for
    every attempt of the call and differs for another input."""
    seen: list[Any] = []

    @ac.tool
    def charge(amount: int) -> None:
        info = current_invocation()
        seen.append(info)
        if len(seen) == 1:
            raise KeyboardInterrupt  # an interrupted attempt: not an outcome

    with ac.run(_run_id()), ac.agent("a"):
        with pytest.raises(KeyboardInterrupt):
            charge.invoke("pay-1", 10)
        charge.invoke("pay-1", 10)
        charge.invoke("pay-1", 11)
    assert [(i.invocation_id, i.attempt) for i in seen] == [
        ("pay-1", 1),
        ("pay-1", 2),
        ("pay-1", 1),
    ]
    assert seen[0].idempotency_key == seen[1].idempotency_key != seen[2].idempotency_key
    assert current_invocation() is None


def test_the_ledger_row_and_the_stored_events_agree(ledger, pg_dsn, stored):  # noqa: F811
    """Once exported, the ledger row's invocation and result event ids are the stored
    tool_invocation and tool_result events of the call."""

    @ac.tool
    def add(a: int, b: int) -> int:
        return a + b

    run_id = _run_id()
    with ac.run(run_id, resume=True), ac.agent("a"):
        add.invoke("x", 1, 2)
    ((invocation_id, result_id, result_seq),) = _rows(
        pg_dsn,
        "SELECT invocation_event_id, result_event_id, result_event_seq FROM agentcap.tool_ledger "
        "WHERE run_id = %s",
        run_id,
    )
    stored_rows = {
        event_id: (event_type, seq)
        for event_id, event_type, seq in _rows(
            pg_dsn,
            "SELECT event_id, event_type, logical_seq FROM agentcap.events WHERE run_id = %s",
            run_id,
        )
    }
    assert stored_rows[invocation_id][0] == "tool_invocation"
    assert stored_rows[result_id] == ("tool_result", result_seq)


def test_async_tools_are_protected_too(ledger, pg_dsn):
    """An async tool claims and completes in the ledger without blocking the event loop; a
    concurrent and a later replay get its result."""
    import asyncio

    calls: list[int] = []

    @ac.tool
    async def fetch(n: int) -> int:
        calls.append(n)
        await asyncio.sleep(0.05)
        return n * 3

    run_id = _run_id()

    async def main() -> list[int]:
        async with ac.agent("a"):
            return list(await asyncio.gather(*(fetch.invoke("f", 2) for _ in range(5))))

    with ac.run(run_id, resume=True):
        assert asyncio.run(main()) == [6] * 5
    with ac.run(run_id, resume=True):
        assert asyncio.run(main()) == [6] * 5
    assert calls == [2]


@pytest.mark.fault
def test_an_unreachable_ledger_runs_the_call_in_process(pg_dsn):
    """With the database unreachable the call runs (exactly once in this process), is counted,
    and nothing is raised, unless the ledger refuses unprotected calls."""
    database = Database("postgresql://nobody@127.0.0.1:1/none?connect_timeout=1")
    lenient = PostgresToolLedger(database, lease=2.0, timeout=0.5)
    strict = PostgresToolLedger(database, lease=2.0, timeout=0.5, on_unavailable="raise")
    calls: list[int] = []

    @ac.tool
    def work(n: int) -> int:
        calls.append(n)
        return n

    try:
        set_tool_ledger(lenient)
        with ac.run(_run_id()), ac.agent("a"):
            assert work.invoke("w", 1) == 1
            assert work.invoke("w", 1) == 1
        assert calls == [1]
        assert lenient.stats().unavailable >= 1
        set_tool_ledger(strict)
        with ac.run(_run_id()), ac.agent("a"), pytest.raises(ToolLedgerUnavailable):
            work.invoke("w", 2)
        assert calls == [1]
    finally:
        set_tool_ledger(None)
        database.close()


@pytest.mark.fault
def test_a_locked_ledger_row_makes_the_call_wait_not_run_again(ledger, pg_dsn):
    """Another session holding a lock on a call's ledger row (SELECT ... FOR UPDATE, for longer
    than the database's statement timeout) is not an outage: the retry waits for it (counted,
    one warning) instead of running the body without the ledger, then replays the outcome."""
    calls: list[int] = []

    @ac.tool
    def work(n: int) -> int:
        calls.append(n)
        return n + 1

    run_id = _run_id()
    with ac.run(run_id, resume=True), ac.agent("a"):
        assert work.invoke("w", 1) == 2
    holder = psycopg.connect(pg_dsn)
    holder.execute("SELECT * FROM agentcap.tool_ledger WHERE run_id = %s FOR UPDATE", (run_id,))
    done = threading.Event()

    def release() -> None:
        # Holds the lock past the statement timeout (2 s): until the retry has given up waiting
        # for it twice, or ran the body (the defect), or the test ends.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not done.is_set():
            if getattr(ledger.stats(), "lock_waits", 0) >= 2 or len(calls) > 1:
                break
            time.sleep(0.01)
        holder.rollback()

    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        with ac.run(run_id, resume=True), ac.agent("a"):
            assert work.invoke("w", 1) == 2
    finally:
        done.set()
        releaser.join()
        holder.close()
    assert calls == [1]
    stats = ledger.stats()
    assert stats.lock_waits >= 2 and stats.unavailable == 0 and stats.replays == 1


@pytest.mark.fault
def test_an_outcome_that_meets_a_locked_row_is_written_later_and_starts_no_cool_down(
    ledger, pg_dsn
):
    """An outcome whose ledger row another session holds locked is kept and written once the
    lock is gone, and the process's next call still claims in the ledger (a lock is not an
    outage: no cool-down that would run calls without it)."""
    holder = psycopg.connect(pg_dsn)

    @ac.tool
    def locking(n: int) -> int:
        holder.execute(
            "SELECT 1 FROM agentcap.tool_ledger WHERE invocation_id = 'locked' FOR UPDATE"
        )
        return n

    @ac.tool
    def other(n: int) -> int:
        return n

    run_id = _run_id()
    try:
        with ac.run(run_id, resume=True), ac.agent("a"):
            assert locking.invoke("locked", 1) == 1
            assert other.invoke("free", 2) == 2
        stats = ledger.stats()
        assert stats.unavailable == 0 and stats.lock_waits >= 1 and stats.claims == 2
        assert ledger.running_claims() == 1  # the locked outcome waits
    finally:
        holder.rollback()
        holder.close()
    deadline = time.monotonic() + 30
    while ledger.running_claims() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ledger.running_claims() == 0
    assert ledger.stats().completions_deferred == 1
    assert _rows(
        pg_dsn, "SELECT status FROM agentcap.tool_ledger WHERE run_id = %s ORDER BY 1", run_id
    ) == [("succeeded",), ("succeeded",)]


@pytest.mark.fault
def test_a_release_that_meets_a_locked_row_starts_no_cool_down(ledger, pg_dsn):
    """A call interrupted in its body whose ledger row another session holds locked is left to
    its lease (one warning), and the process's next call still claims in the ledger."""
    holder = psycopg.connect(pg_dsn)

    @ac.tool
    def interrupted() -> None:
        holder.execute("SELECT 1 FROM agentcap.tool_ledger WHERE invocation_id = 'stop' FOR UPDATE")
        raise KeyboardInterrupt

    @ac.tool
    def other(n: int) -> int:
        return n

    try:
        with ac.run(_run_id(), resume=True), ac.agent("a"):
            with pytest.raises(KeyboardInterrupt):
                interrupted.invoke("stop")
            assert other.invoke("free", 2) == 2
    finally:
        holder.rollback()
        holder.close()
    stats = ledger.stats()
    assert stats.unavailable == 0 and stats.lock_waits >= 1 and stats.claims == 2
    assert stats.releases == 0


@pytest.mark.fault
def test_an_outcome_that_cannot_be_written_is_written_later(ledger, pg_dsn, monkeypatch):
    """If the database fails when the outcome is recorded, the ledger keeps it, keeps the claim's
    lease alive and writes it once the database answers again: a retry elsewhere then replays it
    instead of running the body again."""
    real = Database.coordination

    def flaky(self: Database, *args: Any, **kwargs: Any) -> Any:
        # The first attempt, in the calling thread, fails; the ledger's own thread retries.
        if (
            threading.current_thread() is threading.main_thread()
            and sys._getframe(1).f_code.co_name == "_send_completion"
        ):
            raise ConnectionError("server gone")
        return real(self, *args, **kwargs)

    calls: list[int] = []

    @ac.tool
    def work(n: int) -> int:
        calls.append(n)
        return n + 1

    run_id = _run_id()
    monkeypatch.setattr(Database, "coordination", flaky)
    with ac.run(run_id, resume=True), ac.agent("a"):
        assert work.invoke("w", 1) == 2
    deadline = time.monotonic() + 10
    while ledger.running_claims() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ledger.running_claims() == 0
    assert ledger.stats().completions_deferred == 1
    with ac.run(run_id, resume=True), ac.agent("a"):
        assert work.invoke("w", 1) == 2
    assert calls == [1]


@pytest.mark.fault
def test_an_outcome_whose_answer_was_lost_is_not_reported_as_taken_over(
    ledger, pg_dsn, monkeypatch, caplog
):
    """If the connection breaks after the server committed an outcome (the client sees an error),
    the ledger writes it again later and recognises the row as its own outcome: it neither counts
    the call as taken over nor logs that the body ran more than once."""
    real = Database.coordination
    lost: list[bool] = []

    def lost_answer(self: Database, *args: Any, **kwargs: Any) -> Any:
        # The first outcome, written by the calling thread, commits and its answer is lost.
        if sys._getframe(1).f_code.co_name != "_send_completion" or lost:
            return real(self, *args, **kwargs)
        lost.append(True)

        @contextlib.contextmanager
        def committed_then_failed() -> Iterator[Any]:
            with real(self, *args, **kwargs) as conn:
                yield conn
            raise ConnectionFailed("database connection failed: server closed the connection")

        return committed_then_failed()

    calls: list[int] = []

    @ac.tool
    def work(n: int) -> int:
        calls.append(n)
        return n + 1

    run_id = _run_id()
    monkeypatch.setattr(Database, "coordination", lost_answer)
    with ac.run(run_id, resume=True), ac.agent("a"):
        assert work.invoke("w", 1) == 2
    assert lost == [True]
    deadline = time.monotonic() + 30
    while ledger.running_claims() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ledger.running_claims() == 0
    stats = ledger.stats()
    assert stats.completions_lost == 0
    assert "ran more than once" not in caplog.text
    assert _rows(
        pg_dsn, "SELECT status, attempt FROM agentcap.tool_ledger WHERE run_id = %s", run_id
    ) == [("succeeded", 1)]
    with ac.run(run_id, resume=True), ac.agent("a"):
        assert work.invoke("w", 1) == 2
    assert calls == [1]


def _expire_leases(dsn: str) -> None:
    """Let every claim's lease run out (as after its lease time, without waiting for it)."""
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE agentcap.tool_ledger SET lease_expires_at = now() - interval '1 h'")


def _break_connection(conn: psycopg.Connection[Any]) -> None:
    """Lose the connection as a network drop does, after the statement sent on it committed: its
    socket is shut down and the next use fails (psycopg raises OperationalError and marks it
    broken), so the client never learns the committed statement's answer."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)
    conn.execute(b"SELECT 1")


@pytest.mark.fault
@pytest.mark.parametrize("crash_policy", ["at_least_once", "at_most_once"])
@pytest.mark.parametrize("broken", ["after_the_commit", "before_the_server_read_it"])
def test_a_claim_whose_answer_was_lost_is_recognised_and_the_call_stays_protected(
    ledger, pg_dsn, monkeypatch, caplog, crash_policy, broken
):
    """If the connection breaks after a claim was sent (the client sees an error, the claim may
    have committed), the ledger reads the row again on a new connection: it finds its own claim
    (or, not committed, claims again) and runs the body under it, so the outcome is recorded and
    another process replays it instead of waiting for the lease and running the body again (or
    reading an unknown outcome)."""
    real = ledger._execute
    lost: list[bool] = []

    def lost_answer(conn: Any, query: bytes, params: Any, **kwargs: Any) -> Any:
        if query != ledger_module._CLAIM or lost:
            return real(conn, query, params, **kwargs)
        lost.append(True)
        if broken == "before_the_server_read_it":
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        cursor = real(conn, query, params, **kwargs)
        _break_connection(conn)
        return cursor

    calls: list[int] = []

    @ac.tool(crash_policy=crash_policy)
    def work(n: int) -> int:
        calls.append(n)
        return n + 1

    run_id = _run_id()
    monkeypatch.setattr(ledger, "_execute", lost_answer)
    with ac.run(run_id, resume=True), ac.agent("a"):
        assert work.invoke("w", 1) == 2
    assert lost == [True]
    stats = ledger.stats()
    assert (stats.claims, stats.unavailable, stats.completions) == (1, 0, 1)
    assert stats.lost_answers == 1
    assert "unavailable" not in caplog.text
    assert ("the claim holds" in caplog.text) == (broken == "after_the_commit")
    rows = _rows(
        pg_dsn,
        "SELECT run_id, agent_id, invocation_id, tool, call_digest, status, attempt, owner "
        "FROM agentcap.tool_ledger WHERE run_id = %s",
        run_id,
    )
    assert [row[5:] for row in rows] == [("succeeded", 1, None)]
    # Another process (a ledger of its own) asking for the call, its lease long expired.
    _expire_leases(pg_dsn)
    database = Database(pg_dsn)
    try:
        other = PostgresToolLedger(database, lease=2.0)
        run, agent, invocation, tool, digest = rows[0][:5]
        answer = other.claim(LedgerCall(run, agent, invocation, tool, digest, crash_policy))
    finally:
        database.close()
    assert (answer.state, answer.attempt) == ("succeeded", 1)
    assert calls == [1]


@pytest.mark.fault
@pytest.mark.parametrize("statement", ["release", "withdrawal"])
@pytest.mark.parametrize("broken", ["after_the_commit", "before_the_server_read_it"])
def test_a_release_whose_answer_was_lost_is_sent_again(
    ledger, pg_dsn, monkeypatch, caplog, statement, broken
):
    """If the connection breaks after the release of a claim (or the withdrawal of an unstarted
    one) was sent, it is sent again on a new connection: the claim is given up at once, so another
    process takes the call over without waiting for the lease, and no failure is logged."""
    call = LedgerCall(_run_id(), "a", "w", "t", "0" * 64, "at_least_once")
    assert ledger.claim(call).state == "claimed"
    query = ledger_module._RELEASE if statement == "release" else ledger_module._UNCLAIM
    real = ledger._execute
    lost: list[bool] = []

    def lost_answer(conn: Any, sent: bytes, params: Any, **kwargs: Any) -> Any:
        if sent != query or lost:
            return real(conn, sent, params, **kwargs)
        lost.append(True)
        if broken == "before_the_server_read_it":
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        cursor = real(conn, sent, params, **kwargs)
        _break_connection(conn)
        return cursor

    monkeypatch.setattr(ledger, "_execute", lost_answer)
    if statement == "release":
        ledger.release(call, 1)
    else:
        ledger.release_unstarted(call, 1)
    assert lost == [True]
    assert ledger.stats().releases == 1
    assert ledger.running_claims() == 0
    assert "could not" not in caplog.text
    database = Database(pg_dsn)
    try:
        answer = PostgresToolLedger(database, lease=2.0).claim(call)
    finally:
        database.close()
    assert (answer.state, answer.attempt) == ("claimed", 2 if statement == "release" else 1)


@pytest.mark.fault
@pytest.mark.parametrize("statement", ["outcome", "renewal"])
def test_an_outcome_or_renewal_whose_answer_was_lost_leaves_the_ledger_in_use(
    pg_dsn, monkeypatch, statement
):
    """If the connection breaks after an outcome or a lease renewal was committed, the statement
    is sent again at once on a new connection: the outcome is written then, and the next call is
    claimed in the ledger instead of running without it while PostgreSQL counts as unreachable."""
    database = Database(pg_dsn)
    ledger = PostgresToolLedger(database, lease=300.0)  # no renewal but the test's own
    set_tool_ledger(ledger)
    query = ledger_module._COMPLETE if statement == "outcome" else ledger_module._RENEW
    real = ledger._execute
    lost: list[bool] = []

    def lost_answer(conn: Any, sent: bytes, params: Any, **kwargs: Any) -> Any:
        cursor = real(conn, sent, params, **kwargs)
        if sent == query and not lost:
            lost.append(True)
            _break_connection(conn)
        return cursor

    @ac.tool
    def work(n: int) -> int:
        if statement == "renewal" and n == 1:
            with contextlib.suppress(ConnectionFailed):  # as the renewing thread does
                ledger._renew()
        return n + 1

    monkeypatch.setattr(ledger, "_execute", lost_answer)
    try:
        with ac.run(_run_id()), ac.agent("a"):
            assert work.invoke("w1", 1) == 2
            assert work.invoke("w2", 2) == 3
        stats = ledger.stats()
    finally:
        set_tool_ledger(None)
        ledger.close()
        database.close()
    assert lost == [True]
    assert (stats.claims, stats.unavailable, stats.completions) == (2, 0, 2)
    assert stats.completions_deferred == 0
    assert stats.renewals == (1 if statement == "renewal" else 0)


@pytest.mark.fault
def test_a_claim_whose_answer_was_lost_runs_in_process_if_the_server_stays_unreachable(
    ledger, pg_dsn, monkeypatch
):
    """If the connection breaks after a claim was sent and no new connection can be made, the
    call runs with in-process exactly-once only, as when the ledger is unreachable."""
    real_execute = ledger._execute
    real_coordination = Database.coordination

    def lost_answer(conn: Any, query: bytes, params: Any, **kwargs: Any) -> Any:
        cursor = real_execute(conn, query, params, **kwargs)
        if query == ledger_module._CLAIM:
            _break_connection(conn)
        return cursor

    def unreachable(self: Database, *args: Any, after_failure: bool = False, **kwargs: Any) -> Any:
        if after_failure:
            raise ConnectionFailed("cannot reach PostgreSQL: connection refused")
        return real_coordination(self, *args, **kwargs)

    calls: list[int] = []

    @ac.tool
    def work(n: int) -> int:
        calls.append(n)
        return n + 1

    monkeypatch.setattr(ledger, "_execute", lost_answer)
    monkeypatch.setattr(Database, "coordination", unreachable)
    with ac.run(_run_id()), ac.agent("a"):
        assert work.invoke("w", 1) == 2
        assert work.invoke("w", 1) == 2
    stats = ledger.stats()
    assert (stats.claims, stats.unavailable, stats.lost_answers) == (0, 1, 1)
    assert calls == [1]


@pytest.mark.fault
@pytest.mark.parametrize("crash_policy", ["at_least_once", "at_most_once"])
@pytest.mark.parametrize("cancelled", ["while_the_claim_runs", "after_it_returned"])
def test_a_task_cancelled_while_it_claims_leaves_no_claim_behind(
    ledger, pg_dsn, cancelled, crash_policy
):
    """An async call cancelled while its ledger claim is in flight (or returned but not yet seen)
    never started its body and gives up the claim it won: a retry runs the body (once) instead of
    waiting for a claim renewed forever by a process that runs no body, and an at_most_once call
    instead of raising ToolOutcomeUnknown."""
    import asyncio

    real = ledger.claim
    entered, returned = threading.Event(), threading.Event()
    go = threading.Event()

    def gated_claim(call: Any) -> Any:
        entered.set()
        go.wait(5)  # the claim starts only when the test says so, whatever the machine's load
        claim = real(call)
        returned.set()
        return claim

    calls: list[int] = []

    @ac.tool(crash_policy=crash_policy)
    async def work(n: int) -> int:
        calls.append(n)
        return n * 2

    async def main() -> int:
        async with ac.agent("a"):
            task = asyncio.create_task(work.invoke("w", 1))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            if cancelled == "after_it_returned":
                go.set()
                # Blocks the loop, so the task cannot see the claim yet; the pause lets the
                # worker thread finish its part after the claim returned.
                returned.wait(5)
                time.sleep(0.2)
            task.cancel()
            go.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            while not returned.is_set():  # the abandoned claim is won before the retry asks
                await asyncio.sleep(0.01)
            ledger.claim = real  # type: ignore[method-assign]
            return await asyncio.wait_for(work.invoke("w", 1), 10)

    ledger.claim = gated_claim  # type: ignore[method-assign]
    run_id = _run_id()
    with ac.run(run_id, resume=True):
        assert asyncio.run(main()) == 2
    assert calls == [1]
    rows = _rows(
        pg_dsn,
        "SELECT status, attempt, owner, lease_expires_at > now() FROM agentcap.tool_ledger "
        "WHERE run_id = %s",
        run_id,
    )
    # A rare failure at the dependency floors under CI load left the row running: the message
    # says with which claim, and what the ledger did.
    assert [row[0] for row in rows] == ["succeeded"], (rows, ledger.owner, ledger.stats())
    assert ledger.running_claims() == 0


@pytest.mark.fault
@pytest.mark.parametrize("crash_policy", ["at_least_once", "at_most_once"])
@pytest.mark.parametrize("interrupted", ["after_the_ledger_noted_it", "before_it_noted_it"])
def test_a_call_interrupted_inside_its_claim_leaves_no_claim_behind(
    ledger, pg_dsn, crash_policy, interrupted
):
    """A sync call interrupted (KeyboardInterrupt: Ctrl-C, a notebook's interrupt) after its
    claim was committed but before the claim returned never started its body: the claim is
    withdrawn, so a retry in this process runs the body at once, at_most_once too, instead of
    waiting on a claim this process renews while no body runs (or reading the claim as an
    unknown outcome once its lease expired)."""
    real = ledger.claim

    def interrupted_claim(call: Any) -> Any:
        real(call)
        if interrupted == "before_it_noted_it":
            ledger._running.clear()  # the interrupt came before claim() noted its claim
        raise KeyboardInterrupt

    calls: list[int] = []

    @ac.tool(crash_policy=crash_policy)
    def work(n: int) -> int:
        calls.append(n)
        return n * 2

    run_id = _run_id()
    results: list[int] = []
    with ac.run(run_id), ac.agent("a"):
        ledger.claim = interrupted_claim  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            work.invoke("w", 1)
        ledger.claim = real  # type: ignore[method-assign]
        # On a thread, so that a retry waiting for ever fails the test instead of hanging it.
        context = contextvars.copy_context()
        retry = threading.Thread(
            target=lambda: results.append(context.run(work.invoke, "w", 1)), daemon=True
        )
        retry.start()
        retry.join(30)
    assert results == [2]
    assert calls == [1]
    assert _rows(pg_dsn, "SELECT status FROM agentcap.tool_ledger WHERE run_id = %s", run_id) == [
        ("succeeded",)
    ]


@pytest.mark.fault
@pytest.mark.parametrize("crash_policy", ["at_least_once", "at_most_once"])
def test_a_call_whose_agent_timed_out_while_it_claimed_never_starts_its_body(
    ledger, pg_dsn, crash_policy
):
    """A call whose agent timed out while its ledger claim was in flight does not start its body
    after the agent_error: it raises AgentCancelled and gives its claim back, so the agent's next
    execution runs the body (once), at_most_once too."""
    real = ledger.claim
    go = threading.Event()

    def gated_claim(call: Any) -> Any:
        go.wait(10)  # the claim returns only after the agent has timed out
        return real(call)

    calls: list[int] = []
    outcome: list[object] = []

    @ac.tool(crash_policy=crash_policy)
    def pay(n: int) -> int:
        calls.append(n)
        return n * 2

    def first() -> None:
        try:
            outcome.append(pay.invoke("p", 1))
        except BaseException as exc:
            outcome.append(exc)

    run_id = _run_id()
    with capture_events() as captured, ac.run(run_id):
        agent = ac.agent("payer").agent
        ledger.claim = gated_claim  # type: ignore[method-assign]
        with pytest.raises(ac.AgentTimeoutError):
            agent.run(first, timeout=0.05)
        go.set()
        for thread in threading.enumerate():  # the worker, if it got to run at all
            if thread.name == "agent-payer":
                thread.join(10)
        ledger.claim = real  # type: ignore[method-assign]
        assert calls == []
        retried = agent.run(pay.invoke, "p", 1, timeout=30)
    # The call got AgentCancelled (or, on a machine too slow to start it in time, never ran).
    assert all(isinstance(error, ac.AgentCancelled) for error in outcome)
    assert retried == 2 and calls == [1]
    assert _rows(pg_dsn, "SELECT status FROM agentcap.tool_ledger WHERE run_id = %s", run_id) == [
        ("succeeded",)
    ]
    assert ledger.running_claims() == 0
    error = captured.of_type("agent_error")[0]
    assert all(e.seq > error.seq for e in captured.of_type("tool_invocation"))
    assert len(captured.of_type("tool_invocation")) == 1


@pytest.mark.fault
def test_a_claim_given_up_leaves_the_retry_that_claimed_the_call_again_noted(
    ledger, pg_dsn, monkeypatch
):
    """A claim given up (its body never started) whose row a retry in the same process claims
    again before the give-up finishes leaves the retry's claim noted: the retry's outcome is
    recorded, not lost as if its claim had been taken over."""
    call = LedgerCall(_run_id(), "a", "w", "t", "0" * 64, "at_most_once")
    assert ledger.claim(call).state == "claimed"
    real = ledger._execute
    retried: list[Any] = []

    def retry_right_after_the_withdrawal(conn: Any, sent: bytes, params: Any, **kwargs: Any) -> Any:
        cursor = real(conn, sent, params, **kwargs)
        if sent != ledger_module._UNCLAIM or retried:
            return cursor
        answer = cursor.fetchone()  # the withdrawal is done; the retry claims before it returns
        retried.append(ledger.claim(call))
        return types.SimpleNamespace(description=cursor.description, fetchone=lambda: answer)

    monkeypatch.setattr(ledger, "_execute", retry_right_after_the_withdrawal)
    ledger.release_unstarted(call, 1)
    monkeypatch.setattr(ledger, "_execute", real)
    [retry] = retried
    assert (retry.state, retry.attempt) == ("claimed", 1)
    assert ledger.running_claims() == 1
    ledger.complete(
        call,
        retry.attempt,
        succeeded=True,
        result=2,
        error=None,
        codec="json",
        invocation_event_id="",
        result_event_id=str(uuid.uuid4()),
        result_event_seq=3,
    )
    ledger.close()
    stats = ledger.stats()
    assert (stats.completions, stats.completions_lost) == (1, 0)
    assert _rows(
        pg_dsn, "SELECT status FROM agentcap.tool_ledger WHERE run_id = %s", call.run_id
    ) == [("succeeded",)]


def test_a_retry_noted_while_a_given_up_claim_is_forgotten_stays_noted(ledger):
    """Forgetting a given-up claim checks that the noted claim is still its own, then removes it;
    a retry of the same call that claimed the row and is noted by another thread between the
    check and the removal stays noted (CI at the dependency floors: the retry's outcome matched
    no row, 'finished after its claim was taken over', and the row stayed running)."""
    call = LedgerCall(_run_id(), "a", "w", "t", "0" * 64, "at_most_once")
    assert ledger.claim(call).state == "claimed"
    key = ledger_module._key(call)
    held = ledger._running[key]
    retry = ledger_module._Held(1, f"{ledger.owner}retry")
    retry_noted = threading.Event()

    class NotedDuringTheCheck(dict):  # type: ignore[type-arg]
        def get(self, k: Any, default: Any = None) -> Any:
            value = super().get(k, default)
            if k == key and not retry_noted.is_set():
                # Another thread notes the retry's claim right after the check read the map.
                noting = threading.Thread(
                    target=lambda: (ledger._note(key, retry), retry_noted.set())
                )
                noting.start()
                noting.join(0.5)  # without a lock the write lands here, before the removal
            return value

    ledger._running = NotedDuringTheCheck(ledger._running)
    ledger._forget(key, held.attempt, held.owner)
    assert retry_noted.wait(10)
    assert ledger._running.get(key) == retry
