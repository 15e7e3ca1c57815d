"""The old import path of :mod:`otel_agentcap.pipeline.stamping`: its names, re-exported."""

from otel_agentcap.pipeline.stamping import (
    Stamp,
    stamp,
)

__all__ = [
    "Stamp",
    "stamp",
]
