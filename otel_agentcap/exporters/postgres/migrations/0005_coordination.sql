-- 0005: state that processes serving one run share, written synchronously on the capture path
-- (not by the asynchronous export): the tool ledger, the spawn registry and the shared memory.
-- Each write is one statement (a function call) in its own transaction, so a process that dies
-- leaves either the whole step or nothing. Keys lead with run_id, like the event log's.
-- Applied by otel_agentcap.exporters.postgres.migrate inside one transaction, under an advisory lock.

-- ------------------------------------------------------------------------------------------------
-- Tool ledger: one row per invocation identity, claimed before the body runs.
-- call_digest is SHA-256 (hex) of the tool and its canonical input (see capture/ledger.py), so the
-- same invocation id with another tool or input is another row (ordinal > 0 records the reuse).
CREATE TABLE agentcap.tool_ledger (
    run_id              text        NOT NULL,
    agent_id            text        NOT NULL,
    invocation_id       text        NOT NULL,
    call_digest         text        NOT NULL,
    tool                text        NOT NULL,
    ordinal             integer     NOT NULL,
    attempt             integer     NOT NULL DEFAULT 1,
    status              text        NOT NULL CONSTRAINT tool_ledger_status_check CHECK (status IN (
                            'running', 'succeeded', 'failed', 'released', 'unknown')),
    owner               text,
    lease_expires_at    timestamptz,
    codec               text,
    result              jsonb,
    error               jsonb,
    invocation_event_id uuid,
    result_event_id     uuid,
    result_event_seq    bigint,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT tool_ledger_pkey PRIMARY KEY (run_id, agent_id, invocation_id, call_digest)
);

-- Claim an invocation identity: 'claimed' (the caller runs the body as attempt n), 'running'
-- (another live claim holds it), 'succeeded' / 'failed' (the recorded outcome), or 'unknown' (its
-- holder's lease expired, or it was interrupted and released it, and the caller's policy is at
-- most once). A claim whose lease expired, or that was released, is taken over as the next attempt
-- under the at-least-once policy.
CREATE FUNCTION agentcap.tool_claim(
    p_run text, p_agent text, p_invocation text, p_digest text, p_tool text,
    p_owner text, p_lease_seconds double precision, p_at_most_once boolean)
RETURNS TABLE (state text, attempt integer, ordinal integer, codec text, result jsonb,
               error jsonb, result_event_id uuid, result_event_seq bigint)
LANGUAGE plpgsql AS $$
DECLARE
    r agentcap.tool_ledger%ROWTYPE;
    lease interval := make_interval(secs => p_lease_seconds);
BEGIN
    -- Claims under one invocation id serialise here: a new identity's ordinal is counted, and two
    -- first claims of one identity cannot both insert.
    PERFORM pg_advisory_xact_lock(
        hashtextextended(p_run || chr(31) || p_agent || chr(31) || p_invocation, 1634167153));
    SELECT * INTO r FROM agentcap.tool_ledger l
    WHERE l.run_id = p_run AND l.agent_id = p_agent AND l.invocation_id = p_invocation
      AND l.call_digest = p_digest
    FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO agentcap.tool_ledger AS l (run_id, agent_id, invocation_id, call_digest, tool,
            ordinal, status, owner, lease_expires_at)
        VALUES (p_run, p_agent, p_invocation, p_digest, p_tool,
            (SELECT count(*) FROM agentcap.tool_ledger x
             WHERE x.run_id = p_run AND x.agent_id = p_agent AND x.invocation_id = p_invocation),
            'running', p_owner, clock_timestamp() + lease)
        RETURNING * INTO r;
        RETURN QUERY SELECT 'claimed'::text, r.attempt, r.ordinal, NULL::text, NULL::jsonb,
            NULL::jsonb, NULL::uuid, NULL::bigint;
        RETURN;
    END IF;
    IF r.status IN ('succeeded', 'failed', 'unknown')
       OR (r.status = 'running' AND r.lease_expires_at > clock_timestamp()) THEN
        RETURN QUERY SELECT r.status, r.attempt, r.ordinal, r.codec, r.result, r.error,
            r.result_event_id, r.result_event_seq;
        RETURN;
    END IF;
    IF p_at_most_once THEN
        -- Its holder died (lease expired) or was interrupted (released): the body may have acted.
        UPDATE agentcap.tool_ledger l SET status = 'unknown', owner = NULL,
            lease_expires_at = NULL, updated_at = now()
        WHERE l.run_id = p_run AND l.agent_id = p_agent AND l.invocation_id = p_invocation
          AND l.call_digest = p_digest;
        RETURN QUERY SELECT 'unknown'::text, r.attempt, r.ordinal, NULL::text, NULL::jsonb,
            NULL::jsonb, NULL::uuid, NULL::bigint;
        RETURN;
    END IF;
    UPDATE agentcap.tool_ledger l SET status = 'running', attempt = r.attempt + 1,
        owner = p_owner, lease_expires_at = clock_timestamp() + lease, updated_at = now()
    WHERE l.run_id = p_run AND l.agent_id = p_agent AND l.invocation_id = p_invocation
      AND l.call_digest = p_digest;
    RETURN QUERY SELECT 'claimed'::text, r.attempt + 1, r.ordinal, NULL::text, NULL::jsonb,
        NULL::jsonb, NULL::uuid, NULL::bigint;
