-- Budget reservations (delegation.budget) on PostgreSQL: the same table as
-- the SQLite backend's V4, plus the worker that holds each reservation, so
-- recovery (from any host) releases those of workers whose lease expired.
-- Reserving runs in one SERIALIZABLE transaction that first sums what the
-- lineage spent (its ledger rows) and what is still reserved. Additive only.
CREATE TABLE IF NOT EXISTS retinue_budget_reservations (
    reservation_id TEXT PRIMARY KEY,
    lineage_root TEXT COLLATE "C" NOT NULL,
    delegation_id TEXT,
    cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
    tokens BIGINT NOT NULL DEFAULT 0,
    owner_pid BIGINT,
    owner_started_at BIGINT,
    owner_worker TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    settled_at DOUBLE PRECISION,
    settle_reason TEXT
);

CREATE INDEX IF NOT EXISTS retinue_idx_budget_open
    ON retinue_budget_reservations(lineage_root) WHERE settled_at IS NULL;
