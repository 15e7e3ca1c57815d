-- 0006: the log at scale. Every key of the per-event tables leads with run_id, and events,
-- conflicts and spans are partitioned by range of run_started_at, the start of their run as first
-- recorded (agentcap.runs.started_at, which no later write changes), so a run never straddles
-- partitions, whole runs can be dropped a partition at a time, and the log can be distributed by
-- run_id.
-- Applied by otel_agentcap.exporters.postgres.migrate inside one transaction, under an advisory lock.
--
-- An existing log is copied into the partitioned tables: runs, spans, events and conflicts are
-- locked against reads and writes (ACCESS EXCLUSIVE) until the migration commits; see the README
-- for the time it takes per million events. Writers of an earlier version fail until they are
-- upgraded.

SET LOCAL maintenance_work_mem = '256MB';

-- In the writers' order (runs, spans, events, conflicts), so a writer of an earlier version that
-- holds one of them cannot deadlock with this migration.
LOCK TABLE agentcap.runs, agentcap.spans, agentcap.events, agentcap.conflicts
    IN ACCESS EXCLUSIVE MODE;

-- One row: how wide new partitions are, and below which run start everything has been pruned
-- (writes of runs that started before it are refused; see agentcap.ensure_partitions).
CREATE TABLE agentcap.log_settings (
    id                 boolean     PRIMARY KEY DEFAULT true CONSTRAINT log_settings_one_row CHECK (id),
    partition_interval interval    NOT NULL DEFAULT '1 month',
    pruned_before      timestamptz NOT NULL DEFAULT '-infinity',
    -- Whole months, or a fixed width of at least an hour without months (aligned with date_bin).
    CONSTRAINT log_settings_partition_interval_check CHECK (
        (extract(year FROM partition_interval) * 12 + extract(month FROM partition_interval) > 0
         AND partition_interval = make_interval(months => (extract(year FROM partition_interval) * 12
                                                           + extract(month FROM partition_interval))::int))
        OR (extract(year FROM partition_interval) = 0 AND extract(month FROM partition_interval) = 0
            AND partition_interval >= interval '1 hour'))
);
INSERT INTO agentcap.log_settings DEFAULT VALUES;

-- The runs db prune removed: a late redelivery of one of their spans is refused (counted as
-- expired), not stored as a new run holding a fragment of the old one. One row per pruned run.
CREATE TABLE agentcap.pruned_runs (
    run_id     text        PRIMARY KEY,
    started_at timestamptz NOT NULL,
    pruned_at  timestamptz NOT NULL DEFAULT now()
);

-- The run start is the partition key of every event: every run gets a start, and keeps it.
INSERT INTO agentcap.runs (run_id, started_at)
SELECT run_id, min(wall_time)
FROM (SELECT run_id, wall_time FROM agentcap.events
      UNION ALL SELECT run_id, wall_time FROM agentcap.conflicts
      UNION ALL SELECT run_id, start_time FROM agentcap.spans) AS x
GROUP BY run_id
ON CONFLICT (run_id) DO NOTHING;
-- Filling an unknown start is not a change of a stored value; the first-writer-wins trigger of
-- 0004 would refuse it all the same.
ALTER TABLE agentcap.runs DISABLE TRIGGER USER;
UPDATE agentcap.runs r
SET started_at = COALESCE((SELECT min(e.wall_time) FROM agentcap.events e WHERE e.run_id = r.run_id),
                          (SELECT min(s.start_time) FROM agentcap.spans s WHERE s.run_id = r.run_id),
                          r.recorded_at)
WHERE r.started_at IS NULL;
ALTER TABLE agentcap.runs ENABLE TRIGGER USER;
-- From here on a run's start never changes (the trigger of 0004 refuses it): it is the partition
-- key of the run's rows.
ALTER TABLE agentcap.runs ALTER COLUMN started_at SET DEFAULT now(),
                          ALTER COLUMN started_at SET NOT NULL;

-- The range [lower, upper) of the partition that holds runs started at ts: whole months counted
-- from 2000-01, or date_bin steps from Monday 2000-01-03, in UTC.
CREATE FUNCTION agentcap.partition_range(ts timestamptz, step interval,
                                         OUT lower timestamptz, OUT upper timestamptz)
LANGUAGE plpgsql IMMUTABLE STRICT SET TimeZone = 'UTC' AS $$
DECLARE
    months integer := extract(year FROM step) * 12 + extract(month FROM step);
    month_index integer;
