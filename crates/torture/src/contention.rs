//! The contention harness: `procs` processes × `threads` threads share one
//! `state.db` and run a mixed workload for a fixed count of operations —
//! units dispatched and completed (retain), tombstones, prunes, keyed ledger
//! writes on a shared key space, resume claims and delivery claims.
//!
//! Checked afterwards:
//! * every process first-opened one fresh file at the same moment without
//!   an error, and no `Busy` (or any other) error reached a caller;
//! * no lost update: every unit a process inserted exists; every key has
//!   exactly one ledger row and the processes' `true` answers add up to the
//!   rows; totals equal the sum of the rows; manual tombstones match the
//!   `true` answers;
//! * a child is never resumed by two follow-ups at once: a claim holder
//!   creates a witness file with `O_EXCL` while it holds the claim;
//! * every completion is delivered exactly once: each acknowledged delivery
//!   creates a witness file with `O_EXCL`, and after a final drain every
//!   completed unit is `delivered` after exactly one attempt;
//! * budgets never overspend: threads of every process reserve allowances
//!   against two lineage budgets of [`BUDGET_USD`] each, bill at most their
//!   allowance and settle; at the end each lineage spent at most its limit
//!   and no reservation is left open.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use retinue_core::{
    AttributionDraft, ChildManifest, Claims, Completion, DeliveryFilter, Error, NewSession,
    RegistryRead, ResumeClaim, Retention, SessionStore as _, TombstoneReason, UnitDraft,
    UnitLifecycle,
};
use retinue_store::Store;
use serde_json::{Value, json};

use crate::rng::Rng;
use crate::worker::usage_of;
use crate::{Context, Outcome};

/// `max_retained` for the contention store (large: prunes run but the seeded
/// claim targets stay addressable).
pub const MAX_RETAINED: u32 = 1000;

/// The limit of each of the two contended lineage budgets, in dollars.
pub const BUDGET_USD: f64 = 1.0;

/// Seeded retained units (two children each) the resume claims target.
const SEED_UNITS: usize = 6;

/// How to run the harness.
#[derive(Debug, Clone)]
pub struct ContentionOptions {
    /// The `retinue-torture` binary (each process is its `contention-proc` subcommand).
    pub exe: PathBuf,
    /// Directory for `state.db` and the witness files.
    pub dir: PathBuf,
    /// Processes.
    pub procs: u32,
    /// Threads per process.
    pub threads: u32,
    /// Operations per process (split over its threads).
    pub ops: u64,
    /// Seed.
    pub seed: u64,
}

/// What a contention run did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ContentionReport {
    /// Processes.
    pub procs: u32,
    /// Threads per process.
    pub threads: u32,
    /// Operations run, all processes.
    pub ops: u64,
    /// Per-operation counts, all processes.
    pub counts: BTreeMap<String, u64>,
    /// `Busy` errors that reached a caller (must be 0).
    pub busy: u64,
    /// Resume claims refused as busy (another holder; expected).
    pub claim_busy: u64,
    /// Ledger keys present at the end.
    pub keys: usize,
    /// Completions delivered.
    pub delivered: usize,
    /// Budget reservations held.
    pub budget_held: u64,
    /// Budget reservations refused (the budget was spent or held).
    pub budget_refused: u64,
    /// Dollars spent past a lineage's limit (must be 0).
    pub overspend_usd: f64,
    /// The waiter race: units each raced for by `threads` waiters at once
    /// (every one delivered to exactly one of them).
    pub raced_units: usize,
    /// Wall time of the workload in seconds.
    pub secs: f64,
    /// The seed.
    pub seed: u64,
}

impl ContentionReport {
    /// The figures as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "harness": "contention", "procs": self.procs, "threads": self.threads,
            "ops": self.ops, "counts": self.counts, "busy": self.busy,
            "claim_busy": self.claim_busy, "keys": self.keys, "delivered": self.delivered,
            "budget_held": self.budget_held, "budget_refused": self.budget_refused,
            "overspend_usd": self.overspend_usd, "raced_units": self.raced_units,
            "secs": self.secs,
            "ops_per_sec": if self.secs > 0.0 { (self.ops as f64 / self.secs).round() } else { 0.0 },
            "seed": self.seed,
        })
    }
}

