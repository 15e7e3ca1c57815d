"""The event log is not sampled: a sampler configured for the trace backends (OTEL_TRACES_SAMPLER)
decides which spans are exported there, while agentcap stores every event."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Decision, TraceIdRatioBased

from otel_agentcap.pipeline.sampling import RecordEverySpan


def test_what_the_inner_sampler_drops_is_recorded_with_its_attributes():
    """DROP becomes RECORD_ONLY with the span's attributes (a dropping sampler returns none, and
    the SDK makes the span with the attributes the sampler returns); sampled stays sampled."""
    attributes = {"agentcap.event.id": "e", "n": 1}
    dropped = RecordEverySpan(ALWAYS_OFF).should_sample(None, 1, "s", attributes=attributes)
    assert dropped.decision is Decision.RECORD_ONLY
    assert dict(dropped.attributes) == attributes
    kept = RecordEverySpan(ALWAYS_ON).should_sample(None, 1, "s", attributes=attributes)
    assert kept.decision is Decision.RECORD_AND_SAMPLE
    assert dict(kept.attributes) == attributes
    assert RecordEverySpan(TraceIdRatioBased(0.5)).get_description() == (
        "RecordEverySpan{TraceIdRatioBased{0.5}}"
    )


_PROGRAM = textwrap.dedent(
    """
    import json, sys
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    dsn, queue_dir, mode = sys.argv[1:4]
    collector = InMemorySpanExporter()
    agentcap = configure(
        dsn,
        queue_dir=queue_dir,
        announce=False,
        durable=mode == "durable",
        batch=mode != "synchronous",
        span_processors=[SimpleSpanProcessor(collector)],
    )
    runs = []
    for i in range(40):
        with ac.run() as run, ac.agent("a"):
            ac.Memory("m")["k"] = i
        runs.append(run.run_id)
    agentcap.shutdown(timeout=30)
    exported = collector.get_finished_spans()
    print(json.dumps({
        "runs": runs,
        "inserted": agentcap.stats().events_inserted,
        "exported": len(exported),
        "traces": len({s.context.trace_id for s in exported}),
    }))
    """
)


@pytest.mark.storage
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["durable", "in-memory", "synchronous"])
def test_a_sampled_provider_still_stores_every_event(pg_dsn, tmp_path, mode):
    """With OTEL_TRACES_SAMPLER=parentbased_traceidratio at 0.25, configure() stores all 120
    events of 40 runs, while the collector's processor gets whole runs, about a quarter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, pg_dsn, str(tmp_path), mode],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["inserted"] == 40 * 3
    # Sampling still applies to the exporting processors: whole runs (traces), not all of them.
    assert 0 < out["traces"] < 40 and out["exported"] == out["traces"] * 3


_RESUMING = textwrap.dedent(
    """
    import json, sys
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    dsn, queue_dir, run_id, mode = sys.argv[1:5]
    collector = InMemorySpanExporter()
    agentcap = configure(
        dsn, queue_dir=queue_dir, announce=False, span_processors=[SimpleSpanProcessor(collector)]
    )
    with ac.run(run_id, resume=mode == "resume"), ac.agent("boss") as boss:
        child = boss.spawn("kid")
        if mode == "resume":
            child.run(lambda: None)
    agentcap.shutdown(timeout=30)
    print(json.dumps({
        "exported": sorted(s.name for s in collector.get_finished_spans()),
        "inserted": agentcap.stats().events_inserted,
    }))
    """
)


@pytest.mark.storage
@pytest.mark.multiprocess
@pytest.mark.parametrize("sampler", ["parentbased_always_off", "parentbased_always_on"])
def test_a_process_that_resumes_a_run_samples_it_as_the_process_that_started_it(
    pg_dsn, tmp_path, sampler
):
    """A second process that resumes a run by id (its spans under the stored root span, a child
    under the stored spawn span) exports the run's spans to the other processors as the first
    process did: none under parentbased_always_off, all under parentbased_always_on; the log
    gets every event either way."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_TRACES_SAMPLER"] = sampler
    run_id = f"resume-sampled-{os.getpid()}-{sampler}"
    outs = []
    for mode in ("first", "resume"):
        done = subprocess.run(
            [sys.executable, "-c", _RESUMING, pg_dsn, str(tmp_path / mode), run_id, mode],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        outs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, resumed = outs
    # boss start, spawn, end; then boss start, end and the kid's start, end (the spawn found)
    assert first["inserted"] == 3 and resumed["inserted"] == 4
    if sampler == "parentbased_always_off":
        assert first["exported"] == [] and resumed["exported"] == []
    else:
        assert resumed["exported"] == ["invoke_agent boss", "invoke_agent boss/kid"]
