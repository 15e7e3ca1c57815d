"""The JSON documents the web view reads, built from the storage layer's read queries.

Each function takes an open connection and returns plain JSON-ready data (datetimes as ISO 8601
text, payloads as the JSON text PostgreSQL stores). The server sends them as they are; the HTML
export embeds them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import urlencode

import psycopg

from otel_agentcap.exporters.postgres import store
from otel_agentcap.model import Event
from otel_agentcap.tokens import RunScope

from .graph import run_graph_document, seq_json
from .labels import label

#: Most runs one page of the runs list holds.
MAX_RUNS_PAGE: Final = 500
#: PostgreSQL's OFFSET is a bigint: a larger offset is past every run all the same.
_MAX_OFFSET: Final = 2**63 - 1
#: Longest payload (characters of its JSON text) the event and conflict documents carry whole;
#: a longer one is sent as a preview of this many characters, its size, its small fields and
#: the address of ``/api/run/payload``, which answers it whole (a page that drew 20 MB of JSON
#: would freeze).
PAYLOAD_PREVIEW_CHARS: Final = 65_536
#: Longest top-level field (characters of its JSON text) of a previewed payload's fields;
#: a longer one is a truncation marker with its first characters and its size.
FIELD_CHARS: Final = 2_000


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def totals_document(totals: store.RunTotals) -> dict[str, Any]:
    return {
        "run_id": totals.run_id,
        "started_at": _iso(totals.started_at),
        "first_wall_time": _iso(totals.first_wall_time),
        "last_wall_time": _iso(totals.last_wall_time),
        "duration_s": totals.duration_seconds,
        "attributes": totals.attributes,
        "agents": totals.agents,
        "events": totals.events,
        "model_calls": totals.model_calls,
        "input_tokens": totals.input_tokens,
        "output_tokens": totals.output_tokens,
        "tokens": totals.input_tokens + totals.output_tokens,
        "errors": totals.errors,
        "conflicts": totals.conflicts,
    }


def runs_document(
    conn: psycopg.Connection[Any],
    *,
    limit: int = 200,
    offset: int = 0,
    search: str | None = None,
    scope: RunScope | None = None,
) -> dict[str, Any]:
    """A page of the runs list, newest first (``more``: whether another page follows); with a
    ``scope``, of the runs it allows only."""
    limit = max(1, min(limit, MAX_RUNS_PAGE))
    offset = max(0, min(offset, _MAX_OFFSET))
    runs = store.run_totals(
        conn,
        limit=limit + 1,
        offset=offset,
        search=search,
        within=None if scope is None else (sorted(scope.exact), list(scope.prefixes)),
    )
    return {
        "runs": [totals_document(r) for r in runs[:limit]],
        "more": len(runs) > limit,
        "offset": offset,
    }


def version_document(conn: psycopg.Connection[Any], run_id: str) -> dict[str, Any]:
    return {"version": list(store.run_version(conn, run_id))}


def run_document(
    conn: psycopg.Connection[Any], run_id: str, *, with_ids: bool = False
) -> dict[str, Any]:
    """A run's totals and graph (no payloads); ``RunNotFound`` if it is not stored."""
    version = store.run_version(conn, run_id)  # first, so a later poll sees anything added since
    totals = store.run_totals_of(conn, run_id)
    agents = store.run_agents(conn, run_id)
    rows = store.run_graph(conn, run_id)
    conflicts = store.run_conflicts(conn, run_id)
    stored = {row.event_id for row in rows}
    dangling = sorted({p for row in rows for p in row.causal_parent_ids if p not in stored})
    moved = store.moved_events(conn, run_id, dangling)
    return {
        "run": totals_document(totals),
        "graph": run_graph_document(agents, rows, conflicts, moved, with_ids=with_ids),
        "version": list(version),
    }


def labels_document(
    conn: psycopg.Connection[Any],
    run_id: str,
    seq_from: int,
    seq_to: int,
    agent_ids: Sequence[str] | None = None,
) -> dict[str, Any]:
    """``labels``: ``[agent_id, seq, label]`` for the events in a window of sequences (a sequence
    beyond JavaScript's exact integers is sent as text, as in the graph's ``seqs``)."""
    rows = store.event_labels(conn, run_id, seq_from, seq_to, agent_ids)
    return {
        "labels": [
            [agent, seq_json(seq), label(kind, fields, agent)] for agent, seq, kind, fields in rows
        ]
    }


