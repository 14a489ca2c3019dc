//! The backend conformance suite (and PostgreSQL-only cases) against a real
//! server: `RETINUE_PG_URL`, which `cargo xtask test` sets (starting a
//! throwaway cluster). Without it the tests fail under CI or
//! `RETINUE_REQUIRE_PG`, and skip loudly otherwise.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use retinue_config::{DelegationConfig, LoadedConfig};
use retinue_core::{
    ChildManifest, Lookup, ManualClock, RegistryRead, Retention, TombstoneReason, Unaddressable,
    UnitDraft, UnitLifecycle,
};
use retinue_store_pg::{PgOptions, PgStore, WORKER_LEASE_SECS};
use retinue_testkit::T0;
use retinue_testkit::conformance::{DeadPids, SuiteBackend};

static SEQ: AtomicU32 = AtomicU32::new(0);

fn scratch_schema() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("t_{}_{}_{nanos}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed))
}

/// Drops the scratch schema when the backend is dropped.
struct Scratch {
    url: String,
    schema: String,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = PgStore::drop_schema(&self.url, &self.schema) {
            eprintln!("could not drop schema {}: {e}", self.schema);
        }
    }
}

fn open(url: &str, schema: &str, clock: &Arc<ManualClock>, d: &DelegationConfig) -> PgStore {
    let opts = PgOptions::default()
        .with_clock(clock.clone())
        .with_schema(schema)
        .with_retention(d.clone().retention());
    PgStore::open(url, opts).expect("open the PostgreSQL store")
}

fn pg_backend(url: &str, d: DelegationConfig) -> SuiteBackend {
    let schema = scratch_schema();
    let clock = Arc::new(ManualClock::new(T0));
    let store = Arc::new(open(url, &schema, &clock, &d));
    let (url2, schema2, clock2) = (url.to_owned(), schema.clone(), clock.clone());
    let (url3, schema3, clock3) = (url.to_owned(), schema.clone(), clock.clone());
    let (url4, schema4, worker) = (url.to_owned(), schema.clone(), store.worker_id().to_owned());
    let (url5, schema5) = (url.to_owned(), schema.clone());
    SuiteBackend {
        seams: retinue_core::Backend::of(store),
        clock,
        probe: Arc::new(DeadPids::default()),
        owner_pid: Some(3_999_999),
        // The worker stops renewing; its lease lapses (on the server's
        // clock, the only one leases are judged by).
        owner_died: Box::new(move || expire_lease(&url4, &schema4, &worker, 1.0)),
        claims_expire: Box::new(move || expire_claims(&url5, &schema5)),
        reopen: Box::new(move || Arc::new(open(&url2, &schema2, &clock2, &d))),
        open_as: Box::new(move |profile, d| {
            let opts = PgOptions::default()
                .with_clock(clock3.clone())
                .with_schema(&schema3)
                .with_retention(d.retention())
                .with_profile(profile);
            Arc::new(PgStore::open(&url3, opts).expect("open the PostgreSQL store"))
        }),
        guard: Box::new(Scratch { url: url.to_owned(), schema }),
    }
}

/// Moves `worker`'s lease to `ago` seconds before the server's now, as if
/// it had stopped renewing that long ago.
fn expire_lease(url: &str, schema: &str, worker: &str, ago: f64) {
    let mut c = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    // The schema is ours (`scratch_schema`), never input.
    let n = c
        .execute(
            &format!(
                "UPDATE {schema}.retinue_workers \
                 SET lease_expires_at = extract(epoch FROM clock_timestamp())::float8 - $2 \
                 WHERE worker_id = $1"
            ),
            &[&worker, &ago],
        )
        .expect("expire the lease");
    assert_eq!(n, 1, "no lease row for worker {worker}");
}

/// Moves every delivery and resume claim of `schema` one lease (and a
/// second) into the past on the server's clock.
fn expire_claims(url: &str, schema: &str) {
    let mut c = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    let back = retinue_core::LEASE_SECS + 1.0;
    // The schema is ours (`scratch_schema`), never input.
    c.execute(
        &format!(
            "UPDATE {schema}.async_delegations SET delivery_claimed_at = delivery_claimed_at - $1 \
             WHERE delivery_claimed_at IS NOT NULL"
        ),
        &[&back],
    )
    .expect("expire delivery claims");
    c.execute(
        &format!(
            "UPDATE {schema}.retinue_children SET resume_claimed_at = resume_claimed_at - $1 \
             WHERE resume_claimed_at IS NOT NULL"
        ),
        &[&back],
    )
    .expect("expire resume claims");
}

/// The conformance suite's factory: a fresh schema per case on the test
/// server; `None` (after saying why, or failing under CI) without one.
fn pg_factory() -> Option<impl Fn(DelegationConfig) -> SuiteBackend> {
    let url = retinue_testkit::pg_url("PostgreSQL conformance tests")?;
    Some(move |d| pg_backend(&url, d))
}

/// Each conformance case its own test: `cargo nextest run -p
/// retinue-store-pg conformance::cases::ttl_prune`.
mod cases {
    use super::pg_factory;
    retinue_testkit::conformance_suite!(pg_factory());
}

