-- The web view's change marker (issue #35): a counter every write of a
-- unit or a child bumps, so the page's poll reads one row whatever the
-- number of units (it read max(updated_at) and two counts, O(n), and a
-- planted non-numeric updated_at made it fail for good). hermes's own
-- writes of async_delegations bump it too (the triggers live in the file).
-- Additive only.
CREATE TABLE IF NOT EXISTS retinue_change_clock (
    id   INTEGER PRIMARY KEY CHECK (id = 1),
    tick INTEGER NOT NULL
);
INSERT OR IGNORE INTO retinue_change_clock (id, tick) VALUES (1, 0);

CREATE TRIGGER IF NOT EXISTS retinue_change_unit_insert AFTER INSERT ON async_delegations
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;
CREATE TRIGGER IF NOT EXISTS retinue_change_unit_update AFTER UPDATE ON async_delegations
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;
CREATE TRIGGER IF NOT EXISTS retinue_change_unit_delete AFTER DELETE ON async_delegations
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;
CREATE TRIGGER IF NOT EXISTS retinue_change_child_insert AFTER INSERT ON retinue_children
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;
CREATE TRIGGER IF NOT EXISTS retinue_change_child_update AFTER UPDATE ON retinue_children
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;
