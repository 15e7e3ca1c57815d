"""configure(): one call gives the full record, including the edges only instrumentation sees;
what the user must fix fails at once, a server that is down does not; the AgentCap handle owns
what it set up, reports one set of figures, and keeps the old ways working."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from anthropic_support import expected_tool_use_ids, needs_sdk_tracing, stored_events
from opentelemetry.sdk.trace import TracerProvider
from psycopg.conninfo import make_conninfo

from otel_agentcap.capture.agents import spawn_registry
from otel_agentcap.capture.ledger import tool_ledger
from otel_agentcap.capture.runs import run_registry
from otel_agentcap.capture.tool_uses import sdk_tools_exactly_once
from otel_agentcap.clock import clocks
from otel_agentcap.configure import AgentCap, configure, exporter_of
from otel_agentcap.errors import ConfigurationError
from otel_agentcap.exporters.postgres import PostgresToolLedger, embedded
from otel_agentcap.exporters.postgres.errors import ConnectionFailed
from otel_agentcap.exporters.postgres.memory import default_database
from otel_agentcap.testing.messages_server import (
    MessagesServer,
    ToolCall,
    text_reply,
    tool_use_reply,
)

# A model call asks for a tool, the tool runs, the next call sends its result back: the edge
# tool_result -> model_call is only known to the request wrapper AnthropicInstrumentor installs.
_CHAIN = textwrap.dedent(
    """
    import json, sys
    import anthropic
    import otel_agentcap as ac
    from otel_agentcap.configure import configure, exporter_of

    dsn, base_url, run_id, instrument = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    provider = configure(dsn, batch=False, announce=False, instrument=instrument)
    client = anthropic.Anthropic(base_url=base_url, api_key="test", max_retries=0)

    @ac.tool
    def weather(city: str) -> str:
        return f"sunny in {city}"

    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    with ac.run(run_id), ac.agent("assistant"):
        first = client.messages.create(model="m", max_tokens=64, messages=messages)
        results = ac.run_tool_uses(first, [weather])
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": results},
        ]
        client.messages.create(model="m", max_tokens=64, messages=messages)
    provider.shutdown()
    print(json.dumps(exporter_of(provider).stats().__dict__))
    """
)


def _run_chain(dsn: str, run_id: str, *, instrument: bool) -> None:
    with MessagesServer() as server:
        server.enqueue(
            tool_use_reply([ToolCall("weather", {"city": "Oslo"}, id="toolu_cfg")]),
            text_reply("It is sunny."),
        )
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _CHAIN,
                dsn,
                server.base_url,
                run_id,
                "1" if instrument else "0",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["events_failed"] == 0


@pytest.mark.storage
@pytest.mark.multiprocess
def test_configure_alone_records_the_tool_to_model_edge(pg_dsn):
    """With configure() and nothing else, the model call that reads a tool result names it."""
    _run_chain(pg_dsn, "run-configure", instrument=True)
    events = stored_events(pg_dsn, "run-configure")
    by_id = {e["event_id"]: e for e in events}
    calls = sorted((e for e in events if e["event_type"] == "model_call"), key=lambda e: e["seq"])
    assert len(calls) == 2
    assert calls[0]["payload"]["tool_use_ids"] == expected_tool_use_ids("toolu_cfg")
    assert [by_id[p]["event_type"] for p in calls[1]["parents"]] == ["tool_result"]
    assert by_id[calls[1]["parents"][0]]["payload"]["invocation_id"] == "toolu_cfg"


@pytest.mark.storage
@pytest.mark.multiprocess
@needs_sdk_tracing  # an older SDK records no span at all without the instrumentation
def test_configure_instrument_false_leaves_the_sdk_alone(pg_dsn):
    """instrument=False opts out: the SDK is not wrapped, so the edge is not recorded."""
    _run_chain(pg_dsn, "run-no-instrument", instrument=False)
    events = stored_events(pg_dsn, "run-no-instrument")
    calls = sorted((e for e in events if e["event_type"] == "model_call"), key=lambda e: e["seq"])
    assert len(calls) == 2
    assert calls[1]["parents"] == []


#: configure() inside the test process: neither the global provider nor the anthropic SDK (which
#: other tests expect uninstrumented) is touched.
_IN_PROCESS: dict[str, bool] = {"set_global": False, "instrument": False}


def test_a_dsn_that_does_not_parse_fails_at_once(tmp_path):
    """An unparsable DSN is one clear ConfigurationError, raised before anything is set up."""
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match="invalid PostgreSQL DSN"):
        configure("postgresql://u@[bad/db", queue_dir=tmp_path, **_IN_PROCESS)
    with pytest.raises(ConfigurationError, match="invalid"):
        configure("host=x bogus_option=1", queue_dir=tmp_path, **_IN_PROCESS)
    assert time.monotonic() - started < 2
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("dsn", 5),
        ("writers", "2"),
        ("writers", 0),
        ("writers", 2.5),
        ("fsync", "sometimes"),
        ("overflow", "explode"),
        ("max_queue_bytes", "1GiB"),
        ("max_queue_bytes", 1024),
        ("block_timeout", "2"),
        ("block_timeout", 0),
        ("shutdown_timeout", "10"),
        ("shutdown_timeout", -1),
        ("connect_timeout", "5"),
        ("connect_timeout", 0),
        ("queue_size", -5),
        ("queue_size", "10"),
        ("queue_size", True),
        ("span_processors", None),
        ("span_processors", [object()]),
        ("resource", {"service.name": "x"}),
        ("service_name", 5),
        ("queue_dir", 5),
        ("sdk_tools_exactly_once", "yes"),
    ],
)
def test_an_option_of_the_wrong_type_or_range_fails_at_once(tmp_path, option, value):
    """A wrong option is one ConfigurationError naming it, raised before anything is set up (no
    thread, no connection, no queue), not a TypeError from deep inside, nor accepted to fail
    when spans are recorded or at shutdown."""
    before = set(threading.enumerate())
    options: dict[str, Any] = {"queue_dir": tmp_path, "announce": False, **_IN_PROCESS}
    options[option] = value
    with pytest.raises(ConfigurationError, match=option):
        configure(**({"dsn": "postgresql://u@127.0.0.1:1/db"} | options))
    assert set(threading.enumerate()) <= before
    assert not list(tmp_path.iterdir())


@pytest.mark.storage
@pytest.mark.parametrize("what", ["database", "role"])
def test_a_database_or_role_that_does_not_exist_fails_at_once(pg_server_dsn, tmp_path, what):
    """A database or a role that does not exist (or a failed authentication) is the user's to
    fix: ConfigurationError."""
    dsn = (
        embedded.dsn_for(pg_server_dsn, "no_such_database")
        if what == "database"
        else make_conninfo(pg_server_dsn, user="no_such_role")
    )
    # Over a password-checked connection a role that does not exist fails authentication.
    with pytest.raises(ConfigurationError, match=r"does not exist|authentication failed"):
        configure(dsn, queue_dir=tmp_path, **_IN_PROCESS)


def test_ssl_required_of_a_server_without_it_fails_at_once(tmp_path):
    """sslmode=require against a server that answers the SSL request with "no" (as PostgreSQL
    with ssl = off does) is the user's to fix, not a server that is down: ConfigurationError,
    which says so."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer_no() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    while len(conn.recv(8)) == 8:  # SSLRequest, GSSENCRequest: "N"
                        conn.sendall(b"N")

    threading.Thread(target=answer_no, daemon=True).start()
    port = listener.getsockname()[1]
    try:
        with pytest.raises(ConfigurationError, match="does not support SSL"):
            configure(
                f"host=127.0.0.1 port={port} user=u dbname=d sslmode=require",
                queue_dir=tmp_path,
                **_IN_PROCESS,
            )
    finally:
        listener.close()


