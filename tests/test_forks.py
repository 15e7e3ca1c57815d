"""A process forked while another thread holds one of the capture path's locks can still capture."""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

import otel_agentcap as oa
from otel_agentcap.capture.runs import recorded_runs
from otel_agentcap.capture.tools import invocations
from otel_agentcap.clock import clocks
from otel_agentcap.context import current_agent
from otel_agentcap.pipeline import causal_links
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor, span_processors_of
from otel_agentcap.runs import lifetimes
from otel_agentcap.testing import capture_events

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only"),
]

RUN = "run-fork-locks"
AGENT = "forking-agent"
#: How long the child gives its captured operations before it reports them stuck.
CHILD_PATIENCE_S = 30.0


@oa.tool
def add(a: int, b: int) -> int:
    return a + b


memory = oa.Memory("fork-locks")


def _agentcap_processor() -> AgentCapSpanProcessor:
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    (processor,) = [
        p for p in span_processors_of(provider) or () if isinstance(p, AgentCapSpanProcessor)
    ]
    return processor


def _agent_id() -> str:
    agent = current_agent()
    assert agent is not None
    return agent.agent_id


#: Each a lock of the capture path that another thread of the parent may hold when it forks.
LOCKS: dict[str, Callable[[], Any]] = {
    "clock registry": lambda: clocks._lock,
    "the agent's clock": lambda: clocks.get(RUN, _agent_id())._lock,
    "run lifetimes": lambda: lifetimes._lock,
    "recorded runs": lambda: recorded_runs._lock,
    "the agent's tool invocations": lambda: invocations._runs[RUN][_agent_id()].lock,
    "causal links": lambda: causal_links._by_tool_use._lock,
    "memory": lambda: memory._lock,
    "span processor": lambda: _agentcap_processor()._open_lock,
}


@contextmanager
def _held_by_another_thread(lock: Any) -> Iterator[None]:
    acquired = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with lock:
            acquired.set()
            release.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert acquired.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join()


def _capture_in_child() -> None:
    """What a pool worker forked inside an agent does: capture in that agent, then in a new run."""
    add.invoke("in-child", 1, 2)
    memory.set("key", "from the child")
    # A model call recorded by an add-on GenAI instrumentation.
    attributes = {"gen_ai.operation.name": "chat"}
    with trace.get_tracer("addon.instrumentation").start_as_current_span(
        "chat", attributes=attributes
    ):
        pass
    with oa.run(f"{RUN}-child"), oa.agent("child-agent"):
        add.invoke("in-child", 3, 4)
        memory.set("key", "from the child's run")
        with oa.agent("second-child-agent"):
            pass


def _forked_child_finishes(work: Callable[[], None]) -> bool:
    """Fork; the child runs ``work`` (in this thread's context) on a thread of its own and exits
    with 0 when it finished, 1 when it did not within ``CHILD_PATIENCE_S``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        finished = threading.Event()
        context = contextvars.copy_context()

        def run() -> None:
            context.run(work)
            finished.set()

        threading.Thread(target=run, daemon=True).start()
        os._exit(0 if finished.wait(CHILD_PATIENCE_S) else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("held", list(LOCKS))
def test_a_child_forked_while_a_capture_lock_is_held_captures(held: str) -> None:
    """Forked while another thread holds the lock, the child still captures tool calls, memory
    writes, new runs and agents (each lock is renewed in the child)."""
    with capture_events(), oa.run(RUN), oa.agent(AGENT):
        add.invoke("in-parent", 1, 1)
        memory.set("key", "from the parent")
        with _held_by_another_thread(LOCKS[held]()):
            assert _forked_child_finishes(_capture_in_child), f"stuck on the {held} lock"
        # The parent goes on as before.
        add.invoke("after-fork", 2, 2)