fn config(max_retained: u32) -> DelegationConfig {
    DelegationConfig { max_retained, ..LoadedConfig::default().delegation }
}

fn unit(store: &PgStore, profile: &str, tag: &str) -> String {
    let draft = UnitDraft {
        parent_session_id: Some("P".into()),
        owner_profile: profile.into(),
        children: vec![ChildManifest {
            subagent_id: format!("sa-0-{tag}"),
            session_id: format!("s-{tag}"),
            ..ChildManifest::default()
        }],
        ..UnitDraft::default()
    };
    let id = store.insert_unit(&draft).expect("insert");
    assert!(store.retain_completed_delegation(&id, None).expect("retain"));
    id
}

/// The cap counts per profile: one tenant's delegations never evict another's.
#[test]
fn retention_cap_is_per_profile() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL conformance tests") else { return };
    let b = pg_backend(&url, config(2));
    let clock = b.clock.clone();
    let store = open(&url, &scratch_schema_of(&b), &clock, &config(2));
    let a1 = unit(&store, "tenant-a", "a1");
    clock.advance(1.0);
    let _a2 = unit(&store, "tenant-a", "a2");
    clock.advance(1.0);
    for i in 0..3 {
        unit(&store, "tenant-b", &format!("b{i}"));
        clock.advance(1.0);
    }
    // tenant-b's three units capped only tenant-b's oldest.
    assert!(store.find_retained_child(&a1).expect("find").is_some(), "tenant-a untouched");
    assert!(matches!(
        store.lookup("sa-0-b0").expect("lookup"),
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason: TombstoneReason::Cap, .. })
    ));
    assert_eq!(store.list_retained_children().expect("list").len(), 4);
    assert_eq!(store.prune_retained_children(None, None).expect("prune").units, 0);
}

fn scratch_schema_of(b: &SuiteBackend) -> String {
    b.guard.downcast_ref::<Scratch>().map(|s| s.schema.clone()).expect("a PostgreSQL backend")
}

/// A reader whose cap is lower than the writers' (another host's config)
/// still refuses the units beyond its own cap, although the per-profile
/// live count it reads first says the profile holds more than that; and a
/// prune by that reader is due, and prunes to its cap.
#[test]
fn a_lower_cap_elsewhere_is_enforced_at_read_time() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL conformance tests") else { return };
    let b = pg_backend(&url, config(10));
    let clock = b.clock.clone();
    let schema = scratch_schema_of(&b);
    let writer = open(&url, &schema, &clock, &config(10));
    for i in 0..4 {
        unit(&writer, "tenant", &format!("u{i}"));
        clock.advance(1.0);
    }
    let reader = open(&url, &schema, &clock, &config(2));
    for (tag, capped) in [("u0", true), ("u1", true), ("u2", false), ("u3", false)] {
        let found = reader.lookup(&format!("sa-0-{tag}")).expect("lookup");
        let is_capped = matches!(
            found,
            Lookup::NotAddressable(
                _,
                Unaddressable::Tombstoned { reason: TombstoneReason::Cap, .. }
            )
        );
        assert_eq!(is_capped, capped, "{tag}: {found:?}");
    }
    assert_eq!(reader.list_retained_children().expect("list").len(), 2);
    assert_eq!(writer.list_retained_children().expect("list").len(), 4);
    assert_eq!(reader.prune_retained_children(None, None).expect("prune").units, 2);
    assert_eq!(reader.prune_retained_children(None, None).expect("prune").units, 0);
    assert_eq!(writer.list_retained_children().expect("list").len(), 2);
}

/// Opening twice (two workers) migrates once and is idempotent; a worker's
/// heartbeat keeps its units alive for recovery run elsewhere.
#[test]
fn heartbeat_keeps_units_alive_across_hosts() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL conformance tests") else { return };
    let b = pg_backend(&url, config(10));
    let schema = scratch_schema_of(&b);
    let clock = b.clock.clone();
    let a = Arc::new(open(&url, &schema, &clock, &config(10)));
    let id = a
        .insert_unit(&UnitDraft {
            children: vec![ChildManifest::default()],
            ..UnitDraft::default()
        })
        .expect("insert");
    for _ in 0..3 {
        clock.advance(WORKER_LEASE_SECS / 2.0);
        a.heartbeat().expect("heartbeat");
    }
    let host_b = open(&url, &schema, &clock, &config(10));
    let probe = DeadPids::default();
    assert_eq!(host_b.recover_abandoned_delegations(&probe).abandoned, 0);
    let workers = |schema: &str| -> Vec<String> {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
        c.batch_execute(&format!("SET search_path TO {schema}")).expect("search path");
        let rows = c.query("SELECT worker_id FROM retinue_workers", &[]).expect("workers");
        rows.iter().map(|r| r.get(0)).collect()
    };
    assert!(workers(&schema).contains(&a.worker_id().to_owned()));
    a.retire().expect("retire");
    // A retired worker leaves no row behind (every CLI invocation retires).
    assert!(!workers(&schema).contains(&a.worker_id().to_owned()));
    clock.advance(0.001);
    assert_eq!(host_b.recover_abandoned_delegations(&probe).abandoned, 1);
    // Rows of workers long dead are forgotten at any worker's heartbeat.
    let c = open(&url, &schema, &clock, &config(10));
    let c_id = c.worker_id().to_owned();
    expire_lease(&url, &schema, &c_id, retinue_store_pg::FORGET_WORKERS_AFTER_SECS - 60.0);
    host_b.heartbeat().expect("heartbeat");
    assert!(workers(&schema).contains(&c_id), "forgotten before its time");
    expire_lease(&url, &schema, &c_id, retinue_store_pg::FORGET_WORKERS_AFTER_SECS + 1.0);
    host_b.heartbeat().expect("heartbeat");
    let left = workers(&schema);
    assert!(!left.contains(&c_id) && left.contains(&host_b.worker_id().to_owned()), "{left:?}");
    assert!(matches!(
        host_b.lookup(&id).expect("lookup"),
        Lookup::Unknown | Lookup::NotAddressable(..)
    ));
}

