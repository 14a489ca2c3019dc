//! Hostile files and homes (issue 12): each case builds a real file, opens
//! it the way the commands do and records what happened, how long it took
//! and whether the file was left byte-identical.
//!
//! Cases: a corrupt page, a FIFO, a directory and a socket as the database
//! path, a read-only file in a read-only directory, and a concurrent hermes
//! writer holding the write lock for the whole read.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use retinue_core::{ErrorKind, NewSession, RegistryRead, SessionStore};
use retinue_store::{Store, StoreOptions};
use serde_json::{Value, json};

use crate::{Context, Outcome};

/// One case's figures.
#[derive(Debug, Clone)]
pub struct CaseReport {
    /// The case's name.
    pub case: &'static str,
    /// What happened, in words (`Corrupt`, `NotAFile(FIFO …)`, `answered`, …).
    pub outcome: String,
    /// Wall time of the case's open and operations, in milliseconds.
    pub millis: u64,
    /// Whether the file (or directory listing) was left unchanged.
    pub unchanged: bool,
    /// A note (e.g. why a permission check could not bind).
    pub note: String,
}

/// Every case's figures.
#[derive(Debug, Clone, Default)]
pub struct HostileReport {
    /// The cases, in order.
    pub cases: Vec<CaseReport>,
}

impl HostileReport {
    /// The figures as one JSON value.
    pub fn to_json(&self) -> Value {
        json!({
            "harness": "hostile",
            "cases": self.cases.iter().map(|c| json!({
                "case": c.case,
                "outcome": c.outcome,
                "ms": c.millis,
                "unchanged": c.unchanged,
                "note": c.note,
            })).collect::<Vec<_>>(),
        })
    }
}

