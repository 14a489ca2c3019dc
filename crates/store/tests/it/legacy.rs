//! In-place upgrade of hermes-created files (no refinery history).

use std::sync::Arc;

use retinue_config::DelegationConfig;
use retinue_core::{Lookup, ManualClock, RegistryRead, TombstoneReason, Unaddressable};

use super::fixture::{T0, open};

/// hermes's original 13-column table, as the test kit writes it.
const LEGACY_13: &str = retinue_testkit::hermes::HERMES_LEGACY_DELEGATIONS_DDL;

fn legacy_file(extra_sql: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    let raw = rusqlite::Connection::open(&path).expect("open");
    // Every hermes state.db has its `sessions` table (a file without it is refused).
    raw.execute_batch(retinue_testkit::hermes::HERMES_SESSIONS_DDL).expect("sessions ddl");
    raw.execute_batch(LEGACY_13).expect("ddl");
    for i in 0..3 {
        raw.execute(
            "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, \
             state, dispatched_at, completed_at, updated_at, event_json, delivery_state) \
             VALUES (?1, 'origin', 'p', 'completed', ?2, ?2, ?2, '{\"x\":1}', 'delivered')",
            rusqlite::params![format!("deleg_legacy{i:02}"), T0 - 10.0],
        )
        .expect("row");
    }
    raw.execute_batch(extra_sql).expect("extra");
    (dir, path)
}

fn count(path: &std::path::Path, sql: &str) -> i64 {
    rusqlite::Connection::open(path).expect("open").query_row(sql, [], |r| r.get(0)).expect("q")
}

#[test]
fn schema_upgrade_is_backwards_compatible() {
    let (_dir, path) = legacy_file("");
    let clock = Arc::new(ManualClock::new(T0));
    let store = open(&path, &clock, DelegationConfig::default());
    let raw = rusqlite::Connection::open(&path).expect("open");
    let cols: Vec<String> = raw
        .prepare("SELECT name FROM pragma_table_info('async_delegations')")
        .expect("p")
        .query_map([], |r| r.get(0))
        .expect("q")
        .map(|r| r.expect("row"))
        .collect();
    assert!(cols.contains(&"retained".to_owned()) && cols.contains(&"children_json".to_owned()));
    assert_eq!(cols.len(), 26);
    assert_eq!(count(&path, "SELECT count(*) FROM async_delegations"), 3);
    assert_eq!(
        count(&path, "SELECT count(*) FROM async_delegations WHERE event_json = '{\"x\":1}'"),
        3
    );
    // Upgraded origin_session_id is nullable (hermes's ALTER has no constraint); NULL kept.
    assert_eq!(
        count(&path, "SELECT count(*) FROM async_delegations WHERE origin_session_id IS NULL"),
        3
    );
    // Legacy rows are never retained or listed.
    assert!(store.list_retained_children().expect("list").is_empty());
    assert_eq!(store.lookup("deleg_legacy00").expect("lookup"), Lookup::Unknown);
    // Reopening is a no-op.
    let dump = store.schema_dump().expect("dump");
    let again = open(&path, &clock, DelegationConfig::default());
    assert_eq!(again.schema_dump().expect("dump"), dump);
    assert_eq!(count(&path, "SELECT count(*) FROM async_delegations"), 3);
}

