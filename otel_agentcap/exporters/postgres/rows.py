"""Turn a ``model.Batch`` into the rows the writer sends: validated, sanitised, sorted, resolved
within the batch.

Everything here is pure Python (no I/O). Every event, agent row and run row is first checked
against ``otel_agentcap.validation`` (the same rules for every writer: the exporter, the OTLP
ingest, a hand-built batch); one that breaks a rule is left out and counted with its reason, the
rest of the batch is kept. Values PostgreSQL would reject are made storable: NUL and lone
surrogates in free text are escaped, payloads go through ``jsonsafe`` whenever they are not
already plain JSON that jsonb accepts.
"""

from __future__ import annotations

import json
import operator
import struct
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Generic, NamedTuple, TypeVar

from psycopg.types.json import Jsonb

from otel_agentcap import jsonsafe
from otel_agentcap.model import (
    AgentRecord,
    Batch,
    Event,
    EventType,
    RunRecord,
    SpanRecord,
    from_fields,
)
from otel_agentcap.pipeline.call_identity import CallIndex, call_ids, conflict_reason
from otel_agentcap.validation import Validator

from .errors import InvalidBatch

#: Larger payloads are stored as a ``$agentcap.truncated`` marker (jsonb's own limit is ~255 MB).
DEFAULT_MAX_PAYLOAD_CHARS: Final = 64 * 1024 * 1024

UUID_OID: Final = 2950
_ARRAY_HEAD: Final = struct.Struct("!iiI")
_DIM: Final = struct.Struct("!ii")
_UUID_LEN: Final = struct.pack("!i", 16)
_NO_UUIDS: Final = _ARRAY_HEAD.pack(0, 0, UUID_OID)
#: A ``uuid[]`` of one element without that element (most events have one causal parent).
_ONE_UUID: Final = _ARRAY_HEAD.pack(1, 0, UUID_OID) + _DIM.pack(1, 1) + _UUID_LEN

_MODEL_CALL: Final = EventType.MODEL_CALL.value

#: Column order of the staging table and of the binary COPY, with the COPY types: an ``EventRow``
#: and, last, the run's start (the partition key), which the writer reads from ``agentcap.runs``.
STAGING_COLUMNS: Final = (
    ("event_id", "uuid"),
    ("run_id", "text"),
    ("agent_id", "text"),
    ("logical_seq", "int8"),
    ("wall_time", "timestamptz"),
    ("event_type", "text"),
    ("causal_parent_ids", "uuid[]"),
    ("idempotency_key", "text"),
    ("trace_id", "text"),
    ("span_id", "text"),
    ("payload", "jsonb"),
    ("batch_reason", "text"),
    ("batch_conflict_with", "uuid"),
    ("run_started_at", "timestamptz"),
)

#: The columns of ``agentcap.events`` (and of a conflict's copy of the row), in COPY order.
EVENT_COLUMNS: Final = (*(name for name, _ in STAGING_COLUMNS[:11]), "run_started_at")


class EventRow(NamedTuple):
    """One staged row. Ids are raw 16-byte UUIDs and the parents a ready binary ``uuid[]``, so
    the COPY sends them as they are (``binary_dumpers``), without building ``uuid.UUID`` objects."""

    event_id: bytes
    run_id: str
    agent_id: str
    logical_seq: int
    wall_time: datetime
    event_type: str
    causal_parent_ids: bytes
    idempotency_key: str
    trace_id: str | None
    span_id: str | None
    payload: Jsonb | None
    batch_reason: str | None
    batch_conflict_with: bytes | None


#: An agents row: run, agent, name, parent agent, spawn event, lineage known.
AgentRow = tuple[str, str, str | None, str | None, uuid.UUID | None, bool]
#: A runs row: run, start, declared attributes (None: not declared), root span trace and span id.
RunRow = tuple[str, datetime | None, Jsonb | None, str | None, str | None]
#: ``EventRow`` from one tuple of its fields, built in C (a row per event is made).
_new_row = from_fields(EventRow)

_Item = TypeVar("_Item")


