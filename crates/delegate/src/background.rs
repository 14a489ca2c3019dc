//! Background units from the parent's side (semantics §11, issue #26).
//!
//! A running unit keeps a [`Watch`]: a thread that takes the unit's
//! controls from the registry's mailbox ([`retinue_core::Controls`]) every
//! [`CONTROL_POLL_MS`] and acts on them — a cancel stops the children
//! (exit reason `cancelled`), a steer is handed to the running child or
//! settled `missed` and reported in the child's `missed_steer`. The mailbox
//! is in the registry, so a parent in another process (`retinue steer`,
//! `retinue cancel`, an MCP server) reaches a detached worker.
//!
//! The parent collects results with [`Delegator::wait`] (each completion is
//! delivered exactly once: the registry's delivery claim decides between
//! racing waiters), or with [`Delegator::take_inbox`] (what finished since,
//! attached to the next tool result). Every id is authority-checked like a
//! follow-up; a foreign id answers exactly as a missing one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use retinue_core::{
    CONTROL_POLL_MS, ChildManifest, Control, ControlKind, ControlOutcome, DeliveryFilter,
    RetainedChild, UnitState, UnitView,
};
use serde_json::{Value, json};

use crate::results::ChildReport;
use crate::{DelegateError, Inner, ParentContext};
use retinue_core::Backend;
use retinue_core::run::{CancelToken, ChildHandle};
use retinue_lineage::LineageAuthority;

/// How long `steer` and `cancel` wait for the worker to take their control.
const TAKE_WAIT: Duration = Duration::from_secs(10);
/// How often a waiter looks for workers that died.
const RECOVER_EVERY: Duration = Duration::from_secs(1);

fn poll() -> Duration {
    Duration::from_millis(CONTROL_POLL_MS)
}

/// The control watcher of one running unit.
pub(crate) struct Watch {
    inner: Arc<Inner>,
    delegation_id: String,
    children: Vec<ChildHandle>,
    cancel: CancelToken,
    missed: Arc<Mutex<Vec<(String, String)>>>,
    /// Steers taken for a child that has not started (a queued unit, a
    /// batch child waiting for a worker): retried each poll, settled
    /// `missed` only when the children have ended.
    held: Arc<Mutex<Vec<Control>>>,
    /// Set once the children have returned: a control taken from then on
    /// finds them ended.
    ending: Arc<AtomicBool>,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    /// Starts watching `delegation_id`'s mailbox while its children run.
    pub(crate) fn start(
        inner: &Arc<Inner>,
        delegation_id: &str,
        children: Vec<ChildHandle>,
        cancel: &CancelToken,
    ) -> Watch {
        let mut watch = Watch {
            inner: Arc::clone(inner),
            delegation_id: delegation_id.to_owned(),
            children,
            cancel: cancel.clone(),
            missed: Arc::default(),
            held: Arc::default(),
            ending: Arc::default(),
            stop: None,
            thread: None,
        };
        let (tx, rx) = mpsc::channel::<()>();
        let worker = watch.clone_parts();
        let started =
            std::thread::Builder::new().name(format!("watch-{delegation_id}")).spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(poll()) {
                    worker.poll_once(false);
                }
            });
        match started {
            Ok(h) => {
                watch.stop = Some(tx);
                watch.thread = Some(h);
            }
            Err(e) => log::warn!(
                "unit {delegation_id}: no control watcher ({e}); steer and cancel reach it \
                 only when it ends"
            ),
        }
        watch
    }

    fn clone_parts(&self) -> Watch {
        Watch {
            inner: Arc::clone(&self.inner),
            delegation_id: self.delegation_id.clone(),
            children: self.children.clone(),
            cancel: self.cancel.clone(),
            missed: Arc::clone(&self.missed),
            held: Arc::clone(&self.held),
            ending: Arc::clone(&self.ending),
            stop: None,
            thread: None,
        }
    }

    /// Retries the held steers, takes the pending controls and acts on
    /// them; `ended`: the children have finished, so every steer is missed
    /// and a cancel is moot.
    fn poll_once(&self, ended: bool) {
        let ended = ended || self.ending.load(Ordering::SeqCst);
        let controls = &self.inner.parts.backend.controls;
        let held = std::mem::take(&mut *self.held.lock().unwrap_or_else(PoisonError::into_inner));
        let taken = match controls.take_controls(&self.delegation_id) {
            Ok(t) => t,
            Err(e) => {
                log::debug!("unit {}: controls not read: {e}", self.delegation_id);
                Vec::new()
            }
        };
        for control in held.into_iter().chain(taken) {
            match self.act(&control, ended) {
                Some(outcome) => {
                    if let Err(e) = controls.settle_control(control.id, outcome) {
                        log::warn!(
                            "unit {}: control {} not settled: {e}",
                            self.delegation_id,
                            control.id
                        );
                    }
                }
                None => self.held.lock().unwrap_or_else(PoisonError::into_inner).push(control),
            }
        }
    }

    /// What became of a control; `None`: a steer its child cannot take yet
    /// (held, and tried again).
    fn act(&self, control: &Control, ended: bool) -> Option<ControlOutcome> {
        match control.kind {
            ControlKind::Cancel if ended => Some(ControlOutcome::Missed),
            ControlKind::Cancel => {
                log::info!("unit {}: cancelled by its parent", self.delegation_id);
                self.cancel.cancel_requested();
                Some(ControlOutcome::Delivered)
            }
            ControlKind::Steer => {
                let message = control.message.clone().unwrap_or_default();
                let child = match &control.subagent_id {
                    Some(id) => self.children.iter().find(|c| &c.subagent_id == id),
                    None if self.children.len() == 1 => self.children.first(),
                    None => None,
                };
                let Some(child) = child else { return Some(ControlOutcome::Missed) };
                if !ended && self.inner.parts.runtime.steer(child, &message) {
                    Some(ControlOutcome::Delivered)
                } else if !ended {
                    None
                } else {
                    self.missed
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push((child.subagent_id.clone(), message));
                    Some(ControlOutcome::Missed)
                }
            }
        }
    }

    /// Stops watching, settles what arrived too late as missed, and adds
    /// the missed steers to the children's reports.
    pub(crate) fn finish(mut self, mut results: Vec<ChildReport>) -> Vec<ChildReport> {
        self.ending.store(true, Ordering::SeqCst);
        drop(self.stop.take());
        if let Some(h) = self.thread.take()
            && h.join().is_err()
        {
            log::error!("unit {}: the control watcher panicked", self.delegation_id);
        }
        self.poll_once(true);
        let missed =
            std::mem::take(&mut *self.missed.lock().unwrap_or_else(PoisonError::into_inner));
        for (subagent_id, message) in missed {
            if let Some(r) = results.iter_mut().find(|r| r.subagent_id == subagent_id)
                && !r.missed_steer.contains(&message)
            {
                r.missed_steer.push(message);
            }
        }
        results
    }
}

