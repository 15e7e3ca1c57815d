"""The queue directory: one queue per process, locked while its process lives, adopted by one
later process once it has ended (however it ended), and kept apart per database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from otel_agentcap.exporters.durable.directory import (
    QueueDirectory,
    default_base_dir,
    target_key,
    target_of,
)

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from otel_agentcap.exporters.durable.directory import QueueDirectory

    queue = QueueDirectory(Path(sys.argv[1]), "db").create_queue()
    print(queue.name, flush=True)
    time.sleep(60)
    """
)


def _holder(base) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(base)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


@pytest.mark.multiprocess
def test_a_live_process_keeps_its_queue_and_a_killed_one_leaves_it_for_one_adopter(tmp_path):
    """While its process lives a queue is not adopted; after SIGKILL exactly one of two
    adopters gets it, and a released adopter hands it on to the next."""
    proc, name = _holder(tmp_path)
    directory = QueueDirectory(tmp_path, "db")
    try:
        assert [q.name for q in directory.queues()] == [name]
        assert list(directory.adopt()) == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    first = list(directory.adopt())
    second = list(QueueDirectory(tmp_path, "db").adopt())
    assert [q.name for q in first] == [name]
    assert second == []
    first[0].release()
    (again,) = QueueDirectory(tmp_path, "db").adopt()
    again.remove()
    assert directory.queues() == []


def test_own_queue_is_never_adopted_by_its_own_process(tmp_path):
    """A process's own queue is locked by it: its own adoption scan passes it by."""
    directory = QueueDirectory(tmp_path, "db")
    own = directory.create_queue()
    assert list(directory.adopt()) == []
    own.remove()


def test_leftovers_of_a_creation_cut_short_are_removed_when_old(tmp_path):
    """A temporary queue directory a process left while creating its queue goes once it is old;
    a fresh one (its creator may be at work) stays."""
    directory = QueueDirectory(tmp_path, "db")
    directory.ensure()
    old = directory.path / ".tmp-123-abc"
    old.mkdir()
    (old / "lock").write_text("")
    fresh = directory.path / ".tmp-456-def"
    fresh.mkdir()
    past = time.time() - 3600
    os.utime(old, (past, past))
    directory.cleanup_temporary()
    assert not old.exists() and fresh.exists()


def test_queues_of_different_databases_are_kept_apart_and_hold_no_password(tmp_path):
    """Two databases get two directories; the DSN's password is in neither name nor file."""
    a = QueueDirectory(tmp_path, target_of("postgresql://u:s3cret@h:5432/one"))
    b = QueueDirectory(tmp_path, target_of("postgresql://u:s3cret@h:5432/two"))
    a.ensure()
    b.ensure()
    assert a.path != b.path
    for directory in (a, b):
        assert "s3cret" not in directory.path.name
        assert "s3cret" not in (directory.path / "target").read_text()
    assert target_of("host=h port=5432 dbname=one user=u password=x") == "u@h:5432/one"
    assert target_key("u@h:5432/one").startswith("one-")


def test_default_location(monkeypatch, tmp_path):
    """AGENTCAP_QUEUE_DIR wins; root gets /var/lib, anyone else the user's state directory."""
    monkeypatch.setenv("AGENTCAP_QUEUE_DIR", str(tmp_path))
    assert default_base_dir() == tmp_path
    monkeypatch.delenv("AGENTCAP_QUEUE_DIR")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert str(default_base_dir()) == "/var/lib/otel-agentcap/queue"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert default_base_dir().parts[-2:] == ("otel-agentcap", "queue")


def test_queue_directories_are_private(tmp_path):
    """Queues hold payloads: their directories are readable by their user only."""
    directory = QueueDirectory(tmp_path / "base", "db")
    queue = directory.create_queue()
    assert (directory.path.stat().st_mode & 0o077) == 0
    assert (queue.path.stat().st_mode & 0o077) == 0
    queue.remove()
