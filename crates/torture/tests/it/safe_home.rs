//! Issue 12 at the store level: totals always equal the sum of the ledger
//! rows whoever writes them; read-only opens in a read-only directory and
//! under a writer holding the lock; malformed rows never hide healthy ones.

use std::sync::Arc;

use proptest::prelude::*;
use retinue_core::{AttributionDraft, ManualClock, RegistryRead, UsageTotals};
use retinue_store::{Store, StoreOptions};
use retinue_usage::{load_child_usage_totals, record_child_usage_attribution};
use serde_json::json;

fn sql_sum(conn: &rusqlite::Connection, parent: &str) -> UsageTotals {
    conn.query_row(
        "SELECT COALESCE(SUM(json_extract(usage_json, '$.cost_usd')), 0), \
         COALESCE(SUM(json_extract(usage_json, '$.tokens.input')), 0), \
         COALESCE(SUM(json_extract(usage_json, '$.tokens.output')), 0) \
         FROM delegation_child_usage WHERE parent_session_id = ?1",
        [parent],
        |r| {
            Ok(UsageTotals {
                cost_usd: r.get(0)?,
                input_tokens: r.get(1)?,
                output_tokens: r.get(2)?,
            })
        },
    )
    .expect("sum")
}

#[derive(Debug, Clone)]
enum Op {
    /// Retinue records a row (maintained totals).
    Record(u8, u16),
    /// Another program inserts a row.
    RawInsert(u8, u16),
    /// Another program edits the n-th row.
    RawUpdate(u8, u16),
    /// Another program deletes the n-th row.
    RawDelete(u8),
    /// Another program moves the n-th row to the other parent.
    RawMove(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..2, 0u16..500).prop_map(|(p, c)| Op::Record(p, c)),
        (0u8..2, 0u16..500).prop_map(|(p, c)| Op::RawInsert(p, c)),
        (0u8..8, 0u16..500).prop_map(|(n, c)| Op::RawUpdate(n, c)),
        (0u8..8).prop_map(Op::RawDelete),
        (0u8..8).prop_map(Op::RawMove),
    ]
}

fn usage(c: u16) -> serde_json::Value {
    json!({ "cost_usd": f64::from(c) / 4.0, "tokens": { "input": c, "output": u32::from(c) * 2 } })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn totals_equal_the_sum_of_the_rows(ops in proptest::collection::vec(op(), 1..24)) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        let clock = Arc::new(ManualClock::new(1_800_000_000.0));
        let store = Store::open(&path, StoreOptions::default().with_clock(clock)).expect("open");
        let raw = rusqlite::Connection::open(&path).expect("raw");
        let parents = ["P", "Q"];
        for op in ops {
            match op {
                Op::Record(p, c) => {
                    let draft = AttributionDraft {
                        parent_session_id: parents[usize::from(p)].to_owned(),
                        usage: usage(c),
                        ..AttributionDraft::default()
                    };
                    record_child_usage_attribution(&store, &draft).expect("record");
                }
                Op::RawInsert(p, c) => {
                    raw.execute(
                        "INSERT INTO delegation_child_usage (parent_session_id, usage_json, created_at) \
                         VALUES (?1, ?2, 0)",
                        rusqlite::params![parents[usize::from(p)], usage(c).to_string()],
                    ).expect("insert");
                }
                Op::RawUpdate(n, c) => {
                    raw.execute(
                        "UPDATE delegation_child_usage SET usage_json = ?1 WHERE id = \
                         (SELECT id FROM delegation_child_usage ORDER BY id LIMIT 1 OFFSET ?2)",
                        rusqlite::params![usage(c).to_string(), n],
                    ).expect("update");
                }
                Op::RawDelete(n) => {
                    raw.execute(
                        "DELETE FROM delegation_child_usage WHERE id = \
                         (SELECT id FROM delegation_child_usage ORDER BY id LIMIT 1 OFFSET ?1)",
                        [n],
                    ).expect("delete");
                }
                Op::RawMove(n) => {
                    raw.execute(
                        "UPDATE delegation_child_usage SET parent_session_id = \
                         CASE parent_session_id WHEN 'P' THEN 'Q' ELSE 'P' END WHERE id = \
                         (SELECT id FROM delegation_child_usage ORDER BY id LIMIT 1 OFFSET ?1)",
                        [n],
                    ).expect("move");
                }
            }
            for parent in parents {
                let got = load_child_usage_totals(&store, parent).expect("totals");
                let want = sql_sum(&raw, parent);
                prop_assert!((got.cost_usd - want.cost_usd).abs() < 1e-6, "{parent}: {got:?} vs {want:?}");
                prop_assert!((got.input_tokens - want.input_tokens).abs() < 1e-6);
                prop_assert!((got.output_tokens - want.output_tokens).abs() < 1e-6);
                // A read-only open agrees.
                let ro = Store::open_read_only(&path, StoreOptions::default()).expect("ro");
                let ro_got = load_child_usage_totals(&ro, parent).expect("ro totals");
                prop_assert!((ro_got.cost_usd - want.cost_usd).abs() < 1e-6);
            }
        }
    }
}

