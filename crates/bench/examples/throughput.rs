//! The throughput benchmark: delegations per second under concurrent
//! writers, on one PostgreSQL server (team mode) and on one SQLite file.
//!
//! One delegation is what the product writes for one completed child:
//! dispatch (`insert_unit`: the unit, its one-child manifest and the child's
//! session), completion with retention (`persist_completion` of a
//! `completed` unit: recorded, retained and its profile pruned to the cap,
//! one transaction) and the parent's usage attribution (one keyed ledger
//! row, as a finalize records it). Its latency is the wall time of the
//! three calls.
//!
//! For each backend, cap shape and process count (1, 4 and 16), the
//! example re-runs itself as that many worker processes
//! (`RETINUE_THROUGHPUT_WORKER` set), each with its own store (its own
//! connection pool) and 8 threads; every thread has its own parent
//! session, every unit is in the one (default) profile. Cap shapes: `over`
//! (the default cap of 10: every retain prunes the units every other
//! writer shares) and `under` (a cap no run reaches: no retain needs to
//! prune). The workers start together on a go file; each thread runs
//! `--per-thread K` delegations (50; `--quick`: 10). SQLite: a fresh
//! `state.db` per run; PostgreSQL: a fresh scratch schema per run, dropped
//! afterwards. `--repeat N` runs each configuration N times.
//!
//! Printed: a markdown table, one row per configuration — the median over
//! its runs of delegations/s, p50/p90/p99/max latency, retries per 1,000
//! write operations (3 per delegation; PostgreSQL: transactions retried on
//! SQLSTATE 40001/40P01; SQLite: calls of the busy handler, each a probe of
//! a lock another process held) and errors, with the spread of the runs'
//! delegations/s and p99 ((max − min) / median) — then the knee of each
//! backend and shape. `--hermes-writer SITE` runs, beside every
//! configuration, a Python process writing sessions and messages through
//! hermes-agent's own `SessionDB` (`SITE` holds the unpacked wheel; SQLite
//! only) and prints what it saw: writes, failures, its latency.
//!
//! `cargo run --release -p retinue-bench --example throughput -- [--quick]
//! [--per-thread K] [--procs 1,4,16] [--backend sqlite|pg|both]
//! [--cap under|over|both] [--repeat N] [--hermes-writer SITE] [--json FILE]`.
//! The PostgreSQL rows need `RETINUE_PG_URL` (`cargo xtask pg-start` prints
//! its export line); without it `both` runs SQLite only. A failing operation
//! is counted in its row, not fatal; any error makes the exit status
//! non-zero. Nothing is asserted on time. `cargo xtask bench` runs it
//! (`--repeat 3`, both backends and shapes) and writes its table into
//! docs/benchmarks.md.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

// The seams' methods are called on `Backend`'s trait objects: no trait import.
use retinue_core::{
    Backend, ChildManifest, Completion, CompletionEvent, NewSession, RetentionPolicy, UnitDraft,
    UnitState,
};
use retinue_store::{Store, StoreOptions};
use retinue_store_pg::{PgOptions, PgStore};
use retinue_usage::AttributionDraft;
use serde_json::{Value, json};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Threads per worker process.
const THREADS: usize = 8;
/// Write operations (transactions) per delegation: dispatch, completion, attribution.
const OPS_PER_DELEGATION: u64 = 3;
/// Set in a worker process: `backend,process_index,per_thread`.
const WORKER_ENV: &str = "RETINUE_THROUGHPUT_WORKER";
/// The worker's store: the SQLite file, or the PostgreSQL schema.
const TARGET_ENV: &str = "RETINUE_THROUGHPUT_TARGET";
/// The file whose appearance starts every worker at once.
const GO_ENV: &str = "RETINUE_THROUGHPUT_GO";
/// How long a ready worker waits for the go file before giving up.
const GO_TIMEOUT: Duration = Duration::from_secs(300);
const GOAL: &str = "Summarise the throughput benchmark's workload.";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Sqlite,
    Pg,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Sqlite => "sqlite",
            Kind::Pg => "pg",
        }
    }

    fn parse(text: &str) -> Option<Kind> {
        match text {
            "sqlite" => Some(Kind::Sqlite),
            "pg" => Some(Kind::Pg),
            _ => None,
        }
    }
}