@pytest.mark.fault
def test_a_server_that_is_down_is_absorbed_with_one_line(tmp_path, caplog):
    """No server listening: configure returns (the queue absorbs the outage), says so in one
    line, and the handle shuts down within its timeout."""
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        agentcap = configure("postgresql://u@127.0.0.1:1/db", queue_dir=tmp_path, **_IN_PROCESS)
        took = time.monotonic() - started
        agentcap.shutdown(timeout=1)
    assert took < 8
    assert caplog.text.count("not reachable at start") == 1
    assert "Traceback" not in caplog.text


@pytest.mark.storage
@pytest.mark.fault
def test_a_server_that_answers_nothing_is_treated_as_down(pg_dsn, tmp_path, caplog):
    """A server that accepts the connection but does not answer the schema check (a lock held
    on agentcap.schema_version, say) is treated as down after connect_timeout: configure
    returns and says so in one line rather than wait for as long as the lock is held."""
    locker = psycopg.connect(pg_dsn)
    locker.execute("LOCK TABLE agentcap.schema_version IN ACCESS EXCLUSIVE MODE")
    made: list[AgentCap] = []
    with caplog.at_level(logging.WARNING):
        thread = threading.Thread(
            target=lambda: made.append(
                configure(pg_dsn, queue_dir=tmp_path, connect_timeout=1, **_IN_PROCESS)
            ),
            daemon=True,
        )
        thread.start()
        thread.join(20)  # a guard: the check gives up after about 1 s
        returned_while_locked = not thread.is_alive()
        locker.close()
        thread.join(60)
    for agentcap in made:
        agentcap.shutdown(timeout=1)
    assert returned_while_locked
    assert caplog.text.count("not reachable at start") == 1
    assert "Traceback" not in caplog.text