class DeferredRows(Sequence[_Item], Generic[_Item]):
    """Rows built only when read, from compact tuples (``one_pass``): when the COPY data built
    with them is used, the writer needs only how many there are and their runs, and building
    every row (datetimes, ``Jsonb`` wrappers) was a large part of the delivery thread's work.
    ``run_index`` is the place of the run id in each compact tuple; ``direct_candidate`` says
    no row collides with another of the batch and every event type is one the table takes.
    Read from one thread at a time (the writer's); equal to a list of the same rows."""

    __slots__ = ("_built", "_items", "_make", "_run_index", "direct_candidate")

    def __init__(
        self,
        items: list[tuple[Any, ...]],
        make: Callable[[tuple[Any, ...]], _Item],
        run_index: int,
        *,
        direct_candidate: bool = False,
    ) -> None:
        self._items = items
        self._make = make
        self._run_index = run_index
        self._built: list[_Item] | None = None
        self.direct_candidate = direct_candidate

    def _rows(self) -> list[_Item]:
        built = self._built
        if built is None:
            built = self._built = list(map(self._make, self._items))
        return built

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[_Item]:
        return iter(self._rows())

    def __getitem__(self, index: Any) -> Any:
        return self._rows()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DeferredRows):
            other = other._rows()
        return isinstance(other, list) and self._rows() == other

    __hash__ = None  # type: ignore[assignment]

    def run_counts(self) -> Counter[str]:
        """How many rows each run has (without building the rows)."""
        return Counter(map(operator.itemgetter(self._run_index), self._items))


def row_runs(rows: Sequence[EventRow]) -> set[str]:
    """The runs of event rows (of ``DeferredRows`` without building them)."""
    if type(rows) is DeferredRows:
        return set(rows.run_counts())
    return set(map(_RUN_ID, rows))


def row_run_counts(rows: Sequence[EventRow]) -> Counter[str]:
    """How many event rows each run has (of ``DeferredRows`` without building them)."""
    if type(rows) is DeferredRows:
        return rows.run_counts()
    return Counter(map(_RUN_ID, rows))


def span_row_runs(rows: Sequence[SpanRow]) -> set[str]:
    """The runs of span envelope rows (of ``DeferredRows`` without building them)."""
    if type(rows) is DeferredRows:
        return set(rows.run_counts())
    return set(map(_FIRST_FIELD, rows))


_RUN_ID: Final = operator.attrgetter("run_id")
_FIRST_FIELD: Final = operator.itemgetter(0)


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    events: Sequence[EventRow]
    in_batch_duplicates: int
    #: One row per run named by the batch: what it offers to store.
    runs: list[RunRow]
    #: One row per agent named by the batch, its fields merged (the first known value wins).
    agents: list[AgentRow]
    #: Every distinct attribute declaration of a run in the batch, to compare with what is stored.
    run_offers: list[tuple[str, Jsonb]] = field(default_factory=list)
    #: Every distinct agent record that knows a name or a lineage, to compare with what is stored.
    agent_offers: list[AgentRow] = field(default_factory=list)
    #: Why each record that broke a validation rule was left out.
    rejected: tuple[str, ...] = ()
    #: How many of those were events.
    events_rejected: int = 0
    spans: Sequence[SpanRow] = field(default_factory=list)


def clean_text(value: str) -> str:
    """``value`` with NUL and lone surrogates escaped, so PostgreSQL text accepts it."""
    if value.isascii() and "\x00" not in value:
        return value
    return value.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def _opt_text(value: str | None) -> str | None:
    return None if value is None else clean_text(str(value))


class _CleanTexts(dict[str, str]):
    """``clean_text`` of each text value, made once: runs, agents, event types, traces, span
    names and services repeat from record to record. Use one per batch (it keeps every value)."""

    def __missing__(self, value: str) -> str:
        text = self[value] = clean_text(value)
        return text


def _uuid(value: object, what: str) -> uuid.UUID:
    return uuid.UUID(bytes=uuid_bytes(value, what))


def uuid_bytes(value: object, what: str) -> bytes:
    """The 16 bytes of a UUID given as ``uuid.UUID`` or as a hex string (hyphens optional)."""
    if type(value) is str:
        text = value
    elif isinstance(value, uuid.UUID):
        return value.bytes
    else:
        text = str(value)
    try:
        raw = bytes.fromhex(text.replace("-", ""))
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise InvalidBatch(f"{what} is not a UUID: {value!r}")
    return raw


