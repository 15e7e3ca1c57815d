"""The web view and the HTML export, driven in Debian's headless Chromium through Playwright and
checked against SQL queries of the same log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.model import Batch
from otel_agentcap.testing.synthetic import synthetic_run, write_batches
from otel_agentcap.viewer.app import ViewerConfig
from otel_agentcap.viewer.serve import ViewerServer

pytestmark = [pytest.mark.browser, pytest.mark.storage]

CHROMIUM = os.environ.get("AGENTCAP_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
JAEGER = "http://jaeger.example.invalid:16686"
#: Wide enough that the demo run's 19 columns are all drawn.
WIDE = {"width": 3200, "height": 1000}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def log_dsn(pg_server_dsn: str) -> Iterator[str]:
    """A database for this module's tests, with the demo run recorded in it."""
    name = f"agentcap_view_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = embedded.dsn_for(pg_server_dsn, name)
    try:
        migrate(dsn)
        yield dsn
    finally:
        with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture(scope="module")
def demo_run(log_dsn: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "otel_agentcap.cli", "demo", "--dsn", log_dsn, "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return str(json.loads(out.stdout)["run_id"])


@pytest.fixture(scope="module")
def server(log_dsn: str) -> Iterator[ViewerServer]:
    config = ViewerConfig(dsn=log_dsn, jaeger_url=JAEGER, poll_seconds=0.2)
    with ViewerServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture()
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport=WIDE)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield opened
    finally:
        context.close()
    assert not errors, errors