/// The history pruner runs (its "due?" check binds the keeps as BIGINT) and
/// deletes the oldest terminal units beyond `TERMINAL_KEEP`, never a retained one.
#[test]
fn history_prune_keeps_the_newest_terminal_units() {
    use retinue_core::{Completion, TERMINAL_KEEP};
    let Some(url) = retinue_testkit::pg_url("PostgreSQL conformance tests") else { return };
    let b = pg_backend(&url, config(10));
    let clock = b.clock.clone();
    let store = open(&url, &scratch_schema_of(&b), &clock, &config(10));
    let kept = unit(&store, "", "kept");
    assert_eq!(store.prune_history().expect("prune, nothing due"), 0);
    let total = usize::try_from(TERMINAL_KEEP).expect("a small keep") + 2;
    for i in 0..total {
        clock.advance(1.0);
        let id = store.insert_unit(&UnitDraft::default()).expect("insert");
        let failed = Completion {
            delegation_id: id.clone(),
            status: "failed".into(),
            event: retinue_core::CompletionEvent::from_stored(
                &id,
                serde_json::json!({"delegation_id": id, "i": i}),
            ),
            result: serde_json::json!({"status": "failed"}),
            usage: None,
            background: false,
        };
        store.persist_completion(&failed).expect("complete");
    }
    assert_eq!(store.prune_history().expect("prune"), 2);
    assert_eq!(store.prune_history().expect("prune again"), 0);
    assert!(store.find_retained_child(&kept).expect("find").is_some(), "retained unit kept");
}

/// The server's clock, in the lease columns' unit.
fn server_now(c: &mut postgres::Client) -> f64 {
    c.query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])
        .expect("the server's clock")
        .get(0)
}

