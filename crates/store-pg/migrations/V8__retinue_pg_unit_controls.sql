-- The control mailbox of background units (issue #26), as on SQLite (V11):
-- a steer for one running child or a cancel of a whole unit, taken exactly
-- once by the worker that runs the unit. Rows go with their unit.
CREATE TABLE IF NOT EXISTS retinue_unit_controls (
    control_id BIGSERIAL PRIMARY KEY,
    delegation_id TEXT COLLATE "C" NOT NULL,
    subagent_id TEXT,
    kind TEXT NOT NULL CHECK (kind IN ('steer', 'cancel')),
    message TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    taken_at DOUBLE PRECISION,
    outcome TEXT NOT NULL DEFAULT 'pending'
        CHECK (outcome IN ('pending', 'taken', 'delivered', 'missed'))
);

CREATE INDEX IF NOT EXISTS retinue_idx_controls_pending
    ON retinue_unit_controls(delegation_id) WHERE outcome = 'pending';

CREATE OR REPLACE FUNCTION retinue_unit_controls_gone() RETURNS trigger AS $$
BEGIN
    DELETE FROM retinue_unit_controls WHERE delegation_id = OLD.delegation_id;
    RETURN OLD;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS retinue_unit_controls_gone ON async_delegations;
CREATE TRIGGER retinue_unit_controls_gone AFTER DELETE ON async_delegations
    FOR EACH ROW EXECUTE FUNCTION retinue_unit_controls_gone();