END
$$;

-- ------------------------------------------------------------------------------------------------
-- Spawn registry: the one spawn of each child, registered when it happens. A retry of the same
-- child from any process gets this row: the winner's spawn event, its sequence, and the spawn
-- span's trace and span ids (hex, as the events table writes them).
CREATE TABLE agentcap.spawns (
    run_id          text        NOT NULL,
    child_agent_id  text        NOT NULL,
    parent_agent_id text        NOT NULL,
    name            text,
    spawn_key       text,
    spawn_event_id  uuid        NOT NULL,
    spawn_seq       bigint      NOT NULL,
    trace_id        text,
    span_id         text,
    registered_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT spawns_pkey PRIMARY KEY (run_id, child_agent_id)
);

-- Insert-or-get. A spawn that a process of an earlier version exported without registering it
-- (found in agents and events) is registered as the winner first.
CREATE FUNCTION agentcap.spawn_register(
    p_run text, p_child text, p_parent text, p_name text, p_key text, p_event uuid, p_seq bigint,
    p_trace text, p_span text)
RETURNS TABLE (won boolean, parent_agent_id text, name text, spawn_event_id uuid,
               spawn_seq bigint, trace_id text, span_id text)
LANGUAGE plpgsql AS $$
DECLARE
    s agentcap.spawns%ROWTYPE;
BEGIN
    SELECT * INTO s FROM agentcap.spawns x WHERE x.run_id = p_run AND x.child_agent_id = p_child;
    IF FOUND THEN
        RETURN QUERY SELECT false, s.parent_agent_id, s.name, s.spawn_event_id, s.spawn_seq,
            s.trace_id, s.span_id;
        RETURN;
    END IF;
    INSERT INTO agentcap.spawns (run_id, child_agent_id, parent_agent_id, name, spawn_key,
        spawn_event_id, spawn_seq, trace_id, span_id)
    SELECT a.run_id, a.agent_id, a.parent_agent_id, a.name, NULL, a.spawned_at_event_id,
        e.logical_seq, e.trace_id, e.span_id
    FROM agentcap.agents a JOIN agentcap.events e ON e.event_id = a.spawned_at_event_id
    WHERE a.run_id = p_run AND a.agent_id = p_child AND a.parent_agent_id IS NOT NULL
    ON CONFLICT DO NOTHING;
    INSERT INTO agentcap.spawns (run_id, child_agent_id, parent_agent_id, name, spawn_key,
        spawn_event_id, spawn_seq, trace_id, span_id)
    VALUES (p_run, p_child, p_parent, p_name, p_key, p_event, p_seq, p_trace, p_span)
    ON CONFLICT DO NOTHING
    RETURNING * INTO s;
    IF FOUND THEN
        RETURN QUERY SELECT true, s.parent_agent_id, s.name, s.spawn_event_id, s.spawn_seq,
            s.trace_id, s.span_id;
        RETURN;
    END IF;
    -- Another process registered it first (this statement sees its committed row).
    SELECT * INTO s FROM agentcap.spawns x WHERE x.run_id = p_run AND x.child_agent_id = p_child;
    RETURN QUERY SELECT false, s.parent_agent_id, s.name, s.spawn_event_id, s.spawn_seq,
        s.trace_id, s.span_id;
END
$$;

-- ------------------------------------------------------------------------------------------------
-- Shared memory of a run: one row per key with its value, a version (1 for the key's first write,
-- one more per write), and the write that made it (event id, sequence, agent, and the trace and
-- span ids of its span, which a read's span links to; null for a write made outside any agent,
-- which records no event). A delete keeps the row with found = false, so the
-- key's next write names the delete as its causal parent.
CREATE TABLE agentcap.memory (
    run_id          text        NOT NULL,
    memory          text        NOT NULL,
    key             text        NOT NULL,
    found           boolean     NOT NULL,
    value           jsonb,
    version         bigint      NOT NULL,
    writer_event_id uuid,
    writer_seq      bigint,
    writer_agent_id text,
    writer_trace_id text,
    writer_span_id  text,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT memory_pkey PRIMARY KEY (run_id, memory, key)
);

