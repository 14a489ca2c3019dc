//! PostgreSQL as if on 4 hosts: 4 processes × 8 threads, each process with
//! its own connection pool, claim deliveries, take resume claims and write
//! the ledger at once. Asserted: no error surfaced, every completion
//! delivered exactly once, resume claims never held twice at a time, no
//! ledger row or total lost. A second leg SIGKILLs a "host" mid-work and
//! recovers its units from another once its lease has expired.
//!
//! The processes are `retinue-pg-worker` (this crate's binary,
//! `retinue_torture::pg_worker`).
//!
//! Sizes: CI's by default; `RETINUE_PG_FULL=1` (`cargo xtask reliability
//! --backend pg --full`, a release build) runs the full size: 25× the rounds
//! and deliveries, and a killed host with 30 live units instead of 3.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use retinue_core::{Completion, RegistryRead, Retention, UnitDraft, UnitLifecycle, UsageLedger};
use retinue_store_pg::{PgOptions, PgStore};
use retinue_testkit::conformance::DeadPids;

use retinue_torture::pg_worker::{RESUME_TENANT, Size, THREADS, open, size, unit_draft};

const PROCS: usize = 4;
const RESUMABLE: usize = 6;

fn spawn_worker(schema: &str, mode: &str, out: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_retinue-pg-worker"))
        .env("RETINUE_PG_WORKER", mode)
        .env("RETINUE_PG_SCHEMA", schema)
        .env("RETINUE_PG_OUT", out)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn a worker process")
}

struct Scratch(String, String);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = PgStore::drop_schema(&self.0, &self.1);
    }
}

#[test]
fn four_hosts_contend_without_errors() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL contention test") else { return };
    let schema = format!("cont_{}", std::process::id());
    let _ = PgStore::drop_schema(&url, &schema);
    let _scratch = Scratch(url.clone(), schema.clone());
    let seed = open(&url, &schema, 30.0);
    let Size { rounds, deliveries, .. } = size();
    let mut expected = HashSet::new();
    for i in 0..deliveries {
        let id = seed.insert_unit(&unit_draft(&format!("d{i}"))).expect("insert");
        let done = Completion {
            delegation_id: id.clone(),
            status: "failed".into(),
            event: retinue_core::CompletionEvent::from_stored(
                &id,
                serde_json::json!({"delegation_id": id}),
            ),
            result: serde_json::json!({}),
            usage: None,
            background: true,
        };
        assert!(seed.persist_completion(&done).expect("complete"));
        expected.insert(id);
    }
    // The resumable units belong to another tenant than the stream of
    // insert+retain: the cap is per profile, so that stream never evicts them.
    let resumable: Vec<String> = (0..RESUMABLE)
        .map(|i| {
            let draft =
                UnitDraft { owner_profile: RESUME_TENANT.into(), ..unit_draft(&format!("r{i}")) };
            let id = seed.insert_unit(&draft).expect("insert");
            assert!(seed.retain_completed_delegation(&id, None).expect("retain"));
            id
        })
        .collect();
    let dir = tempfile_dir();
    let started = Instant::now();
    let children: Vec<(std::process::Child, PathBuf)> = (0..PROCS)
        .map(|p| {
            let out = dir.join(format!("proc-{p}.txt"));
            let mut cmd_out = spawn_worker_with(&schema, &out, &resumable);
            let _ = cmd_out.stdout.take();
            (cmd_out, out)
        })
        .collect();
    let mut lines = Vec::new();
    for (mut child, out) in children {
        let status = child.wait().expect("wait");
        assert!(status.success(), "a worker process failed: {status}");
        lines.extend(std::fs::read_to_string(&out).expect("report").lines().map(str::to_owned));
    }
    let elapsed = started.elapsed();
    let errors: Vec<&String> = lines.iter().filter(|l| l.starts_with("error")).collect();
    assert!(errors.is_empty(), "errors surfaced: {errors:?}");
    let delivered: Vec<&str> = lines.iter().filter_map(|l| l.strip_prefix("delivered ")).collect();
    let unique: HashSet<String> = delivered.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(delivered.len(), unique.len(), "a completion was delivered twice");
    assert_eq!(unique, expected, "every completion delivered exactly once");
    let mut holds: BTreeMap<String, Vec<(u128, u128)>> = BTreeMap::new();
    for l in lines.iter().filter_map(|l| l.strip_prefix("held ")) {
        let f: Vec<&str> = l.split(' ').collect();
        let (a, b) = (f[1].parse().expect("start"), f[2].parse().expect("end"));
        holds.entry(f[0].to_owned()).or_default().push((a, b));
    }
    for (unit, mut h) in holds.clone() {
        h.sort_unstable();
        assert!(
            h.windows(2).all(|w| w[0].1 <= w[1].0),
            "resume claim of {unit} held twice at once"
        );
    }
    // Another tenant's retains (each pruning to the cap) evicted none of them,
    // so every one was claimed and held.
    for unit in &resumable {
        assert!(
            matches!(seed.lookup(unit).expect("lookup"), retinue_core::Lookup::Addressable(_)),
            "{unit} of {RESUME_TENANT} was evicted by another profile's retains"
        );
        assert!(holds.contains_key(unit), "{unit} was never held");
    }
    let billed = lines.iter().filter(|l| *l == "billed").count();
    assert_eq!(billed, PROCS * THREADS * rounds);
    let rows = seed.usage_attributions("PAR").expect("rows");
    assert_eq!(rows.len(), billed, "no lost ledger row");
    let snap = seed.usage_totals_snapshot("PAR").expect("totals");
    let total = snap.maintained.cost_usd + snap.pending.len() as f64;
    assert!((total - billed as f64).abs() < 1e-9, "no lost total: {snap:?}");
    let ops = lines.len() + PROCS * THREADS * rounds.div_ceil(4);
    eprintln!(
        "contention: {PROCS} procs × {THREADS} threads × {rounds} rounds, {} ops ({} deliveries, \
         {} resume holds, {billed} ledger rows, 0 errors surfaced, each delivered exactly once, \
         no ledger row or total lost) in {:.2}s = {:.0} ops/s",
        ops,
        delivered.len(),
        holds.values().map(Vec::len).sum::<usize>(),
        elapsed.as_secs_f64(),
        ops as f64 / elapsed.as_secs_f64()
    );
}

