"""FaultLog: one line when a fault starts, a reminder at most once per interval, one line when
it ends; never a line per occurrence, never a traceback, always one line of text."""

from __future__ import annotations

import logging

from otel_agentcap.exporters.faults import FaultLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_fault_is_logged_when_it_starts_and_when_it_ends(caplog):
    """A thousand failures of one condition make one line, its recovery one more, with how
    long it lasted, how many failures, and what waits."""
    clock = Clock()
    faults = FaultLog(lambda: "12 spans waiting", clock=clock, reminder_every=60)
    with caplog.at_level(logging.WARNING):
        for _ in range(1000):
            faults.fault("PostgreSQL", "connection refused", consequence="retrying")
            clock.now += 0.01
        faults.recovered("PostgreSQL")
        faults.recovered("PostgreSQL")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "agentcap: PostgreSQL: connection refused; retrying; 12 spans waiting",
        "agentcap: PostgreSQL: recovered after 10.0 s (1000 failures); 12 spans waiting",
    ]
    assert not any(r.exc_info for r in caplog.records)


def test_a_long_fault_is_reminded_at_most_once_per_interval(caplog):
    """While a fault lasts, a reminder with the count comes once per interval, not per failure."""
    clock = Clock()
    faults = FaultLog(clock=clock, reminder_every=60)
    with caplog.at_level(logging.WARNING):
        for _ in range(300):  # five minutes, one failure a second
            faults.fault("disk queue", "No space left on device")
            clock.now += 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5
    assert "still failing after 60 s (61 failures" in lines[1]


def test_conditions_are_independent_and_reasons_are_one_line(caplog):
    """Two conditions log apart; a reason spanning lines (libpq's) is logged on one line."""
    faults = FaultLog()
    with caplog.at_level(logging.WARNING):
        faults.fault("PostgreSQL", "connection failed\n\tIs the server running?")
        faults.fault("disk queue", "read-only file system")
        faults.recovered("disk queue")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "agentcap: PostgreSQL: connection failed Is the server running?"
    assert len(lines) == 3
    assert faults.is_active("PostgreSQL") and not faults.is_active("disk queue")
