-- Retinue's base schema. Every statement is idempotent (IF NOT EXISTS) because
-- hermes-agent creates the same tables itself; the reconcile step that runs
-- before this migration adds any column an older hermes file lacks.

CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    model TEXT,
    model_config TEXT,
    parent_session_id TEXT REFERENCES sessions(id),
    started_at REAL NOT NULL,
    ended_at REAL,
    end_reason TEXT,
    message_count INTEGER DEFAULT 0,
    tool_call_count INTEGER DEFAULT 0,
    profile_name TEXT,
    estimated_cost_usd REAL,
    cost_status TEXT,
    cost_source TEXT
);

CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    role TEXT NOT NULL,
    content TEXT,
    timestamp REAL NOT NULL,
    active INTEGER NOT NULL DEFAULT 1,
    tool_call_id TEXT,
    tool_calls TEXT,
    tool_name TEXT,
    token_count INTEGER,
    finish_reason TEXT
);

CREATE TABLE IF NOT EXISTS async_delegations (
    delegation_id TEXT PRIMARY KEY,
    origin_session TEXT NOT NULL,
    origin_ui_session_id TEXT NOT NULL DEFAULT '',
    parent_session_id TEXT,
    state TEXT NOT NULL,
    dispatched_at REAL NOT NULL,
    completed_at REAL,
    updated_at REAL NOT NULL,
    event_json TEXT,
    result_json TEXT,
    delivery_state TEXT NOT NULL DEFAULT 'pending',
    delivery_attempts INTEGER NOT NULL DEFAULT 0,
    delivered_at REAL,
    owner_pid INTEGER,
    owner_started_at INTEGER,
    task_json TEXT,
    delivery_claim TEXT,
    delivery_claimed_at REAL,
    origin_session_id TEXT NOT NULL DEFAULT '',
    child_session_id TEXT,
    children_json TEXT,
    retained INTEGER,
    retained_at REAL,
    tombstoned_at REAL,
    owner_profile TEXT,
    usage_json TEXT
);

CREATE INDEX IF NOT EXISTS idx_async_delegations_delivery
    ON async_delegations(delivery_state, completed_at);
CREATE INDEX IF NOT EXISTS retinue_idx_async_retained
    ON async_delegations(retained, tombstoned_at, retained_at);

CREATE TABLE IF NOT EXISTS delegation_child_usage (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    parent_session_id TEXT NOT NULL,
    parent_turn_id TEXT NOT NULL DEFAULT '',
    child_session_id TEXT NOT NULL DEFAULT '',
    usage_json TEXT NOT NULL,
    aggregate_json TEXT,
    created_at REAL NOT NULL
);

CREATE INDEX IF NOT EXISTS idx_delegation_child_usage_parent
    ON delegation_child_usage(parent_session_id);
CREATE INDEX IF NOT EXISTS retinue_idx_sessions_parent ON sessions(parent_session_id);
CREATE INDEX IF NOT EXISTS retinue_idx_messages_session ON messages(session_id, id);

CREATE TABLE IF NOT EXISTS retinue_children (
    delegation_id TEXT NOT NULL,
    child_index INTEGER NOT NULL,
    subagent_id TEXT NOT NULL DEFAULT '',
    child_session_id TEXT NOT NULL DEFAULT '',
    model TEXT,
    provider TEXT,
    goal TEXT,
    manifest_json TEXT NOT NULL,
    retained_at REAL,
    tombstoned_at REAL,
    tombstone_reason TEXT,
    resume_claim TEXT,
    resume_claimed_at REAL,
    PRIMARY KEY (delegation_id, child_index),
    CHECK ((tombstone_reason IS NULL) = (tombstoned_at IS NULL))
);

CREATE INDEX IF NOT EXISTS retinue_idx_children_subagent ON retinue_children(subagent_id);
CREATE INDEX IF NOT EXISTS retinue_idx_children_session ON retinue_children(child_session_id);

CREATE TABLE IF NOT EXISTS retinue_usage_keys (
    attribution_key TEXT PRIMARY KEY,
    usage_id INTEGER NOT NULL,
    created_at REAL NOT NULL
);

-- Maintained ledger totals per parent: `covered_id` is the highest ledger id
-- folded in; rows above it (written by another program) are folded at read time.
CREATE TABLE IF NOT EXISTS retinue_usage_totals (
    parent_session_id TEXT PRIMARY KEY,
    cost_usd REAL NOT NULL DEFAULT 0,
    input_tokens REAL NOT NULL DEFAULT 0,
    output_tokens REAL NOT NULL DEFAULT 0,
    covered_id INTEGER NOT NULL DEFAULT 0
);