def uuid_array(values: Sequence[object]) -> bytes:
    """Binary ``uuid[]`` (one dimension, no NULLs) of ``values``."""
    if not values:
        return _NO_UUIDS
    if len(values) == 1:
        return _ONE_UUID + uuid_bytes(values[0], "causal parent id")
    parts = [_ARRAY_HEAD.pack(1, 0, UUID_OID), _DIM.pack(len(values), 1)]
    for value in values:
        parts.append(_UUID_LEN)
        parts.append(uuid_bytes(value, "causal parent id"))
    return b"".join(parts)


_COPY_SIGNATURE: Final = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags, extension
_I32: Final = struct.Struct("!i")
_INT8_FIELD: Final = struct.Struct("!iq")
_NULL: Final = _I32.pack(-1)
_UUID_FIELD: Final = _I32.pack(16)
_PG_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)
_EVENT_FIELDS: Final = struct.pack("!h", len(EVENT_COLUMNS))
_STAGING_FIELDS: Final = struct.pack("!h", len(STAGING_COLUMNS))


def _text(value: str | None) -> bytes:
    if value is None:
        return _NULL
    data = value.encode()
    return _I32.pack(len(data)) + data


class _TextFields(dict[str | None, bytes]):
    """The COPY field of each text value, made once: the run, agent, type, trace, name and
    service of a batch's rows repeat from row to row. Use one per batch (it keeps every value)."""

    def __missing__(self, value: str | None) -> bytes:
        field = self[value] = _text(value)
        return field


def copy_data(rows: Sequence[EventRow], *, staging: bool, starts: Mapping[str, datetime]) -> bytes:
    """The binary COPY data of ``rows``: the signature and one tuple per row, without the
    trailer (psycopg's ``Copy`` adds it): the ``EVENT_COLUMNS``, or with ``staging`` all of
    ``STAGING_COLUMNS``; each row's ``run_started_at`` is its run's start in ``starts`` (every
    run of ``rows`` must be there). Built in one pass, so the connection's thread sends it in a
    few large writes instead of formatting rows itself. Raises ``InvalidBatch`` for a value no
    column can hold (a sequence beyond bigint)."""
    parts = [_COPY_SIGNATURE]
    append = parts.append
    pack_int8 = _INT8_FIELD.pack
    pack_seq_time = _SEQ_TIME_FIELDS.pack
    pack_i32 = _I32.pack
    pack_jsonb_head = _JSONB_HEAD.pack
    head = _STAGING_FIELDS if staging else _EVENT_FIELDS
    start_fields = {run: pack_int8(8, _micros(start)) for run, start in starts.items()}
    shared = _TextFields()  # run, agent, type and trace ids (keys and spans differ per row)
    try:
        for (
            event_id,
            run_id,
            agent_id,
            seq,
            wall_time,
            event_type,
            parents,
            key,
            trace_id,
            span_id,
            payload,
            reason,
            conflict_with,
        ) in rows:
            delta = wall_time - _PG_EPOCH
            if payload is None:
                json_head = _NULL
                json = b""
            else:
                dumps = payload.dumps or payload_dumps(DEFAULT_MAX_PAYLOAD_CHARS)
                dumped = dumps(payload.obj)
                json = dumped.encode() if isinstance(dumped, str) else dumped
                json_head = pack_jsonb_head(len(json) + 1, 1)
            # In the order of the columns, so a value that fits no column fails as it always did.
            run_field = shared[run_id]
            agent_field = shared[agent_id]
            seq_time = pack_seq_time(
                8, seq, 8, delta.microseconds + 1_000_000 * (86_400 * delta.days + delta.seconds)
            )
            type_field = shared[event_type]
            parents_head = pack_i32(len(parents))
            key_data = key.encode()
            append(
                b"".join(
                    (
                        head,
                        _UUID_FIELD,
                        event_id,
                        run_field,
                        agent_field,
                        seq_time,
                        type_field,
                        parents_head,
                        parents,
                        pack_i32(len(key_data)),
                        key_data,
                        shared[trace_id],
                        _NULL if span_id is None else _text(span_id),
                        json_head,
                        json,
                    )
                )
            )
            if staging:
                append(_text(reason))
                append(_NULL if conflict_with is None else _UUID_FIELD + conflict_with)
            append(start_fields[run_id])
    except struct.error as exc:
        raise InvalidBatch(f"a value does not fit its column: {exc}") from exc
    return b"".join(parts)


