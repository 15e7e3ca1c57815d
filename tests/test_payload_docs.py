"""The README's tables of event payloads are what capture produces: every field documented,
of the documented type, present when the table says always, and no documented field stale."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic_support import API_KEY, MODEL, USER

import otel_agentcap as ac
from otel_agentcap.testing.messages_server import ToolCall, error_reply, text_reply, tool_use_reply

README = Path(__file__).resolve().parent.parent / "README.md"
_HEADING = re.compile(r"^#### `(\w+)`")
_ROW = re.compile(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|$")

_TYPES: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array of strings": lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v),
    "any": lambda v: True,
    "null": lambda v: v is None,
}


def documented() -> dict[str, dict[str, tuple[str, bool]]]:
    """event type -> field -> (type, always present), from the README."""
    tables: dict[str, dict[str, tuple[str, bool]]] = {}
    current = None
    for line in README.read_text().splitlines():
        heading = _HEADING.match(line)
        if heading:
            current = tables.setdefault(heading.group(1), {})
            continue
        if line.startswith("#"):
            current = None
        row = _ROW.match(line.strip())
        if current is not None and row:
            current[row.group(1)] = (
                row.group(2).strip(),
                row.group(3).strip().startswith("always"),
            )
    return tables


def _type_ok(kind: str, value: Any) -> bool:
    return any(_TYPES[k](value) for k in kind.split(" or "))


def _workload(server, client) -> None:
    """Every event type, in the variants that carry the conditional fields."""
    memory = ac.Memory("notes")
    memory.set("outside", 1)  # written outside any agent: read without written_by

    @ac.tool
    def lookup(city: str) -> str:
        return f"sunny in {city}"

    @ac.tool
    def broken(city: str) -> str:
        raise ValueError(f"no data for {city}")

    server.enqueue(
        tool_use_reply(
            [ToolCall("lookup", {"city": "Oslo"}, id="toolu_doc")], cache_read=3, cache_creation=2
        ),
        text_reply("streamed"),
        error_reply(529),
        text_reply("with content"),
    )
    content_client = anthropic.Anthropic(
        base_url=server.base_url,
        api_key=API_KEY,
        max_retries=0,
        open_telemetry={"traces": {"content_mode": "content"}},
    )
    with ac.run("run-payload-docs"):
        with ac.agent("planner", timeout=30) as planner:
            memory["plan"] = ["a"]
            assert memory["plan"] == ["a"]
            assert memory.lookup("outside").found
            assert not memory.lookup("missing").found
            memory.delete("plan")
            message = client.messages.create(model=MODEL, max_tokens=64, messages=USER)
            ac.run_tool_uses(message, [lookup])
            lookup("Bergen")  # a plain call: invocation id seq-N
            with pytest.raises(ValueError):
                broken.invoke("call-broken", "X")
            with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
                stream.get_final_message()
            with pytest.raises(anthropic.APIStatusError):
                client.messages.create(model=MODEL, max_tokens=64, messages=USER)
            content_client.messages.create(model=MODEL, max_tokens=64, system="s", messages=USER)
            child = planner.spawn("researcher", key="topic")
            planner.spawn("writer")  # no key

        def fail() -> None:
            raise RuntimeError("the child failed")

        with pytest.raises(RuntimeError):
            child.run(fail)
        with ac.agent("idle"):  # no timeout: null
            pass


def test_documented_payloads_are_what_capture_produces(server, client, captured, instrumented):
    """Each captured payload field is documented with its type; "always" fields are always
    there; every documented field appears in the workload (so none is stale)."""
    _workload(server, client)
    tables = documented()
    events = [e for e in captured.events if e.run_id == "run-payload-docs"]
    assert {e.event_type for e in events} == set(tables), "an event type is not documented"
    seen: dict[str, set[str]] = defaultdict(set)
    for event in events:
        table = tables[event.event_type]
        payload = event.payload
        assert isinstance(payload, dict)
        for field, value in payload.items():
            assert field in table, f"{event.event_type}.{field} is not documented"
            kind, _ = table[field]
            assert _type_ok(kind, value), f"{event.event_type}.{field}: {value!r} is not {kind}"
            seen[event.event_type].add(field)
        for field, (_, always) in table.items():
            if always:
                assert field in payload, f"{event.event_type}.{field} is documented as always"
    for event_type, table in tables.items():
        stale = set(table) - seen[event_type]
        assert not stale, f"{event_type}: documented but never produced: {sorted(stale)}"