/// Leases are taken and judged on the server's clock (issue #28): a worker
/// whose clock runs an hour ahead is not kept alive for an hour after it
/// stops renewing, one an hour behind is not recovered while its lease
/// holds. Each unit is recovered exactly when its worker's lease lapses on
/// the server: never by a recovery that ended before the expiry, always by
/// one that began after it.
#[test]
fn leases_ignore_a_skewed_host_clock() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL conformance tests") else { return };
    let b = pg_backend(&url, config(10));
    let schema = scratch_schema_of(&b);
    let mut sql = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    const LEASE: f64 = 4.0;
    let skewed = |skew: f64| {
        let opts = PgOptions { lease_secs: LEASE, ..PgOptions::default() }
            .with_clock(Arc::new(ManualClock::new(wall + skew)))
            .with_schema(&schema);
        PgStore::open(&url, opts).expect("open a skewed worker")
    };
    let opened = server_now(&mut sql);
    let workers = [skewed(3_600.0), skewed(-3_600.0)];
    let units: Vec<String> = workers
        .iter()
        .map(|w| {
            w.insert_unit(&UnitDraft {
                children: vec![ChildManifest::default()],
                ..UnitDraft::default()
            })
            .expect("insert")
        })
        .collect();
    // Each lease expires a lease after the server's now, whatever the host's clock says.
    let expiry: Vec<f64> = workers
        .iter()
        .map(|w| {
            sql.query_one(
                &format!(
                    "SELECT lease_expires_at FROM {schema}.retinue_workers WHERE worker_id = $1"
                ),
                &[&w.worker_id()],
            )
            .expect("lease row")
            .get(0)
        })
        .collect();
    let after = server_now(&mut sql);
    for e in &expiry {
        assert!(*e >= opened + LEASE && *e <= after + LEASE, "lease off the server's clock: {e}");
    }
    let judge = open(&url, &schema, &Arc::new(ManualClock::new(wall)), &config(10));
    let probe = DeadPids::default();
    let unknown = |sql: &mut postgres::Client, id: &str| -> bool {
        let state: String = sql
            .query_one(
                &format!("SELECT state FROM {schema}.async_delegations WHERE delegation_id = $1"),
                &[&id],
            )
            .expect("unit row")
            .get(0);
        state == "unknown"
    };
    let (mut seen_alive, mut seen_dead) = ([false; 2], [false; 2]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while seen_dead != [true; 2] {
        assert!(std::time::Instant::now() < deadline, "never recovered");
        let t0 = server_now(&mut sql);
        let report = judge.recover_abandoned_delegations(&probe);
        assert_eq!(report.error, None);
        let t1 = server_now(&mut sql);
        for i in 0..2 {
            let gone = unknown(&mut sql, &units[i]);
            if t1 < expiry[i] {
                assert!(!gone, "worker {i} recovered before its lease lapsed");
                seen_alive[i] = true;
            }
            if t0 > expiry[i] {
                assert!(gone, "worker {i} not recovered after its lease lapsed");
                seen_dead[i] = true;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(seen_alive, [true; 2], "no recovery ran inside the leases: the test proved nothing");
}

/// A scratch store of its own (schema dropped at the end) and a raw client
/// on its schema.
fn scratch_store(url: &str) -> (PgStore, postgres::Client, Scratch) {
    let schema = scratch_schema();
    let clock = Arc::new(ManualClock::new(T0));
    let store = open(url, &schema, &clock, &config(10));
    let mut sql = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    // The schema is ours (`scratch_schema`), never input.
    sql.batch_execute(&format!("SET search_path TO {schema}")).expect("search path");
    (store, sql, Scratch { url: url.to_owned(), schema })
}

fn session(id: &str, parent: &str) -> retinue_core::NewSession {
    retinue_core::NewSession {
        id: id.into(),
        source: "delegate".into(),
        parent_session_id: Some(parent.into()),
        ..retinue_core::NewSession::default()
    }
}

fn draft_with_sessions(tag: &str, sessions: Vec<retinue_core::NewSession>) -> UnitDraft {
    UnitDraft {
        parent_session_id: Some("P".into()),
        children: vec![ChildManifest {
            subagent_id: format!("sa-0-{tag}"),
            session_id: format!("s-{tag}"),
            ..ChildManifest::default()
        }],
        child_sessions: sessions,
        ..UnitDraft::default()
    }
}

fn parent_of(sql: &mut postgres::Client, id: &str) -> Option<String> {
    sql.query_one("SELECT parent_session_id FROM sessions WHERE id = $1", &[&id])
        .expect("session row")
        .get(0)
}

fn rows(sql: &mut postgres::Client, table: &str) -> i64 {
    // `table` is one of this file's literals.
    sql.query_one(&format!("SELECT count(*) FROM {table}"), &[]).expect("count").get(0)
}

/// A dispatch is one statement (unit, children, sessions) unless its
/// sessions name each other as parents: both link every parent that is a
/// row, and a failing dispatch writes nothing at all.
#[test]
fn a_dispatch_writes_unit_children_and_sessions_or_nothing() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL dispatch") else { return };
    let (store, mut sql, _guard) = scratch_store(&url);
    use retinue_core::SessionStore;
    store
        .create_session(&retinue_core::NewSession { id: "P".into(), ..Default::default() })
        .expect("root");

    // One statement: both sessions under the existing spawner; an unknown
    // parent is not linked (as SQLite).
    let id = store
        .insert_unit(&draft_with_sessions("a", vec![session("s-a", "P"), session("x", "ghost")]))
        .expect("insert");
    assert_eq!(parent_of(&mut sql, "s-a").as_deref(), Some("P"));
    assert_eq!(parent_of(&mut sql, "x"), None);
    let children: i64 = sql
        .query_one("SELECT count(*) FROM retinue_children WHERE delegation_id = $1", &[&id])
        .expect("children")
        .get(0);
    assert_eq!(children, 1);

    // Chained: the second session's parent is the first, inserted first.
    store
        .insert_unit(&draft_with_sessions("b", vec![session("s-b", "P"), session("s-b2", "s-b")]))
        .expect("insert chained");
    assert_eq!(parent_of(&mut sql, "s-b2").as_deref(), Some("s-b"));

    // A session id that exists fails the dispatch: no unit, child or session written.
    let before = [rows(&mut sql, "async_delegations"), rows(&mut sql, "retinue_children")];
    let sessions_before = rows(&mut sql, "sessions");
    let dup = store
        .insert_unit(&draft_with_sessions("c", vec![session("s-c", "P"), session("s-a", "P")]));
    assert!(dup.is_err(), "a duplicate session id was accepted");
    assert_eq!([rows(&mut sql, "async_delegations"), rows(&mut sql, "retinue_children")], before);
    assert_eq!(rows(&mut sql, "sessions"), sessions_before);
    // Bad input is refused before anything is sent.
    let mut bad = session("s-d", "P");
    bad.model_config = Some(serde_json::json!([1]));
    assert!(matches!(
        store.insert_unit(&draft_with_sessions("d", vec![bad, session("s-d2", "P")])),
        Err(retinue_core::Error::Invalid(_))
    ));
    assert_eq!(rows(&mut sql, "async_delegations"), before[0]);
}

/// A retained unit without child rows (copied from a hermes file by a
/// foreign writer) is adopted by a tombstone of an id nothing else
/// matches, which then finds and tombstones its child; an id that resolves
/// takes exactly the row a lookup shows.
#[test]
fn a_tombstone_adopts_a_unit_without_child_rows() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL tombstone adoption") else { return };
    let (store, mut sql, _guard) = scratch_store(&url);
    let kept = unit(&store, "", "kept");
    sql.execute(
        "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, \
         state, dispatched_at, updated_at, task_json, children_json, retained, retained_at, \
         owner_profile) VALUES ('deleg_hermes', 'P', 'P', 'completed', $1, $1, '{}', $2, 1, $1, '')",
        &[&T0, &r#"[{"subagent_id": "sa-0-hermes", "session_id": "s-hermes"}]"#],
    )
    .expect("a foreign unit");
    assert!(
        store.tombstone_retained_child("sa-0-hermes", &TombstoneReason::Manual).expect("tombstone")
    );
    assert!(matches!(
        store.lookup("sa-0-hermes").expect("lookup"),
        Lookup::NotAddressable(
            _,
            Unaddressable::Tombstoned { reason: TombstoneReason::Manual, .. }
        )
    ));
    // The other unit was untouched, and is tombstoned on its own.
    assert!(store.find_retained_child("sa-0-kept").expect("find").is_some());
    assert!(store.tombstone_retained_child(&kept, &TombstoneReason::Manual).expect("tombstone"));
    assert!(store.find_retained_child("sa-0-kept").expect("find").is_none());
    assert!(!store.tombstone_retained_child("sa-0-kept", &TombstoneReason::Manual).expect("again"));
}

/// Delivery and resume claims are leased on the server's clock: a host
/// whose clock runs two hours ahead neither takes a claim another host
/// holds nor reports its lease from its own clock; once the lease lapses
/// on the server, it takes it.
#[test]
fn claims_ignore_a_skewed_host_clock() {
    use retinue_core::{Claims, Completion, CompletionEvent, DeliveryFilter, ResumeClaim};
    let Some(url) = retinue_testkit::pg_url("PostgreSQL claim leases") else { return };
    let (store, mut sql, guard) = scratch_store(&url);
    let ahead = Arc::new(ManualClock::new(T0 + 7_200.0));
    let other = open(&url, &guard.schema, &ahead, &config(10));
    // A retained child to resume, and a background completion to deliver.
    let id = unit(&store, "", "claimed");
    let done = store
        .insert_unit(&UnitDraft { parent_session_id: Some("P".into()), ..UnitDraft::default() })
        .expect("insert");
    assert!(
        store
            .persist_completion(&Completion {
                delegation_id: done.clone(),
                status: "failed".into(),
                event: CompletionEvent::from_stored(
                    &done,
                    serde_json::json!({"type": "async_delegation", "delegation_id": done}),
                ),
                result: serde_json::json!({"status": "failed"}),
                usage: None,
                background: true,
            })
            .expect("complete")
    );

    let t0 = server_now(&mut sql);
    let ResumeClaim::Claimed { token } = store.claim_resume(&id, 0).expect("claim") else {
        panic!("the first claim must succeed")
    };
    let t1 = server_now(&mut sql);
    match other.claim_resume(&id, 0).expect("claim") {
        ResumeClaim::Busy { claimed_at, expires_at } => {
            assert!((t0..=t1).contains(&claimed_at), "claimed_at {claimed_at} not in [{t0}, {t1}]");
            assert!((expires_at - claimed_at - retinue_core::LEASE_SECS).abs() < 1e-6);
        }
        other => panic!("a host ahead took a held claim: {other:?}"),
    }
    assert!(other.renew_resume(&id, 0, "not-mine").is_ok_and(|renewed| !renewed));
    let delivery = store.claim_delivery(&DeliveryFilter::default()).expect("claim").expect("one");
    assert_eq!(delivery.delegation_id, done);
    assert!(other.claim_delivery(&DeliveryFilter::default()).expect("claim").is_none());

    // A renewal (on the server's clock) keeps the claim from the other host…
    expire_claims(&url, &guard.schema);
    assert!(store.renew_resume(&id, 0, &token).expect("renew"));
    assert!(matches!(other.claim_resume(&id, 0).expect("claim"), ResumeClaim::Busy { .. }));
    // …until its lease lapses on the server: then the other host takes both.
    expire_claims(&url, &guard.schema);
    assert!(matches!(other.claim_resume(&id, 0).expect("claim"), ResumeClaim::Claimed { .. }));
    let again = other.claim_delivery(&DeliveryFilter::default()).expect("claim").expect("again");
    assert_eq!((again.delegation_id.as_str(), again.attempt), (done.as_str(), 2));
}

/// A live unit another program wrote without counting it (no
/// `retinue_profile_live` row for its profile) is ranked by the list as a
/// lookup ranks it: beyond the cap, it is listed by neither.
#[test]
fn an_uncounted_profile_is_ranked_by_the_list() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL uncounted profile") else { return };
    let (store, mut sql, _guard) = scratch_store(&url);
    for i in 0..12 {
        sql.execute(
            "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, \
             state, dispatched_at, updated_at, task_json, children_json, retained, retained_at, \
             owner_profile) VALUES ($1, 'P', 'P', 'completed', $2, $2, '{}', '[]', 1, $2, 'raw')",
            &[&format!("deleg_raw{i:02}"), &(T0 + f64::from(i))],
        )
        .expect("a foreign unit");
        sql.execute(
            "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, \
             child_session_id, manifest_json, retained_at) VALUES ($1, 0, $2, $3, '{}', $4)",
            &[
                &format!("deleg_raw{i:02}"),
                &format!("sa-raw{i:02}"),
                &format!("s-raw{i:02}"),
                &(T0 + f64::from(i)),
            ],
        )
        .expect("its child");
    }
    // The cap is 10: the two oldest are beyond it, for the list as for a lookup.
    let listed: Vec<String> =
        store.list_retained_children().expect("list").into_iter().map(|e| e.subagent_id).collect();
    assert_eq!(listed.len(), 10, "{listed:?}");
    assert!(!listed.contains(&"sa-raw00".to_owned()) && !listed.contains(&"sa-raw01".to_owned()));
    for sa in ["sa-raw00", "sa-raw01"] {
        assert!(store.find_retained_child(sa).expect("find").is_none(), "{sa}");
    }
    assert!(store.find_retained_child("sa-raw02").expect("find").is_some());
}

/// A live unit's child without a TTL clock of its own (written by another
/// program) is judged by its unit's clock when a retain prunes: kept while
/// the unit is within the TTL, tombstoned `ttl` at the unit's expiry after.
#[test]
fn a_child_without_a_clock_is_judged_by_its_units() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL clockless child") else { return };
    let schema = scratch_schema();
    let clock = Arc::new(ManualClock::new(T0));
    let d = config(10);
    let store = open(&url, &schema, &clock, &d);
    let _guard = Scratch { url: url.clone(), schema: schema.clone() };
    let mut sql = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
    sql.batch_execute(&format!("SET search_path TO {schema}")).expect("search path");
    sql.execute(
        "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, \
         state, dispatched_at, updated_at, task_json, children_json, retained, retained_at, \
         owner_profile) VALUES ('deleg_raw', 'P', 'P', 'completed', $1, $1, '{}', '[]', 1, $1, '')",
        &[&T0],
    )
    .expect("a foreign unit");
    sql.execute(
        "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, \
         child_session_id, manifest_json) VALUES ('deleg_raw', 0, 'sa-raw', 's-raw', '{}')",
        &[],
    )
    .expect("its clockless child");
    // The server counted it (issue #41: the count's triggers fire for any writer).
    assert_eq!(counted(&mut sql, ""), 1);
    clock.advance(10.0);
    unit(&store, "", "a");
    assert!(store.find_retained_child("sa-raw").expect("find").is_some(), "pruned while fresh");
    let ttl = d.clone().retention().ttl_hours * 3600.0;
    clock.advance(ttl);
    unit(&store, "", "b");
    match store.lookup("sa-raw").expect("lookup") {
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason, at, .. }) => {
            assert_eq!(reason, TombstoneReason::Ttl);
            assert!((at - (T0 + ttl)).abs() < 1e-6, "tombstoned at {at}, not at its unit's expiry");
        }
        other => panic!("a clockless child of an expired unit: {other:?}"),
    }
}

