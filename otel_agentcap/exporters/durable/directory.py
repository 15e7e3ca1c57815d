"""Where the durable queue lives, and how processes share it.

Layout, under the base directory (``AGENTCAP_QUEUE_DIR``, else ``/var/lib/otel-agentcap/queue``
for root, else ``platformdirs.user_state_dir("otel-agentcap")/queue``)::

    <base>/<target>/                 one per database (host, port, database, user: no password),
        target                       so a queue is only ever delivered to the database it was for
        sequences.sqlite3            this host's sequence floors (see ``host_sequences``)
        spawns.sqlite3               this host's spawns (see ``host_spawns``)
        p-<pid>-<random>/            one queue per process that writes (see ``segments``)
            lock                     held (flock) by its process while it lives
            000000000000.seg ...     segment files
            acked                    the position up to which everything is stored
        rejected/                    records the database refuses for good (dead letters)

A process creates its queue under a temporary name, locks it, then renames it into place, so no
other process ever sees it unlocked. The kernel releases the lock when the process ends, however
it ends (``SIGKILL`` included); a later process that finds a queue whose lock it can take adopts
it, delivers its records, and removes it. Locks are ``flock`` locks: the directory must be on a
local file system (flock over NFS is not reliable).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import platformdirs
from psycopg.conninfo import conninfo_to_dict

ENV_QUEUE_DIR: Final = "AGENTCAP_QUEUE_DIR"
ROOT_QUEUE_DIR: Final = Path("/var/lib/otel-agentcap/queue")
QUEUE_PREFIX: Final = "p-"
LOCK_FILE: Final = "lock"
TARGET_FILE: Final = "target"
REJECTED_DIR: Final = "rejected"
SEQUENCES_FILE: Final = "sequences.sqlite3"
SPAWNS_FILE: Final = "spawns.sqlite3"
_TMP_PREFIX: Final = ".tmp-"


def default_base_dir() -> Path:
    """``$AGENTCAP_QUEUE_DIR``, else ``/var/lib/otel-agentcap/queue`` for root, else the user's
    state directory (``~/.local/state/otel-agentcap/queue`` on Linux)."""
    override = os.environ.get(ENV_QUEUE_DIR)
    if override:
        return Path(override).expanduser()
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return ROOT_QUEUE_DIR
    return Path(platformdirs.user_state_dir("otel-agentcap")) / "queue"


def target_of(dsn: str) -> str:
    """What identifies the database of ``dsn`` (no password): ``user@host:port/dbname``."""
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        params = {}
    host = str(params.get("host") or params.get("hostaddr") or "")
    port = str(params.get("port") or "")
    dbname = str(params.get("dbname") or "")
    user = str(params.get("user") or "")
    if not (host or port or dbname or user):
        return dsn.split("?", 1)[0].rsplit("@", 1)[-1]
    return f"{user}@{host}:{port}/{dbname}"


def target_key(target: str) -> str:
    """The directory name of ``target``: its database name (for people) and a hash."""
    digest = hashlib.sha256(target.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    dbname = target.rsplit("/", 1)[-1] if "/" in target else target
    readable = "".join(c if c.isalnum() or c in "_-" else "-" for c in dbname)[:32]
    return f"{readable or 'db'}-{digest}"


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@dataclass
class LockedQueue:
    """A queue directory this process holds the lock of (its own, or an adopted one)."""

    path: Path
    lock_fd: int

    @property
    def name(self) -> str:
        return self.path.name

    def release(self) -> None:
        """Give the lock up (the directory stays, for a later process)."""
        if self.lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)
            self.lock_fd = -1

    def remove(self) -> None:
        """Delete the directory (its records are all stored), then give the lock up."""
        for entry in list(self.path.iterdir()) if self.path.exists() else ():
            if entry.name != LOCK_FILE:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
        with contextlib.suppress(FileNotFoundError):
            (self.path / LOCK_FILE).unlink()
        with contextlib.suppress(OSError):
            self.path.rmdir()
        self.release()


class QueueDirectory:
    """The queue directory of one database (``<base>/<target>``)."""

    def __init__(self, base: Path, target: str) -> None:
        self.base = base
        self.target = target
        self.path = base / target_key(target)

    @property
    def rejected(self) -> Path:
        return self.path / REJECTED_DIR

    @property
    def sequences(self) -> Path:
        return self.path / SEQUENCES_FILE

    @property
    def spawns(self) -> Path:
        return self.path / SPAWNS_FILE

    def ensure(self) -> None:
        """Create the directory (private to the user) if needed; raises OSError."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        target_file = self.path / TARGET_FILE
        if not target_file.exists():
            tmp = self.path / f"{_TMP_PREFIX}target-{secrets.token_hex(4)}"
            tmp.write_text(self.target + "\n", encoding="utf-8", errors="surrogateescape")
            tmp.replace(target_file)

    def create_queue(self) -> LockedQueue:
        """A new, locked queue directory for this process; raises OSError."""
        self.ensure()
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        tmp = self.path / f"{_TMP_PREFIX}{name}"
        tmp.mkdir(mode=0o700)
        fd = os.open(tmp / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if not _lock(fd):  # pragma: no cover - a fresh file nobody else knows
                raise OSError(f"cannot lock {tmp / LOCK_FILE}")
            final = self.path / f"{QUEUE_PREFIX}{name}"
            tmp.rename(final)
        except BaseException:
            os.close(fd)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return LockedQueue(final, fd)

    def queues(self) -> list[Path]:
        """Every process queue in the directory, oldest name first."""
        try:
            entries = list(self.path.iterdir())
        except OSError:
            return []
        return sorted(e for e in entries if e.name.startswith(QUEUE_PREFIX) and e.is_dir())

    def adopt(self, skip: frozenset[str] | set[str] = frozenset()) -> Iterator[LockedQueue]:
        """Lock and yield the queues whose process has ended (their lock is free), except those
        named in ``skip``. Another live process holding one, or adopting it first, skips it."""
        for path in self.queues():
            if path.name in skip:
                continue
            try:
                fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                # Created without a lock file (cannot happen with create_queue) or being removed.
                continue
            except OSError:
                continue
            if not _lock(fd) or not path.exists():
                os.close(fd)
                continue
            yield LockedQueue(path, fd)

    def cleanup_temporary(self, min_age: float = 60.0) -> None:
        """Remove what processes died leaving behind before their queue was in place (entries
        older than ``min_age`` seconds whose lock, if any, is free)."""
        try:
            entries = list(self.path.iterdir())
        except OSError:
            return
        for entry in entries:
            if not entry.name.startswith(_TMP_PREFIX):
                continue
            try:
                if entry.stat().st_mtime > time.time() - min_age:
                    continue
            except OSError:
                continue
            if not entry.is_dir():
                with contextlib.suppress(OSError):
                    entry.unlink()
                continue
            try:
                fd = os.open(entry / LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                fd = -1
            if fd >= 0:
                locked = _lock(fd)
                os.close(fd)
                if not locked:
                    continue
            shutil.rmtree(entry, ignore_errors=True)
