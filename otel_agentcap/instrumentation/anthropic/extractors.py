"""Pure mapping from anthropic SDK objects (request keyword arguments, Messages, stream events,
exceptions) to span attributes, with the attribute names the SDK's own tracing uses, so that
:mod:`otel_agentcap.pipeline.model_calls` reads both the same way. Nothing here raises."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Final

from opentelemetry.util.types import AttributeValue

from otel_agentcap import jsonsafe
from otel_agentcap.instrumentation.anthropic.stream_blocks import StreamedBlocks
from otel_agentcap.pipeline.model_calls import TOOL_USE_IDS

_logger = logging.getLogger(__name__)

CAPTURE_CONTENT_ENV: Final = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


def capture_content() -> bool:
    """Whether the user opted in to content capture for this instrumentation."""
    return os.environ.get(CAPTURE_CONTENT_ENV, "").strip().lower() in ("1", "true", "yes")


def get(value: Any, key: str) -> Any:
    """``value[key]`` for a mapping, ``value.key`` otherwise; ``None`` when absent."""
    if isinstance(value, Mapping):
        return value.get(key)
    return getattr(value, key, None)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _json(value: Any) -> str:
    return json.dumps(jsonsafe.to_jsonable(value), ensure_ascii=False, separators=(",", ":"))


def request_attributes(kwargs: Mapping[str, Any], *, stream: bool) -> dict[str, AttributeValue]:
    """What a ``chat`` span starts with, from the call's keyword arguments (metadata only, plus
    content when :func:`capture_content`)."""
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic",
    }
    try:
        model = kwargs.get("model")
        if isinstance(model, str):
            attributes["gen_ai.request.model"] = model
        max_tokens = _int(kwargs.get("max_tokens"))
        if max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = max_tokens
        if stream:
            attributes["gen_ai.request.stream"] = True
        if capture_content():
            messages = kwargs.get("messages")
            if isinstance(messages, list | tuple):
                attributes["gen_ai.input.messages"] = _json(list(messages))
            system = kwargs.get("system")
            if system is not None and not _is_not_given(system):
                attributes["gen_ai.system_instructions"] = _json(system)
            tools = kwargs.get("tools")
            if isinstance(tools, list | tuple):
                attributes["gen_ai.tool.definitions"] = _json(list(tools))
    except Exception:
        _logger.debug("agentcap: could not read the request", exc_info=True)
    return attributes


def _is_not_given(value: Any) -> bool:
    return type(value).__name__ in ("NotGiven", "Omit")


def usage_attributes(usage: Any, *, with_output: bool = True) -> dict[str, AttributeValue]:
    """Usage as attributes; input tokens include cache reads and cache creation, as the SDK's."""
    attributes: dict[str, AttributeValue] = {}
    input_tokens = _int(get(usage, "input_tokens"))
    cache_read = _int(get(usage, "cache_read_input_tokens"))
    cache_creation = _int(get(usage, "cache_creation_input_tokens"))
    if input_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = (
            input_tokens + (cache_read or 0) + (cache_creation or 0)
        )
    if cache_read is not None:
        attributes["gen_ai.usage.cache_read.input_tokens"] = cache_read
    if cache_creation is not None:
        attributes["gen_ai.usage.cache_write.input_tokens"] = cache_creation
    output_tokens = _int(get(usage, "output_tokens"))
    if with_output and output_tokens is not None:
        attributes["gen_ai.usage.output_tokens"] = output_tokens
    return attributes


def tool_use_ids(content: Any) -> list[str]:
    ids: list[str] = []
    if isinstance(content, list | tuple):
        for block in content:
            if get(block, "type") == "tool_use" and isinstance(get(block, "id"), str):
                ids.append(get(block, "id"))
    return ids


def tool_use_attributes(message: Any) -> dict[str, AttributeValue]:
    """``agentcap.model_call.tool_use_ids`` of a Message (or its dict), if it asked for tools."""
    try:
        ids = tool_use_ids(get(message, "content"))
        return {TOOL_USE_IDS: ids} if ids else {}
    except Exception:
        return {}


