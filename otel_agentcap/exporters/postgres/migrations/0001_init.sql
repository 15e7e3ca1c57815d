-- 0001: the agentcap event log.
-- Applied by otel_agentcap.exporters.postgres.migrate inside one transaction, under an advisory lock.
-- No foreign keys between these tables: events may arrive before their agent or run row, and the
-- order in which batches land must never matter.

CREATE TABLE agentcap.runs (
    run_id      text        PRIMARY KEY,
    started_at  timestamptz,
    attributes  jsonb       NOT NULL DEFAULT '{}'::jsonb,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX runs_started_at_idx ON agentcap.runs (started_at DESC NULLS LAST, run_id);

CREATE TABLE agentcap.agents (
    run_id              text        NOT NULL,
    agent_id            text        NOT NULL,
    parent_agent_id     text,
    spawned_at_event_id uuid,
    name                text,
    recorded_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT agents_pkey PRIMARY KEY (run_id, agent_id)
);
CREATE INDEX agents_parent_idx ON agentcap.agents (run_id, parent_agent_id);

CREATE TABLE agentcap.events (
    event_id          uuid        PRIMARY KEY,
    run_id            text        NOT NULL,
    agent_id          text        NOT NULL,
    logical_seq       bigint      NOT NULL,
    wall_time         timestamptz NOT NULL,
    event_type        text        NOT NULL CONSTRAINT events_event_type_check CHECK (event_type IN (
                          'model_call', 'tool_invocation', 'tool_result', 'memory_read',
                          'memory_write', 'agent_spawn', 'agent_start', 'agent_end', 'agent_error')),
    causal_parent_ids uuid[]      NOT NULL DEFAULT '{}',
    idempotency_key   text        NOT NULL,
    trace_id          text,
    span_id           text,
    payload           jsonb,
    CONSTRAINT events_run_agent_seq_key UNIQUE (run_id, agent_id, logical_seq),
    CONSTRAINT events_run_agent_idempotency_key UNIQUE (run_id, agent_id, idempotency_key)
);
-- events_run_agent_seq_key also serves "events of a run ordered by (agent_id, logical_seq)".
CREATE INDEX events_causal_parents_idx ON agentcap.events USING gin (causal_parent_ids);
CREATE INDEX events_run_wall_time_idx ON agentcap.events (run_id, wall_time);

-- Different events that collided with a stored (or same-batch) event. Never silently dropped:
-- the full incoming row is kept with the id it collided with and why.
CREATE TABLE agentcap.conflicts (
    conflict_id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    detected_at       timestamptz NOT NULL DEFAULT now(),
    reason            text        NOT NULL CONSTRAINT conflicts_reason_check CHECK (reason IN (
                          'event_id_content', 'run_agent_seq', 'run_agent_key',
                          'invalid_event_type')),
    existing_event_id uuid,
    row_digest        text        NOT NULL,
    event_id          uuid        NOT NULL,
    run_id            text        NOT NULL,
    agent_id          text        NOT NULL,
    logical_seq       bigint      NOT NULL,
    wall_time         timestamptz NOT NULL,
    event_type        text        NOT NULL,
    causal_parent_ids uuid[]      NOT NULL,
    idempotency_key   text        NOT NULL,
    trace_id          text,
    span_id           text,
    payload           jsonb
);
-- A re-sent conflicting row is recorded once (needs PostgreSQL 15 or later).
CREATE UNIQUE INDEX conflicts_dedup_idx
    ON agentcap.conflicts (reason, existing_event_id, row_digest) NULLS NOT DISTINCT;
CREATE INDEX conflicts_run_idx ON agentcap.conflicts (run_id, agent_id, logical_seq);

-- High-water mark of reserved sequence blocks: every seq below next_seq has been handed out.
CREATE TABLE agentcap.agent_sequences (
    run_id   text   NOT NULL,
    agent_id text   NOT NULL,
    next_seq bigint NOT NULL,
    CONSTRAINT agent_sequences_pkey PRIMARY KEY (run_id, agent_id)
);
