"""The web view's HTTP side: JSON API over the log, read-only sessions, host and token checks."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from otel_agentcap.model import AgentRecord, Batch, Event, RunRecord, event_id_for
from otel_agentcap.serving import ConnectionLimits
from otel_agentcap.testing.synthetic import synthetic_run, write_batches
from otel_agentcap.tokens import TokenError
from otel_agentcap.viewer.app import ViewerConfig, _configure_connection
from otel_agentcap.viewer.serve import ViewerServer

TOKEN = "a-token-long-enough-to-use"


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(url, headers=headers or {})
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=20) as response:
            body = response.read()
            status, head = response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        body = exc.read()
        status, head = exc.code, dict(exc.headers)
    kind = head.get("content-type", "")
    return status, head, json.loads(body) if "json" in kind else body.decode()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


@pytest.fixture()
def server(pg_dsn: str) -> Iterator[ViewerServer]:
    with ViewerServer(ViewerConfig(dsn=pg_dsn)) as running:
        yield running


def _event(
    run: str, agent: str, seq: int, kind: str, payload: Any, key: str | None = None
) -> Event:
    from datetime import UTC, datetime

    idem = key or f"seq:{seq}"
    return Event(
        event_id=event_id_for(run, agent, idem),
        run_id=run,
        agent_id=agent,
        seq=seq,
        event_type=kind,
        idempotency_key=idem,
        wall_time=datetime(2026, 1, 1, tzinfo=UTC),
        payload=payload,
    )


@pytest.mark.storage
def test_runs_are_listed_newest_first_with_totals_search_and_pages(server, pg_dsn):
    """The runs API lists runs newest first with SQL-equal totals, filters and pages."""
    from datetime import UTC, datetime, timedelta

    for n in range(3):
        started = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(hours=n)
        record = RunRecord(f"run-{n}", started, {"team": f"t{n}"})
        batches = [
            b._replace(runs=(record,))
            for b in synthetic_run(f"run-{n}", 40 + n, agents=3, start=started)
        ]
        write_batches(pg_dsn, batches)
    # a model call whose usage holds text instead of numbers counts as a call, with no tokens
    odd = _event("run-2", "root", 10_000, "model_call", {"usage": {"input_tokens": "12"}})
    odd = odd._replace(wall_time=datetime(2026, 1, 2, tzinfo=UTC))
    write_batches(pg_dsn, [Batch(events=(odd,))])
    status, _, body = _get(f"{server.url}/api/runs")
    assert status == 200
    assert [r["run_id"] for r in body["runs"]] == ["run-2", "run-1", "run-0"]
    with psycopg.connect(pg_dsn) as conn:
        for run in body["runs"]:
            expected = conn.execute(
                """SELECT count(*), count(*) FILTER (WHERE event_type = 'model_call'),
                          COALESCE(sum((payload->'usage'->>'input_tokens')::int
                                       + (payload->'usage'->>'output_tokens')::int)
                              FILTER (WHERE jsonb_typeof(payload->'usage'->'output_tokens')
                                            = 'number'), 0)
                   FROM agentcap.events WHERE run_id = %s""",
                (run["run_id"],),
            ).fetchone()
            assert (run["events"], run["model_calls"], run["tokens"]) == expected
            assert run["agents"] == 3 and run["conflicts"] == 0
    assert [r["run_id"] for r in _get(f"{server.url}/api/runs?q=T1")[2]["runs"]] == ["run-1"]
    assert [r["run_id"] for r in _get(f"{server.url}/api/runs?q=run-0")[2]["runs"]] == ["run-0"]
    page = _get(f"{server.url}/api/runs?limit=2")[2]
    assert len(page["runs"]) == 2 and page["more"] is True
    rest = _get(f"{server.url}/api/runs?limit=2&offset=2")[2]
    assert [r["run_id"] for r in rest["runs"]] == ["run-0"] and rest["more"] is False


@pytest.mark.storage
def test_labels_are_short_and_payloads_exact(server, pg_dsn):
    """A window of labels never carries a large payload; one event's payload is the stored JSON
    text, digit for digit, and markup in it stays text."""
    big = "x" * 200_000
    events = (
        _event("r", "a", 1, "agent_start", {}),
        _event("r", "a", 2, "memory_write", {"key": "k" * 500, "after": big, "op": "set"}),
        _event(
            "r", "a", 3, "tool_result", {"tool": "</script><b>t</b>", "n": 12345678901234567890123}
        ),
    )
    write_batches(pg_dsn, [Batch(events=events, agents=(AgentRecord("r", "a", "a"),))])
    status, _, body = _get(f"{server.url}/api/run/labels?run=r&from=1&to=3")
    assert status == 200
    labels = {seq: text for _, seq, text in body["labels"]}
    assert set(labels) == {1, 2, 3} and all(len(t) <= 60 for t in labels.values())
    assert len(json.dumps(body)) < 1_000
    assert _get(f"{server.url}/api/run/labels?run=r&from=2&to=2")[2]["labels"] == [
        ["a", 2, labels[2]]
    ]
    detail = _get(f"{server.url}/api/run/event?run=r&agent=a&seq=3")[2]
    assert "12345678901234567890123" in detail["event"]["payload"]
    assert json.loads(detail["event"]["payload"])["tool"] == "</script><b>t</b>"
    assert _get(f"{server.url}/api/run/event?run=r&agent=a&seq=9")[0] == 404


@pytest.mark.storage
def test_errors_are_json_with_status(server):
    """Unknown runs are 404, bad parameters 400, both as JSON with one message."""
    status, _, body = _get(f"{server.url}/api/run?run=nope")
    assert status == 404 and "nope" in body["error"]
    assert _get(f"{server.url}/api/run/labels?run=x&from=a&to=2")[0] == 400
    assert _get(f"{server.url}/api/run")[0] == 400
    status, _, body = _get(f"{server.url}/api/run/event?run=x&agent=a&seq={2**70}")
    assert status == 404 and body["error"]  # beyond bigint: no such event, not a crash


def test_database_down_is_503(tmp_path):
    """With the database unreachable the API answers 503 quickly, and pages still load."""
    config = ViewerConfig(dsn="postgresql://postgres@127.0.0.1:1/x", connect_timeout=1)
    with ViewerServer(config) as running:
        status, _, body = _get(f"{running.url}/api/runs")
        assert status == 503 and "unavailable" in body["error"]
        assert _get(f"{running.url}/")[0] == 200


@pytest.mark.storage
def test_sessions_are_read_only(pg_dsn):
    """The view's database sessions refuse every write."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        _configure_connection(conn)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("DELETE FROM agentcap.events")
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("CREATE TABLE agentcap.x (a int)")


