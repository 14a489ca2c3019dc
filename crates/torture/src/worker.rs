//! The crash worker: a loop of committed registry operations, each logged
//! (fsync'd) after it commits, so the [`crate::crash`] harness can check that
//! everything reported as committed survives a SIGKILL.
//!
//! Operations: dispatch a unit (`insert_unit` with child sessions), complete
//! it (`persist_completion`, which retains on success), retain a unit that is
//! still running (as hermes may), tombstone a child, follow up a retained
//! child (resume claim, keyed usage, `finish_follow_up`), record keyed usage
//! (sometimes replaying a logged key, which must write nothing), and prune.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::Path;

use retinue_core::{
    AttributionDraft, ChildManifest, Claims, Completion, NewSession, RegistryRead, ResumeClaim,
    Retention, UnitDraft, UnitLifecycle, current_owner,
};
use retinue_store::Store;
use retinue_usage::record_child_usage_attribution;
use serde_json::{Value, json};

use crate::rng::Rng;
use crate::{Context, Outcome};

/// `max_retained` the worker and its checker use.
pub const MAX_RETAINED: u32 = 40;

/// Parent sessions the worker bills.
pub const PARENTS: [&str; 4] = ["P0", "P1", "P2", "P3"];

/// The deterministic usage of one attribution (exact binary fractions, so
/// sums compare exactly).
pub fn usage_of(n: u64) -> Value {
    let cost = f64::from(u32::try_from(n % 1000).unwrap_or(0)) / 64.0;
    json!({
        "cost_usd": cost,
        "tokens": {"input": n % 997, "output": n % 89},
        "api_calls": 1,
        "status": "completed",
    })
}

struct OpLog {
    file: File,
}

impl OpLog {
    fn open(path: &Path) -> Outcome<OpLog> {
        let file = OpenOptions::new().create(true).append(true).open(path).ctx("open op log")?;
        Ok(OpLog { file })
    }

    /// Appends one line and fsyncs it: only then is the operation "reported".
    fn record(&mut self, entry: &Value) -> Outcome<()> {
        let line = format!("{entry}\n");
        self.file.write_all(line.as_bytes()).ctx("write op log")?;
        self.file.sync_data().ctx("fsync op log")
    }
}

/// The lineage whose budget the workers share.
pub const BUDGET_ROOT: &str = "BUDGET";

/// Its limit: one dollar.
pub const BUDGET: retinue_core::BudgetLimit =
    retinue_core::BudgetLimit { max_cost_usd: Some(1.0), max_tokens: None };

/// A protocol violation the worker can see by itself (exit status 3).
pub const VIOLATION_EXIT: i32 = 3;

struct Worker {
    store: Store,
    log: OpLog,
    rng: Rng,
    running: Vec<String>,
    logged_keys: Vec<(String, String, u64)>,
    counter: u64,
    tag: String,
}

impl Worker {
    fn dispatch(&mut self) -> Outcome<()> {
        let parent = PARENTS[self.rng.index(PARENTS.len())].to_owned();
        let n = usize::try_from(self.rng.range(1, 3)).unwrap_or(1);
        let mut children = Vec::new();
        let mut sessions = Vec::new();
        for i in 0..n {
            let sid = format!("cs-{}", self.rng.hex(16));
            children.push(ChildManifest {
                subagent_id: format!("sa-{i}-{}", self.rng.hex(8)),
                session_id: sid.clone(),
                model: Some("torture/model".to_owned()),
                goal: Some(format!("task {i} of {}", self.counter)),
                ..ChildManifest::default()
            });
            sessions.push(NewSession {
                id: sid,
                source: "delegate".to_owned(),
                model: Some("torture/model".to_owned()),
                model_config: Some(json!({ "_delegate_from": parent })),
                parent_session_id: Some(parent.clone()),
                profile_name: None,
                started_at: None,
            });
        }
        let (pid, fp) = current_owner();
        let draft = UnitDraft {
            parent_session_id: Some(parent.clone()),
            owner_pid: Some(pid),
            owner_started_at: fp,
            task: json!({"goal": "torture", "is_batch": n > 1}),
            owner_profile: crate::PROFILE.to_owned(),
            children: children.clone(),
            child_sessions: sessions,
            ..UnitDraft::default()
        };
        let id = self.store.insert_unit(&draft).ctx("insert_unit")?;
        self.running.push(id.clone());
        let kids: Vec<Value> =
            children.iter().map(|c| json!([c.subagent_id, c.session_id])).collect();
        self.log.record(&json!({"op": "dispatch", "id": id, "parent": parent, "children": kids}))
    }

