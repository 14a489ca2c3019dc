-- The web view's change marker (issue #35): a sequence every write of a
-- unit or a child advances, read in O(1) (it was max(updated_at) and two
-- counts, O(n); a planted NaN froze it). A sequence never conflicts:
-- concurrent serializable writers do not queue on it.
CREATE SEQUENCE IF NOT EXISTS retinue_change_clock;

CREATE OR REPLACE FUNCTION retinue_change_tick() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('retinue_change_clock');
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS retinue_change_units ON async_delegations;
CREATE TRIGGER retinue_change_units AFTER INSERT OR UPDATE OR DELETE ON async_delegations
    FOR EACH STATEMENT EXECUTE FUNCTION retinue_change_tick();
DROP TRIGGER IF EXISTS retinue_change_children ON retinue_children;
CREATE TRIGGER retinue_change_children AFTER INSERT OR UPDATE OR DELETE ON retinue_children
    FOR EACH STATEMENT EXECUTE FUNCTION retinue_change_tick();
