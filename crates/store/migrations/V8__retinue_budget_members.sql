-- Budgets over the whole subagent tree (issue #23): the budget root is fixed
-- when a top-level unit is created (its parent's compression-lineage root)
-- and every child session it spawns is recorded here as a member of that
-- budget, so a nested spawn (an orchestrator child as the payer) and a
-- follow-up days later draw on the same budget, and the ledger rows billed
-- to member sessions count as the budget's spend. First write wins: a
-- session never moves to another budget. Additive only.
CREATE TABLE IF NOT EXISTS retinue_budget_members (
    session_id TEXT PRIMARY KEY,
    budget_root TEXT NOT NULL
);

CREATE INDEX IF NOT EXISTS retinue_idx_budget_members_root
    ON retinue_budget_members(budget_root);