#[test]
fn full_hermes_table_with_retained_batch_is_backfilled() {
    let hermes_alter = format!(
        "{}{}",
        retinue_testkit::hermes::HERMES_ALTER_DELEGATIONS_DDL,
        retinue_testkit::hermes::HERMES_USAGE_DDL
    );
    let (_dir, path) = legacy_file(&hermes_alter);
    let raw = rusqlite::Connection::open(&path).expect("open");
    let children = r#"[{"subagent_id":"sa-0-aaaa0000","session_id":"hs-0","model":"m","goal":"g0"},
        {"subagent_id":"sa-1-bbbb1111","session_id":"hs-1","model":"m","goal":"g1"},
        {"subagent_id":"sa-2-cccc2222","session_id":"hs-2","model":"m","goal":"g2"}]"#;
    raw.execute(
        "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, state, \
         dispatched_at, completed_at, updated_at, children_json, retained, retained_at, owner_profile) \
         VALUES ('deleg_hermes01', '', 'A', 'completed', ?1, ?1, ?1, ?2, 1, ?1, '')",
        rusqlite::params![T0 - 60.0, children],
    )
    .expect("hermes retained");
    raw.execute(
        "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, state, \
         dispatched_at, completed_at, updated_at, child_session_id, retained, retained_at, tombstoned_at) \
         VALUES ('deleg_hermes02', '', 'A', 'completed', ?1, ?1, ?1, 'hs-solo', 1, ?1, ?1)",
        rusqlite::params![T0 - 30.0],
    )
    .expect("hermes tombstoned");
    drop(raw);
    let clock = Arc::new(ManualClock::new(T0));
    let store = open(&path, &clock, DelegationConfig::default());
    let listed: Vec<String> = store
        .list_retained_children()
        .expect("list")
        .iter()
        .map(|e| e.child_id().to_owned())
        .collect();
    assert_eq!(listed, vec!["sa-0-aaaa0000", "sa-1-bbbb1111", "sa-2-cccc2222"]);
    assert!(store.find_retained_child("hs-1").expect("find").is_some());
    // hermes retained and tombstoned it before Retinue ever opened the file:
    // tombstoned with reason `external` and hermes' time, never unknown (issue 12).
    match store.lookup("hs-solo").expect("lookup") {
        Lookup::NotAddressable(entry, Unaddressable::Tombstoned { at, reason, .. }) => {
            assert_eq!(entry.delegation_id, "deleg_hermes02");
            assert_eq!(reason, TombstoneReason::External);
            assert!((at - (T0 - 30.0)).abs() < 1e-6, "{at}");
        }
        other => panic!("unexpected {other:?}"),
    }
    // An adopted unit that hermes tombstones later reads as `external`, with its time.
    rusqlite::Connection::open(&path)
        .expect("open")
        .execute(
            "UPDATE async_delegations SET tombstoned_at = ?1 WHERE delegation_id = 'deleg_hermes01'",
            [T0 - 30.0],
        )
        .expect("hermes tombstone");
    assert!(store.list_retained_children().expect("list").is_empty());
    match store.lookup("hs-1").expect("lookup") {
        Lookup::NotAddressable(entry, Unaddressable::Tombstoned { at, reason, .. }) => {
            assert_eq!(entry.child_session_id, "hs-1");
            assert!((at - (T0 - 30.0)).abs() < 1e-6);
            assert_eq!(reason, TombstoneReason::External);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(count(&path, "SELECT count(*) FROM async_delegations"), 5);
    assert_eq!(count(&path, "SELECT count(*) FROM retinue_adoption_queue"), 0, "adopted at open");

    // After adoption, hermes (another writer) retains and tombstones a new
    // unit and retains an old one: the triggers queue them, the next open
    // adopts them (tombstoned: `external`), and the queue is empty again.
    drop(store);
    let raw = rusqlite::Connection::open(&path).expect("open");
    raw.execute(
        "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, state, \
         dispatched_at, completed_at, updated_at, child_session_id, retained, retained_at, tombstoned_at) \
         VALUES ('deleg_hermes03', '', 'A', 'completed', ?1, ?1, ?1, 'hs-late', 1, ?1, ?1)",
        rusqlite::params![T0 - 10.0],
    )
    .expect("hermes retained and tombstoned later");
    assert_eq!(count(&path, "SELECT count(*) FROM retinue_adoption_queue"), 1);
    drop(raw);
    let store = open(&path, &clock, DelegationConfig::default());
    assert_eq!(count(&path, "SELECT count(*) FROM retinue_adoption_queue"), 0);
    match store.lookup("hs-late").expect("lookup") {
        Lookup::NotAddressable(entry, Unaddressable::Tombstoned { reason, .. }) => {
            assert_eq!(entry.delegation_id, "deleg_hermes03");
            assert_eq!(reason, TombstoneReason::External);
        }
        other => panic!("unexpected {other:?}"),
    }
    // Retinue's own retains are never queued (their child rows exist first).
    retinue_testkit::dispatch_and_retain(&store, "A");
    assert_eq!(count(&path, "SELECT count(*) FROM retinue_adoption_queue"), 0);
}

#[test]
fn all_columns_present_without_refinery_history() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    let clock = Arc::new(ManualClock::new(T0));
    {
        let store = open(&path, &clock, DelegationConfig::default());
        drop(store);
    }
    let raw = rusqlite::Connection::open(&path).expect("open");
    raw.execute_batch("DROP TABLE refinery_schema_history").expect("drop history");
    raw.execute("INSERT INTO sessions (id, source, started_at) VALUES ('s1', 'cli', 1.0)", [])
        .expect("row");
    drop(raw);
    let store = open(&path, &clock, DelegationConfig::default());
    assert_eq!(count(&path, "SELECT count(*) FROM sessions"), 1);
    assert_eq!(
        count(&path, "SELECT count(*) FROM refinery_schema_history"),
        super::fixture::migration_count()
    );
    drop(store);
}

#[test]
fn hermes_sessions_and_messages_gain_missing_columns() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    let raw = rusqlite::Connection::open(&path).expect("open");
    raw.execute_batch(
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, source TEXT NOT NULL, started_at REAL NOT NULL,
            system_prompt TEXT, title TEXT);
         CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL,
            role TEXT NOT NULL, content TEXT, timestamp REAL NOT NULL);
         INSERT INTO sessions VALUES ('s1', 'cli', 1.0, 'be terse', 't');
         INSERT INTO messages (session_id, role, content, timestamp) VALUES ('s1', 'user', 'hi', 2.0);",
    )
    .expect("ddl");
    drop(raw);
    let clock = Arc::new(ManualClock::new(T0));
    let store = open(&path, &clock, DelegationConfig::default());
    use retinue_core::{SessionGraph, SessionStore};
    let s = store.session("s1").expect("read").expect("row");
    assert_eq!(s.system_prompt.as_deref(), Some("be terse"));
    let conv = store.conversation("s1").expect("conv");
    assert_eq!(conv.len(), 1);
    assert_eq!(conv[0].content.as_deref(), Some("hi"));
    // hermes's own extra column is kept.
    assert_eq!(count(&path, "SELECT count(*) FROM sessions WHERE title = 't'"), 1);
}