@pytest.mark.storage
def test_the_handle_owns_what_it_set_up(pg_dsn, tmp_path):
    """The handle holds the provider, exporter, queue and tool ledger; exporter_of finds the
    exporter from the handle or its provider; shutdown closes the ledger and the database (pools
    included) and restores every process-wide setting it replaced (clocks' source, spawn and run
    registries, tool ledger, memory's default database, the SDK tool setting), and is
    idempotent."""
    before_source = clocks.configuration()
    before = (spawn_registry(), run_registry(), tool_ledger(), default_database())
    before_sdk = sdk_tools_exactly_once()
    with configure(
        pg_dsn,
        queue_dir=tmp_path,
        announce=False,
        sdk_tools_exactly_once=not before_sdk,
        **_IN_PROCESS,
    ) as agentcap:
        assert isinstance(agentcap, AgentCap)
        assert isinstance(agentcap.provider, TracerProvider)
        assert exporter_of(agentcap) is agentcap.exporter
        assert exporter_of(agentcap.provider) is agentcap.exporter
        assert agentcap.queue is not None and agentcap.queue.directory.path.is_dir()
        assert clocks.configuration()[0] is not before_source[0]
        assert isinstance(agentcap.ledger, PostgresToolLedger)
        assert tool_ledger() is agentcap.ledger
        assert default_database() is agentcap.database
        assert spawn_registry() is not before[0] and run_registry() is not before[1]
        assert sdk_tools_exactly_once() is (not before_sdk)
        with agentcap.database.coordination() as conn:  # the ledger's connections work
            assert conn.execute("SELECT 1").fetchone() == (1,)
        # The provider's own API, for code written when configure() returned it.
        assert agentcap.get_tracer("t") is not None
        assert agentcap.resource is agentcap.provider.resource
        assert agentcap.force_flush(timeout=5) is True
        assert agentcap.force_flush(timeout_millis=5000) is True
    assert clocks.configuration() == before_source
    assert (spawn_registry(), run_registry(), tool_ledger(), default_database()) == before
    assert sdk_tools_exactly_once() is before_sdk
    assert agentcap.ledger.running_claims() == 0
    with pytest.raises(ConnectionFailed), agentcap.database.coordination():
        pass
    assert agentcap.shutdown() is agentcap.report


@pytest.mark.storage
def test_configure_without_the_tool_ledger_installs_none(pg_dsn, tmp_path):
    """tool_ledger=False leaves tools with in-process exactly-once only, and the handle has no
    ledger to close."""
    before = tool_ledger()
    with configure(
        pg_dsn, queue_dir=tmp_path, announce=False, tool_ledger=False, **_IN_PROCESS
    ) as agentcap:
        assert agentcap.ledger is None
        assert tool_ledger() is None
    assert tool_ledger() is before


