"""model_call_payload takes a call's output from the SDK's attribute, else from agentcap's, and
presents it as the call's output only when the call completed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from opentelemetry.trace import Status, StatusCode

from otel_agentcap import jsonsafe
from otel_agentcap.pipeline.model_calls import OUTPUT_MESSAGES, model_call_payload

SDK = [{"role": "assistant", "parts": [{"type": "text", "content": "from the SDK"}]}]
OURS = [{"role": "assistant", "parts": [{"type": "text", "content": "from agentcap"}]}]


def _content(stream: bool, code: StatusCode, **output: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {"gen_ai.request.stream": stream}
    attributes.update({key: json.dumps(value) for key, value in output.items()})
    payload = model_call_payload("chat", attributes, status=Status(code))
    return dict(payload.get("content", {}))


@pytest.mark.parametrize("stream", [False, True])
def test_output_of_a_completed_call(stream):
    """A completed call's output is the SDK's attribute when set, else agentcap's."""
    sdk = {"gen_ai.output.messages": SDK}
    assert _content(stream, StatusCode.OK, **sdk) == {"output_messages": SDK}
    assert _content(stream, StatusCode.OK, **{OUTPUT_MESSAGES: OURS}) == {"output_messages": OURS}
    both = {**sdk, OUTPUT_MESSAGES: OURS}
    assert _content(stream, StatusCode.OK, **both) == {"output_messages": SDK}


@pytest.mark.parametrize("code", [StatusCode.UNSET, StatusCode.ERROR])
def test_output_of_a_stream_that_did_not_complete_is_partial(code):
    """What a stream that did not complete has of its Message is never its output_messages."""
    content = _content(True, code, **{"gen_ai.output.messages": SDK})
    assert content == {"partial_output_messages": SDK}


def test_no_output_attribute_no_output():
    """A span with neither attribute has no output in its payload."""
    assert _content(True, StatusCode.OK) == {}
    assert _content(False, StatusCode.OK, **{"gen_ai.input.messages": SDK}) == {
        "input_messages": SDK
    }


@pytest.mark.parametrize("as_list", [False, True])
def test_content_over_the_payload_limit_is_bounded_field_by_field(as_list):
    """A content attribute over the payload limit becomes a truncation marker in its own field;
    the call's other content and fields stay as they were."""
    limit = jsonsafe.DEFAULT_MAX_PAYLOAD_CHARS
    big = [{"role": "user", "parts": [{"type": "text", "content": "y" * (limit + 10)}]}]
    text = json.dumps(big)
    attributes: dict[str, Any] = {
        "gen_ai.request.model": "m",
        "gen_ai.input.messages": (text[:100], text[100:]) if as_list else text,
        "gen_ai.output.messages": json.dumps(SDK),
    }
    payload = model_call_payload("chat m", attributes, status=Status(StatusCode.OK))
    marker = payload["content"]["input_messages"]
    assert set(marker) == {"$agentcap.truncated", "size"}
    assert marker["size"] > limit
    assert marker["$agentcap.truncated"].startswith(
        '["[{\\"role\\"' if as_list else '[{"role": "user"'
    )
    assert payload["content"]["output_messages"] == SDK
    assert payload["model"] == "m"
    assert len(json.dumps(payload)) < 2 * limit
    # Under the limit, content is kept as it was.
    small = {"gen_ai.input.messages": json.dumps(SDK)}
    assert model_call_payload("chat", small)["content"]["input_messages"] == SDK
