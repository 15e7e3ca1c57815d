"""Runs: the root span, run identity (a claimed run id continues only when the caller says so),
and carrying a run to another process."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import uuid

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

import otel_agentcap as ac
from otel_agentcap import attributes as attr
from otel_agentcap.capture.runs import RunCarrier, forget_runs
from otel_agentcap.model import validate_id
from otel_agentcap.testing import capture_events


def _run_id() -> str:
    return f"runs-{uuid.uuid4().hex[:12]}"


def _by_name(spans, prefix):
    return [s for s in spans if s.name.startswith(prefix)]


def test_run_opens_a_root_span_that_parents_its_top_level_agents():
    """ac.run opens invoke_workflow {run id}; agents in it, in threads and tasks too, are its
    children, in its trace."""
    run_id = _run_id()
    with capture_events() as captured, ac.run(run_id):
        with ac.agent("a"):
            pass
        ac.ContextThreadPoolExecutor(1).submit(lambda: ac.agent("b").__enter__()).result()
    (root,) = _by_name(captured.spans, "invoke_workflow")
    assert root.name == f"invoke_workflow {run_id}"
    assert root.parent is None
    assert root.attributes[attr.RUN_ID] == run_id
    assert root.attributes[attr.GEN_AI_OPERATION_NAME] == "invoke_workflow"
    agents = _by_name(captured.spans, "invoke_agent")
    assert {s.name for s in agents} >= {"invoke_agent a"}
    for span in agents:
        assert span.context.trace_id == root.context.trace_id
        assert span.parent is not None and span.parent.span_id == root.context.span_id


def test_a_run_id_opened_before_needs_resume_and_resume_joins_its_trace():
    """Opening a run id again raises RunExistsError; with resume=True it continues under the
    same root span (no second root span), in the same trace."""
    run_id = _run_id()
    with capture_events() as captured:
        with ac.run(run_id), ac.agent("first"):
            pass
        with pytest.raises(ac.RunExistsError, match="resume=True"), ac.run(run_id):
            pass
        with ac.run(run_id, resume=True), ac.agent("second"):
            pass
    (root,) = _by_name(captured.spans, "invoke_workflow")
    (second,) = _by_name(captured.spans, "invoke_agent second")
    assert second.context.trace_id == root.context.trace_id
    assert second.parent is not None and second.parent.span_id == root.context.span_id
    assert {e.run_id for e in captured.events} == {run_id}


def test_resume_of_an_unknown_run_starts_it():
    """resume=True on a run id nobody opened starts the run, with its root span."""
    run_id = _run_id()
    with capture_events() as captured, ac.run(run_id, resume=True), ac.agent("a"):
        pass
    assert len(_by_name(captured.spans, "invoke_workflow")) == 1


def test_generated_run_ids_are_fresh():
    """run() without an id generates run- and 16 hex digits, a new one each time."""
    seen = set()
    for _ in range(3):
        with ac.run() as run:
            assert re.fullmatch(r"run-[0-9a-f]{16}", run.run_id)
            seen.add(run.run_id)
    assert len(seen) == 3


def test_entering_the_current_run_again_continues_it():
    """A nested run() of the run that is current is the same run, not a new claim."""
    run_id = _run_id()
    with capture_events() as captured, ac.run(run_id), ac.run(run_id) as inner, ac.agent("a"):
        assert inner.run_id == run_id
    assert len(_by_name(captured.spans, "invoke_workflow")) == 1


ids = st.text(min_size=1, max_size=60).filter(
    lambda s: s.strip() and "\x00" not in s and "\x1f" not in s
)


@given(run_id=ids, trace_id=st.integers(1, 2**128 - 1), span_id=st.integers(1, 2**64 - 1))
def test_a_carried_context_round_trips_through_its_dict_and_string(run_id, trace_id, span_id):
    """RunCarrier.to_dict / to_string read back to the same run and span (any run id)."""
    try:
        validate_id(run_id, "run_id")
    except ValueError:
        return
    from opentelemetry.trace import SpanContext, TraceFlags

    carrier = RunCarrier(
        run_id, SpanContext(trace_id, span_id, True, TraceFlags(TraceFlags.SAMPLED))
    )
    for form in (carrier.to_dict(), carrier.to_string()):
        back = RunCarrier.parse(form)
        assert back.run_id == run_id
        assert back.span_context is not None
        assert (back.span_context.trace_id, back.span_context.span_id) == (trace_id, span_id)
    assert set(carrier.to_dict()) == {"traceparent", "baggage"}


def test_a_carried_context_continues_the_run_under_the_carried_span():
    """run(context=...) continues the carried run without a claim: its agents run under the span
    where the context was taken, in the run's trace."""
    run_id = _run_id()
    with capture_events() as captured:
        with ac.run(run_id), ac.agent("sender"):
            carried = ac.run_context().to_string()
        forget_runs()  # as in another process
        with ac.run(context=carried) as run, ac.agent("receiver"):
            assert run.run_id == run_id
    (sender,) = _by_name(captured.spans, "invoke_agent sender")
    (receiver,) = _by_name(captured.spans, "invoke_agent receiver")
    assert receiver.context.trace_id == sender.context.trace_id
    assert receiver.parent is not None and receiver.parent.span_id == sender.context.span_id
    assert len(_by_name(captured.spans, "invoke_workflow")) == 1