fn millis(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A hermes-shaped file (a `sessions` table with enough rows for several
/// pages) that Retinue has not adopted yet.
fn hermes_file(path: &Path) -> Outcome<()> {
    let conn = rusqlite::Connection::open(path).ctx("create hermes file")?;
    conn.execute_batch(
        "PRAGMA journal_mode = WAL; \
         CREATE TABLE sessions (id TEXT PRIMARY KEY, source TEXT NOT NULL, \
           parent_session_id TEXT, started_at REAL NOT NULL, title TEXT);",
    )
    .ctx("hermes schema")?;
    for i in 0..300 {
        conn.execute(
            "INSERT INTO sessions (id, source, started_at, title) VALUES (?1, 'cli', ?2, ?3)",
            rusqlite::params![format!("s-{i:04}"), f64::from(i), "x".repeat(200)],
        )
        .ctx("hermes row")?;
    }
    conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").ctx("checkpoint")?;
    Ok(())
}

fn options(busy: Duration) -> StoreOptions {
    StoreOptions { busy_timeout: busy, ..StoreOptions::default() }
}

fn describe(r: &Result<Store, retinue_core::Error>) -> String {
    match r {
        Ok(_) => "opened".to_owned(),
        Err(e) => format!("{:?}: {e}", e.kind()),
    }
}

fn listing(dir: &Path) -> Outcome<Vec<PathBuf>> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .ctx("list dir")?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .ctx("list dir")?;
    names.sort();
    Ok(names)
}

/// A corrupt page in an unadopted hermes file: every write open refuses it
/// (`quick_check` before any schema change) and leaves it byte-identical; a
/// read-only open answers or reports `Corrupt`, never an empty success.
fn corrupt_page(dir: &Path) -> Outcome<CaseReport> {
    let path = dir.join("corrupt.db");
    hermes_file(&path)?;
    let mut bytes = std::fs::read(&path).ctx("read")?;
    let page = 4096;
    if bytes.len() < 4 * page {
        return Err(format!("fixture too small: {} bytes", bytes.len()));
    }
    for b in &mut bytes[2 * page + 100..3 * page] {
        *b = 0xA5;
    }
    std::fs::write(&path, &bytes).ctx("damage")?;
    let start = Instant::now();
    let write = Store::open(&path, options(Duration::from_secs(2)));
    let refused = matches!(&write, Err(e) if e.kind() == ErrorKind::Corrupt);
    let outcome_write = describe(&write);
    drop(write);
    let read = Store::open_read_only(&path, options(Duration::from_secs(2)));
    let read_outcome = match &read {
        Ok(store) => match store.integrity_check() {
            Ok(text) if text == "ok" => "read: integrity ok (damage not reached)".to_owned(),
            Ok(_) => "read: integrity_check reports the damage".to_owned(),
            Err(e) => format!("read: {:?}", e.kind()),
        },
        Err(e) => format!("read open: {:?}", e.kind()),
    };
    drop(read);
    let unchanged = std::fs::read(&path).ctx("reread")? == bytes;
    if !refused || !unchanged {
        return Err(format!("corrupt page: write open {outcome_write}, unchanged {unchanged}"));
    }
    Ok(CaseReport {
        case: "corrupt page",
        outcome: format!("write open: {outcome_write}; {read_outcome}"),
        millis: millis(start),
        unchanged,
        note: String::new(),
    })
}

/// A path that is not a regular file: refused at once, never opened (a FIFO
/// would block), for writes and reads.
fn not_a_file(case: &'static str, path: &Path, want: &str) -> Outcome<CaseReport> {
    let start = Instant::now();
    let mut outcomes = Vec::new();
    for read_only in [false, true] {
        let r = if read_only {
            Store::open_read_only(path, options(Duration::from_secs(2)))
        } else {
            Store::open(path, options(Duration::from_secs(2)))
        };
        match &r {
            Err(e) if e.kind() == ErrorKind::NotAFile && e.to_string().contains(want) => {}
            _ => return Err(format!("{case}: {}", describe(&r))),
        }
        outcomes.push(describe(&r));
    }
    let ms = millis(start);
    if ms > 1000 {
        return Err(format!("{case}: took {ms} ms"));
    }
    Ok(CaseReport {
        case,
        outcome: outcomes.join(" | "),
        millis: ms,
        unchanged: true,
        note: String::new(),
    })
}

fn fifo(dir: &Path) -> Outcome<CaseReport> {
    let path = dir.join("fifo.db");
    let status = std::process::Command::new("mkfifo").arg(&path).status().ctx("mkfifo")?;
    if !status.success() {
        return Err(format!("mkfifo failed: {status}"));
    }
    not_a_file("FIFO as the database", &path, "FIFO")
}

fn directory(dir: &Path) -> Outcome<CaseReport> {
    let path = dir.join("dir.db");
    std::fs::create_dir_all(&path).ctx("mkdir")?;
    not_a_file("directory as the database", &path, "directory")
}

fn socket(dir: &Path) -> Outcome<CaseReport> {
    let path = dir.join("socket.db");
    let _listener = std::os::unix::net::UnixListener::bind(&path).ctx("bind")?;
    not_a_file("socket as the database", &path, "socket")
}

/// Whether this process's permissions bind (not root): probes by trying to
/// create a file in a 0555 directory.
fn permissions_bind(dir: &Path) -> Outcome<bool> {
    use std::os::unix::fs::PermissionsExt;
    let probe = dir.join("perm-probe");
    std::fs::create_dir_all(&probe).ctx("mkdir")?;
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o555)).ctx("chmod")?;
    let binds = std::fs::write(probe.join("x"), b"x").is_err();
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o755)).ctx("chmod")?;
    std::fs::remove_dir_all(&probe).ctx("rm")?;
    Ok(binds)
}

