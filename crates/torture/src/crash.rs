//! The kill -9 harness: runs the [`crate::worker`] as a child process, kills
//! it with SIGKILL at random moments, and after every kill checks the
//! database:
//!
//! 1. `PRAGMA integrity_check` is `ok` and `PRAGMA foreign_key_check` is empty;
//! 2. no half-written unit: every unit has exactly its manifest's child rows
//!    and child sessions, every child row its unit, every delegate session a
//!    child row (checked on the raw file, before the store's open backfill);
//! 3. every operation the worker logged (after its commit) is present;
//! 4. every idempotency key has its one ledger row, every row one key, and
//!    `load_child_usage_totals` equals the sum of the distinct rows;
//! 5. restart recovery (`ProcProbe`) marks the dead worker's running units
//!    `unknown` and leaves every retained unit and child exactly as it was;
//! 6. recovery releases the budget reservations the dead worker held, and
//!    the shared budget was never overspent.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use retinue_core::{Retention, parse_children_json};
use rusqlite::{Connection, OpenFlags, OptionalExtension};
use serde_json::{Value, json};

use crate::rng::Rng;
use crate::worker::{MAX_RETAINED, usage_of};
use crate::{Context, Outcome};

/// How to run the harness.
#[derive(Debug, Clone)]
pub struct CrashOptions {
    /// The `retinue-torture` binary (the worker is its `worker` subcommand).
    pub exe: PathBuf,
    /// Directory for `state.db`, the op log and the worker's stderr.
    pub dir: PathBuf,
    /// Number of SIGKILLs.
    pub kills: u32,
    /// Seed of the kill schedule and the workers.
    pub seed: u64,
    /// Shortest time a worker runs before its kill.
    pub min_delay: Duration,
    /// Longest time a worker runs before its kill.
    pub max_delay: Duration,
}

/// What a crash run did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CrashReport {
    /// SIGKILLs delivered (each followed by a full check).
    pub kills: u32,
    /// Distinct committed operations the worker logged.
    pub ops_logged: usize,
    /// Logged operations verified present, summed over all checks.
    pub op_checks: u64,
    /// Units in the final database.
    pub units: usize,
    /// Retained units in the final database (checked untouched by recovery).
    pub retained_units: usize,
    /// Of those, units retained while still `running` (as hermes may retain):
    /// recovery must never mark them `unknown`.
    pub retained_running: usize,
    /// Units recovery marked `unknown`, over all checks.
    pub abandoned: usize,
    /// Ledger rows in the final database.
    pub ledger_rows: usize,
    /// Wall time in seconds.
    pub secs: f64,
    /// The seed.
    pub seed: u64,
}