def test_a_carried_context_must_name_a_run():
    """A context without the run id, or one that is not a carrier at all, is a clear error."""
    with pytest.raises(ValueError, match="names no run"), ac.run(context={"traceparent": "x"}):
        pass
    with pytest.raises(ValueError, match="not a carried run context"), ac.run(context="nope"):
        pass
    with pytest.raises(RuntimeError, match="inside a run"):
        ac.run_context()


def test_a_carrier_built_by_hand_is_checked_when_built():
    """RunCarrier(...) built in code checks its run id and span context as a parsed one does, so
    a wrong one fails where it is made, not as an AssertionError (or worse, under python -O)
    when the run opens."""
    with pytest.raises(TypeError, match="must be a str"):
        RunCarrier(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        RunCarrier("")
    with pytest.raises(TypeError, match="SpanContext"):
        RunCarrier("r", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a str"), ac.run(context=RunCarrier(None)):  # type: ignore[arg-type]
        pass


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero span id
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
        "",
    ],
)
def test_a_carried_traceparent_that_is_not_valid_is_a_clear_error(traceparent):
    """A traceparent that is present but cannot be read would leave the receiver's spans
    outside the run's trace: it is an error, not ignored."""
    carried = {"traceparent": traceparent, "baggage": "agentcap.run.id=r"}
    with pytest.raises(ValueError, match="not a valid W3C traceparent"):
        RunCarrier.from_dict(carried)
    with pytest.raises(ValueError, match="not a valid W3C traceparent"), ac.run(context=carried):
        pass


def test_a_carried_run_id_that_is_not_utf8_is_a_clear_error():
    """A run id whose percent-encoding is not UTF-8 is refused, not read as another run id
    (U+FFFD in place of the bytes)."""
    with pytest.raises(ValueError, match="not percent-encoded UTF-8"):
        RunCarrier.from_dict({"baggage": "agentcap.run.id=run-%FF%FE"})
    assert RunCarrier.from_dict({"baggage": "agentcap.run.id=r%C3%A9"}).run_id == "r\u00e9"


_PROCESS = textwrap.dedent(
    """
    import sys
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    dsn, run_id, mode = sys.argv[1:4]
    provider = configure(dsn, announce=False)
    try:
        if mode == "carried":  # a context taken where no span was recording: the run id only
            scope = ac.run(context={"baggage": ac.RunCarrier(run_id).to_dict()["baggage"]})
        elif mode == "carried-span":  # a context carried with a span, from wherever
            scope = ac.run(context=sys.argv[4])
        elif mode == "carried-then-resumed":  # continued from a carried span, then by id
            with ac.run(context=sys.argv[4]), ac.agent("agent-carried"):
                pass
            scope = ac.run(run_id, resume=True)
        else:
            scope = ac.run(run_id, resume=(mode == "resume"))
        with scope, ac.agent(f"agent-{mode}"):
            if mode == "new":
                print(ac.run_context().to_string())
    except ac.RunExistsError as exc:
        print(f"RunExistsError: {exc}")
        sys.exit(3)
    finally:
        provider.shutdown()
    """
)