BEGIN
    IF months > 0 THEN
        month_index := (extract(year FROM ts) - 2000) * 12 + extract(month FROM ts) - 1;
        month_index := floor(month_index::numeric / months) * months;
        lower := timestamp '2000-01-01' + make_interval(months => month_index);
    ELSE
        lower := date_bin(step, ts, timestamptz '2000-01-03 00:00:00+00');
    END IF;
    upper := lower + step;
END $$;

-- The tables of the schema partitioned by run_started_at.
CREATE FUNCTION agentcap.run_partitioned_tables() RETURNS SETOF regclass
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT c.oid::regclass
    FROM pg_partitioned_table pt
    JOIN pg_class c ON c.oid = pt.partrelid
    JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = pt.partattrs[0]
    WHERE c.relnamespace = 'agentcap'::regnamespace AND NOT c.relispartition
      AND pt.partstrat = 'r' AND pt.partnatts = 1 AND a.attname = 'run_started_at'
    ORDER BY c.relname
$$;

-- The partitions of parent with their bounds (-infinity / infinity for MINVALUE / MAXVALUE, null
-- for a default partition), and whether a DETACH ... CONCURRENTLY of them is pending.
CREATE FUNCTION agentcap.log_partitions(parent regclass)
RETURNS TABLE (partition regclass, lower timestamptz, upper timestamptz, detach_pending boolean)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp SET TimeZone = 'UTC' SET DateStyle = 'ISO'
AS $$
    SELECT c.oid::regclass,
           CASE WHEN b[1] = 'MINVALUE' THEN '-infinity'::timestamptz ELSE btrim(b[1], '''')::timestamptz END,
           CASE WHEN b[2] = 'MAXVALUE' THEN 'infinity'::timestamptz ELSE btrim(b[2], '''')::timestamptz END,
           i.inhdetachpending
    FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    LEFT JOIN LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \((.+)\) TO \((.+)\)') AS b ON true
    WHERE i.inhparent = parent
    ORDER BY 2 NULLS FIRST
$$;

-- Create the partitions (of every run-partitioned table) that hold runs started at the given
-- times, unless they exist or the time is below log_settings.pruned_before. A new partition is
-- CREATE TABLE ... LIKE plus ATTACH PARTITION, which locks the parent in SHARE UPDATE EXCLUSIVE
-- mode only: writers and readers go on. Its range is partition_range(), narrowed to fit between
-- existing partitions (after a change of interval). Returns the number of partitions created.
-- SECURITY DEFINER, so a writer role that owns nothing can extend the log.
CREATE FUNCTION agentcap.ensure_partitions(starts timestamptz[]) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET TimeZone = 'UTC' SET DateStyle = 'ISO' AS $$
DECLARE
    step      interval;
    floor_at  timestamptz;
    parent    regclass;
    ts        timestamptz;
    lo        timestamptz;
    hi        timestamptz;
    base_name text;
    part_name text;
    n         integer;
    created   integer := 0;
BEGIN
    IF starts IS NULL OR cardinality(starts) = 0 THEN
        RETURN 0;
    END IF;
    -- One creator at a time ("agcap_pt"); db prune takes the same lock to move pruned_before.
    PERFORM pg_advisory_xact_lock(7018687814428487796);
    SELECT s.partition_interval, s.pruned_before INTO step, floor_at FROM agentcap.log_settings s;
    FOR parent IN SELECT t FROM agentcap.run_partitioned_tables() t LOOP
        FOR ts IN
            SELECT DISTINCT s FROM unnest(starts) s
            WHERE s IS NOT NULL AND isfinite(s) AND s >= floor_at ORDER BY 1
        LOOP
            CONTINUE WHEN EXISTS (
                SELECT 1 FROM agentcap.log_partitions(parent) p
                WHERE p.lower <= ts AND ts < p.upper);
            SELECT r.lower, r.upper INTO lo, hi FROM agentcap.partition_range(ts, step) r;
            lo := greatest(lo, floor_at, (SELECT max(p.upper) FROM agentcap.log_partitions(parent) p
                                          WHERE p.upper <= ts));
            hi := least(hi, (SELECT min(p.lower) FROM agentcap.log_partitions(parent) p
                             WHERE p.lower > ts));
            base_name := (SELECT c.relname FROM pg_class c WHERE c.oid = parent) || '_p'
                || to_char(lo, 'YYYYMMDD')
                || CASE WHEN lo = date_trunc('day', lo) THEN '' ELSE to_char(lo, '"t"HH24MI') END;
            part_name := base_name;
            n := 1;
            WHILE to_regclass(format('agentcap.%I', part_name)) IS NOT NULL LOOP
                n := n + 1;
                part_name := base_name || '_' || n;
            END LOOP;
            EXECUTE format('CREATE TABLE agentcap.%I (LIKE %s INCLUDING DEFAULTS INCLUDING CONSTRAINTS'
                           ' INCLUDING STORAGE INCLUDING COMPRESSION)', part_name, parent);
            -- run_started_at is a function of run_id: without this the planner multiplies their
            -- selectivities, takes "run_id = r AND run_started_at = s" for one row, and may scan
            -- a whole run where an index names the event.
            EXECUTE format('CREATE STATISTICS agentcap.%I (dependencies) ON run_id, run_started_at'
                           ' FROM agentcap.%I', part_name || '_run_start', part_name);
            EXECUTE format('ALTER TABLE %s ATTACH PARTITION agentcap.%I FOR VALUES FROM (%L) TO (%L)',
                           parent, part_name, lo, hi);
            created := created + 1;
        END LOOP;
    END LOOP;
    RETURN created;
END $$;
-- EXECUTE stays with PUBLIC (a role needs USAGE on the schema to call it anyway), so a writer
-- role given table privileges only keeps working when a new month starts.

-- Analyze the partitions (of every run-partitioned table) that hold runs started at the given
-- times, when they have grown to twice the size their last analyze saw, and to at least 32 pages
-- (256 kB). Until a partition is first analyzed the planner knows nothing of how many rows a run has
-- there, and may read the whole run where the primary key names one event (a writer's probes
-- then cost the size of the run per row); autovacuum analyzes it too, but only after its naptime.
-- The writers call it as they fill a partition; a session that finds another analyzing the same
-- partition skips it. SECURITY DEFINER: a writer role owns no partition. Returns how many it
-- analyzed.
CREATE FUNCTION agentcap.analyze_partitions(starts timestamptz[]) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET TimeZone = 'UTC' SET DateStyle = 'ISO' AS $$
DECLARE
    part     regclass;
    analyzed integer := 0;
BEGIN
    FOR part IN
        SELECT DISTINCT p.partition
        FROM agentcap.run_partitioned_tables() t
        CROSS JOIN LATERAL agentcap.log_partitions(t) p
        JOIN unnest(starts) s ON p.lower <= s AND s < p.upper
        WHERE NOT p.detach_pending
    LOOP
        -- relpages is the size the last analyze (or vacuum) saw; the file's size is exact now.
        CONTINUE WHEN NOT EXISTS (
            SELECT 1 FROM pg_class c
            WHERE c.oid = part
              AND pg_relation_size(part) / current_setting('block_size')::bigint
                  >= greatest(2 * c.relpages, 32));
        -- "agcp" and the partition: one analyzer per partition, the others go on.
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(1634165616, (part::oid::bigint % 2147483647)::integer);
        EXECUTE format('ANALYZE %s', part);
        analyzed := analyzed + 1;
    END LOOP;
    RETURN analyzed;
END $$;

-- events, conflicts and spans move into partitioned tables of the same columns (and whatever
-- columns, defaults and CHECK constraints earlier migrations gave them) plus run_started_at.
-- The triggers of events, conflicts and spans (0004's append-only ones, any a later migration
-- adds) are made again on the partitioned tables below.
CREATE TEMP TABLE log_triggers ON COMMIT DROP AS
SELECT c.relname AS table_name, pg_get_triggerdef(t.oid) AS definition
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
WHERE c.relnamespace = 'agentcap'::regnamespace AND c.relname IN ('events', 'conflicts', 'spans')
  AND NOT t.tgisinternal;

ALTER TABLE agentcap.events RENAME TO events_before_0006;
ALTER TABLE agentcap.conflicts RENAME TO conflicts_before_0006;
ALTER TABLE agentcap.spans RENAME TO spans_before_0006;
ALTER TABLE agentcap.spans_before_0006 RENAME CONSTRAINT spans_pkey TO spans_before_0006_pkey;

CREATE TABLE agentcap.spans (
    LIKE agentcap.spans_before_0006
        INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMPRESSION,
    run_started_at timestamptz NOT NULL
) PARTITION BY RANGE (run_started_at);

CREATE TABLE agentcap.events (
    LIKE agentcap.events_before_0006
        INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMPRESSION,
    run_started_at timestamptz NOT NULL
) PARTITION BY RANGE (run_started_at);

-- conflict_id was an identity column; PostgreSQL 15 and 16 have none on partitioned tables, so
-- it takes its values from a sequence that continues where the identity stopped.
ALTER TABLE agentcap.conflicts_before_0006 ALTER COLUMN conflict_id DROP IDENTITY;
CREATE SEQUENCE agentcap.conflicts_conflict_id_seq AS bigint;
SELECT setval('agentcap.conflicts_conflict_id_seq',
              COALESCE((SELECT max(conflict_id) FROM agentcap.conflicts_before_0006), 0) + 1, false);
CREATE TABLE agentcap.conflicts (
    LIKE agentcap.conflicts_before_0006
        INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMPRESSION,
    run_started_at timestamptz NOT NULL
) PARTITION BY RANGE (run_started_at);
ALTER TABLE agentcap.conflicts
    ALTER COLUMN conflict_id SET DEFAULT nextval('agentcap.conflicts_conflict_id_seq');
ALTER SEQUENCE agentcap.conflicts_conflict_id_seq OWNED BY agentcap.conflicts.conflict_id;

-- One partition per range that holds a stored run (one representative start per range), plus
-- the current and the next range.
SELECT agentcap.ensure_partitions(ARRAY(
    SELECT min(r.started_at) FROM agentcap.runs r
    GROUP BY (agentcap.partition_range(r.started_at, s.partition_interval)).lower
    UNION ALL SELECT now() UNION ALL SELECT now() + s.partition_interval))
FROM agentcap.log_settings s;

INSERT INTO agentcap.events
SELECT e.*, r.started_at FROM agentcap.events_before_0006 e JOIN agentcap.runs r USING (run_id);
INSERT INTO agentcap.conflicts
SELECT c.*, r.started_at FROM agentcap.conflicts_before_0006 c JOIN agentcap.runs r USING (run_id);

INSERT INTO agentcap.spans
SELECT s.*, r.started_at FROM agentcap.spans_before_0006 s JOIN agentcap.runs r USING (run_id);

DROP TABLE agentcap.events_before_0006;
DROP TABLE agentcap.conflicts_before_0006;
DROP TABLE agentcap.spans_before_0006;

-- Recorded before the renames, the definitions name the tables as they are named again now.
DO $$
DECLARE
    t record;
BEGIN
    FOR t IN SELECT * FROM log_triggers LOOP
        EXECUTE t.definition;
    END LOOP;
END $$;

-- The keys, built once the rows are in. PostgreSQL needs the partition key in every unique key;
-- run_started_at is a function of run_id, so each key is unique by its other columns, and it
-- comes second so that a query naming the run and its start (every query of the writer, the
-- store and the CLI does) matches a prefix of the index, with no filter left for the planner
-- to misjudge.
ALTER TABLE agentcap.events
    ADD CONSTRAINT events_pkey PRIMARY KEY (run_id, run_started_at, event_id),
    ADD CONSTRAINT events_run_agent_seq_key UNIQUE (run_id, run_started_at, agent_id, logical_seq),
    ADD CONSTRAINT events_run_agent_idempotency_key
        UNIQUE (run_id, run_started_at, agent_id, idempotency_key);
-- events_run_agent_seq_key also serves "events of a run ordered by (agent_id, logical_seq)";
-- events_run_wall_time_idx the run list's count and time span of a run's events.
CREATE INDEX events_run_wall_time_idx ON agentcap.events (run_id, run_started_at, wall_time);
-- Children of an event (causal_parent_ids @> ARRAY[id]) across a large run.
CREATE INDEX events_causal_parents_idx ON agentcap.events USING gin (causal_parent_ids);
CREATE UNIQUE INDEX events_model_call_response_id_key
    ON agentcap.events (run_id, run_started_at, (payload ->> 'response_id'))
    WHERE event_type = 'model_call' AND jsonb_typeof(payload -> 'response_id') = 'string';
CREATE UNIQUE INDEX events_model_call_request_id_key
    ON agentcap.events (run_id, run_started_at, (payload ->> 'request_id'))
    WHERE event_type = 'model_call' AND jsonb_typeof(payload -> 'request_id') = 'string';

ALTER TABLE agentcap.conflicts
    ADD CONSTRAINT conflicts_pkey PRIMARY KEY (run_id, run_started_at, conflict_id);
-- A re-sent conflicting row is recorded once (needs PostgreSQL 15 or later).
CREATE UNIQUE INDEX conflicts_dedup_idx
    ON agentcap.conflicts (run_id, run_started_at, reason, existing_event_id, row_digest)
    NULLS NOT DISTINCT;
CREATE INDEX conflicts_run_idx ON agentcap.conflicts (run_id, run_started_at, agent_id, logical_seq);

ALTER TABLE agentcap.spans
    ADD CONSTRAINT spans_pkey PRIMARY KEY (run_id, run_started_at, trace_id, span_id);

-- ------------------------------------------------------------------------------------------------
-- The coordination tables of 0005 (tool_ledger, spawns, memory) already lead their keys with
-- run_id. They stay unpartitioned: a run has one row per tool call, child and memory key (the
-- events hold every write), their functions name the run only, and db prune deletes their rows
-- with the run's other per-run rows (agents, record_conflicts, agent_sequences). Their functions
-- take the retention barrier like the writer and refuse a pruned run, so a late process of a run
-- that db prune removed cannot leave rows without a run.

-- The start of a run (null for a run no one has recorded yet), read under the retention barrier
-- (the shared advisory lock "agcap_rt" that db prune takes exclusively while it moves
-- pruned_before); raises for a run db prune removed.
CREATE FUNCTION agentcap.run_start_for_write(p_run text) RETURNS timestamptz
LANGUAGE plpgsql AS $$
DECLARE
    run_start timestamptz;
    floor_at  timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(7018687814428488308);
    SELECT s.pruned_before INTO floor_at FROM agentcap.log_settings s;
    SELECT r.started_at INTO run_start FROM agentcap.runs r WHERE r.run_id = p_run;
    IF run_start < floor_at OR EXISTS (SELECT 1 FROM agentcap.pruned_runs p WHERE p.run_id = p_run) THEN
        RAISE EXCEPTION 'run % was removed by db prune', p_run
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    RETURN run_start;
END $$;

-- 0005's functions again: each refuses a pruned run; spawn_register reads the spawn event of an
-- earlier version in its run's partition; memory_write writes its event with the run's start
-- (recording the run and creating its partition when it is the run's first write).
CREATE OR REPLACE FUNCTION agentcap.tool_claim(
    p_run text, p_agent text, p_invocation text, p_digest text, p_tool text,
    p_owner text, p_lease_seconds double precision, p_at_most_once boolean)
RETURNS TABLE (state text, attempt integer, ordinal integer, codec text, result jsonb,
               error jsonb, result_event_id uuid, result_event_seq bigint)
LANGUAGE plpgsql AS $$
DECLARE
    r agentcap.tool_ledger%ROWTYPE;
    lease interval := make_interval(secs => p_lease_seconds);
BEGIN
    PERFORM agentcap.run_start_for_write(p_run);
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

CREATE OR REPLACE FUNCTION agentcap.spawn_register(
    p_run text, p_child text, p_parent text, p_name text, p_key text, p_event uuid, p_seq bigint,
    p_trace text, p_span text)
RETURNS TABLE (won boolean, parent_agent_id text, name text, spawn_event_id uuid,
               spawn_seq bigint, trace_id text, span_id text)
LANGUAGE plpgsql AS $$
DECLARE
    s agentcap.spawns%ROWTYPE;
BEGIN
    PERFORM agentcap.run_start_for_write(p_run);
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
    FROM agentcap.agents a JOIN agentcap.runs r ON r.run_id = a.run_id
    JOIN agentcap.events e ON e.run_id = a.run_id AND e.run_started_at = r.started_at
        AND e.event_id = a.spawned_at_event_id
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

CREATE OR REPLACE FUNCTION agentcap.memory_write(
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
    run_start timestamptz;
BEGIN
    run_start := agentcap.run_start_for_write(p_run);
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
        IF run_start IS NULL THEN
            -- A run no registry claimed (PostgresMemory outside configure()): its first write
            -- fixes its start, as the exporter's first batch of it would.
            INSERT INTO agentcap.runs (run_id, started_at) VALUES (p_run, p_wall_time)
            ON CONFLICT (run_id) DO NOTHING;
            SELECT x.started_at INTO run_start FROM agentcap.runs x WHERE x.run_id = p_run;
        END IF;
        PERFORM agentcap.ensure_partitions(ARRAY[run_start]);
        INSERT INTO agentcap.events (event_id, run_id, agent_id, logical_seq, wall_time,
            event_type, causal_parent_ids, idempotency_key, trace_id, span_id, payload,
            run_started_at)
        VALUES (p_event, p_run, p_agent, p_seq, p_wall_time, 'memory_write', all_parents,
            'seq:' || p_seq, p_trace, p_span, body, run_start);
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

ANALYZE agentcap.runs, agentcap.events, agentcap.conflicts, agentcap.spans;
