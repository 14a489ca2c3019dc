//! A `state.db` as hermes-agent writes it: hermes's own DDL (the legacy
//! 13-column `async_delegations` grown by hermes's `ALTER TABLE ADD COLUMN`s,
//! `sessions` and `messages` with hermes's extra columns, its FTS table and
//! triggers, `schema_version`, `delegation_child_usage`) and hermes's rows —
//! with no refinery history and none of Retinue's tables.
//!
//! [`HermesDb`] writes single rows; [`HermesDb::standard`] writes the
//! fixture the CLI tests run on (see [`HermesFixture`] for what it holds).
//! Times are relative to a `now` the caller passes (the wall clock, for
//! tests running the `retinue` binary), so retention is within its TTL.
//!
//! ```
//! use retinue_testkit::{HermesDb, TempHome};
//! let home = TempHome::new();
//! let fx = HermesDb::standard(&home.db_path(), 1_780_000_000.0);
//! assert_eq!(fx.root, "h-root");
//! assert!(HermesDb::table_rows(&home.db_path(), "async_delegations").len() >= 5);
//! ```

use std::path::{Path, PathBuf};

use rusqlite::types::ValueRef;
use rusqlite::{Connection, params};
use serde_json::{Value, json};

/// hermes's `sessions` and `messages` tables (with columns Retinue does not
/// use, such as `system_prompt` and `title`), its indexes, FTS table and
/// triggers, and its `schema_version`. `profile_name` and `messages.active`
/// are left out, as in hermes versions that predate them, so opening the
/// file must add them.
pub const HERMES_SESSIONS_DDL: &str = "
CREATE TABLE schema_version (version INTEGER NOT NULL);
INSERT INTO schema_version (version) VALUES (6);
CREATE TABLE sessions (
    id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    user_id TEXT,
    model TEXT,
    model_config TEXT,
    system_prompt TEXT,
    parent_session_id TEXT,
    started_at REAL NOT NULL,
    ended_at REAL,
    end_reason TEXT,
    message_count INTEGER DEFAULT 0,
    tool_call_count INTEGER DEFAULT 0,
    input_tokens INTEGER DEFAULT 0,
    output_tokens INTEGER DEFAULT 0,
    cache_read_tokens INTEGER DEFAULT 0,
    cache_write_tokens INTEGER DEFAULT 0,
    reasoning_tokens INTEGER DEFAULT 0,
    billing_provider TEXT,
    billing_base_url TEXT,
    billing_mode TEXT,
    estimated_cost_usd REAL,
    actual_cost_usd REAL,
    cost_status TEXT,
    cost_source TEXT,
    pricing_version TEXT,
    title TEXT,
    FOREIGN KEY (parent_session_id) REFERENCES sessions(id)
);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    role TEXT NOT NULL,
    content TEXT,
    tool_call_id TEXT,
    tool_calls TEXT,
    tool_name TEXT,
    timestamp REAL NOT NULL,
    token_count INTEGER,
    finish_reason TEXT,
    reasoning TEXT
);
CREATE INDEX idx_sessions_source ON sessions(source);
CREATE INDEX idx_sessions_parent ON sessions(parent_session_id);
CREATE INDEX idx_sessions_started ON sessions(started_at DESC);
CREATE INDEX idx_messages_session ON messages(session_id, timestamp);
CREATE UNIQUE INDEX idx_sessions_title_unique ON sessions(title) WHERE title IS NOT NULL;
CREATE VIRTUAL TABLE messages_fts USING fts5(content, content=messages, content_rowid=id);
CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
END;
CREATE TRIGGER messages_fts_update AFTER UPDATE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
";

/// hermes's original 13-column `async_delegations` (semantics §2.2, columns 1–13)
/// and its delivery index.
pub const HERMES_LEGACY_DELEGATIONS_DDL: &str = "
CREATE TABLE async_delegations (
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
    delivered_at REAL
);
CREATE INDEX idx_async_delegations_delivery ON async_delegations(delivery_state, completed_at);
";