@pytest.fixture()
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: ``AGENTCAP_SCREENSHOT_DIR`` (``make screenshots`` points it at
    docs/screenshots), else the test's temporary directory."""
    target = Path(os.environ.get("AGENTCAP_SCREENSHOT_DIR") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


# --------------------------------------------------------------------------- helpers


def _open_run(page: Any, server: ViewerServer, run_id: str, fragment: str = "") -> None:
    page.goto(f"{server.url}/runs/{_quote(run_id)}{fragment}")
    page.wait_for_selector("body[data-ready='1']")


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def _rows(dsn: str, query: str, **params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query, params).fetchall()


def _nodes(page: Any) -> list[dict[str, Any]]:
    """Every drawn event: index, agent, sequence, type, x, y and classes."""
    return page.eval_on_selector_all(
        "g.ev[data-i]",
        """els => els.map(e => {
            const m = /translate\\(([-\\d.e]+),([-\\d.e]+)\\)/.exec(e.getAttribute('transform'));
            return {i: Number(e.dataset.i), agent: e.dataset.agent, seq: Number(e.dataset.seq),
                    type: e.dataset.type, x: Number(m[1]), y: Number(m[2]),
                    cls: e.getAttribute('class')};
        })""",
    )


def _marked(page: Any, cls: str) -> set[tuple[str, int]]:
    return {(n["agent"], n["seq"]) for n in _nodes(page) if cls in n["cls"].split()}


def _expected_lanes(dsn: str, run_id: str) -> list[str]:
    """The spawn tree in depth-first order: children by the sequence of their spawn event."""
    agents = _rows(
        dsn,
        """SELECT a.agent_id, a.parent_agent_id, s.logical_seq,
                  (SELECT min(logical_seq) FROM agentcap.events e
                   WHERE e.run_id = a.run_id AND e.agent_id = a.agent_id)
           FROM agentcap.agents a
           LEFT JOIN agentcap.events s ON s.event_id = a.spawned_at_event_id
           WHERE a.run_id = %(run)s""",
        run=run_id,
    )
    children: dict[str | None, list[tuple[int, str]]] = {}
    for agent, parent, spawn_seq, first in agents:
        key = spawn_seq if parent else first
        children.setdefault(parent, []).append((key or 0, agent))
    order: list[str] = []

    def walk(parent: str | None) -> None:
        for _, agent in sorted(children.get(parent, [])):
            order.append(agent)
            walk(agent)

    walk(None)
    return order


_CLOSURE = """
WITH RECURSIVE ev AS (
    SELECT event_id, agent_id, logical_seq, causal_parent_ids,
           lag(event_id) OVER (PARTITION BY agent_id ORDER BY logical_seq) AS prev
    FROM agentcap.events WHERE run_id = %(run)s
),
edges(child, parent) AS (
    SELECT e.event_id, p.id FROM ev e CROSS JOIN LATERAL unnest(e.causal_parent_ids) AS p(id)
    UNION
    SELECT event_id, prev FROM ev WHERE prev IS NOT NULL AND %(program_order)s
),
reached(id) AS (
    SELECT CASE WHEN %(past)s THEN parent ELSE child END FROM edges
    WHERE CASE WHEN %(past)s THEN child ELSE parent END = %(event)s::uuid
    UNION
    SELECT CASE WHEN %(past)s THEN e.parent ELSE e.child END
    FROM edges e JOIN reached r ON r.id = CASE WHEN %(past)s THEN e.child ELSE e.parent END
)
SELECT ev.agent_id, ev.logical_seq FROM ev JOIN reached r ON r.id = ev.event_id
WHERE ev.event_id <> %(event)s::uuid
"""


def _closure_sql(
    dsn: str, run_id: str, event_id: str, *, past: bool, program_order: bool
) -> set[tuple[str, int]]:
    rows = _rows(dsn, _CLOSURE, run=run_id, event=event_id, past=past, program_order=program_order)
    return {(agent, seq) for agent, seq in rows}


# --------------------------------------------------------------------------- runs list


def test_runs_list_shows_the_demo_run_with_its_totals(page, server, demo_run, log_dsn, shots):
    """The runs list shows the demo run with totals equal to SQL counts of the same log."""
    (expected,) = _rows(
        log_dsn,
        """SELECT (SELECT count(*) FROM agentcap.agents WHERE run_id = %(run)s),
                  count(*),
                  count(*) FILTER (WHERE event_type = 'model_call'),
                  sum((payload->'usage'->>'input_tokens')::int
                      + (payload->'usage'->>'output_tokens')::int)
                      FILTER (WHERE event_type = 'model_call'),
                  count(*) FILTER (WHERE event_type = 'agent_error'
                                   OR payload->>'status' = 'error'),
                  (SELECT count(*) FROM agentcap.conflicts WHERE run_id = %(run)s)
           FROM agentcap.events WHERE run_id = %(run)s""",
        run=demo_run,
    )
    page.set_viewport_size({"width": 1400, "height": 700})
    page.goto(server.url + "/")
    page.wait_for_selector("body[data-ready='1']")
    row = page.locator(f"tr[data-run='{demo_run}']")
    cells = {
        key: row.locator(f"td[data-key='{key}']").inner_text().replace(",", "")
        for key in ("agents", "events", "model_calls", "tokens", "errors", "conflicts")
    }
    assert cells == dict(
        zip(
            ("agents", "events", "model_calls", "tokens", "errors", "conflicts"),
            (str(v) for v in expected),
            strict=True,
        )
    )
    assert int(cells["errors"]) == 3  # two failed tools and the timed-out researcher
    page.screenshot(path=str(shots / "runs-list.png"))
    # The filter asks the server: an id that matches nothing empties the table.
    page.fill("#filter", "no-such-run-anywhere")
    page.wait_for_selector(f"tr[data-run='{demo_run}']", state="detached")
    page.fill("#filter", demo_run[-6:])
    page.wait_for_selector(f"tr[data-run='{demo_run}']")
    assert page.inner_text("#count") == "1 run"
    page.click(f"tr[data-run='{demo_run}'] a")
    page.wait_for_selector("body[data-ready='1']")
    assert page.inner_text("#run-title") == demo_run


# --------------------------------------------------------------------------- the run page


def test_lanes_follow_the_spawn_tree_and_events_their_sequence(page, server, demo_run, log_dsn):
    """One lane per agent in spawn-tree order; each lane's events in sequence order, placed by
    sequence (one x per sequence, across lanes), and every stored event drawn once."""
    _open_run(page, server, demo_run)
    lanes = page.eval_on_selector_all(
        "text.lane-name", "els => els.map(e => e.querySelector('title').textContent)"
    )
    assert lanes == _expected_lanes(log_dsn, demo_run)
    nodes = _nodes(page)
    stored = _rows(
        log_dsn,
        "SELECT agent_id, logical_seq, event_type FROM agentcap.events WHERE run_id = %(run)s",
        run=demo_run,
    )
    assert sorted((n["agent"], n["seq"], n["type"]) for n in nodes) == sorted(stored)
    lane_y = {agent: n for n, agent in enumerate(lanes)}
    x_of_seq: dict[int, float] = {}
    for agent in lanes:
        mine = [n for n in nodes if n["agent"] == agent]
        assert len({n["y"] for n in mine}) == 1
        by_x = [n["seq"] for n in sorted(mine, key=lambda n: n["x"])]
        assert by_x == sorted(by_x)
        for n in mine:
            assert x_of_seq.setdefault(n["seq"], n["x"]) == n["x"]
    ys = [next(n["y"] for n in nodes if n["agent"] == a) for a in lanes]
    assert ys == sorted(ys) and len(set(ys)) == len(lane_y)
    seqs = sorted(x_of_seq)
    assert [x_of_seq[s] for s in seqs] == sorted(x_of_seq.values())
    # Each child lane names the spawn event that created it.
    spawned = page.eval_on_selector_all("text.lane-sub", "els => els.map(e => e.textContent)")
    assert sum("spawned at #" in text for text in spawned) == len(lanes) - 1


def test_every_causal_parent_is_an_edge(page, server, demo_run, log_dsn):
    """The drawn edges are exactly the causal parent links of the log, across lanes too."""
    _open_run(page, server, demo_run)
    nodes = {n["i"]: (n["agent"], n["seq"]) for n in _nodes(page)}
    drawn = page.eval_on_selector_all(
        "path.edge", "els => els.map(e => [Number(e.dataset.from), Number(e.dataset.to)])"
    )
    edges = {(nodes[a], nodes[b]) for a, b in drawn}
    assert len(edges) == len(drawn)
    links = _rows(
        log_dsn,
        """SELECT p.agent_id, p.logical_seq, e.agent_id, e.logical_seq
           FROM agentcap.events e CROSS JOIN LATERAL unnest(e.causal_parent_ids) AS u(id)
           JOIN agentcap.events p ON p.event_id = u.id
           WHERE e.run_id = %(run)s""",
        run=demo_run,
    )
    assert edges == {((a, b), (c, d)) for a, b, c, d in links}
    assert any(a[0] != b[0] for a, b in edges)  # spawns and memory reads cross lanes


def test_the_model_tool_model_chain_is_drawn(page, server, demo_run):
    """A model call leads by edges to its tool call, the tool's result, and the next model call."""
    _open_run(page, server, demo_run)
    types = {n["i"]: n["type"] for n in _nodes(page)}
    drawn = page.eval_on_selector_all(
        "path.edge", "els => els.map(e => [Number(e.dataset.from), Number(e.dataset.to)])"
    )
    out: dict[int, set[int]] = {}
    for a, b in drawn:
        out.setdefault(a, set()).add(b)
    chains = [
        (m, t, r, m2)
        for m in types
        if types[m] == "model_call"
        for t in out.get(m, ())
        if types[t] == "tool_invocation"
        for r in out.get(t, ())
        if types[r] == "tool_result"
        for m2 in out.get(r, ())
        if types[m2] == "model_call"
    ]
    assert len(chains) >= 4  # one per researcher that ran a tool


def test_clicking_an_event_shows_its_payload_and_links(page, server, demo_run, log_dsn):
    """Clicking a model call shows its payload, usage, stop reason, tool_use ids, wall time, trace
    and a Jaeger link; its parents and children click through."""
    ((agent, seq, response_id, tool_use, trace, span),) = _rows(
        log_dsn,
        """SELECT agent_id, logical_seq, payload->>'response_id', payload->'tool_use_ids'->>0,
                  trace_id, span_id
           FROM agentcap.events WHERE run_id = %(run)s AND event_type = 'model_call'
             AND jsonb_array_length(payload->'tool_use_ids') = 1
           ORDER BY agent_id, logical_seq LIMIT 1""",
        run=demo_run,
    )
    _open_run(page, server, demo_run)
    page.click(f"g.ev[data-agent='{agent}'][data-seq='{seq}']")
    page.wait_for_selector("#payload")
    assert response_id in page.inner_text("#payload")
    panel = page.inner_text("#detail")
    assert tool_use in panel and "tool_use" in panel and "60 in, 25 out" in panel
    assert trace in panel and span in panel
    href = page.get_attribute("a.jaeger", "href")
    assert href == f"{JAEGER}/trace/{trace}?uiFind={span}"
    # Its child is the tool call it asked for: click through to it.
    page.click("#children button")
    page.wait_for_selector("#payload")
    assert tool_use in page.inner_text("#payload")
    assert "tool call" in page.inner_text("#detail h2")
    page.click("#parents button")
    page.wait_for_selector("#payload")
    assert response_id in page.inner_text("#payload")


@pytest.mark.parametrize("program_order", [True, False], ids=["happened-before", "links-only"])
def test_selection_highlights_exactly_the_causal_past_and_future(
    page, server, demo_run, log_dsn, program_order
):
    """For every event of the demo, selecting it highlights exactly the events a recursive SQL
    query over causal_parent_ids (plus each agent's program order, when on) finds."""
    _open_run(page, server, demo_run)
    if not program_order:
        page.uncheck("#program-order")
    events = _rows(
        log_dsn,
        "SELECT event_id::text, agent_id, logical_seq FROM agentcap.events WHERE run_id = %(run)s",
        run=demo_run,
    )
    nonempty = 0
    for event_id, agent, seq in events:
        page.click(f"g.ev[data-agent='{agent}'][data-seq='{seq}']")
        past = _closure_sql(log_dsn, demo_run, event_id, past=True, program_order=program_order)
        future = _closure_sql(log_dsn, demo_run, event_id, past=False, program_order=program_order)
        assert _marked(page, "past") == past, (agent, seq)
        assert _marked(page, "future") == future, (agent, seq)
        assert _marked(page, "selected") == {(agent, seq)}
        nonempty += bool(past) and bool(future)
    assert nonempty > 5
    page.keyboard.press("Escape")
    assert not _marked(page, "past") and not _marked(page, "selected")


def test_a_payload_that_arrives_after_the_selection_is_cleared_is_dropped(
    page, server, demo_run, log_dsn
):
    """Escape while an event's payload is still on its way: the answer that arrives later neither
    fails (the page fixture fails on any page error) nor fills the cleared panel."""
    ((agent, seq),) = _rows(
        log_dsn,
        """SELECT agent_id, logical_seq FROM agentcap.events WHERE run_id = %(run)s
           AND event_type = 'model_call' ORDER BY agent_id, logical_seq LIMIT 1""",
        run=demo_run,
    )
    _open_run(page, server, demo_run)
    held: list[Any] = []
    page.route("**/api/run/event?*", lambda route: held.append(route))
    page.click(f"g.ev[data-agent='{agent}'][data-seq='{seq}']")
    page.wait_for_function("() => document.querySelector('#detail h2') !== null")
    page.keyboard.press("Escape")
    page.wait_for_timeout(50)
    while not held:
        page.wait_for_timeout(20)
    for route in held:
        route.continue_()
    page.unroute("**/api/run/event?*")
    page.wait_for_timeout(300)
    assert page.query_selector("#payload") is None
    assert not _marked(page, "selected")


def test_run_page_screenshot(browser, server, demo_run, log_dsn, shots):
    """The demo run's page, with the writer's model call selected, is saved as a screenshot."""
    ((seq,),) = _rows(
        log_dsn,
        """SELECT logical_seq FROM agentcap.events WHERE run_id = %(run)s
           AND agent_id = 'planner/writer' AND event_type = 'model_call'""",
        run=demo_run,
    )
    context = browser.new_context(viewport={"width": 2900, "height": 700})
    try:
        shot = context.new_page()
        _open_run(shot, server, demo_run, f"#e=planner%2Fwriter@{seq}")
        shot.wait_for_selector("#payload")
        assert _marked(shot, "selected") == {("planner/writer", seq)}
        shot.screenshot(path=str(shots / "run-page.png"))
    finally:
        context.close()


# --------------------------------------------------------------------------- export


def test_exported_html_opens_from_disk_with_the_same_lanes(
    page, server, demo_run, log_dsn, tmp_path
):
    browser_context = page.context
    """export --format html writes one file that opens from file:// with no request beyond
    itself and shows the same lanes, events, edges, highlights and payloads as the server."""
    _open_run(page, server, demo_run)
    served_lanes = page.eval_on_selector_all("text.lane-name", "els => els.map(e => e.textContent)")
    served_nodes = sorted((n["agent"], n["seq"], n["type"], n["x"]) for n in _nodes(page))
    served_edges = page.eval_on_selector_all("path.edge", "els => els.length")

    target = tmp_path / "run.html"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_agentcap.cli",
            "export",
            demo_run,
            "--format",
            "html",
            "--dsn",
            log_dsn,
            "-o",
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    html = target.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)

    page.close()  # the served page polls; the file gets a page of its own
    page = browser_context.new_page()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(target.as_uri())
    page.wait_for_selector("body[data-ready='1']")
    assert (
        page.eval_on_selector_all("text.lane-name", "els => els.map(e => e.textContent)")
        == served_lanes
    )
    assert sorted((n["agent"], n["seq"], n["type"], n["x"]) for n in _nodes(page)) == served_nodes
    assert page.eval_on_selector_all("path.edge", "els => els.length") == served_edges
    ((event_id, agent, seq, response_id),) = _rows(
        log_dsn,
        """SELECT event_id::text, agent_id, logical_seq, payload->>'response_id'
           FROM agentcap.events WHERE run_id = %(run)s AND agent_id = 'planner/writer'
           AND event_type = 'model_call'""",
        run=demo_run,
    )
    page.click(f"g.ev[data-agent='{agent}'][data-seq='{seq}']")
    page.wait_for_selector("#payload")
    assert response_id in page.inner_text("#payload")
    assert _marked(page, "past") == _closure_sql(
        log_dsn, demo_run, event_id, past=True, program_order=True
    )
    assert all(url.startswith(("file:", "data:")) for url in requests), requests


