//! The spawn's resource guards (issue #25): a background slot, a budget
//! reservation and the unit's row are given back or finalised on every
//! path — a thread that cannot start, a panic in the run step, a panic in
//! the finalize step — on a real SQLite store with the scripted runtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use retinue_config::DelegationConfig;
use retinue_core::{
    AttributionDraft, Backend, BudgetLimit, Budgets, ManualClock, NewSession, Result, SessionCost,
    SessionStore, TotalsSnapshot, TotalsUpdate, UsageAttribution, UsageLedger,
};
use retinue_delegate::{Delegator, DelegatorParts, ParentContext, ThreadStarter};
use retinue_lineage::Authority;
use retinue_store::{Store, StoreOptions};
use retinue_testkit::T0;
use retinue_testkit::scripted::{Script, ScriptedRuntime};
use serde_json::{Value, json};

struct Fx {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    config: DelegationConfig,
}

/// A store under a $1 lineage budget with one background slot.
fn fx() -> Fx {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = Arc::new(ManualClock::new(T0));
    let opts = StoreOptions::default().with_clock(clock);
    let store = Arc::new(Store::open(dir.path().join("state.db"), opts).expect("open"));
    store
        .create_session(&NewSession {
            id: "P".into(),
            source: "cli".into(),
            ..NewSession::default()
        })
        .expect("parent");
    let config = DelegationConfig {
        budget: BudgetLimit { max_cost_usd: Some(1.0), max_tokens: None },
        max_concurrent_children: 1,
        ..DelegationConfig::default()
    };
    Fx { _dir: dir, store, config }
}

fn parts(fx: &Fx, backend: Backend, runtime: ScriptedRuntime) -> DelegatorParts {
    DelegatorParts {
        backend,
        authority: Arc::new(Authority::new(fx.store.clone(), fx.store.clone(), "")),
        runtime: Arc::new(runtime),
        completions: None,
        config: (&fx.config).into(),
        profile: String::new(),
    }
}

fn background() -> (Value, ParentContext) {
    let parent = ParentContext {
        session_id: Some("P".into()),
        can_receive_detached: true,
        ..ParentContext::default()
    };
    (json!({"goal": "in the background", "background": true}), parent)
}

/// Nothing of the lineage's budget is held by an open reservation.
fn reserved_nothing(fx: &Fx) {
    let status =
        fx.store.budget_status("P", &["P".to_owned()], fx.config.budget).expect("budget status");
    assert_eq!(status.reserved.cost_usd, 0.0, "{status:?}");
    assert_eq!(status.reserved.tokens, 0, "{status:?}");
}

/// The units of the store and their states, as stored.
fn units(fx: &Fx) -> Vec<(String, String)> {
    let conn = rusqlite::Connection::open(fx.store.path()).expect("raw open");
    let mut stmt = conn
        .prepare("SELECT delegation_id, state FROM async_delegations ORDER BY rowid")
        .expect("prepare");
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .expect("query")
        .collect::<rusqlite::Result<_>>()
        .expect("rows")
}

fn unit_state(fx: &Fx, delegation_id: &str) -> String {
    units(fx).into_iter().find(|(id, _)| id == delegation_id).map(|(_, s)| s).unwrap_or_default()
}

#[test]
fn a_background_thread_that_cannot_start_finalises_its_unit_and_gives_everything_back() {
    let fx = fx();
    let first = Arc::new(AtomicBool::new(true));
    let fail_once = first.clone();
    let threads: ThreadStarter = Arc::new(move |name, body| {
        if fail_once.swap(false, Ordering::SeqCst) {
            drop(body);
            return Err(std::io::Error::other("injected: no thread for you"));
        }
        std::thread::Builder::new().name(name).spawn(body)
    });
    let tool = Delegator::new_with_threads(
        parts(&fx, Backend::of(fx.store.clone()), ScriptedRuntime::new()),
        threads,
    );
    let (args, parent) = background();
    let out = tool.delegate_task(&args, Some(&parent));
    let e = out["error"].as_str().unwrap_or_else(|| panic!("expected an error: {out}"));
    assert!(e.contains("could not start the background unit"), "{out}");
    // The unit is finalised as failed, never left running.
    let units = units(&fx);
    assert_eq!(units.len(), 1, "{units:?}");
    assert_eq!(units[0].1, "error", "{units:?}");
    // The reservation was given back.
    reserved_nothing(&fx);
    // The slot was given back: the next background call is dispatched
    // (one slot only: a held one would make it run synchronously).
    let again = tool.delegate_task(&args, Some(&parent));
    assert_eq!(again["mode"], "background", "{again}");
    tool.wait_background();
    reserved_nothing(&fx);
}

/// A ledger whose first write panics (a bug in an embedder's ledger).
struct PanickingLedger {
    inner: Arc<Store>,
    panics: AtomicUsize,
}