_PROGRAM = textwrap.dedent(
    """
    import dataclasses, json, sys
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    agentcap = configure(sys.argv[1], queue_dir=sys.argv[2], announce=False)
    memory = ac.Memory("m")

    @ac.tool
    def double(x):
        return 2 * x

    with ac.run("run-metrics"), ac.agent("a"):
        for i in range(30):
            memory[f"k{i}"] = i
            double.invoke(f"c{i}", i)
    assert agentcap.force_flush(timeout=30)
    stats = dataclasses.asdict(agentcap.stats())
    seen = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    result = dict(point.attributes or {}).get("agentcap.result")
                    seen[metric.name + (f"[{result}]" if result else "")] = point.value
    agentcap.shutdown(timeout=10)
    print(json.dumps({"stats": stats, "metrics": seen}))
    """
)


@pytest.mark.storage
@pytest.mark.multiprocess
def test_metrics_report_the_same_figures_as_stats(pg_dsn, tmp_path):
    """With an SDK MeterProvider set, the agentcap.* instruments report what stats() says:
    events inserted, retries, queue size, drops."""
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, pg_dsn, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    stats, seen = out["stats"], out["metrics"]
    assert stats["events_inserted"] == 30 * 3 + 2
    assert seen["agentcap.export.events[inserted]"] == stats["events_inserted"]
    assert seen["agentcap.export.events[duplicate]"] == stats["duplicates"]
    assert seen["agentcap.export.retries"] == stats["failed_attempts"]
    assert seen["agentcap.queue.spans"] == stats["spans_queued"] == 0
    assert seen["agentcap.queue.spans.dropped"] == stats["spans_dropped"] == 0
    assert "agentcap.queue.size" in seen


def test_stats_has_every_figure_the_issue_names():
    """queued on disk, exported, retried, duplicates, conflicts, dropped: all in ExportStats."""
    from otel_agentcap.exporters.postgres.exporter import ExportStats

    names = {f.name for f in dataclasses.fields(ExportStats)}
    assert {
        "spans_queued",
        "bytes_queued",
        "events_inserted",
        "failed_attempts",
        "duplicates",
        "conflicts",
        "spans_dropped",
        "events_dropped",
    } <= names


_LIMITED = textwrap.dedent(
    """
    import json, sys
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    collector = InMemorySpanExporter()
    agentcap = configure(
        sys.argv[1],
        queue_dir=sys.argv[2],
        announce=False,
        span_processors=[SimpleSpanProcessor(collector)],
    )

    @ac.tool
    def double(x):
        return 2 * x

    with ac.run(), ac.agent("a"):
        ac.Memory("m")["k"] = "v" * 5000
        double.invoke("c1", 2)
    agentcap.shutdown(timeout=30)
    stats = agentcap.stats()
    exported = collector.get_finished_spans()
    print(json.dumps({
        "stored": [stats.events_inserted, stats.spans_rejected, stats.events_unreadable],
        "most_attributes": max((len(s.attributes) for s in exported), default=0),
        "dropped": sum(s.dropped_attributes for s in exported),
        "longest": max(
            (len(v) for s in exported for v in s.attributes.values() if isinstance(v, str)),
            default=0,
        ),
    }))
    """
)


