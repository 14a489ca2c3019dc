//! The PostgreSQL contention harness's worker (`retinue-pg-worker`): one
//! "host" of `cargo xtask reliability --backend pg` — `THREADS` threads over
//! one store (its own connection pool) claiming deliveries, taking resume
//! claims, writing the ledger and retaining units (`contend`), or a host
//! that inserts live units and hangs until it is SIGKILLed (`hang`). The
//! test `pg_contention` (tests/it) starts several and checks their reports.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use retinue_core::{
    AttributionDraft, ChildManifest, Claims, DeliveryFilter, ResumeClaim, TotalsUpdate, UnitDraft,
    UnitLifecycle, UsageLedger, UsageTotals,
};
use retinue_store_pg::{PgOptions, PgStore};

/// Threads per worker process.
pub const THREADS: usize = 8;

/// The size of a run: CI's, or the full one (`RETINUE_PG_FULL=1`).
pub struct Size {
    /// Rounds per thread (each: 2 delivery claims, a resume claim, a keyed ledger row).
    pub rounds: usize,
    /// Completions to deliver.
    pub deliveries: usize,
    /// Live units of the killed host.
    pub hung_units: usize,
}

/// This run's size.
pub fn size() -> Size {
    if std::env::var("RETINUE_PG_FULL").is_ok_and(|v| v == "1") {
        Size { rounds: 300, deliveries: 2_400, hung_units: 30 }
    } else {
        Size { rounds: 12, deliveries: 96, hung_units: 3 }
    }
}

/// Wall-clock nanoseconds (claims' hold intervals across processes).
pub fn now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

/// The store on `schema` with a worker lease of `lease` seconds.
pub fn open(url: &str, schema: &str, lease: f64) -> PgStore {
    let opts = PgOptions { lease_secs: lease, ..PgOptions::default() }.with_schema(schema);
    PgStore::open(url, opts).expect("open")
}

/// The profile of the resumable units (the other units have none).
pub const RESUME_TENANT: &str = "resume-tenant";

/// A one-child unit tagged `tag`.
pub fn unit_draft(tag: &str) -> UnitDraft {
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
pub fn contend(url: &str, schema: &str, out: &Path, resumable: &[String]) {
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

/// The worker's entry point: its mode, schema and report file from
/// `RETINUE_PG_WORKER`, `RETINUE_PG_SCHEMA`, `RETINUE_PG_OUT`, the server
/// from `RETINUE_PG_URL`; `false` when any is missing.
pub fn run_from_env() -> bool {
    let (Ok(mode), Ok(schema), Ok(out), Some(url)) = (
        std::env::var("RETINUE_PG_WORKER"),
        std::env::var("RETINUE_PG_SCHEMA"),
        std::env::var("RETINUE_PG_OUT"),
        std::env::var("RETINUE_PG_URL").ok(),
    ) else {
        return false;
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
    true
}
