"""The rows and COPY data of a batch of spans in one pass, for the batches that need no more.

``batch_from_spans`` (the mapping), ``rows.prepare`` (validation, rows, in-batch collisions) and
``rows.copy_data`` / ``rows.span_copy_data`` each walk the whole batch and build objects for the
next step. The durable queue's delivery thread does that for every span it stores, and it is
most of its CPU work. :func:`prepare_spans` builds the same ``PreparedBatch`` and the same COPY
data directly from the spans, in one loop, for a batch where every span is of the common kind:
stamped spans that ended, whose events are not model calls, each event valid, no two events of
the batch colliding, no run root, no declared run attributes, no legacy span events. For any
other batch it returns None, and the caller takes the general path, which gives the same result
for the common kind (``tests/test_one_pass.py`` compares them).
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final, NamedTuple

from opentelemetry.sdk.trace import ReadableSpan
from psycopg.types.json import Jsonb

from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe
from otel_agentcap.jsonsafe import RawJson
from otel_agentcap.model import (
    _VARIANT,
    EVENT_TYPES,
    AgentRecord,
    EventType,
    RunRecord,
    _sha1,
    event_id_prefix,
)
from otel_agentcap.pipeline.call_identity import SUPERSEDED
from otel_agentcap.pipeline.mapping import (
    SpanLike,
    record_event,
    span_agents,
    span_service_name,
    span_shape,
    trace_id_hex,
)
from otel_agentcap.pipeline.span_attributes import attributes_of, has_events
from otel_agentcap.validation import (
    MAX_CAUSAL_PARENTS,
    MAX_FUTURE,
    MAX_KEY_BYTES,
    MAX_TRACE_TEXT,
    Validator,
    uuid_text,
)

from .pacing import paced
from .rows import (
    _COPY_SIGNATURE,
    _EVENT_FIELDS,
    _I32,
    _INT2_FIELD,
    _INT8_FIELD,
    _JSONB_HEAD,
    _NO_UUIDS,
    _NULL,
    _ONE_UUID,
    _PG_EPOCH,
    _SEQ_TIME_FIELDS,
    _SPAN_FIELDS,
    _STAGING_FIELDS,
    _TIMES_CODE_FIELDS,
    _UUID_FIELD,
    DEFAULT_MAX_PAYLOAD_CHARS,
    DeferredRows,
    EventRow,
    PreparedBatch,
    SpanRow,
    _CleanTexts,
    _new_row,
    _TextFields,
    merge_agents,
    payload_dumps,
    uuid_array,
)

_MODEL_CALL: Final = EventType.MODEL_CALL.value
#: The plain text of every event type but ``model_call`` (model calls are matched by call id).
_PLAIN_TYPES: Final[dict[object, str]] = {t: t.value for t in EventType if t.value != _MODEL_CALL}
_ONE_MICRO: Final = timedelta(microseconds=1)
#: The length of a span id field (16 hex digits).
_SPAN_ID_HEAD: Final = _I32.pack(16)
_ROW_ORDER: Final = operator.itemgetter(1, 2, 3)
#: How many pieces each event's COPY tuple is made of.
_PIECES: Final = 15
#: The largest span id 16 hex digits hold.
_MAX_SPAN_ID: Final = 2**64 - 1


class OnePass(NamedTuple):
    """What :func:`prepare_spans` built: the prepared rows, how many events they hold, and the
    COPY data of the events (for the path ``staging`` named) and of the span envelopes with
    the run ``starts`` they were built with (all three None when a run's start is not known)."""

    prepared: PreparedBatch
    events: int
    data: bytes | None
    span_data: bytes | None
    starts: dict[str, datetime] | None


class _NotCommon(Exception):
    """A span or a batch the one pass leaves to the general path."""


def prepare_spans(
    spans: Sequence[SpanLike],
    *,
    staging: bool,
    known_start: Callable[[str], datetime | None],
    max_payload_chars: int = DEFAULT_MAX_PAYLOAD_CHARS,
    failures: list[Exception] | None = None,
    pause: Callable[[], None] | None = None,
) -> OnePass | None:
    """``rows.prepare(exporter._map(spans, raw_payloads=True))`` and its COPY data
    (``rows.copy_data`` with ``staging``, ``rows.span_copy_data``), built in one pass; None when
    a span is not of the common kind (see the module doc). ``known_start`` gives the stored
    start of a run, or None when it is not known (then no COPY data is built). An exception
    other than the one pass's own refusal (a value the general path reports span by span, or a
    bug of the one pass) also gives None, and is appended to ``failures`` when given.
    ``pause`` is called after every ``PAUSE_EVERY`` spans (see ``WriterThreads.pause``)."""
    try:
        return _prepare(spans, staging, known_start, max_payload_chars, pause)
    except _NotCommon:
        return None
    except Exception as exc:
        if failures is not None:
            failures.append(exc)
        return None


def _decline_early(spans: Sequence[SpanLike]) -> None:
    """Raise ``_NotCommon`` when a span of ``spans`` is of a kind the one pass declines on sight
    (a model call, a run's root span), before any span is mapped: mapping the spans ahead of it
    would be work thrown away, as the general path maps the whole batch again. One look at each
    span's event type (two or three for a span of another kind), next to about 12 us of mapping
    each."""
    plain = _PLAIN_TYPES
    event_type_key = attr.EVENT_TYPE
    try:
        for span in spans:
            try:
                attributes = span._attributes._dict  # type: ignore[attr-defined]  # noqa: SLF001
            except AttributeError:
                attributes = attributes_of(span)
            if attributes.get(event_type_key) in plain:
                continue  # the common case: one look (other reasons wait for the pass itself)
            if attr.EVENT_ID in attributes or attr.RUN_ROOT in attributes:
                raise _NotCommon
    except TypeError:  # an event type that is no str (a list, say): declined too
        raise _NotCommon from None


def _prepare(
    spans: Sequence[SpanLike],
    staging: bool,
    known_start: Callable[[str], datetime | None],
    max_payload_chars: int,
    pause: Callable[[], None] | None,
) -> OnePass:
    _decline_early(spans)
    now = time.time_ns()
    validator = Validator(now)
    max_seq = validator.max_seq
    max_micros = _seconds_micros(now / 1e9) + _MAX_FUTURE_MICROS
    dumps = payload_dumps(max_payload_chars)
    #: Each (run, agent)'s event id prefix and its run and agent COPY fields, joined.
    prefixes: dict[tuple[str, str], tuple[bytes, bytes]] = {}
    #: The bytes of each event id of the batch (also: no id twice).
    ids: dict[str, bytes] = {}
    #: Each span's envelope row and COPY tuple by its span id (also: no span twice).
    envelopes: dict[str, tuple[tuple[Any, ...], bytes]] = {}
    #: The run and trace of every span so far, when the same for all (else None).
    span_group: tuple[str, str] | None = None
    #: The compact form of each event row (see ``_event_row``).
    rows: list[tuple[Any, ...]] = []
    chunks: list[bytes] = []
    add_pieces = chunks.extend
    #: The earliest time of each run's events: in microseconds since PostgreSQL's epoch, and
    #: as ``_at`` takes it.
    started: dict[str, tuple[int, float | datetime]] = {}
    start_fields: dict[str, bytes] = {}
    starts: dict[str, datetime] | None = {}
    agents: dict[AgentRecord, None] = {}
    agent_keys: set[tuple[object, ...]] = set()
    names = _CleanTexts()
    traces: dict[int, str] = {}
    parent_texts: dict[object, str] = {}
    shapes: dict[tuple[int, int, int, int], tuple[Any, ...]] = {}
    fields = _TextFields()
    lead = (_STAGING_FIELDS if staging else _EVENT_FIELDS) + _UUID_FIELD
    tail = _NULL + _NULL if staging else b""
    pack_i32 = _I32.pack
    pack_int8 = _INT8_FIELD.pack
    pack_int2 = _INT2_FIELD.pack
    pack_seq_time = _SEQ_TIME_FIELDS.pack
    pack_jsonb_head = _JSONB_HEAD.pack
    pack_times_code = _TIMES_CODE_FIELDS.pack
    last_order: tuple[str, str, int] = ("", "", -1)
    ordered = True

    def add_event(
        event_id: object,
        run_id: str,
        agent_id: str,
        seq: object,
        event_type: object,
        key: object,
        at: float | datetime,
        micros: int,
        parents: object,
        payload: Any,
        raw: bytes | None,
        trace_id: str,
        span_id: str,
        span_field: bytes,
    ) -> None:
        """Validate one event as ``Validator.event`` does, and add its compact row and COPY
        tuple. ``at`` is its time as ``_at`` takes it, ``micros`` the same time in microseconds
        since PostgreSQL's epoch (compared as integers: the same as comparing the datetimes,
        which are microseconds too, and cheaper). ``raw``, when not None, is ``payload`` (the
        text of a ``RawJson`` within the limit, not yet wrapped) as UTF-8."""
        nonlocal last_order, ordered, starts
        if type(event_type) is not str or event_type not in EVENT_TYPES:
            raise _NotCommon
        identity = prefixes.get((run_id, agent_id))
        if identity is None:
            if validator.id_reason(run_id, "run id") or validator.id_reason(agent_id, "agent id"):
                raise _NotCommon
            identity = prefixes[run_id, agent_id] = (
                event_id_prefix(run_id, agent_id),
                fields[run_id] + fields[agent_id],
            )
        prefix, run_agent_field = identity
        if type(key) is not str or not key or "\x00" in key:
            raise _NotCommon
        try:
            key_data = key.encode()
        except UnicodeEncodeError:
            raise _NotCommon from None
        # ``model.event_id_in``, inline (this runs for every event), on the key's bytes.
        h = _sha1(prefix + key_data).hexdigest()
        if not (
            len(key_data) <= MAX_KEY_BYTES
            and type(event_id) is str
            and event_id == f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"
            and event_id not in ids
            and type(seq) is int
            and 0 <= seq <= max_seq
            and 0 <= micros <= max_micros  # MIN_WALL_TIME is PostgreSQL's epoch
            and type(parents) is tuple
            and len(parents) <= MAX_CAUSAL_PARENTS
        ):
            raise _NotCommon
        raw_id = ids[event_id] = bytes.fromhex(event_id.replace("-", ""))
        if not parents:
            parent_ids = _NO_UUIDS
        elif len(parents) == 1 and type(parent := parents[0]) is str and parent in ids:
            parent_ids = _ONE_UUID + ids[parent]
        else:
            if not all(type(p) is str and uuid_text(p) for p in parents):
                raise _NotCommon
            parent_ids = uuid_array(parents)
        order = (run_id, agent_id, seq)
        if order <= last_order:
            if order == last_order:
                raise _NotCommon  # two events of one agent with one sequence: a collision
            ordered = False
        last_order = order
        first = started.get(run_id)
        if first is None:
            started[run_id] = (micros, at)
            if starts is not None:
                start = known_start(run_id)
                if start is None:
                    starts = None
                else:
                    starts[run_id] = start
                    start_fields[run_id] = pack_int8(8, _micros(start))
        elif micros < first[0]:
            started[run_id] = (micros, at)
        rows.append(
            (
                raw_id,
                run_id,
                agent_id,
                seq,
                at,
                event_type,
                parent_ids,
                key,
                trace_id,
                span_id,
                payload,
                raw is not None,
            )
        )
        if starts is None:
            return
        if raw is not None:
            json = raw
            json_head = pack_jsonb_head(len(json) + 1, 1)
        elif payload is None:
            json_head = _NULL
            json = b""
        else:
            if type(payload) is RawJson and len(payload) <= max_payload_chars:
                json = payload.encode()  # as ``dumps`` does
            else:
                json = dumps(payload)
            json_head = pack_jsonb_head(len(json) + 1, 1)
        # The tuple's pieces, joined once for the whole batch (no copy of each tuple, nor of
        # each payload): always _PIECES of them, so a tuple can be moved when rows are sorted.
        add_pieces(
            (
                lead,
                raw_id,
                run_agent_field,
                pack_seq_time(8, seq, 8, micros),
                fields[event_type],
                pack_i32(len(parent_ids)),
                parent_ids,
                pack_i32(len(key_data)),
                key_data,
                fields[trace_id],
                span_field,
                json_head,
                json,
                tail,
                start_fields[run_id],
            )
        )

    for span in paced(spans, pause):
        direct = type(span) is _SDK_SPAN
        if direct:
            sdk: Any = span
            # ``attributes_of`` and ``has_events``, inline (see _sdk_span).
            attributes = getattr(sdk._attributes, "_dict", None)  # noqa: SLF001
            if type(attributes) is not dict:
                attributes = attributes_of(span)
            span_events = sdk._events  # noqa: SLF001
        else:
            attributes = attributes_of(span)
            span_events = span.events if has_events(span) else ()
        get = attributes.get
        if attr.EVENT_ID not in attributes:
            if attr.RUN_ROOT in attributes:
                raise _NotCommon
            continue  # not stamped: no record
        if (
            SUPERSEDED in attributes
            or attr.RUN_ROOT in attributes
            or attr.RUN_ATTRIBUTES in attributes
            or getattr(span, "own_event_queued", False)
        ):
            raise _NotCommon
        if span_events and any(e.name.startswith(attr.SPAN_EVENT_PREFIX) for e in span_events):
            raise _NotCommon  # a closing event recorded as a span event (earlier versions)
        if direct:
            # What the SDK's properties give (each a Python call), read directly: the span the
            # SDK hands to ``on_end`` is of this class, and the delivery keeps it.
            end_time = sdk._end_time  # noqa: SLF001 (see _sdk_span)
            ctx = sdk._context  # noqa: SLF001
            start_time = sdk._start_time  # noqa: SLF001
            name = sdk._name  # noqa: SLF001
            parent = sdk._parent  # noqa: SLF001
            resource: object = sdk._resource  # noqa: SLF001
            shape_key = (
                id(sdk._kind),  # noqa: SLF001
                id(sdk._status),  # noqa: SLF001
                id(sdk._instrumentation_scope),  # noqa: SLF001
                id(resource),
            )
        else:
            end_time = span.end_time
            ctx = span.context
            start_time = span.start_time
            name = span.name
            parent = getattr(span, "parent", None)
            resource = getattr(span, "resource", None)
            if resource is None:  # a span read back from the queue
                resource = getattr(span, "resource_attributes", None)
            # Kind, status, scope and resource are objects the spans share: their parts of the
            # envelope are made once per batch (the spans, alive, keep their ids unique).
            shape_key = (
                id(getattr(span, "kind", None)),
                id(getattr(span, "status", None)),
                id(getattr(span, "instrumentation_scope", None)),
                id(resource),
            )
        if not end_time or ctx is None:
            # Not ended, or ended at 0 (the general path's envelope then ends at its start).
            raise _NotCommon
        run_id = get(attr.RUN_ID)
        agent_id = get(attr.AGENT_ID)
        event_type = get(attr.EVENT_TYPE)
        seq = get(attr.EVENT_SEQ)
        if (
            type(run_id) is not str
            or type(agent_id) is not str
            or type(seq) is not int
            or (type(event_type) is not str and type(event_type) is not EventType)
        ):
            raise _NotCommon
        plain_type = _PLAIN_TYPES.get(event_type)
        if plain_type is None:
            raise _NotCommon
        key = get(attr.EVENT_IDEMPOTENCY_KEY)
        if key is None:
            key = f"seq:{seq}"
        parents = get(attr.EVENT_CAUSAL_PARENT_IDS) or ()
        if type(parents) is list:
            parents = tuple(parents)
        text = get(attr.EVENT_PAYLOAD)
        raw = None
        if text is None:
            payload = None
        elif type(text) is not str:
            raise _NotCommon
        elif len(text) > max_payload_chars or (
            "\\" in text and ("\\u0000" in text or "\\ud" in text or "\\uD" in text)
        ):
            payload = jsonsafe.raw_or_loads(text)
        else:
            # ``jsonsafe.raw_or_loads``, inline, its ``RawJson`` made only when the row is read.
            try:
                raw = text.encode()
            except UnicodeEncodeError:  # a lone surrogate
                payload = jsonsafe.loads(text)
            else:
                payload = text
        trace_int = ctx.trace_id
        trace_id = traces.get(trace_int)
        if trace_id is None:
            trace_id = traces[trace_int] = trace_id_hex(trace_int)
            if len(trace_id) > MAX_TRACE_TEXT:
                raise _NotCommon  # the general path rejects its events
        span_int = ctx.span_id
        if type(span_int) is int and 0 <= span_int <= _MAX_SPAN_ID:
            span_id = span_int.to_bytes(8, "big").hex()  # as f"{span_int:016x}", cheaper
        else:
            span_id = f"{span_int:016x}"
            if len(span_id) != 16:
                raise _NotCommon
        # As ``mapping.wall_time``, without the datetime (``_at`` makes it when it is read).
        at = (start_time or 0) / 1e9
        whole = int(at)  # ``_seconds_micros``, inline (for the start and end of every span)
        start_micros = (whole - _PG_EPOCH_SECONDS) * 1_000_000 + round((at - whole) * 1e6)
        #: The span id's COPY field (in the event's tuple and the envelope's).
        span_field = _SPAN_ID_HEAD + span_id.encode()
        add_event(
            get(attr.EVENT_ID),
            run_id,
            agent_id,
            seq,
            plain_type,
            key,
            at,
            start_micros,
            parents,
            payload,
            raw,
            trace_id,
            span_id,
            span_field,
        )
        end = end_time / 1e9
        whole = int(end)
        end_micros = (whole - _PG_EPOCH_SECONDS) * 1_000_000 + round((end - whole) * 1e6)
        if not 0 <= end_micros <= max_micros:
            _at(end)  # an unusual end: raises here, as the datetime of the general path would
        outcome = get(attr.OUTCOME)
        if outcome is not None:
            closing = record_event(outcome, attributes, end_time, trace_id, span_id)
            if closing is None:
                raise _NotCommon  # unreadable: counted by the general path
            closing_type = closing.event_type
            if closing_type == _MODEL_CALL:
                raise _NotCommon
            add_event(
                closing.event_id,
                closing.run_id,
                closing.agent_id,
                closing.seq,
                closing_type,
                closing.idempotency_key,
                closing.wall_time,
                _micros(closing.wall_time),
                closing.causal_parent_ids,
                closing.payload,
                None,
                trace_id,
                span_id,
                span_field,
            )
        # The agent rows: built once per agent identity in the batch.
        if plain_type == "agent_start" or plain_type == "agent_spawn":
            for record in span_agents(attributes):
                agents[record] = None
        else:
            agent_name = get(attr.GEN_AI_AGENT_NAME)
            if agent_name is not None and type(agent_name) is not str:
                raise _NotCommon
            identity = (run_id, agent_id, agent_name)
            if identity not in agent_keys:
                agent_keys.add(identity)
                for record in span_agents(attributes):
                    agents[record] = None
        # The envelope, as ``mapping.span_record`` and ``rows.span_rows`` make it.
        if span_id in envelopes:
            raise _NotCommon
        if span_group is None:
            if not envelopes:
                span_group = (run_id, trace_id)
        elif span_group[0] != run_id or span_group[1] != trace_id:
            span_group = None
        if type(name) is not str:
            raise _NotCommon
        parent_id = parent.span_id if parent is not None else 0
        parent_text = parent_texts.get(parent_id)  # the spans of an agent share their parent
        if parent_text is None and parent_id:
            parent_text = parent_texts[parent_id] = f"{parent_id:016x}"
        shape = shapes.get(shape_key)
        if shape is None:
            kind, code, message, scope = span_shape(span)
            service = span_service_name(span)
            shape = shapes[shape_key] = (
                kind,
                code,
                None if message is None else names[message],
                None if service is None else names[service],
                None if scope is None else names[scope],
                pack_int2(2, kind),
                fields[None if message is None else names[message]]
                + fields[None if service is None else names[service]]
                + fields[None if scope is None else names[scope]],
            )
        kind, code, message_text, service_text, scope_text, kind_field, shape_tail = shape
        name_text = names[name]
        row = (
            run_id,
            trace_id,
            span_id,
            parent_text,
            name_text,
            kind,
            at,
            end,
            code,
            message_text,
            service_text,
            scope_text,
        )
        if starts is None:
            envelopes[span_id] = (row, b"")
            continue
        envelopes[span_id] = (
            row,
            b"".join(
                (
                    _SPAN_FIELDS,
                    fields[run_id],
                    fields[trace_id],
                    span_field,
                    fields[parent_text],
                    fields[name_text],
                    kind_field,
                    pack_times_code(
                        8,
                        start_micros,
                        8,
                        end_micros,
                        2,
                        code,
                    ),
                    shape_tail,
                    start_fields[run_id],
                )
            ),
        )

    records = list(agents)
    for record in records:
        if validator.agent(record) is not None:
            raise _NotCommon
    run_starts = {run_id: _at(at) for run_id, (_, at) in started.items()}
    for run_id, start in run_starts.items():
        if validator.run(RunRecord(run_id, start)) is not None:
            raise _NotCommon
    if not ordered:
        order = sorted(range(len(rows)), key=lambda i: _ROW_ORDER(rows[i]))
        rows = [rows[i] for i in order]
        if starts is not None:
            chunks = [piece for i in order for piece in chunks[i * _PIECES : (i + 1) * _PIECES]]
        for previous, current in itertools.pairwise(rows):
            if _ROW_ORDER(previous) == _ROW_ORDER(current):
                raise _NotCommon
    # Sorted as ``rows.span_rows`` sorts them: by run, trace and span id (when the spans share
    # their run and trace, by the span id alone, which sorts faster).
    span_pairs = (
        [envelopes[span_id] for span_id in sorted(envelopes)]
        if span_group is not None
        else sorted(envelopes.values(), key=_FIRST)
    )
    agent_rows, agent_offers = merge_agents(records, ())

    def event_row(compact: tuple[Any, ...]) -> EventRow:
        """The event row of a compact one (the same tuple with ``at`` a datetime and the
        payload wrapped, a ``RawJson`` when the last item says so), as the general path builds
        it."""
        payload = compact[10]
        if compact[11]:
            payload = RawJson(payload)
        return _new_row(
            (
                *compact[:4],
                _at(compact[4]),
                *compact[5:10],
                None if payload is None else Jsonb(payload, dumps),
                None,
                None,
            )
        )

    prepared = PreparedBatch(
        DeferredRows(rows, event_row, 1, direct_candidate=True),
        0,
        [(run_id, run_starts[run_id], None, None, None) for run_id in sorted(run_starts)],
        agent_rows,
        [],
        agent_offers,
        (),
        0,
        DeferredRows([row for row, _ in span_pairs], _span_row, 0),
    )
    if starts is None:
        return OnePass(prepared, len(rows), None, None, None)
    return OnePass(
        prepared,
        len(rows),
        _COPY_SIGNATURE + b"".join(chunks) if rows else None,
        _COPY_SIGNATURE + b"".join(data for _, data in span_pairs) if span_pairs else None,
        starts,
    )


_FIRST: Final = operator.itemgetter(0)

#: The properties of an SDK ``ReadableSpan`` the one pass reads, and what each returns.
_SDK_PARTS: Final = (
    ("end_time", "_end_time"),
    ("context", "_context"),
    ("start_time", "_start_time"),
    ("name", "_name"),
    ("parent", "_parent"),
    ("resource", "_resource"),
    ("kind", "_kind"),
    ("status", "_status"),
    ("instrumentation_scope", "_instrumentation_scope"),
)


def _sdk_span() -> type | None:
    """``ReadableSpan`` when its properties return its private attributes of ``_SDK_PARTS``
    (checked on one span, once), which the one pass then reads directly; else None (another
    SDK version: the properties are read)."""
    try:
        probe = ReadableSpan(name="probe", start_time=1, end_time=2)
        if (
            all(getattr(probe, public) is getattr(probe, part) for public, part in _SDK_PARTS)
            and tuple(probe._events) == probe.events  # noqa: SLF001
            and hasattr(probe, "_attributes")
        ):
            return ReadableSpan
    except Exception:  # any change of the SDK: the properties are read
        pass
    return None


_SDK_SPAN: Final = _sdk_span()


def _micros(value: datetime) -> int:
    return (value - _PG_EPOCH) // _ONE_MICRO


#: ``MAX_FUTURE`` in microseconds.
_MAX_FUTURE_MICROS: Final = MAX_FUTURE // _ONE_MICRO
#: PostgreSQL's epoch (2000-01-01) in seconds since the Unix epoch.
_PG_EPOCH_SECONDS: Final = 946_684_800


def _seconds_micros(seconds: float) -> int:
    """``datetime.fromtimestamp(seconds, tz=UTC)`` in microseconds since PostgreSQL's epoch,
    rounded as ``fromtimestamp`` rounds (the fraction of a second, in microseconds, half to
    even), without building the datetime."""
    whole = int(seconds)
    return (whole - _PG_EPOCH_SECONDS) * 1_000_000 + round((seconds - whole) * 1e6)


def _at(value: float | datetime) -> datetime:
    """A time the one pass kept as seconds since the Unix epoch (a span's start or end), as
    ``mapping.wall_time`` makes it; a datetime as it is."""
    if type(value) is float:
        return datetime.fromtimestamp(value, tz=UTC)
    assert isinstance(value, datetime)
    return value


def _span_row(compact: tuple[Any, ...]) -> SpanRow:
    """The envelope row of a compact one (its start and end as seconds)."""
    return (*compact[:6], _at(compact[6]), _at(compact[7]), *compact[8:])