/// Each worker's pool keeps one idle connection per thread (it opens more on
/// demand; 16 × 8 = 128 in all).
fn pg_options(schema: &str) -> PgOptions {
    PgOptions { pool_size: THREADS, ..PgOptions::default() }.with_schema(schema)
}

fn epoch_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------- worker

/// The usage of one child, as its result reports it.
fn usage() -> Value {
    json!({"cost_usd": 0.0123, "tokens": {"input": 1200, "output": 340}})
}

/// The completion of unit `id` (one child, `completed`: it retains).
fn completion(id: &str, parent: &str, child_session: &str) -> Completion {
    let entry = json!({
        "task_index": 0,
        "status": "completed",
        "summary": "The workload is one dispatch, one completion and one attribution.",
        "child_session_id": child_session,
        "usage": usage(),
    });
    Completion {
        delegation_id: id.to_owned(),
        status: UnitState::Completed,
        event: CompletionEvent::new(id, Some(parent), UnitState::Completed, vec![entry.clone()]),
        result: json!({"delegation_id": id, "results": [entry]}),
        usage: Some(usage()),
        background: false,
    }
}

/// One delegation of `parent`; `seq` is unique within the configuration.
fn delegate(b: &Backend, parent: &str, seq: usize) -> Res<()> {
    let child_session = format!("tp-cs-{seq:08x}");
    let draft = UnitDraft {
        origin_session: parent.to_owned(),
        origin_session_id: parent.to_owned(),
        parent_session_id: Some(parent.to_owned()),
        owner_pid: Some(i64::from(std::process::id())),
        task: json!({"goal": GOAL, "is_batch": false}),
        children: vec![ChildManifest {
            subagent_id: format!("sa-0-{seq:08x}"),
            session_id: child_session.clone(),
            model: Some("bench/model".into()),
            role: Some("leaf".into()),
            goal: Some(GOAL.into()),
            ..ChildManifest::default()
        }],
        child_sessions: vec![NewSession {
            id: child_session.clone(),
            source: "delegate".into(),
            model: Some("bench/model".into()),
            model_config: Some(json!({"_delegate_from": parent})),
            parent_session_id: Some(parent.to_owned()),
            ..NewSession::default()
        }],
        ..UnitDraft::default()
    };
    let id = b.registry.insert_unit(&draft)?;
    if !b.registry.persist_completion(&completion(&id, parent, &child_session))? {
        return Err(format!("{id}: the completion changed nothing").into());
    }
    let attribution = AttributionDraft {
        parent_session_id: parent.to_owned(),
        parent_turn_id: String::new(),
        child_session_id: child_session,
        usage: usage(),
        aggregate: None,
        key: Some(format!("{id}:0:0")),
    };
    if !retinue_usage::record_child_usage_attribution(&*b.ledger, &attribution)? {
        return Err(format!("{id}: the attribution's key was refused").into());
    }
    Ok(())
}

/// What one thread measured.
#[derive(Default)]
struct ThreadOut {
    latencies_us: Vec<u64>,
    errors: u64,
    first_error: Option<String>,
}

fn run_thread(b: &Backend, parent: &str, slot: usize, per_thread: usize) -> ThreadOut {
    let mut out =
        ThreadOut { latencies_us: Vec::with_capacity(per_thread), ..ThreadOut::default() };
    for i in 0..per_thread {
        let started = Instant::now();
        match delegate(b, parent, slot * per_thread + i) {
            Ok(()) => out.latencies_us.push(micros(started.elapsed())),
            Err(e) => {
                out.errors += 1;
                if out.first_error.is_none() {
                    out.first_error = Some(e.to_string());
                }
            }
        }
    }
    out
}

