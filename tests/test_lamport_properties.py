"""Property tests of invariants 1 and 2 over random multi-agent programs.

Random programs run several workers at once, each a thread or an asyncio task acting as one of a
few agents (several workers may share an agent), doing tool calls and retries, reads, writes and
deletes of shared memory keys, foreign model-call spans, spawns (children run inline or in another
thread) and nested agents. Over the captured events of each program:

* per (run, agent), sequences are unique, and strictly increasing in each thread's program order;
* every causal parent of every event was captured and has a smaller sequence.

Program order is observed by a span processor that runs on the thread doing the work: a span's
primary event is recorded in ``on_start`` and its closing event (``agentcap.outcome``) in ``on_end``,
both immediately after the sequence was allocated on that thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import uuid
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

import otel_agentcap as oa
from otel_agentcap import attributes as attr
from otel_agentcap.testing import capture_events
from otel_agentcap.testing._capture import _ensure_installed

pytestmark = pytest.mark.timeout(120)

AGENTS = ("a", "b", "c")
KEYS = ("k1", "k2", "k3")


class ProgramOrder(SpanProcessor):
    """Records (thread, run, agent, seq) in the order events are stamped on each thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[tuple[int, str, str, int]] = []
        #: Spans whose stamp on_start did not see yet: their index in ``records``.
        self.pending: dict[int, int] = {}
        self.active = False

    def _add(self, run_id: Any, agent_id: Any, seq: Any) -> None:
        if self.active:
            with self.lock:
                self.records.append((threading.get_ident(), str(run_id), str(agent_id), int(seq)))

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        a = span.attributes or {}
        if attr.EVENT_SEQ in a:
            self._add(a[attr.RUN_ID], a[attr.AGENT_ID], a[attr.EVENT_SEQ])
        elif attr.EVENT_ID in a and self.active:
            # A tool span starts with its event id only; the rest of its stamp is written right
            # after, on this thread: its place in program order is taken now, filled in at the end.
            with self.lock:
                self.pending[span.get_span_context().span_id] = len(self.records)
                self.records.append((threading.get_ident(), "", "", -1))

    def on_end(self, span: ReadableSpan) -> None:
        owner = span.attributes or {}  # a closing event takes run and agent from its span
        context = span.get_span_context()
        if self.pending and context is not None:
            with self.lock:
                index = self.pending.pop(context.span_id, None)
                if index is not None and index < len(self.records):
                    thread_id = self.records[index][0]
                    self.records[index] = (
                        thread_id,
                        str(owner[attr.RUN_ID]),
                        str(owner[attr.AGENT_ID]),
                        int(owner[attr.EVENT_SEQ]),  # type: ignore[arg-type]
                    )
        if attr.OUTCOME in owner:
            record = json.loads(str(owner[attr.OUTCOME]))
            self._add(owner[attr.RUN_ID], owner[attr.AGENT_ID], record["seq"])


_order = ProgramOrder()
_install_lock = threading.Lock()
_installed = False


def _install() -> ProgramOrder:
    global _installed
    with _install_lock:
        if not _installed:
            _ensure_installed()
            provider = trace.get_tracer_provider()
            provider.add_span_processor(_order)  # type: ignore[attr-defined]
            _installed = True
    return _order


@oa.tool
def echo(x: Any) -> Any:
    return x


@oa.tool
async def aecho(x: Any) -> Any:
    await asyncio.sleep(0)
    return x


_foreign = trace.get_tracer("property.foreign")

leaf_op = st.one_of(
    st.tuples(st.just("tool")),
    st.tuples(st.just("tool_id")),
    st.tuples(st.just("retry")),
    st.tuples(st.just("read"), st.sampled_from(KEYS)),
    st.tuples(st.just("write"), st.sampled_from(KEYS), st.integers(0, 3)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("model")),
    st.tuples(st.just("yield")),
)
leaf_ops = st.lists(leaf_op, max_size=4)
op = st.one_of(
    leaf_op,
    st.tuples(
        st.just("spawn"),
        st.sampled_from(("s1", "s2")),
        st.sampled_from(("inline", "thread")),
        leaf_ops,
    ),
    st.tuples(st.just("nested"), st.sampled_from(AGENTS), leaf_ops),
)
worker = st.tuples(
    st.sampled_from(AGENTS), st.sampled_from(("thread", "task")), st.lists(op, max_size=8)
)
program = st.lists(worker, min_size=1, max_size=5)