# --------------------------------------------------------------------------- live, conflicts, size


def test_a_run_being_written_updates_while_open(page, server, log_dsn):
    """Events stored after the page opened appear without a reload (the page polls)."""
    batches = list(synthetic_run("live-run", 120, agents=3, batch=40))
    write_batches(log_dsn, batches[:1])
    _open_run(page, server, "live-run")
    assert page.evaluate("agentcapView.events()") == 40
    write_batches(log_dsn, batches[1:])
    page.wait_for_function("() => agentcapView.events() === 120", timeout=15_000)
    page.wait_for_selector("#run-totals [data-key='events'] dd >> text=120")


def test_conflicts_are_shown_at_the_stored_event_they_collided_with(page, server, log_dsn):
    """A different event under a stored event's id is drawn as a badge on the stored event, and
    its detail shows the incoming row and the reason."""
    batches = list(synthetic_run("conflict-run", 60, agents=2))
    write_batches(log_dsn, batches)
    stored = next(e for e in batches[0].events if e.event_type == "model_call")
    changed = stored._replace(payload={**stored.payload, "model": "something-else"})
    write_batches(log_dsn, [Batch(events=(changed,))])
    _open_run(page, server, "conflict-run")
    node = f"g.ev[data-agent='{stored.agent_id}'][data-seq='{stored.seq}']"
    assert page.locator(f"{node} circle.badge").count() == 1
    assert page.locator("circle.badge").count() == 1
    assert page.inner_text("#run-totals [data-key='conflicts'] dd") == "1"
    page.click(node)
    page.wait_for_selector(".conflict")
    box = page.inner_text(".conflict")
    assert "event_id_content" in box and stored.event_id in box
    page.click(".conflict summary")
    assert "something-else" in page.inner_text(".conflict pre")