/// What a waiter got for one id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitState {
    /// Finished, and its result is delivered to this waiter (exactly once).
    Delivered,
    /// Finished; read without consuming (`--peek`).
    Peeked,
    /// Finished, but its result was delivered before (to another waiter,
    /// a task poll or a tool result): never again.
    AlreadyDelivered,
    /// Still running when the wait ended.
    Running,
    /// No unit this parent may address (foreign ≡ missing).
    NotFound,
}

impl WaitState {
    /// The JSON word.
    pub fn as_str(self) -> &'static str {
        match self {
            WaitState::Delivered => "delivered",
            WaitState::Peeked => "peeked",
            WaitState::AlreadyDelivered => "already_delivered",
            WaitState::Running => "running",
            WaitState::NotFound => "not_found",
        }
    }
}

/// One id's answer to a wait.
#[derive(Debug, Clone, PartialEq)]
pub struct WaitEntry {
    /// The id as given.
    pub id: String,
    /// What the waiter got.
    pub state: WaitState,
    /// The unit, when addressable.
    pub unit: Option<UnitView>,
}

impl WaitEntry {
    /// `{id, status, delegation_id?, state?, elapsed_seconds?, result?}`.
    pub fn to_json(&self, now: f64) -> Value {
        let mut out = json!({ "id": self.id, "status": self.state.as_str() });
        if let Some(u) = &self.unit {
            out["delegation_id"] = json!(u.delegation_id);
            out["state"] = json!(u.state.as_str());
            let end = u.completed_at.unwrap_or(now);
            out["elapsed_seconds"] = crate::results::seconds((end - u.dispatched_at).max(0.0));
            if matches!(self.state, WaitState::Delivered | WaitState::Peeked) {
                out["result"] = u.result.clone().unwrap_or(Value::Null);
            }
            if self.state == WaitState::Running {
                out["children"] = json!(
                    u.children
                        .iter()
                        .map(|c| json!({"subagent_id": c.subagent_id, "session_id": c.child_session_id}))
                        .collect::<Vec<_>>()
                );
            }
        }
        out
    }
}

