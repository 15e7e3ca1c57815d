"""Pure mapping of model-call spans to ``model_call`` event payloads (no I/O, no SDK).

A model call may be recorded by the anthropic SDK's own tracing (scope ``com.anthropic.sdk.python``),
by otel_agentcap's :class:`~otel_agentcap.instrumentation.anthropic.AnthropicInstrumentor` on SDKs
without tracing, or by an add-on GenAI instrumentation (OpenLLMetry and the like). Each spells a few
attributes differently; :func:`model_call_payload` reads all of them into one payload with stable
keys:

=========================  ===================================================================
key                        meaning
=========================  ===================================================================
``schema``                 payload version, ``1``
``span_name``              name of the span that recorded the call
``instrumentation``        its instrumentation scope (who recorded it)
``provider``               ``gen_ai.provider.name`` / ``gen_ai.system`` (``"anthropic"``)
``model``                  the response's model, else the requested one
``request_model``          ``gen_ai.request.model``
``response_model``         ``gen_ai.response.model``
``stream``                 whether the response was streamed
``response_id``            the Message id (``msg_...``)
``request_id``             the API's ``request-id`` header (``req_...``)
``stop_reason``            ``end_turn``, ``tool_use``, ... (absent when the call did not finish)
``usage``                  ``input_tokens`` (including cache reads and cache creation),
                           ``output_tokens``, ``cache_read_input_tokens``,
                           ``cache_creation_input_tokens``; a key is absent when unknown
                           (never a ``message_start`` placeholder)
``tool_use_ids``           ids of the ``tool_use`` blocks the response asked for
``latency_ms``             span duration (request start to the end of the stream)
``time_to_first_chunk_ms`` streams: start to the first content delta
``status``                 ``ok``, ``error`` or ``unset`` (abandoned or closed early)
``error_type``             ``error.type`` (e.g. ``rate_limit_error``, ``overloaded_error``)
``http_status_code``       status of the final HTTP attempt
``content``                only when content capture was opted in: ``system_instructions``,
                           ``input_messages``, ``output_messages``, ``tool_definitions``;
                           ``output_messages`` is ``gen_ai.output.messages``, else
                           ``agentcap.model_call.output_messages`` (a raw stream that
                           completed, see :data:`OUTPUT_MESSAGES`), and only for a call that
                           completed; a stream that did not, but whose span has what was read
                           of its Message (the SDK's stream helper records that), has it as
                           ``partial_output_messages``
=========================  ===================================================================
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, cast

from opentelemetry.trace import StatusCode
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe

# Defined in otel_agentcap.pipeline.call_identity, with the rule they serve.
from otel_agentcap.pipeline.call_identity import REQUEST_ID, RESPONSE_ID
from otel_agentcap.pipeline.call_identity import SUPERSEDED as SUPERSEDED
from otel_agentcap.pipeline.call_identity import call_ids as call_ids

PAYLOAD_SCHEMA: Final = 1

SDK_SCOPE: Final = "com.anthropic.sdk.python"
"""Instrumentation scope of the anthropic SDK's own spans (platform clients add a suffix)."""

#: Our attribute for the ids of the tool_use blocks a response asked for (not content: ids only).
TOOL_USE_IDS: Final = "agentcap.model_call.tool_use_ids"
#: Our attribute for the output of a raw stream that completed, on an SDK span that leaves it off
#: (content: set only when content capture is on). JSON: the GenAI output messages, as the SDK
#: writes ``gen_ai.output.messages``.
OUTPUT_MESSAGES: Final = "agentcap.model_call.output_messages"

# Attribute spellings, first match wins.
_INPUT_TOKENS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens")
_OUTPUT_TOKENS = ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens")
_CACHE_READ = ("gen_ai.usage.cache_read.input_tokens", "gen_ai.usage.cache_read_input_tokens")
_CACHE_CREATION = (
    "gen_ai.usage.cache_write.input_tokens",
    "gen_ai.usage.cache_creation.input_tokens",
    "gen_ai.usage.cache_creation_input_tokens",
)
#: The stop reason attribute of the anthropic SDK's spans (and ours on SDKs without tracing).
STOP_REASON: Final = "anthropic.message.stop_reason"
_STOP_REASON = (STOP_REASON, "gen_ai.response.finish_reasons")
_REQUEST_ID = ("anthropic.request.id", "gen_ai.request.id")

#: Attributes that hold message content (inputs, outputs, system prompt, tool definitions,
#: tool arguments and results). Prefixes end with a dot.
CONTENT_ATTRIBUTES: Final = frozenset(
    {
        "gen_ai.system_instructions",
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        OUTPUT_MESSAGES,
        "gen_ai.tool.definitions",
        "gen_ai.tool.call.arguments",
        "gen_ai.tool.call.result",
        "gen_ai.request.stop_sequences",
        "anthropic.tool_result.content",
        "llm.request.functions",
    }
)
CONTENT_PREFIXES: Final = ("gen_ai.prompt.", "gen_ai.completion.", "llm.request.functions.")

_CONTENT_KEYS: Final = {
    "gen_ai.system_instructions": "system_instructions",
    "gen_ai.input.messages": "input_messages",
    "gen_ai.tool.definitions": "tool_definitions",
}
#: Where a call's output is: the SDK's attribute (set by the SDK, or by our instrumentor on SDKs
#: without tracing), else ours (a raw stream on an SDK that traces itself).
_OUTPUT_ATTRIBUTES: Final = ("gen_ai.output.messages", OUTPUT_MESSAGES)


def is_sdk_scope(scope: str | None) -> bool:
    """Whether ``scope`` is the anthropic SDK's own instrumentation scope (any platform suffix)."""
    return scope is not None and scope.startswith(SDK_SCOPE)