def test_a_malformed_escape_in_the_address_is_shown_as_an_unknown_run(page, server, log_dsn):
    """A run address or event fragment with a malformed percent escape (%E0) opens the page with
    a message (no such run) or without a selection; the page never stops on an error."""
    page.goto(f"{server.url}/runs/%E0")
    page.wait_for_selector("body[data-ready='error']")
    assert "%E0" in page.inner_text("#detail") and "not found" in page.inner_text("#detail")
    write_batches(log_dsn, synthetic_run("escape-run", 20, agents=2))
    _open_run(page, server, "escape-run", "#e=%E0@1")
    assert page.evaluate("agentcapView.marks().selected") is None


def test_payload_values_that_are_not_text_never_stop_the_detail_panel(page, server, log_dsn):
    """A payload field the panel shows that holds an object whose toString and valueOf are not
    functions (String() throws on it) is shown as JSON, and the panel still ends with the
    payload; the page fixture fails on any page error."""
    from datetime import UTC, datetime

    from otel_agentcap.model import Event, RunRecord, event_id_for

    odd = {"toString": 1, "valueOf": 1}
    payloads = {
        "model_call": {
            "model": odd,
            "status": odd,
            "usage": {"input_tokens": odd, "output_tokens": odd, "cache_read_input_tokens": odd},
            "time_to_first_chunk_ms": odd,
            "stream": odd,
            "tool_use_ids": [odd],
        },
        "tool_invocation": {"tool": odd, "invocation_id": odd},
        "memory_read": {"memory": odd, "key": "k", "found": odd},
        "memory_write": {"memory": odd, "key": "k", "op": odd},
        "agent_error": {"error_type": odd, "message": odd, "discarded_state_keys": [odd]},
        "agent_spawn": {"child_agent_id": odd, "key": odd, "child_name": odd},
    }
    start = datetime(2026, 2, 1, tzinfo=UTC)
    events = tuple(
        Event(
            event_id=event_id_for("odd-values", "a", f"seq:{seq}"),
            run_id="odd-values",
            agent_id="a",
            seq=seq,
            event_type=kind,
            idempotency_key=f"seq:{seq}",
            wall_time=start,
            payload=payload,
        )
        for seq, (kind, payload) in enumerate(payloads.items(), start=1)
    )
    write_batches(log_dsn, [Batch(events=events, runs=(RunRecord("odd-values", start, {}),))])
    _open_run(page, server, "odd-values")
    for seq in range(1, len(payloads) + 1):
        page.evaluate("(s) => agentcapView.select('a', s)", seq)
        page.wait_for_selector(f"#detail .chip >> text=#{seq}")
        page.wait_for_selector("#payload")
        # compact JSON in a field of the panel (the payload below is indented); jsonb orders keys
        assert re.search(
            r'\{"(toString|valueOf)":1,"(toString|valueOf)":1\}', page.inner_text("#detail")
        )