fn wait_for(go: &Path) -> bool {
    let deadline = Instant::now() + GO_TIMEOUT;
    while !go.exists() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// A worker process: opens its store, says `ready`, waits for the go file,
/// runs `THREADS` threads and prints one JSON line with what they measured.
fn worker(spec: &str) -> Res<()> {
    let mut fields = spec.split(',');
    let kind = fields.next().and_then(Kind::parse).ok_or("bad backend")?;
    let proc_index: usize =
        fields.next().and_then(|s| s.parse().ok()).ok_or("bad process index")?;
    let per_thread: usize =
        fields.next().and_then(|s| s.parse().ok()).ok_or("bad delegations per thread")?;
    let max_retained: u32 = fields.next().and_then(|s| s.parse().ok()).ok_or("bad cap")?;
    let retention = RetentionPolicy { max_retained, ..RetentionPolicy::default() };
    let target = std::env::var_os(TARGET_ENV).ok_or("no target")?;
    let go = PathBuf::from(std::env::var_os(GO_ENV).ok_or("no go file")?);
    let (backend, pg, sqlite) = match kind {
        Kind::Sqlite => {
            let opts = StoreOptions::default().with_retention(retention);
            let store = Arc::new(Store::open(PathBuf::from(target), opts)?);
            (Backend::of(store.clone()), None, Some(store))
        }
        Kind::Pg => {
            let url = std::env::var("RETINUE_PG_URL").map_err(|_| "RETINUE_PG_URL is unset")?;
            let schema = target.into_string().map_err(|_| "the schema name is not UTF-8")?;
            let opts = PgOptions { retention, ..pg_options(&schema) };
            let store = Arc::new(PgStore::open(&url, opts)?);
            (Backend::of(store.clone()), Some(store), None)
        }
    };
    if !completion("deleg_check", "p", "cs").plan(0.0).retains {
        return Err("the benchmark's completion would not retain".into());
    }
    // Untimed: each thread's parent session.
    let parents: Vec<String> =
        (0..THREADS).map(|t| format!("tp-parent-{proc_index}-{t}")).collect();
    for parent in &parents {
        backend.sessions.create_session(&NewSession {
            id: parent.clone(),
            source: "cli".into(),
            ..NewSession::default()
        })?;
    }
    // PostgreSQL: transactions retried on 40001/40P01; SQLite: busy-handler
    // waits (the lock held by another process).
    let retries = || {
        pg.as_ref()
            .map(|s| s.serialization_retries())
            .or_else(|| sqlite.as_ref().map(|s| s.busy_probes()))
            .unwrap_or(0)
    };
    let before = retries();
    let abort = AtomicBool::new(false);
    let barrier = Barrier::new(THREADS + 1);
    let (started, outs, start_us, end_us) = std::thread::scope(|s| {
        let handles: Vec<_> = parents
            .iter()
            .enumerate()
            .map(|(t, parent)| {
                let (backend, barrier, abort) = (&backend, &barrier, &abort);
                s.spawn(move || {
                    barrier.wait();
                    if abort.load(Ordering::SeqCst) {
                        return ThreadOut::default();
                    }
                    run_thread(backend, parent, proc_index * THREADS + t, per_thread)
                })
            })
            .collect();
        println!("ready");
        let _ = std::io::stdout().flush();
        let started = wait_for(&go);
        abort.store(!started, Ordering::SeqCst);
        barrier.wait();
        let start_us = epoch_us();
        let outs: Vec<ThreadOut> = handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| ThreadOut {
                    errors: count(per_thread),
                    first_error: Some("a benchmark thread panicked".into()),
                    ..ThreadOut::default()
                })
            })
            .collect();
        (started, outs, start_us, epoch_us())
    });
    if !started {
        return Err(format!("no go file after {} s", GO_TIMEOUT.as_secs()).into());
    }
    let retried = retries().saturating_sub(before);
    let errors: u64 = outs.iter().map(|o| o.errors).sum();
    let first_error = outs.iter().find_map(|o| o.first_error.clone());
    let latencies: Vec<u64> = outs.into_iter().flat_map(|o| o.latencies_us).collect();
    let report = json!({
        "proc": proc_index,
        "delegations": latencies.len(),
        "errors": errors,
        "first_error": first_error,
        "start_us": start_us,
        "end_us": end_us,
        "retries": retried,
        "latencies_us": latencies,
    });
    println!("{report}");
    std::io::stdout().flush()?;
    Ok(())
}

// ---------------------------------------------------------------- parent

/// Whether every retain prunes (the default cap of 10 live units: past the
/// first ten delegations each retain tombstones one) or none does (a cap
/// above every unit the run writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cap {
    Under,
    Over,
}

impl Cap {
    fn name(self) -> &'static str {
        match self {
            Cap::Under => "under",
            Cap::Over => "over",
        }
    }

    fn max_retained(self) -> u32 {
        match self {
            Cap::Under => 10_000_000,
            Cap::Over => RetentionPolicy::default().max_retained,
        }
    }
}