/// What one thread (and, summed, one process) saw.
#[derive(Debug, Default)]
struct Tally {
    counts: BTreeMap<String, u64>,
    busy: u64,
    errors: Vec<String>,
    violations: Vec<String>,
    claim_busy: u64,
    inserted: Vec<String>,
    tombstoned: Vec<String>,
    keys_written: Vec<String>,
    acked: Vec<String>,
    budget_held: u64,
    budget_refused: u64,
}

impl Tally {
    fn merge(&mut self, o: Tally) {
        for (k, v) in o.counts {
            *self.counts.entry(k).or_default() += v;
        }
        self.busy += o.busy;
        self.errors.extend(o.errors);
        self.violations.extend(o.violations);
        self.claim_busy += o.claim_busy;
        self.inserted.extend(o.inserted);
        self.tombstoned.extend(o.tombstoned);
        self.keys_written.extend(o.keys_written);
        self.acked.extend(o.acked);
        self.budget_held += o.budget_held;
        self.budget_refused += o.budget_refused;
    }

    fn to_json(&self) -> Value {
        json!({
            "counts": self.counts, "busy": self.busy, "errors": self.errors,
            "violations": self.violations, "claim_busy": self.claim_busy,
            "inserted": self.inserted, "tombstoned": self.tombstoned,
            "keys_written": self.keys_written, "acked": self.acked,
            "budget_held": self.budget_held, "budget_refused": self.budget_refused,
        })
    }

    fn from_json(v: &Value) -> Tally {
        let strings = |k: &str| -> Vec<String> {
            v[k].as_array()
                .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
                .unwrap_or_default()
        };
        Tally {
            counts: v["counts"]
                .as_object()
                .map(|m| m.iter().map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0))).collect())
                .unwrap_or_default(),
            busy: v["busy"].as_u64().unwrap_or(0),
            errors: strings("errors"),
            violations: strings("violations"),
            claim_busy: v["claim_busy"].as_u64().unwrap_or(0),
            inserted: strings("inserted"),
            tombstoned: strings("tombstoned"),
            keys_written: strings("keys_written"),
            acked: strings("acked"),
            budget_held: v["budget_held"].as_u64().unwrap_or(0),
            budget_refused: v["budget_refused"].as_u64().unwrap_or(0),
        }
    }

    /// Notes a store error: `Busy` is counted apart; the run fails on either.
    fn error(&mut self, what: &str, e: &Error) {
        if e.is_busy() {
            self.busy += 1;
        }
        if self.errors.len() < 20 {
            self.errors.push(format!("{what}: {e} ({e:?})"));
        }
    }
}

/// Key space of the shared ledger keys: about two writes per key.
fn key_space(opts_ops: u64, procs: u32) -> u64 {
    (opts_ops * u64::from(procs) / 8).max(16)
}

fn parent_of(n: u64) -> String {
    format!("P{}", n % 4)
}

struct Ctx<'a> {
    store: &'a Store,
    /// A parent's waiter (`retinue wait`, `wait_subagents`) on the same file.
    collector: &'a retinue_delegate::Collector,
    dir: &'a Path,
    claim_targets: &'a [(String, u32)],
    keys: u64,
    tag: String,
}

