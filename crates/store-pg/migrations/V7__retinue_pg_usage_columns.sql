-- Usage in typed columns (issue #25): what each ledger row counts toward a
-- budget (`retinue_core::UsageColumns`), typed once when the row is written,
-- so "spent" is one aggregate over the parent index instead of JSON parsed
-- per row on every reservation. NULL = not typed yet (rows written before
-- this migration, or copied by `retinue migrate`): the store types them
-- when it opens and after an import. `usage_json` stays as it is.
ALTER TABLE delegation_child_usage
    ADD COLUMN IF NOT EXISTS cost_usd DOUBLE PRECISION,
    ADD COLUMN IF NOT EXISTS input_tokens DOUBLE PRECISION,
    ADD COLUMN IF NOT EXISTS output_tokens DOUBLE PRECISION,
    ADD COLUMN IF NOT EXISTS cache_read_tokens DOUBLE PRECISION,
    ADD COLUMN IF NOT EXISTS cache_write_tokens DOUBLE PRECISION,
    ADD COLUMN IF NOT EXISTS reasoning_tokens DOUBLE PRECISION;

CREATE INDEX IF NOT EXISTS retinue_idx_usage_untyped
    ON delegation_child_usage(id) WHERE cost_usd IS NULL;
