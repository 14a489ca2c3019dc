-- The web view's change marker (issue #35): a counter that every write the
-- view shows bumps (a unit dispatched, finished, retained, delivered or
-- tombstoned; a child retained, refreshed or tombstoned), so the page's
-- poll reads one row whatever the number of units. It replaces
-- max(updated_at) and two counts (O(n); a planted text updated_at failed
-- it for good). Claims (resume, delivery) do not bump it: a refused call
-- that claims and releases changes nothing. hermes's own writes of
-- async_delegations bump it too (the triggers live in the file).
-- Additive only.
CREATE TABLE IF NOT EXISTS retinue_change_clock (
    id   INTEGER PRIMARY KEY CHECK (id = 1),
    tick INTEGER NOT NULL
);
INSERT OR IGNORE INTO retinue_change_clock (id, tick) VALUES (1, 0);

CREATE TRIGGER IF NOT EXISTS retinue_change_unit_insert
AFTER INSERT ON async_delegations
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;

CREATE TRIGGER IF NOT EXISTS retinue_change_unit_update
AFTER UPDATE OF state, completed_at, updated_at, result_json, delivery_state, delivered_at,
    retained, retained_at, tombstoned_at, children_json, usage_json, owner_pid, child_session_id
ON async_delegations
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;

CREATE TRIGGER IF NOT EXISTS retinue_change_unit_delete
AFTER DELETE ON async_delegations
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;

CREATE TRIGGER IF NOT EXISTS retinue_change_child_insert
AFTER INSERT ON retinue_children
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;

CREATE TRIGGER IF NOT EXISTS retinue_change_child_update
AFTER UPDATE OF retained_at, tombstoned_at, tombstone_reason, tombstone_note, manifest_json,
    child_session_id
ON retinue_children
BEGIN UPDATE retinue_change_clock SET tick = tick + 1 WHERE id = 1; END;