impl CrashReport {
    /// The figures as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "harness": "crash", "kills": self.kills, "ops_logged": self.ops_logged,
            "op_checks": self.op_checks, "units": self.units,
            "retained_units": self.retained_units, "retained_running": self.retained_running,
            "abandoned": self.abandoned,
            "ledger_rows": self.ledger_rows, "secs": self.secs, "seed": self.seed,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
struct UnitRow {
    state: String,
    retained: Option<i64>,
    retained_at: Option<f64>,
    tombstoned_at: Option<f64>,
    children_json: Option<String>,
    child_session_id: Option<String>,
    event_json: Option<String>,
    delivery_state: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
struct ChildRow {
    index: i64,
    subagent_id: String,
    child_session_id: String,
    retained_at: Option<f64>,
    tombstoned_at: Option<f64>,
    reason: Option<String>,
    resume_claim: Option<String>,
}

#[derive(Debug, Default)]
struct Snapshot {
    units: HashMap<String, UnitRow>,
    children: HashMap<String, Vec<ChildRow>>,
    sessions: HashMap<String, String>,
    /// Ledger rows: id → (parent, usage_json).
    ledger: BTreeMap<i64, (String, String)>,
    /// Idempotency keys: key → usage_id.
    keys: HashMap<String, i64>,
}

fn table_exists(conn: &Connection, name: &str) -> Outcome<bool> {
    Ok(conn
        .query_row("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?1", [name], |_| Ok(()))
        .optional()
        .ctx("sqlite_master")?
        .is_some())
}

fn snapshot(conn: &Connection) -> Outcome<Snapshot> {
    let mut s = Snapshot::default();
    for t in ["async_delegations", "retinue_children", "sessions", "delegation_child_usage"] {
        if !table_exists(conn, t)? {
            return Ok(s);
        }
    }
    if !table_exists(conn, "retinue_usage_keys")? {
        return Ok(s);
    }
    let mut stmt = conn
        .prepare(
            "SELECT delegation_id, state, retained, retained_at, tombstoned_at, children_json, \
             child_session_id, event_json, delivery_state FROM async_delegations",
        )
        .ctx("units")?;
    let rows = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                UnitRow {
                    state: r.get(1)?,
                    retained: r.get(2)?,
                    retained_at: r.get(3)?,
                    tombstoned_at: r.get(4)?,
                    children_json: r.get(5)?,
                    child_session_id: r.get(6)?,
                    event_json: r.get(7)?,
                    delivery_state: r.get(8)?,
                },
            ))
        })
        .ctx("units")?;
    for row in rows {
        let (id, unit) = row.ctx("unit row")?;
        s.units.insert(id, unit);
    }
    let mut stmt = conn
        .prepare(
            "SELECT delegation_id, child_index, subagent_id, child_session_id, retained_at, \
             tombstoned_at, tombstone_reason, resume_claim FROM retinue_children \
             ORDER BY delegation_id, child_index",
        )
        .ctx("children")?;
    let rows = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                ChildRow {
                    index: r.get(1)?,
                    subagent_id: r.get(2)?,
                    child_session_id: r.get(3)?,
                    retained_at: r.get(4)?,
                    tombstoned_at: r.get(5)?,
                    reason: r.get(6)?,
                    resume_claim: r.get(7)?,
                },
            ))
        })
        .ctx("children")?;
    for row in rows {
        let (id, child) = row.ctx("child row")?;
        s.children.entry(id).or_default().push(child);
    }
    let mut stmt = conn.prepare("SELECT id, source FROM sessions").ctx("sessions")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).ctx("sessions")?;
    for row in rows {
        let (id, source) = row.ctx("session row")?;
        s.sessions.insert(id, source);
    }
    let mut stmt = conn
        .prepare("SELECT id, parent_session_id, usage_json FROM delegation_child_usage")
        .ctx("ledger")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?)))).ctx("ledger")?;
    for row in rows {
        let (id, v) = row.ctx("ledger row")?;
        s.ledger.insert(id, v);
    }
    let mut stmt =
        conn.prepare("SELECT attribution_key, usage_id FROM retinue_usage_keys").ctx("keys")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).ctx("keys")?;
    for row in rows {
        let (k, id) = row.ctx("key row")?;
        s.keys.insert(k, id);
    }
    Ok(s)
}

fn pragma_lines(conn: &Connection, sql: &str) -> Outcome<Vec<String>> {
    let mut stmt = conn.prepare(sql).ctx(sql)?;
    let n = stmt.column_count();
    let rows = stmt
        .query_map([], |r| {
            let cells: Vec<String> = (0..n)
                .map(|i| r.get_ref(i).map(|v| format!("{v:?}")).unwrap_or_default())
                .collect();
            Ok(cells.join(" "))
        })
        .ctx(sql)?;
    rows.collect::<rusqlite::Result<Vec<_>>>().ctx(sql)
}

fn check_integrity(db: &Path) -> Outcome<()> {
    let conn = Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_WRITE)
        .ctx("raw open for integrity_check")?;
    conn.busy_timeout(Duration::from_secs(10)).ctx("busy_timeout")?;
    let integrity: String =
        conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).ctx("integrity_check")?;
    if integrity != "ok" {
        return Err(format!("integrity_check: {integrity}"));
    }
    let fk = pragma_lines(&conn, "PRAGMA foreign_key_check")?;
    if !fk.is_empty() {
        return Err(format!("foreign_key_check: {fk:?}"));
    }
    Ok(())
}