class Runner:
    def __init__(self, memory: oa.Memory) -> None:
        self.memory = memory
        self.ids = itertools.count()

    def _leaf_sync(self, op: tuple[Any, ...], last: list[str]) -> None:
        kind = op[0]
        if kind == "tool":
            echo(1)
        elif kind == "tool_id":
            last.append(f"inv-{next(self.ids)}")
            echo.invoke(last[-1], 2)
        elif kind == "retry":
            if last:
                echo.invoke(last[-1], 2)  # the same call again: replayed
        elif kind == "read":
            self.memory.lookup(op[1])
        elif kind == "write":
            self.memory[op[1]] = op[2]
        elif kind == "delete":
            self.memory.delete(op[1])
        elif kind == "model":
            _foreign.start_span("chat m", attributes={attr.GEN_AI_OPERATION_NAME: "chat"}).end()
        elif kind == "yield":
            threading.Event().wait(0.0005)

    def run_sync(self, ops: list[tuple[Any, ...]]) -> None:
        last: list[str] = []
        for op in ops:
            if op[0] == "spawn":
                child = oa.spawn("child", key=op[1])
                if op[2] == "inline":
                    with child.scope():
                        self.run_sync(op[3])
                else:
                    thread = threading.Thread(target=self._child_thread, args=(child, op[3]))
                    thread.start()
                    thread.join()
            elif op[0] == "nested":
                with oa.agent(op[1]):
                    self.run_sync(op[2])
            else:
                self._leaf_sync(op, last)

    def _child_thread(self, child: oa.Agent, ops: list[tuple[Any, ...]]) -> None:
        with child.scope():
            self.run_sync(ops)

    async def run_async(self, ops: list[tuple[Any, ...]]) -> None:
        last: list[str] = []
        for op in ops:
            kind = op[0]
            if kind == "spawn":
                child = oa.spawn("child", key=op[1])
                if op[2] == "inline":
                    async with child.scope():
                        await self.run_async(op[3])
                else:
                    await asyncio.to_thread(self._child_thread, child, op[3])
            elif kind == "nested":
                async with oa.agent(op[1]):
                    await self.run_async(op[2])
            elif kind == "tool":
                await aecho(1)
            elif kind == "tool_id":
                last.append(f"inv-{next(self.ids)}")
                await aecho.invoke(last[-1], 2)
            elif kind == "retry":
                if last:
                    await aecho.invoke(last[-1], 2)  # the same call again: replayed
            elif kind == "yield":
                await asyncio.sleep(0)
            else:
                self._leaf_sync(op, last)


def _execute(workers: list[tuple[str, str, list[tuple[Any, ...]]]]) -> None:
    runner = Runner(oa.Memory("shared"))
    barrier = threading.Barrier(1 + sum(1 for w in workers if w[1] == "thread"))

    def thread_worker(name: str, ops: list[tuple[Any, ...]]) -> None:
        barrier.wait()
        with oa.agent(name):
            runner.run_sync(ops)

    async def task_worker(name: str, ops: list[tuple[Any, ...]]) -> None:
        async with oa.agent(name):
            await asyncio.sleep(0)
            await runner.run_async(ops)

    async def tasks() -> None:
        await asyncio.gather(
            *(task_worker(name, ops) for name, mode, ops in workers if mode == "task")
        )

    threads = [
        oa.start_thread(thread_worker, name, ops) for name, mode, ops in workers if mode == "thread"
    ]
    barrier.wait()
    asyncio.run(tasks())
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program)
def test_random_programs_keep_lamport_invariants(workers):
    """Per (run, agent) sequences are unique and increase in each thread's program order, and
    every causal parent was captured with a smaller sequence."""
    order = _install()
    run_id = f"prop-{uuid.uuid4().hex[:12]}"
    with capture_events() as captured:
        order.active = True
        try:
            with oa.run(run_id):
                _execute(workers)
        finally:
            order.active = False
    events = [e for e in captured.events if e.run_id == run_id]
    records = [r for r in order.records if r[1] == run_id]
    order.records.clear()
    order.pending.clear()

    # Invariant 1: unique per (run, agent) ...
    per_agent: dict[str, list[int]] = defaultdict(list)
    for event in events:
        per_agent[event.agent_id].append(event.seq)
    for agent_id, seqs in per_agent.items():
        assert len(seqs) == len(set(seqs)), f"repeated sequence in {agent_id}"
    assert len({e.event_id for e in events}) == len(events)

    # ... and strictly increasing in program order on every thread.
    assert sorted((r[2], r[3]) for r in records) == sorted((e.agent_id, e.seq) for e in events)
    per_thread: dict[tuple[int, str], list[int]] = defaultdict(list)
    for thread_id, _, agent_id, seq in records:
        per_thread[(thread_id, agent_id)].append(seq)
    for key, seqs in per_thread.items():
        assert all(x < y for x, y in itertools.pairwise(seqs)), f"out of program order on {key}"

    # Invariant 2: every causal parent exists and is earlier.
    by_id = {e.event_id: e for e in events}
    for event in events:
        for parent_id in event.causal_parent_ids:
            assert parent_id in by_id, f"{event.event_type} names an uncaptured parent"
            assert by_id[parent_id].seq < event.seq

    # Every agent execution is bracketed by its start and end.
    assert len([e for e in events if e.event_type == "agent_start"]) == len(
        [e for e in events if e.event_type == "agent_end"]
    )


