-- Approval requests of children's risky calls (issue #37): one row per call
-- that waits for a human, shared by every surface (CLI, MCP, web view).
-- A request moves once, pending -> approved | denied | expired, in one
-- UPDATE ... WHERE state = 'pending'. When its unit ends (any state but
-- pending, running, finalizing) a pending request is expired in the same
-- statement ("worker gone" when recovery finds the worker dead), and rows go
-- with their unit when the history pruner deletes it. Every change bumps
-- the web view's change clock (V12). Additive only.
CREATE TABLE IF NOT EXISTS retinue_approvals (
    approval_id TEXT PRIMARY KEY,
    delegation_id TEXT NOT NULL,
    subagent_id TEXT NOT NULL,
    tool TEXT NOT NULL,
    arguments_json TEXT NOT NULL,
    reason TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'approved', 'denied', 'expired')),
    scope TEXT NOT NULL DEFAULT 'once' CHECK (scope IN ('once', 'always')),
    requested_at REAL NOT NULL,
    decided_at REAL,
    decided_by TEXT,
    decision_reason TEXT
);

CREATE INDEX IF NOT EXISTS retinue_idx_approvals_pending
    ON retinue_approvals(delegation_id) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS retinue_idx_approvals_subagent
    ON retinue_approvals(subagent_id, tool) WHERE scope = 'always';

CREATE TRIGGER IF NOT EXISTS retinue_approvals_gone
AFTER DELETE ON async_delegations
BEGIN
    DELETE FROM retinue_approvals WHERE delegation_id = OLD.delegation_id;
END;

CREATE TRIGGER IF NOT EXISTS retinue_approvals_unit_ended
AFTER UPDATE OF state ON async_delegations
WHEN NEW.state NOT IN ('pending', 'running', 'finalizing') AND OLD.state IS NOT NEW.state
BEGIN
    UPDATE retinue_approvals
       SET state = 'expired',
           decided_at = (julianday('now') - 2440587.5) * 86400.0,
           decided_by = 'retinue',
           decision_reason = CASE NEW.state WHEN 'unknown' THEN 'worker gone'
                             ELSE 'the unit ended (' || NEW.state || ')' END
     WHERE delegation_id = NEW.delegation_id AND state = 'pending';
END;

CREATE TRIGGER IF NOT EXISTS retinue_change_approval_insert
AFTER INSERT ON retinue_approvals
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;

CREATE TRIGGER IF NOT EXISTS retinue_change_approval_update
AFTER UPDATE OF state ON retinue_approvals
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;
