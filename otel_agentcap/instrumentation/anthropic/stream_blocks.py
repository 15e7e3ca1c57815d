"""The content blocks of one streamed Message, built from its raw stream events.

Reads only the Messages API's documented stream format (``content_block_start``,
``content_block_delta`` with ``text_delta``, ``input_json_delta``, ``citations_delta``,
``thinking_delta``, ``signature_delta`` or ``compaction_delta``, ``message_stop``), as SDK models or as dicts, so it works the same on every SDK release and calls
nothing of the SDK: the SDK's own tracing deliberately accumulates no deltas of a stream read
without its helper, and its tests count the calls of its accumulation functions. A delta of
another type is ignored, as the SDK's own accumulation ignores it.

A Message is complete when ``message_stop`` arrived and every event could be read
(:attr:`StreamedBlocks.complete`); only then is :meth:`StreamedBlocks.blocks` meant to be
recorded as the call's output.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

_logger = logging.getLogger(__name__)


def _get(value: Any, key: str) -> Any:
    if isinstance(value, Mapping):
        return value.get(key)
    return getattr(value, key, None)


def _plain(value: Any) -> dict[str, Any] | None:
    """A content block as a dict of its fields (a copy: the caller's event is never changed)."""
    if isinstance(value, Mapping):
        return dict(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        fields = to_dict()
        return dict(fields) if isinstance(fields, Mapping) else None
    return None


def _text(delta: Any, key: str) -> str:
    text = _get(delta, key)
    if not isinstance(text, str):
        raise ValueError(f"a {_get(delta, 'type')} without its {key}")
    return text


class _Block:
    """One content block being streamed: its start fields and the pieces of its deltas."""

    __slots__ = ("citations", "fields", "json", "signature", "text", "thinking")

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.json: list[str] = []
        self.citations: list[Any] = []
        self.signature: str | None = None

    def build(self) -> dict[str, Any]:
        block = dict(self.fields)
        if self.text:
            block["text"] = str(block.get("text") or "") + "".join(self.text)
        if self.thinking:
            block["thinking"] = str(block.get("thinking") or "") + "".join(self.thinking)
        if self.signature is not None:
            block["signature"] = self.signature
        if self.citations:
            block["citations"] = list(block.get("citations") or ()) + self.citations
        if self.json:
            text = "".join(self.json)
            if text.strip():
                block["input"] = json.loads(text)  # a ValueError means a broken stream
        return block


class StreamedBlocks:
    """Accumulates the content blocks of one streamed Message (see the module documentation).

    Never raises: an event that cannot be read marks the Message as broken."""

    __slots__ = ("_blocks", "broken", "stopped")

    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}
        self.stopped = False
        self.broken = False

    @property
    def complete(self) -> bool:
        """Whether ``message_stop`` arrived and every event before it could be read."""
        return self.stopped and not self.broken

    def add(self, event: Any) -> None:
        if self.broken:
            return
        try:
            kind = _get(event, "type")
            if kind == "content_block_delta":
                self._delta(self._blocks[_get(event, "index")], _get(event, "delta"))
            elif kind == "content_block_start":
                fields = _plain(_get(event, "content_block"))
                if fields is None:
                    raise ValueError("a content block that is not an object")
                self._blocks[_get(event, "index")] = _Block(fields)
            elif kind == "message_stop":
                self.stopped = True
        except Exception:
            _logger.debug("agentcap: could not read a stream event", exc_info=True)
            self.broken = True

    @staticmethod
    def _delta(block: _Block, delta: Any) -> None:
        kind = _get(delta, "type")
        if kind == "text_delta":
            block.text.append(_text(delta, "text"))
        elif kind == "input_json_delta":
            block.json.append(_text(delta, "partial_json"))
        elif kind == "thinking_delta":
            block.thinking.append(_text(delta, "thinking"))
        elif kind == "signature_delta":
            block.signature = _text(delta, "signature")
        elif kind == "citations_delta":
            citation = _get(delta, "citation")
            block.citations.append(_plain(citation) or citation)
        elif kind == "compaction_delta":
            block.fields["content"] = _get(delta, "content")
            block.fields["encrypted_content"] = _get(delta, "encrypted_content")

    def blocks(self) -> list[dict[str, Any]] | None:
        """The content blocks in index order (tool input parsed), or None when an event could not
        be read or a tool input is not JSON."""
        if self.broken:
            return None
        try:
            return [self._blocks[index].build() for index in sorted(self._blocks)]
        except Exception:
            _logger.debug("agentcap: could not build a streamed Message", exc_info=True)
            return None