/// The columns hermes adds to `async_delegations` when missing (semantics §2.2,
/// columns 14–26): plain `ALTER TABLE ADD COLUMN`, no constraint or default.
pub const HERMES_ALTER_DELEGATIONS_DDL: &str = "
ALTER TABLE async_delegations ADD COLUMN owner_pid INTEGER;
ALTER TABLE async_delegations ADD COLUMN owner_started_at INTEGER;
ALTER TABLE async_delegations ADD COLUMN task_json TEXT;
ALTER TABLE async_delegations ADD COLUMN delivery_claim TEXT;
ALTER TABLE async_delegations ADD COLUMN delivery_claimed_at REAL;
ALTER TABLE async_delegations ADD COLUMN origin_session_id TEXT;
ALTER TABLE async_delegations ADD COLUMN child_session_id TEXT;
ALTER TABLE async_delegations ADD COLUMN children_json TEXT;
ALTER TABLE async_delegations ADD COLUMN retained INTEGER;
ALTER TABLE async_delegations ADD COLUMN retained_at REAL;
ALTER TABLE async_delegations ADD COLUMN tombstoned_at REAL;
ALTER TABLE async_delegations ADD COLUMN owner_profile TEXT;
ALTER TABLE async_delegations ADD COLUMN usage_json TEXT;
";

/// hermes's usage ledger (semantics §2.3) and its index.
pub const HERMES_USAGE_DDL: &str = "
CREATE TABLE delegation_child_usage (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    parent_session_id TEXT NOT NULL,
    parent_turn_id TEXT NOT NULL DEFAULT '',
    child_session_id TEXT NOT NULL DEFAULT '',
    usage_json TEXT NOT NULL,
    aggregate_json TEXT,
    created_at REAL NOT NULL
);
CREATE INDEX idx_delegation_child_usage_parent ON delegation_child_usage(parent_session_id);
";

/// The hermes tables [`HermesDb::table_rows`] knows, with their primary keys.
pub const HERMES_TABLES: &[(&str, &str)] = &[
    ("schema_version", "version"),
    ("sessions", "id"),
    ("messages", "id"),
    ("async_delegations", "delegation_id"),
    ("delegation_child_usage", "id"),
];

/// A hermes session row.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HermesSession {
    /// `id`.
    pub id: String,
    /// `source` (`cli`, `telegram`, `delegate`, …).
    pub source: String,
    /// `model`.
    pub model: Option<String>,
    /// `model_config` as stored text (lineage markers), or NULL.
    pub model_config: Option<String>,
    /// `system_prompt` (hermes's own column).
    pub system_prompt: Option<String>,
    /// `parent_session_id`.
    pub parent_session_id: Option<String>,
    /// `started_at`.
    pub started_at: f64,
    /// `ended_at`.
    pub ended_at: Option<f64>,
    /// `end_reason`.
    pub end_reason: Option<String>,
    /// `title` (hermes's own column, unique when set).
    pub title: Option<String>,
    /// `estimated_cost_usd`.
    pub estimated_cost_usd: Option<f64>,
}

/// A hermes `async_delegations` row (every column hermes writes).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HermesUnit {
    /// `delegation_id`.
    pub delegation_id: String,
    /// `parent_session_id` (the spawner).
    pub parent_session_id: Option<String>,
    /// `state`.
    pub state: String,
    /// `dispatched_at`.
    pub dispatched_at: f64,
    /// `completed_at`.
    pub completed_at: Option<f64>,
    /// `event_json`.
    pub event_json: Option<String>,
    /// `result_json`.
    pub result_json: Option<String>,
    /// `delivery_state` (`pending`, `delivered`, `dropped`).
    pub delivery_state: String,
    /// `owner_pid`.
    pub owner_pid: Option<i64>,
    /// `task_json`.
    pub task_json: Option<String>,
    /// `child_session_id` (one-child units only).
    pub child_session_id: Option<String>,
    /// `children_json` (hermes's manifest).
    pub children_json: Option<String>,
    /// `retained`: 1 or NULL.
    pub retained: Option<i64>,
    /// `retained_at`.
    pub retained_at: Option<f64>,
    /// `tombstoned_at` (hermes tombstones whole units).
    pub tombstoned_at: Option<f64>,
    /// `owner_profile`.
    pub owner_profile: Option<String>,
    /// `usage_json` (hermes leaves it NULL).
    pub usage_json: Option<String>,
}

