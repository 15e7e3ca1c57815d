-- 0003: one run, one trace.
-- A run's root span (ac.run opens it, invoke_workflow {run id}): recorded when the run is claimed,
-- so that a process resuming the run joins its trace.
ALTER TABLE agentcap.runs ADD COLUMN trace_id text, ADD COLUMN root_span_id text;

-- The envelope of each span that carried a run's events, and of the run's root span: what a trace
-- viewer needs beyond the events (parent span, name, kind, times, status, service) to draw the run
-- as it was recorded (otel-agentcap export --format otlp-json|jaeger-json). Links are not stored:
-- they are the events' causal parents. Keyed by run first, like every per-run table.
CREATE TABLE agentcap.spans (
    run_id         text        NOT NULL,
    trace_id       text        NOT NULL,
    span_id        text        NOT NULL,
    parent_span_id text,
    name           text        NOT NULL,
    kind           smallint    NOT NULL DEFAULT 0,
    start_time     timestamptz NOT NULL,
    end_time       timestamptz NOT NULL,
    status_code    smallint    NOT NULL DEFAULT 0,
    status_message text,
    service_name   text,
    scope_name     text,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT spans_pkey PRIMARY KEY (run_id, trace_id, span_id)
);