def test_a_jaeger_url_that_is_not_a_web_address_makes_no_link(page, log_dsn):
    """A Jaeger base address given to the view that is not http(s) (javascript:...) makes no
    link to an event's span."""
    write_batches(log_dsn, synthetic_run("jaeger-run", 20, agents=2))
    config = ViewerConfig(dsn=log_dsn, jaeger_url="javascript:alert(document.domain)//")
    with ViewerServer(config) as running:
        _open_run(page, running, "jaeger-run")
        page.evaluate("agentcapView.select('root', 1)")
        page.wait_for_selector("#event-fields >> text=span id")
        assert page.locator("#detail a").count() == 0


def test_runs_whose_ids_are_dot_segments_open_from_the_runs_list(page, server, log_dsn):
    """A run id "." or ".." (a dot segment the browser would drop from /runs/ID) opens from its
    link in the runs list, with a 200 page."""
    for run_id in (".", ".."):
        write_batches(log_dsn, synthetic_run(run_id, 20, agents=2))
    answers: list[tuple[str, int]] = []
    page.on("response", lambda response: answers.append((response.url, response.status)))
    for run_id in (".", ".."):
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='1']")
        page.click(f"tr[data-run='{run_id}'] a")
        page.wait_for_url("**/runs/**", timeout=5_000)
        page.wait_for_selector("body[data-ready='1']")
        assert page.inner_text("#run-title") == run_id
        assert page.evaluate("agentcapView.events()") == 20
    assert not [answer for answer in answers if answer[1] >= 400], answers
    write_batches(log_dsn, synthetic_run("path-run", 20, agents=2))
    _open_run(page, server, "path-run", "?run=..")  # the path names the run, as on the server
    assert page.inner_text("#run-title") == "path-run"


