"""``PostgresToolLedger``: the tool ledger in ``agentcap.tool_ledger`` (migration 0005).

One protected call costs two round trips on the success path, each one statement in autocommit
mode on a pooled connection held only for that statement: ``agentcap.tool_claim(...)`` before the
body runs, an ``UPDATE`` with the outcome after it.

* A claim has a lease (``lease`` seconds, 30 by default). While this process runs bodies, one
  background thread renews the leases of all its running claims in one statement every
  ``lease / 3`` seconds, so a body may run for as long as it needs; a process that dies stops
  renewing, and its claims expire. No connection is held per running tool.
* A caller that finds another process's live claim polls ``tool_claim`` again with exponential
  backoff (10 ms doubling to 0.5 s, with jitter; see ``capture.tools``) and holds no connection
  between polls.
* An outcome that cannot be written (the server is down) is kept and written by the background
  thread when the server is back; its claim's lease is renewed meanwhile, so nobody else runs the
  body again.
* When the ledger cannot be reached at claim time, the call runs with in-process exactly-once
  only (logged once per change, counted in ``stats()``), unless ``on_unavailable="raise"``.
* A claim whose connection broke after it was sent may have committed: the row is read again on a
  new connection (``Database.coordination(after_failure=True)``) and a claim carrying this claim's
  token as its ``owner`` (the process's ``owner`` prefix, then a number) is taken as made; an
  uncommitted claim is sent again. Only when that fails is the ledger unavailable for the call.
  An outcome, a renewal, a release or a withdrawal whose connection broke after it was sent is sent
  once more the same way (none changes anything a second time).
* A lock is not an outage. The ledger's statements wait at most ``LOCK_WAIT`` seconds (0.25 s,
  below the database's statement timeout) for a lock another session holds on the call's row or
  on the table (``SELECT ... FOR UPDATE`` in an open transaction, a claim whose commit is slow,
  a migration). A claim that gives up answers ``running``: the caller polls again with backoff,
  as for another process's live claim, and never runs the body without the ledger for it (one
  warning per call, counted in ``stats().lock_waits``; an agent's timeout still ends the wait).
  An outcome that meets a lock is written later, as when the server is down; a renewal that
  meets one is tried again at the next interval; a release (of an interrupted call) that meets
  one leaves the claim to its lease. None of these starts the cool-down that a server that is
  down or hung starts.
* Every statement commits durably (the server's ``synchronous_commit``): a claim is on disk before
  the body runs. That costs two commits (WAL flushes) per protected call. ``durable=False`` commits
  the ledger's statements without waiting for the flush (``SET LOCAL synchronous_commit TO off``,
  sent with the statement: still one round trip): much faster on slow disks, but a crash of the
  PostgreSQL server (not of the client) can lose the last claims and outcomes, and a lost claim
  lets another process run the body again.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal, NamedTuple

import psycopg
from psycopg import ClientCursor
from psycopg.types.json import Jsonb

from otel_agentcap.capture.ledger import LedgerCall, LedgerClaim
from otel_agentcap.errors import AgentCapError
from otel_agentcap.exporters.postgres.connection import first_line
from otel_agentcap.exporters.postgres.database import Database, answer_lost
from otel_agentcap.exporters.postgres.errors import ConnectionFailed

_logger = logging.getLogger(__name__)

DEFAULT_LEASE: Final = 30.0
#: The longest a ledger statement waits for a lock another session holds (see the module doc).
LOCK_WAIT: Final = 0.25

_CLAIM: Final = b"SELECT * FROM agentcap.tool_claim(%s, %s, %s, %s, %s, %s, %s, %s)"

_COMPLETE: Final = b"""
UPDATE agentcap.tool_ledger SET status = %s, codec = %s, result = %s, error = %s,
    invocation_event_id = %s, result_event_id = %s, result_event_seq = %s,
    owner = NULL, lease_expires_at = NULL, updated_at = now()
WHERE run_id = %s AND agent_id = %s AND invocation_id = %s AND call_digest = %s
  AND owner = %s AND attempt = %s AND status = 'running'
"""

_RELEASE: Final = b"""
UPDATE agentcap.tool_ledger SET status = 'released', owner = NULL, lease_expires_at = NULL,
    updated_at = now()
WHERE run_id = %s AND agent_id = %s AND invocation_id = %s AND call_digest = %s
  AND owner = %s AND attempt = %s AND status = 'running'
