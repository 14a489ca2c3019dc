//! Schema creation, idempotent opening and refusal of foreign files.

use std::collections::BTreeSet;

use retinue_core::Error;
use retinue_store::{Store, StoreOptions};

use super::fixture::Fx;

fn columns(conn: &rusqlite::Connection, table: &str) -> Vec<String> {
    let mut stmt = conn.prepare("SELECT name FROM pragma_table_info(?1)").expect("prepare");
    stmt.query_map([table], |r| r.get(0)).expect("query").map(|r| r.expect("row")).collect()
}

fn tables(conn: &rusqlite::Connection) -> BTreeSet<String> {
    let mut stmt = conn.prepare("SELECT name FROM sqlite_master WHERE type='table'").expect("p");
    stmt.query_map([], |r| r.get(0)).expect("q").map(|r| r.expect("row")).collect()
}

#[test]
fn schema_adds_retained_columns_and_usage_table() {
    let fx = Fx::new();
    let raw = fx.raw();
    let cols = columns(&raw, "async_delegations");
    for expected in [
        "retained",
        "retained_at",
        "tombstoned_at",
        "child_session_id",
        "children_json",
        "owner_profile",
        "usage_json",
    ] {
        assert!(cols.contains(&expected.to_owned()), "missing {expected}");
    }
    assert_eq!(cols.len(), 26);
    assert!(tables(&raw).contains("delegation_child_usage"));
    insta::assert_snapshot!("fresh_schema", fx.store.schema_dump().expect("dump"));
}

#[test]
fn pragmas_are_wal_full_and_foreign_keys() {
    let fx = Fx::new();
    let raw = fx.raw();
    let mode: String = raw.query_row("PRAGMA journal_mode", [], |r| r.get(0)).expect("mode");
    assert_eq!(mode, "wal");
    assert_eq!(fx.store.integrity_check().expect("check"), "ok");
}

#[test]
fn opening_twice_is_a_no_op() {
    let fx = Fx::new();
    fx.seed_unit();
    let before = fx.store.schema_dump().expect("dump");
    let again = fx.reopen();
    assert_eq!(again.schema_dump().expect("dump"), before);
    let history: i64 = fx
        .raw()
        .query_row("SELECT count(*) FROM refinery_schema_history", [], |r| r.get(0))
        .expect("history");
    assert_eq!(history, super::fixture::migration_count(), "one row per migration");
    assert_eq!(super::fixture::ids(&again), vec!["sa-0-abc12345"]);
}

#[test]
fn non_sqlite_file_is_refused_and_left_byte_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    let junk =
        b"this is not a database, just some text that is long enough to look like one\n".repeat(4);
    std::fs::write(&path, &junk).expect("write");
    let err = Store::open(&path, StoreOptions::default()).expect_err("must refuse");
    assert!(matches!(err, Error::NotADatabase { .. }), "{err:?}");
    assert_eq!(std::fs::read(&path).expect("read"), junk);
    let names: Vec<_> = std::fs::read_dir(dir.path()).expect("ls").collect();
    assert_eq!(names.len(), 1, "no -wal/-shm side files");
}

#[test]
fn truncated_header_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    std::fs::write(&path, b"SQLite format 3\0").expect("write");
    let err = Store::open(&path, StoreOptions::default()).expect_err("must refuse");
    assert!(matches!(err, Error::NotADatabase { .. }), "{err:?}");
}

#[test]
fn newer_schema_is_refused_untouched() {
    let fx = Fx::new();
    fx.raw()
        .execute(
            "INSERT INTO refinery_schema_history (version, name, applied_on, checksum) \
             VALUES (99, 'future', '2030-01-01T00:00:00Z', '0')",
            [],
        )
        .expect("insert");
    let before = fx.store.schema_dump().expect("dump");
    drop(fx.store.schema_dump());
    let err = Store::open(fx.db(), StoreOptions::default()).expect_err("must refuse");
    let supported = super::fixture::migration_count();
    assert!(
        matches!(err, Error::SchemaTooNew { found: 99, supported: s } if s == supported),
        "{err:?}"
    );
    assert!(err.to_string().contains("newer"));
    assert_eq!(fx.store.schema_dump().expect("dump"), before);
}

#[test]
fn two_simultaneous_first_opens_succeed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let path = path.clone();
            std::thread::spawn(move || Store::open(&path, StoreOptions::default()).map(|_| ()))
        })
        .collect();
    for h in handles {
        h.join().expect("join").expect("open");
    }
}

#[test]
fn read_only_store_serves_reads() {
    let fx = Fx::new();
    fx.seed_unit();
    let ro = Store::open(
        fx.db(),
        StoreOptions { read_only: true, ..StoreOptions::default().with_clock(fx.clock.clone()) },
    )
    .expect("ro open");
    use retinue_core::{RegistryRead, Retention};
    assert_eq!(ro.list_retained_children().expect("list").len(), 1);
    assert!(ro.find_retained_child("child-sess-1").expect("find").is_some());
    let err = ro
        .tombstone_retained_child("sa-0-abc12345", &retinue_core::TombstoneReason::Manual)
        .expect_err("read-only");
    assert!(matches!(err, Error::ReadOnly { .. }), "{err:?}");
}

/// hermes's `async_delegation` module may create its tables before any
/// `SessionDB` exists (issue #22): such a file is hermes's, adopted in
/// place with every row kept.
#[test]
fn a_file_with_only_hermes_delegation_tables_is_adopted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    {
        let conn = rusqlite::Connection::open(&path).expect("create");
        conn.execute_batch(retinue_testkit::hermes::HERMES_LEGACY_DELEGATIONS_DDL).expect("ddl");
        conn.execute_batch(retinue_testkit::hermes::HERMES_ALTER_DELEGATIONS_DDL).expect("alter");
        conn.execute_batch(retinue_testkit::hermes::HERMES_USAGE_DDL).expect("usage");
        conn.execute(
            "INSERT INTO async_delegations (delegation_id, origin_session, state, dispatched_at, \
             updated_at) VALUES ('deleg_early', 'p', 'running', 1.0, 1.0)",
            [],
        )
        .expect("row");
    }
    let store = Store::open(&path, StoreOptions::default()).expect("hermes's file is adopted");
    drop(store);
    let conn = rusqlite::Connection::open(&path).expect("reopen");
    let t = tables(&conn);
    assert!(t.contains("sessions") && t.contains("retinue_children"), "{t:?}");
    let n: i64 = conn
        .query_row(
            "SELECT count(*) FROM async_delegations WHERE delegation_id = 'deleg_early'",
            [],
            |r| r.get(0),
        )
        .expect("count");
    assert_eq!(n, 1);
    // A file of some other program is still refused.
    let other = dir.path().join("other.db");
    rusqlite::Connection::open(&other)
        .and_then(|c| c.execute_batch("CREATE TABLE notes (body TEXT);"))
        .expect("other");
    assert!(matches!(Store::open(&other, StoreOptions::default()), Err(Error::Foreign { .. })));
}
