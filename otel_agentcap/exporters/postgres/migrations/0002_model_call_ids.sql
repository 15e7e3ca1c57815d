-- 0002: one model call is one event. A model_call event is identified by its run and its
-- response id (payload key response_id, the Message id), and by its run and its request id
-- (payload key request_id, the API's request-id header; the only id of an error response).
-- Two partial unique indexes make the log refuse a second model_call event for the same call
-- under another event id; the writer classifies such a row as a conflict before its INSERT and
-- keeps it in agentcap.conflicts. Only string ids count (jsonb_typeof), as in the writer's probes.
-- Applied by otel_agentcap.exporters.postgres.migrate inside one transaction, under an advisory lock.

-- Writers of an earlier version may still be running: hold their writes to events off for the
-- whole migration, so no duplicate lands between the clean-up below and the index builds, and
-- take events before conflicts, in the writer's order, so the two cannot deadlock.
LOCK TABLE agentcap.events IN SHARE ROW EXCLUSIVE MODE;

ALTER TABLE agentcap.conflicts DROP CONSTRAINT conflicts_reason_check;
ALTER TABLE agentcap.conflicts ADD CONSTRAINT conflicts_reason_check CHECK (reason IN (
    'event_id_content', 'run_agent_seq', 'run_agent_key', 'invalid_event_type',
    'model_call_response_id', 'model_call_request_id'));

-- A log written before this migration may already hold a call twice. Of each such group the
-- event recorded by the anthropic SDK's own instrumentation is kept, else the earliest; the others
-- move to agentcap.conflicts, in full, with the id of the kept event (a causal parent id naming a
-- moved event is resolved through conflicts.existing_event_id). The digest is the writer's.
WITH ranked AS (
    SELECT event_id,
           first_value(event_id) OVER w AS kept,
           row_number() OVER w AS n
    FROM agentcap.events
    WHERE event_type = 'model_call' AND jsonb_typeof(payload -> 'response_id') = 'string'
    WINDOW w AS (
        PARTITION BY run_id, (payload ->> 'response_id')
        ORDER BY COALESCE(starts_with(payload ->> 'instrumentation', 'com.anthropic.sdk.python'),
                          false) DESC,
                 wall_time, logical_seq, event_id)
),
moved AS (
    DELETE FROM agentcap.events e USING ranked r
    WHERE e.event_id = r.event_id AND r.n > 1
    RETURNING e.*, r.kept
)
INSERT INTO agentcap.conflicts (reason, existing_event_id, row_digest, event_id, run_id, agent_id,
    logical_seq, wall_time, event_type, causal_parent_ids, idempotency_key, trace_id, span_id,
    payload)
SELECT 'model_call_response_id', kept,
       md5(row(event_id, run_id, agent_id, logical_seq, extract(epoch FROM wall_time),
               event_type, causal_parent_ids, idempotency_key, trace_id, span_id, payload)::text),
       event_id, run_id, agent_id, logical_seq, wall_time, event_type, causal_parent_ids,
       idempotency_key, trace_id, span_id, payload
FROM moved
ON CONFLICT (reason, existing_event_id, row_digest) DO NOTHING;

CREATE UNIQUE INDEX events_model_call_response_id_key
    ON agentcap.events (run_id, (payload ->> 'response_id'))
    WHERE event_type = 'model_call' AND jsonb_typeof(payload -> 'response_id') = 'string';

WITH ranked AS (
    SELECT event_id,
           first_value(event_id) OVER w AS kept,
           row_number() OVER w AS n
    FROM agentcap.events
    WHERE event_type = 'model_call' AND jsonb_typeof(payload -> 'request_id') = 'string'
    WINDOW w AS (
        PARTITION BY run_id, (payload ->> 'request_id')
        ORDER BY COALESCE(starts_with(payload ->> 'instrumentation', 'com.anthropic.sdk.python'),
                          false) DESC,
                 wall_time, logical_seq, event_id)
),
moved AS (
    DELETE FROM agentcap.events e USING ranked r
    WHERE e.event_id = r.event_id AND r.n > 1
    RETURNING e.*, r.kept
)
INSERT INTO agentcap.conflicts (reason, existing_event_id, row_digest, event_id, run_id, agent_id,
    logical_seq, wall_time, event_type, causal_parent_ids, idempotency_key, trace_id, span_id,
    payload)
SELECT 'model_call_request_id', kept,
       md5(row(event_id, run_id, agent_id, logical_seq, extract(epoch FROM wall_time),
               event_type, causal_parent_ids, idempotency_key, trace_id, span_id, payload)::text),
       event_id, run_id, agent_id, logical_seq, wall_time, event_type, causal_parent_ids,
       idempotency_key, trace_id, span_id, payload
FROM moved
ON CONFLICT (reason, existing_event_id, row_digest) DO NOTHING;

CREATE UNIQUE INDEX events_model_call_request_id_key
    ON agentcap.events (run_id, (payload ->> 'request_id'))
    WHERE event_type = 'model_call' AND jsonb_typeof(payload -> 'request_id') = 'string';
