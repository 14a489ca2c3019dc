-- Retention reads through indexes instead of over every retained unit.
--
-- The live retained units of each profile in cap order (newest first): the
-- lookup's cap rank and the "is any profile over its cap?" check of a prune
-- read a range of this index (index-only: the profile column is included so
-- PostgreSQL can answer from the index alone).
CREATE INDEX IF NOT EXISTS retinue_idx_async_cap_rank
    ON async_delegations ((COALESCE(owner_profile, '')), retained_at DESC NULLS LAST,
                          delegation_id DESC)
    INCLUDE (owner_profile)
    WHERE retained = 1 AND tombstoned_at IS NULL;

-- Live children by TTL clock: "is any child past its TTL?" reads the oldest
-- end of this index only.
CREATE INDEX IF NOT EXISTS retinue_idx_children_ttl
    ON retinue_children (retained_at) WHERE tombstoned_at IS NULL;

-- Live retained units per profile (retained = 1, not tombstoned), so that
-- "can this profile be over its cap at all?" is one row, not a count over
-- the profile. Written in the transaction of every write that can add live
-- units (a prune recounts exactly; retaining always prunes; `retinue
-- migrate` recounts). A count that is too high only sends a lookup to the
-- exact path (and makes a prune run, which recounts); a profile without a
-- row sends a lookup to the exact path too.
CREATE TABLE IF NOT EXISTS retinue_profile_live (
    profile TEXT COLLATE "C" PRIMARY KEY,
    units BIGINT NOT NULL
);

INSERT INTO retinue_profile_live (profile, units)
    SELECT COALESCE(owner_profile, ''), count(*) FROM async_delegations
    WHERE retained = 1 AND tombstoned_at IS NULL GROUP BY 1
    ON CONFLICT (profile) DO UPDATE SET units = EXCLUDED.units;