/// What [`HermesDb::standard`] wrote (all ids are fixed).
///
/// Sessions: `h-root` (cli, ended `compression`, with `system_prompt` and
/// `title`) → `h-cont` (cli, its only eligible continuation, live); `h-branch`
/// (cli branch of `h-root`, `_branched_from`); `h-stranger` (cli, no parent);
/// delegate children `h-child-0..3` and `h-child-old`, with transcripts
/// (`h-child-1` has no `system` message: its prompt is the session's
/// `system_prompt`).
///
/// Units: `deleg_h0000001` (by `h-root`, a retained batch of three),
/// `deleg_h0000002` (by `h-cont`, one retained child, `owner_profile`
/// `work`), `deleg_h0000003` (by `h-root`, retained then tombstoned by
/// hermes: never addressable), `deleg_h0000004` (legacy: completed and
/// delivered, never retained, no manifest), `deleg_h0000005` (`running`
/// with no owner pid: abandoned). Ledger: three rows for `h-root` (the
/// batch), one for `h-cont`.
#[derive(Debug, Clone, PartialEq)]
pub struct HermesFixture {
    /// The database file.
    pub path: PathBuf,
    /// The `now` the fixture's times are relative to.
    pub now: f64,
    /// The lineage root (ended `compression`).
    pub root: &'static str,
    /// Its compression continuation.
    pub continuation: &'static str,
    /// A branch of the root.
    pub branch: &'static str,
    /// An unrelated session.
    pub stranger: &'static str,
    /// The retained batch spawned by the root.
    pub batch: &'static str,
    /// The batch's subagent ids, by child index.
    pub batch_subagents: [&'static str; 3],
    /// The batch's child sessions, by child index.
    pub batch_sessions: [&'static str; 3],
    /// The retained one-child unit spawned by the continuation (profile `work`).
    pub solo: &'static str,
    /// Its subagent id.
    pub solo_subagent: &'static str,
    /// Its child session.
    pub solo_session: &'static str,
    /// The unit hermes tombstoned.
    pub tombstoned: &'static str,
    /// Its child session.
    pub tombstoned_session: &'static str,
    /// The legacy, never-retained unit.
    pub legacy: &'static str,
    /// The abandoned running unit.
    pub abandoned: &'static str,
}

/// Writes hermes-format rows into a `state.db` (raw SQL, foreign keys OFF).
/// Every method panics on failure: a failed fixture is a failed test.
#[derive(Debug)]
pub struct HermesDb {
    conn: Connection,
    path: PathBuf,
}

#[track_caller]
fn exec(conn: &Connection, sql: &str) {
    if let Err(e) = conn.execute_batch(sql) {
        panic!("hermes fixture SQL failed: {e}\n{sql}");
    }
}

impl HermesDb {
    /// Creates `path` (which must not exist yet) with hermes's full schema:
    /// sessions, messages, FTS, the legacy `async_delegations` plus hermes's
    /// added columns, and the usage ledger.
    ///
    /// # Panics
    /// If the file cannot be created.
    #[track_caller]
    pub fn create(path: &Path) -> HermesDb {
        let db = HermesDb::create_legacy(path);
        exec(&db.conn, HERMES_ALTER_DELEGATIONS_DDL);
        exec(&db.conn, HERMES_USAGE_DDL);
        db
    }

    /// Creates `path` with hermes's schema from before the retained-subagent
    /// registry: the 13-column `async_delegations`, no usage ledger.
    ///
    /// # Panics
    /// If the file cannot be created.
    #[track_caller]
    pub fn create_legacy(path: &Path) -> HermesDb {
        if path.exists() {
            panic!("{} already exists", path.display());
        }
        let conn = match Connection::open(path) {
            Ok(c) => c,
            Err(e) => panic!("cannot create {}: {e}", path.display()),
        };
        exec(&conn, "PRAGMA journal_mode = WAL; PRAGMA foreign_keys = OFF;");
        exec(&conn, HERMES_SESSIONS_DDL);
        exec(&conn, HERMES_LEGACY_DELEGATIONS_DDL);
        HermesDb { conn, path: path.to_path_buf() }
    }

    /// Opens an existing file as another writer would (hermes, a script):
    /// a second raw connection, e.g. to hold the write lock during a test.
    ///
    /// # Panics
    /// If the file cannot be opened.
    #[track_caller]
    pub fn open(path: &Path) -> HermesDb {
        match Connection::open(path) {
            Ok(conn) => HermesDb { conn, path: path.to_path_buf() },
            Err(e) => panic!("cannot open {}: {e}", path.display()),
        }
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The raw connection.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// Inserts a session.
    ///
    /// # Panics
    /// If the insert fails.
    #[track_caller]
    pub fn session(&self, s: &HermesSession) -> &Self {
        if let Err(e) = self.conn.execute(
            "INSERT INTO sessions (id, source, model, model_config, system_prompt, \
             parent_session_id, started_at, ended_at, end_reason, title, estimated_cost_usd, \
             message_count) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, 0)",
            params![
                s.id,
                s.source,
                s.model,
                s.model_config,
                s.system_prompt,
                s.parent_session_id,
                s.started_at,
                s.ended_at,
                s.end_reason,
                s.title,
                s.estimated_cost_usd
            ],
        ) {
            panic!("insert of hermes session {} failed: {e}", s.id);
        }
        self
    }

    /// Appends a message to a session's transcript (and counts it, as hermes does).
    ///
    /// # Panics
    /// If the insert fails.
    #[track_caller]
    pub fn message(&self, session_id: &str, role: &str, content: &str, at: f64) -> &Self {
        let done = self
            .conn
            .execute(
                "INSERT INTO messages (session_id, role, content, timestamp, finish_reason) \
                 VALUES (?1, ?2, ?3, ?4, CASE WHEN ?2 = 'assistant' THEN 'stop' END)",
                params![session_id, role, content, at],
            )
            .and_then(|_| {
                self.conn.execute(
                    "UPDATE sessions SET message_count = message_count + 1 WHERE id = ?1",
                    [session_id],
                )
            });
        if let Err(e) = done {
            panic!("insert of a hermes message into {session_id} failed: {e}");
        }
        self
    }

    /// Inserts a unit with every hermes column.
    ///
    /// # Panics
    /// If the insert fails.
    #[track_caller]
    pub fn unit(&self, u: &HermesUnit) -> &Self {
        let origin = u.parent_session_id.clone().unwrap_or_default();
        let updated = [Some(u.dispatched_at), u.completed_at, u.retained_at, u.tombstoned_at]
            .into_iter()
            .flatten()
            .fold(f64::MIN, f64::max);
        let delivered_at = (u.delivery_state == "delivered").then_some(u.completed_at).flatten();
        if let Err(e) = self.conn.execute(
            "INSERT INTO async_delegations (delegation_id, origin_session, origin_ui_session_id, \
             parent_session_id, state, dispatched_at, completed_at, updated_at, event_json, \
             result_json, delivery_state, delivery_attempts, delivered_at, owner_pid, \
             owner_started_at, task_json, origin_session_id, child_session_id, children_json, \
             retained, retained_at, tombstoned_at, owner_profile, usage_json) \
             VALUES (?1, ?2, '', ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, NULL, ?14, ?2, \
             ?15, ?16, ?17, ?18, ?19, ?20, ?21)",
            params![
                u.delegation_id,
                origin,
                u.parent_session_id,
                u.state,
                u.dispatched_at,
                u.completed_at,
                updated,
                u.event_json,
                u.result_json,
                u.delivery_state,
                i64::from(u.delivery_state == "delivered"),
                delivered_at,
                u.owner_pid,
                u.task_json,
                u.child_session_id,
                u.children_json,
                u.retained,
                u.retained_at,
                u.tombstoned_at,
                u.owner_profile,
                u.usage_json
            ],
        ) {
            panic!("insert of hermes unit {} failed: {e}", u.delegation_id);
        }
        self
    }

    /// Inserts a legacy unit: only the 13 original columns.
    ///
    /// # Panics
    /// If the insert fails.
    #[track_caller]
    pub fn legacy_unit(&self, id: &str, parent: &str, state: &str, at: f64) -> &Self {
        if let Err(e) = self.conn.execute(
            "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, \
             state, dispatched_at, completed_at, updated_at, event_json, result_json, \
             delivery_state, delivery_attempts, delivered_at) \
             VALUES (?1, ?2, ?2, ?3, ?4, ?4, ?4, ?5, ?6, 'delivered', 1, ?4)",
            params![
                id,
                parent,
                state,
                at,
                json!({"type": "async_delegation", "delegation_id": id, "status": state})
                    .to_string(),
                json!({"results": [{"task_index": 0, "status": state, "summary": "legacy"}]})
                    .to_string()
            ],
        ) {
            panic!("insert of legacy unit {id} failed: {e}");
        }
        self
    }

    /// Inserts a ledger row as hermes's `record_child_usage_attribution` does.
    ///
    /// # Panics
    /// If the insert fails.
    #[track_caller]
    pub fn usage(
        &self,
        parent: &str,
        turn: &str,
        child_session: &str,
        usage: &Value,
        aggregate: Option<&Value>,
        at: f64,
    ) -> &Self {
        if let Err(e) = self.conn.execute(
            "INSERT INTO delegation_child_usage (parent_session_id, parent_turn_id, \
             child_session_id, usage_json, aggregate_json, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                parent,
                turn,
                child_session,
                usage.to_string(),
                aggregate.map(Value::to_string),
                at
            ],
        ) {
            panic!("insert of a ledger row for {parent} failed: {e}");
        }
        self
    }

    /// Writes the standard fixture (see [`HermesFixture`]) into a new file at
    /// `path`, with times relative to `now`.
    ///
    /// # Panics
    /// If any write fails.
    #[track_caller]
    pub fn standard(path: &Path, now: f64) -> HermesFixture {
        let h = 3600.0;
        let db = HermesDb::create(path);
        let fx = HermesFixture {
            path: path.to_path_buf(),
            now,
            root: "h-root",
            continuation: "h-cont",
            branch: "h-branch",
            stranger: "h-stranger",
            batch: "deleg_h0000001",
            batch_subagents: ["sa-0-1a2b3c4d", "sa-1-2b3c4d5e", "sa-2-3c4d5e6f"],
            batch_sessions: ["h-child-0", "h-child-1", "h-child-2"],
            solo: "deleg_h0000002",
            solo_subagent: "sa-0-4d5e6f70",
            solo_session: "h-child-3",
            tombstoned: "deleg_h0000003",
            tombstoned_session: "h-child-old",
            legacy: "deleg_h0000004",
            abandoned: "deleg_h0000005",
        };
        let model = Some("anthropic/claude-sonnet-4".to_owned());
        let cli = |id: &str, parent: Option<&str>, mc: Option<Value>, at: f64| HermesSession {
            id: id.to_owned(),
            source: "cli".to_owned(),
            model: model.clone(),
            model_config: mc.map(|v| v.to_string()),
            system_prompt: Some("You are Hermes, a helpful agent.".to_owned()),
            parent_session_id: parent.map(str::to_owned),
            started_at: at,
            ..HermesSession::default()
        };
        let child = |id: &str, parent: &str, at: f64| HermesSession {
            id: id.to_owned(),
            source: "delegate".to_owned(),
            model: Some("openai/gpt-5-mini".to_owned()),
            model_config: Some(json!({ "_delegate_from": parent }).to_string()),
            system_prompt: Some(format!("You are a focused subagent ({id}).")),
            parent_session_id: Some(parent.to_owned()),
            started_at: at,
            ended_at: Some(at + 60.0),
            end_reason: Some("completed".to_owned()),
            ..HermesSession::default()
        };
        // Sessions: the lineage, a branch, a stranger, the delegate children.
        db.session(&HermesSession {
            ended_at: Some(now - 3.0 * h),
            end_reason: Some("compression".to_owned()),
            title: Some("Release planning".to_owned()),
            estimated_cost_usd: Some(0.42),
            ..cli(fx.root, None, None, now - 10.0 * h)
        })
        .session(&HermesSession {
            title: Some("Release planning #2".to_owned()),
            ..cli(fx.continuation, Some(fx.root), None, now - 3.0 * h)
        })
        .session(&cli(
            fx.branch,
            Some(fx.root),
            Some(json!({ "_branched_from": fx.root })),
            now - 4.0 * h,
        ))
        .session(&cli(fx.stranger, None, None, now - 2.0 * h));
        for (i, sid) in fx.batch_sessions.iter().enumerate() {
            db.session(&child(sid, fx.root, now - 6.0 * h));
            if i != 1 {
                db.message(
                    sid,
                    "system",
                    &format!("You are a focused subagent ({sid})."),
                    now - 6.0 * h,
                );
            }
            db.message(sid, "user", &format!("Batch task {i}"), now - 6.0 * h + 1.0).message(
                sid,
                "assistant",
                &format!("Finished batch task {i}."),
                now - 6.0 * h + 50.0,
            );
        }
        db.session(&child(fx.solo_session, fx.continuation, now - 2.0 * h))
            .message(fx.solo_session, "user", "Draft the changelog", now - 2.0 * h + 1.0)
            .message(fx.solo_session, "assistant", "Changelog drafted.", now - 2.0 * h + 30.0)
            .session(&child(fx.tombstoned_session, fx.root, now - 9.0 * h))
            .message(fx.tombstoned_session, "user", "Old task", now - 9.0 * h + 1.0)
            .message(fx.tombstoned_session, "assistant", "Old answer.", now - 9.0 * h + 20.0)
            .message(fx.root, "user", "Plan the release.", now - 10.0 * h)
            .message(fx.root, "assistant", "Delegating three tasks.", now - 10.0 * h + 5.0)
            .message(fx.continuation, "user", "[compressed context] Continue.", now - 3.0 * h);

        // Units.
        let manifest = |i: usize, sa: &str, sid: &str| {
            json!({
                "subagent_id": sa,
                "session_id": sid,
                "model": "openai/gpt-5-mini",
                "goal": format!("Batch task {i}"),
            })
        };
        let batch_children: Vec<Value> =
            (0..3).map(|i| manifest(i, fx.batch_subagents[i], fx.batch_sessions[i])).collect();
        db.unit(&HermesUnit {
            delegation_id: fx.batch.to_owned(),
            parent_session_id: Some(fx.root.to_owned()),
            state: "completed".to_owned(),
            dispatched_at: now - 6.0 * h,
            completed_at: Some(now - 6.0 * h + 60.0),
            event_json: Some(
                json!({"type": "async_delegation", "delegation_id": fx.batch, "status": "completed"})
                    .to_string(),
            ),
            result_json: Some(json!({"results": []}).to_string()),
            delivery_state: "delivered".to_owned(),
            owner_pid: Some(4242),
            task_json: Some(
                json!({"goals": ["Batch task 0", "Batch task 1", "Batch task 2"], "is_batch": true, "mode": "background"})
                    .to_string(),
            ),
            child_session_id: None,
            children_json: Some(Value::Array(batch_children).to_string()),
            retained: Some(1),
            retained_at: Some(now - 6.0 * h + 60.0),
            owner_profile: Some(String::new()),
            ..HermesUnit::default()
        })
        .unit(&HermesUnit {
            delegation_id: fx.solo.to_owned(),
            parent_session_id: Some(fx.continuation.to_owned()),
            state: "completed".to_owned(),
            dispatched_at: now - 2.0 * h,
            completed_at: Some(now - 2.0 * h + 30.0),
            delivery_state: "delivered".to_owned(),
            owner_pid: Some(4242),
            task_json: Some(json!({"goal": "Draft the changelog", "is_batch": false}).to_string()),
            child_session_id: Some(fx.solo_session.to_owned()),
            children_json: Some(
                Value::Array(vec![json!({
                    "subagent_id": fx.solo_subagent,
                    "session_id": fx.solo_session,
                    "model": "openai/gpt-5-mini",
                    "goal": "Draft the changelog",
                })])
                .to_string(),
            ),
            retained: Some(1),
            retained_at: Some(now - 2.0 * h + 30.0),
            owner_profile: Some("work".to_owned()),
            ..HermesUnit::default()
        })
        .unit(&HermesUnit {
            delegation_id: fx.tombstoned.to_owned(),
            parent_session_id: Some(fx.root.to_owned()),
            state: "completed".to_owned(),
            dispatched_at: now - 9.0 * h,
            completed_at: Some(now - 9.0 * h + 20.0),
            delivery_state: "delivered".to_owned(),
            owner_pid: Some(4242),
            child_session_id: Some(fx.tombstoned_session.to_owned()),
            children_json: Some("[]".to_owned()),
            retained: Some(1),
            retained_at: Some(now - 9.0 * h + 20.0),
            tombstoned_at: Some(now - 5.0 * h),
            owner_profile: Some(String::new()),
            ..HermesUnit::default()
        })
        .legacy_unit(fx.legacy, fx.root, "completed", now - 30.0 * h)
        .unit(&HermesUnit {
            delegation_id: fx.abandoned.to_owned(),
            parent_session_id: Some(fx.continuation.to_owned()),
            state: "running".to_owned(),
            dispatched_at: now - h,
            delivery_state: "pending".to_owned(),
            owner_pid: None,
            task_json: Some(json!({"goal": "Benchmark", "is_batch": false, "mode": "background"}).to_string()),
            ..HermesUnit::default()
        });

        // The ledger: the batch billed to the root, the solo child to the continuation.
        let costs = [(0.01, 100, 20), (0.02, 200, 40), (0.03, 300, 60)];
        for (i, (sid, (cost, input, output))) in fx.batch_sessions.iter().zip(costs).enumerate() {
            let usage = json!({
                "cost_usd": cost,
                "tokens": {"input": input, "output": output},
                "api_calls": i + 1,
                "status": "completed",
            });
            let aggregate =
                json!({"session_estimated_cost_usd": 0.48, "children_cost_total": 0.06});
            db.usage(fx.root, "turn-7", sid, &usage, Some(&aggregate), now - 6.0 * h + 60.0);
        }
        db.usage(
            fx.continuation,
            "",
            fx.solo_session,
            &json!({"cost_usd": "0.025", "tokens": {"input": 250, "output": 40}, "api_calls": 2, "status": "completed"}),
            None,
            now - 2.0 * h + 30.0,
        );
        fx
    }

    /// Every row of a hermes table, ordered by its key, as JSON objects of
    /// the columns `columns` (all columns of the table when empty) — to
    /// compare a file before and after another program opened it.
    ///
    /// # Panics
    /// If the table cannot be read.
    #[track_caller]
    pub fn table_rows(path: &Path, table: &str) -> Vec<Value> {
        HermesDb::table_rows_of(path, table, &[])
    }

    /// [`HermesDb::table_rows`] restricted to `columns`.
    ///
    /// # Panics
    /// If the table cannot be read.
    #[track_caller]
    pub fn table_rows_of(path: &Path, table: &str, columns: &[&str]) -> Vec<Value> {
        let key = HERMES_TABLES.iter().find(|(t, _)| *t == table).map_or("rowid", |(_, k)| k);
        let conn = match Connection::open(path) {
            Ok(c) => c,
            Err(e) => panic!("cannot open {}: {e}", path.display()),
        };
        let cols = if columns.is_empty() { "*".to_owned() } else { columns.join(", ") };
        let sql = format!("SELECT {cols} FROM {table} ORDER BY {key}");
        let read = || -> rusqlite::Result<Vec<Value>> {
            let mut stmt = conn.prepare(&sql)?;
            let names: Vec<String> = stmt.column_names().map(str::to_owned).collect();
            let rows = stmt.query_map([], |r| {
                let mut obj = serde_json::Map::new();
                for (i, name) in names.iter().enumerate() {
                    let v = match r.get_ref(i)? {
                        ValueRef::Null => Value::Null,
                        ValueRef::Integer(n) => json!(n),
                        ValueRef::Real(f) => json!(f),
                        ValueRef::Text(t) => json!(String::from_utf8_lossy(t)),
                        ValueRef::Blob(b) => json!(format!("<{} bytes>", b.len())),
                    };
                    obj.insert(name.clone(), v);
                }
                Ok(Value::Object(obj))
            })?;
            rows.collect()
        };
        match read() {
            Ok(rows) => rows,
            Err(e) => panic!("cannot read {table} from {}: {e}", path.display()),
        }
    }

    /// The column names of `table`, in order.
    ///
    /// # Panics
    /// If the table cannot be read.
    #[track_caller]
    pub fn columns(path: &Path, table: &str) -> Vec<String> {
        let conn = match Connection::open(path) {
            Ok(c) => c,
            Err(e) => panic!("cannot open {}: {e}", path.display()),
        };
        let read = || -> rusqlite::Result<Vec<String>> {
            let mut stmt = conn.prepare("SELECT name FROM pragma_table_info(?1) ORDER BY cid")?;
            let rows = stmt.query_map([table], |r| r.get(0))?;
            rows.collect()
        };
        match read() {
            Ok(cols) => cols,
            Err(e) => panic!("cannot read the columns of {table}: {e}"),
        }
    }
}