_SEQ_TIME_FIELDS: Final = struct.Struct("!iqiq")
#: The length of a binary jsonb field and its format version (1).
_JSONB_HEAD: Final = struct.Struct("!ib")
_SPAN_FIELDS: Final = struct.pack("!h", 13)
_TIMES_CODE_FIELDS: Final = struct.Struct("!iqiqih")
_INT2_FIELD: Final = struct.Struct("!ih")


def _micros(value: datetime) -> int:
    delta = value - _PG_EPOCH
    return delta.microseconds + 1_000_000 * (86_400 * delta.days + delta.seconds)


def span_copy_data(rows: Sequence[SpanRow], *, starts: Mapping[str, datetime]) -> bytes:
    """The binary COPY data (signature and tuples, no trailer) of span envelope rows, in the
    column order of ``agentcap.spans`` as the writer copies it, each with its run's start in
    ``starts`` (every run of ``rows`` must be there). Raises ``InvalidBatch`` for a value no
    column can hold."""
    parts = [_COPY_SIGNATURE]
    append = parts.append
    pack_int2 = _INT2_FIELD.pack
    pack_int8 = _INT8_FIELD.pack
    start_fields = {run: pack_int8(8, _micros(start)) for run, start in starts.items()}
    # Run, trace, name, status message, service and scope repeat from span to span; a parent
    # is often the parent of many.
    shared = _TextFields()
    pack_times_code = _TIMES_CODE_FIELDS.pack
    pack_i32 = _I32.pack
    try:
        for (
            run_id,
            trace_id,
            span_id,
            parent,
            name,
            kind,
            start,
            end,
            code,
            message,
            service,
            scope,
        ) in rows:
            run_field = shared[run_id]
            trace_field = shared[trace_id]
            if span_id is None:
                span_head, span_data = _NULL, b""
            else:
                span_data = span_id.encode()
                span_head = pack_i32(len(span_data))
            parent_field = shared[parent]
            name_field = shared[name]
            kind_field = pack_int2(2, kind)
            append(
                b"".join(
                    (
                        _SPAN_FIELDS,
                        run_field,
                        trace_field,
                        span_head,
                        span_data,
                        parent_field,
                        name_field,
                        kind_field,
                        # A datetime's microseconds always fit int8: only the code can fail.
                        pack_times_code(8, _micros(start), 8, _micros(end), 2, code),
                        shared[message],
                        shared[service],
                        shared[scope],
                        start_fields[run_id],
                    )
                )
            )
    except struct.error as exc:
        raise InvalidBatch(f"a span value does not fit its column: {exc}") from exc
    return b"".join(parts)


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def _run_attributes(attributes: Mapping[str, Any]) -> Any:
    """A run's attributes as the JSON value to store: encoded once. An ``EncodedObject``
    (encoded by capture, or read from a log) is kept as it is when jsonb can hold it (an
    imported file may hold anything); anything else is encoded."""
    if isinstance(attributes, jsonsafe.EncodedObject):
        try:
            text = json.dumps(attributes, ensure_ascii=False, allow_nan=False)
            if "\\u0000" not in text:
                text.encode("utf-8")
                return attributes
        except (TypeError, ValueError, UnicodeEncodeError, RecursionError):
            pass
        return jsonsafe.to_jsonable(jsonsafe.from_jsonable(dict(attributes)))
    return jsonsafe.to_jsonable(dict(attributes))


def payload_dumps(max_chars: int) -> Callable[[Any], bytes]:
    """A ``dumps`` for psycopg's ``Jsonb`` that never produces JSON jsonb would reject."""

    def dumps(obj: Any) -> bytes:
        if isinstance(obj, jsonsafe.RawJson):
            if len(obj) <= max_chars:
                return obj.encode("utf-8")
            # Parsed as a re-map with parsed payloads parses it (text that is not JSON, cut by
            # a length limit say, becomes its marker).
            obj = jsonsafe.loads(obj)
        try:
            text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            if "\\u0000" not in text and len(text) <= max_chars:
                return text.encode("utf-8")
        except (TypeError, ValueError, RecursionError, UnicodeEncodeError):
            pass
        return jsonsafe.dumps(obj, max_chars).encode("utf-8", "surrogatepass")

    return dumps