/// Structural invariants: no half-written unit, keys ↔ ledger rows.
fn check_structure(s: &Snapshot) -> Outcome<()> {
    let mut referenced: HashSet<String> = HashSet::new();
    for (id, unit) in &s.units {
        let manifest =
            parse_children_json(unit.children_json.as_deref(), unit.child_session_id.as_deref());
        let rows = s.children.get(id).map(Vec::as_slice).unwrap_or_default();
        if manifest.is_empty() {
            return Err(format!("half-written unit {id}: empty manifest"));
        }
        if rows.len() != manifest.len() {
            return Err(format!(
                "half-written unit {id}: {} child rows for {} manifest entries",
                rows.len(),
                manifest.len()
            ));
        }
        for (i, (row, m)) in rows.iter().zip(&manifest).enumerate() {
            if usize::try_from(row.index).ok() != Some(i)
                || row.subagent_id != m.subagent_id
                || row.child_session_id != m.session_id
            {
                return Err(format!("unit {id}: child row {i} differs from its manifest"));
            }
            if !s.sessions.contains_key(&m.session_id) {
                return Err(format!("half-written unit {id}: no session {}", m.session_id));
            }
            referenced.insert(m.session_id.clone());
        }
    }
    for id in s.children.keys() {
        if !s.units.contains_key(id) {
            return Err(format!("child rows of a missing unit {id}"));
        }
    }
    for (sid, source) in &s.sessions {
        if source == "delegate" && !referenced.contains(sid) {
            return Err(format!("half-written unit: child session {sid} has no unit"));
        }
    }
    let mut used = HashSet::new();
    for (key, usage_id) in &s.keys {
        if !s.ledger.contains_key(usage_id) {
            return Err(format!("key {key} points at missing ledger row {usage_id}"));
        }
        if !used.insert(*usage_id) {
            return Err(format!("ledger row {usage_id} has two keys"));
        }
    }
    if used.len() != s.ledger.len() {
        return Err(format!("{} ledger rows but {} keys", s.ledger.len(), used.len()));
    }
    Ok(())
}

/// The committed operations of the op log (complete lines only).
fn read_log(path: &Path) -> Outcome<Vec<Value>> {
    let text = match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("read op log: {e}")),
    };
    let complete = text.rfind('\n').map_or("", |at| &text[..at]);
    Ok(complete
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["op"] != "start")
        .collect())
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or_default()
}

fn child_of<'a>(s: &'a Snapshot, id: &str, index: i64) -> Option<&'a ChildRow> {
    s.children.get(id)?.iter().find(|c| c.index == index)
}