def conflict_fields(row: store.ConflictRow) -> dict[str, Any]:
    return {
        "id": row.conflict_id,
        "detected_at": _iso(row.detected_at),
        "reason": row.reason,
        "existing_event_id": row.existing_event_id,
        "event_id": row.event_id,
        "agent_id": row.agent_id,
        "seq": row.seq,
        "event_type": row.event_type,
        "wall_time": _iso(row.wall_time),
        "causal_parent_ids": list(row.causal_parent_ids),
        "idempotency_key": row.idempotency_key,
        "trace_id": row.trace_id,
        "span_id": row.span_id,
        "payload": row.payload,
    }


def event_fields(event: Event) -> dict[str, Any]:
    """An event as the detail panel reads it; ``payload`` is its stored JSON text."""
    return {
        "event_id": event.event_id,
        "agent_id": event.agent_id,
        "seq": event.seq,
        "event_type": event.event_type,
        "wall_time": _iso(event.wall_time),
        "idempotency_key": event.idempotency_key,
        "causal_parent_ids": list(event.causal_parent_ids),
        "trace_id": event.trace_id,
        "span_id": event.span_id,
        "payload": event.payload,
    }


def _small_fields(text: str) -> dict[str, Any] | None:
    """The top-level fields of a payload object (JSON ``text``), each one longer than
    :data:`FIELD_CHARS` replaced by ``{"$agentcap.truncated": its first characters, "size":
    its length}``, or None for a payload that is not an object."""
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    fields: dict[str, Any] = {}
    for key, value in parsed.items():
        shown = json.dumps(value, ensure_ascii=False)
        fields[key] = (
            value
            if len(shown) <= FIELD_CHARS
            else {"$agentcap.truncated": shown[:200], "size": len(shown)}
        )
    return fields


def _bounded(fields: dict[str, Any], url: str) -> dict[str, Any]:
    """``fields`` (an event's or conflict's) with its payload whole when it is short, else (no
    ``payload`` key) ``payload_preview``, ``payload_fields`` and ``payload_url``, the address of
    the whole payload; ``payload_size`` (characters of its JSON text) either way."""
    text = fields["payload"]
    if text is None or len(text) <= PAYLOAD_PREVIEW_CHARS:
        return {**fields, "payload_size": None if text is None else len(text)}
    bounded = {key: value for key, value in fields.items() if key != "payload"}
    bounded.update(
        payload_preview=text[:PAYLOAD_PREVIEW_CHARS],
        payload_size=len(text),
        payload_fields=_small_fields(text),
        payload_url=url,
    )
    return bounded


def payload_url(run_id: str, **where: str | int) -> str:
    """The address of ``/api/run/payload`` for a run's event (``agent``, ``seq``) or conflict."""
    return "/api/run/payload?" + urlencode({"run": run_id, **where})


def event_document(
    conn: psycopg.Connection[Any], run_id: str, agent_id: str, seq: int
) -> dict[str, Any]:
    """One event with its payload and the conflicts that collided with it (a payload over
    :data:`PAYLOAD_PREVIEW_CHARS` as its preview, see :func:`_bounded`)."""
    event = store.event_detail(conn, run_id, agent_id, seq)
    if event is None:
        raise LookupError(f"no event of agent {agent_id!r} at seq {seq} in run {run_id!r}")
    return {
        "event": _bounded(event_fields(event), payload_url(run_id, agent=agent_id, seq=seq)),
        "conflicts": [
            _bounded(conflict_fields(c), payload_url(run_id, conflict=c.conflict_id))
            for c in store.event_conflicts(conn, event)
        ],
    }


def conflict_document(
    conn: psycopg.Connection[Any], run_id: str, conflict_id: int
) -> dict[str, Any]:
    row = store.conflict_detail(conn, run_id, conflict_id)
    if row is None:
        raise LookupError(f"no conflict {conflict_id} in run {run_id!r}")
    return {"conflict": _bounded(conflict_fields(row), payload_url(run_id, conflict=conflict_id))}


def payload_text(
    conn: psycopg.Connection[Any],
    run_id: str,
    *,
    agent_id: str | None = None,
    seq: int | None = None,
    conflict_id: int | None = None,
) -> str:
    """The whole payload of an event (``agent_id``, ``seq``) or a conflict, as the JSON text
    PostgreSQL stores (``null`` for none); ``LookupError`` when there is no such event."""
    if conflict_id is not None:
        row = store.conflict_detail(conn, run_id, conflict_id)
        if row is None:
            raise LookupError(f"no conflict {conflict_id} in run {run_id!r}")
        text: str | None = row.payload
    else:
        assert agent_id is not None and seq is not None
        event = store.event_detail(conn, run_id, agent_id, seq)
        if event is None:
            raise LookupError(f"no event of agent {agent_id!r} at seq {seq} in run {run_id!r}")
        text = event.payload
    return "null" if text is None else text
