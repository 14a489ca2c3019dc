//! Hostile files: a non-SQLite file, a truncated database, a database from a
//! newer schema, a read-only file and a full disk each give a typed
//! `retinue_core::Error`, and nothing is modified on refusal.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use retinue_core::{
    AttributionDraft, ChildManifest, Error, ManualClock, NewSession, RegistryRead, Retention,
    SessionStore, TombstoneReason, UnitDraft, UnitLifecycle,
};
use retinue_store::{Store, StoreOptions};
use serde_json::json;

use super::common::{Fx, T0, dump, open};

fn bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).expect("read file")
}

fn read_only() -> StoreOptions {
    StoreOptions { read_only: true, ..StoreOptions::default() }
}

/// A store with some units, closed, its WAL checkpointed into the main file.
fn populated(dir: &Path, units: usize) -> PathBuf {
    let path = dir.join("state.db");
    let clock = Arc::new(ManualClock::new(T0));
    let store = open(&path, &clock).expect("open");
    for u in 0..units {
        let id = store
            .insert_unit(&UnitDraft {
                parent_session_id: Some("A".into()),
                task: json!({"goal": "x".repeat(500)}),
                children: vec![ChildManifest {
                    subagent_id: format!("sa-0-{u:08x}"),
                    session_id: format!("child-{u}"),
                    ..ChildManifest::default()
                }],
                child_sessions: vec![NewSession {
                    id: format!("child-{u}"),
                    source: "delegate".into(),
                    ..NewSession::default()
                }],
                ..UnitDraft::default()
            })
            .expect("unit");
        store.retain_completed_delegation(&id, Some(&json!({"cost_usd": 0.5}))).expect("retain");
    }
    drop(store);
    let conn = rusqlite::Connection::open(&path).expect("raw");
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).expect("checkpoint");
    drop(conn);
    path
}

#[test]
fn non_sqlite_files_are_refused_byte_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("text", b"these are my notes, not a database\n".repeat(200)),
        ("short magic", b"SQLite format 3\0".to_vec()),
        ("magic then garbage", {
            let mut b = b"SQLite format 3\0".to_vec();
            b.extend((0..8192u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
            b
        }),
        ("nul page", vec![0u8; 4096]),
    ];
    for (what, content) in cases {
        let path = dir.path().join(format!("{}.db", what.replace(' ', "-")));
        std::fs::write(&path, &content).expect("write");
        for opts in [StoreOptions::default(), read_only()] {
            let err = Store::open(&path, opts).expect_err(what);
            assert!(
                matches!(err, Error::NotADatabase { .. } | Error::Corrupt { .. }),
                "{what}: {err:?}"
            );
            assert_eq!(bytes(&path), content, "{what}: the refused file was modified");
            assert!(!dir.path().join(format!("{}-wal", path.display())).exists());
        }
    }
}

#[test]
fn truncated_databases_are_refused_byte_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let full = populated(dir.path(), 300);
    let original = bytes(&full);
    let len = original.len();
    assert!(len > 64 * 1024, "the fixture should span many pages ({len} bytes)");
    for cut in [50, 100, 4096, len / 2, len - 4096] {
        let path = dir.path().join(format!("cut-{cut}.db"));
        std::fs::write(&path, &original[..cut]).expect("write");
        for opts in [StoreOptions::default(), read_only()] {
            let res = Store::open(&path, opts.clone());
            let err = match res {
                Err(e) => e,
                Ok(store) => panic!(
                    "a database cut to {cut} of {len} bytes opened (read_only {}): integrity {:?}",
                    opts.read_only,
                    store.integrity_check()
                ),
            };
            assert!(
                matches!(err, Error::NotADatabase { .. } | Error::Corrupt { .. }),
                "cut {cut}: {err:?}"
            );
            assert_eq!(bytes(&path), original[..cut], "cut {cut}: the refused file was modified");
            println!("cut to {cut} of {len} bytes (read_only {}): {err:?}", opts.read_only);
        }
    }
}

#[test]
fn newer_schema_is_refused_unchanged() {
    let fx = Fx::new();
    retinue_testkit::dispatch_and_retain(&*fx.store, "A");
    fx.raw()
        .execute(
            "INSERT INTO refinery_schema_history (version, name, applied_on, checksum) \
             VALUES (99, 'from_the_future', '2030-01-01T00:00:00Z', '1')",
            [],
        )
        .expect("future migration");
    let before = fx.dump();
    for opts in [StoreOptions::default(), read_only()] {
        let err = Store::open(fx.db(), opts).expect_err("newer schema");
        assert!(matches!(err, Error::SchemaTooNew { found: 99, .. }), "{err:?}");
        assert_eq!(before, fx.dump());
    }
}

fn permissions_bind(path: &Path) -> bool {
    std::fs::OpenOptions::new().write(true).open(path).is_err()
}