/// The answer to a wait.
#[derive(Debug, Clone, PartialEq)]
pub struct WaitReport {
    /// One entry per id, in the order given.
    pub entries: Vec<WaitEntry>,
    /// The timeout passed with some unit still running.
    pub timed_out: bool,
}

impl WaitReport {
    /// `{results: [...], timed_out, still_running: [...]}`.
    pub fn to_json(&self) -> Value {
        let now = now_secs();
        json!({
            "results": self.entries.iter().map(|e| e.to_json(now)).collect::<Vec<_>>(),
            "timed_out": self.timed_out,
            "still_running": self
                .entries
                .iter()
                .filter(|e| e.state == WaitState::Running)
                .map(|e| e.id.clone())
                .collect::<Vec<_>>(),
        })
    }
}

/// What became of a steer.
#[derive(Debug, Clone, PartialEq)]
pub struct SteerReport {
    /// The child steered.
    pub subagent_id: String,
    /// Its unit.
    pub delegation_id: String,
    /// `Delivered` (handed to the running child), `Missed` (it had
    /// finished: reported as `missed_steer`), or `Pending`/`Taken` (the
    /// worker has not acted within the wait; it will, or settle it missed).
    pub outcome: ControlOutcome,
}

impl SteerReport {
    /// `{status, subagent_id, delegation_id}`; `status` is `delivered`,
    /// `missed_steer` or `queued`.
    pub fn to_json(&self) -> Value {
        let status = match self.outcome {
            ControlOutcome::Delivered => "delivered",
            ControlOutcome::Missed => "missed_steer",
            ControlOutcome::Pending | ControlOutcome::Taken => "queued",
        };
        json!({
            "status": status,
            "subagent_id": self.subagent_id,
            "delegation_id": self.delegation_id,
        })
    }
}

/// What became of a cancel.
#[derive(Debug, Clone, PartialEq)]
pub struct CancelReport {
    /// The unit.
    pub delegation_id: String,
    /// Whether the worker took it (`Delivered`); `Pending` when no worker
    /// acted within the wait.
    pub outcome: ControlOutcome,
    /// The unit's state after the wait.
    pub state: UnitState,
}

impl CancelReport {
    /// `{status, delegation_id, state}`; `status` is `cancelled` or
    /// `requested`.
    pub fn to_json(&self) -> Value {
        json!({
            "status": if self.outcome == ControlOutcome::Delivered { "cancelled" } else { "requested" },
            "delegation_id": self.delegation_id,
            "state": self.state.as_str(),
        })
    }
}

/// The wall clock, through core's [`retinue_core::Clock`].
fn now_secs() -> f64 {
    retinue_core::Clock::now(&retinue_core::SystemClock)
}

/// The parent's side of background units — look up, wait for, steer and
/// cancel units, take the inbox — over the registry alone: no runtime, so
/// any process may hold one (`retinue wait` runs no model).
#[derive(Clone)]
pub struct Collector {
    pub(crate) backend: Backend,
    pub(crate) authority: Arc<dyn LineageAuthority>,
    pub(crate) profile: String,
    /// Isolated children's worktrees, when this process keeps any.
    pub(crate) isolation: Option<Arc<dyn retinue_core::run::Isolation>>,
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collector").field("profile", &self.profile).finish_non_exhaustive()
    }
}

impl Collector {
    /// A collector acting for profile `profile`.
    pub fn new(backend: Backend, authority: Arc<dyn LineageAuthority>, profile: &str) -> Collector {
        Collector { backend, authority, profile: profile.to_owned(), isolation: None }
    }