def _same_payload(a: Any, b: Any, dumps: Callable[[Any], bytes]) -> bool:
    try:
        if bool(a == b):
            return True
    except Exception:  # a payload with a broken __eq__: compare the stored form instead
        pass
    return dumps(a) == dumps(b)


def _row(event: Event, dumps: Callable[[Any], bytes]) -> EventRow:
    """The staged row of a validated event (``otel_agentcap.validation``)."""
    return _rows((event,), dumps)[0]


def _rows(events: Iterable[Event], dumps: Callable[[Any], bytes]) -> list[EventRow]:
    """The staged rows of validated events (``otel_agentcap.validation``), in their order."""
    texts = _CleanTexts()  # runs, agents, event types and traces repeat from event to event
    # The bytes of each event id: a causal parent is most often an earlier event of the batch.
    ids: dict[str, bytes] = {}
    rows: list[EventRow] = []
    append = rows.append
    for (
        event_id,
        run_id,
        agent_id,
        seq,
        event_type,
        key,
        wall_time,
        parents,
        payload,
        trace_id,
        span_id,
    ) in events:
        raw_id = uuid_bytes(event_id, "event_id")
        if type(event_id) is str:
            ids[event_id] = raw_id
        run_text = texts[run_id]
        agent_text = texts[agent_id]
        if wall_time.tzinfo is None:
            wall_time = wall_time.replace(tzinfo=UTC)
        type_text = texts[event_type if type(event_type) is str else str(event_type)]
        if not parents:
            parent_ids = _NO_UUIDS
        elif (
            len(parents) == 1
            and type(parent := parents[0]) is str
            and (raw_parent := ids.get(parent)) is not None
        ):
            parent_ids = _ONE_UUID + raw_parent
        else:
            parent_ids = uuid_array(parents)
        append(
            _new_row(
                (
                    raw_id,
                    run_text,
                    agent_text,
                    seq,
                    wall_time,
                    type_text,
                    parent_ids,
                    key if key.isascii() and "\x00" not in key else clean_text(key),
                    None
                    if trace_id is None
                    else texts[trace_id]
                    if type(trace_id) is str
                    else clean_text(str(trace_id)),
                    None
                    if span_id is None
                    else span_id
                    if type(span_id) is str and span_id.isascii() and "\x00" not in span_id
                    else clean_text(str(span_id)),
                    None if payload is None else Jsonb(payload, dumps),
                    None,
                    None,
                )
            )
        )
    return rows


def _same_content(a: EventRow, b: EventRow, dumps: Callable[[Any], bytes]) -> bool:
    if a[:10] != b[:10]:
        return False
    pa = None if a.payload is None else a.payload.obj
    pb = None if b.payload is None else b.payload.obj
    return _same_payload(pa, pb, dumps)


def _sorted_rows(events: Iterable[Event], dumps: Callable[[Any], bytes]) -> list[EventRow]:
    rows = _rows(events, dumps)
    rows.sort(key=_ROW_ORDER)
    return rows


#: (run, agent, sequence) of an ``EventRow``.
_ROW_ORDER: Final = operator.itemgetter(1, 2, 3)