#[test]
fn read_only_file_refuses_writes_unchanged() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = populated(dir.path(), 3);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).expect("chmod");
    let original = bytes(&path);
    if permissions_bind(&path) {
        let err = Store::open(&path, StoreOptions::default()).expect_err("0444 file");
        assert!(matches!(err, Error::ReadOnly { .. }), "{err:?}");
        assert_eq!(bytes(&path), original);
    } else {
        println!(
            "note: running as root, where chmod 0444 does not bind; \
             the read-only case uses StoreOptions {{ read_only: true }}"
        );
    }
    let store = Store::open(&path, read_only()).expect("read-only open");
    assert_eq!(store.list_retained_children().expect("reads work").len(), 3);
    let writes: Vec<(&str, retinue_core::Result<()>)> = vec![
        ("insert_unit", store.insert_unit(&UnitDraft::default()).map(|_| ())),
        ("retain", store.retain_completed_delegation("x", None).map(|_| ())),
        (
            "tombstone",
            store.tombstone_retained_child("sa-0-00000000", &TombstoneReason::Manual).map(|_| ()),
        ),
        ("prune", store.prune_retained_children(Some(1), Some(0.0)).map(|_| ())),
        (
            "create_session",
            store.create_session(&NewSession {
                id: "S".into(),
                source: "cli".into(),
                ..NewSession::default()
            }),
        ),
        (
            "ledger",
            retinue_usage::record_child_usage_attribution(
                &store,
                &AttributionDraft {
                    parent_session_id: "A".into(),
                    usage: json!({"cost_usd": 1}),
                    ..AttributionDraft::default()
                },
            )
            .map(|_| ())
            .map_err(|e| match e {
                retinue_usage::UsageError::Store(e) => e,
                other => Error::Invalid(other.to_string()),
            }),
        ),
    ];
    for (what, res) in writes {
        let err = res.expect_err(what);
        assert!(matches!(err, Error::ReadOnly { .. }), "{what}: {err:?}");
    }
    let report = store.recover_abandoned_delegations(&retinue_core::ProcProbe);
    assert!(report.error.is_some() || report.abandoned == 0);
    drop(store);
    assert_eq!(bytes(&path), original, "a read-only store modified the file");
}

/// A tmpfs mount, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .is_ok_and(|o| o.status.success());
        ok.then_some(Tmpfs { dir })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

fn big_unit(u: usize) -> UnitDraft {
    UnitDraft {
        parent_session_id: Some("A".into()),
        task: json!({"goal": format!("{u}").repeat(40_000)}),
        children: vec![ChildManifest {
            subagent_id: format!("sa-0-{u:08x}"),
            session_id: format!("full-{u}"),
            ..ChildManifest::default()
        }],
        child_sessions: vec![NewSession {
            id: format!("full-{u}"),
            source: "delegate".into(),
            ..NewSession::default()
        }],
        ..UnitDraft::default()
    }
}

#[test]
fn full_disk_gives_disk_full_and_keeps_the_database() {
    let Some(fs) = Tmpfs::mount("1m") else {
        println!(
            "note: cannot mount a tmpfs here; the full disk is simulated with \
             PRAGMA max_page_count on a raw connection"
        );
        return simulated_full_disk();
    };
    let path = fs.dir.path().join("state.db");
    let clock = Arc::new(ManualClock::new(T0));
    let store = open(&path, &clock).expect("open on tmpfs");
    let mut refused = 0;
    for u in 0..200 {
        let before = dump(&path);
        match store.insert_unit(&big_unit(u)) {
            Ok(_) => assert_eq!(refused, 0, "a write succeeded after the disk filled"),
            Err(e) => {
                assert!(matches!(e, Error::DiskFull { .. }), "unit {u}: {e:?}");
                println!("tmpfs 1 MB: unit {u} refused: {e}");
                assert_eq!(before, dump(&path), "a refused write left a trace");
                refused += 1;
                if refused == 3 {
                    break;
                }
            }
        }
    }
    assert_eq!(refused, 3, "the 1 MB tmpfs never filled up");
    assert_eq!(store.integrity_check().expect("integrity"), "ok");
    store.list_retained_children().expect("reads still work");
    drop(store);
    let reopened = open(&path, &clock);
    assert!(matches!(reopened, Ok(_) | Err(Error::DiskFull { .. })), "{reopened:?}");
}

/// Where no tmpfs can be mounted: a raw connection capped by
/// `max_page_count` hits `SQLITE_FULL` (which the store classifies as
/// `Error::DiskFull` by that code; see the store's error tests), and the
/// failed transaction leaves nothing behind.
fn simulated_full_disk() {
    let fx = Fx::new();
    let conn = fx.raw();
    let pages: i64 = conn.query_row("PRAGMA page_count", [], |r| r.get(0)).expect("pages");
    conn.execute_batch(&format!("PRAGMA max_page_count = {pages}")).expect("cap");
    let before = fx.dump();
    let res = conn.execute_batch(
        "BEGIN IMMEDIATE; INSERT INTO delegation_child_usage (parent_session_id, usage_json, \
         created_at) VALUES ('A', printf('%.*c', 200000, 'x'), 1); COMMIT;",
    );
    let err = res.expect_err("capped database accepted a write");
    assert_eq!(err.sqlite_error_code(), Some(rusqlite::ErrorCode::DiskFull), "{err:?}");
    let _ = conn.execute_batch("ROLLBACK");
    assert_eq!(before, fx.dump());
}
