//! Writers taking turns (issue #41): the writers of one process queue in
//! the file's gate and never meet in the busy handler; another process
//! holding the write lock (Python's own SQLite, as hermes) is waited for
//! within the busy timeout, a failure says how long it waited, and a
//! process killed while it holds the lock leaves nothing locked.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use retinue_core::{ErrorKind, NewSession, SessionStore};
use retinue_store::{Store, StoreOptions};

/// A Python process (its own SQLite library, as hermes) that takes the
/// write lock of `db` with `BEGIN IMMEDIATE`, says `locked`, and holds it
/// for `secs` seconds before committing.
struct Holder {
    child: Child,
}

const HOLD: &str = "import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=0)
c.execute('BEGIN IMMEDIATE')
c.execute(\"INSERT INTO sessions (id, source, started_at) VALUES ('held-by-python', 'cli', 0)\")
print('locked', flush=True)
time.sleep(float(sys.argv[2]))
c.execute('COMMIT')
";

impl Holder {
    /// `None` when there is no Python 3 here (CI installs it).
    fn start(db: &Path, secs: f64) -> Option<Holder> {
        let spawned = Command::new("python3")
            .args(["-S", "-c", HOLD])
            .arg(db)
            .arg(secs.to_string())
            .stdout(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                assert!(std::env::var_os("CI").is_none(), "python3 is required in CI: {e}");
                eprintln!("skipped: no python3 ({e})");
                return None;
            }
        };
        let mut line = String::new();
        let out = child.stdout.take().expect("piped stdout");
        BufReader::new(out).read_line(&mut line).expect("the holder's first line");
        assert_eq!(line.trim(), "locked", "the Python holder did not take the lock");
        Some(Holder { child })
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn session(id: &str) -> NewSession {
    NewSession { id: id.to_owned(), source: "cli".into(), ..NewSession::default() }
}

fn store(db: &Path, busy: Duration) -> Store {
    Store::open(db, StoreOptions { busy_timeout: busy, ..StoreOptions::default() }).expect("open")
}

/// The ids of the sessions in `db`, in order (read by a connection of its own).
fn session_ids(db: &Path) -> Vec<String> {
    let raw = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .expect("raw");
    let mut stmt = raw.prepare("SELECT id FROM sessions ORDER BY id").expect("prepare");
    let ids = stmt.query_map([], |r| r.get(0)).expect("query").collect::<Result<_, _>>();
    ids.expect("rows")
}

#[test]
fn writers_of_one_process_never_meet_in_the_busy_handler() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("state.db");
    // Two stores (two pools) on one file, as the CLI and a background
    // worker thread of one process would have.
    let stores = [
        Arc::new(store(&db, Duration::from_secs(10))),
        Arc::new(store(&db, Duration::from_secs(10))),
    ];
    std::thread::scope(|s| {
        for t in 0..8 {
            let store = stores[t % 2].clone();
            s.spawn(move || {
                for i in 0..40 {
                    store.create_session(&session(&format!("s-{t}-{i}"))).expect("a write");
                }
            });
        }
    });
    // 320 concurrent writes, and not one found the lock taken: they queued.
    assert_eq!(stores[0].busy_probes() + stores[1].busy_probes(), 0);
    assert_eq!(session_ids(&db).len(), 320);
}

#[test]
fn a_foreign_writer_is_waited_for_then_the_write_proceeds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("state.db");
    let store = store(&db, Duration::from_secs(30));
    store.create_session(&session("before")).expect("a first write");
    // hermes holds a write transaction for 5 s.
    let Some(mut holder) = Holder::start(&db, 5.0) else { return };
    store.create_session(&session("after")).expect("waits for the holder, then writes");
    assert!(store.busy_probes() > 0, "the write never found the lock taken");
    // The holder's own write landed first, intact.
    let status = holder.child.wait().expect("holder exit");
    assert!(status.success());
    assert_eq!(session_ids(&db), ["after", "before", "held-by-python"]);
}

#[test]
fn a_writer_that_gives_up_says_how_long_it_waited() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("state.db");
    let store = store(&db, Duration::from_millis(400));
    let Some(_holder) = Holder::start(&db, 30.0) else { return };
    let e = store.create_session(&session("x")).expect_err("the lock is held for 30 s");
    assert_eq!(e.kind(), ErrorKind::Busy);
    let text = e.to_string();
    assert!(text.contains("busy timeout 0.4 s"), "the message names the timeout: {text}");
    assert!(text.contains("waited"), "{text}");
    match e {
        retinue_core::Error::Busy { waited_ms, timeout_ms, .. } => {
            assert_eq!(timeout_ms, 400);
            assert!(waited_ms >= 400, "gave up after {waited_ms} ms");
        }
        other => panic!("not Busy: {other:?}"),
    }
    // Nothing half-written.
    assert!(!session_ids(&db).contains(&"x".to_owned()));
}

#[test]
fn a_writer_killed_holding_the_lock_leaves_nothing_locked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("state.db");
    let store = store(&db, Duration::from_secs(30));
    store.create_session(&session("before")).expect("a first write");
    let Some(mut holder) = Holder::start(&db, 600.0) else { return };
    // Killed mid-transaction (SIGKILL: no chance to roll back).
    holder.child.kill().expect("kill");
    holder.child.wait().expect("reaped");
    store.create_session(&session("after")).expect("the next writer proceeds");
    // The killed writer's insert was rolled back; ours landed.
    assert_eq!(session_ids(&db), ["after", "before"]);
    let raw = rusqlite::Connection::open(&db).expect("raw");
    let check: String = raw.query_row("PRAGMA integrity_check", [], |r| r.get(0)).expect("check");
    assert_eq!(check, "ok");
}