def resolve_events(
    events: Iterable[Event],
    dumps: Callable[[Any], bytes],
    superseded: Sequence[Event] = (),
    superseded_by: Sequence[str] = (),
) -> tuple[list[EventRow], int]:
    """Rows sorted by (run, agent, seq); exact repeats dropped (and counted); rows colliding with an
    earlier row of the same batch marked with ``batch_reason`` and the id they collided with.

    Two ``model_call`` rows of one run with the same response id, or the same request id, collide
    too (``model_call_response_id`` / ``model_call_request_id``; see
    :mod:`otel_agentcap.pipeline.call_identity`). ``superseded`` rows (model calls
    the mapping found recorded twice) collide with the event the mapping kept for them, given in
    ``superseded_by``; without it they come after all of ``events`` and are matched by their ids."""
    rows = _sorted_rows(events, dumps)
    linked = bool(superseded) and len(superseded_by) == len(superseded)
    if superseded and not linked:
        rows.extend(_sorted_rows(superseded, dumps))
    # Event ids are unique within a run (the log's key is (run_id, event_id)).
    by_id: dict[tuple[str, bytes], EventRow] = {}
    # Per (run, agent): the id of the row that took each sequence and each idempotency key. The
    # rows come grouped by (run, agent), so the group changes seldom.
    by_agent: dict[tuple[str, str], tuple[dict[int, bytes], dict[str, bytes]]] = {}
    last_run: object = None
    last_agent: object = None
    by_seq: dict[int, bytes] = {}
    by_key: dict[str, bytes] = {}
    calls: CallIndex[bytes] = CallIndex()
    out: list[EventRow] = []
    duplicates = 0
    # A row colliding with an earlier row of the same batch gets the reason it would get against
    # that row once stored, so re-sending it later is recognised as the same conflict.
    for row in rows:
        event_id, run_id, agent_id, seq, _, event_type, _, key, _, _, payload, _, _ = row
        id_key = (run_id, event_id)
        first = by_id.get(id_key)
        if first is not None:
            if _same_content(first, row, dumps):
                duplicates += 1
            else:
                out.append(
                    row._replace(
                        batch_reason="event_id_content", batch_conflict_with=first.event_id
                    )
                )
            continue
        # The model-call checks come before the (run, agent, seq) and (run, agent, key) ones, in
        # the order the writer's classification uses.
        call: tuple[str | None, str | None] | None = None
        if event_type == _MODEL_CALL and payload is not None:
            # Broader than the SQL test (a Python str may be stored as an encoded object), never
            # narrower: two rows the log's unique indexes would refuse never both reach the INSERT.
            call = call_ids(payload.obj)
            found = calls.find(run_id, *call)
            if found is not None:
                kept, reason = found
                # Lends the call its other id (as the mapping does), so a third record that
                # shares only that id is found too.
                calls.add(run_id, *call, kept)
                out.append(row._replace(batch_reason=reason, batch_conflict_with=kept))
                continue
        if run_id is not last_run or agent_id is not last_agent:
            last_run, last_agent = run_id, agent_id
            by_seq, by_key = by_agent.setdefault((run_id, agent_id), ({}, {}))
        if seq in by_seq:
            out.append(row._replace(batch_reason="run_agent_seq", batch_conflict_with=by_seq[seq]))
            continue
        if key in by_key:
            out.append(row._replace(batch_reason="run_agent_key", batch_conflict_with=by_key[key]))
            continue
        if call is not None:
            calls.add(run_id, *call, event_id)
        by_id[id_key] = row
        by_seq[seq] = event_id
        by_key[key] = event_id
        out.append(row)
    if linked:
        # Linked by the mapping, which may have matched a record to its call only through
        # another set-aside record: never inserted, whatever order they come in.
        for event, kept_id in zip(superseded, superseded_by, strict=True):
            row = _row(event, dumps)
            first = by_id.get((row.run_id, row.event_id))
            if first is not None and _same_content(first, row, dumps):
                duplicates += 1
                continue
            if first is not None:
                reason = "event_id_content"
            else:
                reason = conflict_reason(
                    call_ids(row.payload.obj)[0] if row.payload is not None else None
                )
            conflict_with = first.event_id if first is not None else uuid_bytes(kept_id, "event id")
            out.append(row._replace(batch_reason=reason, batch_conflict_with=conflict_with))
    return out, duplicates


