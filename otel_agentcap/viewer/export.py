"""``otel-agentcap export RUN --format html``: one run as a single self-contained HTML file.

The file holds the run page's style and script and every event of the run (graph, labels, and
each payload as the JSON text PostgreSQL stores); it opens from disk with no server and no
network (its Content-Security-Policy allows nothing to be fetched).
"""

from __future__ import annotations

from typing import Any

import psycopg

from otel_agentcap.exporters.postgres import store

from .documents import conflict_fields, run_document
from .labels import label
from .pages import exported_run_page


def run_export_data(
    conn: psycopg.Connection[Any], run_id: str, *, jaeger_url: str | None = None
) -> dict[str, Any]:
    """What the exported page embeds: the served run document plus every event's columns,
    labels and conflicts with payloads. ``RunNotFound`` if the run is not stored."""
    document = run_document(conn, run_id, with_ids=True)
    graph = document["graph"]
    ids: list[str] = graph.pop("id")
    index = {event_id: i for i, event_id in enumerate(ids)}
    n = len(ids)
    wall: list[str | None] = [None] * n
    key: list[str | None] = [None] * n
    trace: list[str | None] = [None] * n
    span: list[str | None] = [None] * n
    payload: list[str | None] = [None] * n
    for row in store.run_event_texts(conn, run_id):
        i = index.get(row.event_id)
        if i is None:  # stored after the graph was read: left out, as from the graph
            continue
        wall[i] = row.wall_time.isoformat()
        key[i] = row.idempotency_key
        trace[i] = row.trace_id
        span[i] = row.span_id
        payload[i] = row.payload
    labels = [""] * n
    if n:
        lanes = [lane["agent"] for lane in graph["lanes"]]
        place = {(lanes[graph["lane"][i]], graph["col"][i]): i for i in range(n)}
        col_of = {int(seq): c for c, seq in enumerate(graph["seqs"])}
        first, last = int(graph["seqs"][0]), int(graph["seqs"][-1])
        for agent, seq, kind, fields in store.event_labels(conn, run_id, first, last):
            i = place.get((agent, col_of.get(seq, -1)), -1)
            if i >= 0:
                labels[i] = label(kind, fields, agent)
    conflict_rows = [conflict_fields(c) for c in store.run_conflicts(conn, run_id, payloads=True)]
    return {
        **document,
        "config": {"jaeger_url": jaeger_url},
        "events": {
            "id": ids,
            "wall": wall,
            "key": key,
            "trace": trace,
            "span": span,
            "payload": payload,
        },
        "labels": labels,
        "conflict_rows": conflict_rows,
    }


def export_html(
    conn: psycopg.Connection[Any], run_id: str, *, jaeger_url: str | None = None
) -> str:
    """The exported page of ``run_id``; ``RunNotFound`` if it is not stored."""
    return exported_run_page(run_export_data(conn, run_id, jaeger_url=jaeger_url))