fn spawn_worker_with(schema: &str, out: &Path, resumable: &[String]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_retinue-pg-worker"))
        .env("RETINUE_PG_WORKER", "contend")
        .env("RETINUE_PG_SCHEMA", schema)
        .env("RETINUE_PG_OUT", out)
        .env("RETINUE_PG_RESUMABLE", resumable.join(","))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn a worker process")
}

fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("retinue-pg-contention-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The worker rows of `schema`: (newest heartbeat, newest lease expiry).
fn worker_lease(url: &str, schema: &str) -> (f64, f64) {
    let mut client = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    // The schema name is ours (`kill_<pid>`), never input.
    let row = client
        .query_one(
            &format!(
                "SELECT COALESCE(max(heartbeat_at), 0), COALESCE(max(lease_expires_at), 0) \
                 FROM {schema}.retinue_workers WHERE pid = $1"
            ),
            &[&i64::from(WORKER_PID.load(std::sync::atomic::Ordering::Relaxed))],
        )
        .expect("read the worker's lease");
    (row.get(0), row.get(1))
}

/// One recovery between two readings of the server's clock.
fn timed_recovery(
    url: &str,
    store: &PgStore,
    probe: &DeadPids,
) -> (f64, retinue_core::RecoveryReport, f64) {
    let mut client = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    let mut now = || -> f64 {
        client
            .query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])
            .expect("the server's clock")
            .get(0)
    };
    let t0 = now();
    let report = store.recover_abandoned_delegations(probe);
    (t0, report, now())
}

static WORKER_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A killed host's units are recovered once its lease lapses, never while
/// it heartbeats. Leases run on the server's clock: "it heartbeats" is a
/// barrier on the worker's lease row (its heartbeat seen to advance twice),
/// and each recovery is judged against the server's time read just before
/// and just after it — one that ended before the lease's expiry must
/// recover nothing, one that began after it everything.
#[test]
fn a_killed_host_is_recovered_after_its_lease() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL contention test") else { return };
    let schema = format!("kill_{}", std::process::id());
    let _ = PgStore::drop_schema(&url, &schema);
    let _scratch = Scratch(url.clone(), schema.clone());
    let other_host = PgStore::open(
        &url,
        PgOptions { lease_secs: 30.0, ..PgOptions::default() }.with_schema(&schema),
    )
    .expect("open");
    let ready = tempfile_dir().join("ready");
    let _ = std::fs::remove_file(&ready);
    let mut child = spawn_worker(&schema, "hang", &ready);
    WORKER_PID.store(child.id(), std::sync::atomic::Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(60);
    // Barrier: ready, then two renewals of its lease observed.
    let mut beats = Vec::new();
    while beats.len() < 3 {
        assert!(Instant::now() < deadline, "the worker never heartbeated");
        if ready.exists() {
            let (beat, _) = worker_lease(&url, &schema);
            if beat > 0.0 && beats.last() != Some(&beat) {
                beats.push(beat);
            }
        }
        std::thread::yield_now();
    }
    let probe = DeadPids::default();
    let hung = size().hung_units;
    // Alive and heartbeating, checked after more than one lease of its
    // life: a recovery inside its current lease recovers nothing.
    let (_, expires) = worker_lease(&url, &schema);
    let (t0, report, t1) = timed_recovery(&url, &other_host, &probe);
    assert!(t0 <= expires, "too slow to check inside the lease");
    if t1 < expires {
        assert_eq!(report.abandoned, 0, "recovered while its lease held");
    }
    child.kill().expect("SIGKILL the worker");
    let _ = child.wait();
    // Dead: nothing before its (last) lease's expiry, everything after.
    let (_, expires) = worker_lease(&url, &schema);
    let mut recovered = 0;
    while recovered < hung {
        assert!(Instant::now() < deadline, "never recovered");
        let (t0, report, t1) = timed_recovery(&url, &other_host, &probe);
        assert_eq!(report.error, None);
        if t1 < expires {
            assert_eq!(report.abandoned, 0, "recovered before its lease lapsed");
        }
        recovered += report.abandoned;
        if t0 > expires {
            assert_eq!(recovered, hung, "not recovered after its lease lapsed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("kill: a SIGKILLed host's {hung} live units recovered after its lease lapsed");
    assert_eq!(other_host.recover_abandoned_delegations(&probe).abandoned, 0);
}