    /// The unit `id` (a delegation id, subagent id or child session id) if
    /// `parent` may address it: same profile, and the unit's spawner in the
    /// caller's compression lineage. Anything else — missing, foreign,
    /// unreadable — is [`DelegateError::NotAddressable`] (fails closed).
    pub fn unit(&self, id: &str, parent: &ParentContext) -> Result<UnitView, DelegateError> {
        let target = id.trim();
        let denied = || DelegateError::NotAddressable { target: target.to_owned() };
        if target.is_empty() {
            return Err(denied());
        }
        let view = match self.backend.controls.unit_view(target) {
            Ok(Some(v)) => v,
            Ok(None) => return Err(denied()),
            Err(e) => {
                log::warn!("unit {target} not read: {e}");
                return Err(denied());
            }
        };
        if !retinue_core::Scope::of(&self.profile).admits(view.owner_profile.as_deref()) {
            return Err(denied());
        }
        let Some(owner) = view.parent_session_id.clone().filter(|p| !p.trim().is_empty()) else {
            return Err(denied());
        };
        let child = view
            .children
            .iter()
            .find(|c| c.subagent_id == target || c.child_session_id == target)
            .or_else(|| view.children.first());
        let entry = RetainedChild {
            delegation_id: view.delegation_id.clone(),
            parent_session_id: owner,
            owner_profile: view.owner_profile.clone().unwrap_or_default(),
            state: view.state.clone(),
            retained_at: None,
            completed_at: view.completed_at,
            child_index: child.map_or(0, |c| c.child_index),
            subagent_id: child.map(|c| c.subagent_id.clone()).unwrap_or_default(),
            child_session_id: child.map(|c| c.child_session_id.clone()).unwrap_or_default(),
            manifest: ChildManifest::default(),
        };
        let requester = parent.session_id.as_deref().map(str::trim).filter(|s| !s.is_empty());
        match self.authority.check_follow_up_authority(&entry, requester) {
            Ok(()) => Ok(view),
            Err(_) => Err(denied()),
        }
    }

    /// Marks the units of dead workers `unknown` and releases their budget
    /// reservations (the liveness check `wait` runs as it polls).
    pub fn recover_dead_workers(&self) {
        let backend = &self.backend;
        let report = backend.registry.recover_abandoned_delegations(&retinue_core::ProcProbe);
        if report.abandoned > 0 {
            log::info!("{} unit(s) of dead workers marked unknown", report.abandoned);
        }
        if let Err(e) = backend.budgets.release_abandoned_reservations(&retinue_core::ProcProbe) {
            log::warn!("reservations of dead workers not released: {e}");
        }
    }

    /// Waits up to `timeout` (or until `cancel` fires) for the units `ids`
    /// to finish, then delivers each finished one's result exactly once
    /// (`peek`: read it without consuming). Foreign and missing ids answer
    /// `not_found`; a result delivered before answers `already_delivered`.
    pub fn wait(
        &self,
        ids: &[String],
        parent: &ParentContext,
        timeout: Duration,
        peek: bool,
        cancel: &CancelToken,
    ) -> Result<WaitReport, DelegateError> {
        if ids.is_empty() {
            return Err(DelegateError::InvalidArguments(
                "Provide at least one delegation or subagent id to wait for.".to_owned(),
            ));
        }
        let deadline = Instant::now().checked_add(timeout);
        let mut last_recovery: Option<Instant> = None;
        let mut views: Vec<Option<UnitView>> =
            ids.iter().map(|id| self.unit(id, parent).ok()).collect();
        loop {
            let running = views.iter().flatten().any(|v| !v.is_finished());
            let out_of_time = deadline.is_none_or(|d| Instant::now() >= d) || cancel.is_cancelled();
            if !running || out_of_time {
                break;
            }
            if last_recovery.is_none_or(|t| t.elapsed() >= RECOVER_EVERY) {
                self.recover_dead_workers();
                last_recovery = Some(Instant::now());
            }
            cancel.sleep(poll());
            for (view, id) in views.iter_mut().zip(ids) {
                if view.as_ref().is_some_and(|v| !v.is_finished()) {
                    *view = self.unit(id, parent).ok();
                }
            }
        }
        let mut timed_out = false;
        let mut entries = Vec::with_capacity(ids.len());
        // A cancelled wait (its caller gave up) consumes nothing: its answer
        // may never be read.
        let peek = peek || cancel.is_cancelled();
        for (view, id) in views.into_iter().zip(ids) {
            let state = match &view {
                None => WaitState::NotFound,
                Some(v) if !v.is_finished() => {
                    timed_out = true;
                    WaitState::Running
                }
                Some(_) if peek => WaitState::Peeked,
                Some(v) => self.consume(&v.delegation_id),
            };
            entries.push(WaitEntry { id: id.trim().to_owned(), state, unit: view });
        }
        Ok(WaitReport { entries, timed_out })
    }