fn dispatch_and_complete(c: &Ctx<'_>, rng: &mut Rng, t: &mut Tally) {
    let parent = parent_of(rng.next_u64());
    let n = usize::try_from(rng.range(1, 2)).unwrap_or(1);
    let mut children = Vec::new();
    let mut sessions = Vec::new();
    for i in 0..n {
        let sid = format!("cs-{}-{}", c.tag, rng.hex(12));
        children.push(ChildManifest {
            subagent_id: format!("sa-{i}-{}", rng.hex(8)),
            session_id: sid.clone(),
            goal: Some("contend".to_owned()),
            ..ChildManifest::default()
        });
        sessions.push(NewSession {
            id: sid,
            source: "delegate".to_owned(),
            model_config: Some(json!({"_delegate_from": parent})),
            parent_session_id: Some(parent.clone()),
            ..NewSession::default()
        });
    }
    let draft = UnitDraft {
        parent_session_id: Some(parent),
        owner_profile: crate::PROFILE.to_owned(),
        children,
        child_sessions: sessions,
        ..UnitDraft::default()
    };
    let id = match c.store.insert_unit(&draft) {
        Ok(id) => id,
        Err(e) => return t.error("insert_unit", &e),
    };
    t.inserted.push(id.clone());
    let completion = Completion {
        delegation_id: id.clone(),
        status: retinue_core::UnitState::Completed,
        event: retinue_core::CompletionEvent::from_stored(
            &id,
            json!({"type": "async_delegation", "delegation_id": id, "status": "completed"}),
        ),
        result: json!({"status": "completed"}),
        usage: None,
        background: true,
    };
    match c.store.persist_completion(&completion) {
        Ok(true) => {}
        Ok(false) => t.violations.push(format!("persist_completion lost unit {id}")),
        Err(e) => t.error("persist_completion", &e),
    }
}

fn tombstone(c: &Ctx<'_>, rng: &mut Rng, t: &mut Tally) {
    let live = match c.store.list_retained_children() {
        Ok(l) => l,
        Err(e) => return t.error("list", &e),
    };
    // Seeded units are the claim targets; tombstone only dispatched ones.
    let targets: Vec<_> = live
        .iter()
        .filter(|e| !c.claim_targets.iter().any(|(id, _)| *id == e.delegation_id))
        .collect();
    let Some(entry) = rng.pick(&targets) else { return };
    match c.store.tombstone_retained_child(&entry.subagent_id, &TombstoneReason::Manual) {
        Ok(true) => t.tombstoned.push(entry.subagent_id.clone()),
        Ok(false) => {}
        Err(e) => t.error("tombstone", &e),
    }
}

fn ledger(c: &Ctx<'_>, rng: &mut Rng, t: &mut Tally) {
    let k = rng.below(c.keys);
    let key = format!("key-{k}");
    let draft = AttributionDraft {
        parent_session_id: parent_of(k),
        usage: usage_of(k),
        key: Some(key.clone()),
        ..AttributionDraft::default()
    };
    match retinue_usage::record_child_usage_attribution(c.store, &draft) {
        Ok(true) => t.keys_written.push(key),
        Ok(false) => {}
        Err(retinue_usage::UsageError::Store(e)) => t.error("record usage", &e),
        Err(e) => t.errors.push(format!("record usage: {e}")),
    }
}

fn resume_claim(c: &Ctx<'_>, rng: &mut Rng, t: &mut Tally) {
    let Some((id, index)) = rng.pick(c.claim_targets).cloned() else { return };
    let token = match c.store.claim_resume(&id, index) {
        Ok(ResumeClaim::Claimed { token }) => token,
        Ok(ResumeClaim::Busy { .. }) => {
            t.claim_busy += 1;
            return;
        }
        Ok(ResumeClaim::Unavailable) => {
            t.violations.push(format!("seeded child {id}:{index} became unavailable"));
            return;
        }
        Err(e) => return t.error("claim_resume", &e),
    };
    let witness = c.dir.join("claims").join(format!("{id}-{index}"));
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&witness) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            t.violations.push(format!("{id}:{index} resumed by two follow-ups at once"));
            return;
        }
        Err(e) => {
            t.errors.push(format!("claim witness: {e}"));
            return;
        }
    }
    std::thread::sleep(Duration::from_micros(rng.range(0, 2000)));
    if let Err(e) = std::fs::remove_file(&witness) {
        t.errors.push(format!("claim witness: {e}"));
    }
    let released = if rng.chance(50) {
        c.store.finish_follow_up(&id, index, &token, None)
    } else {
        c.store.release_resume(&id, index, &token)
    };
    match released {
        Ok(true) => {}
        Ok(false) => t.violations.push(format!("{id}:{index}: held claim lost before release")),
        Err(e) => t.error("release", &e),
    }
}

