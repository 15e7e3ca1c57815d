"""The agentcap distro and configurator: opentelemetry-instrument with one variable stores the full
record, sends nothing it was not asked to, and changes nothing when not selected."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from anthropic_support import expected_tool_use_ids, stored_events

from otel_agentcap import distro
from otel_agentcap.distro import AgentCapDistro
from otel_agentcap.testing.messages_server import (
    MessagesServer,
    ToolCall,
    text_reply,
    tool_use_reply,
)

APP = Path(__file__).parent / "data" / "instrumented_app.py"
INSTRUMENT = Path(sys.executable).parent / "opentelemetry-instrument"


class _Sink:
    """An HTTP server on loopback that records the path of every request (an OTLP endpoint)."""

    def __init__(self) -> None:
        paths: list[str] = []
        self.paths = paths

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sink() -> Iterator[_Sink]:
    sink = _Sink()
    try:
        yield sink
    finally:
        sink.close()


def _instrumented_run(
    dsn: str, run_id: str, endpoint: str, **extra: str
) -> subprocess.CompletedProcess[str]:
    with MessagesServer() as server:
        server.enqueue(
            tool_use_reply([ToolCall("weather", {"city": "Oslo"}, id="toolu_distro")]),
            text_reply("It is sunny."),
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            OTEL_PYTHON_DISTRO="agentcap",
            AGENTCAP_DSN=dsn,
            APP_BASE_URL=server.base_url,
            # Anything that tries to export over OTLP (traces, metrics, logs; HTTP or gRPC) goes here.
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            **extra,
        )
        return subprocess.run(
            [str(INSTRUMENT), sys.executable, str(APP), run_id],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )


def _check_full_record(dsn: str, run_id: str) -> None:
    events = stored_events(dsn, run_id)
    by_id = {e["event_id"]: e for e in events}
    types = sorted(e["event_type"] for e in events)
    assert types == sorted(
        ["agent_start", "model_call", "tool_invocation", "tool_result", "model_call", "agent_end"]
    )
    calls = sorted((e for e in events if e["event_type"] == "model_call"), key=lambda e: e["seq"])
    assert calls[0]["payload"]["tool_use_ids"] == expected_tool_use_ids("toolu_distro")
    invocation = next(e for e in events if e["event_type"] == "tool_invocation")
    assert calls[0]["event_id"] in invocation["parents"]
    assert [by_id[p]["event_type"] for p in calls[1]["parents"]] == ["tool_result"]


@pytest.mark.storage
@pytest.mark.multiprocess
def test_one_variable_stores_the_full_record_and_sends_nothing_else(pg_dsn, sink):
    """OTEL_PYTHON_DISTRO=agentcap alone: the model -> tool -> model chain is stored, nothing goes
    to an OTLP endpoint, and nothing complains about exporters that are not installed."""
    done = _instrumented_run(pg_dsn, "run-distro", sink.endpoint)
    assert done.returncode == 0, done.stderr
    assert "app done" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert "exporter" not in done.stderr.lower(), done.stderr
    assert "error" not in done.stderr.lower(), done.stderr
    _check_full_record(pg_dsn, "run-distro")
    assert sink.paths == []


@pytest.mark.storage
@pytest.mark.multiprocess
@pytest.mark.collector
def test_a_trace_exporter_asked_for_gets_the_stamped_spans_too(pg_dsn, sink):
    """OTEL_TRACES_EXPORTER=agentcap,otlp: the log gets the record and the OTLP endpoint the spans
    (over HTTP, the exporter the otlp extra installs); metrics and logs still stay home."""
    done = _instrumented_run(
        pg_dsn, "run-distro-otlp", sink.endpoint, OTEL_TRACES_EXPORTER="agentcap,otlp"
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    _check_full_record(pg_dsn, "run-distro-otlp")
    assert set(sink.paths) == {"/v1/traces"}


@pytest.mark.multiprocess
def test_an_exporter_that_is_not_installed_is_one_line_not_a_traceback(sink, tmp_path):
    """A trace exporter named but not installed is reported on one line; the program runs."""
    script = tmp_path / "app.py"
    script.write_text("print('ran')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_PYTHON_DISTRO="agentcap",
        OTEL_TRACES_EXPORTER="no_such_exporter",
        OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
    )
    done = subprocess.run(
        [str(INSTRUMENT), sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran"
    assert "Traceback" not in done.stderr, done.stderr
    assert "no_such_exporter" in done.stderr
    assert sink.paths == []


@pytest.fixture
def otel_env() -> Iterator[None]:
    """No OTEL_ variables inside the test; the environment as it was afterwards (distros write
    os.environ directly)."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            del os.environ[name]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.usefixtures("otel_env")
def test_not_selected_the_distro_configures_as_the_other_installed_one():
    """Without OTEL_PYTHON_DISTRO=agentcap the distro runs the other installed distro
    (opentelemetry-distro here): installing otel-agentcap changes nothing it was not asked to."""
    AgentCapDistro()._configure()
    assert os.environ.get("OTEL_TRACES_EXPORTER") == "otlp"
    assert os.environ.get("OTEL_PYTHON_CONFIGURATOR") is None


@pytest.mark.usefixtures("otel_env")
def test_selected_the_distro_sets_only_what_is_unset():
    """OTEL_PYTHON_DISTRO=agentcap sets the defaults of the setup, keeping what the user set."""
    os.environ["OTEL_PYTHON_DISTRO"] = "agentcap"
    os.environ["OTEL_METRICS_EXPORTER"] = "console"
    AgentCapDistro()._configure()
    assert os.environ["OTEL_TRACES_EXPORTER"] == "agentcap"
    assert os.environ["OTEL_LOGS_EXPORTER"] == "none"
    assert os.environ["OTEL_METRICS_EXPORTER"] == "console"
    assert os.environ["OTEL_PYTHON_CONFIGURATOR"] == "agentcap"


@pytest.mark.parametrize(
    ("protocol", "install"),
    [
        ("http/protobuf", "pip install 'otel-agentcap[otlp]'"),
        ("grpc", "pip install opentelemetry-exporter-otlp-proto-grpc"),
    ],
)
@pytest.mark.usefixtures("otel_env")
def test_a_missing_otlp_exporter_names_what_installs_it(monkeypatch, caplog, protocol, install):
    """An otlp exporter that is not installed is reported with what installs the exporter of the
    configured protocol (the otlp extra brings the HTTP one only); the program goes on without it."""
    monkeypatch.setattr(distro, "entry_points", lambda **_: [])
    os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = protocol
    with caplog.at_level(logging.ERROR, logger=distro.__name__):
        assert distro._trace_exporters(["otlp"]) == []
    assert [record.getMessage() for record in caplog.records] == [
        "agentcap: OTEL_TRACES_EXPORTER names 'otlp', but no installed package provides it"
        f" ({install}); not exporting there"
    ]


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]
)
@pytest.mark.usefixtures("otel_env")
def test_an_otlp_protocol_that_is_not_supported_is_named(caplog, variable):
    """otlp with a protocol no OTLP exporter speaks is reported as that protocol, naming the
    variable and the protocols there are, not as an exporter that is not installed."""
    os.environ[variable] = "bogus"
    with caplog.at_level(logging.ERROR, logger=distro.__name__):
        assert distro._trace_exporters(["otlp"]) == []
    assert [record.getMessage() for record in caplog.records] == [
        f"agentcap: {variable} is 'bogus', but the otlp exporters speak grpc or http/protobuf;"
        " not exporting there"
    ]
