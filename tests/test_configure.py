"""configure(): one call gives the full record, including the edges only instrumentation sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from anthropic_support import expected_tool_use_ids, needs_sdk_tracing, stored_events

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