/// One run of one configuration.
#[derive(Clone)]
struct Run {
    delegations: u64,
    errors: u64,
    wall_s: f64,
    per_s: f64,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    retries_per_1000: f64,
    /// What a hermes writer beside the run measured, when one ran.
    hermes: Option<Value>,
}

/// One configuration's figures: the median of its runs, and every run.
struct Row {
    backend: Kind,
    cap: Cap,
    procs: usize,
    per_thread: usize,
    median: Run,
    runs: Vec<Run>,
}

/// The median of `values` (the lower middle of an even count).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len().saturating_sub(1) / 2).copied().unwrap_or(f64::NAN)
}

impl Row {
    fn of(backend: Kind, cap: Cap, procs: usize, per_thread: usize, runs: Vec<Run>) -> Row {
        let pick = |f: fn(&Run) -> f64| median(&mut runs.iter().map(f).collect::<Vec<f64>>());
        let median = Run {
            delegations: runs.iter().map(|r| r.delegations).sum::<u64>() / count(runs.len().max(1)),
            errors: runs.iter().map(|r| r.errors).sum(),
            wall_s: pick(|r| r.wall_s),
            per_s: pick(|r| r.per_s),
            p50_ms: pick(|r| r.p50_ms),
            p90_ms: pick(|r| r.p90_ms),
            p99_ms: pick(|r| r.p99_ms),
            max_ms: pick(|r| r.max_ms),
            retries_per_1000: pick(|r| r.retries_per_1000),
            hermes: None,
        };
        Row { backend, cap, procs, per_thread, median, runs }
    }

    /// `min–max` of `f` over the runs.
    fn spread(&self, f: fn(&Run) -> f64) -> String {
        let v: Vec<f64> = self.runs.iter().map(f).collect();
        let (lo, hi) = v
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        if self.runs.len() < 2 { "-".to_owned() } else { format!("{lo:.1}–{hi:.1}") }
    }
}

/// A running worker and its stdout.
struct Worker {
    child: Child,
    out: BufReader<ChildStdout>,
}

/// The workers of one configuration; any still running when this is
/// dropped (a configuration that failed half-way) are killed.
struct Workers(Vec<Worker>);

impl Workers {
    fn push(&mut self, mut child: Child) -> Res<()> {
        if let Some(out) = child.stdout.take() {
            self.0.push(Worker { child, out: BufReader::new(out) });
            Ok(())
        } else {
            let _ = child.kill();
            let _ = child.wait();
            Err("a worker's stdout was not captured".into())
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for w in &mut self.0 {
            if matches!(w.child.try_wait(), Ok(None)) {
                let _ = w.child.kill();
                let _ = w.child.wait();
            }
        }
    }
}

/// A scratch schema, dropped with this guard.
struct Scratch {
    url: String,
    schema: String,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = PgStore::drop_schema(&self.url, &self.schema) {
            eprintln!("could not drop the scratch schema {}: {e}", self.schema);
        }
    }
}

fn scratch_name(procs: usize) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("tp_{procs}_{}_{nanos:08x}", std::process::id())
}

fn next_line(out: &mut BufReader<ChildStdout>) -> Res<Option<String>> {
    let mut line = String::new();
    if out.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    Ok(Some(line.trim_end().to_owned()))
}

/// Nearest-rank percentile of sorted µs, in ms.
fn percentile_ms(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1000.0
}