fn delivery(c: &Ctx<'_>, t: &mut Tally) {
    let claim = match c.store.claim_delivery(&DeliveryFilter::default()) {
        Ok(Some(claim)) => claim,
        Ok(None) => return,
        Err(e) => return t.error("claim_delivery", &e),
    };
    match c.store.ack_delivery(&claim.delegation_id, &claim.token) {
        Ok(true) => {}
        Ok(false) => {
            t.violations.push(format!("ack of {} lost its lease", claim.delegation_id));
            return;
        }
        Err(e) => return t.error("ack_delivery", &e),
    }
    let witness = c.dir.join("delivered").join(&claim.delegation_id);
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&witness) {
        Ok(_) => t.acked.push(claim.delegation_id),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            t.violations.push(format!("{} delivered twice", claim.delegation_id));
        }
        Err(e) => t.errors.push(format!("delivery witness: {e}")),
    }
}

/// A parent waits (timeout 0) on one of this thread's completed units, as
/// `retinue wait`/`wait_subagents` do, racing the claimers and the other
/// waiters: a `delivered` answer writes the same witness as a claim, so a
/// second delivery by any path is a violation.
fn wait(c: &Ctx<'_>, rng: &mut Rng, t: &mut Tally) {
    let Some(id) = pick(&t.inserted, rng).cloned() else { return };
    let view = match retinue_core::Controls::unit_view(c.store, &id) {
        Ok(Some(v)) => v,
        Ok(None) => return, // pruned from history
        Err(e) => return t.error("unit_view", &e),
    };
    let parent = retinue_delegate::ParentContext {
        session_id: view.parent_session_id.clone(),
        ..retinue_delegate::ParentContext::default()
    };
    let cancel = retinue_delegate::CancelToken::new();
    let report = match c.collector.wait(
        std::slice::from_ref(&id),
        &parent,
        Duration::ZERO,
        false,
        &cancel,
    ) {
        Ok(r) => r,
        Err(e) => return t.errors.push(format!("wait: {e}")),
    };
    match report.entries.first().map(|e| e.state) {
        Some(retinue_delegate::WaitState::Delivered) => {
            let witness = c.dir.join("delivered").join(&id);
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&witness) {
                Ok(_) => t.acked.push(id),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    t.violations.push(format!("{id} delivered twice (a waiter)"));
                }
                Err(e) => t.errors.push(format!("delivery witness: {e}")),
            }
        }
        Some(retinue_delegate::WaitState::NotFound) => {
            t.violations.push(format!("{id}: its own parent's waiter cannot address it"));
        }
        _ => {}
    }
}

fn pick<'a, T>(items: &'a [T], rng: &mut Rng) -> Option<&'a T> {
    if items.is_empty() {
        return None;
    }
    let n = u64::try_from(items.len()).unwrap_or(u64::MAX);
    items.get(usize::try_from(rng.below(n)).unwrap_or(0))
}

fn budget_root(n: u64) -> String {
    format!("B{}", n % 2)
}

const BUDGET: retinue_core::BudgetLimit =
    retinue_core::BudgetLimit { max_cost_usd: Some(BUDGET_USD), max_tokens: None };

/// Reserves up to $0.20 of a lineage budget, bills at most that, settles.
fn budget(c: &Ctx<'_>, rng: &mut Rng, t: &mut Tally) {
    use retinue_core::{Budgets, Reservation, ReservationDraft, Spend};
    let root = budget_root(rng.next_u64());
    let want = f64::from(u32::try_from(rng.range(1, 20)).unwrap_or(1)) / 100.0;
    let draft = ReservationDraft {
        lineage_root: root.clone(),
        sessions: vec![root.clone()],
        limit: BUDGET,
        minimum: Spend { cost_usd: want, tokens: 0 },
        maximum: Some(Spend { cost_usd: want, tokens: 0 }),
        delegation_id: None,
    };
    let (id, granted) = match c.store.reserve(&draft) {
        Ok(Reservation::Held { id, granted, .. }) => (id, granted),
        Ok(Reservation::Refused(_)) => {
            t.budget_refused += 1;
            return;
        }
        Err(e) => return t.error("reserve", &e),
    };
    t.budget_held += 1;
    // The run spends some of its allowance (never more: the meter stops it).
    let pct = f64::from(u32::try_from(rng.range(0, 100)).unwrap_or(0));
    let row = AttributionDraft {
        parent_session_id: root,
        usage: json!({"cost_usd": granted.cost_usd * pct / 100.0, "tokens": {"input": 0, "output": 0}}),
        ..AttributionDraft::default()
    };
    if let Err(e) = retinue_usage::record_child_usage_attribution(c.store, &row) {
        t.errors.push(format!("budget bill: {e}"));
    }
    match c.store.settle(&id, &retinue_core::SettleReason::Settled) {
        Ok(true) => {}
        Ok(false) => t.violations.push(format!("reservation {id} settled twice")),
        Err(e) => t.error("settle", &e),
    }
}

