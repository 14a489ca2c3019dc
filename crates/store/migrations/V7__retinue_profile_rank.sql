-- The retention limits (TTL, cap) apply per profile (issue #17): one
-- tenant's delegations never evict another's retained children. The cap
-- ranks a profile's live units among themselves, so the rank index now
-- leads with the profile key after the liveness columns. A NULL
-- `owner_profile` is the empty profile (semantics §1), the same key the
-- readers compare with. For a hermes `state.db`, where every unit has the
-- same profile, every rank and every prune is exactly what it was.
-- Scans over all live units (backfill, the TTL) read the same prefix.
-- Additive only for hermes: Retinue's own V5 index is replaced.
DROP INDEX IF EXISTS retinue_idx_async_rank;
CREATE INDEX IF NOT EXISTS retinue_idx_async_profile_rank
    ON async_delegations(retained, tombstoned_at, COALESCE(owner_profile, ''), retained_at,
                         delegation_id);