/// Runs `procs` workers × `THREADS` threads against a fresh store; with
/// `hermes` (an unpacked hermes-agent wheel), hermes's own `SessionDB`
/// writes to the same SQLite file throughout (crates/bench/examples/hermes_writer.py).
fn run_config(
    kind: Kind,
    cap: Cap,
    procs: usize,
    per_thread: usize,
    url: Option<&str>,
    hermes: Option<&Path>,
) -> Res<Run> {
    let dir = tempfile::tempdir()?;
    let go = dir.path().join("go");
    let (target, _scratch): (OsString, Option<Scratch>) = match kind {
        Kind::Sqlite => {
            let path = dir.path().join("state.db");
            // Created (and migrated) once, before any worker opens it.
            drop(Store::open(&path, StoreOptions::default())?);
            (path.into_os_string(), None)
        }
        Kind::Pg => {
            let url = url.ok_or("RETINUE_PG_URL is unset")?;
            let schema = scratch_name(procs);
            let scratch = Scratch { url: url.to_owned(), schema: schema.clone() };
            // Migrated once, before the workers open it.
            drop(PgStore::open(url, pg_options(&schema))?);
            (schema.into(), Some(scratch))
        }
    };
    let exe = std::env::current_exe()?;
    let mut workers = Workers(Vec::with_capacity(procs));
    for p in 0..procs {
        let child = Command::new(exe.as_os_str())
            .env(WORKER_ENV, format!("{},{p},{per_thread},{}", kind.name(), cap.max_retained()))
            .env(TARGET_ENV, target.as_os_str())
            .env(GO_ENV, go.as_os_str())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()?;
        workers.push(child)?;
    }
    for (p, w) in workers.0.iter_mut().enumerate() {
        match next_line(&mut w.out)? {
            Some(line) if line == "ready" => {}
            other => {
                return Err(format!("worker {p} did not get ready ({other:?}); see above").into());
            }
        }
    }
    let mut writer = match (hermes, kind) {
        (Some(site), Kind::Sqlite) => Some(HermesWriter::start(site, Path::new(&target), &go)?),
        _ => None,
    };
    let go_us = epoch_us();
    std::fs::write(go.as_path(), b"go")?;
    let (mut latencies, mut errors, mut retries, mut end_us) =
        (Vec::<u64>::new(), 0u64, 0u64, go_us);
    for (p, w) in workers.0.iter_mut().enumerate() {
        let line = next_line(&mut w.out)?.ok_or_else(|| format!("worker {p}: no report"))?;
        let report: Value = serde_json::from_str(&line)?;
        let status = w.child.wait()?;
        if !status.success() {
            return Err(format!("worker {p} failed: {status}").into());
        }
        let worker_errors = report["errors"].as_u64().unwrap_or(0);
        if let Some(e) = report["first_error"].as_str() {
            eprintln!("  worker {p}: {worker_errors} error(s), the first: {e}");
        }
        errors += worker_errors;
        retries += report["retries"].as_u64().unwrap_or(0);
        end_us = end_us.max(report["end_us"].as_u64().unwrap_or(go_us));
        let times = report["latencies_us"].as_array().ok_or("a report without latencies")?;
        latencies.extend(times.iter().filter_map(Value::as_u64));
    }
    let hermes = writer.as_mut().map(HermesWriter::stop).transpose()?;
    latencies.sort_unstable();
    let delegations = count(latencies.len());
    let wall_s = end_us.saturating_sub(go_us) as f64 / 1e6;
    let ops = (delegations + errors) * OPS_PER_DELEGATION;
    Ok(Run {
        delegations,
        errors,
        wall_s,
        per_s: if wall_s > 0.0 { delegations as f64 / wall_s } else { 0.0 },
        p50_ms: percentile_ms(&latencies, 0.50),
        p90_ms: percentile_ms(&latencies, 0.90),
        p99_ms: percentile_ms(&latencies, 0.99),
        max_ms: latencies.last().map_or(f64::NAN, |us| *us as f64 / 1000.0),
        retries_per_1000: if ops > 0 { retries as f64 * 1000.0 / ops as f64 } else { 0.0 },
        hermes,
    })
}

/// hermes-agent's own writer (`hermes_state.SessionDB`: a session and a
/// message per write, its 1 s busy timeout and jittered retries) on the
/// benchmark's SQLite file, from the go file until told to stop.
struct HermesWriter {
    child: Child,
    out: BufReader<ChildStdout>,
    stop: PathBuf,
}

impl HermesWriter {
    fn start(site: &Path, db: &Path, go: &Path) -> Res<HermesWriter> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/hermes_writer.py");
        let stop = go.with_file_name("stop");
        let mut child = Command::new("python3")
            .args(["-S", "-B"])
            .arg(script)
            .arg(db)
            .arg(go)
            .arg(&stop)
            .env("PYTHONPATH", site)
            .env("HERMES_HOME", db.parent().unwrap_or(db))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()?;
        let Some(out) = child.stdout.take() else {
            let _ = child.kill();
            return Err("the hermes writer's stdout was not captured".into());
        };
        let mut out = BufReader::new(out);
        match next_line(&mut out)? {
            Some(line) if line == "ready" => Ok(HermesWriter { child, out, stop }),
            other => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("the hermes writer did not get ready ({other:?})").into())
            }
        }
    }

    fn stop(&mut self) -> Res<Value> {
        std::fs::write(&self.stop, b"stop")?;
        let line = next_line(&mut self.out)?.ok_or("the hermes writer printed no report")?;
        let status = self.child.wait()?;
        if !status.success() {
            return Err(format!("the hermes writer failed: {status}").into());
        }
        Ok(serde_json::from_str(&line)?)
    }
}

