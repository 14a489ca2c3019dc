-- Each tenant's live retained units, counted by the server itself (issue #41).
--
-- Before, every retain ranked its tenant's live units and wrote the count
-- row back (`retinue_profile_live`, one row per profile): concurrent retains
-- of one tenant conflicted on that row and on the ranking, so they queued
-- behind each other even when nothing was over the cap. Now:
--
-- * the count is kept in stripes, one row per (profile, stripe); the live
--   count is their sum. A writer's change goes to the stripe of its backend
--   (`pg_backend_pid() % 64`), so concurrent writers rarely touch one row;
-- * triggers on `async_delegations` move the count whenever a row starts or
--   stops being live (retained = 1, not tombstoned) or a live row changes
--   tenant, whoever writes it: Retinue, `retinue migrate`, psql or another
--   program. The count is exact after every commit;
-- * a retain checks the sum in the statement that retains, and ranks and
--   prunes (serialized, as before) only when its tenant is over the cap or a
--   TTL is due; every prune recounts its tenant exactly (a count edited by
--   hand is repaired there).
--
-- The triggers name the count table in their table's own schema, so a
-- connection with another search_path counts in the right place.
ALTER TABLE retinue_profile_live ADD COLUMN IF NOT EXISTS stripe INT NOT NULL DEFAULT 0;
ALTER TABLE retinue_profile_live DROP CONSTRAINT IF EXISTS retinue_profile_live_pkey;
ALTER TABLE retinue_profile_live ADD PRIMARY KEY (profile, stripe);

CREATE OR REPLACE FUNCTION retinue_live_count() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    upsert TEXT := format(
        'INSERT INTO %I.retinue_profile_live AS l (profile, stripe, units) VALUES ($1, $2, $3) '
        'ON CONFLICT (profile, stripe) DO UPDATE SET units = l.units + EXCLUDED.units',
        TG_TABLE_SCHEMA);
    s INT := pg_backend_pid() % 64;
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        IF (OLD.retained = 1 AND OLD.tombstoned_at IS NULL) IS TRUE THEN
            EXECUTE upsert USING COALESCE(OLD.owner_profile, ''), s, -1::BIGINT;
        END IF;
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') THEN
        IF (NEW.retained = 1 AND NEW.tombstoned_at IS NULL) IS TRUE THEN
            EXECUTE upsert USING COALESCE(NEW.owner_profile, ''), s, 1::BIGINT;
        END IF;
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS retinue_live_insert ON async_delegations;
CREATE TRIGGER retinue_live_insert
AFTER INSERT ON async_delegations
FOR EACH ROW WHEN ((NEW.retained = 1 AND NEW.tombstoned_at IS NULL) IS TRUE)
EXECUTE FUNCTION retinue_live_count();

DROP TRIGGER IF EXISTS retinue_live_update ON async_delegations;
CREATE TRIGGER retinue_live_update
AFTER UPDATE OF retained, tombstoned_at, owner_profile ON async_delegations
FOR EACH ROW WHEN (
    (OLD.retained = 1 AND OLD.tombstoned_at IS NULL) IS DISTINCT FROM
        (NEW.retained = 1 AND NEW.tombstoned_at IS NULL)
    OR ((NEW.retained = 1 AND NEW.tombstoned_at IS NULL) IS TRUE
        AND COALESCE(OLD.owner_profile, '') <> COALESCE(NEW.owner_profile, '')))
EXECUTE FUNCTION retinue_live_count();

DROP TRIGGER IF EXISTS retinue_live_delete ON async_delegations;
CREATE TRIGGER retinue_live_delete
AFTER DELETE ON async_delegations
FOR EACH ROW WHEN ((OLD.retained = 1 AND OLD.tombstoned_at IS NULL) IS TRUE)
EXECUTE FUNCTION retinue_live_count();

-- The exact count, once, on stripe 0.
DELETE FROM retinue_profile_live;
INSERT INTO retinue_profile_live (profile, stripe, units)
    SELECT COALESCE(owner_profile, ''), 0, count(*) FROM async_delegations
    WHERE retained = 1 AND tombstoned_at IS NULL GROUP BY 1;
