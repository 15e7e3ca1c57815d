"""The durable local queue between the span processor and PostgreSQL.

Ended spans that carry agentcap events are appended to segment files on local disk by the thread
that ends them (``processor``, ``queue``, ``segments``, ``frames``, ``records``), delivered to
PostgreSQL by a background thread (``delivery``), and acknowledged once stored. The queue
directory is shared by the processes of a host (``directory``): each writes a queue of its own,
and a later process adopts and delivers what ended ones left. It also holds the host's sequence
floors, which give sequence blocks while PostgreSQL is down (``host_sequences``).
"""

from otel_agentcap.exporters.durable.directory import QueueDirectory, default_base_dir
from otel_agentcap.exporters.durable.processor import (
    DurableSpanProcessor,
    QueueSettings,
    ShutdownReport,
)

__all__ = [
    "DurableSpanProcessor",
    "QueueDirectory",
    "QueueSettings",
    "ShutdownReport",
    "default_base_dir",
]