def test_a_large_run_draws_a_window_and_loads_payloads_on_demand(page, server, log_dsn):
    """A run of 3,000 events draws only the events on screen, fetches no payload until one is
    opened, and highlights the same causal past as SQL for an event far from the start."""
    write_batches(log_dsn, synthetic_run("large-run", 3_000, agents=6))
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))
    page.set_viewport_size({"width": 1600, "height": 900})
    _open_run(page, server, "large-run")
    drawn = page.locator("g.ev").count()
    assert 0 < drawn < 600
    assert not [url for url in asked if "/api/run/event" in url]
    ((event_id, agent, seq),) = _rows(
        log_dsn,
        """SELECT event_id::text, agent_id, logical_seq FROM agentcap.events
           WHERE run_id = 'large-run' AND event_type = 'memory_read'
           ORDER BY logical_seq DESC LIMIT 1""",
    )
    page.evaluate("([a, s]) => agentcapView.select(a, s)", [agent, seq])
    page.wait_for_selector("#payload")
    marks = page.evaluate("agentcapView.marks()")
    assert {(a, s) for a, s in marks["past"]} == _closure_sql(
        log_dsn, "large-run", event_id, past=True, program_order=True
    )
    assert len([url for url in asked if "/api/run/event" in url]) >= 1
    assert _marked(page, "selected") == {(agent, seq)}  # scrolled into view and drawn