    fn complete(&mut self) -> Outcome<()> {
        if self.running.is_empty() {
            return self.dispatch();
        }
        let id = self.running.swap_remove(self.rng.index(self.running.len()));
        let status = if self.rng.chance(80) { "completed" } else { "failed" };
        let c = Completion {
            delegation_id: id.clone(),
            status: retinue_core::UnitState::parse(status),
            event: retinue_core::CompletionEvent::from_stored(
                &id,
                json!({"type": "async_delegation", "delegation_id": id, "status": status}),
            ),
            result: json!({"status": status}),
            usage: Some(usage_of(self.counter)),
            background: self.rng.chance(50),
        };
        if !self.store.persist_completion(&c).ctx("persist_completion")? {
            return Err(format!("persist_completion({id}) found no unit"));
        }
        self.log.record(&json!({"op": "complete", "id": id, "status": status}))
    }

    fn retain_running(&mut self) -> Outcome<()> {
        if self.running.is_empty() {
            return self.dispatch();
        }
        let id = self.running.swap_remove(self.rng.index(self.running.len()));
        if self.store.retain_completed_delegation(&id, None).ctx("retain")? {
            self.log.record(&json!({"op": "retain", "id": id}))?;
        }
        Ok(())
    }

    fn tombstone(&mut self) -> Outcome<()> {
        let live = self.store.list_retained_children().ctx("list")?;
        let Some(entry) = self.rng.pick(&live) else { return Ok(()) };
        let reason = retinue_core::TombstoneReason::Manual;
        if self.store.tombstone_retained_child(entry.child_id(), &reason).ctx("tombstone")? {
            self.log.record(&json!({
                "op": "tombstone", "id": entry.delegation_id, "index": entry.child_index,
            }))?;
        }
        Ok(())
    }

    fn usage(&mut self, key: String, parent: &str, n: u64, child: &str) -> Outcome<bool> {
        let draft = AttributionDraft {
            parent_session_id: parent.to_owned(),
            parent_turn_id: String::new(),
            child_session_id: child.to_owned(),
            usage: usage_of(n),
            aggregate: None,
            key: Some(key.clone()),
        };
        let wrote = record_child_usage_attribution(&self.store, &draft).ctx("record usage")?;
        if wrote {
            self.log.record(&json!({"op": "usage", "key": key, "parent": parent, "n": n}))?;
            self.logged_keys.push((key, parent.to_owned(), n));
        }
        Ok(wrote)
    }

    fn follow_up(&mut self) -> Outcome<()> {
        let live = self.store.list_retained_children().ctx("list")?;
        let Some(entry) = self.rng.pick(&live).cloned() else { return Ok(()) };
        let token = match self.store.claim_resume(&entry.delegation_id, entry.child_index) {
            Ok(ResumeClaim::Claimed { token }) => token,
            // A claim left by a killed worker holds until its lease expires.
            Ok(ResumeClaim::Busy { .. } | ResumeClaim::Unavailable) => return Ok(()),
            Err(e) => return Err(format!("claim_resume: {e}")),
        };
        let key = format!("{}:{}:{token}", entry.delegation_id, entry.child_index);
        let n = self.counter;
        if !self.usage(key, &entry.parent_session_id, n, &entry.child_session_id)? {
            return Err("a fresh follow-up key was already recorded".to_owned());
        }
        let usage = usage_of(n);
        let expected = self.store.unit_usage(&entry.delegation_id).ctx("unit_usage")?;
        let swap = retinue_core::UsageSwap { expected, new: usage };
        let released = self
            .store
            .finish_follow_up(&entry.delegation_id, entry.child_index, &token, Some(&swap))
            .ctx("finish_follow_up")?;
        if !released {
            return Err(format!("finish_follow_up lost the claim of {}", entry.delegation_id));
        }
        self.log.record(&json!({
            "op": "follow_up", "id": entry.delegation_id, "index": entry.child_index,
            "token": token,
        }))
    }

