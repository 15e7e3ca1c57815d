"""Sequence blocks through the host's store: processes of one host never get overlapping blocks
for an agent, also while PostgreSQL is down, and offline blocks stay near the known floor."""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
import textwrap

import pytest

from otel_agentcap.exporters.durable.host_sequences import (
    MAX_OFFLINE_JUMP,
    HostAwareSequenceSource,
    HostSequenceStore,
)
from otel_agentcap.exporters.faults import FaultLog


class Remote:
    """A sequence source that hands out consecutive blocks, or fails while ``down``."""

    def __init__(self) -> None:
        self.next = 0
        self.down = False
        self.asked: list[int] = []

    def reserve(self, run_id: str, agent_id: str, *, at_least: int, size: int) -> int:
        self.asked.append(at_least)
        if self.down:
            raise ConnectionError("PostgreSQL is down")
        start = max(self.next, at_least)
        self.next = start + size
        return start


def test_offline_blocks_start_above_the_known_floor_and_continue_without_gaps(tmp_path):
    """The first offline block of an outage starts above every block the host had (by at most
    MAX_OFFLINE_JUMP), the next ones right after it; once the remote answers again it is asked
    for a block above the offline ones."""
    remote = Remote()
    source = HostAwareSequenceSource(
        remote, HostSequenceStore(tmp_path / "s.db"), faults=FaultLog()
    )
    assert source.reserve("r", "a", at_least=1, size=100) == 1
    remote.down = True
    first = source.reserve("r", "a", at_least=101, size=100)
    second = source.reserve("r", "a", at_least=first + 100, size=100)
    assert 101 <= first <= 101 + MAX_OFFLINE_JUMP
    assert second == first + 100
    remote.down = False
    back = source.reserve("r", "a", at_least=second + 100, size=100)
    assert remote.asked[-1] >= second + 100 and back >= second + 100


_TAKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from otel_agentcap.exporters.durable.host_sequences import HostSequenceStore

    store = HostSequenceStore(Path(sys.argv[1]))
    blocks = []
    for i in range(int(sys.argv[2])):
        start, failure = store.reserve("r", "shared", at_least=1, size=16, remote=None)
        blocks.append(start)
    print(json.dumps(blocks))
    """
)


@pytest.mark.multiprocess
def test_processes_taking_offline_blocks_at_once_never_overlap(tmp_path):
    """Four processes taking offline blocks for one agent at the same time from one store get
    disjoint blocks."""
    import json

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TAKER, str(tmp_path / "s.db"), "150"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    starts = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        starts.extend(json.loads(out))
    starts.sort()
    assert len(starts) == 600
    assert all(b - a >= 16 for a, b in itertools.pairwise(starts))


def test_a_store_that_cannot_be_used_leaves_the_remote_alone_in_charge(tmp_path, caplog):
    """When the store's file cannot be opened the remote still serves (one log line); with the
    remote down too, the error reaches the clock, which has its own last resort."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    remote = Remote()
    source = HostAwareSequenceSource(remote, HostSequenceStore(blocker / "s.db"), faults=FaultLog())
    with caplog.at_level(logging.WARNING):
        assert source.reserve("r", "a", at_least=5, size=10) == 5
        assert source.reserve("r", "a", at_least=15, size=10) == 15
    assert caplog.text.count("sequence blocks") == 1
    remote.down = True
    with pytest.raises(ConnectionError):
        source.reserve("r", "a", at_least=25, size=10)


def test_outage_is_logged_once_and_its_end_once(tmp_path, caplog):
    """Many offline blocks during one outage make one line; the first block from the remote
    again makes one more."""
    remote = Remote()
    source = HostAwareSequenceSource(
        remote, HostSequenceStore(tmp_path / "s.db"), faults=FaultLog()
    )
    remote.down = True
    with caplog.at_level(logging.WARNING):
        at = 1
        for _ in range(50):
            at = source.reserve("r", "a", at_least=at, size=10) + 10
        remote.down = False
        source.reserve("r", "a", at_least=at, size=10)
    lines = [r.getMessage() for r in caplog.records if "sequence blocks" in r.getMessage()]
    assert len(lines) == 2
    assert "recovered" in lines[1]
