"""The web view's HTTP side: JSON API over the log, read-only sessions, host and token checks,
runs a token may read, connection timeouts and TLS (Hypercorn)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from otel_agentcap.model import AgentRecord, Batch, Event, RunRecord, event_id_for
from otel_agentcap.serving import ConnectionLimits, TlsConfig
from otel_agentcap.testing.synthetic import synthetic_run, write_batches
from otel_agentcap.tokens import Authenticator, TokenConfigError
from otel_agentcap.viewer.app import ViewerConfig, _configure_connection
from otel_agentcap.viewer.serve import ViewerServer

TOKEN = "a-token-long-enough-to-use"
TEAM = "team-a-token-0123456789"


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
def test_a_runs_page_offset_beyond_bigint_is_an_empty_page(server, pg_dsn):
    """An offset past what PostgreSQL's OFFSET holds (a bigint) is a page past every run, as a
    smaller one past the end is, not a database error; a negative one is the first page."""
    write_batches(pg_dsn, [Batch(events=(_event("r", "a", 1, "agent_start", {}),))])
    for offset in (2**63 - 1, 2**63, 10**30):
        status, _, body = _get(f"{server.url}/api/runs?offset={offset}")
        assert (status, body["runs"], body["more"]) == (200, [], False), (offset, body)
    status, _, body = _get(f"{server.url}/api/runs?offset=-{10**30}")
    assert (status, [r["run_id"] for r in body["runs"]]) == (200, ["r"])


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


def _raw(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.status, response.headers.get("content-type", ""), response.read()


@pytest.mark.storage
def test_a_large_payload_is_sent_as_a_preview_and_whole_on_demand(server, pg_dsn):
    """An event or conflict payload over PAYLOAD_PREVIEW_CHARS (here 20 MB) is answered as a
    preview (its first characters), its size, its small fields and the address of the whole
    payload, which answers the stored JSON text exactly; a small payload is answered whole."""
    from otel_agentcap.viewer.documents import PAYLOAD_PREVIEW_CHARS

    big = "y" * 20_000_000
    stored = _event("r", "a", 1, "tool_result", {"tool": "t", "result": big, "n": 2**70})
    small = _event("r", "a", 2, "tool_result", {"tool": "t", "result": "short"})
    other = stored._replace(payload={"tool": "t", "result": big + "z"})
    write_batches(pg_dsn, [Batch(events=(stored, small), agents=(AgentRecord("r", "a", "a"),))])
    write_batches(pg_dsn, [Batch(events=(other,))])  # a conflict on the stored event's id
    with psycopg.connect(pg_dsn) as conn:
        text, conflict_text = conn.execute(
            "SELECT e.payload::text, c.payload::text FROM agentcap.events e"
            " JOIN agentcap.conflicts c ON c.existing_event_id = e.event_id"
            " WHERE e.run_id = 'r' AND e.logical_seq = 1"
        ).fetchone()
    status, _, body = _get(f"{server.url}/api/run/event?run=r&agent=a&seq=1")
    assert status == 200
    assert len(json.dumps(body)) < 2 * PAYLOAD_PREVIEW_CHARS + 10_000
    event = body["event"]
    assert "payload" not in event
    assert event["payload_preview"] == text[:PAYLOAD_PREVIEW_CHARS]
    assert event["payload_size"] == len(text)
    assert event["payload_fields"]["tool"] == "t" and event["payload_fields"]["n"] == 2**70
    assert event["payload_fields"]["result"]["size"] == len(json.dumps(big))
    status, kind, whole = _raw(server.url + event["payload_url"])
    assert (status, kind.split(";")[0], whole.decode()) == (200, "application/json", text)
    (conflict,) = body["conflicts"]
    assert "payload" not in conflict and conflict["payload_size"] == len(conflict_text)
    assert _raw(server.url + conflict["payload_url"])[2].decode() == conflict_text
    alone = _get(f"{server.url}/api/run/conflict?run=r&id={conflict['id']}")[2]["conflict"]
    assert alone["payload_preview"] == conflict_text[:PAYLOAD_PREVIEW_CHARS]
    detail = _get(f"{server.url}/api/run/event?run=r&agent=a&seq=2")[2]["event"]
    assert json.loads(detail["payload"]) == {"tool": "t", "result": "short"}
    assert "payload_preview" not in detail
    assert _get(f"{server.url}/api/run/payload?run=r&agent=a&seq=9")[0] == 404
    assert _get(f"{server.url}/api/run/payload?run=r&conflict=999")[0] == 404
    assert _get(f"{server.url}/api/run/payload?run=nope&agent=a&seq=1")[0] == 404


@pytest.mark.storage
def test_errors_are_json_with_status(server):
    """Unknown runs are 404, bad parameters 400, both as JSON with one message."""
    status, _, body = _get(f"{server.url}/api/run?run=nope")
    assert status == 404 and "nope" in body["error"]
    assert _get(f"{server.url}/api/run/labels?run=x&from=a&to=2")[0] == 400
    assert _get(f"{server.url}/api/run")[0] == 400
    status, _, body = _get(f"{server.url}/api/run/event?run=x&agent=a&seq={2**70}")
    assert status == 404 and body["error"]  # beyond bigint: no such event, not a crash


@pytest.mark.storage
def test_every_run_endpoint_answers_404_for_a_run_that_is_not_stored(server, pg_dsn):
    """/api/run, its version, labels, event and conflict answer 404 with a JSON message for a
    run that is not stored (as its page does), and 200 for one that is."""
    write_batches(pg_dsn, [Batch(events=(_event("r", "a", 1, "agent_start", {}),))])
    for endpoint in ("run?", "run/version?", "run/labels?from=0&to=9&"):
        assert _get(f"{server.url}/api/{endpoint}run=r")[0] == 200, endpoint
    for endpoint in (
        "run?",
        "run/version?",
        "run/labels?from=0&to=9&",
        "run/event?agent=a&seq=1&",
        "run/conflict?id=1&",
    ):
        status, _, body = _get(f"{server.url}/api/{endpoint}run=nope")
        assert (status, "'nope'" in body.get("error", "")) == (404, True), (endpoint, body)


@pytest.mark.storage
def test_a_nul_in_a_text_parameter_is_400_not_a_database_error(server, pg_dsn):
    """A run id, agent id or filter holding NUL (which PostgreSQL text cannot hold) names
    nothing stored: 400 with a message, never a 500."""
    write_batches(pg_dsn, [Batch(events=(_event("r", "a", 1, "agent_start", {}),))])
    for path in (
        "/api/runs?q=%00",
        "/api/run?run=r%00",
        "/api/run/version?run=%00",
        "/api/run/labels?run=r&from=0&to=9&agent=a%00",
        "/api/run/event?run=r&agent=a%00&seq=1",
        "/api/run/conflict?run=%00&id=1",
    ):
        status, _, body = _get(f"{server.url}{path}")
        assert (status, "NUL" in body["error"]) == (400, True), (path, status, body)
    assert _get(f"{server.url}/api/run/event?run=r&agent=a&seq=1")[0] == 200


@pytest.mark.storage
def test_the_page_of_a_run_that_is_not_stored_is_a_404(server, pg_dsn):
    """/runs/ID answers 404 (the page, which then shows the API's message) when no such run is
    stored, for an empty or NUL-holding id too, and 200 for a stored run."""
    write_batches(pg_dsn, [Batch(events=(_event("a/b", "a", 1, "agent_start", {}),))])
    assert _get(f"{server.url}/runs/a%2Fb")[0] == 200
    assert _get(f"{server.url}/runs/a/b")[0] == 200
    assert _get(f"{server.url}/runs/?run=a/b")[0] == 200  # the form of ids "." and ".."
    assert _get(f"{server.url}/runs/?run=nope")[0] == 404
    for path in ("/runs/nope", "/runs/", "/runs/a%00", "/runs/%E0"):
        status, headers, body = _get(f"{server.url}{path}")
        assert (status, headers["content-type"].split(";")[0]) == (404, "text/html"), path
        assert 'id="run-title"' in body


def test_database_down_is_503(tmp_path):
    """With the database unreachable the API answers 503 quickly, and pages still load."""
    config = ViewerConfig(dsn="postgresql://postgres@127.0.0.1:1/x", connect_timeout=1)
    with ViewerServer(config) as running:
        status, _, body = _get(f"{running.url}/api/runs")
        assert status == 503 and "unavailable" in body["error"]
        assert _get(f"{running.url}/")[0] == 200


@pytest.mark.storage
@pytest.mark.fault
def test_a_connection_the_server_closed_while_idle_is_not_a_503(pg_dsn):
    """With the view's pooled connections closed by the server while idle (as
    idle_session_timeout or a restart does), the next request is answered from a new connection,
    not with 503 "the event log is unavailable"."""
    with ViewerServer(ViewerConfig(dsn=pg_dsn)) as running:
        assert _get(f"{running.url}/api/runs")[0] == 200
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            ours = (
                "FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            )
            assert admin.execute(f"SELECT count(*) {ours}").fetchone() != (0,)
            admin.execute(f"SELECT pg_terminate_backend(pid) {ours}")
            deadline = time.monotonic() + 30
            while admin.execute(f"SELECT count(*) {ours}").fetchone() != (0,):
                assert time.monotonic() < deadline, "the backends did not end"
                time.sleep(0.05)
        status, _, body = _get(f"{running.url}/api/runs")
        assert status == 200, body


@pytest.mark.storage
def test_a_locked_log_is_503_saying_so(pg_dsn):
    """A request whose query waits for a lock another session holds on the log (a migration,
    DDL) answers 503 after the view's lock_timeout, saying why, and the next one, once the lock
    is gone, is answered."""
    with ViewerServer(ViewerConfig(dsn=pg_dsn, lock_timeout=0.2)) as running:
        with psycopg.connect(pg_dsn) as holder:
            holder.execute("LOCK TABLE agentcap.runs, agentcap.events IN ACCESS EXCLUSIVE MODE")
            for path in ("/api/runs", "/api/run?run=r"):
                status, _, body = _get(f"{running.url}{path}")
                assert status == 503, path
                assert "another session holds a lock on it" in body["error"], path
        assert _get(f"{running.url}/api/runs")[0] == 200


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
    config = ViewerConfig(dsn=pg_dsn, authenticator=Authenticator([(TOKEN, None)]))
    with ViewerServer(config) as running:
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


@pytest.mark.storage
def test_a_login_body_larger_than_a_token_form_is_refused_unread(pg_dsn):
    """POST /login answers 413 as soon as the body is longer than a token form can be, without
    waiting for (or holding) the rest, and a token form still signs in."""
    config = ViewerConfig(dsn=pg_dsn, authenticator=Authenticator([(TOKEN, None)]))
    with (
        ViewerServer(config) as running,
        socket.create_connection((running.host, running.port), timeout=10) as sock,
    ):
        sock.sendall(
            b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n"
            + f"Content-Length: {1 << 30}\r\n\r\n".encode()
            + b"token="
            + b"a" * (64 * 1024)
        )
        head = sock.recv(64)  # before the fix: no answer until the gigabyte arrives (timeout)
        assert head.startswith(b"HTTP/1.1 413"), head
        assert _login(running.url, TOKEN).startswith("agentcap_session=")


def _login(url: str, token: str) -> str:
    """The session cookie (name=value) that /login sets for ``token``."""
    request = urllib.request.Request(f"{url}/login", data=f"token={token}".encode(), method="POST")
    opener = urllib.request.build_opener(_NoRedirect)
    with pytest.raises(urllib.error.HTTPError) as answer:
        opener.open(request, timeout=10)
    assert answer.value.code == 303
    return str(answer.value.headers["set-cookie"]).split(";", 1)[0]


@pytest.mark.storage
def test_a_token_bound_to_runs_reads_those_runs_only(pg_dsn):
    """A token scoped to runs (the ingest's token file format) lists only those runs, and every
    run endpoint answers for another run as for one that is not stored, with a bearer token or
    its login cookie; an unscoped token sees every run."""
    for run_id in ("team-a/1", "team-a/2", "team-b/1", "other"):
        write_batches(pg_dsn, synthetic_run(run_id, 30, agents=3))
    authenticator = Authenticator([(TOKEN, None), (TEAM, "team-a/*"), (TEAM, "other")])
    with ViewerServer(ViewerConfig(dsn=pg_dsn, authenticator=authenticator)) as running:
        url = running.url
        team = {"Authorization": f"Bearer {TEAM}"}
        for headers in (team, {"Cookie": _login(url, TEAM)}):
            listed = _get(f"{url}/api/runs", headers)[2]["runs"]
            assert sorted(r["run_id"] for r in listed) == ["other", "team-a/1", "team-a/2"]
            searched = _get(f"{url}/api/runs?q=team", headers)[2]["runs"]
            assert sorted(r["run_id"] for r in searched) == ["team-a/1", "team-a/2"]
            assert _get(f"{url}/api/run?run=team-a/1", headers)[0] == 200
            for endpoint in (
                "run?",
                "run/version?",
                "run/labels?from=1&to=9&",
                "run/event?agent=root&seq=1&",
                "run/conflict?id=1&",
            ):
                hidden = _get(f"{url}/api/{endpoint}run=team-b/1", headers)
                unknown = _get(f"{url}/api/{endpoint}run=team-b/none", headers)
                assert hidden[0] == 404, endpoint
                assert hidden[2]["error"].replace("team-b/1", "R") == unknown[2]["error"].replace(
                    "team-b/none", "R"
                ), endpoint
            assert _get(f"{url}/runs/team-b/1", headers)[0] == 404
            assert _get(f"{url}/runs/team-a/1", headers)[0] == 200
        admin = _get(f"{url}/api/runs", {"Authorization": f"Bearer {TOKEN}"})[2]["runs"]
        assert len(admin) == 4
        assert _get(f"{url}/api/run?run=team-b/1", {"Cookie": _login(url, TOKEN)})[0] == 200


@pytest.mark.storage
def test_concurrent_requests_with_different_tokens_each_see_their_own_runs(pg_dsn):
    """Requests with a scoped and an unscoped token at once, over kept-alive connections, each
    get the runs of their own token (the principal is the request's, never shared)."""
    from concurrent.futures import ThreadPoolExecutor

    for run_id in ("team-a/1", "team-b/1"):
        write_batches(pg_dsn, synthetic_run(run_id, 20, agents=2))
    authenticator = Authenticator([(TOKEN, None), (TEAM, "team-a/*")])
    config = ViewerConfig(dsn=pg_dsn, authenticator=authenticator, pool_size=8)
    with ViewerServer(config) as running:

        def client(token: str) -> set[tuple[str, ...]]:
            seen = set()
            conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
            try:
                for _ in range(15):
                    conn.request("GET", "/api/runs", headers={"Authorization": f"Bearer {token}"})
                    runs = json.loads(conn.getresponse().read())["runs"]
                    seen.add(tuple(sorted(r["run_id"] for r in runs)))
            finally:
                conn.close()
            return seen

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(client, [TOKEN, TEAM] * 4))
    for token, seen in zip([TOKEN, TEAM] * 4, results, strict=True):
        expected = ("team-a/1", "team-b/1") if token == TOKEN else ("team-a/1",)
        assert seen == {expected}, token


def test_non_loopback_address_needs_a_token():
    """Serving beyond loopback without a token is refused before anything is bound."""
    with pytest.raises(TokenConfigError, match="AGENTCAP_UI_TOKENS"):
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


def test_https_with_a_certificate(tmp_path):
    """With a certificate the view speaks HTTPS only, its login cookie is Secure, and plain HTTP
    gets no page."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    config = ViewerConfig(
        dsn="postgresql://postgres@127.0.0.1:1/x",
        authenticator=Authenticator([(TOKEN, None)]),
        tls=TlsConfig(str(cert), str(key)),
    )
    with ViewerServer(config) as running:
        assert running.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", running.port, context=context, timeout=30)
        conn.request(
            "POST",
            "/login",
            f"token={TOKEN}",
            {"Content-Type": "application/x-www-form-urlencoded", "Host": "localhost"},
        )
        answer = conn.getresponse()
        assert answer.status == 303 and "Secure" in answer.headers["set-cookie"]
        conn.close()
        with socket.create_connection(("127.0.0.1", running.port), timeout=5) as plain:
            plain.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                assert not plain.recv(100).startswith(b"HTTP/1.1 2")
        assert running.warnings() == []