/// The one-statement retain when the prune takes the retained unit itself:
/// a unit retained behind two newer ones (another host's clock ran ahead)
/// is beyond a cap of 2 at once, and one re-retained after its child's TTL
/// lapsed has no child left within it; each is written once, as the
/// two-statement retain and prune wrote it.
#[test]
fn a_retain_whose_prune_takes_the_retained_unit() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL retain pruning itself") else { return };
    let schema = scratch_schema();
    let clock = Arc::new(ManualClock::new(T0));
    let d = config(2);
    let store = open(&url, &schema, &clock, &d);
    let _guard = Scratch { url: url.clone(), schema: schema.clone() };
    let mut sql = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
    sql.batch_execute(&format!("SET search_path TO {schema}")).expect("search path");
    let live = |sql: &mut postgres::Client| -> i64 {
        sql.query_one(
            "SELECT COALESCE(sum(units), 0)::BIGINT FROM retinue_profile_live WHERE profile = ''",
            &[],
        )
        .expect("count")
        .get(0)
    };

    clock.advance(100.0);
    let a = unit(&store, "", "a");
    clock.advance(1.0);
    let b = unit(&store, "", "b");
    // Back in time: the third unit is the oldest of three, beyond the cap.
    clock.advance(-50.0);
    let c = unit(&store, "", "c");
    let at = retinue_core::Clock::now(&*clock);
    match store.lookup("sa-0-c").expect("lookup") {
        Lookup::NotAddressable(e, Unaddressable::Tombstoned { reason, .. }) => {
            assert_eq!(reason, TombstoneReason::Cap);
            assert_eq!(e.delegation_id, c);
        }
        other => panic!("the retained unit beyond the cap: {other:?}"),
    }
    let (unit_tomb, child_tomb, reason, retained_at): (
        Option<f64>,
        Option<f64>,
        Option<String>,
        Option<f64>,
    ) = {
        let r = sql
            .query_one(
                "SELECT u.tombstoned_at, k.tombstoned_at, k.tombstone_reason, k.retained_at \
                 FROM async_delegations u JOIN retinue_children k USING (delegation_id) \
                 WHERE u.delegation_id = $1",
                &[&c],
            )
            .expect("rows");
        (r.get(0), r.get(1), r.get(2), r.get(3))
    };
    assert_eq!(
        (unit_tomb, child_tomb, reason.as_deref(), retained_at),
        (Some(at), Some(at), Some("cap"), Some(at))
    );
    for (id, sa) in [(&a, "sa-0-a"), (&b, "sa-0-b")] {
        let e = store.find_retained_child(sa).expect("find").expect("within the cap");
        assert_eq!(&e.delegation_id, id);
    }
    assert_eq!(live(&mut sql), 2);

    // `b` re-retained after its child's TTL lapsed (no prune in between):
    // its child is tombstoned `ttl` at its expiry, and the unit with it.
    let ttl = d.clone().retention().ttl_hours * 3600.0;
    let b_clock = T0 + 101.0;
    clock.advance(50.0 + ttl + 10.0);
    assert!(store.retain_completed_delegation(&b, None).expect("retain"));
    let r = sql
        .query_one(
            "SELECT u.tombstoned_at, k.tombstoned_at, k.tombstone_reason \
             FROM async_delegations u JOIN retinue_children k USING (delegation_id) \
             WHERE u.delegation_id = $1",
            &[&b],
        )
        .expect("rows");
    let (u_t, k_t, why): (Option<f64>, Option<f64>, Option<String>) =
        (r.get(0), r.get(1), r.get(2));
    assert_eq!(u_t, Some(retinue_core::Clock::now(&*clock)));
    assert_eq!(k_t, Some(b_clock + ttl));
    assert_eq!(why.as_deref(), Some("ttl"));
    // `a`'s child lapsed too: the prune of that retain took it (and `a`).
    assert!(store.find_retained_child("sa-0-a").expect("find").is_none());
    assert_eq!(live(&mut sql), 0);
}