fn read(c: &Ctx<'_>, rng: &mut Rng, t: &mut Tally) {
    let res = if rng.chance(50) {
        c.store.list_retained_children().map(|_| ())
    } else {
        let id = rng.pick(c.claim_targets).map(|(id, _)| id.clone()).unwrap_or_default();
        c.store.lookup(&id).map(|_| ())
    };
    if let Err(e) = res {
        t.error("read", &e);
    }
}

fn thread_loop(c: &Ctx<'_>, seed: u64, ops: u64) -> Tally {
    let mut rng = Rng::new(seed);
    let mut t = Tally::default();
    for _ in 0..ops {
        let name = match rng.below(100) {
            0..15 => {
                dispatch_and_complete(c, &mut rng, &mut t);
                "retain"
            }
            15..25 => {
                tombstone(c, &mut rng, &mut t);
                "tombstone"
            }
            25..30 => {
                if let Err(e) = c.store.prune_retained_children(None, None) {
                    t.error("prune", &e);
                }
                "prune"
            }
            30..55 => {
                ledger(c, &mut rng, &mut t);
                "ledger"
            }
            55..75 => {
                resume_claim(c, &mut rng, &mut t);
                "resume_claim"
            }
            75..82 => {
                delivery(c, &mut t);
                "delivery_claim"
            }
            82..88 => {
                wait(c, &mut rng, &mut t);
                "wait"
            }
            88..95 => {
                budget(c, &mut rng, &mut t);
                "budget"
            }
            _ => {
                read(c, &mut rng, &mut t);
                "read"
            }
        };
        *t.counts.entry(name.to_owned()).or_default() += 1;
    }
    t
}

/// Options of one contention process.
#[derive(Debug, Clone)]
pub struct ProcOptions {
    /// The shared database.
    pub db: PathBuf,
    /// Where its tally goes (JSON).
    pub out: PathBuf,
    /// Threads.
    pub threads: u32,
    /// Operations of this process.
    pub ops: u64,
    /// Operations per process in the whole run (sizes the key space).
    pub procs: u32,
    /// Seed.
    pub seed: u64,
}

/// One contention process: opens the store and runs its threads.
pub fn run_proc(p: &ProcOptions) -> Outcome<()> {
    let dir = p.db.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    // Every process first-opens one fresh file at about the same moment.
    drop(crate::open_store(&dir.join("first-open.db"), MAX_RETAINED)?);
    let store = Arc::new(crate::open_store(&p.db, MAX_RETAINED)?);
    let claim_targets: Vec<(String, u32)> = store
        .list_retained_children()
        .ctx("list seeded children")?
        .into_iter()
        .filter(|e| e.subagent_id.contains("-seed"))
        .map(|e| (e.delegation_id, e.child_index))
        .collect();
    let authority =
        Arc::new(retinue_lineage::Authority::new(store.clone(), store.clone(), crate::PROFILE));
    let collector = retinue_delegate::Collector::new(
        retinue_core::Backend::of(store.clone()),
        authority,
        crate::PROFILE,
    );
    let mut rng = Rng::new(p.seed);
    let mut total = Tally::default();
    let threads = u64::from(p.threads.max(1));
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let ops = p.ops / threads + u64::from(i < p.ops % threads);
                let seed = rng.next_u64();
                let ctx = Ctx {
                    store: &store,
                    collector: &collector,
                    dir: &dir,
                    claim_targets: &claim_targets,
                    keys: key_space(p.ops, p.procs),
                    tag: rng.hex(8),
                };
                scope.spawn(move || thread_loop(&ctx, seed, ops))
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(t) => total.merge(t),
                Err(_) => total.errors.push("a worker thread panicked".to_owned()),
            }
        }
    });
    std::fs::write(&p.out, total.to_json().to_string()).ctx("write the tally")
}

