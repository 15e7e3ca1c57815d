"""The collector path: OTLP encoding and decoding, a real rotel collector, the OTLP ingest server."""

from __future__ import annotations

import gzip
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http import HTTPStatus
from pathlib import Path

import psycopg
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from otlp_support import captured

from otel_agentcap.ingest import OtlpIngestServer, spans_from_otlp
from otel_agentcap.ingest.service import IngestStats, Outcome, RetryLater
from otel_agentcap.model import Batch
from otel_agentcap.pipeline.mapping import batch_from_spans
from otel_agentcap.tokens import ANONYMOUS

pytestmark = [pytest.mark.collector, pytest.mark.storage]

ROOT = Path(__file__).resolve().parent.parent
ROTEL_ENV = ROOT / "collector-config" / "rotel.env"


def _rotel_binary() -> Path:
    rotel = pytest.importorskip("rotel")
    binary = Path(rotel.__file__).parent / "rotel-agent"
    if not binary.exists():
        pytest.skip("the rotel wheel has no rotel-agent binary for this platform")
    return binary


def _canonical(batch: Batch) -> tuple[list[object], list[object], list[object]]:
    """The batch with its rows sorted (OTLP groups spans by scope, so their order changes)."""
    return (
        sorted(batch.events, key=lambda e: (e.run_id, e.agent_id, e.seq, e.event_id)),
        sorted(batch.agents, key=repr),
        sorted(batch.runs, key=repr),
    )


def _count(dsn: str, query: str, *params: object) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(url: str, body: bytes, *, gzipped: bool = False) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/x-protobuf"}
    if gzipped:
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rotel exited early with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"rotel did not listen on port {port} within {timeout} s")


def _wait_for_count(dsn: str, expected: int, run_id: str, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    query = "SELECT count(*) FROM agentcap.events WHERE run_id = %s"
    count = _count(dsn, query, run_id)
    while count < expected and time.monotonic() < deadline:
        time.sleep(0.1)
        count = _count(dsn, query, run_id)
    return count


def _stats_after(server: OtlpIngestServer, events: int, timeout: float = 15.0) -> IngestStats:
    """The server's counters once they count ``events`` inserted: a request's rows are visible
    in the database (its commit) a moment before the server counts them (CI at PostgreSQL 15:
    11 events in the log, 0 counted)."""
    deadline = time.monotonic() + timeout
    stats = server.stats()
    while stats.events_inserted < events and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = server.stats()
    return stats


def _rotel_env(
    tmp_path: Path, ingest_port: int, grpc_port: int, http_port: int, extra: dict[str, str]
) -> dict[str, str]:
    """collector-config/rotel.env as shipped, with loopback ports of this test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTEL_")}
    for line in ROTEL_ENV.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    env.update(
        ROTEL_OTLP_GRPC_ENDPOINT=f"127.0.0.1:{grpc_port}",
        ROTEL_OTLP_HTTP_ENDPOINT=f"127.0.0.1:{http_port}",
        ROTEL_EXPORTER_AGENTCAP_ENDPOINT=f"http://127.0.0.1:{ingest_port}",
        ROTEL_EXPORTER_JAEGER_ENDPOINT=f"http://127.0.0.1:{_free_port()}",  # unused: not routed
        ROTEL_PID_FILE=str(tmp_path / "rotel.pid"),
        ROTEL_LOG_FILE=str(tmp_path / "rotel.log"),
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    env.update(extra)
    return env


@pytest.fixture()
def rotel_to(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start rotel (from the wheel, with rotel.env) forwarding to an ingest port; yields a starter
    that returns rotel's OTLP/HTTP receiver URL; rotel is always killed at teardown."""
    binary = _rotel_binary()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def start(ingest_port: int, **extra: str) -> str:
        grpc_port, http_port = _free_port(), _free_port()
        log = tmp_path / f"rotel-{len(procs)}.out"
        logs.append(log)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(binary), "start"],
                env=_rotel_env(tmp_path, ingest_port, grpc_port, http_port, extra),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        procs.append(proc)
        try:
            _wait_for_port(http_port, proc)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}\n{log.read_text(errors='replace')}") from exc
        return f"http://127.0.0.1:{http_port}/v1/traces"

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def test_otlp_round_trip_maps_to_the_same_batch():
    """SDK spans encoded as an OTLP request and decoded again map to exactly the same batch."""
    spans, expected = captured("run-otlp-pure")
    request = encode_spans(spans)
    original = batch_from_spans(spans)
    decoded = batch_from_spans(spans_from_otlp(request.SerializeToString()))
    assert len(original.events) == expected
    assert {e.event_type for e in original.events} >= {
        "agent_start",
        "agent_end",
        "agent_spawn",
        "memory_write",
        "memory_read",
        "tool_invocation",
        "tool_result",
        "agent_error",
    }
    assert _canonical(decoded) == _canonical(original)
    assert _canonical(batch_from_spans(spans_from_otlp(request))) == _canonical(original)