/// A claim whose lease cannot be the server's — taken a day from now, NaN,
/// infinite: a row another program planted — holds nothing: the child is
/// claimed and the completion delivered, instead of being held forever.
#[test]
fn a_planted_impossible_claim_holds_nothing() {
    use retinue_core::{Claims, Completion, CompletionEvent, DeliveryFilter, ResumeClaim};
    let Some(url) = retinue_testkit::pg_url("PostgreSQL planted claims") else { return };
    let (store, mut sql, _guard) = scratch_store(&url);
    let id = unit(&store, "", "planted");
    let done = store
        .insert_unit(&UnitDraft { parent_session_id: Some("P".into()), ..UnitDraft::default() })
        .expect("insert");
    assert!(
        store
            .persist_completion(&Completion {
                delegation_id: done.clone(),
                status: "failed".into(),
                event: CompletionEvent::from_stored(
                    &done,
                    serde_json::json!({"type": "async_delegation", "delegation_id": done}),
                ),
                result: serde_json::json!({"status": "failed"}),
                usage: None,
                background: true,
            })
            .expect("complete")
    );
    for planted in ["extract(epoch FROM clock_timestamp())::float8 + 86400", "'NaN'", "'Infinity'"]
    {
        // `planted` is one of this test's literals.
        sql.execute(
            &format!(
                "UPDATE retinue_children SET resume_claim = 'planted', \
                 resume_claimed_at = {planted} WHERE delegation_id = $1"
            ),
            &[&id],
        )
        .expect("plant a resume claim");
        sql.execute(
            &format!(
                "UPDATE async_delegations SET delivery_state = 'pending', \
                 delivery_claim = 'planted', delivery_claimed_at = {planted} \
                 WHERE delegation_id = $1"
            ),
            &[&done],
        )
        .expect("plant a delivery claim");
        let ResumeClaim::Claimed { token } = store.claim_resume(&id, 0).expect("claim") else {
            panic!("a planted claim ({planted}) held the child")
        };
        assert!(store.release_resume(&id, 0, &token).expect("release"));
        let taken = store.claim_delivery(&DeliveryFilter::default()).expect("claim");
        assert_eq!(taken.map(|c| c.delegation_id), Some(done.clone()), "{planted}");
    }
}