def _stored_trace(dsn: str, run_id: str) -> tuple[str, str, list[tuple[str, str, str, str]]]:
    """The run's stored trace id and root span id, and its span envelopes as (name, span id,
    parent span id, trace id)."""
    with psycopg.connect(dsn) as conn:
        trace_id, root = conn.execute(
            "SELECT trace_id, root_span_id FROM agentcap.runs WHERE run_id = %s", (run_id,)
        ).fetchone()
        spans = conn.execute(
            "SELECT name, span_id, parent_span_id, trace_id FROM agentcap.spans WHERE run_id = %s",
            (run_id,),
        ).fetchall()
    return trace_id, root, spans


def _process(dsn: str, run_id: str, mode: str, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROCESS, dsn, run_id, mode, *more],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.storage
@pytest.mark.multiprocess
def test_a_stored_run_is_not_merged_into_by_another_process(pg_dsn):
    """A second process opening a stored run id fails with RunExistsError and stores nothing;
    with resume=True it continues the run in its trace, under the stored root span."""
    run_id = _run_id()
    first = _process(pg_dsn, run_id, "new")
    assert first.returncode == 0, first.stderr
    again = _process(pg_dsn, run_id, "again")
    assert again.returncode == 3, again.stderr
    assert "already exists in the event log" in again.stdout
    resumed = _process(pg_dsn, run_id, "resume")
    assert resumed.returncode == 0, resumed.stderr
    with psycopg.connect(pg_dsn) as conn:
        agents = [
            r[0]
            for r in conn.execute(
                "SELECT agent_id FROM agentcap.agents WHERE run_id = %s ORDER BY 1", (run_id,)
            )
        ]
        trace_id, root, started_at = conn.execute(
            "SELECT trace_id, root_span_id, started_at FROM agentcap.runs WHERE run_id = %s",
            (run_id,),
        ).fetchone()
        root_start = conn.execute(
            "SELECT start_time FROM agentcap.spans WHERE run_id = %s AND span_id = %s",
            (run_id, root),
        ).fetchone()[0]
        spans = conn.execute(
            "SELECT name, trace_id, parent_span_id FROM agentcap.spans WHERE run_id = %s",
            (run_id,),
        ).fetchall()
    assert agents == ["agent-new", "agent-resume"]
    assert trace_id and root
    assert started_at == root_start  # the claim records the root span's start
    assert {s[1] for s in spans} == {trace_id}
    assert ("invoke_agent agent-resume", trace_id, root) in spans
    assert [s[0] for s in spans].count(f"invoke_workflow {run_id}") == 1


@pytest.mark.storage
@pytest.mark.multiprocess
def test_a_context_carried_from_another_event_log_is_not_merged_into_a_run_of_that_id(
    pg_dsn, pg_empty_dsn
):
    """A context carried from a run in another database, into a process whose database has an
    unrelated run of the same id, raises RunExistsError there and stores nothing under it."""
    run_id = _run_id()
    elsewhere = _process(pg_empty_dsn, run_id, "new")
    assert elsewhere.returncode == 0, elsewhere.stderr
    here = _process(pg_dsn, run_id, "new")
    assert here.returncode == 0, here.stderr
    carried = _process(pg_dsn, run_id, "carried-span", elsewhere.stdout.strip().splitlines()[-1])
    assert carried.returncode == 3, carried.stderr
    assert "another run" in carried.stdout
    with psycopg.connect(pg_dsn) as conn:
        trace_id = conn.execute(
            "SELECT trace_id FROM agentcap.runs WHERE run_id = %s", (run_id,)
        ).fetchone()[0]
        stored = conn.execute(
            "SELECT agent_id, trace_id FROM agentcap.events WHERE run_id = %s", (run_id,)
        ).fetchall()
    assert {agent for agent, _ in stored} == {"agent-new"}
    assert {trace for _, trace in stored} == {trace_id}


@pytest.mark.storage
@pytest.mark.multiprocess
def test_a_context_carried_without_a_span_for_an_unknown_run_claims_it_with_a_root(pg_dsn):
    """A context carried without a span, for a run the event log does not know, claims the run
    with a root span of its own: the agents run under it, in one trace, as resume=True would."""
    run_id = _run_id()
    carried = _process(pg_dsn, run_id, "carried")
    assert carried.returncode == 0, carried.stderr
    trace_id, root, stored = _stored_trace(pg_dsn, run_id)
    spans = [(name, trace, parent) for name, _, parent, trace in stored]
    assert trace_id and root
    assert ("invoke_agent agent-carried", trace_id, root) in spans


