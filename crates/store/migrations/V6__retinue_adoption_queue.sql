-- Units another writer (hermes) retains without Retinue's child rows are
-- queued by these triggers, which fire for every writer of the file; the
-- open sequence adopts them (backfill) only when the queue is not empty, so
-- opening never scans the whole history of retained units. Retinue's own
-- units have child rows before they are retained and are never queued.
-- Additive only: nothing of hermes is renamed, dropped or rebuilt.
CREATE TABLE IF NOT EXISTS retinue_adoption_queue (
    delegation_id TEXT PRIMARY KEY
);

CREATE TRIGGER IF NOT EXISTS retinue_adoption_queue_ins
AFTER INSERT ON async_delegations
WHEN NEW.retained = 1
 AND NOT EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = NEW.delegation_id)
BEGIN
    INSERT OR IGNORE INTO retinue_adoption_queue (delegation_id) VALUES (NEW.delegation_id);
END;

CREATE TRIGGER IF NOT EXISTS retinue_adoption_queue_upd
AFTER UPDATE OF retained ON async_delegations
WHEN NEW.retained = 1
 AND NOT EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = NEW.delegation_id)
BEGIN
    INSERT OR IGNORE INTO retinue_adoption_queue (delegation_id) VALUES (NEW.delegation_id);
END;

-- What is unadopted now (a file upgraded to this version) is queued once.
INSERT OR IGNORE INTO retinue_adoption_queue (delegation_id)
SELECT u.delegation_id FROM async_delegations u
WHERE u.retained = 1
  AND NOT EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id);
