"""Synthetic runs of any size, for tests and benchmarks of the read side (the web view).

:func:`synthetic_run` builds the ``Batch`` es of one run that keeps the log's invariants: a root
agent spawns ``agents - 1`` children; each agent calls a model, runs the tool it asked for, sends
the result back, and now and then writes shared memory that another agent reads later (a causal
link across agents). Sequences follow the Lamport rule. Deterministic for a given size.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from otel_agentcap.model import AgentRecord, Batch, Event, RunRecord, event_id_for

_START = datetime(2026, 1, 1, tzinfo=UTC)


def synthetic_run(
    run_id: str,
    events: int,
    agents: int = 8,
    batch: int = 2_000,
    start: datetime = _START,
) -> Iterator[Batch]:
    """Batches holding exactly ``events`` events of ``run_id`` (at most ``batch`` per batch)."""
    if agents < 1 or events < 3 * agents - 1:
        raise ValueError("need at least 3 * agents - 1 events (start, spawn and end of each)")
    rng = random.Random(f"{run_id}:{events}:{agents}")
    clock: dict[str, int] = {}
    made: list[Event] = []
    records: list[AgentRecord] = []
    writes: list[Event] = []
    count = 0

    def emit(
        agent: str,
        kind: str,
        payload: dict[str, object],
        parents: tuple[Event, ...] = (),
        key: str | None = None,
    ) -> Event:
        nonlocal count
        seq = max([clock.get(agent, 0), *(p.seq for p in parents)]) + 1
        clock[agent] = seq
        idem = key or f"seq:{seq}"
        event = Event(
            event_id=event_id_for(run_id, agent, idem),
            run_id=run_id,
            agent_id=agent,
            seq=seq,
            event_type=kind,
            idempotency_key=idem,
            wall_time=start + timedelta(milliseconds=count),
            causal_parent_ids=tuple(p.event_id for p in parents),
            payload=payload,
            trace_id=f"{rng.getrandbits(128):032x}",
            span_id=f"{rng.getrandbits(64):016x}",
        )
        count += 1
        made.append(event)
        return event

    root = "root"
    records.append(AgentRecord(run_id, root, "root"))
    emit(root, "agent_start", {"name": "root"})
    names = [root]
    for n in range(1, agents):
        child = f"{root}/worker:{n}"
        spawn = emit(
            root,
            "agent_spawn",
            {"child_agent_id": child, "child_name": "worker"},
            key=f"spawn:{child}",
        )
        records.append(AgentRecord(run_id, child, "worker", root, spawn.event_id))
        emit(child, "agent_start", {"name": "worker"}, (spawn,))
        names.append(child)
    last_call: dict[str, Event] = {}
    step = 0
    while count < events - len(names) - 1:
        agent = names[step % len(names)]
        step += 1
        phase = step // len(names) % 4
        if phase == 0 or agent not in last_call:
            previous = last_call.get(agent)
            parents = (
                (previous,) if previous is not None and previous.event_type == "tool_result" else ()
            )
            call = emit(
                agent,
                "model_call",
                {
                    "model": "claude-sonnet-4-5",
                    "status": "ok",
                    "stop_reason": "tool_use",
                    "usage": {"input_tokens": 100 + step % 50, "output_tokens": 20 + step % 7},
                    "tool_use_ids": [f"toolu_{step:08d}"],
                    "latency_ms": 12.5,
                    "response_id": f"msg_{run_id}_{step:08d}",
                },
                parents,
            )
            last_call[agent] = call
        elif phase == 1:
            call = last_call[agent]
            invocation = f"toolu_{step:08d}"
            inv = emit(
                agent,
                "tool_invocation",
                {
                    "tool": "search",
                    "invocation_id": invocation,
                    "arguments": {"query": f"topic {step}"},
                },
                (call,),
                key=f"tool:{invocation}:invocation",
            )
            last_call[agent] = emit(
                agent,
                "tool_result",
                {"tool": "search", "invocation_id": invocation, "result": [f"source {step}"]},
                (inv, call),
                key=f"tool:{invocation}:result",
            )
        elif phase == 2:
            writes.append(
                emit(
                    agent,
                    "memory_write",
                    {
                        "memory": "shared",
                        "key": f"k{step}",
                        "op": "set",
                        "after": f"value {step}",
                        "before_found": False,
                        "after_found": True,
                    },
                )
            )
        elif writes:
            seen = writes[rng.randrange(max(0, len(writes) - 16), len(writes))]
            emit(
                agent,
                "memory_read",
                {
                    "memory": "shared",
                    "key": seen.payload["key"],
                    "found": True,
                    "value": seen.payload["after"],
                    "written_by": seen.event_id,
                },
                (seen,),
            )
    if count < events - len(names):  # the last step made one event fewer than a tool call
        writes.append(
            emit(
                root,
                "memory_write",
                {"memory": "shared", "key": "last", "op": "set", "after": 0, "after_found": True},
            )
        )
    for agent in names:
        emit(agent, "agent_end", {"state_committed": True})
    run = RunRecord(run_id, start)
    for first in range(0, len(made), batch):
        yield Batch(
            events=tuple(made[first : first + batch]),
            agents=tuple(records) if first == 0 else (),
            runs=(run,),
        )


def write_batches(dsn: str, batches: Iterator[Batch] | list[Batch]) -> int:
    """Store ``batches`` with an :class:`EventWriter`; returns the number of events inserted."""
    from psycopg_pool import ConnectionPool

    from otel_agentcap.exporters.postgres.writer import EventWriter

    inserted = 0
    with ConnectionPool(dsn, min_size=1, max_size=1, kwargs={"autocommit": False}) as pool:
        writer = EventWriter(pool)
        try:
            for batch in batches:
                inserted += writer.write(batch).inserted
        finally:
            writer.close()
    return inserted