fn seed_db(db: &Path) -> Outcome<()> {
    let store = crate::open_store(db, MAX_RETAINED)?;
    for p in 0..4 {
        store
            .create_session(&NewSession {
                id: format!("P{p}"),
                source: "cli".to_owned(),
                ..NewSession::default()
            })
            .ctx("seed parent")?;
    }
    for u in 0..SEED_UNITS {
        let draft = UnitDraft {
            parent_session_id: Some(parent_of(u as u64)),
            owner_profile: crate::PROFILE.to_owned(),
            children: (0..2)
                .map(|i| ChildManifest {
                    subagent_id: format!("sa-{i}-seed{u:04}"),
                    session_id: format!("seed-{u}-{i}"),
                    ..ChildManifest::default()
                })
                .collect(),
            ..UnitDraft::default()
        };
        let id = store.insert_unit(&draft).ctx("seed unit")?;
        store.retain_completed_delegation(&id, None).ctx("seed retain")?;
    }
    Ok(())
}

/// Each contended lineage spent at most its limit and holds nothing; the
/// worst overspend in dollars (0 when the budget held).
fn verify_budgets(store: &Store) -> Outcome<f64> {
    use retinue_core::Budgets;
    let mut worst: f64 = 0.0;
    for n in 0..2 {
        let root = budget_root(n);
        let status =
            store.budget_status(&root, std::slice::from_ref(&root), BUDGET).ctx("budget status")?;
        worst = worst.max(status.spent.cost_usd - BUDGET_USD);
        if status.reserved.cost_usd > 0.0 {
            return Err(format!("{root}: reservations still open: {:?}", status.reserved));
        }
    }
    if worst > 1e-9 {
        return Err(format!("a lineage budget was overspent by ${worst}"));
    }
    Ok(worst.max(0.0))
}

