-- The web view's change marker (issue #35): a sequence that every write
-- the view shows advances (see the SQLite V12), read in O(1). It replaces
-- max(updated_at) and two counts (O(n); a planted NaN froze it). A
-- sequence never conflicts: concurrent serializable writers do not queue
-- on it. The trigger names the sequence in its table's own schema, so a
-- connection with another search_path finds it. Claims do not advance it.
-- Row-level: a statement that changes no row (a prune with nothing to do)
-- costs nothing.
CREATE SEQUENCE IF NOT EXISTS retinue_change_clock;

CREATE OR REPLACE FUNCTION retinue_change_tick() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval(format('%I.retinue_change_clock', TG_TABLE_SCHEMA)::regclass);
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS retinue_change_units ON async_delegations;
CREATE TRIGGER retinue_change_units
AFTER INSERT OR DELETE OR UPDATE OF state, completed_at, updated_at, result_json, delivery_state,
    delivered_at, retained, retained_at, tombstoned_at, children_json, usage_json,
    child_session_id
ON async_delegations
FOR EACH ROW EXECUTE FUNCTION retinue_change_tick();

DROP TRIGGER IF EXISTS retinue_change_children ON retinue_children;
CREATE TRIGGER retinue_change_children
AFTER INSERT OR DELETE OR UPDATE OF retained_at, tombstoned_at, tombstone_reason,
    tombstone_note, manifest_json, child_session_id
ON retinue_children
FOR EACH ROW EXECUTE FUNCTION retinue_change_tick();
