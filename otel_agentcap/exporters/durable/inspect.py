"""What a queue directory holds, for ``otel-agentcap queue status`` (reads only: no queue is
locked for longer than it takes to see whether its process still runs)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Any

from .directory import LOCK_FILE, QueueDirectory
from .segments import AckFile, segment_indexes, segment_path


def _locked(path: os.PathLike[str]) -> bool:
    """Whether a process holds the queue's lock (it is running)."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases the lock if this took it
    return False


def queue_report(directory: QueueDirectory) -> dict[str, Any]:
    """The queues in ``directory``: name, bytes, segments, acked position, whether their
    process runs; and how many files of rejected records there are."""
    queues = []
    for path in directory.queues():
        indexes = segment_indexes(path)
        size = 0
        for index in indexes:
            with contextlib.suppress(OSError):
                size += os.stat(segment_path(path, index)).st_size
        acked = AckFile(path).load()
        queues.append(
            {
                "name": path.name,
                "bytes": size,
                "segments": len(indexes),
                "acked": [acked.segment, acked.offset],
                "locked": _locked(path),
            }
        )
    rejected = directory.rejected
    try:
        rejected_files = sum(1 for entry in rejected.iterdir() if entry.suffix == ".seg")
    except OSError:
        rejected_files = 0
    return {
        "path": str(directory.path),
        "target": directory.target,
        "queues": queues,
        "rejected": str(rejected),
        "rejected_files": rejected_files,
    }