"""

# Whether the outcome of attempt %s with this result event is the one the row holds: a write of
# it whose answer was lost (the connection broke after the commit) and that was written again.
_HOLDS_OUTCOME: Final = b"""
SELECT 1 FROM agentcap.tool_ledger
WHERE run_id = %s AND agent_id = %s AND invocation_id = %s AND call_digest = %s
  AND attempt = %s AND status = %s AND result_event_id = %s AND result_event_seq = %s
"""

# A claim given up before its body started, by the only attempt there was (a fresh row): the row
# goes, as if never claimed, so a retry claims it anew (an at_most_once call too). Under the lock
# tool_claim takes, and only while no later call under the invocation id counted this row for its
# ordinal (that call keeps its ordinal; this row is released instead).
_UNCLAIM: Final = b"SELECT agentcap.tool_unclaim(%s, %s, %s, %s, %s, %s)"

# The running claim this process holds (any of its claim tokens: the owner starts with them).
_OWN_RUNNING_ATTEMPT: Final = b"""
SELECT l.attempt, l.owner FROM agentcap.tool_ledger l
WHERE l.run_id = %s AND l.agent_id = %s AND l.invocation_id = %s AND l.call_digest = %s
  AND starts_with(l.owner, %s) AND l.status = 'running'
"""

# The claim one claim statement made (its token is the owner), if it was committed: read after the
# statement's answer was lost (the connection broke after it was sent).
_MY_CLAIM: Final = b"""
SELECT l.attempt, l.ordinal FROM agentcap.tool_ledger l
WHERE l.run_id = %s AND l.agent_id = %s AND l.invocation_id = %s AND l.call_digest = %s
  AND l.owner = %s AND l.status = 'running'
"""

_RENEW: Final = b"""
UPDATE agentcap.tool_ledger l
SET lease_expires_at = clock_timestamp() + make_interval(secs => %s)
FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[]) AS k(run_id, agent_id,
    invocation_id, call_digest, owner)
WHERE l.run_id = k.run_id AND l.agent_id = k.agent_id AND l.invocation_id = k.invocation_id
  AND l.call_digest = k.call_digest AND l.owner = k.owner AND l.status = 'running'