@pytest.mark.storage
@pytest.mark.multiprocess
def test_a_run_resumed_after_a_carried_context_runs_under_its_root_span(pg_dsn):
    """A process that continued a run from a carried span (an agent's), and then resumes the
    run by id, runs the resumed agents under the run's stored root span, not under the span
    the context was carried from."""
    run_id = _run_id()
    first = _process(pg_dsn, run_id, "new")
    assert first.returncode == 0, first.stderr
    carried = first.stdout.strip().splitlines()[-1]
    second = _process(pg_dsn, run_id, "carried-then-resumed", carried)
    assert second.returncode == 0, second.stderr
    trace_id, root, spans = _stored_trace(pg_dsn, run_id)
    assert {span[3] for span in spans} == {trace_id}
    parents = {name: parent for name, _, parent, _ in spans}
    ids = {name: span_id for name, span_id, _, _ in spans}
    assert parents["invoke_agent agent-carried"] == ids["invoke_agent agent-new"]
    assert parents["invoke_agent agent-carried-then-resumed"] == root


@pytest.mark.storage
@pytest.mark.multiprocess
def test_a_context_carried_without_a_span_joins_the_stored_run_trace(pg_dsn):
    """A carried context with the run id only (no span was recording where it was taken) joins
    the run's trace under its stored root span, instead of starting traces of its own."""
    run_id = _run_id()
    first = _process(pg_dsn, run_id, "new")
    assert first.returncode == 0, first.stderr
    carried = _process(pg_dsn, run_id, "carried")
    assert carried.returncode == 0, carried.stderr
    trace_id, root, stored = _stored_trace(pg_dsn, run_id)
    spans = [(name, trace, parent) for name, _, parent, trace in stored]
    assert ("invoke_agent agent-carried", trace_id, root) in spans
    assert {s[1] for s in spans} == {trace_id}


def test_a_context_carried_from_another_run_of_the_same_id_is_refused():
    """A carried context whose trace is not the trace of the run this process opened under that
    id (another run of the same id, elsewhere) raises RunExistsError instead of merging."""
    from opentelemetry.trace import SpanContext, TraceFlags

    run_id = _run_id()
    foreign = RunCarrier(run_id, SpanContext(0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED)))
    with capture_events() as captured:
        with ac.run(run_id), ac.agent("here"):
            pass
        with pytest.raises(ac.RunExistsError, match="another run"), ac.run(context=foreign):
            pass
        with ac.run(run_id, resume=True), ac.agent("here"):
            carried = ac.run_context()
        with ac.run(context=carried.to_string()), ac.agent("there"):
            pass
    assert {s.context.trace_id for s in captured.spans} != {0xABC}
    assert 0xABC not in {s.context.trace_id for s in captured.spans}


def test_a_context_carried_without_a_span_for_a_run_nobody_knows_starts_it():
    """A context carried without a span, for a run neither this process nor the log knows,
    starts the run with its root span (as resume=True does), so its agents share one trace."""
    run_id = _run_id()
    carried = {"baggage": RunCarrier(run_id).to_dict()["baggage"]}
    with capture_events() as captured, ac.run(context=carried):
        with ac.agent("a"):
            pass
        with ac.agent("b"):
            pass
    (root,) = _by_name(captured.spans, "invoke_workflow")
    agents = _by_name(captured.spans, "invoke_agent")
    assert len(agents) == 2
    for span in agents:
        assert span.parent is not None and span.parent.span_id == root.context.span_id
        assert span.context.trace_id == root.context.trace_id


def test_a_run_opened_inside_an_agent_of_another_run_keeps_its_own_id():
    """The root span of a run opened inside an agent of another run carries its own run id."""
    outer, inner = _run_id(), _run_id()
    with capture_events() as captured, ac.run(outer), ac.agent("a"), ac.run(inner):
        pass
    roots = {s.attributes[attr.RUN_ID] for s in _by_name(captured.spans, "invoke_workflow")}
    assert roots == {outer, inner}


