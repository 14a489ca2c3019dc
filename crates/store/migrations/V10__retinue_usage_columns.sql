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

-- Each field is read once per row (a derived table); malformed JSON types
-- as zeros.
CREATE TRIGGER IF NOT EXISTS retinue_usage_columns_ins
AFTER INSERT ON delegation_child_usage
BEGIN
    INSERT OR REPLACE INTO retinue_usage_columns
    SELECT NEW.id, ifnull(NEW.parent_session_id, ''),
        CASE WHEN c > 0 AND c <= 1.7976931348623157e308 THEN c ELSE 0 END,
        CASE WHEN i > 0 AND i <= 1.7976931348623157e308 THEN i ELSE 0 END,
        CASE WHEN o > 0 AND o <= 1.7976931348623157e308 THEN o ELSE 0 END,
        CASE WHEN cr > 0 AND cr <= 1.7976931348623157e308 THEN cr ELSE 0 END,
        CASE WHEN cw > 0 AND cw <= 1.7976931348623157e308 THEN cw ELSE 0 END,
        CASE WHEN r > 0 AND r <= 1.7976931348623157e308 THEN r ELSE 0 END
    FROM (SELECT
            CAST(json_extract(NEW.usage_json, '$.cost_usd') AS REAL) AS c,
            CAST(json_extract(NEW.usage_json, '$.tokens.input') AS REAL) AS i,
            CAST(json_extract(NEW.usage_json, '$.tokens.output') AS REAL) AS o,
            CAST(json_extract(NEW.usage_json, '$.tokens.cache_read') AS REAL) AS cr,
            CAST(json_extract(NEW.usage_json, '$.tokens.cache_write') AS REAL) AS cw,
            CAST(json_extract(NEW.usage_json, '$.tokens.reasoning') AS REAL) AS r
        WHERE json_valid(NEW.usage_json))
    UNION ALL
    SELECT NEW.id, ifnull(NEW.parent_session_id, ''), 0, 0, 0, 0, 0, 0 WHERE NOT json_valid(NEW.usage_json);
END;

CREATE TRIGGER IF NOT EXISTS retinue_usage_columns_upd
AFTER UPDATE ON delegation_child_usage
BEGIN
    DELETE FROM retinue_usage_columns WHERE usage_id = OLD.id;
    INSERT OR REPLACE INTO retinue_usage_columns
    SELECT NEW.id, ifnull(NEW.parent_session_id, ''),
        CASE WHEN c > 0 AND c <= 1.7976931348623157e308 THEN c ELSE 0 END,
        CASE WHEN i > 0 AND i <= 1.7976931348623157e308 THEN i ELSE 0 END,
        CASE WHEN o > 0 AND o <= 1.7976931348623157e308 THEN o ELSE 0 END,
        CASE WHEN cr > 0 AND cr <= 1.7976931348623157e308 THEN cr ELSE 0 END,
        CASE WHEN cw > 0 AND cw <= 1.7976931348623157e308 THEN cw ELSE 0 END,
        CASE WHEN r > 0 AND r <= 1.7976931348623157e308 THEN r ELSE 0 END
    FROM (SELECT
            CAST(json_extract(NEW.usage_json, '$.cost_usd') AS REAL) AS c,
            CAST(json_extract(NEW.usage_json, '$.tokens.input') AS REAL) AS i,
            CAST(json_extract(NEW.usage_json, '$.tokens.output') AS REAL) AS o,
            CAST(json_extract(NEW.usage_json, '$.tokens.cache_read') AS REAL) AS cr,
            CAST(json_extract(NEW.usage_json, '$.tokens.cache_write') AS REAL) AS cw,
            CAST(json_extract(NEW.usage_json, '$.tokens.reasoning') AS REAL) AS r
        WHERE json_valid(NEW.usage_json))
    UNION ALL
    SELECT NEW.id, ifnull(NEW.parent_session_id, ''), 0, 0, 0, 0, 0, 0 WHERE NOT json_valid(NEW.usage_json);
END;

CREATE TRIGGER IF NOT EXISTS retinue_usage_columns_del
AFTER DELETE ON delegation_child_usage
BEGIN
    DELETE FROM retinue_usage_columns WHERE usage_id = OLD.id;
END;

-- The rows written before this migration.
INSERT OR REPLACE INTO retinue_usage_columns
SELECT id, ifnull(parent_session_id, ''),
    CASE WHEN c > 0 AND c <= 1.7976931348623157e308 THEN c ELSE 0 END,
    CASE WHEN i > 0 AND i <= 1.7976931348623157e308 THEN i ELSE 0 END,
    CASE WHEN o > 0 AND o <= 1.7976931348623157e308 THEN o ELSE 0 END,
    CASE WHEN cr > 0 AND cr <= 1.7976931348623157e308 THEN cr ELSE 0 END,
    CASE WHEN cw > 0 AND cw <= 1.7976931348623157e308 THEN cw ELSE 0 END,
    CASE WHEN r > 0 AND r <= 1.7976931348623157e308 THEN r ELSE 0 END
FROM (SELECT id, parent_session_id,
        CASE WHEN json_valid(usage_json) THEN CAST(json_extract(usage_json, '$.cost_usd') AS REAL) END AS c,
        CASE WHEN json_valid(usage_json) THEN CAST(json_extract(usage_json, '$.tokens.input') AS REAL) END AS i,
        CASE WHEN json_valid(usage_json) THEN CAST(json_extract(usage_json, '$.tokens.output') AS REAL) END AS o,
        CASE WHEN json_valid(usage_json) THEN CAST(json_extract(usage_json, '$.tokens.cache_read') AS REAL) END AS cr,
        CASE WHEN json_valid(usage_json) THEN CAST(json_extract(usage_json, '$.tokens.cache_write') AS REAL) END AS cw,
        CASE WHEN json_valid(usage_json) THEN CAST(json_extract(usage_json, '$.tokens.reasoning') AS REAL) END AS r
      FROM delegation_child_usage);