def _limited(dsn: str, tmp_path: Path, **environment: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | environment
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED, dsn, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "Dropping the oldest" not in done.stderr  # never on the log's spans
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.storage
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "variable", ["OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "OTEL_ATTRIBUTE_COUNT_LIMIT"]
)
def test_an_attribute_count_limit_bounds_the_collector_not_the_log(pg_dsn, tmp_path, variable):
    """A count limit below what agentcap's spans carry (here 6) would have the SDK drop the
    stamps and every event: the log's spans keep them, and the further processors (a
    collector's) get at most 6 attributes a span, the rest counted as dropped."""
    result = _limited(pg_dsn, tmp_path, **{variable: "6"})
    # agent_start, memory_write, tool_invocation, tool_result, agent_end; nothing refused.
    assert result["stored"] == [5, 0, 0]
    assert result["most_attributes"] == 6 and result["dropped"] > 0


@pytest.mark.storage
@pytest.mark.multiprocess
def test_a_value_length_limit_bounds_the_collector_not_the_log(pg_dsn, tmp_path):
    """OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT cuts what the collector gets, not the payloads the log
    stores: the 5,000-character value is stored whole."""
    result = _limited(pg_dsn, tmp_path, OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT="100")
    assert result["stored"] == [5, 0, 0]
    assert result["longest"] == 100
    with psycopg.connect(pg_dsn) as conn:
        value = conn.execute(
            "SELECT payload->>'after' FROM agentcap.events WHERE event_type = 'memory_write'"
            " ORDER BY wall_time DESC LIMIT 1"
        ).fetchone()[0]
    assert value == "v" * 5000


@pytest.mark.storage
@pytest.mark.multiprocess
def test_a_disabled_sdk_is_said_once(pg_dsn, tmp_path):
    """OTEL_SDK_DISABLED=true is the SDK's switch: nothing is recorded, and configure() says so
    instead of leaving an empty log unexplained."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED, pg_dsn, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env | {"OTEL_SDK_DISABLED": "true"},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["stored"] == [0, 0, 0]
    assert done.stderr.count("OTEL_SDK_DISABLED=true turns the OpenTelemetry SDK off") == 1


@pytest.mark.storage
@pytest.mark.parametrize(
    ("environment", "argument", "expected"),
    [
        ({"OTEL_SERVICE_NAME": "my-agents"}, None, "my-agents"),
        (
            {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes,team=a"},
            None,
            "from-attributes",
        ),
        ({}, None, "otel-agentcap"),
        ({"OTEL_SERVICE_NAME": "my-agents"}, "given", "given"),
    ],
)
def test_the_service_name_comes_from_the_environment_unless_given(
    pg_dsn, tmp_path, monkeypatch, environment, argument, expected
):
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the service as everywhere else in
    OpenTelemetry; configure(service_name=...) overrides them; "otel-agentcap" only when nothing
    names one."""
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with configure(
        pg_dsn, queue_dir=tmp_path, announce=False, service_name=argument, **_IN_PROCESS
    ) as agentcap:
        assert agentcap.resource.attributes["service.name"] == expected
        if "team=a" in environment.get("OTEL_RESOURCE_ATTRIBUTES", ""):
            assert agentcap.resource.attributes["team"] == "a"


_SECOND_PROVIDER = textwrap.dedent(
    """
    import sys
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from otel_agentcap.configure import configure
    from otel_agentcap.errors import ConfigurationError

    dsn, queue_dir, case = sys.argv[1:4]
    if case == "foreign":
        trace.set_tracer_provider(TracerProvider())
    else:
        configure(dsn, queue_dir=queue_dir, announce=False).shutdown(timeout=10)
    try:
        configure(dsn, queue_dir=queue_dir, announce=False)
    except ConfigurationError as exc:
        print(f"ConfigurationError: {exc}")
    """
)


@pytest.mark.storage
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            "foreign",
            "a global TracerProvider is set already (opentelemetry.sdk.trace.TracerProvider)",
        ),
        ("again", "configure() was called before in this process"),
    ],
)
def test_configure_refuses_when_a_global_provider_is_set(pg_dsn, tmp_path, case, expected):
    """OpenTelemetry keeps the first global TracerProvider: configure() after another one is set
    (or after an earlier configure(), shut down or not) would record nothing, so it fails at
    once and says what to do, instead of an empty log and the API's generic warning."""
    done = subprocess.run(
        [sys.executable, "-c", _SECOND_PROVIDER, pg_dsn, str(tmp_path), case],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    assert done.returncode == 0, done.stderr
    assert f"ConfigurationError: {expected}" in done.stdout, done.stdout + done.stderr
