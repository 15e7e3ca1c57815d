"""A local, read-only web view of the event log (``otel-agentcap ui``) and its single-file HTML
export (``otel-agentcap export RUN --format html``).

A run is drawn as one lane per agent, ordered by the spawn tree, with events placed by logical
sequence and causal edges between them. The server sends a run's graph (ids, sequences, types,
parent indexes: no payloads), labels for the window on screen and one event's payload when it is
opened; the browser computes causal closures on the graph's arrays.
"""
