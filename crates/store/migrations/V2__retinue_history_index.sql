-- The history pruner (semantics §3.6) reads only non-retained terminal units, a
-- set it keeps bounded (at most TERMINAL_KEEP + PENDING_KEEP rows between
-- runs). This partial index holds exactly those rows, so the pruner never
-- scans the retained units or the whole table. Additive only.
CREATE INDEX IF NOT EXISTS retinue_idx_async_history
    ON async_delegations(delivery_state, updated_at)
    WHERE retained IS NULL AND state NOT IN ('running', 'finalizing');