    fn plain_usage(&mut self) -> Outcome<()> {
        if self.rng.chance(15)
            && let Some((key, parent, n)) = self.rng.pick(&self.logged_keys).cloned()
        {
            // A replayed finalize: the key is known, nothing may be written.
            if self.usage(key.clone(), &parent, n, "")? {
                eprintln!("VIOLATION: replayed key {key} was recorded twice");
                std::process::exit(VIOLATION_EXIT);
            }
            return Ok(());
        }
        let parent = PARENTS[self.rng.index(PARENTS.len())];
        let key = format!("u-{}-{}", self.tag, self.counter);
        let n = self.counter;
        self.usage(key, parent, n, "").map(|_| ())
    }

    /// Reserves $0.05 of the shared budget, bills at most that, settles: a
    /// kill in between leaves a reservation that recovery must release.
    fn budget(&mut self) -> Outcome<()> {
        use retinue_core::{Budgets, Reservation, ReservationDraft, Spend};
        let draft = ReservationDraft {
            lineage_root: BUDGET_ROOT.to_owned(),
            sessions: vec![BUDGET_ROOT.to_owned()],
            limit: BUDGET,
            minimum: Spend { cost_usd: 0.05, tokens: 0 },
            maximum: Some(Spend { cost_usd: 0.05, tokens: 0 }),
            delegation_id: None,
        };
        let Reservation::Held { id, granted, .. } = self.store.reserve(&draft).ctx("reserve")?
        else {
            return Ok(());
        };
        let spent = granted.cost_usd
            * f64::from(u32::try_from(self.rng.range(0, 100)).unwrap_or(0))
            / 100.0;
        let row = retinue_core::AttributionDraft {
            parent_session_id: BUDGET_ROOT.to_owned(),
            usage: json!({"cost_usd": spent, "tokens": {"input": 0, "output": 0}}),
            key: Some(format!("b-{}-{}", self.tag, self.counter)),
            ..retinue_core::AttributionDraft::default()
        };
        retinue_usage::record_child_usage_attribution(&self.store, &row)
            .map_err(|e| format!("budget bill: {e}"))?;
        self.store.settle(&id, &retinue_core::SettleReason::Settled).ctx("settle").map(|_| ())
    }

    fn step(&mut self) -> Outcome<()> {
        self.counter += 1;
        match self.rng.below(100) {
            0..30 => self.dispatch(),
            30..55 => self.complete(),
            55..58 => self.retain_running(),
            58..68 => self.tombstone(),
            68..83 => self.follow_up(),
            83..93 => self.plain_usage(),
            93..98 => self.budget(),
            _ => self.store.prune_retained_children(None, None).ctx("prune").map(|_| ()),
        }
    }
}

/// Runs the worker on `db`, logging to `log`, until killed (or `max_ops`).
pub fn run(db: &Path, log: &Path, seed: u64, max_ops: Option<u64>) -> Outcome<()> {
    let mut log = OpLog::open(log)?;
    // A line cut by the previous kill ends here; the checker skips it.
    log.file.write_all(b"\n").ctx("write op log")?;
    log.record(&json!({"op": "start", "pid": std::process::id(), "seed": seed}))?;
    let store = crate::open_store(db, MAX_RETAINED)?;
    let mut rng = Rng::new(seed);
    let tag = rng.hex(8);
    let mut w =
        Worker { store, log, rng, running: Vec::new(), logged_keys: Vec::new(), counter: 0, tag };
    loop {
        if max_ops.is_some_and(|m| w.counter >= m) {
            return Ok(());
        }
        w.step()?;
    }
}
