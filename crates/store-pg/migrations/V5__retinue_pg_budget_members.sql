-- Budgets over the whole subagent tree (issue #23), as the SQLite backend's
-- V8: the members of each budget (child sessions, first write wins), and a
-- reservation kept as spent (a failed ledger write, an owner that died
-- mid-run) instead of released. Additive only.
CREATE TABLE IF NOT EXISTS retinue_budget_members (
    session_id TEXT COLLATE "C" PRIMARY KEY,
    budget_root TEXT COLLATE "C" NOT NULL
);

CREATE INDEX IF NOT EXISTS retinue_idx_budget_members_root
    ON retinue_budget_members(budget_root);

ALTER TABLE retinue_budget_reservations ADD COLUMN IF NOT EXISTS kept_spent_at DOUBLE PRECISION;
