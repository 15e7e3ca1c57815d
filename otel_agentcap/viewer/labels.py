"""One short line describing an event, from the few payload fields ``store.event_labels`` reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from otel_agentcap.model import EventType

MAX_LABEL: Final = 60


def _text(fields: Mapping[str, Any], name: str) -> str:
    value = fields.get(name)
    return "" if value is None else str(value)


def _model_call(fields: Mapping[str, Any]) -> str:
    # The vendor prefix leaves room in a narrow column; the detail panel shows the full name.
    model = _text(fields, "model").removeprefix("claude-") or "model"
    if _text(fields, "status") == "error":
        return f"{model} error {_text(fields, 'error_type')}".strip()
    tokens = ""
    if "input_tokens" in fields or "output_tokens" in fields:
        tokens = f" {_text(fields, 'input_tokens') or '?'}/{_text(fields, 'output_tokens') or '?'}"
    uses = fields.get("tool_uses")
    asked = f" +{uses} tool_use" if isinstance(uses, int) and uses > 0 else ""
    return f"{model}{tokens}{asked}"


def _error(fields: Mapping[str, Any]) -> str:
    kind = _text(fields, "error_type").rsplit(".", 1)[-1]
    if _text(fields, "timed_out") == "true":
        return f"timed out ({kind})" if kind else "timed out"
    tool = _text(fields, "tool")
    return f"{tool}: {kind}" if tool else kind


def _memory(fields: Mapping[str, Any], event_type: str) -> str:
    key = _text(fields, "key")
    if event_type == EventType.MEMORY_WRITE and _text(fields, "op") == "delete":
        return f"del {key}"
    if event_type == EventType.MEMORY_READ and _text(fields, "found") == "false":
        return f"{key} (missing)"
    return key


def label(event_type: str, fields: Mapping[str, Any], agent_id: str = "") -> str:
    """A label of at most :data:`MAX_LABEL` characters (the type is drawn apart, as a shape); a
    spawned child's id is shown relative to ``agent_id``, its parent."""
    if event_type == EventType.MODEL_CALL:
        text = _model_call(fields)
    elif event_type in (EventType.TOOL_INVOCATION, EventType.TOOL_RESULT):
        text = _text(fields, "tool")
    elif event_type == EventType.AGENT_ERROR:
        text = _error(fields)
    elif event_type in (EventType.MEMORY_READ, EventType.MEMORY_WRITE):
        text = _memory(fields, event_type)
    elif event_type == EventType.AGENT_SPAWN:
        text = _text(fields, "child_agent_id")
        if agent_id and text.startswith(f"{agent_id}/"):
            text = text[len(agent_id) + 1 :]
    else:
        text = ""
    text = " ".join(text.split())
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 3] + "..."