impl Drop for HermesWriter {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The knee of `kind` with `cap`: the first process count from which the
/// next adds less than 10% delegations/s.
fn knee(kind: Kind, cap: Cap, rows: &[Row]) -> String {
    let mine: Vec<&Row> = rows.iter().filter(|r| r.backend == kind && r.cap == cap).collect();
    let label = format!("{}, cap {}", kind.name(), cap.name());
    for pair in mine.windows(2) {
        let (a, b) = (&pair[0].median, &pair[1].median);
        if b.per_s < a.per_s * 1.10 {
            let gain = if a.per_s > 0.0 { (b.per_s / a.per_s - 1.0) * 100.0 } else { 0.0 };
            return format!(
                "Knee ({label}): {} × {THREADS}; {} × {THREADS} changes delegations/s by \
                 {gain:+.1}% (less than +10%).",
                pair[0].procs, pair[1].procs
            );
        }
    }
    match mine.last() {
        Some(last) => format!("Knee ({label}): no knee up to {} × {THREADS}.", last.procs),
        None => format!("Knee ({label}): no configuration ran."),
    }
}

struct Args {
    per_thread: usize,
    procs: Vec<usize>,
    backend: String,
    caps: Vec<Cap>,
    repeat: usize,
    hermes: Option<PathBuf>,
    json: Option<PathBuf>,
}

const USAGE: &str = "usage: throughput [--quick] [--per-thread K] [--procs 1,4,16] \
                     [--backend sqlite|pg|both] [--cap under|over|both] [--repeat N] \
                     [--hermes-writer SITE] [--json FILE]";

fn value_of(it: &mut std::slice::Iter<'_, String>, flag: &str) -> Res<String> {
    it.next().cloned().ok_or_else(|| format!("{flag} needs a value ({USAGE})").into())
}

fn number(it: &mut std::slice::Iter<'_, String>, flag: &str) -> Res<usize> {
    let v = value_of(it, flag)?;
    Ok(v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"))?)
}

fn parse_args() -> Res<Args> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut quick, mut per_thread, mut json, mut hermes) = (false, None, None, None);
    let (mut procs, mut backend) = (vec![1, 4, 16], "both".to_owned());
    let (mut caps, mut repeat) = (vec![Cap::Over, Cap::Under], 1);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--per-thread" => per_thread = Some(number(&mut it, arg)?),
            "--repeat" => repeat = number(&mut it, arg)?,
            "--procs" => {
                let v = value_of(&mut it, arg)?;
                procs = v
                    .split(',')
                    .map(|s| s.trim().parse::<usize>())
                    .collect::<Result<Vec<usize>, _>>()
                    .map_err(|e| format!("--procs {v}: {e}"))?;
            }
            "--backend" => backend = value_of(&mut it, arg)?,
            "--cap" => {
                caps = match value_of(&mut it, arg)?.as_str() {
                    "under" => vec![Cap::Under],
                    "over" => vec![Cap::Over],
                    "both" => vec![Cap::Over, Cap::Under],
                    other => return Err(format!("--cap {other}: under, over or both").into()),
                }
            }
            "--hermes-writer" => hermes = Some(PathBuf::from(value_of(&mut it, arg)?)),
            "--json" => json = Some(PathBuf::from(value_of(&mut it, arg)?)),
            other => return Err(format!("unknown argument `{other}` ({USAGE})").into()),
        }
    }
    procs.sort_unstable();
    procs.dedup();
    if procs.is_empty() || procs.contains(&0) {
        return Err("--procs: process counts are positive".into());
    }
    let per_thread = per_thread.unwrap_or(if quick { 10 } else { 50 });
    if per_thread == 0 || repeat == 0 {
        return Err("--per-thread and --repeat: at least 1".into());
    }
    Ok(Args { per_thread, procs, backend, caps, repeat, hermes, json })
}