def test_a_20_mb_payload_is_shown_as_a_preview_with_the_whole_one_a_click_away(
    page, server, log_dsn, tmp_path
):
    """A 20 MB tool result is shown as the first PAYLOAD_PREVIEW_CHARS characters of its JSON,
    its size and its small fields (the tool), and the link it offers opens the whole payload,
    character for character: served, and in the exported HTML file (a link to its own copy)."""
    from datetime import UTC, datetime

    from otel_agentcap.model import Event, RunRecord, event_id_for
    from otel_agentcap.viewer.documents import PAYLOAD_PREVIEW_CHARS

    start = datetime(2026, 2, 1, tzinfo=UTC)
    event = Event(
        event_id=event_id_for("huge-payload", "a", "seq:1"),
        run_id="huge-payload",
        agent_id="a",
        seq=1,
        event_type="tool_result",
        idempotency_key="seq:1",
        wall_time=start,
        payload={"tool": "fetch-everything", "result": "q" * 20_000_000},
    )
    write_batches(log_dsn, [Batch(events=(event,), runs=(RunRecord("huge-payload", start, {}),))])
    ((stored,),) = _rows(
        log_dsn, "SELECT payload::text FROM agentcap.events WHERE run_id = 'huge-payload'"
    )
    target = tmp_path / "huge.html"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "otel_agentcap.cli", "export", "huge-payload"),
            *("--format", "html", "--dsn", log_dsn, "-o", str(target)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for address in (f"{server.url}/runs/huge-payload", target.as_uri()):
        page.goto(address)
        page.wait_for_selector("body[data-ready='1']")
        page.evaluate("agentcapView.select('a', 1)")
        page.wait_for_selector("#payload")
        assert page.inner_text("#payload") == stored[:PAYLOAD_PREVIEW_CHARS], address
        note = page.inner_text(".payload-cut")
        assert f"{len(stored):,} characters" in note, (address, note)
        assert "fetch-everything" in page.inner_text("#detail"), address
        with page.context.expect_page() as opened:
            page.click("a.payload-whole")
        whole = opened.value
        whole.wait_for_load_state()
        size, head, tail = whole.evaluate(
            "() => { const t = document.body.textContent;"
            " return [t.length, t.slice(0, 40), t.slice(-40)]; }"
        )
        whole.close()
        assert (size, head, tail) == (len(stored), stored[:40], stored[-40:]), address
