-- 0004: first writer wins for agents and runs, as for events.
-- Applied by otel_agentcap.exporters.postgres.migrate inside one transaction, under an advisory lock.
--
-- An agents row keeps the first name stored for the agent and the first lineage (its parent and
-- spawn event, or none for a root agent) stored by a record that knows it (the agent's own
-- agent_start, its parent's agent_spawn). A runs row keeps its first start and its first
-- attribute declaration and root span. Later records only fill what is still unknown; every record that
-- differs from what is stored goes to agentcap.record_conflicts with a reason, and the triggers
-- below refuse any UPDATE that would change a stored value, whoever sends it.

-- Runs keep their first start (the root span's, when the run was claimed) and root span ids.

-- lineage_known: parent_agent_id and spawned_at_event_id are known (a null parent is a root).
ALTER TABLE agentcap.agents ADD COLUMN lineage_known boolean NOT NULL DEFAULT false;
UPDATE agentcap.agents SET lineage_known = true WHERE parent_agent_id IS NOT NULL;

-- attributes_declared: attributes come from a declaration (ac.run(run_id, **attributes)); until
-- then they are the empty default and may be filled once.
ALTER TABLE agentcap.runs ADD COLUMN attributes_declared boolean NOT NULL DEFAULT false;
UPDATE agentcap.runs SET attributes_declared = true WHERE attributes <> '{}'::jsonb;

-- A record that differs from the stored agent or run row. The offered value is kept in full next
-- to what is stored; a re-sent record is kept once.
CREATE TABLE agentcap.record_conflicts (
    run_id      text        NOT NULL,
    conflict_id bigint      GENERATED ALWAYS AS IDENTITY,
    agent_id    text,       -- null for a run
    reason      text        NOT NULL CONSTRAINT record_conflicts_reason_check CHECK (reason IN (
                    'agent_name', 'agent_lineage', 'run_attributes')),
    stored      jsonb       NOT NULL,
    offered     jsonb       NOT NULL,
    row_digest  text        NOT NULL,
    detected_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT record_conflicts_pkey PRIMARY KEY (run_id, conflict_id)
);
CREATE UNIQUE INDEX record_conflicts_dedup_idx
    ON agentcap.record_conflicts (run_id, agent_id, reason, row_digest) NULLS NOT DISTINCT;

CREATE FUNCTION agentcap.agents_first_writer_wins() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.run_id IS DISTINCT FROM OLD.run_id OR NEW.agent_id IS DISTINCT FROM OLD.agent_id
       OR NEW.recorded_at IS DISTINCT FROM OLD.recorded_at
       OR (OLD.name IS NOT NULL AND NEW.name IS DISTINCT FROM OLD.name)
       OR ((OLD.lineage_known OR OLD.parent_agent_id IS NOT NULL)
           AND (NEW.parent_agent_id IS DISTINCT FROM OLD.parent_agent_id
                OR NEW.spawned_at_event_id IS DISTINCT FROM OLD.spawned_at_event_id))
       OR (OLD.lineage_known AND NOT NEW.lineage_known) THEN
        RAISE EXCEPTION 'agentcap.agents (%, %): a stored value cannot change (first writer wins)',
            OLD.run_id, OLD.agent_id USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER agents_first_writer_wins BEFORE UPDATE ON agentcap.agents
    FOR EACH ROW EXECUTE FUNCTION agentcap.agents_first_writer_wins();

CREATE FUNCTION agentcap.runs_first_writer_wins() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.run_id IS DISTINCT FROM OLD.run_id OR NEW.started_at IS DISTINCT FROM OLD.started_at
       OR NEW.recorded_at IS DISTINCT FROM OLD.recorded_at
       OR (OLD.trace_id IS NOT NULL AND (NEW.trace_id IS DISTINCT FROM OLD.trace_id
                                         OR NEW.root_span_id IS DISTINCT FROM OLD.root_span_id))
       OR (OLD.attributes_declared AND (NEW.attributes IS DISTINCT FROM OLD.attributes
                                        OR NOT NEW.attributes_declared)) THEN
        RAISE EXCEPTION 'agentcap.runs (%): a stored value cannot change (first writer wins)',
            OLD.run_id USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER runs_first_writer_wins BEFORE UPDATE ON agentcap.runs
    FOR EACH ROW EXECUTE FUNCTION agentcap.runs_first_writer_wins();

-- The events and conflicts tables are append-only for everyone but their owner (see the roles
-- that `otel-agentcap db grant` creates); these triggers also refuse UPDATE of them to anyone
-- the owner may have granted it by mistake. DELETE stays possible for the owner (pruning).
CREATE FUNCTION agentcap.append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'agentcap.%: rows are never changed (append-only)', TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END $$;
CREATE TRIGGER events_append_only BEFORE UPDATE ON agentcap.events
    FOR EACH ROW EXECUTE FUNCTION agentcap.append_only();
CREATE TRIGGER conflicts_append_only BEFORE UPDATE ON agentcap.conflicts
    FOR EACH ROW EXECUTE FUNCTION agentcap.append_only();

-- Roles that `otel-agentcap db grant` set up: migrate() grants them their privileges again on
-- the tables of later migrations.
CREATE TABLE agentcap.roles (
    kind      text PRIMARY KEY CONSTRAINT roles_kind_check CHECK (kind IN ('owner', 'writer', 'reader')),
    role_name text NOT NULL
);