def response_attributes(message: Any) -> dict[str, AttributeValue]:
    """What a complete Message gives its span."""
    attributes: dict[str, AttributeValue] = {}
    try:
        for key, field in (
            ("gen_ai.response.id", "id"),
            ("gen_ai.response.model", "model"),
            ("anthropic.message.stop_reason", "stop_reason"),
        ):
            value = get(message, field)
            if isinstance(value, str):
                attributes[key] = value
        attributes.update(usage_attributes(get(message, "usage")))
        attributes.update(tool_use_attributes(message))
        # The SDK documents ``_request_id`` (underscored so it cannot clash with an API field) as
        # where a response's request id is; absent on releases before it, the id is left out.
        request_id = getattr(message, "_request_id", None)
        if isinstance(request_id, str):
            attributes["anthropic.request.id"] = request_id
        if capture_content():
            content = get(message, "content")
            if content is not None:
                attributes["gen_ai.output.messages"] = _json(
                    [{"role": "assistant", "content": content}]
                )
    except Exception:
        _logger.debug("agentcap: could not read the response", exc_info=True)
    return attributes


def error_type(error: BaseException) -> str:
    """``error.type`` as the SDK's tracing spells it: the API's error type, else a category."""
    body = getattr(error, "body", None)
    inner = get(body, "error") if body is not None else None
    api_type = get(inner, "type") or getattr(error, "type", None)
    if isinstance(api_type, str) and api_type:
        return api_type
    name = type(error).__name__
    if name in ("APITimeoutError", "TimeoutException", "ReadTimeout", "ConnectTimeout"):
        return "client_timeout_error"
    if name == "APIConnectionError" or "Protocol" in name or "Connect" in name:
        return "connection_error"
    status = getattr(error, "status_code", None)
    if isinstance(status, int):
        return str(status)
    return "client_error" if isinstance(error, Exception) else name


def error_attributes(error: BaseException) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {"error.type": error_type(error)}
    try:
        status = getattr(error, "status_code", None)
        if isinstance(status, int):
            attributes["http.response.status_code"] = status
        response = getattr(error, "response", None)
        headers = getattr(response, "headers", None)
        request_id = headers.get("request-id") if headers is not None else None
        if isinstance(request_id, str):
            attributes["anthropic.request.id"] = request_id
    except Exception:
        pass
    return attributes


class StreamAccumulator:
    """Reads the raw stream events of one Message into span attributes.

    ``message_start`` gives the id, the model and the input usage; its output token count is a
    placeholder and is never used. ``message_delta`` gives the stop reason and the final output
    usage. ``content_block_start`` gives the tool_use ids. With :func:`capture_content`, the
    content blocks are accumulated too (:mod:`.stream_blocks`), and become the output of a
    stream that completed.
    """

    def __init__(self, start_ns: int) -> None:
        self.start_ns = start_ns
        self.attributes: dict[str, AttributeValue] = {}
        self.first_chunk_ns: int | None = None
        self.stopped = False
        self._tool_ids: list[str] = []
        self._blocks = StreamedBlocks() if capture_content() else None

    def add(self, event: Any, now_ns: int) -> None:
        if self._blocks is not None:
            self._blocks.add(event)
        try:
            kind = get(event, "type")
            if kind == "message_start":
                message = get(event, "message")
                for key, field in (
                    ("gen_ai.response.id", "id"),
                    ("gen_ai.response.model", "model"),
                ):
                    value = get(message, field)
                    if isinstance(value, str):
                        self.attributes[key] = value
                self.attributes.update(usage_attributes(get(message, "usage"), with_output=False))
            elif kind == "content_block_start":
                block = get(event, "content_block")
                if get(block, "type") == "tool_use" and isinstance(get(block, "id"), str):
                    self._tool_ids.append(get(block, "id"))
                    self.attributes[TOOL_USE_IDS] = list(self._tool_ids)
            elif kind == "content_block_delta":
                if self.first_chunk_ns is None:
                    self.first_chunk_ns = now_ns
                    self.attributes["gen_ai.response.time_to_first_chunk"] = (
                        now_ns - self.start_ns
                    ) / 1e9
            elif kind == "message_delta":
                stop = get(get(event, "delta"), "stop_reason")
                if isinstance(stop, str):
                    self.attributes["anthropic.message.stop_reason"] = stop
                output = _int(get(get(event, "usage"), "output_tokens"))
                if output is not None:
                    self.attributes["gen_ai.usage.output_tokens"] = output
            elif kind == "message_stop":
                self.stopped = True
        except Exception:
            _logger.debug("agentcap: could not read a stream event", exc_info=True)

    def final_attributes(self, *, completed: bool) -> dict[str, AttributeValue]:
        """The span's attributes; the output content only for a stream that ``completed`` (read
        to its end after ``message_stop``, without error), in the shape of a returned Message's."""
        attributes = dict(self.attributes)
        if completed and self._blocks is not None and self._blocks.complete:
            blocks = self._blocks.blocks()
            if blocks is not None:
                attributes["gen_ai.output.messages"] = _json(
                    [{"role": "assistant", "content": blocks}]
                )
        return attributes