    /// Claims and acknowledges a finished unit's delivery: `Delivered` to
    /// the one caller that wins the claim, `AlreadyDelivered` to any other.
    fn consume(&self, delegation_id: &str) -> WaitState {
        let registry = &self.backend.registry;
        let filter = DeliveryFilter {
            delegation_id: Some(delegation_id.to_owned()),
            ..DeliveryFilter::default()
        };
        match registry.claim_delivery(&filter) {
            Ok(Some(claim)) => match registry.ack_delivery(&claim.delegation_id, &claim.token) {
                Ok(true) => WaitState::Delivered,
                Ok(false) => WaitState::AlreadyDelivered,
                Err(e) => {
                    log::warn!("delivery of {delegation_id} not acknowledged: {e}");
                    WaitState::AlreadyDelivered
                }
            },
            Ok(None) => WaitState::AlreadyDelivered,
            Err(e) => {
                log::warn!("delivery of {delegation_id} not claimed: {e}");
                WaitState::AlreadyDelivered
            }
        }
    }

    /// Marks a finished unit's result as delivered (a task poll returned
    /// it); true when this call consumed it.
    pub fn mark_delivered(&self, delegation_id: &str) -> bool {
        self.consume(delegation_id) == WaitState::Delivered
    }

    /// The completions of `parent`'s units not delivered yet, each claimed
    /// and acknowledged here (exactly once across processes): the inbox a
    /// tool result carries.
    pub fn take_inbox(&self, parent: &ParentContext) -> Vec<WaitEntry> {
        let claimed = self.claim_inbox(parent);
        self.ack_inbox(claimed)
    }

    /// The inbox's first half: claims `parent`'s undelivered completions
    /// (each with its lease) without acknowledging them. A claim whose unit
    /// this parent may not read is left to lapse, never consumed. Hand the
    /// result to [`Collector::ack_inbox`] once the answer that carries them
    /// goes out; claims never acknowledged come back after their lease.
    pub fn claim_inbox(&self, parent: &ParentContext) -> Vec<(WaitEntry, String)> {
        let Some(session) = parent.session_id.as_deref().map(str::trim).filter(|s| !s.is_empty())
        else {
            return Vec::new();
        };
        let registry = &self.backend.registry;
        let filter = DeliveryFilter {
            parent_session_id: Some(session.to_owned()),
            ..DeliveryFilter::default()
        };
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::new();
        // Bounded: a flood of completions is handed out over several calls.
        for _ in 0..32 {
            let claim = match registry.claim_delivery(&filter) {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => {
                    log::warn!("inbox of {session} not read: {e}");
                    break;
                }
            };
            if !seen.insert(claim.delegation_id.clone()) {
                break;
            }
            match self.unit(&claim.delegation_id, parent) {
                Ok(unit) => out.push((
                    WaitEntry {
                        id: claim.delegation_id.clone(),
                        state: WaitState::Delivered,
                        unit: Some(unit),
                    },
                    claim.token,
                )),
                Err(_) => log::debug!(
                    "inbox: {} is not {session}'s to read; its claim lapses",
                    claim.delegation_id
                ),
            }
        }
        out
    }

    /// The inbox's second half: acknowledges the claims; returns the
    /// entries whose claim still held (each delivered exactly once).
    pub fn ack_inbox(&self, claimed: Vec<(WaitEntry, String)>) -> Vec<WaitEntry> {
        let registry = &self.backend.registry;
        claimed
            .into_iter()
            .filter_map(|(entry, token)| match registry.ack_delivery(&entry.id, &token) {
                Ok(true) => Some(entry),
                Ok(false) => None,
                Err(e) => {
                    log::warn!("delivery of {} not acknowledged: {e}", entry.id);
                    None
                }
            })
            .collect()
    }