/// A 0444 adopted file in a 0555 directory: a read-only open answers the
/// same list and creates nothing; a write is refused `ReadOnly` (when
/// permissions bind, i.e. not as root: then the case says so).
fn read_only_dir(dir: &Path) -> Outcome<CaseReport> {
    use std::os::unix::fs::PermissionsExt;
    let home = dir.join("ro-home");
    std::fs::create_dir_all(&home).ctx("mkdir")?;
    let path = home.join("state.db");
    hermes_file(&path)?;
    let expected = {
        let store = Store::open(&path, options(Duration::from_secs(2))).ctx("adopt")?;
        store.list_retained_children().ctx("list")?.len()
    };
    // Leave no WAL companions: a checkpointed file.
    rusqlite::Connection::open(&path)
        .and_then(|c| {
            c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE); PRAGMA journal_mode = DELETE")
        })
        .ctx("checkpoint")?;
    let binds = permissions_bind(dir)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).ctx("chmod file")?;
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o555)).ctx("chmod dir")?;
    let before = (std::fs::read(&path).ctx("read")?, listing(&home)?);
    let start = Instant::now();
    let result = (|| -> Outcome<(String, String)> {
        let ro = Store::open_read_only(&path, options(Duration::from_secs(2))).ctx("ro open")?;
        let listed = ro.list_retained_children().ctx("ro list")?.len();
        if listed != expected {
            return Err(format!("read-only list: {listed} children, expected {expected}"));
        }
        drop(ro);
        // A write that really changes a row (a prune with nothing to prune writes nothing).
        let session =
            NewSession { id: "s-new".into(), source: "cli".into(), ..NewSession::default() };
        let write = Store::open(&path, options(Duration::from_secs(2)))
            .and_then(|s| s.create_session(&session));
        let write = match write {
            Err(e) if e.kind() == ErrorKind::ReadOnly => "write: ReadOnly".to_owned(),
            Err(e) if binds => return Err(format!("write: {:?} {e}", e.kind())),
            Err(e) => format!("write: {:?}", e.kind()),
            Ok(()) if binds => return Err("a write succeeded in a read-only directory".into()),
            Ok(()) => "write: succeeded (permissions do not bind for root)".to_owned(),
        };
        Ok((format!("read-only open: {listed} children listed"), write))
    })();
    let ms = millis(start);
    let after = (std::fs::read(&path).ctx("read")?, listing(&home)?);
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o755)).ctx("chmod dir")?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).ctx("chmod file")?;
    let (read, write) = result?;
    let unchanged = before == after;
    if binds && !unchanged {
        return Err("the read-only directory changed".to_owned());
    }
    Ok(CaseReport {
        case: "read-only file in a read-only directory",
        outcome: format!("{read}; {write}"),
        millis: ms,
        unchanged,
        note: if binds {
            "permissions bind (not root): the write was really refused by the OS".to_owned()
        } else {
            "running as root: permissions do not bind, the write path ran unrestricted".to_owned()
        },
    })
}

/// A hermes writer holds `BEGIN IMMEDIATE` (with an uncommitted write) for
/// the whole case: WAL reads answer from the last commit without waiting; a
/// write waits out its busy timeout and says how long it waited.
fn concurrent_writer(dir: &Path) -> Outcome<CaseReport> {
    let path = dir.join("locked.db");
    hermes_file(&path)?;
    let expected = {
        let store = Store::open(&path, options(Duration::from_secs(2))).ctx("adopt")?;
        store.list_retained_children().ctx("list")?.len()
    };
    let writer = rusqlite::Connection::open(&path).ctx("writer")?;
    writer
        .execute_batch("BEGIN IMMEDIATE; UPDATE sessions SET title = 'held' WHERE id = 's-0001';")
        .ctx("lock")?;
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let ro = Store::open_read_only(&path, options(timeout)).ctx("ro open")?;
    let listed = ro.list_retained_children().ctx("ro list")?.len();
    let read_ms = millis(start);
    drop(ro);
    let write_start = Instant::now();
    // A write that must happen: a unit dispatched (opening a current file
    // takes no lock, and a prune with nothing due writes nothing, so
    // neither would wait).
    let write = Store::open(&path, options(timeout)).and_then(|s| {
        use retinue_core::UnitLifecycle;
        let draft = retinue_core::UnitDraft {
            children: vec![retinue_core::ChildManifest::default()],
            ..retinue_core::UnitDraft::default()
        };
        s.insert_unit(&draft).map(|_| ())
    });
    let write_ms = millis(write_start);
    writer.execute_batch("ROLLBACK").ctx("unlock")?;
    let message = match write {
        Err(e) if e.kind() == ErrorKind::Busy => e.to_string(),
        other => return Err(format!("write under the lock: {other:?}")),
    };
    if listed != expected || read_ms >= 300 {
        return Err(format!("read under the lock: {listed} children in {read_ms} ms"));
    }
    if !(300..=2000).contains(&write_ms) {
        return Err(format!("write waited {write_ms} ms for a 300 ms busy timeout"));
    }
    Ok(CaseReport {
        case: "hermes writer holding the write lock",
        outcome: format!(
            "read: {listed} children in {read_ms} ms (no wait); write: {message} (wall {write_ms} ms)"
        ),
        millis: millis(start),
        unchanged: true,
        note: String::new(),
    })
}

/// Runs every case in a fresh directory under `dir`.
pub fn run(dir: &Path) -> Outcome<HostileReport> {
    std::fs::create_dir_all(dir).ctx("mkdir")?;
    let cases = vec![
        corrupt_page(dir)?,
        fifo(dir)?,
        directory(dir)?,
        socket(dir)?,
        read_only_dir(dir)?,
        concurrent_writer(dir)?,
    ];
    Ok(HostileReport { cases })
}