def merge_agents(
    records: Sequence[AgentRecord], rows: Sequence[EventRow]
) -> tuple[list[AgentRow], list[AgentRow]]:
    """One row per (run, agent) named by the batch, with the first known name and the first
    known lineage (parent and spawn link together); and every distinct record that knows a name
    or a lineage, which the writer compares with what the log holds."""
    merged: dict[tuple[str, str], list[Any]] = {}
    offers: dict[AgentRow, None] = {}
    for rec in records:
        key = (clean_text(rec.run_id), clean_text(rec.agent_id))
        spawned = (
            None
            if rec.spawned_at_event_id is None
            else _uuid(rec.spawned_at_event_id, "spawned_at_event_id")
        )
        name = _opt_text(rec.name)
        parent = _opt_text(rec.parent_agent_id)
        known = bool(rec.lineage_known)
        if name is not None or known:
            offers[(key[0], key[1], name, parent, spawned, known)] = None
        current = merged.setdefault(key, [None, None, None, False])
        if current[0] is None:
            current[0] = name
        if known and not current[3]:
            current[1], current[2], current[3] = parent, spawned, True
    for pair in map(_RUN_AND_AGENT, rows):
        if pair not in merged:
            merged[pair] = [None, None, None, False]
    return (
        [(k[0], k[1], v[0], v[1], v[2], v[3]) for k, v in sorted(merged.items())],
        list(offers),
    )


def merge_runs(
    runs: Sequence[RunRecord],
    rows: Sequence[EventRow],
    dumps: Callable[[Any], bytes],
    *,
    spans: Sequence[SpanRecord] = (),
    agents: Sequence[AgentRecord] = (),
) -> tuple[list[RunRow], list[tuple[str, Jsonb]]]:
    """One row per run named by the batch (by its runs, events, span envelopes or agents): the
    earliest start the batch knows (None when it knows none) and the first attribute declaration;
    and every distinct declaration, which the writer compares with what is stored."""
    started: dict[str, datetime | None] = {}
    declared: dict[str, Jsonb] = {}
    offers: dict[tuple[str, bytes], Jsonb] = {}
    roots: dict[str, tuple[str, str]] = {}
    recorded: dict[str, datetime] = {}
    for run in runs:
        run_id = clean_text(run.run_id)
        if run.trace_id and run.root_span_id and run_id not in roots:
            roots[run_id] = (clean_text(run.trace_id), clean_text(run.root_span_id))
        start = _utc(run.started_at) if run.started_at is not None else None
        if run.start_recorded and start is not None:
            recorded.setdefault(run_id, start)
        previous = started.get(run_id)
        started[run_id] = (
            start if previous is None or (start is not None and start < previous) else previous
        )
        if run.attributes is not None:
            attrs = _run_attributes(run.attributes)
            value = Jsonb(attrs if isinstance(attrs, dict) else {}, dumps)
            offers.setdefault((run_id, dumps(value.obj)), value)
            declared.setdefault(run_id, value)
    for run_id, start in map(_RUN_AND_TIME, rows):
        previous = started.get(run_id)
        if previous is None or start < previous:
            started[run_id] = start
    for run_id, start in map(_RUN_AND_START, spans):
        if not run_id.isascii() or "\x00" in run_id:
            run_id = clean_text(run_id)
        if start.tzinfo is None:
            start = start.replace(tzinfo=UTC)
        previous = started.get(run_id)
        if previous is None or start < previous:
            started[run_id] = start
    # A run named only by agent rows is registered too (its start: when it is first recorded),
    # so every row of the log belongs to a runs row and leaves with it.
    for record in agents:
        started.setdefault(clean_text(record.run_id), None)
    # A start a log recorded (an imported run record) is the run's, whatever else the batch holds:
    # a run whose first stored batch lacked its root span started later than that span.
    started.update(recorded)
    return (
        [
            (run_id, started[run_id], declared.get(run_id), *roots.get(run_id, _NO_ROOT))
            for run_id in sorted(started)
        ],
        [(run_id, value) for (run_id, _), value in offers.items()],
    )


_NO_ROOT: Final = (None, None)
#: The run and time, and the run and agent, of an ``EventRow``; the run and start of a
#: ``SpanRecord``.
_RUN_AND_TIME: Final = operator.itemgetter(1, 4)
_RUN_AND_AGENT: Final = operator.itemgetter(1, 2)
_RUN_AND_START: Final = operator.itemgetter(0, 6)

SpanRow = tuple[
    str, str, str, str | None, str, int, datetime, datetime, int, str | None, str | None, str | None
]