def is_content_attribute(key: str) -> bool:
    """Whether the attribute ``key`` carries message content (see :data:`CONTENT_ATTRIBUTES`)."""
    return key in CONTENT_ATTRIBUTES or key.startswith(CONTENT_PREFIXES)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _content(value: AttributeValue) -> Any:
    """A content attribute's value for the payload: its JSON parsed, bounded as every payload
    field is (over ``jsonsafe.DEFAULT_MAX_PAYLOAD_CHARS`` characters: a truncation marker, so
    the call's other fields stay readable)."""
    limit = jsonsafe.DEFAULT_MAX_PAYLOAD_CHARS
    if isinstance(value, str):
        if len(value) > limit:
            return json.loads(jsonsafe.truncate(value, limit))
    elif isinstance(value, tuple | list) and sum(len(str(v)) for v in value) > limit:
        return json.loads(jsonsafe.truncate(jsonsafe.dumps(list(value), 2**62), limit))
    return _json_or_text(value)


def _json_or_text(value: AttributeValue) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return list(value) if isinstance(value, tuple | list) else value


def usage_of(attributes: Mapping[str, AttributeValue]) -> dict[str, int]:
    """The token usage recorded on a model-call span; unknown counts are left out."""
    get = attributes.get
    usage: dict[str, int] = {}
    for key, names in _USAGE:
        for name in names:
            value = get(name)
            if value is not None:
                if type(value) is int:
                    usage[key] = value
                else:
                    count = _int(value)
                    if count is not None:
                        usage[key] = count
                break
    return usage


_USAGE: Final = (
    ("input_tokens", _INPUT_TOKENS),
    ("output_tokens", _OUTPUT_TOKENS),
    ("cache_read_input_tokens", _CACHE_READ),
    ("cache_creation_input_tokens", _CACHE_CREATION),
)
_STATUS_NAMES: Final = {"OK": "ok", "ERROR": "error"}


def status_of(status: Any) -> str:
    """``ok``, ``error`` or ``unset`` from an OpenTelemetry ``Status`` (or anything else)."""
    code = getattr(status, "status_code", None)
    if code is StatusCode.UNSET:
        return "unset"
    if code is StatusCode.OK:
        return "ok"
    if code is StatusCode.ERROR:
        return "error"
    name = getattr(code, "name", None)  # a status code of another kind, e.g. decoded from OTLP
    return _STATUS_NAMES.get(name, "unset") if isinstance(name, str) else "unset"


def model_call_payload(
    span_name: str,
    attributes: Mapping[str, AttributeValue],
    *,
    start_time: int | None = None,
    end_time: int | None = None,
    status: Any = None,
    scope: str | None = None,
) -> dict[str, Any]:
    """The ``model_call`` payload of a finished model-call span (keys in the module doc).

    Runs for every model call on the export path, so lookups are done once each."""
    get = attributes.get
    payload: dict[str, Any] = {"schema": PAYLOAD_SCHEMA, "span_name": span_name}
    if scope:
        payload["instrumentation"] = scope
    provider = get(attr.GEN_AI_PROVIDER_NAME) or get(attr.GEN_AI_SYSTEM)
    if provider is not None:
        payload["provider"] = str(provider)
    request_model = get(attr.GEN_AI_REQUEST_MODEL)
    response_model = get(attr.GEN_AI_RESPONSE_MODEL)
    model = response_model or request_model
    if model is not None:
        payload["model"] = str(model)
    if request_model is not None:
        payload["request_model"] = str(request_model)
    if response_model is not None:
        payload["response_model"] = str(response_model)
    payload["stream"] = bool(get("gen_ai.request.stream"))
    response_id = get(attr.GEN_AI_RESPONSE_ID)
    if response_id is not None:
        payload[RESPONSE_ID] = str(response_id)
    request_id = get(_REQUEST_ID[0])
    if request_id is None:
        request_id = get(_REQUEST_ID[1])
    if request_id is not None:
        payload[REQUEST_ID] = str(request_id)
    stop = get(_STOP_REASON[0])
    if stop is None:
        stop = get(_STOP_REASON[1])
    if type(stop) is tuple or type(stop) is list:
        stop = stop[0] if stop else None
    if stop is not None:
        payload["stop_reason"] = str(stop)
    payload["usage"] = usage_of(attributes)
    tool_ids = get(TOOL_USE_IDS)
    payload["tool_use_ids"] = (
        [str(i) for i in tool_ids] if isinstance(tool_ids, tuple | list) else []
    )
    if start_time is not None and end_time is not None:
        payload["latency_ms"] = round((end_time - start_time) / 1e6, 3)
    ttfc = get("gen_ai.response.time_to_first_chunk")
    if type(ttfc) is float or type(ttfc) is int:
        payload["time_to_first_chunk_ms"] = round(float(cast(float, ttfc)) * 1000.0, 3)
    payload["status"] = status_of(status)
    error_type = get(attr.ERROR_TYPE)
    if error_type is not None:
        payload["error_type"] = str(error_type)
    http_status = _int(get("http.response.status_code"))
    if http_status is not None:
        payload["http_status_code"] = http_status
    content = None
    for name, key in _CONTENT_KEYS.items():
        value = get(name)
        if value is not None:
            if content is None:
                content = {}
            content[key] = _content(value)
    output = next((v for v in map(get, _OUTPUT_ATTRIBUTES) if v is not None), None)
    if output is not None:
        if content is None:
            content = {}
        # A stream that did not complete has at most what was read of its Message (the SDK's
        # helper records that much): never presented as the Message.
        complete = not payload["stream"] or payload["status"] == "ok"
        content["output_messages" if complete else "partial_output_messages"] = _content(output)
    if content:
        payload["content"] = content
    return payload
