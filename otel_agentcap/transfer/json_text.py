"""Writing a JSON document piece by piece: the exports that stream ``otlp-json`` and
``jaeger-json`` write a span at a time, in the bytes ``json.dumps`` with compact separators gives
for the whole document."""

from __future__ import annotations

import json
from typing import Any, BinaryIO


def compact(value: Any) -> str:
    """``value`` as compact JSON text (no spaces, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class TextOut:
    """Text written to a binary file as UTF-8, counting the bytes written (``size``)."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self.size = 0

    def emit(self, text: str) -> None:
        data = text.encode()
        self._out.write(data)
        self.size += len(data)
