-- Usage in typed columns (issue #25): what each ledger row counts toward a
-- budget, typed once when the row is written, so "spent" is one indexed
-- aggregate instead of JSON parsed per row on every reservation. A side
-- table kept by triggers, so rows hermes (or anyone) writes are typed too;
-- the hermes columns stay as they are. The values follow
-- `retinue_core::UsageColumns`: SQLite's CAST of each field, negative or
-- non-finite as 0, malformed JSON as nothing. Additive only.
CREATE TABLE IF NOT EXISTS retinue_usage_columns (
    usage_id INTEGER PRIMARY KEY,
    parent_session_id TEXT NOT NULL,
    cost_usd REAL NOT NULL,
    input_tokens REAL NOT NULL,
    output_tokens REAL NOT NULL,
    cache_read_tokens REAL NOT NULL,
    cache_write_tokens REAL NOT NULL,
    reasoning_tokens REAL NOT NULL
);

CREATE INDEX IF NOT EXISTS retinue_idx_usage_columns_parent
    ON retinue_usage_columns(parent_session_id);

CREATE TRIGGER IF NOT EXISTS retinue_usage_columns_ins
AFTER INSERT ON delegation_child_usage
BEGIN
    INSERT OR REPLACE INTO retinue_usage_columns VALUES (
        NEW.id,
        ifnull(NEW.parent_session_id, ''),
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.cost_usd') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.cost_usd') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.cost_usd') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.tokens.input') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.tokens.input') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.tokens.input') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.tokens.output') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.tokens.output') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.tokens.output') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.tokens.cache_read') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.tokens.cache_read') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.tokens.cache_read') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.tokens.cache_write') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.tokens.cache_write') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.tokens.cache_write') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.tokens.reasoning') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.tokens.reasoning') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.tokens.reasoning') AS REAL) ELSE 0 END ELSE 0 END
    );
END;

CREATE TRIGGER IF NOT EXISTS retinue_usage_columns_upd
AFTER UPDATE ON delegation_child_usage
BEGIN
    DELETE FROM retinue_usage_columns WHERE usage_id = OLD.id;
    INSERT OR REPLACE INTO retinue_usage_columns VALUES (
        NEW.id,
        ifnull(NEW.parent_session_id, ''),
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.cost_usd') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.cost_usd') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.cost_usd') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.tokens.input') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.tokens.input') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.tokens.input') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.tokens.output') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.tokens.output') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.tokens.output') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.tokens.cache_read') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.tokens.cache_read') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.tokens.cache_read') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.tokens.cache_write') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.tokens.cache_write') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.tokens.cache_write') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(NEW.usage_json) THEN CASE WHEN CAST(json_extract(NEW.usage_json, '$.tokens.reasoning') AS REAL) > 0 AND CAST(json_extract(NEW.usage_json, '$.tokens.reasoning') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(NEW.usage_json, '$.tokens.reasoning') AS REAL) ELSE 0 END ELSE 0 END
    );
END;

CREATE TRIGGER IF NOT EXISTS retinue_usage_columns_del
AFTER DELETE ON delegation_child_usage
BEGIN
    DELETE FROM retinue_usage_columns WHERE usage_id = OLD.id;
END;

-- The rows written before this migration.
INSERT OR REPLACE INTO retinue_usage_columns
SELECT
    id,
    ifnull(parent_session_id, ''),
    CASE WHEN json_valid(usage_json) THEN CASE WHEN CAST(json_extract(usage_json, '$.cost_usd') AS REAL) > 0 AND CAST(json_extract(usage_json, '$.cost_usd') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(usage_json, '$.cost_usd') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(usage_json) THEN CASE WHEN CAST(json_extract(usage_json, '$.tokens.input') AS REAL) > 0 AND CAST(json_extract(usage_json, '$.tokens.input') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(usage_json, '$.tokens.input') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(usage_json) THEN CASE WHEN CAST(json_extract(usage_json, '$.tokens.output') AS REAL) > 0 AND CAST(json_extract(usage_json, '$.tokens.output') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(usage_json, '$.tokens.output') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(usage_json) THEN CASE WHEN CAST(json_extract(usage_json, '$.tokens.cache_read') AS REAL) > 0 AND CAST(json_extract(usage_json, '$.tokens.cache_read') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(usage_json, '$.tokens.cache_read') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(usage_json) THEN CASE WHEN CAST(json_extract(usage_json, '$.tokens.cache_write') AS REAL) > 0 AND CAST(json_extract(usage_json, '$.tokens.cache_write') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(usage_json, '$.tokens.cache_write') AS REAL) ELSE 0 END ELSE 0 END,
        CASE WHEN json_valid(usage_json) THEN CASE WHEN CAST(json_extract(usage_json, '$.tokens.reasoning') AS REAL) > 0 AND CAST(json_extract(usage_json, '$.tokens.reasoning') AS REAL) <= 1.7976931348623157e308 THEN CAST(json_extract(usage_json, '$.tokens.reasoning') AS REAL) ELSE 0 END ELSE 0 END
FROM delegation_child_usage;