impl UsageLedger for PanickingLedger {
    fn record_usage(&self, draft: &AttributionDraft, totals: &TotalsUpdate) -> Result<bool> {
        if self.panics.fetch_sub(1, Ordering::SeqCst) > 0 {
            panic!("injected: the ledger panicked");
        }
        self.inner.record_usage(draft, totals)
    }
    fn usage_attributions(&self, parent: &str) -> Result<Vec<UsageAttribution>> {
        self.inner.usage_attributions(parent)
    }
    fn usage_totals_snapshot(&self, parent: &str) -> Result<TotalsSnapshot> {
        self.inner.usage_totals_snapshot(parent)
    }
    fn session_cost(&self, session: &str) -> Result<Option<SessionCost>> {
        self.inner.session_cost(session)
    }
    fn write_session_cost(&self, session: &str, cost: &SessionCost) -> Result<bool> {
        self.inner.write_session_cost(session, cost)
    }
}

#[test]
fn a_panic_in_the_finalize_step_keeps_the_spend_and_gives_the_slot_back() {
    let fx = fx();
    let ledger = Arc::new(PanickingLedger { inner: fx.store.clone(), panics: AtomicUsize::new(1) });
    let backend = Backend { ledger, ..Backend::of(fx.store.clone()) };
    let tool = Delegator::new(parts(&fx, backend, ScriptedRuntime::new()));
    let (args, parent) = background();
    let out = tool.delegate_task(&args, Some(&parent));
    assert_eq!(out["mode"], "background", "{out}");
    let id = out["delegation_id"].as_str().expect("id").to_owned();
    tool.wait_background();
    // The run spent $0.01 that no ledger row holds: kept as spent, not open.
    reserved_nothing(&fx);
    let status = fx.store.budget_status("P", &["P".to_owned()], fx.config.budget).expect("s");
    assert!(status.spent.cost_usd >= 0.01 - 1e-9, "the spend was given back: {status:?}");
    // The unit is finalised (its thread caught the panic), never left running.
    assert_eq!(unit_state(&fx, &id), "error");
    // The slot came back: the next background call is dispatched.
    let again = tool.delegate_task(&args, Some(&parent));
    assert_eq!(again["mode"], "background", "{again}");
    tool.wait_background();
}

#[test]
fn a_panic_in_the_run_step_is_a_failed_child_and_releases_everything() {
    let fx = fx();
    let runtime = ScriptedRuntime::new()
        .with_script("boom", Script { panic: Some("injected".into()), ..Script::default() });
    let tool = Delegator::new(parts(&fx, Backend::of(fx.store.clone()), runtime));
    let out = tool.delegate_task(
        &json!({"goal": "boom"}),
        Some(&ParentContext { session_id: Some("P".into()), ..ParentContext::default() }),
    );
    assert_eq!(out["results"][0]["status"], "error", "{out}");
    reserved_nothing(&fx);
}

#[test]
fn a_panic_while_resuming_releases_the_resume_claim() {
    let fx = fx();
    // A retained child with a transcript (the seed's fixture).
    for (id, source, parent) in [("A", "cli", None), ("child-sess-1", "delegate", Some("A"))] {
        fx.store
            .create_session(&NewSession {
                id: id.into(),
                source: source.into(),
                parent_session_id: parent.map(str::to_owned),
                model_config: parent.map(|p| json!({"_delegate_from": p})),
                ..NewSession::default()
            })
            .expect("session");
    }
    for (role, text) in [("user", "original goal"), ("assistant", "original answer")] {
        let m = retinue_core::Message {
            role: role.into(),
            content: Some(text.into()),
            ..retinue_core::Message::default()
        };
        fx.store.append_message("child-sess-1", &m).expect("append");
    }
    retinue_testkit::dispatch_and_retain(&*fx.store, "A");
    let ledger = Arc::new(PanickingLedger { inner: fx.store.clone(), panics: AtomicUsize::new(1) });
    let backend = Backend { ledger, ..Backend::of(fx.store.clone()) };
    let tool = Delegator::new(parts(&fx, backend, ScriptedRuntime::new()));
    let parent = ParentContext { session_id: Some("A".into()), ..ParentContext::default() };
    let args = json!({"follow_up": "child-sess-1", "goal": "more"});
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tool.delegate_task(&args, Some(&parent))
    }));
    assert!(panicked.is_err(), "the injected ledger panic reaches the caller");
    // The claim was released on the way out: the child is not busy.
    let again = tool.delegate_task(&args, Some(&parent));
    assert_eq!(again["results"][0]["status"], "completed", "{again}");
}

#[test]
fn a_panic_in_the_persist_step_gives_the_reservation_back() {
    let fx = fx();
    let mut registry = retinue_core::MockRegistry::new();
    registry.expect_lookup().returning(|_| Ok(retinue_core::Lookup::Unknown));
    registry.expect_insert_unit().returning(|_| panic!("injected: the unit write panicked"));
    let backend = Backend { registry: Arc::new(registry), ..Backend::of(fx.store.clone()) };
    let tool = Delegator::new(parts(&fx, backend, ScriptedRuntime::new()));
    let parent = ParentContext { session_id: Some("P".into()), ..ParentContext::default() };
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tool.delegate_task(&json!({"goal": "never written"}), Some(&parent))
    }));
    assert!(panicked.is_err(), "the injected panic reaches the caller");
    // The reservation taken before the write was given back on the way out.
    reserved_nothing(&fx);
}
