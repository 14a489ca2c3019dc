//! PostgreSQL as if on 4 hosts: 4 processes × 8 threads, each process with
//! its own connection pool, claim deliveries, take resume claims and write
//! the ledger at once. Asserted: no error surfaced, every completion
//! delivered exactly once, resume claims never held twice at a time, no
//! ledger row or total lost. A second leg SIGKILLs a "host" mid-work and
//! recovers its units from another once its lease has expired.
//!
//! The processes are this test binary re-run with `RETINUE_PG_WORKER` set
//! (the `worker_process` test is a no-op otherwise).
//!
//! Sizes: CI's by default; `RETINUE_PG_FULL=1` (`cargo xtask reliability
//! --backend pg --full`, a release build) runs the full size: 25× the rounds
//! and deliveries, and a killed host with 30 live units instead of 3.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use retinue_core::{
    AttributionDraft, ChildManifest, Claims, Completion, DeliveryFilter, RegistryRead, ResumeClaim,
    Retention, TotalsUpdate, UnitDraft, UnitLifecycle, UsageLedger, UsageTotals,
};
use retinue_store_pg::{PgOptions, PgStore};
use retinue_testkit::conformance::DeadPids;

const PROCS: usize = 4;
const THREADS: usize = 8;
const RESUMABLE: usize = 6;

/// The size of a run: CI's, or the full one (`RETINUE_PG_FULL=1`).
struct Size {
    /// Rounds per thread (each: 2 delivery claims, a resume claim, a keyed ledger row).
    rounds: usize,
    /// Completions to deliver.
    deliveries: usize,
    /// Live units of the killed host.
    hung_units: usize,
}

fn size() -> Size {
    if std::env::var("RETINUE_PG_FULL").is_ok_and(|v| v == "1") {
        Size { rounds: 300, deliveries: 2_400, hung_units: 30 }
    } else {
        Size { rounds: 12, deliveries: 96, hung_units: 3 }
    }
}

fn now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

fn open(url: &str, schema: &str, lease: f64) -> PgStore {
    let opts = PgOptions { lease_secs: lease, ..PgOptions::default() }.with_schema(schema);
    PgStore::open(url, opts).expect("open")
}

fn spawn_worker(schema: &str, mode: &str, out: &Path) -> std::process::Child {
    let exe = std::env::current_exe().expect("test binary");
    Command::new(exe)
        .args(["--exact", "worker_process", "--nocapture", "--test-threads=1"])
        .env("RETINUE_PG_WORKER", mode)
        .env("RETINUE_PG_SCHEMA", schema)
        .env("RETINUE_PG_OUT", out)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn a worker process")
}

/// The profile of the resumable units (the other units have none).
const RESUME_TENANT: &str = "resume-tenant";

fn unit_draft(tag: &str) -> UnitDraft {
    UnitDraft {
        parent_session_id: Some("P".into()),
        children: vec![ChildManifest {
            subagent_id: format!("sa-0-{tag}"),
            session_id: format!("s-{tag}"),
            ..ChildManifest::default()
        }],
        ..UnitDraft::default()
    }
}

/// One "host": `THREADS` threads over one store (one pool), lines to `out`.
fn contend(url: &str, schema: &str, out: &Path, resumable: &[String]) {
    let store = Arc::new(open(url, schema, 30.0));
    let pid = std::process::id();
    let lines = std::sync::Mutex::new(Vec::<String>::new());
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (store, lines) = (store.clone(), &lines);
            s.spawn(move || {
                let mut mine = Vec::new();
                let mut note = |r: std::result::Result<String, retinue_core::Error>| match r {
                    Ok(line) if !line.is_empty() => mine.push(line),
                    Ok(_) => {}
                    Err(e) => mine.push(format!("error {e}")),
                };
                for i in 0..size().rounds {
                    // Deliveries: claim and acknowledge.
                    for _ in 0..2 {
                        note(store.claim_delivery(&DeliveryFilter::default()).and_then(|c| {
                            Ok(match c {
                                Some(c) if store.ack_delivery(&c.delegation_id, &c.token)? => {
                                    format!("delivered {}", c.delegation_id)
                                }
                                Some(c) => format!("error lost lease {}", c.delegation_id),
                                None => String::new(),
                            })
                        }));
                    }
                    // A resume claim, held a moment.
                    let unit = &resumable[(t + i) % resumable.len()];
                    note(store.claim_resume(unit, 0).and_then(|c| {
                        Ok(match c {
                            ResumeClaim::Claimed { token } => {
                                let start = now_nanos();
                                std::thread::sleep(Duration::from_millis(2));
                                let end = now_nanos();
                                if store.release_resume(unit, 0, &token)? {
                                    format!("held {unit} {start} {end}")
                                } else {
                                    format!("error claim lost {unit}")
                                }
                            }
                            _ => String::new(),
                        })
                    }));
                    // The ledger, keyed.
                    let draft = AttributionDraft {
                        parent_session_id: "PAR".into(),
                        usage: serde_json::json!({"cost_usd": 1.0}),
                        key: Some(format!("{pid}-{t}-{i}")),
                        ..AttributionDraft::default()
                    };
                    let delta = TotalsUpdate {
                        delta: UsageTotals { cost_usd: 1.0, ..UsageTotals::default() },
                        catch_up: None,
                    };
                    note(store.record_usage(&draft, &delta).map(|fresh| {
                        if fresh { "billed".to_owned() } else { "error key refused".to_owned() }
                    }));
                    // A new retained unit now and then (retain prunes).
                    if i % 4 == 0 {
                        note(store.insert_unit(&unit_draft(&format!("{pid}-{t}-{i}"))).and_then(
                            |id| {
                                store.retain_completed_delegation(&id, None).map(|_| String::new())
                            },
                        ));
                    }
                }
                lines.lock().expect("lock").extend(mine);
            });
        }
    });
    let text = lines.into_inner().expect("lock").join("\n");
    std::fs::write(out, text).expect("write the worker's report");
}

#[test]
fn worker_process() {
    let (Ok(mode), Ok(schema), Ok(out), Some(url)) = (
        std::env::var("RETINUE_PG_WORKER"),
        std::env::var("RETINUE_PG_SCHEMA"),
        std::env::var("RETINUE_PG_OUT"),
        std::env::var("RETINUE_PG_URL").ok(),
    ) else {
        return;
    };
    let out = PathBuf::from(out);
    match mode.as_str() {
        "contend" => {
            let resumable: Vec<String> = std::env::var("RETINUE_PG_RESUMABLE")
                .unwrap_or_default()
                .split(',')
                .map(str::to_owned)
                .collect();
            contend(&url, &schema, &out, &resumable);
        }
        "hang" => {
            let store = Arc::new(open(&url, &schema, 1.5));
            let _beat = store.spawn_heartbeat();
            for i in 0..size().hung_units {
                store.insert_unit(&unit_draft(&format!("hang-{i}"))).expect("insert");
            }
            std::fs::write(&out, "ready").expect("ready");
            // Mid-work until SIGKILLed (bounded, so a lost parent cannot leave it behind).
            std::thread::sleep(Duration::from_secs(120));
        }
        other => panic!("unknown worker mode {other}"),
    }
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
    let exe = std::env::current_exe().expect("test binary");
    Command::new(exe)
        .args(["--exact", "worker_process", "--nocapture", "--test-threads=1"])
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
