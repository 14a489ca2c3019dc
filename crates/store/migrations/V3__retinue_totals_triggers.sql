-- Maintained usage totals stay exact whoever writes the ledger (hermes, a
-- script, an operator): any insert, update or delete that touches a row a
-- parent's totals already cover drops that parent's totals row, and the next
-- read folds the parent's rows afresh (the next write re-caches them). Rows
-- above `covered_id` are already folded at read time. Additive only: nothing
-- of hermes is renamed, dropped or rebuilt.
CREATE TRIGGER IF NOT EXISTS retinue_usage_totals_ins
AFTER INSERT ON delegation_child_usage
WHEN NEW.id <= (SELECT covered_id FROM retinue_usage_totals
                WHERE parent_session_id = NEW.parent_session_id)
BEGIN
    DELETE FROM retinue_usage_totals WHERE parent_session_id = NEW.parent_session_id;
END;

CREATE TRIGGER IF NOT EXISTS retinue_usage_totals_upd
AFTER UPDATE ON delegation_child_usage
BEGIN
    DELETE FROM retinue_usage_totals
    WHERE (parent_session_id = OLD.parent_session_id AND covered_id >= OLD.id)
       OR (parent_session_id = NEW.parent_session_id AND covered_id >= NEW.id);
END;

CREATE TRIGGER IF NOT EXISTS retinue_usage_totals_del
AFTER DELETE ON delegation_child_usage
BEGIN
    DELETE FROM retinue_usage_totals
    WHERE parent_session_id = OLD.parent_session_id AND covered_id >= OLD.id;
END;

-- Totals cached before the triggers existed may already be stale: start over.
DELETE FROM retinue_usage_totals;