def test_spans_through_rotel_land_in_postgres(pg_dsn, rotel_to):
    """Spans exported over OTLP/HTTP to rotel and forwarded to the ingest are stored once each."""
    spans, expected = captured("run-rotel")
    with OtlpIngestServer(pg_dsn, port=0) as server:
        url = rotel_to(server.port)
        exporter = OTLPSpanExporter(endpoint=url, timeout=5)
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        assert _wait_for_count(pg_dsn, expected, "run-rotel") == expected
        stats = _stats_after(server, expected)
    assert stats.events_inserted == expected
    assert stats.conflicts == 0
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.conflicts") == 0
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.agents WHERE run_id = 'run-rotel'") == 2


def _lose_first_ack(server: OtlpIngestServer) -> None:
    """Make ``server`` store the first request but answer it 503, as if the acknowledgement were
    lost."""
    process = server.service.process
    failed: list[bool] = []

    def first_answer_lost(request, principal=ANONYMOUS):
        outcome = process(request, principal)
        if not failed:
            failed.append(True)
            raise RetryLater("acknowledgement lost", 1)
        return outcome

    server.service.process = first_answer_lost  # type: ignore[method-assign]


def test_rotel_redelivery_after_lost_ack_stores_each_event_once(pg_dsn, rotel_to):
    """rotel retries a request whose answer was 503 after it was stored: no event is stored twice."""
    spans, expected = captured("run-redeliver")
    with OtlpIngestServer(pg_dsn, port=0) as server:
        _lose_first_ack(server)
        url = rotel_to(server.port)
        exporter = OTLPSpanExporter(endpoint=url, timeout=5)
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        deadline = time.monotonic() + 15
        # Until the redelivered request is processed (it is counted when it arrives).
        while server.stats().batches < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = server.stats()
    assert stats.requests >= 2, "rotel did not redeliver"
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.events") == expected
    assert stats.events_inserted == expected
    assert stats.duplicates == expected
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.conflicts") == 0


def test_ingest_redelivery_is_deduplicated(pg_dsn):
    """The same OTLP request posted twice (plain, then gzip) stores each event once."""
    spans, expected = captured("run-twice")
    body = encode_spans(spans).SerializeToString()
    with OtlpIngestServer(pg_dsn, port=0) as server:
        first = _post(server.endpoint, body)
        second = _post(server.endpoint, body, gzipped=True)
        stats = server.stats()
    for status, payload in (first, second):
        assert status == 200
        ExportTraceServiceResponse().ParseFromString(payload)
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.events") == expected
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.conflicts") == 0
    assert (stats.requests, stats.batches) == (2, 2)
    assert stats.events_inserted == expected
    assert stats.duplicates == expected


def test_ingest_answers_503_when_the_database_is_unreachable():
    """A write that fails because PostgreSQL is down answers 503, so the collector retries."""
    spans, _ = captured("run-down")
    body = encode_spans(spans).SerializeToString()
    dsn = f"postgresql://agentcap@127.0.0.1:{_free_port()}/agentcap?connect_timeout=1"
    with OtlpIngestServer(dsn, port=0, connect_timeout=0.5) as server:
        status, _ = _post(server.endpoint, body)
        stats = server.stats()
    assert status == 503
    assert stats.failed_requests == 1
    assert stats.events_inserted == 0


def test_ingest_rejects_what_it_can_never_store(pg_dsn):
    """An undecodable body or an unsupported encoding is answered 4xx (not retried)."""
    with OtlpIngestServer(pg_dsn, port=0) as server:
        garbage = _post(server.endpoint, b"\xff\xff\xff not protobuf")
        wrong_path = _post(server.endpoint.replace("/v1/traces", "/v1/logs"), b"")
        stats = server.stats()
    assert garbage[0] == 400
    assert wrong_path[0] == 404
    assert stats.rejected_requests == 2
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.events") == 0


def test_ingest_command_stores_posted_spans_and_reports_its_counters(pg_dsn):
    """``otel-agentcap ingest --json`` serves until interrupted, stores what is posted, and prints
    its counters on the way out."""
    import json
    import signal
    import sys

    run_id = "run-ingest-cli"
    spans, expected = captured(run_id)
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "otel_agentcap.cli",
            "ingest",
            "--dsn",
            pg_dsn,
            "--port",
            str(port),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_for_port(port, proc)
        status, _ = _post(
            f"http://127.0.0.1:{port}/v1/traces", encode_spans(spans).SerializeToString()
        )
        assert status == HTTPStatus.OK
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    assert f"accepting OTLP/HTTP traces at http://127.0.0.1:{port}/v1/traces" in err.decode()
    stats = json.loads(out)
    assert (stats["requests"], stats["events_inserted"]) == (1, expected)
    assert (
        _count(pg_dsn, "SELECT count(*) FROM agentcap.events WHERE run_id = %s", run_id) == expected
    )