#[test]
fn read_only_open_works_in_a_read_only_directory_and_creates_nothing() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let home = dir.path().join("home");
    std::fs::create_dir(&home).expect("home");
    let path = home.join("state.db");
    let fx = retinue_testkit::HermesDb::standard(&path, 1_800_000_000.0);
    drop(fx);
    let expected = Store::open_read_only(&path, StoreOptions::default())
        .expect("ro")
        .list_retained_children()
        .expect("list");
    let list = |p: &std::path::Path| {
        let mut v: Vec<String> = std::fs::read_dir(p)
            .expect("dir")
            .map(|e| e.expect("e").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let before_entries = list(&home);
    let bytes = std::fs::read(&path).expect("read");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).expect("chmod");
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o555)).expect("chmod");
    let store = Store::open_read_only(&path, StoreOptions::default());
    let got = store.and_then(|s| s.list_retained_children());
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    assert_eq!(got.expect("read-only dir"), expected);
    assert_eq!(std::fs::read(&path).expect("read"), bytes);
    assert_eq!(list(&home), before_entries);
    // A missing file: an error naming it, nothing created.
    let missing = home.join("nope").join("state.db");
    let err = Store::open_read_only(&missing, StoreOptions::default()).expect_err("missing");
    assert!(err.to_string().contains("no state.db at"), "{err}");
    assert!(!home.join("nope").exists());
}

#[test]
fn malformed_rows_never_hide_healthy_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    let fx = retinue_testkit::HermesDb::standard(&path, 1_800_000_000.0);
    let batch = fx.batch;
    drop(fx);
    let store = Store::open(
        &path,
        StoreOptions::default().with_clock(Arc::new(ManualClock::new(1_800_000_000.0))),
    )
    .expect("open");
    let healthy = store.list_retained_children().expect("list").len();
    assert!(healthy >= 2);
    let raw = rusqlite::Connection::open(&path).expect("raw");
    // Text in a time column, a BLOB id, a non-finite number.
    raw.execute(
        "UPDATE retinue_children SET subagent_id = x'ff00fe', child_session_id = x'fffe' \
                 WHERE delegation_id = ?1 AND child_index = 0",
        [batch],
    )
    .expect("blob");
    raw.execute(
        "UPDATE retinue_children SET retained_at = 'yesterday' \
                 WHERE delegation_id = ?1 AND child_index = 1",
        [batch],
    )
    .expect("text");
    raw.execute("UPDATE sessions SET started_at = 'soon', estimated_cost_usd = 9e999", [])
        .expect("inf");
    let listed = store.list_retained_children().expect("a bad row never fails the list");
    assert!(!listed.is_empty() && listed.len() < healthy, "{} of {healthy}", listed.len());
    let ro = Store::open_read_only(&path, StoreOptions::default()).expect("ro");
    assert_eq!(ro.list_retained_children().expect("ro list").len(), listed.len());
}

#[test]
fn hostile_harness_cases_all_hold() {
    let dir = tempfile::tempdir().expect("tempdir");
    let report = retinue_torture::hostile::run(&dir.path().join("hostile")).expect("hostile");
    let names: Vec<&str> = report.cases.iter().map(|c| c.case).collect();
    assert_eq!(
        names,
        [
            "corrupt page",
            "FIFO as the database",
            "directory as the database",
            "socket as the database",
            "read-only file in a read-only directory",
            "hermes writer holding the write lock",
        ]
    );
    for case in &report.cases {
        eprintln!("{}: {} ({} ms) {}", case.case, case.outcome, case.millis, case.note);
    }
    assert!(report.cases[0].unchanged && report.cases[0].outcome.contains("Corrupt"));
    assert!(report.cases[5].outcome.contains("database is busy: waited"));
}

#[test]
fn a_socket_as_state_db_is_refused_at_once_and_left_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    let _listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
    for read_only in [false, true] {
        let started = std::time::Instant::now();
        let got = if read_only {
            Store::open_read_only(&path, StoreOptions::default())
        } else {
            Store::open(&path, StoreOptions::default())
        };
        let err = got.expect_err("a socket is not a database");
        assert_eq!(err.kind(), retinue_core::ErrorKind::NotAFile);
        assert_eq!(err.to_string(), format!("{} is a socket, not a database file", path.display()));
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&path).expect("still there").file_type().is_socket());
    let mut entries: Vec<String> = std::fs::read_dir(dir.path())
        .expect("dir")
        .map(|e| e.expect("e").file_name().to_string_lossy().into_owned())
        .collect();
    entries.sort();
    assert_eq!(entries, ["state.db"], "nothing created beside the socket");
}

/// Whether permissions bind for this process (a file cannot be created in a
/// 0555 directory): false when running as root.
fn permissions_bind() -> bool {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro).expect("mkdir");
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).expect("chmod");
    let binds = std::fs::write(ro.join("x"), b"x").is_err();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    binds
}

#[test]
fn a_read_only_directory_really_refuses_writes() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("mkdir");
    let figures: serde_json::Value = if permissions_bind() {
        eprintln!("read-only directory: permissions bind (not root): running in-process");
        retinue_torture::hostile::run(&work).expect("hostile").to_json()
    } else {
        // As root, permissions do not bind: run the harness as `nobody`.
        let Some(setpriv) = ["/usr/bin/setpriv", "/bin/setpriv"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
        else {
            eprintln!(
                "SKIPPED: running as root and no setpriv to drop privileges: the read-only \
                 directory's permissions cannot bind here"
            );
            return;
        };
        eprintln!("read-only directory: running as root: the harness runs as nobody (setpriv)");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let out = std::process::Command::new(setpriv)
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(env!("CARGO_BIN_EXE_retinue-torture"))
            .args(["hostile", "--db-dir"])
            .arg(&work)
            .output()
            .expect("setpriv");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("figures")
    };
    let case = figures["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["case"] == "read-only file in a read-only directory")
        .expect("case")
        .clone();
    // The path that ran is the one where the OS enforces the permission.
    assert_eq!(
        case["note"], "permissions bind (not root): the write was really refused by the OS",
        "{case}"
    );
    assert!(case["outcome"].as_str().expect("outcome").contains("write: ReadOnly"), "{case}");
    assert_eq!(case["unchanged"], true);
}