@pytest.mark.storage
def test_loopback_server_answers_only_loopback_host_names(server):
    """Bound to loopback, a request naming another host (DNS rebinding) is refused."""
    assert _get(f"{server.url}/api/config")[0] == 200
    for host in ("localhost", f"localhost:{server.port}", "[::1]:80", "127.0.0.1"):
        assert _get(f"{server.url}/api/config", {"Host": host})[0] == 200, host
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example"):
        assert _get(f"{server.url}/api/config", {"Host": host})[0] == 400, host


@pytest.mark.storage
def test_security_headers(server):
    """Pages and API answers carry a strict Content-Security-Policy and nosniff."""
    for path in ("/", "/runs/x", "/api/config", "/static/run.js"):
        _, headers, _ = _get(server.url + path)
        assert "default-src 'none'" in headers["content-security-policy"], path
        assert headers["x-content-type-options"] == "nosniff"


@pytest.mark.storage
def test_token_is_required_when_configured(pg_dsn):
    """With a token, the API needs it as a bearer token (or the cookie /login sets); pages
    redirect to /login; static assets stay public."""
    with ViewerServer(ViewerConfig(dsn=pg_dsn, token=TOKEN)) as running:
        url = running.url
        status, headers, _ = _get(f"{url}/api/runs")
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert _get(f"{url}/api/runs", {"Authorization": "Bearer wrong-token-of-length"})[0] == 401
        assert _get(f"{url}/api/runs", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
        status, headers, _ = _get(f"{url}/runs/abc")
        assert status == 303 and headers["location"] == "/login?next=/runs/abc"
        assert _get(f"{url}/static/view.css")[0] == 200
        request = urllib.request.Request(
            f"{url}/login?next=/", data=f"token={TOKEN}".encode(), method="POST"
        )
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            opener.open(request, timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code == 303
            cookie = exc.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and TOKEN not in cookie
        session = cookie.split(";", 1)[0]
        assert _get(f"{url}/api/runs", {"Cookie": session})[0] == 200
        bad = urllib.request.Request(f"{url}/login", data=b"token=nope", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            opener.open(bad, timeout=10)
        assert refused.value.code == 401


def test_non_loopback_address_needs_a_token():
    """Serving beyond loopback without a token is refused before anything is bound."""
    with pytest.raises(TokenError, match="token"):
        ViewerServer(ViewerConfig(dsn="postgresql://x"), host="0.0.0.0")


def test_idle_and_slow_connections_are_closed():
    """Connections that send nothing, and one that sends its request head a byte at a time, are
    closed after the idle timeout, as the ingest's are (uvicorn held both for ever)."""
    config = ViewerConfig(dsn="postgresql://postgres@127.0.0.1:1/x", connect_timeout=1)
    limits = ConnectionLimits(idle_timeout=1, read_timeout=1, graceful_timeout=1)
    with ViewerServer(config, limits=limits) as running:
        idle = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(50)]
        slow = socket.create_connection(("127.0.0.1", running.port))
        started = time.monotonic()
        try:
            closed_slow = False
            for byte in b"GET /api/config HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 30:
                try:  # 6 s of trickling, far past the timeouts
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed_slow = True
                    break
                time.sleep(0.1)
            if not closed_slow:
                slow.settimeout(3)
                with contextlib.suppress(TimeoutError):
                    try:
                        closed_slow = slow.recv(100) == b""
                    except ConnectionResetError:
                        closed_slow = True
            closed = 0
            for sock in idle:
                sock.settimeout(max(0.1, 6 - (time.monotonic() - started)))
                with contextlib.suppress(TimeoutError):
                    try:
                        closed += sock.recv(10) == b""
                    except ConnectionResetError:
                        closed += 1
        finally:
            for sock in [*idle, slow]:
                sock.close()
    assert closed == 50
    assert closed_slow