fn run_json(r: &Run) -> Value {
    json!({
        "delegations": r.delegations,
        "errors": r.errors,
        "wall_s": r.wall_s,
        "per_s": r.per_s,
        "p50_ms": r.p50_ms,
        "p90_ms": r.p90_ms,
        "p99_ms": r.p99_ms,
        "max_ms": r.max_ms,
        "retries_per_1000": r.retries_per_1000,
        "hermes": r.hermes,
    })
}

fn print_table(rows: &[Row]) {
    println!(
        "\n| backend | cap | processes × threads | runs | delegations/s | spread | p50 ms \
         | p90 ms | p99 ms | p99 spread | max ms | retries / 1,000 ops | errors |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let m = &r.median;
        println!(
            "| {} | {} | {} × {THREADS} | {} | {:.1} | {} | {:.2} | {:.2} | {:.2} | {} | {:.2} \
             | {:.1} | {} |",
            r.backend.name(),
            r.cap.name(),
            r.procs,
            r.runs.len(),
            m.per_s,
            r.spread(|x| x.per_s),
            m.p50_ms,
            m.p90_ms,
            m.p99_ms,
            r.spread(|x| x.p99_ms),
            m.max_ms,
            m.retries_per_1000,
            m.errors
        );
    }
    for r in rows {
        for (i, run) in r.runs.iter().enumerate() {
            if let Some(h) = &run.hermes {
                println!(
                    "hermes writer beside {} {} × {THREADS}, run {}: {h}",
                    r.backend.name(),
                    r.procs,
                    i + 1
                );
            }
        }
    }
}

fn run() -> Res<bool> {
    let args = parse_args()?;
    let url = std::env::var("RETINUE_PG_URL").ok().filter(|u| !u.trim().is_empty());
    let backends = match (args.backend.as_str(), url.is_some()) {
        ("sqlite", _) => vec![Kind::Sqlite],
        ("pg", true) => vec![Kind::Pg],
        ("pg", false) => return Err("--backend pg needs RETINUE_PG_URL".into()),
        ("both", true) => vec![Kind::Sqlite, Kind::Pg],
        ("both", false) => {
            eprintln!("RETINUE_PG_URL is unset: SQLite only (`cargo xtask pg-start`)");
            vec![Kind::Sqlite]
        }
        (other, _) => return Err(format!("--backend {other}: sqlite, pg or both").into()),
    };
    let mut rows = Vec::new();
    let mut failed = false;
    for &kind in &backends {
        for &cap in &args.caps {
            for &procs in &args.procs {
                let mut runs = Vec::new();
                for i in 0..args.repeat {
                    eprintln!(
                        "{}, cap {}: {procs} process(es) × {THREADS} threads × {} delegations \
                         (run {} of {}) …",
                        kind.name(),
                        cap.name(),
                        args.per_thread,
                        i + 1,
                        args.repeat
                    );
                    let hermes = args.hermes.as_deref();
                    match run_config(kind, cap, procs, args.per_thread, url.as_deref(), hermes) {
                        Ok(run) => {
                            failed |= run.errors > 0;
                            runs.push(run);
                        }
                        Err(e) => {
                            eprintln!("{} with {procs} process(es) failed: {e}", kind.name());
                            failed = true;
                        }
                    }
                }
                if !runs.is_empty() {
                    rows.push(Row::of(kind, cap, procs, args.per_thread, runs));
                }
            }
        }
    }
    print_table(&rows);
    println!();
    for &kind in &backends {
        for &cap in &args.caps {
            println!("{}", knee(kind, cap, &rows));
        }
    }
    if let Some(path) = &args.json {
        let doc: Vec<Value> = rows
            .iter()
            .map(|r| {
                let mut v = run_json(&r.median);
                v["backend"] = json!(r.backend.name());
                v["cap"] = json!(r.cap.name());
                v["processes"] = json!(r.procs);
                v["threads"] = json!(THREADS);
                v["per_thread"] = json!(r.per_thread);
                v["runs"] = r.runs.iter().map(run_json).collect();
                v
            })
            .collect();
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(!failed)
}

fn main() -> ExitCode {
    if let Some(spec) = std::env::var_os(WORKER_ENV) {
        return match worker(&spec.to_string_lossy()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("throughput worker ({}): {e}", spec.to_string_lossy());
                ExitCode::FAILURE
            }
        };
    }
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("throughput: errors occurred (see the errors column and above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("throughput: {e}");
            ExitCode::FAILURE
        }
    }
}