/// The tenant's maintained live count (the sum of its stripes).
fn counted(sql: &mut postgres::Client, profile: &str) -> i64 {
    sql.query_one(
        "SELECT COALESCE(sum(units), 0)::BIGINT FROM retinue_profile_live WHERE profile = $1",
        &[&profile],
    )
    .expect("count")
    .get(0)
}

fn live_units(sql: &mut postgres::Client, profile: &str) -> i64 {
    sql.query_one(
        "SELECT count(*) FROM async_delegations WHERE retained = 1 AND tombstoned_at IS NULL \
         AND COALESCE(owner_profile, '') = $1",
        &[&profile],
    )
    .expect("live")
    .get(0)
}

fn plant_live(sql: &mut postgres::Client, id: &str, profile: &str, at: f64) {
    sql.execute(
        "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, \
         state, dispatched_at, updated_at, task_json, children_json, retained, retained_at, \
         owner_profile) VALUES ($1, 'P', 'P', 'completed', $2, $2, '{}', '[]', 1, $2, $3)",
        &[&id, &at, &profile],
    )
    .expect("a foreign unit");
    sql.execute(
        "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, \
         child_session_id, manifest_json, retained_at) VALUES ($1, 0, $2, $3, '{}', $4)",
        &[&id, &format!("sa-{id}"), &format!("s-{id}"), &at],
    )
    .expect("its child");
}

