-- A prune's tombstone of a unit covers its children (semantics §0, amendment to
-- §2.5): TTL and cap pruning write the unit's `tombstoned_at` (as hermes
-- does) and one row here, instead of one row per child. A child without a
-- tombstone of its own, whose unit's `tombstoned_at` equals this row's,
-- reports what a per-child write would have stored: `ttl` at its
-- `retained_at` + `ttl_seconds` (never after the tombstone) when it had
-- expired by then, else `cap` at the tombstone time. A unit tombstone
-- without a matching row here is another writer's (`external`). Per-child
-- events (manual tombstones, a partly expired unit) still write the child's
-- own row, which always wins. Additive only.
CREATE TABLE IF NOT EXISTS retinue_unit_tombstones (
    delegation_id TEXT PRIMARY KEY,
    tombstoned_at REAL NOT NULL,
    ttl_seconds REAL NOT NULL
) WITHOUT ROWID;

-- The live (untombstoned) children of each unit with their TTL clocks: the
-- prune's "has a live child", "has an expired child" and covered-children
-- counts, and the readers' liveness checks, read this small index only.
CREATE INDEX IF NOT EXISTS retinue_idx_children_live
    ON retinue_children(delegation_id, retained_at) WHERE tombstoned_at IS NULL;

-- The retained units in rank order, now with their ids: the cap boundary,
-- the units beyond it and every scan over live units (backfill, prune
-- checks, lists and ranks) read this index only, never the wide unit rows.
-- It replaces Retinue's own index of V1 (same leading columns).
DROP INDEX IF EXISTS retinue_idx_async_retained;
CREATE INDEX IF NOT EXISTS retinue_idx_async_rank
    ON async_delegations(retained, tombstoned_at, retained_at, delegation_id);