-- One write and its memory_write event, in one transaction. The event's sequence (from the
-- writer's clock) must be above the key's last write, its causal parent: when it is not, nothing is
-- written and 'retry' returns that write's sequence, so the caller ticks past it and calls again.
-- With p_expected_version, the write happens only if the key is at that version ('mismatch'
-- otherwise; 0 for a key never written). Deleting a missing key writes nothing ('unchanged').
-- A null p_event is a write outside any agent: no event, and the next write has no parent.
CREATE FUNCTION agentcap.memory_write(
    p_run text, p_memory text, p_key text, p_op text, p_found boolean, p_value jsonb,
    p_expected_version bigint, p_agent text, p_event uuid, p_seq bigint,
    p_wall_time timestamptz, p_parents uuid[], p_trace text, p_span text)
RETURNS TABLE (outcome text, version bigint, before_found boolean, before_value jsonb,
               previous_event_id uuid, previous_seq bigint, parents uuid[], payload text)
LANGUAGE plpgsql AS $$
DECLARE
    r agentcap.memory%ROWTYPE;
    had boolean;
    all_parents uuid[];
    body jsonb;
BEGIN
    PERFORM pg_advisory_xact_lock(
        hashtextextended(p_run || chr(31) || p_memory || chr(31) || p_key, 1835363705));
    SELECT * INTO r FROM agentcap.memory m
    WHERE m.run_id = p_run AND m.memory = p_memory AND m.key = p_key;
    had := FOUND;
    IF p_expected_version IS NOT NULL AND COALESCE(r.version, 0) <> p_expected_version THEN
        RETURN QUERY SELECT 'mismatch'::text, COALESCE(r.version, 0), COALESCE(r.found, false),
            NULL::jsonb, r.writer_event_id, r.writer_seq, NULL::uuid[], NULL::text;
        RETURN;
    END IF;
    IF NOT p_found AND NOT COALESCE(r.found, false) THEN
        RETURN QUERY SELECT 'unchanged'::text, COALESCE(r.version, 0), false, NULL::jsonb,
            r.writer_event_id, r.writer_seq, NULL::uuid[], NULL::text;
        RETURN;
    END IF;
    IF had AND p_event IS NOT NULL AND r.writer_seq >= p_seq THEN
        RETURN QUERY SELECT 'retry'::text, r.version, r.found, NULL::jsonb, r.writer_event_id,
            r.writer_seq, NULL::uuid[], NULL::text;
        RETURN;
    END IF;
    all_parents := CASE WHEN r.writer_event_id IS NOT NULL THEN ARRAY[r.writer_event_id]
                        ELSE '{}'::uuid[] END;
    all_parents := all_parents || ARRAY(
        SELECT p FROM unnest(COALESCE(p_parents, '{}'::uuid[])) WITH ORDINALITY AS t(p, n)
        WHERE p <> ALL (all_parents) ORDER BY n);
    body := jsonb_build_object('memory', p_memory, 'key', p_key, 'op', p_op,
        'before_found', COALESCE(r.found, false), 'after_found', p_found);
    IF COALESCE(r.found, false) THEN
        body := body || jsonb_build_object('before', r.value);
    END IF;
    IF p_found THEN
        body := body || jsonb_build_object('after', p_value);
    END IF;
    IF p_event IS NOT NULL THEN
        INSERT INTO agentcap.events (event_id, run_id, agent_id, logical_seq, wall_time,
            event_type, causal_parent_ids, idempotency_key, trace_id, span_id, payload)
        VALUES (p_event, p_run, p_agent, p_seq, p_wall_time, 'memory_write', all_parents,
            'seq:' || p_seq, p_trace, p_span, body);
    END IF;
    INSERT INTO agentcap.memory AS m (run_id, memory, key, found, value, version,
        writer_event_id, writer_seq, writer_agent_id, writer_trace_id, writer_span_id)
    VALUES (p_run, p_memory, p_key, p_found, CASE WHEN p_found THEN p_value END, 1, p_event,
        p_seq, p_agent, p_trace, p_span)
    ON CONFLICT (run_id, memory, key) DO UPDATE SET found = EXCLUDED.found,
        value = EXCLUDED.value, version = m.version + 1, writer_event_id = EXCLUDED.writer_event_id,
        writer_seq = EXCLUDED.writer_seq, writer_agent_id = EXCLUDED.writer_agent_id,
        writer_trace_id = EXCLUDED.writer_trace_id, writer_span_id = EXCLUDED.writer_span_id,
        updated_at = now();
    RETURN QUERY SELECT 'written'::text, COALESCE(r.version, 0) + 1, COALESCE(r.found, false),
        r.value, r.writer_event_id, r.writer_seq, all_parents, body::text;
END
$$;