/// Issue #41: the live count is the server's, whoever writes. Units another
/// program writes, tombstones and deletes with plain SQL move it; a retain
/// that finds its tenant over the cap (by that count) prunes at once, in
/// the statement's own tenant only.
#[test]
fn the_live_count_follows_every_writer() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL live count") else { return };
    let (store, mut sql, _guard) = scratch_store(&url);
    for i in 0..12 {
        plant_live(&mut sql, &format!("deleg_a{i:02}"), "", T0 + f64::from(i));
    }
    plant_live(&mut sql, "deleg_other", "other", T0);
    assert_eq!((counted(&mut sql, ""), counted(&mut sql, "other")), (12, 1));
    sql.execute(
        "UPDATE async_delegations SET tombstoned_at = $1 WHERE delegation_id = 'deleg_a00'",
        &[&T0],
    )
    .expect("tombstoned by hand");
    sql.batch_execute(
        "DELETE FROM retinue_children WHERE delegation_id = 'deleg_a01'; \
         DELETE FROM async_delegations WHERE delegation_id = 'deleg_a01'",
    )
    .expect("deleted by hand");
    sql.execute(
        "UPDATE async_delegations SET owner_profile = 'other' WHERE delegation_id = 'deleg_a02'",
        &[],
    )
    .expect("moved to another tenant");
    assert_eq!((counted(&mut sql, ""), counted(&mut sql, "other")), (9, 2));
    // 9 live and one more retained: over the cap of 10? No: 10 is the cap.
    unit(&store, "", "x");
    assert_eq!((live_units(&mut sql, ""), counted(&mut sql, "")), (10, 10));
    // The next one is over it: pruned back to 10 by this retain.
    unit(&store, "", "y");
    assert_eq!((live_units(&mut sql, ""), counted(&mut sql, "")), (10, 10));
    assert_eq!((live_units(&mut sql, "other"), counted(&mut sql, "other")), (2, 2));
}

/// Issue #41: a count that disagrees with the rows (edited by hand, or
/// units written with the triggers disabled: other programs' ordinary
/// writes are counted by the triggers) is never trusted for long: every
/// 64th retain of a store ranks its tenant, prunes it to the cap and
/// rewrites the count from the rows, as does any prune.
#[test]
fn a_count_that_disagrees_is_repaired() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL repaired count") else { return };
    let (store, mut sql, _guard) = scratch_store(&url);
    for i in 0..10 {
        plant_live(&mut sql, &format!("deleg_a{i:02}"), "", T0 + f64::from(i));
    }
    // Under-counted: the tenant looks empty.
    sql.execute("UPDATE retinue_profile_live SET units = 0 WHERE profile = ''", &[])
        .expect("edited by hand");
    let mut repaired_after = None;
    for i in 0..64 {
        unit(&store, "", &format!("n{i:02}"));
        if live_units(&mut sql, "") == 10 && counted(&mut sql, "") == 10 {
            repaired_after = Some(i + 1);
            break;
        }
    }
    let n = repaired_after.expect("no retain ranked the tenant within 64");
    assert!(n > 1, "the first retain already ranked: the count was not trusted at all");
    // The oldest planted units were pruned by the cap.
    assert!(store.find_retained_child("sa-deleg_a00").expect("find").is_none());
    // An over-count (units that are not there) makes the next retain rank
    // (it looks over the cap) and is rewritten from the rows.
    sql.execute(
        "INSERT INTO retinue_profile_live (profile, stripe, units) VALUES ('', 5, 1000) \
         ON CONFLICT (profile, stripe) DO UPDATE SET units = 1000",
        &[],
    )
    .expect("over-counted by hand");
    unit(&store, "", "after-over");
    assert_eq!((live_units(&mut sql, ""), counted(&mut sql, "")), (10, 10));
    // A negative count, likewise.
    sql.execute(
        "UPDATE retinue_profile_live SET units = -50 WHERE profile = '' AND stripe = 5",
        &[],
    )
    .expect("negative by hand");
    unit(&store, "", "after-negative");
    assert_eq!((live_units(&mut sql, ""), counted(&mut sql, "")), (10, 10));
}