def test_a_stored_run_without_a_root_span_is_resumed_under_a_new_one():
    """resume=True of a run the log stores without its root span (claimed where nothing was
    recorded: OTEL_SDK_DISABLED=true) starts the root span, so the agents share one trace."""
    from otel_agentcap.capture import runs as runs_module

    class StoredWithoutRoot:
        def claim(self, run_id, root_span, started_at):
            return runs_module.StoredRun(run_id, None)

    run_id = _run_id()
    runs_module.set_run_registry(StoredWithoutRoot())
    try:
        with capture_events() as captured, ac.run(run_id, resume=True):
            with ac.agent("a"):
                pass
            with ac.agent("b"):
                pass
    finally:
        runs_module.set_run_registry(None)
    (root,) = _by_name(captured.spans, "invoke_workflow")
    agents = _by_name(captured.spans, "invoke_agent")
    assert len(agents) == 2
    for span in agents:
        assert span.parent is not None and span.parent.span_id == root.context.span_id


@pytest.mark.fault
def test_a_run_opens_unchecked_when_the_store_cannot_be_asked(caplog):
    """A registry that fails lets runs open (capture never breaks the program), with one warning
    for a burst of runs."""
    from otel_agentcap.capture import runs as runs_module

    class Down:
        calls = 0

        def claim(self, run_id, root_span, started_at):
            Down.calls += 1
            raise ConnectionError("database down")

    runs_module.set_run_registry(Down())
    runs_module._unchecked_logged_at = -3600.0
    try:
        with caplog.at_level("WARNING", logger="otel_agentcap"):
            for _ in range(3):
                with ac.run(_run_id()), ac.agent("a"):
                    pass
    finally:
        runs_module.set_run_registry(None)
    assert Down.calls == 3
    warnings = [r for r in caplog.records if "unchecked" in r.getMessage()]
    assert len(warnings) == 1


def test_run_attributes_over_the_payload_limit_are_bounded_value_by_value():
    """Run attributes over the payload limit keep their other keys readable: the long value is
    a truncation marker in its own place. Storage keeps the capture's encoding as it is (its
    markers are not read as user keys and wrapped again)."""
    from otel_agentcap import jsonsafe
    from otel_agentcap.exporters.postgres.rows import _run_attributes
    from otel_agentcap.pipeline.mapping import declared_run_attributes

    run_id = _run_id()
    with capture_events() as captured, ac.run(run_id, purpose="p", big="x" * 300_000):
        pass
    (root,) = _by_name(captured.spans, "invoke_workflow")
    declared = declared_run_attributes(root.attributes)
    assert isinstance(declared, jsonsafe.EncodedObject)
    assert declared["purpose"] == "p"
    assert set(declared["big"]) == {"$agentcap.truncated", "size"}
    assert declared["big"]["size"] == 300_002
    assert _run_attributes(declared) is declared  # stored as capture encoded it
    # Attributes of user values (a hand-built RunRecord) are encoded, their markers escaped.
    assert _run_attributes({"$agentcap.x": 1}) == {"$agentcap.literal": {"$agentcap.x": 1}}


def test_a_run_continued_again_from_carried_contexts_asks_the_log_once():
    """A worker that continues one run from message after message (a carried context each)
    checks the run in the event log the first time only; a foreign context is still refused."""
    from opentelemetry.trace import SpanContext, TraceFlags

    from otel_agentcap.capture import runs as runs_module

    class Log:
        """Stores each run id once, with the root span it was first claimed with."""

        def __init__(self) -> None:
            self.roots: dict[str, SpanContext | None] = {}
            self.claims: list[str] = []

        def claim(self, run_id, root_span, started_at):
            self.claims.append(run_id)
            if run_id not in self.roots:
                self.roots[run_id] = root_span
                return None
            return runs_module.StoredRun(run_id, self.roots[run_id])

    run_id = _run_id()
    log = Log()
    runs_module.set_run_registry(log)
    try:
        with capture_events() as captured:
            with ac.run(run_id), ac.agent("sender"):
                carried = ac.run_context().to_string()
            runs_module.forget_runs()  # the worker: another process
            for message in range(5):
                with ac.run(context=carried), ac.agent(f"worker-{message}"):
                    pass
            foreign = RunCarrier(run_id, SpanContext(0xABC, 0xDEF, True, TraceFlags(1)))
            with pytest.raises(ac.RunExistsError), ac.run(context=foreign):
                pass
    finally:
        runs_module.set_run_registry(None)
    assert log.claims == [run_id, run_id]  # the sender's open, the worker's first message
    assert len({s.context.trace_id for s in captured.spans}) == 1