"""


#: How often a claim is sent again after its answer was lost (the connection broke after it was
#: sent), each time on a new connection.
_LOST_ANSWER_RETRIES: Final = 2


class _Locked(Exception):
    """A ledger statement gave up waiting for a lock another session held."""


class ToolLedgerUnavailable(AgentCapError):
    """The tool ledger could not be reached and it was configured to refuse unprotected calls
    (``on_unavailable="raise"``)."""

    fatal = True


@dataclass
class LedgerStats:
    """Counters of what the ledger did (read them with :meth:`PostgresToolLedger.stats`)."""

    claims: int = 0
    replays: int = 0
    waits: int = 0
    completions: int = 0
    #: Outcomes written late, by the background thread, after the server came back.
    completions_deferred: int = 0
    #: Outcomes the ledger refused because the claim was no longer ours (its lease had expired
    #: and another process took the call over: the body ran twice).
    completions_lost: int = 0
    releases: int = 0
    renewals: int = 0
    #: Statements sent (each one round trip).
    round_trips: int = 0
    unavailable: int = 0
    #: Statements that gave up waiting for a lock another session held (a claim then polls
    #: again; see the module doc).
    lock_waits: int = 0
    #: Claims whose answer was lost (the connection broke after the claim was sent), read back
    #: on a new connection.
    lost_answers: int = 0


def _owner_id() -> str:
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:12]}/"


class _Held(NamedTuple):
    """A running claim this process holds: its attempt, and its token (the row's ``owner``)."""

    attempt: int
    owner: str


class _AnswerLost(Exception):
    """A claim statement was sent and its connection broke: whether it committed is unknown."""


class _Completion:
    __slots__ = ("attempt", "call", "params")

    def __init__(self, call: LedgerCall, attempt: int, params: tuple[Any, ...]) -> None:
        self.call = call
        self.attempt = attempt
        self.params = params


class PostgresToolLedger:
    """A :class:`~otel_agentcap.capture.ledger.ToolLedger` in PostgreSQL (see the module
    documentation). Install it with :func:`otel_agentcap.capture.ledger.set_tool_ledger`;
    ``configure()`` does."""

    def __init__(
        self,
        database: Database,
        *,
        lease: float = DEFAULT_LEASE,
        timeout: float = 2.0,
        on_unavailable: Literal["run", "raise"] = "run",
        durable: bool = True,
    ) -> None:
        if lease <= 0:
            raise ValueError("lease must be positive")
        if on_unavailable not in ("run", "raise"):
            raise ValueError("on_unavailable must be 'run' or 'raise'")
        self._database = database
        self.lease = lease
        self._timeout = timeout
        self._on_unavailable = on_unavailable
        self.durable = durable
        #: The prefix of this process's claim tokens: each claim stores ``owner`` followed by a
        #: number of its own as the row's owner, so a claim whose answer was lost is told from
        #: any other claim of this process.
        self.owner = _owner_id()
        self._tokens = itertools.count(1)
        # Running claims of this process: key -> attempt and token; the renewing thread reads a
        # snapshot. Noting a claim and forgetting one take ``_running_lock``: forgetting is a
        # check then a removal, which a claim of the same call noted in between must not lose.
        self._running: dict[tuple[str, str, str, str], _Held] = {}
        self._running_lock = threading.Lock()
        # Calls waiting for a lock on their row (warned about once each), bounded.
        self._lock_waiting: dict[tuple[str, str, str, str], None] = {}
        self._pending: list[_Completion] = []
        self._pending_lock = threading.Lock()
        self._stats = LedgerStats()
        self._stats_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        after_fork = weakref.WeakMethod(self._after_fork)
        os.register_at_fork(after_in_child=lambda: _call(after_fork))
        atexit.register(_call, weakref.WeakMethod(self._close_at_exit))

    # ----------------------------------------------------------------- protocol

    def claim(self, call: LedgerCall) -> LedgerClaim:
        token = f"{self.owner}{next(self._tokens)}"
        params = (
            call.run_id,
            call.agent_id,
            call.invocation_id,
            call.digest,
            call.tool,
            token,
            self.lease,
            call.crash_policy == "at_most_once",
        )
        try:
            try:
                row = self._send_claim(params, after_failure=False)
            except _AnswerLost as lost:
                row = self._claim_after_lost_answer(call, params, lost)
        except Exception as exc:
            self._count("unavailable")
            if self._on_unavailable == "raise":
                raise ToolLedgerUnavailable(f"the tool ledger is unavailable: {exc}") from exc
            raise
        key = _key(call)
        if row is None:
            self._waits_for_lock(call, key)
            return LedgerClaim("running", 0, 0)
        if self._lock_waiting:
            self._lock_waiting.pop(key, None)
        assert row is not None
        state, attempt, ordinal, codec, result, error, result_event_id, result_event_seq = row
        if state == "claimed":
            self._count("claims")
            self._note(key, _Held(int(attempt), token))
            self._start_thread()
        elif state == "running":
            self._count("waits")
        else:
            self._count("replays")
        return LedgerClaim(
            state,
            int(attempt),
            int(ordinal),
            result,
            error,
            codec,
            None if result_event_id is None else str(result_event_id),
            None if result_event_seq is None else int(result_event_seq),
        )

    def _send_claim(self, params: tuple[Any, ...], *, after_failure: bool) -> Any:
        """Run ``tool_claim`` once: its row, or None when it gave up waiting for a lock. Raises
        ``_AnswerLost`` when the connection broke after the statement was sent."""
        sent = False
        try:
            with self._database.coordination(self._timeout, after_failure=after_failure) as conn:
                self._count("round_trips")
                try:
                    sent = True
                    return self._execute(conn, _CLAIM, params, lock_wait=True).fetchone()
                except psycopg.errors.LockNotAvailable:
                    return None  # caught here: a lock is not an outage (no cool-down)
        except ConnectionFailed as exc:
            if sent and answer_lost(exc):
                raise _AnswerLost(str(exc)) from exc
            raise

    def _claim_after_lost_answer(
        self, call: LedgerCall, params: tuple[Any, ...], lost: _AnswerLost
    ) -> Any:
        """The claim with ``params`` was sent and its answer lost: whether it committed is
        unknown. On a new connection, the row is read: if it holds this claim (its token is the
        owner), the claim was committed and the caller runs the body under it; else the claim is
        sent again (it claims, waits or replays, as the first one would have). Raises what the
        new connection raises (the ledger is unavailable then)."""
        token = params[5]
        for tries_left in range(_LOST_ANSWER_RETRIES, -1, -1):
            self._count("lost_answers")
            with self._database.coordination(self._timeout, after_failure=True) as conn:
                self._count("round_trips")
                mine = conn.execute(_MY_CLAIM, (*_key(call), token)).fetchone()
            if mine is not None:
                _logger.warning(
                    "agentcap: the connection broke after invocation %s of %s was claimed (%s); "
                    "read back on a new connection: the claim holds, the call runs under it",
                    call.invocation_id,
                    call.tool,
                    lost,
                )
                return ("claimed", mine[0], mine[1], None, None, None, None, None)
            try:
                return self._send_claim(params, after_failure=True)
            except _AnswerLost as again:
                if not tries_left:
                    raise ConnectionFailed(f"database connection failed: {again}") from again
                lost = again
        raise AssertionError("unreachable")

    def complete(
        self,
        call: LedgerCall,
        attempt: int,
        *,
        succeeded: bool,
        result: Any,
        error: Any,
        codec: str,
        invocation_event_id: str,
        result_event_id: str,
        result_event_seq: int,
    ) -> None:
        params = (
            "succeeded" if succeeded else "failed",
            codec,
            Jsonb(result) if succeeded else None,
            None if succeeded else Jsonb(error),
            invocation_event_id or None,
            result_event_id,
            result_event_seq,
            *self._held(call, attempt),
        )
        completion = _Completion(call, attempt, params)
        if not self._write_completion(completion):
            with self._pending_lock:
                self._pending.append(completion)
            self._start_thread()
            self._wake.set()

    def release(self, call: LedgerCall, attempt: int, owner: str | None = None) -> None:
        """Give up claim ``attempt`` of ``call`` (its body was interrupted); ``owner`` is its token
        when this process no longer notes the claim as running. Never raises."""
        key = _key(call)
        held = self._held(call, attempt, owner)
        try:
            locked, _ = self._idempotent(_RELEASE, held)
            if locked:
                self._count("lock_waits")
                raise _Locked("another session holds a lock on its row")
            self._count("releases")
        except Exception:
            # Not released: the lease runs out instead and the call is taken over then.
            _logger.warning(
                "agentcap: could not release invocation %s of %s; it is taken over when its "
                "lease expires",
                call.invocation_id,
                call.tool,
                exc_info=True,
            )
        self._forget(key, attempt, held[4])

    def release_unstarted(self, call: LedgerCall, attempt: int, owner: str | None = None) -> None:
        """Give up the caller's claim before its body started (its caller was cancelled while
        the claim was in flight): a first attempt's row is removed, so the next claim runs the
        body, also for an ``at_most_once`` call, whose released claim would otherwise read as an
        unknown outcome; any other claim is released (:meth:`release`). Never raises."""
        key = _key(call)
        held = self._held(call, attempt, owner)
        try:
            locked, row = self._idempotent(_UNCLAIM, held)
            if locked:
                self._count("lock_waits")
                raise _Locked("another session holds a lock on its row")
            removed = bool(row and row[0])
        except Exception as exc:
            removed = False
            _logger.warning(
                "agentcap: could not withdraw the claim of invocation %s of %s (%s); releasing it",
                call.invocation_id,
                call.tool,
                first_line(exc),
            )
        if not removed:
            self.release(call, attempt, held[4])
            return
        self._count("releases")
        self._forget(key, attempt, held[4])

    def withdraw_interrupted(self, call: LedgerCall) -> None:
        """The caller was interrupted (``KeyboardInterrupt``, ``SystemExit``) inside
        :meth:`claim`, so whether its claim was committed is unknown, and its body never started:
        withdraw the claim of ``call`` this process holds, if any (:meth:`release_unstarted`).
        Never raises."""
        held = self._running.get(_key(call))
        if held is None:
            try:
                with self._database.coordination(self._timeout) as conn:
                    self._count("round_trips")
                    row = conn.execute(_OWN_RUNNING_ATTEMPT, (*_key(call), self.owner)).fetchone()
            except Exception as exc:
                _logger.warning(
                    "agentcap: could not look for the interrupted claim of invocation %s of %s "
                    "(%s); it is taken over when its lease expires",
                    call.invocation_id,
                    call.tool,
                    first_line(exc),
                )
                return
            if row is None:
                return  # the claim was not committed
            held = _Held(int(row[0]), str(row[1]))
        self.release_unstarted(call, held.attempt, held.owner)

    # ----------------------------------------------------------------- internals

    def _idempotent(self, query: bytes, params: tuple[Any, ...]) -> tuple[bool, Any]:
        """Run a statement that may run twice (a release, a withdrawal, a lease renewal):
        whether it gave up waiting for a lock, and its first row (None without one). When its
        connection broke after it was sent (committed or not, the answer is lost), it is sent
        once more at once, on a new connection."""
        for after_failure in (False, True):
            sent = False
            try:
                with self._database.coordination(
                    self._timeout, after_failure=after_failure
                ) as conn:
                    self._count("round_trips")
                    sent = True
                    try:
                        cursor = self._execute(conn, query, params, lock_wait=True)
                        return False, cursor.fetchone() if cursor.description else None
                    except psycopg.errors.LockNotAvailable:
                        return True, None  # caught here: a lock is not an outage (no cool-down)
            except ConnectionFailed as exc:
                if after_failure or not (sent and answer_lost(exc)):
                    raise
        raise AssertionError("unreachable")

    def _held(
        self, call: LedgerCall, attempt: int, owner: str | None = None
    ) -> tuple[str, str, str, str, str, int]:
        """The claim ``attempt`` of ``call`` this process holds, as ``_COMPLETE`` (its last six
        parameters), ``_RELEASE`` and ``_UNCLAIM`` name it: run, agent, invocation id, call
        digest, owner (the claim's token: ``owner``, else the one noted when it was claimed),
        attempt."""
        if owner is None:
            held = self._running.get(_key(call))
            # A claim no longer noted matches no row (its token is not this process's prefix).
            owner = held.owner if held is not None and held.attempt == attempt else self.owner
        return (*_key(call), owner, attempt)

    def _execute(
        self,
        conn: psycopg.Connection[Any],
        query: bytes,
        params: tuple[Any, ...],
        *,
        lock_wait: bool = False,
    ) -> psycopg.Cursor[Any]:
        """Run one statement (one round trip); without ``durable``, in a transaction whose commit
        does not wait for the WAL flush; with ``lock_wait``, waiting at most ``LOCK_WAIT`` seconds
        for a lock (``psycopg.errors.LockNotAvailable`` then)."""
        settings = b""
        if not self.durable:
            settings += b"SET LOCAL synchronous_commit TO off; "
        if lock_wait:
            settings += b"SET LOCAL lock_timeout = %d; " % self._lock_wait_ms
        if not settings:
            return conn.execute(query, params)
        cursor = ClientCursor(conn)
        cursor.execute(settings + query, params)
        for _ in range(settings.count(b";")):
            cursor.nextset()  # past the result of each SET, to the statement's
        return cursor

    @property
    def _lock_wait_ms(self) -> int:
        """``LOCK_WAIT`` in milliseconds, below the database's statement timeout."""
        return max(1, min(int(LOCK_WAIT * 1000), int(self._database.quick_timeout * 500)))

    def _waits_for_lock(self, call: LedgerCall, key: tuple[str, str, str, str]) -> None:
        self._count("lock_waits")
        if key in self._lock_waiting:
            return
        if len(self._lock_waiting) >= 1024:
            self._lock_waiting.clear()
        self._lock_waiting[key] = None
        _logger.warning(
            "agentcap: invocation %s of %s waits: another session holds a lock on its row of "
            "agentcap.tool_ledger (or on the table); it runs or replays once the lock is gone, "
            "never without the ledger",
            call.invocation_id,
            call.tool,
        )

    def _write_completion(self, completion: _Completion) -> bool:
        """Write one outcome; False if the server could not be reached (kept for later)."""
        call = completion.call
        key = _key(call)
        try:
            updated = self._send_completion(completion)
            if updated is None:
                self._count("lock_waits")
                return False  # kept, written later (a lock is not an outage: no cool-down)
        except psycopg.Error as exc:
            # The statement itself failed (not the connection): retrying cannot help.
            _logger.error(
                "agentcap: could not record the outcome of invocation %s of %s: %s",
                call.invocation_id,
                call.tool,
                exc,
            )
            self._forget(key, completion.attempt, completion.params[-2])
            return True
        except Exception:
            return False
        self._count("completions")
        if updated != 1:
            self._count("completions_lost")
            _logger.error(
                "agentcap: invocation %s of %s (attempt %d) finished after its claim was taken "
                "over (its lease expired): the body ran more than once",
                call.invocation_id,
                call.tool,
                completion.attempt,
            )
        self._forget(key, completion.attempt, completion.params[-2])
        return True

    def _send_completion(self, completion: _Completion) -> int | None:
        """Write one outcome: 1 if the row holds it now, 0 if the claim was taken over, None if
        the write gave up waiting for a lock. When the connection broke after the write was sent
        (committed or not), it is sent once more at once on a new connection: a write that had
        committed is recognised then (``_holds_outcome``)."""
        for after_failure in (False, True):
            sent = False
            try:
                with self._database.coordination(
                    self._timeout, after_failure=after_failure
                ) as conn:
                    self._count("round_trips")
                    sent = True
                    try:
                        cursor = self._execute(conn, _COMPLETE, completion.params, lock_wait=True)
                    except psycopg.errors.LockNotAvailable:
                        return None
                    updated = cursor.rowcount
                    if updated != 1:
                        updated = self._holds_outcome(conn, completion)
                    return updated
            except ConnectionFailed as exc:
                if after_failure or not (sent and answer_lost(exc)):
                    raise
        raise AssertionError("unreachable")

    def _holds_outcome(self, conn: psycopg.Connection[Any], completion: _Completion) -> int:
        """1 if the row holds ``completion`` already (an earlier write of it committed and its
        answer was lost), else 0."""
        params = completion.params
        self._count("round_trips")
        row = conn.execute(
            _HOLDS_OUTCOME,
            (*_key(completion.call), completion.attempt, params[0], params[5], params[6]),
        ).fetchone()
        return 1 if row is not None else 0

    def _forget(self, key: tuple[str, str, str, str], attempt: int, owner: str) -> None:
        """Stop noting (and renewing) claim ``attempt`` of ``key`` whose token is ``owner``. A
        later claim of the same call noted since (a retry in this process that claimed the row
        again after this claim was given up, even with the same attempt) is kept: its outcome and
        renewals name its own token."""
        with self._running_lock:
            held = self._running.get(key)
            if held is not None and held.attempt == attempt and held.owner == owner:
                del self._running[key]

    def _note(self, key: tuple[str, str, str, str], held: _Held) -> None:
        """Note claim ``held`` of ``key`` as running (renewed until it is forgotten)."""
        with self._running_lock:
            self._running[key] = held

    def _start_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._thread_lock:
            if self._closed or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(
                target=self._renew_loop, name="agentcap-ledger", daemon=True
            )
            self._thread.start()

    def _renew_loop(self) -> None:
        interval = self.lease / 3
        while not self._closed:
            self._wake.wait(interval)
            self._wake.clear()
            if self._closed:
                return
            try:
                self._flush_pending()
                self._renew()
            except Exception:
                _logger.debug("agentcap: ledger renewal failed", exc_info=True)

    def _renew(self) -> None:
        running = [(*key, held.owner) for key, held in list(self._running.items())]
        if not running:
            return
        columns = [list(column) for column in zip(*running, strict=True)]
        locked, _ = self._idempotent(_RENEW, (self.lease, *columns))
        if locked:
            self._count("lock_waits")
            return  # tried again at the next interval (no cool-down)
        self._count("renewals")

    def _flush_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, []
        left: list[_Completion] = []
        for completion in pending:
            if left or not self._write_completion(completion):
                left.append(completion)
            else:
                self._count("completions_deferred")
        if left:
            with self._pending_lock:
                self._pending[:0] = left

    def _count(self, field: str) -> None:
        with self._stats_lock:
            setattr(self._stats, field, getattr(self._stats, field) + 1)

    def _after_fork(self) -> None:
        """A forked child holds none of its parent's claims and has no renewing thread."""
        self.owner = _owner_id()
        self._tokens = itertools.count(1)
        self._running = {}
        self._running_lock = threading.Lock()
        self._pending = []
        self._pending_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._thread_lock = threading.Lock()
        self._thread = None
        self._wake = threading.Event()

    def _close_at_exit(self) -> None:
        if not self._closed:
            self.close()

    def stats(self) -> LedgerStats:
        with self._stats_lock:
            return LedgerStats(**asdict(self._stats))

    def running_claims(self) -> int:
        """Claims this process holds now (bodies running, or outcomes not yet written)."""
        return len(self._running)

    def close(self, timeout: float = 2.0) -> None:
        """Write the outcomes still pending (for up to ``timeout`` seconds) and stop renewing."""
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            try:
                self._flush_pending()
            except Exception:
                break
            if self._pending:
                time.sleep(0.1)
        self._closed = True
        self._wake.set()


def _key(call: LedgerCall) -> tuple[str, str, str, str]:
    return (call.run_id, call.agent_id, call.invocation_id, call.digest)


def _call(method: weakref.WeakMethod[Any]) -> None:
    """Call a weakly held bound method if its object is still alive."""
    bound = method()
    if bound is not None:
        bound()