/// hermes-agent 0.19.0's `messages` with its FTS5 tables and triggers (its
/// `FTS_SQL` and `FTS_TRIGRAM_SQL`, verbatim), as `cargo xtask interop` finds them.
const HERMES_FTS: &str = "
CREATE TABLE sessions (id TEXT PRIMARY KEY, source TEXT NOT NULL, model TEXT, model_config TEXT,
    parent_session_id TEXT, started_at REAL NOT NULL, ended_at REAL, end_reason TEXT,
    message_count INTEGER DEFAULT 0, tool_call_count INTEGER DEFAULT 0,
    FOREIGN KEY (parent_session_id) REFERENCES sessions(id));
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL REFERENCES sessions(id), role TEXT NOT NULL, content TEXT,
    tool_call_id TEXT, tool_calls TEXT, tool_name TEXT, effect_disposition TEXT,
    timestamp REAL NOT NULL, token_count INTEGER, finish_reason TEXT, reasoning TEXT,
    observed INTEGER DEFAULT 0, active INTEGER NOT NULL DEFAULT 1,
    compacted INTEGER NOT NULL DEFAULT 0, api_content TEXT);
CREATE VIRTUAL TABLE messages_fts USING fts5(content);
CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (
        new.id,
        COALESCE(new.content, '') || ' ' || COALESCE(new.tool_name, '') || ' ' || COALESCE(new.tool_calls, '')
    );
END;
CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
    DELETE FROM messages_fts WHERE rowid = old.id;
END;
CREATE TRIGGER messages_fts_update AFTER UPDATE ON messages BEGIN
    DELETE FROM messages_fts WHERE rowid = old.id;
    INSERT INTO messages_fts(rowid, content) VALUES (
        new.id,
        COALESCE(new.content, '') || ' ' || COALESCE(new.tool_name, '') || ' ' || COALESCE(new.tool_calls, '')
    );
END;
CREATE VIRTUAL TABLE messages_fts_trigram USING fts5(content, tokenize='trigram');
CREATE TRIGGER messages_fts_trigram_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts_trigram(rowid, content) VALUES (
        new.id,
        COALESCE(new.content, '') || ' ' || COALESCE(new.tool_name, '') || ' ' || COALESCE(new.tool_calls, '')
    );
END;
INSERT INTO sessions (id, source, started_at) VALUES ('s1', 'cli', 1.0);
";

#[test]
fn hermes_fts_triggers_index_our_inserts_and_tool_calls_count_as_hermes_counts() {
    use retinue_core::{Message, SessionStore};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    rusqlite::Connection::open(&path).expect("open").execute_batch(HERMES_FTS).expect("ddl");
    let clock = Arc::new(ManualClock::new(T0));
    let store = open(&path, &clock, DelegationConfig::default());
    let say = |role: &str, content: &str, tool_calls: Option<&str>| {
        store
            .append_message(
                "s1",
                &Message {
                    role: role.into(),
                    content: Some(content.into()),
                    tool_calls: tool_calls.map(str::to_owned),
                    ..Message::default()
                },
            )
            .expect("append")
    };
    say("user", "find the platypus", None);
    let calls = r#"[{"id":"c1","type":"function","function":{"name":"grep","arguments":"{}"}},
                    {"id":"c2","type":"function","function":{"name":"ls","arguments":"{}"}}]"#;
    say("assistant", "searching", Some(calls));
    say("tool", "2 hits", None);
    say("assistant", "one more", Some(r#"{"id":"c3"}"#));
    say("assistant", "none", Some("null"));
    // hermes counts every message, and each tool call (a non-list value as one).
    assert_eq!(count(&path, "SELECT message_count FROM sessions WHERE id = 's1'"), 5);
    assert_eq!(count(&path, "SELECT tool_call_count FROM sessions WHERE id = 's1'"), 3);
    // hermes's triggers fired on our inserts: both indexes hold every row.
    assert_eq!(count(&path, "SELECT count(*) FROM messages_fts"), 5);
    assert_eq!(count(&path, "SELECT count(*) FROM messages_fts_trigram"), 5);
    assert_eq!(
        count(&path, "SELECT count(*) FROM messages_fts WHERE messages_fts MATCH 'platypus'"),
        1
    );
    assert_eq!(
        count(
            &path,
            "SELECT count(*) FROM messages_fts_trigram WHERE messages_fts_trigram MATCH 'grep'"
        ),
        1
    );
    assert_eq!(store.integrity_check().expect("check"), "ok");
}