_TWO_PROCESS_RUN = """
import asyncio
import sys

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import otel_agentcap as ac
from otel_agentcap.configure import configure

dsn, run_id, url, phase = sys.argv[1:5]
provider = configure(
    dsn,
    announce=False,
    service_name="otel-agentcap" if phase == "first" else "otel-agentcap-worker",
    span_processors=[BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=10))],
)
memory = ac.Memory("notes")


@ac.tool
def lookup(topic: str) -> str:
    return f"about {topic}"


if phase == "first":
    with ac.run(run_id):

        def intake() -> None:
            with ac.agent("intake"):
                memory["topic"] = "clocks"

        with ac.ContextThreadPoolExecutor(1) as pool:  # a top-level agent in a thread
            pool.submit(intake).result()
        with ac.agent("planner") as planner:
            topic = memory["topic"]  # the intake's write is its causal parent
            plan = memory.set("plan", [topic])
            threaded = planner.spawn("researcher", key="thread")
            threaded.run(lambda: memory.set("found:thread", lookup.invoke("l1", topic)), timeout=30)

            async def in_a_task() -> None:
                child = planner.spawn("researcher", key="task")

                async def work() -> None:
                    with ac.caused_by(plan):
                        memory["found:task"] = lookup(topic)

                await child.arun(work, timeout=30)

            asyncio.run(in_a_task())
            planner.spawn("researcher", key="later")  # run by the second process
else:
    with ac.run(run_id, resume=True), ac.agent("planner") as planner:
        later = planner.spawn("researcher", key="later")  # found in the log
        later.run(lambda: memory.set("found:later", lookup.invoke("l2", memory.get("plan"))))
provider.shutdown()
"""