def span_rows(spans: Iterable[SpanRecord]) -> list[SpanRow]:
    """The batch's span envelopes as rows, one per (run, trace, span) (the first wins), sorted."""
    rows: dict[tuple[str, str, str], SpanRow] = {}
    texts = _CleanTexts()  # run, trace, name, service and scope repeat from span to span
    for (
        run_id,
        trace_id,
        span_id,
        parent,
        name,
        kind,
        start,
        end,
        code,
        message,
        service,
        scope,
    ) in spans:
        run_text = texts[run_id]
        trace_text = texts[trace_id]
        span_text = span_id if span_id.isascii() and "\x00" not in span_id else clean_text(span_id)
        key = (run_text, trace_text, span_text)
        if key in rows:
            continue
        rows[key] = (
            run_text,
            trace_text,
            span_text,
            None
            if parent is None
            else texts[parent]
            if type(parent) is str
            else clean_text(str(parent)),
            texts[name],
            kind if type(kind) is int else int(kind),
            start if start.tzinfo is not None else start.replace(tzinfo=UTC),
            end if end.tzinfo is not None else end.replace(tzinfo=UTC),
            code if type(code) is int else int(code),
            None
            if message is None
            else texts[message]
            if type(message) is str
            else clean_text(str(message)),
            None
            if service is None
            else texts[service]
            if type(service) is str
            else clean_text(str(service)),
            None
            if scope is None
            else texts[scope]
            if type(scope) is str
            else clean_text(str(scope)),
        )
    # The rows begin with their (distinct) keys: sorting them sorts the keys.
    return sorted(rows.values())


def _validated(batch: Batch, validator: Validator) -> tuple[Batch, list[str], int]:
    """``batch`` without the records that break a validation rule, the reasons, and how many of
    them were events."""
    check_event = validator.event
    reasons = [check_event(e) for e in batch.events]
    superseded_reasons = [check_event(e) for e in batch.superseded]
    agent_reasons = [validator.agent(a) for a in batch.agents]
    run_reasons = [validator.run(r) for r in batch.runs]
    if not (any(reasons) or any(superseded_reasons) or any(agent_reasons) or any(run_reasons)):
        return batch, [], 0  # the common case: nothing to leave out
    rejected = [r for r in (*reasons, *superseded_reasons) if r is not None]
    events_rejected = len(rejected)
    rejected += [r for r in (*agent_reasons, *run_reasons) if r is not None]
    linked = len(batch.superseded_by) == len(batch.superseded)
    superseded = tuple(
        e for e, r in zip(batch.superseded, superseded_reasons, strict=True) if r is None
    )
    superseded_by = (
        tuple(k for k, r in zip(batch.superseded_by, superseded_reasons, strict=True) if r is None)
        if linked
        else batch.superseded_by
    )
    return (
        batch._replace(
            events=tuple(e for e, r in zip(batch.events, reasons, strict=True) if r is None),
            superseded=superseded,
            superseded_by=superseded_by,
            agents=tuple(a for a, r in zip(batch.agents, agent_reasons, strict=True) if r is None),
            runs=tuple(x for x, r in zip(batch.runs, run_reasons, strict=True) if r is None),
        ),
        rejected,
        events_rejected,
    )


def prepare(
    batch: Batch,
    max_payload_chars: int = DEFAULT_MAX_PAYLOAD_CHARS,
    validator: Validator | None = None,
    *,
    validated: bool = False,
) -> PreparedBatch:
    """Everything the writer sends for ``batch``: its valid records (see
    ``otel_agentcap.validation``; the others are counted in ``rejected``), resolved.
    ``validated``: the caller checked every record of ``batch`` with these rules already (the
    ingest checks span by span)."""
    rejected: list[str] = []
    events_rejected = 0
    if not validated:
        batch, rejected, events_rejected = _validated(batch, validator or Validator())
    dumps = payload_dumps(max_payload_chars)
    events, duplicates = resolve_events(batch.events, dumps, batch.superseded, batch.superseded_by)
    runs, run_offers = merge_runs(batch.runs, events, dumps, spans=batch.spans, agents=batch.agents)
    agents, agent_offers = merge_agents(batch.agents, events)
    return PreparedBatch(
        events,
        duplicates,
        runs,
        agents,
        run_offers,
        agent_offers,
        tuple(rejected),
        events_rejected,
        span_rows(batch.spans),
    )