fn verify(db: &Path, tally: &Tally, keys: u64) -> Outcome<(usize, usize, f64)> {
    if tally.busy > 0 || !tally.errors.is_empty() {
        return Err(format!(
            "{} Busy error(s) reached a caller; errors: {:?}",
            tally.busy, tally.errors
        ));
    }
    if !tally.violations.is_empty() {
        return Err(format!("violations: {:?}", tally.violations));
    }
    let store = crate::open_store(db, MAX_RETAINED)?;
    let integrity = store.integrity_check().ctx("integrity_check")?;
    if integrity != "ok" {
        return Err(format!("integrity_check: {integrity}"));
    }
    // Lost updates: every inserted unit is there.
    for id in &tally.inserted {
        if matches!(store.lookup(id).ctx("lookup")?, retinue_core::Lookup::Unknown) {
            return Err(format!("inserted unit {id} is missing"));
        }
    }
    // Tombstones: each child reported once.
    let mut seen = HashSet::new();
    for sa in &tally.tombstoned {
        if !seen.insert(sa) {
            return Err(format!("child {sa} tombstoned twice"));
        }
        match store.lookup(sa).ctx("lookup")? {
            retinue_core::Lookup::NotAddressable(
                _,
                retinue_core::Unaddressable::Tombstoned { reason: TombstoneReason::Manual, .. },
            ) => {}
            other => return Err(format!("tombstoned child {sa} reads as {other:?}")),
        }
    }
    let overspend = verify_budgets(&store)?;
    // Ledger: keys ↔ rows, totals = rows = sum over the keys' usage.
    let mut present = 0usize;
    let mut want: BTreeMap<String, f64> = BTreeMap::new();
    let mut rows_total = 0usize;
    for p in 0..4u64 {
        let parent = parent_of(p);
        let rows = retinue_usage::load_child_usage_attributions(&store, &parent).ctx("rows")?;
        rows_total += rows.len();
        let totals = retinue_usage::load_child_usage_totals(&store, &parent).ctx("totals")?;
        let sum: f64 = rows.iter().map(|r| r.usage["cost_usd"].as_f64().unwrap_or(0.0)).sum();
        if (sum - totals.cost_usd).abs() > 1e-6 {
            return Err(format!("totals of {parent}: {} != rows {sum}", totals.cost_usd));
        }
        want.insert(parent, sum);
    }
    let written: HashSet<&String> = tally.keys_written.iter().collect();
    if written.len() != tally.keys_written.len() {
        return Err("a ledger key was written twice".to_owned());
    }
    let mut by_key: BTreeMap<String, f64> = BTreeMap::new();
    for k in 0..keys {
        let key = format!("key-{k}");
        if written.contains(&key) {
            present += 1;
            *by_key.entry(parent_of(k)).or_default() +=
                usage_of(k)["cost_usd"].as_f64().unwrap_or(0.0);
        }
    }
    if present != rows_total {
        return Err(format!("{present} keys written but {rows_total} ledger rows"));
    }
    for (parent, sum) in &want {
        let expected = by_key.get(parent).copied().unwrap_or(0.0);
        if (sum - expected).abs() > 1e-6 {
            return Err(format!("ledger of {parent} sums to {sum}, its keys to {expected}"));
        }
    }
    // Delivery: drain what is left, then every completion was delivered once.
    let mut acked: Vec<String> = tally.acked.clone();
    while let Some(c) = store.claim_delivery(&DeliveryFilter::default()).ctx("drain")? {
        if !store.ack_delivery(&c.delegation_id, &c.token).ctx("drain ack")? {
            return Err(format!("drain ack of {} failed", c.delegation_id));
        }
        acked.push(c.delegation_id);
    }
    let unique: HashSet<&String> = acked.iter().collect();
    if unique.len() != acked.len() {
        return Err("a completion was delivered twice".to_owned());
    }
    let conn = rusqlite::Connection::open(db).ctx("raw open")?;
    let (completed, delivered_once, claims_held): (i64, i64, i64) = conn
        .query_row(
            "SELECT (SELECT count(*) FROM async_delegations WHERE event_json IS NOT NULL), \
             (SELECT count(*) FROM async_delegations WHERE delivery_state = 'delivered' \
              AND delivery_attempts = 1), \
             (SELECT count(*) FROM retinue_children WHERE resume_claim IS NOT NULL)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .ctx("delivery counts")?;
    if usize::try_from(completed).ok() != Some(acked.len()) || completed != delivered_once {
        return Err(format!(
            "{completed} completions, {} acknowledged, {delivered_once} delivered after one attempt",
            acked.len()
        ));
    }
    if claims_held != 0 {
        return Err(format!("{claims_held} resume claims still held"));
    }
    Ok((present, acked.len(), overspend))
}

/// The waiter leg: `units` background completions of one parent, each
/// waited for by `waiters` threads at once (each with its own store handle,
/// as separate `retinue wait` processes would be); every unit must be
/// delivered to exactly one waiter, the others told `already_delivered`.
/// Returns the units raced for.
pub fn waiter_race(db: &Path, waiters: u32, units: usize) -> Outcome<usize> {
    use retinue_delegate::{CancelToken, Collector, ParentContext, WaitState};
    let store = Arc::new(crate::open_store(db, MAX_RETAINED)?);
    let parent = "P-race";
    store
        .create_session(&NewSession {
            id: parent.to_owned(),
            source: "cli".to_owned(),
            ..NewSession::default()
        })
        .ctx("race parent")?;
    let mut ids = Vec::with_capacity(units);
    for u in 0..units {
        let draft = UnitDraft {
            parent_session_id: Some(parent.to_owned()),
            owner_profile: crate::PROFILE.to_owned(),
            children: vec![ChildManifest {
                subagent_id: format!("sa-0-race{u:04}"),
                session_id: format!("race-{u}"),
                ..ChildManifest::default()
            }],
            ..UnitDraft::default()
        };
        let id = store.insert_unit(&draft).ctx("race unit")?;
        let completion = Completion {
            delegation_id: id.clone(),
            status: retinue_core::UnitState::Completed,
            event: retinue_core::CompletionEvent::from_stored(
                &id,
                json!({"type": "async_delegation", "delegation_id": id, "status": "completed"}),
            ),
            result: json!({"status": "completed"}),
            usage: None,
            background: true,
        };
        store.persist_completion(&completion).ctx("race completion")?;
        ids.push(id);
    }
    let barrier = std::sync::Barrier::new(usize::try_from(waiters).unwrap_or(8));
    let outcomes: Vec<Outcome<Vec<WaitState>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..waiters)
            .map(|_| {
                let (ids, barrier) = (&ids, &barrier);
                scope.spawn(move || -> Outcome<Vec<WaitState>> {
                    let store = Arc::new(crate::open_store(db, MAX_RETAINED)?);
                    let authority = Arc::new(retinue_lineage::Authority::new(
                        store.clone(),
                        store.clone(),
                        crate::PROFILE,
                    ));
                    let c =
                        Collector::new(retinue_core::Backend::of(store), authority, crate::PROFILE);
                    let who = ParentContext {
                        session_id: Some(parent.to_owned()),
                        ..ParentContext::default()
                    };
                    barrier.wait();
                    let report = c
                        .wait(ids, &who, Duration::from_secs(5), false, &CancelToken::new())
                        .map_err(|e| format!("wait: {e}"))?;
                    Ok(report.entries.iter().map(|e| e.state).collect())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a waiter panicked".to_owned())))
            .collect()
    });
    let mut delivered = vec![0usize; ids.len()];
    for outcome in outcomes {
        for (i, state) in outcome?.into_iter().enumerate() {
            match state {
                WaitState::Delivered => delivered[i] += 1,
                WaitState::AlreadyDelivered => {}
                other => return Err(format!("waiter got {other:?} for {}", ids[i])),
            }
        }
    }
    if let Some(i) = delivered.iter().position(|n| *n != 1) {
        return Err(format!("{} was delivered to {} waiters, not 1", ids[i], delivered[i]));
    }
    Ok(ids.len())
}

/// Runs the contention harness.
pub fn run(opts: &ContentionOptions) -> Outcome<ContentionReport> {
    std::fs::create_dir_all(opts.dir.join("claims")).ctx("witness dir")?;
    std::fs::create_dir_all(opts.dir.join("delivered")).ctx("witness dir")?;
    let db = opts.dir.join("state.db");
    seed_db(&db)?;
    let mut rng = Rng::new(opts.seed);
    let start = Instant::now();
    let mut children = Vec::new();
    for i in 0..opts.procs {
        let out = opts.dir.join(format!("proc-{i}.json"));
        let child = Command::new(&opts.exe)
            .arg("contention-proc")
            .arg("--db")
            .arg(&db)
            .arg("--out")
            .arg(&out)
            .args(["--threads", &opts.threads.to_string()])
            .args(["--ops", &opts.ops.to_string()])
            .args(["--procs", &opts.procs.to_string()])
            .args(["--seed", &rng.next_u64().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .ctx("spawn a contention process")?;
        children.push((child, out));
    }
    let mut tally = Tally::default();
    for (child, out) in children {
        let output = child.wait_with_output().ctx("wait for a contention process")?;
        if !output.status.success() {
            return Err(format!(
                "contention process failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let text = std::fs::read_to_string(&out).ctx("read a tally")?;
        let v: Value = serde_json::from_str(&text).ctx("parse a tally")?;
        tally.merge(Tally::from_json(&v));
    }
    let secs = crate::secs_since(start);
    let (keys, delivered, overspend_usd) = verify(&db, &tally, key_space(opts.ops, opts.procs))?;
    let raced_units = waiter_race(&db, opts.threads.max(8), 24)?;
    Ok(ContentionReport {
        raced_units,
        procs: opts.procs,
        threads: opts.threads,
        ops: tally.counts.values().sum(),
        counts: tally.counts,
        busy: tally.busy,
        claim_busy: tally.claim_busy,
        keys,
        delivered,
        budget_held: tally.budget_held,
        budget_refused: tally.budget_refused,
        overspend_usd,
        secs,
        seed: opts.seed,
    })
}