class _RecordingServer(OtlpIngestServer):
    """Keeps every OTLP request rotel forwards, as sent, and stores nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.bodies: list[bytes] = []
        lock = threading.Lock()

        def record(request, principal=ANONYMOUS):
            with lock:
                self.bodies.append(bytes(request.body))
            return Outcome(received=request.count)

        self.service.process = record  # type: ignore[method-assign]


def _received_spans(server: _RecordingServer, run_id: str) -> list[dict[str, object]]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from otel_agentcap.ingest.otlp import decode_attributes

    spans = []
    for body in list(getattr(server, "bodies", [])):
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            resource = decode_attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = decode_attributes(span.attributes)
                    if attributes.get("agentcap.run.id") != run_id:
                        continue
                    spans.append(
                        {
                            "name": span.name,
                            "trace": span.trace_id.hex(),
                            "id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex() or None,
                            "service": resource.get("service.name"),
                            "attributes": attributes,
                            "links": [
                                (link.span_id.hex(), decode_attributes(link.attributes))
                                for link in span.links
                            ],
                        }
                    )
    return spans


@pytest.mark.multiprocess
def test_a_run_across_agents_threads_tasks_and_processes_is_one_trace(pg_dsn, rotel_to):
    """Two top-level agents, threads, an asyncio task and a second process continuing the run
    (its spawn found in the log), exported as OTLP through rotel: one trace with one root, every
    child invoke_agent under its create_agent, every causal parent a link to its span."""
    import json
    import sys

    from otel_agentcap import attributes as attr

    run_id = "run-two-processes"
    with _RecordingServer(pg_dsn, port=0) as server:
        url = rotel_to(server.port)
        for phase in ("first", "second"):
            done = subprocess.run(
                [sys.executable, "-c", _TWO_PROCESS_RUN, pg_dsn, run_id, url, phase],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
        expected = 1 + _count(
            pg_dsn, "SELECT count(DISTINCT span_id) FROM agentcap.events WHERE run_id = %s", run_id
        )
        deadline = time.monotonic() + 30
        spans = _received_spans(server, run_id)
        while len(spans) < expected and time.monotonic() < deadline:
            time.sleep(0.2)
            spans = _received_spans(server, run_id)
    assert len(spans) == expected
    assert len({s["trace"] for s in spans}) == 1
    assert {s["service"] for s in spans} == {"otel-agentcap", "otel-agentcap-worker"}
    by_id = {s["id"]: s for s in spans}
    roots = [s for s in spans if s["parent"] is None]
    assert [r["name"] for r in roots] == [f"invoke_workflow {run_id}"]
    assert all(s["parent"] in by_id for s in spans if s is not roots[0])
    # Every child's invoke_agent is a child of the create_agent span that spawned it.
    children = [s for s in spans if attr.PARENT_AGENT_ID in s["attributes"]]
    assert len(children) == 3
    for child in children:
        parent = by_id[child["parent"]]
        assert parent["attributes"][attr.GEN_AI_OPERATION_NAME] == "create_agent"
        assert parent["attributes"][attr.CHILD_AGENT_ID] == child["attributes"][attr.AGENT_ID]
    later = next(c for c in children if c["attributes"][attr.AGENT_ID] == "planner/later")
    assert later["service"] == "otel-agentcap-worker"
    assert by_id[later["parent"]]["service"] == "otel-agentcap"
    # Every causal parent of every event is a link to the span that carries the parent.
    span_of: dict[str, str] = {}
    parents_of: list[tuple[str, str]] = []
    for span in spans:
        records = [span["attributes"]]
        outcome = span["attributes"].get(attr.OUTCOME)
        if outcome:
            record = json.loads(outcome)
            span_of[record["id"]] = span["id"]
            parents_of += [(span["id"], p) for p in record["parents"]]
        for record in records:
            if attr.EVENT_ID in record:
                span_of[record[attr.EVENT_ID]] = span["id"]
                parents_of += [
                    (span["id"], p) for p in record.get(attr.EVENT_CAUSAL_PARENT_IDS, ())
                ]
    crossing = 0
    for span_id, parent in parents_of:
        assert parent in span_of, parent
        if span_of[parent] == span_id:
            continue  # a tool's result and its invocation share the span
        crossing += 1
        links = {(target, a.get(attr.LINK_EVENT_ID)) for target, a in by_id[span_id]["links"]}
        assert (span_of[parent], parent) in links, (by_id[span_id]["name"], parent)
    assert crossing >= 6


def test_bad_and_forged_spans_through_rotel_do_not_hold_up_good_ones(pg_dsn, rotel_to):
    """Malformed and forged spans batched with good ones through rotel: every good span is
    stored at once, the bad ones are rejected alone (partial success, which rotel does not
    retry), and nothing stored is changed."""
    from otlp_support import event_span, forged

    runs = [f"run-rotel-mixed-{i}" for i in range(5)]
    good: list[ReadableSpan] = []
    expected = 0
    for run_id in runs:
        spans, events = captured(run_id)
        good += spans
        expected += events
    write = next(s for s in good if s.name == "memory_write")
    tool = next(s for s in good if s.name == "execute_tool double")
    bad = [
        forged(write, agentcap__event__seq="not a number"),
        forged(write, agentcap__event__id="not-a-uuid"),
        event_span(write, runs[0], "planner", "far", 2**63 - 1),
        forged(tool, agentcap__run__id="run-attacker", agentcap__event__payload='{"x": 1}'),
        forged(write, drop=tuple(k for k in (write.attributes or {}) if k != "agentcap.event.id")),
    ]
    mixed = list(good)
    for i, span in enumerate(bad):  # spread among the good spans
        mixed.insert(1 + i * 7, span)
    with OtlpIngestServer(pg_dsn, port=0) as server:
        url = rotel_to(server.port)
        exporter = OTLPSpanExporter(endpoint=url, timeout=5)
        try:
            assert exporter.export(mixed) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        stored = sum(_wait_for_count(pg_dsn, 1, run_id) for run_id in runs)
        deadline = time.monotonic() + 15
        while stored < expected and time.monotonic() < deadline:
            time.sleep(0.1)
            stored = _count(pg_dsn, "SELECT count(*) FROM agentcap.events")
        time.sleep(1.5)  # room for a retry, were rotel to retry
        stats = server.stats()
    assert stored == expected
    assert stats.spans_rejected == len(bad)
    assert (stats.failed_requests, stats.rejected_requests) == (0, 0)  # nothing for rotel to retry
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.conflicts") == 0
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-attacker'") == 0


def test_rotel_sends_the_bearer_token_the_ingest_requires(pg_dsn, rotel_to):
    """With a token required, rotel configured with the token in its exporter headers stores
    every event (ROTEL_EXPORTER_AGENTCAP_CUSTOM_HEADERS)."""
    from otel_agentcap.ingest import Authenticator

    token = "rotel-token-0123456789"
    spans, expected = captured("run-rotel-token")
    authenticator = Authenticator([(token, "run-rotel-*")])
    with OtlpIngestServer(pg_dsn, port=0, authenticator=authenticator) as server:
        url = rotel_to(
            server.port, ROTEL_EXPORTER_AGENTCAP_CUSTOM_HEADERS=f"authorization=Bearer {token}"
        )
        exporter = OTLPSpanExporter(endpoint=url, timeout=5)
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        assert _wait_for_count(pg_dsn, expected, "run-rotel-token") == expected
        stats = _stats_after(server, expected)
    assert stats.unauthorized_requests == 0
