-- hermes keeps one TTL clock per unit (`async_delegations.retained_at`);
-- Retinue keeps one per child (`retinue_children.retained_at`), so a
-- follow-up refreshes only its own child. When another program (hermes
-- refreshing or backdating a unit, as its own tests do) moves a unit's
-- clock, the unit's live children move with it, so TTL answers and prunes
-- agree with hermes's (issue #22). Retinue's own writes of the unit clock
-- hold the guard row inside their transaction (no other connection ever
-- sees it: SQLite has one writer), so its per-child refresh stays per child.
-- Additive only.
CREATE TABLE IF NOT EXISTS retinue_clock_guard (held INTEGER PRIMARY KEY);

CREATE TRIGGER IF NOT EXISTS retinue_unit_clock_moved
AFTER UPDATE OF retained_at ON async_delegations
WHEN NEW.retained_at IS NOT NULL AND NEW.retained_at IS NOT OLD.retained_at
     AND NOT EXISTS (SELECT 1 FROM retinue_clock_guard)
BEGIN
    UPDATE retinue_children SET retained_at = NEW.retained_at
    WHERE delegation_id = NEW.delegation_id AND tombstoned_at IS NULL;
END;
