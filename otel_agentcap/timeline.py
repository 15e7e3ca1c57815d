"""The old import path of :mod:`otel_agentcap.cli.timeline`: its names, re-exported."""

from otel_agentcap.cli.timeline import (
    Line,
    Totals,
    event_positions,
    layout,
    parent_text,
    summary,
    totals,
)

__all__ = [
    "Line",
    "Totals",
    "event_positions",
    "layout",
    "parent_text",
    "summary",
    "totals",
]
