-- A claim given up before its body started (its caller was cancelled while the claim was in
-- flight) is withdrawn: the first attempt's row goes, so the next claim runs the body, also for
-- an at_most_once call (a released claim of one reads as an unknown outcome). Only a running
-- first attempt of the caller's own, under the claim function's per-invocation lock, and only
-- while no later identity under the same invocation id has counted the row for its ordinal.
-- SECURITY DEFINER: the writer role may not delete from the ledger, and withdraws through this
-- function only its own unstarted claims.
CREATE FUNCTION agentcap.tool_unclaim(
    p_run text, p_agent text, p_invocation text, p_digest text, p_owner text, p_attempt integer)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    removed integer;
BEGIN
    PERFORM pg_advisory_xact_lock(
        hashtextextended(p_run || chr(31) || p_agent || chr(31) || p_invocation, 1634167153));
    DELETE FROM agentcap.tool_ledger l
    WHERE l.run_id = p_run AND l.agent_id = p_agent AND l.invocation_id = p_invocation
      AND l.call_digest = p_digest AND l.owner = p_owner AND l.attempt = p_attempt
      AND l.attempt = 1 AND l.status = 'running'
      AND NOT EXISTS (
        SELECT 1 FROM agentcap.tool_ledger x
        WHERE x.run_id = l.run_id AND x.agent_id = l.agent_id
          AND x.invocation_id = l.invocation_id AND x.ordinal > l.ordinal);
    GET DIAGNOSTICS removed = ROW_COUNT;
    RETURN removed > 0;
END
$$;