    /// Sends `message` to the running child `id` (a subagent id, child
    /// session id, or the delegation id of a one-child unit), through the
    /// registry's mailbox, so the worker that runs it may be another
    /// process. Waits briefly for the worker to act: `Delivered`, or
    /// `Missed` when the child had finished (reported, never lost).
    pub fn steer(
        &self,
        id: &str,
        message: &str,
        parent: &ParentContext,
    ) -> Result<SteerReport, DelegateError> {
        if message.trim().is_empty() {
            return Err(DelegateError::InvalidArguments(
                "Provide a non-empty message to steer the child with.".to_owned(),
            ));
        }
        let view = self.unit(id, parent)?;
        let target = id.trim();
        let child = match view
            .children
            .iter()
            .find(|c| c.subagent_id == target || c.child_session_id == target)
        {
            Some(c) => c.clone(),
            None if view.children.len() == 1 => view.children[0].clone(),
            None => {
                return Err(DelegateError::WhichChild {
                    target: target.to_owned(),
                    children: view.children.len(),
                });
            }
        };
        let controls = &self.backend.controls;
        let report = |outcome| SteerReport {
            subagent_id: child.subagent_id.clone(),
            delegation_id: view.delegation_id.clone(),
            outcome,
        };
        if view.is_finished() {
            return Ok(report(ControlOutcome::Missed));
        }
        let control = controls
            .post_control(
                &view.delegation_id,
                Some(&child.subagent_id),
                ControlKind::Steer,
                Some(message),
            )
            .map_err(DelegateError::Registry)?;
        let outcome = self.await_control(control, &view.delegation_id, parent)?;
        Ok(report(outcome))
    }

    /// Stops the running unit `id` (any of its ids): its children stop with
    /// exit reason `cancelled`, bill what they spent, and the unit is
    /// finalised. A finished unit is [`DelegateError::Finished`].
    pub fn cancel_unit(
        &self,
        id: &str,
        parent: &ParentContext,
    ) -> Result<CancelReport, DelegateError> {
        let view = self.unit(id, parent)?;
        if view.is_finished() {
            return Err(DelegateError::Finished {
                target: id.trim().to_owned(),
                state: view.state.as_str().to_owned(),
                action: "cancel",
            });
        }
        let control = self
            .backend
            .controls
            .post_control(&view.delegation_id, None, ControlKind::Cancel, None)
            .map_err(DelegateError::Registry)?;
        let outcome = self.await_control(control, &view.delegation_id, parent)?;
        if outcome == ControlOutcome::Missed {
            // It finished before its worker took the cancel.
            let state = self.unit(id, parent).map(|v| v.state).unwrap_or(view.state.clone());
            return Err(DelegateError::Finished {
                target: id.trim().to_owned(),
                state: state.as_str().to_owned(),
                action: "cancel",
            });
        }
        // The children stop within a poll or two; report where it stands.
        let deadline = Instant::now() + TAKE_WAIT;
        let mut state = view.state.clone();
        while outcome == ControlOutcome::Delivered && Instant::now() < deadline {
            match self.unit(&view.delegation_id, parent) {
                Ok(v) if v.is_finished() => {
                    state = v.state;
                    break;
                }
                Ok(v) => state = v.state,
                Err(_) => break,
            }
            std::thread::sleep(poll());
        }
        if outcome == ControlOutcome::Delivered
            && !matches!(
                state,
                UnitState::Interrupted
                    | UnitState::Pending
                    | UnitState::Running
                    | UnitState::Finalizing
            )
        {
            // The children had returned before the cancel reached them.
            return Err(DelegateError::Finished {
                target: id.trim().to_owned(),
                state: state.as_str().to_owned(),
                action: "cancel",
            });
        }
        Ok(CancelReport { delegation_id: view.delegation_id, outcome, state })
    }

    /// Polls a posted control until the worker acts on it, its unit
    /// finishes (a control still pending then is settled `missed` here), or
    /// [`TAKE_WAIT`] passes.
    fn await_control(
        &self,
        control: i64,
        delegation_id: &str,
        parent: &ParentContext,
    ) -> Result<ControlOutcome, DelegateError> {
        let controls = &self.backend.controls;
        let deadline = Instant::now() + TAKE_WAIT;
        loop {
            let outcome = controls
                .control_outcome(control)
                .map_err(DelegateError::Registry)?
                .unwrap_or(ControlOutcome::Missed);
            if matches!(outcome, ControlOutcome::Delivered | ControlOutcome::Missed) {
                return Ok(outcome);
            }
            // A read error is not "finished": only a unit seen finished has
            // had its worker's last take (before its completion was written).
            let finished =
                self.unit(delegation_id, parent).map(|v| v.is_finished()).unwrap_or(false);
            if finished && outcome == ControlOutcome::Pending {
                // Nobody will take it now: settle it missed (unless the
                // worker took it in the meantime).
                if controls
                    .settle_control(control, ControlOutcome::Missed)
                    .map_err(DelegateError::Registry)?
                {
                    return Ok(ControlOutcome::Missed);
                }
                continue;
            }
            if Instant::now() >= deadline {
                return Ok(outcome);
            }
            std::thread::sleep(poll());
        }
    }
}
