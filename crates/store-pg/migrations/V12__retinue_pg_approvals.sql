-- Approval requests of children's risky calls (issue #37), as on SQLite
-- (V13): a request moves once, pending -> approved | denied | expired, in
-- one UPDATE ... WHERE state = 'pending'; a pending request is expired when
-- its unit ends ("worker gone" when recovery finds the worker dead); rows
-- go with their unit; every change advances the web view's change clock.
CREATE TABLE IF NOT EXISTS retinue_approvals (
    approval_id TEXT COLLATE "C" PRIMARY KEY,
    delegation_id TEXT COLLATE "C" NOT NULL,
    subagent_id TEXT COLLATE "C" NOT NULL,
    tool TEXT NOT NULL,
    arguments_json TEXT NOT NULL,
    reason TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'approved', 'denied', 'expired')),
    scope TEXT NOT NULL DEFAULT 'once' CHECK (scope IN ('once', 'always')),
    requested_at DOUBLE PRECISION NOT NULL,
    decided_at DOUBLE PRECISION,
    decided_by TEXT,
    decision_reason TEXT
);

CREATE INDEX IF NOT EXISTS retinue_idx_approvals_pending
    ON retinue_approvals(delegation_id) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS retinue_idx_approvals_subagent
    ON retinue_approvals(subagent_id, tool) WHERE scope = 'always';

CREATE OR REPLACE FUNCTION retinue_approvals_gone() RETURNS trigger AS $$
BEGIN
    DELETE FROM retinue_approvals WHERE delegation_id = OLD.delegation_id;
    RETURN OLD;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS retinue_approvals_gone ON async_delegations;
CREATE TRIGGER retinue_approvals_gone AFTER DELETE ON async_delegations
    FOR EACH ROW EXECUTE FUNCTION retinue_approvals_gone();

CREATE OR REPLACE FUNCTION retinue_approvals_unit_ended() RETURNS trigger AS $$
BEGIN
    UPDATE retinue_approvals
       SET state = 'expired',
           decided_at = extract(epoch FROM clock_timestamp()),
           decided_by = 'retinue',
           decision_reason = CASE NEW.state WHEN 'unknown' THEN 'worker gone'
                             ELSE 'the unit ended (' || NEW.state || ')' END
     WHERE delegation_id = NEW.delegation_id AND state = 'pending';
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS retinue_approvals_unit_ended ON async_delegations;
CREATE TRIGGER retinue_approvals_unit_ended AFTER UPDATE OF state ON async_delegations
    FOR EACH ROW WHEN (NEW.state NOT IN ('pending', 'running', 'finalizing')
                       AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION retinue_approvals_unit_ended();

DROP TRIGGER IF EXISTS retinue_change_approvals ON retinue_approvals;
CREATE TRIGGER retinue_change_approvals
AFTER INSERT OR DELETE OR UPDATE OF state ON retinue_approvals
FOR EACH ROW EXECUTE FUNCTION retinue_change_tick();