def test_harness_captures_every_kind_of_event():
    """A fixed program through the same harness yields the expected events, so the property above
    is not vacuous."""
    order = _install()
    run_id = f"prop-{uuid.uuid4().hex[:12]}"
    ops = [
        ("tool",),
        ("tool_id",),
        ("retry",),
        ("write", "k1", 1),
        ("read", "k1"),
        ("model",),
        ("delete", "k1"),
        ("spawn", "s1", "thread", [("read", "k2")]),
        ("nested", "b", [("write", "k2", 2)]),
    ]
    with capture_events() as captured:
        order.active = True
        try:
            with oa.run(run_id):
                _execute([("a", "thread", ops), ("c", "task", ops)])
        finally:
            order.active = False
    recorded = [r for r in order.records if r[1] == run_id]
    order.records.clear()
    order.pending.clear()
    events = [e for e in captured.events if e.run_id == run_id]
    counts: dict[str, int] = defaultdict(int)
    for event in events:
        counts[event.event_type] += 1
    assert counts == {
        "agent_start": 6,
        "agent_end": 6,
        "tool_invocation": 4,
        "tool_result": 4,
        "memory_write": 6,
        "memory_read": 4,
        "model_call": 2,
        "agent_spawn": 2,
    }
    assert len(recorded) == len(events)


timed_leaf = st.one_of(
    st.tuples(st.just("tool")),
    st.tuples(st.just("tool_id")),
    st.tuples(st.just("read"), st.sampled_from(KEYS)),
    st.tuples(st.just("write"), st.sampled_from(KEYS)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
)
timed_op = st.one_of(
    timed_leaf,
    st.tuples(st.just("nested"), st.sampled_from(AGENTS), st.lists(timed_leaf, max_size=4)),
    st.tuples(st.just("spawn"), st.sampled_from(("s1", "s2")), st.lists(timed_leaf, max_size=4)),
)
timed_worker = st.tuples(
    st.sampled_from(AGENTS), st.lists(timed_op, max_size=6), st.none() | st.integers(0, 1000)
)


def _with_gate(ops: list[tuple[Any, ...]], cut: int) -> list[tuple[Any, ...]]:
    """``ops`` with a ("gate",) op at slot ``cut`` (modulo the slots), top level or inside a
    nested or spawned block."""
    slots = len(ops) + 1 + sum(len(op[2]) + 1 for op in ops if op[0] in ("nested", "spawn"))
    at = cut % slots
    out: list[tuple[Any, ...]] = []
    for op in ops:
        if at == 0:
            out.append(("gate",))
        at -= 1
        if op[0] in ("nested", "spawn"):
            inner = list(op[2])
            if 0 <= at <= len(inner):
                inner.insert(at, ("gate",))
            at -= len(op[2]) + 1
            out.append((op[0], op[1], inner))
        else:
            out.append(op)
    if at == 0:
        out.append(("gate",))
    return out


class _Gate:
    def __init__(self) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self.records_at_gate = 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(timed_worker, min_size=1, max_size=4))
