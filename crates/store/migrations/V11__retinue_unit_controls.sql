-- The control mailbox of background units (issue #26): a steer for one
-- running child or a cancel of a whole unit, posted by any process
-- (`retinue steer`, `retinue cancel`, an MCP server) and taken exactly once
-- by the worker that runs the unit (one UPDATE … RETURNING). A steer nobody
-- took before the unit finished is settled `missed`, never dropped. Rows go
-- with their unit when the history pruner deletes it. Additive only.
CREATE TABLE IF NOT EXISTS retinue_unit_controls (
    control_id INTEGER PRIMARY KEY AUTOINCREMENT,
    delegation_id TEXT NOT NULL,
    subagent_id TEXT,
    kind TEXT NOT NULL CHECK (kind IN ('steer', 'cancel')),
    message TEXT,
    created_at REAL NOT NULL,
    taken_at REAL,
    outcome TEXT NOT NULL DEFAULT 'pending'
        CHECK (outcome IN ('pending', 'taken', 'delivered', 'missed'))
);

CREATE INDEX IF NOT EXISTS retinue_idx_controls_pending
    ON retinue_unit_controls(delegation_id) WHERE outcome = 'pending';

CREATE TRIGGER IF NOT EXISTS retinue_unit_controls_gone
AFTER DELETE ON async_delegations
BEGIN
    DELETE FROM retinue_unit_controls WHERE delegation_id = OLD.delegation_id;
END;
