-- A unit's live children by the unit (issue #28): the list joins each live
-- retained unit with its live children. Without this index a generic plan
-- could scan every live child once per unit (the TTL index, whose only
-- condition is the partial one); with it the per-unit lookup is always a
-- range of this small index.
CREATE INDEX IF NOT EXISTS retinue_idx_children_live_unit
    ON retinue_children (delegation_id) WHERE tombstoned_at IS NULL;