/// Every logged operation is present.
fn check_logged(s: &Snapshot, ops: &[Value]) -> Outcome<()> {
    for op in ops {
        let id = str_of(op, "id");
        let fail = |what: &str| Err(format!("logged {op} lost: {what}"));
        match str_of(op, "op") {
            "dispatch" => {
                if !s.units.contains_key(id) {
                    return fail("no unit");
                }
                let kids = op["children"].as_array().cloned().unwrap_or_default();
                for (i, kid) in kids.iter().enumerate() {
                    let index = i64::try_from(i).unwrap_or(-1);
                    let Some(row) = child_of(s, id, index) else { return fail("no child row") };
                    if kid[0] != row.subagent_id.as_str() || kid[1] != row.child_session_id.as_str()
                    {
                        return fail("child row differs");
                    }
                }
            }
            "complete" => {
                let Some(u) = s.units.get(id) else { return fail("no unit") };
                let status = str_of(op, "status");
                if u.state != status || (status == "completed") != (u.retained == Some(1)) {
                    return fail(&format!("state {} retained {:?}", u.state, u.retained));
                }
            }
            "retain" => {
                let Some(u) = s.units.get(id) else { return fail("no unit") };
                if u.retained != Some(1) || u.state != "running" {
                    return fail(&format!("state {} retained {:?}", u.state, u.retained));
                }
            }
            "tombstone" => {
                let index = op["index"].as_i64().unwrap_or(-1);
                let Some(c) = child_of(s, id, index) else { return fail("no child row") };
                if c.tombstoned_at.is_none() || c.reason.as_deref() != Some("manual") {
                    return fail("not tombstoned manually");
                }
            }
            "follow_up" => {
                let index = op["index"].as_i64().unwrap_or(-1);
                let Some(c) = child_of(s, id, index) else { return fail("no child row") };
                if c.resume_claim.as_deref() == Some(str_of(op, "token")) {
                    return fail("claim still held");
                }
            }
            "usage" => {
                let key = str_of(op, "key");
                let Some(row_id) = s.keys.get(key) else { return fail("no key") };
                let Some((parent, usage)) = s.ledger.get(row_id) else {
                    return fail("no ledger row");
                };
                let want = usage_of(op["n"].as_u64().unwrap_or(u64::MAX));
                let got: Value = serde_json::from_str(usage).unwrap_or(Value::Null);
                if parent != str_of(op, "parent") || got != want {
                    return fail("ledger row differs");
                }
            }
            other => return Err(format!("unknown logged op {other}")),
        }
    }
    Ok(())
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// Ledger totals equal the sum of the distinct rows, per parent.
fn check_totals(store: &retinue_store::Store, s: &Snapshot) -> Outcome<()> {
    let mut sums: BTreeMap<&str, (f64, f64, f64)> = BTreeMap::new();
    for (parent, usage) in s.ledger.values() {
        let u: Value = serde_json::from_str(usage).unwrap_or(Value::Null);
        let e = sums.entry(parent.as_str()).or_default();
        e.0 += num(&u["cost_usd"]);
        e.1 += num(&u["tokens"]["input"]);
        e.2 += num(&u["tokens"]["output"]);
    }
    for (parent, (cost, input, output)) in sums {
        let t = retinue_usage::load_child_usage_totals(store, parent).ctx("totals")?;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
        if !close(t.cost_usd, cost)
            || !close(t.input_tokens, input)
            || !close(t.output_tokens, output)
        {
            return Err(format!(
                "ledger totals of {parent} are {t:?}, rows sum to ({cost}, {input}, {output})"
            ));
        }
    }
    Ok(())
}

type Retained = BTreeMap<String, (UnitRow, Vec<ChildRow>)>;

fn retained_of(s: &Snapshot) -> Retained {
    s.units
        .iter()
        .filter(|(_, u)| u.retained == Some(1))
        .map(|(id, u)| (id.clone(), (u.clone(), s.children.get(id).cloned().unwrap_or_default())))
        .collect()
}

/// Checks the database in `dir` (`state.db`, `ops.log`) after a kill, then
/// runs restart recovery on it; returns (ops verified, units abandoned).
pub fn check(dir: &Path) -> Outcome<(usize, usize)> {
    let db = dir.join("state.db");
    let ops = read_log(&dir.join("ops.log"))?;
    if !db.exists() {
        return if ops.is_empty() { Ok((0, 0)) } else { Err("logged ops but no db".to_owned()) };
    }
    check_integrity(&db)?;
    let before = {
        let conn =
            Connection::open_with_flags(&db, OpenFlags::SQLITE_OPEN_READ_ONLY).ctx("raw open")?;
        snapshot(&conn)?
    };
    check_structure(&before)?;
    check_logged(&before, &ops)?;
    // Restart recovery, as the next process would run it.
    let abandoned_ids: Vec<&String> = before
        .units
        .iter()
        .filter(|(_, u)| u.retained.is_none() && (u.state == "running" || u.state == "finalizing"))
        .map(|(id, _)| id)
        .collect();
    let store = crate::open_store(&db, MAX_RETAINED)?;
    check_totals(&store, &before)?;
    let report = store.recover_abandoned_delegations(&retinue_core::ProcProbe);
    if let Some(e) = report.error {
        return Err(format!("recovery failed: {e}"));
    }
    {
        use retinue_core::Budgets;
        store
            .release_abandoned_reservations(&retinue_core::ProcProbe)
            .ctx("release reservations")?;
        let root = crate::worker::BUDGET_ROOT.to_owned();
        let status = store
            .budget_status(&root, std::slice::from_ref(&root), crate::worker::BUDGET)
            .ctx("budget status")?;
        if status.reserved.cost_usd > 0.0 {
            return Err(format!("reservations of a dead worker left open: {status:?}"));
        }
        if status.spent.cost_usd > 1.0 + 1e-9 {
            return Err(format!("the shared budget was overspent: {status:?}"));
        }
    }
    if report.abandoned != abandoned_ids.len() {
        return Err(format!(
            "recovery marked {} units unknown, {} were abandoned",
            report.abandoned,
            abandoned_ids.len()
        ));
    }
    drop(store);
    let after = {
        let conn =
            Connection::open_with_flags(&db, OpenFlags::SQLITE_OPEN_READ_ONLY).ctx("raw open")?;
        snapshot(&conn)?
    };
    for id in &abandoned_ids {
        let u = after.units.get(*id).ok_or_else(|| format!("abandoned unit {id} vanished"))?;
        let event: Value =
            serde_json::from_str(u.event_json.as_deref().unwrap_or("null")).unwrap_or(Value::Null);
        if u.state != "unknown"
            || u.delivery_state.as_deref() != Some("pending")
            || event["status"] != "unknown"
        {
            return Err(format!("abandoned unit {id} not marked unknown: {u:?}"));
        }
    }
    if retained_of(&before) != retained_of(&after) {
        return Err("recovery changed a retained unit or child".to_owned());
    }
    check_structure(&after)?;
    check_integrity(&db)?;
    Ok((ops.len(), abandoned_ids.len()))
}

/// Runs the crash harness.
pub fn run(opts: &CrashOptions) -> Outcome<CrashReport> {
    let start = Instant::now();
    std::fs::create_dir_all(&opts.dir).ctx("create the harness directory")?;
    let mut rng = Rng::new(opts.seed);
    let mut report = CrashReport { seed: opts.seed, ..CrashReport::default() };
    let err_path = opts.dir.join("worker.err");
    let min = u64::try_from(opts.min_delay.as_millis()).unwrap_or(u64::MAX);
    let max = u64::try_from(opts.max_delay.as_millis()).unwrap_or(u64::MAX).max(min);
    for kill in 0..opts.kills {
        let stderr =
            OpenOptions::new().create(true).append(true).open(&err_path).ctx("worker stderr")?;
        let mut child = Command::new(&opts.exe)
            .arg("worker")
            .arg("--db")
            .arg(opts.dir.join("state.db"))
            .arg("--log")
            .arg(opts.dir.join("ops.log"))
            .arg("--seed")
            .arg(rng.next_u64().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .spawn()
            .ctx("spawn the worker")?;
        std::thread::sleep(Duration::from_millis(rng.range(min, max)));
        if let Some(status) = child.try_wait().ctx("worker status")? {
            let err = std::fs::read_to_string(&err_path).unwrap_or_default();
            return Err(format!("worker exited by itself ({status}) before kill {kill}:\n{err}"));
        }
        child.kill().ctx("SIGKILL the worker")?;
        child.wait().ctx("reap the worker")?;
        report.kills += 1;
        let (ops, abandoned) = check(&opts.dir).map_err(|e| format!("after kill {kill}: {e}"))?;
        report.op_checks += ops as u64;
        report.ops_logged = ops;
        report.abandoned += abandoned;
    }
    let db = opts.dir.join("state.db");
    if db.exists() {
        let conn =
            Connection::open_with_flags(&db, OpenFlags::SQLITE_OPEN_READ_ONLY).ctx("raw open")?;
        let s = snapshot(&conn)?;
        report.units = s.units.len();
        report.retained_units = s.units.values().filter(|u| u.retained == Some(1)).count();
        report.retained_running =
            s.units.values().filter(|u| u.retained == Some(1) && u.state == "running").count();
        report.ledger_rows = s.ledger.len();
    }
    report.secs = crate::secs_since(start);
    Ok(report)
}
