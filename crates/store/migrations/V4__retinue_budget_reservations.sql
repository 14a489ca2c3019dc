-- Budget reservations (delegation.budget): before a child or a follow-up
-- starts, its allowance is reserved against its compression lineage's budget
-- (keyed by the lineage root) in one BEGIN IMMEDIATE transaction that first
-- sums what the lineage spent (its ledger rows) and what is still reserved.
-- A reservation is settled when its run's ledger rows are written; one left
-- by a dead owner is released by recovery. Additive only.
CREATE TABLE IF NOT EXISTS retinue_budget_reservations (
    reservation_id TEXT PRIMARY KEY,
    lineage_root TEXT NOT NULL,
    delegation_id TEXT,
    cost_usd REAL NOT NULL DEFAULT 0,
    tokens INTEGER NOT NULL DEFAULT 0,
    owner_pid INTEGER,
    owner_started_at INTEGER,
    created_at REAL NOT NULL,
    settled_at REAL,
    settle_reason TEXT
);

CREATE INDEX IF NOT EXISTS retinue_idx_budget_open
    ON retinue_budget_reservations(lineage_root) WHERE settled_at IS NULL;
