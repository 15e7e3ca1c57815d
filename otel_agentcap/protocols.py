"""The package's interfaces in one place: what a store implements to serve capture, what the
mapping reads of a span, and the records they exchange.

Capture works with nothing behind it: sequences, tool outcomes, spawns and runs are then known in
this process only. ``configure()`` installs the PostgreSQL implementations
(:mod:`otel_agentcap.exporters.postgres`), and tests install their own.

=========================  ==================================  ======================================
interface                  used by                             implementations
=========================  ==================================  ======================================
:class:`SequenceSource`    the Lamport clocks                  ``PostgresSequenceSource``,
                                                               ``HostAwareSequenceSource``
:class:`ToolLedger`        ``Tool.invoke`` (exactly once)      ``PostgresToolLedger``
:class:`Codec`             the tool ledger's results           ``JsonCodec``, ``PickleCodec``
:class:`SpawnRegistry`     ``spawn()`` across processes        ``PostgresSpawnRegistry``
:class:`SpawnLookup`       (earlier versions' registry)        ``PostgresSpawnLookup``
:class:`RunRegistry`       ``run()`` (a run id is new or       ``PostgresRunRegistry``
                           resumed)
:class:`MemoryBase`        agents' shared memory               ``Memory``, ``PostgresMemory``
:class:`SpanLike`          the mapping of spans to events      the SDK's ``ReadableSpan``, the
                                                               ingest's ``OtlpSpan``
:class:`SpanCheck`         ``batch_from_spans``                the ingest's field validation
:class:`ConnectionSource`  ``EventWriter``                     ``psycopg_pool.ConnectionPool``,
                                                               ``DedicatedConnection``
=========================  ==================================  ======================================

Only the standard library, ``opentelemetry-api`` and :mod:`otel_agentcap.model` are imported here
(psycopg for type checking only), so every layer of the package can name these types.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, Protocol

from opentelemetry.trace import SpanContext
from opentelemetry.util.types import AttributeValue

from otel_agentcap.model import AgentRecord, Event, EventRef

if TYPE_CHECKING:
    import psycopg

# Sequences: blocks reserved across processes.


class SequenceSource(Protocol):
    """Reserves blocks of sequences for one agent, exclusively across processes."""

    def reserve(self, run_id: str, agent_id: str, *, at_least: int, size: int) -> int:
        """Return ``start >= at_least`` such that ``[start, start + size)`` belongs to the caller
        alone, and is above every sequence stored for the agent."""
        ...


# Tools: the ledger that runs an invocation once across processes.


CrashPolicy = Literal["at_least_once", "at_most_once"]
#: What happens to an invocation whose claim was held by a process that died (its lease expired):
#: ``at_least_once`` runs the body again (as the next attempt), ``at_most_once`` raises
#: :class:`~otel_agentcap.errors.ToolOutcomeUnknown` naming the invocation, now and on every retry.
DEFAULT_CRASH_POLICY: Final[CrashPolicy] = "at_least_once"
CRASH_POLICIES: Final = frozenset({"at_least_once", "at_most_once"})

ClaimState = Literal["claimed", "running", "succeeded", "failed", "unknown"]


class LedgerCall(NamedTuple):
    """One invocation identity, as the ledger keys it."""

    run_id: str
    agent_id: str
    invocation_id: str
    tool: str
    digest: str
    crash_policy: CrashPolicy = DEFAULT_CRASH_POLICY


class LedgerClaim(NamedTuple):
    """The answer to :meth:`ToolLedger.claim`.

    ``state`` is ``claimed`` (the caller runs the body, as ``attempt``), ``running`` (another
    process holds a live claim, or another session a lock on the call's record: ask again later), ``succeeded`` / ``failed`` (the recorded outcome:
    ``result`` in the ``codec``'s encoding, or ``error`` as :func:`encode_error` wrote it), or
    ``unknown`` (the claim's holder died and the tool's policy is at most once). ``ordinal`` is 0
    for the first call recorded under the invocation id and k > 0 for the k-th call that reused the
    id with another tool or input."""

    state: ClaimState
    attempt: int = 1
    ordinal: int = 0
    result: Any = None
    error: Any = None
    codec: str | None = None
    result_event_id: str | None = None
    result_event_seq: int | None = None


class ToolLedger(Protocol):
    """Records tool invocations in a store shared by processes, before their bodies run.

    Calls are synchronous; ``claim`` and ``complete`` are one round trip each on the success path.
    Implementations keep a claim alive while its body runs (``claim`` ... ``complete`` /
    ``release``) and let it expire when the process dies."""

    def claim(self, call: LedgerCall) -> LedgerClaim: ...

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
        """Record the outcome of the caller's claim (never raises: a store that is down gets it
        later)."""
        ...

    def release(self, call: LedgerCall, attempt: int) -> None:
        """Give up the caller's claim without an outcome (the body was interrupted), so the next
        claim runs it again. Never raises."""
        ...


class Codec(Protocol):
    """How a tool's result is written to the ledger and read back in another process.

    ``encode`` returns a value JSON can hold (it is stored as ``jsonb``); ``decode`` gets that value
    back, parsed."""

    name: str

    def encode(self, value: Any) -> Any: ...

    def decode(self, data: Any) -> Any: ...


# Spawns: registered when they happen, seen by every process of the run.


@dataclass(frozen=True, slots=True)
class SpawnRecord:
    """A child's registered spawn: its parent and name, the ``agent_spawn`` event, the span that
    carries it (the ``create_agent`` span), under which the child's executions run so that a
    child resumed in another process joins the run's trace, and whether the caller's own spawn
    was the one registered (``won``). ``offline``: registered on this host only (the shared
    registry did not answer), so the delivery of its event registers it there first."""

    parent_agent_id: str
    name: str | None
    spawned_at: EventRef
    span_context: SpanContext | None = None
    won: bool = False
    offline: bool = False

    @property
    def spawn_span(self) -> SpanContext | None:
        """The ``create_agent`` span of the spawn, if known."""
        return self.span_context if self.span_context is not None else self.spawned_at.span


class SpawnClaim(NamedTuple):
    """A spawn as the caller would register it (trace and span ids in hex, as the log stores
    them)."""

    run_id: str
    child_agent_id: str
    parent_agent_id: str
    name: str
    key: str | None
    spawn_event_id: str
    spawn_seq: int
    trace_id: str | None
    span_id: str | None


class SpawnRegistry(Protocol):
    """Registers spawns where every process serving a run sees them, when they happen: the first
    registration of a child wins, and every later one (from any process) gets the winner's record.
    ``configure()`` installs the PostgreSQL one."""

    def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None:
        """The registered spawn of the child, if any (a retry then starts no span at all)."""
        ...

    def register(self, claim: SpawnClaim) -> SpawnRecord: ...


class SpawnLookup(Protocol):
    """Finds a child spawned by an earlier process (the interface of earlier versions; a
    :class:`SpawnRegistry` replaces it)."""

    def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None: ...


# Runs: a run id is claimed when the run opens.


@dataclass(frozen=True, slots=True)
class StoredRun:
    """A run the store knows, with its root span when that was recorded."""

    run_id: str
    root_span: SpanContext | None = None


class RunRegistry(Protocol):
    """Claims run ids in a store shared by processes (``configure()`` installs the PostgreSQL
    one). Called when a run opens, outside any lock; may raise (the run then opens unchecked,
    with a warning)."""

    def claim(
        self, run_id: str, root_span: SpanContext | None, started_at: datetime
    ) -> StoredRun | None:
        """Record ``run_id`` as started at ``started_at`` (its root span's start), with its root
        span; return None when this call created it, or the stored run, unchanged, when it
        existed."""
        ...


# Memory: the mapping interface of agents' shared memory.


@dataclass(frozen=True, slots=True)
class Lookup:
    """The outcome of a read: ``found`` is False for a missing key, True for a stored ``None``.
    ``written_by`` is the write the read saw: the one that stored the value, or for a missing key
    the delete that removed it (None when no recorded write is known). ``version`` is the key's
    version as read (0 for a key never written), for :meth:`Memory.compare_and_set`."""

    found: bool
    value: Any = None
    written_by: EventRef | None = None
    version: int = 0


class MemoryBase(ABC):
    """The mapping interface shared by :class:`Memory` and ``PostgresMemory``: implementations
    provide :meth:`lookup`, :meth:`set`, :meth:`delete`, :meth:`compare_and_set`, :meth:`keys`."""

    name: str

    @abstractmethod
    def lookup(self, key: str) -> Lookup:
        """Read ``key``, recording a ``memory_read`` event inside an agent."""

    @abstractmethod
    def set(self, key: str, value: Any) -> EventRef | None:
        """Store a copy of ``value``; returns the ``memory_write`` event (None outside an
        agent)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it was there. Recorded as a write with
        ``after_found: false``."""

    @abstractmethod
    def compare_and_set(self, key: str, expected_version: int, value: Any) -> EventRef | bool:
        """Write ``value`` (or delete, with :data:`MISSING`) only if ``key`` is at
        ``expected_version`` (as :attr:`Lookup.version` reported it; 0 for a key never written).
        Returns the ``memory_write`` event (True outside an agent) if it wrote, False if the
        version differed (nothing is written or recorded)."""

    @abstractmethod
    def keys(self) -> list[str]:
        """The keys present now, without recording a read."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.lookup(key).found

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __getitem__(self, key: str) -> Any:
        found = self.lookup(key)
        if not found.found:
            raise KeyError(key)
        return found.value

    def __setitem__(self, key: str, value: Any) -> None:
        self.set(key, value)

    def __delitem__(self, key: str) -> None:
        if not self.delete(key):
            raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        found = self.lookup(key)
        return found.value if found.found else default


# Spans: what the mapping reads, and the checks it applies.


class _SpanContextLike(Protocol):
    @property
    def trace_id(self) -> int: ...

    @property
    def span_id(self) -> int: ...


class _SpanEventLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def attributes(self) -> Mapping[str, AttributeValue] | None: ...

    @property
    def timestamp(self) -> int: ...


class SpanLike(Protocol):
    """What the mapping reads of an SDK ``ReadableSpan``."""

    @property
    def name(self) -> str: ...

    @property
    def attributes(self) -> Mapping[str, AttributeValue] | None: ...

    @property
    def events(self) -> Sequence[_SpanEventLike]: ...

    @property
    def start_time(self) -> int | None: ...

    @property
    def end_time(self) -> int | None: ...

    @property
    def context(self) -> _SpanContextLike | None: ...


class SpanCheck(Protocol):
    """A check :func:`batch_from_spans` applies to each span's records before it takes them:
    returns why the span must be rejected, or None. ``root_run`` is the run id of a run's root
    span (which has no events), else None."""

    def __call__(
        self,
        span: SpanLike,
        events: Sequence[Event],
        agents: Sequence[AgentRecord],
        run_attributes: Mapping[str, Any] | None,
        root_run: str | None,
    ) -> str | None: ...


# Storage: where the event writer gets its connections.


class ConnectionSource(Protocol):
    """Where a writer gets its connection: a ``psycopg_pool.ConnectionPool`` or a
    ``connection.DedicatedConnection``."""

    def connection(
        self, timeout: float | None = None
    ) -> AbstractContextManager[psycopg.Connection[Any]]: ...