def test_timed_out_executions_keep_lamport_invariants_and_act_no_more(workers):
    """Executions abandoned as timed out at any point (also inside a nested agent or an inline
    spawned child), while other agents go on, keep invariants 1 and 2; the abandoned thread then
    records nothing but the failures of the agents it had open, every capture call it makes
    raises AgentCancelled, and the memory ends as the chain of recorded writes says."""
    order = _install()
    run_id = f"prop-{uuid.uuid4().hex[:12]}"
    memory = oa.Memory("timed")
    values = itertools.count()
    ids = itertools.count()
    gates: dict[int, _Gate] = {}
    leaked: list[str] = []

    def leaf(op: tuple[Any, ...], gate: _Gate | None) -> None:
        kind = op[0]
        if kind == "gate":
            assert gate is not None
            with order.lock:
                gate.records_at_gate = sum(1 for r in order.records if r[0] == me())
            gate.reached.set()
            assert gate.release.wait(30)
            return
        try:
            if kind == "tool":
                echo(1)
            elif kind == "tool_id":
                echo.invoke(f"inv-{next(ids)}", 2)
            elif kind == "read":
                memory.lookup(op[1])
            elif kind == "write":
                memory[op[1]] = next(values)
            elif kind == "delete":
                memory.delete(op[1])
        except oa.AgentCancelled:
            pass
        else:
            if gate is not None and gate.release.is_set():
                leaked.append(f"{kind} after the timeout")

    def me() -> int:
        return threading.get_ident()

    def block(ops: list[tuple[Any, ...]], gate: _Gate | None) -> None:
        for op in ops:
            if op[0] in ("nested", "spawn"):
                try:
                    if op[0] == "nested":
                        scope = oa.agent(op[1])
                    else:
                        scope = oa.spawn("child", key=op[1]).scope()
                    with scope:
                        block(op[2], gate)
                except oa.AgentCancelled:
                    pass
            else:
                leaf(op, gate)

    scopes: list[Any] = []
    threads: list[threading.Thread] = []
    with capture_events() as captured:
        order.active = True
        try:
            with oa.run(run_id):
                for index, (name, ops, cut) in enumerate(workers):
                    gate = None if cut is None else _Gate()
                    if gate is not None:
                        ops = _with_gate(ops, cut)
                        gates[index] = gate
                    scope = oa.agent(name).agent.scope()
                    scopes.append(scope)

                    def target(scope: Any = scope, ops: Any = ops, gate: Any = gate) -> None:
                        try:
                            with scope:
                                block(ops, gate)
                        except oa.AgentCancelled:
                            pass

                    threads.append(oa.start_thread(target))
                for index, gate in gates.items():
                    assert gate.reached.wait(30)
                    scopes[index].abandon(oa.AgentTimeoutError("abandoned by the test"))
                    gate.release.set()
                for thread in threads:
                    thread.join(30)
                    assert not thread.is_alive()
        finally:
            order.active = False
    events = [e for e in captured.events if e.run_id == run_id]
    records = [r for r in order.records if r[1] == run_id]
    order.records.clear()
    order.pending.clear()
    assert leaked == []

    # Invariants 1 and 2.
    per_agent: dict[str, list[int]] = defaultdict(list)
    for event in events:
        per_agent[event.agent_id].append(event.seq)
    for agent_id, seqs in per_agent.items():
        assert len(seqs) == len(set(seqs)), f"repeated sequence in {agent_id}"
    per_thread: dict[tuple[int, str], list[int]] = defaultdict(list)
    for thread_id, _, agent_id, seq in records:
        per_thread[(thread_id, agent_id)].append(seq)
    for key, seqs in per_thread.items():
        assert all(x < y for x, y in itertools.pairwise(seqs)), f"out of program order on {key}"
    by_id = {e.event_id: e for e in events}
    for event in events:
        for parent_id in event.causal_parent_ids:
            assert parent_id in by_id, f"{event.event_type} names an uncaptured parent"
            assert by_id[parent_id].seq < event.seq

    # After its timeout, an abandoned thread records only the failures of the agents it had open.
    by_seq = {(e.agent_id, e.seq): e for e in events}
    for index, gate in gates.items():
        thread_id = threads[index].ident
        after = [r for r in records if r[0] == thread_id][gate.records_at_gate :]
        kinds = [by_seq[(r[2], r[3])].event_type for r in after]
        assert set(kinds) <= {"agent_error"}, kinds

    # Every execution ends once; the memory is what its chain of recorded writes says.
    starts = sum(1 for e in events if e.event_type == "agent_start")
    ends = sum(1 for e in events if e.event_type in ("agent_end", "agent_error"))
    assert starts == ends
    writes = [e for e in events if e.event_type == "memory_write"]
    named = {p for w in writes for p in w.causal_parent_ids}
    final = memory.snapshot()
    for key in KEYS:
        heads = [w for w in writes if w.payload["key"] == key and w.event_id not in named]
        if not heads:
            assert key not in final
            continue
        (head,) = heads
        if head.payload["after_found"]:
            assert final[key] == head.payload["after"]
        else:
            assert key not in final
