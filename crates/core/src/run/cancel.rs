//! A run's stop signal: [`CancelToken`] (a deadline, an explicit cancel and,
//! under a budget, a spending allowance) and why it fired ([`CancelReason`]).

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::meter::{BudgetMeter, CallPermit, CallPlan, CallRefusal, usd};
use crate::Spend;

/// Why a [`CancelToken`] fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelReason {
    /// The child's deadline (`child_timeout_seconds`) passed.
    Timeout,
    /// Someone cancelled the run (the parent's call was cancelled).
    Cancelled,
    /// The run's budget allowance is spent.
    Budget,
    /// Its parent asked for the unit to stop (`retinue cancel`,
    /// `cancel_subagent`, `tasks/cancel`): exit reason `cancelled`.
    Requested,
}

/// Time a run spent waiting for a human (an approval): its deadline is
/// moved by it, so a run timeout never counts the wait.
#[derive(Debug, Default)]
struct PauseClock {
    inner: Mutex<Paused>,
}

#[derive(Debug, Default)]
struct Paused {
    /// Waits in progress.
    depth: u32,
    /// When the current wait began.
    since: Option<Instant>,
    /// Waits already over.
    total: Duration,
}

impl PauseClock {
    fn enter(&self) {
        let mut p = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if p.depth == 0 {
            p.since = Some(Instant::now());
        }
        p.depth = p.depth.saturating_add(1);
    }

    fn leave(&self) {
        let mut p = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        p.depth = p.depth.saturating_sub(1);
        if p.depth == 0
            && let Some(since) = p.since.take()
        {
            p.total = p.total.saturating_add(since.elapsed());
        }
    }

    /// How far the deadline has moved (a wait in progress counts up to now).
    fn moved(&self) -> Duration {
        let p = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        p.total.saturating_add(p.since.map_or(Duration::ZERO, |s| s.elapsed()))
    }
}

/// A wait for a human in progress ([`CancelToken::pause`]); the deadlines
/// of the run and of every run above it resume when it is dropped.
#[derive(Debug)]
#[must_use = "the pause ends when the guard is dropped"]
pub struct PauseGuard {
    clocks: Vec<Arc<PauseClock>>,
}

impl Drop for PauseGuard {
    fn drop(&mut self) {
        for c in &self.clocks {
            c.leave();
        }
    }
}

#[derive(Debug, Default)]
struct CancelState {
    reason: Mutex<Option<CancelReason>>,
    changed: Condvar,
}

/// A run's stop signal: a deadline, an explicit cancel and, under a budget,
/// a spending allowance. Cheap to clone; all clones share one state.
#[derive(Debug, Clone, Default)]
pub struct CancelToken {
    state: Arc<CancelState>,
    deadline: Option<Instant>,
    budget: Option<Arc<BudgetMeter>>,
    /// What this run's permits charged (a fresh counter per [`CancelToken::child`]).
    metered: Arc<Mutex<Spend>>,
    /// This run's pause clock first, then those of the runs above it.
    pauses: Vec<Arc<PauseClock>>,
}

impl CancelToken {
    /// A token with no deadline.
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// A token whose deadline is `timeout` from now; `None`, or a timeout too
    /// large to represent, means no deadline (never a panic).
    pub fn with_timeout(timeout: Option<Duration>) -> CancelToken {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        CancelToken {
            state: Arc::default(),
            deadline,
            budget: None,
            metered: Arc::default(),
            pauses: vec![Arc::default()],
        }
    }

    /// This token, with runs charged against `meter` (a run stops with
    /// [`CancelReason::Budget`] once it is spent).
    #[must_use]
    pub fn with_budget(mut self, meter: Arc<BudgetMeter>) -> CancelToken {
        self.budget = Some(meter);
        self
    }

    /// The budget meter, if the run is under a budget.
    pub fn budget(&self) -> Option<&Arc<BudgetMeter>> {
        self.budget.as_ref()
    }

    /// Asks the core for leave to make one model call: under a budget, the
    /// call's prompt plus its bounded completion is reserved first (and the
    /// permit says the bound to send); refused when that does not fit. A
    /// runtime calls this before every model call and finishes the permit
    /// with the call's usage.
    pub fn begin_call(&self, plan: CallPlan) -> Result<CallPermit, CallRefusal> {
        let (hold, bound, exclusive) = match &self.budget {
            Some(meter) => meter.begin(&plan)?,
            // Without a budget no bound is imposed (the plan's is a ceiling
            // for budgets only).
            None => (
                Spend { cost_usd: usd(plan.prompt_cost_usd), tokens: plan.prompt_tokens },
                None,
                false,
            ),
        };
        Ok(CallPermit {
            max_completion_tokens: bound,
            hold,
            meter: self.budget.clone(),
            metered: Arc::clone(&self.metered),
            exclusive,
            done: false,
        })
    }

    /// What this run's permits charged so far.
    pub fn metered(&self) -> Spend {
        *self.metered.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A token sharing this one's cancel state with an earlier (never later)
    /// deadline of `timeout` from now.
    #[must_use]
    pub fn child(&self, timeout: Option<Duration>) -> CancelToken {
        let own = timeout.and_then(|t| Instant::now().checked_add(t));
        // The parent's deadline as moved by its waits so far.
        let deadline = match (self.deadline(), own) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let mut pauses = Vec::with_capacity(self.pauses.len() + 1);
        pauses.push(Arc::default());
        pauses.extend(self.pauses.iter().cloned());
        CancelToken {
            state: Arc::clone(&self.state),
            deadline,
            budget: self.budget.clone(),
            metered: Arc::default(),
            pauses,
        }
    }

    /// Stops the run (idempotent; the first reason wins).
    pub fn cancel(&self) {
        self.fire(CancelReason::Cancelled);
    }

    /// Stops the run because its parent cancelled the unit
    /// ([`CancelReason::Requested`]; the first reason wins).
    pub fn cancel_requested(&self) {
        self.fire(CancelReason::Requested);
    }

    fn fire(&self, reason: CancelReason) {
        let mut slot = self.state.reason.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(reason);
        }
        self.state.changed.notify_all();
    }

    /// Why the run must stop, if it must.
    pub fn reason(&self) -> Option<CancelReason> {
        let fired = *self.state.reason.lock().unwrap_or_else(PoisonError::into_inner);
        fired
            .or_else(|| {
                self.deadline().filter(|d| Instant::now() >= *d).map(|_| CancelReason::Timeout)
            })
            .or_else(|| {
                self.budget.as_ref().filter(|m| m.exhausted()).map(|_| CancelReason::Budget)
            })
    }

    /// Whether the run must stop now.
    pub fn is_cancelled(&self) -> bool {
        self.reason().is_some()
    }

    /// The deadline, if any: moved by every wait for a human so far
    /// ([`CancelToken::pause`]).
    pub fn deadline(&self) -> Option<Instant> {
        let moved = self.pauses.first().map_or(Duration::ZERO, |c| c.moved());
        self.deadline.map(|d| d.checked_add(moved).unwrap_or(d))
    }

    /// Time left before the deadline (`None`: no deadline; zero: passed).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline().map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Stops this run's clock, and the clocks of the runs above it, while
    /// it waits for a human (an approval): the wait never counts towards a
    /// deadline. The clocks run again when the guard is dropped. A
    /// cancellation still stops the run at once.
    pub fn pause(&self) -> PauseGuard {
        for c in &self.pauses {
            c.enter();
        }
        PauseGuard { clocks: self.pauses.clone() }
    }

    /// Sleeps up to `pause` (never past the deadline), waking early on
    /// cancellation; returns `true` when the run must stop.
    pub fn sleep(&self, pause: Duration) -> bool {
        let pause = self.remaining().map_or(pause, |r| r.min(pause));
        let until = Instant::now().checked_add(pause);
        let mut slot = self.state.reason.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if slot.is_some() {
                return true;
            }
            let left = until.map_or(pause, |u| u.saturating_duration_since(Instant::now()));
            if left.is_zero() {
                break;
            }
            slot = match self.state.changed.wait_timeout(slot, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        drop(slot);
        self.is_cancelled()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::CallUsage;

    #[test]
    fn a_huge_timeout_is_no_deadline_not_a_panic() {
        let t = CancelToken::with_timeout(Some(Duration::MAX));
        assert_eq!(t.deadline(), None);
        assert!(!t.is_cancelled());
        let c = t.child(Some(Duration::from_secs(u64::MAX)));
        assert!(!c.is_cancelled());
    }

    #[test]
    fn cancel_wakes_a_sleeper_and_is_shared_by_clones() {
        let t = CancelToken::new();
        let other = t.clone();
        let sleeper = std::thread::spawn(move || other.sleep(Duration::from_secs(600)));
        t.cancel();
        assert!(sleeper.join().unwrap_or(false));
        assert_eq!(t.reason(), Some(CancelReason::Cancelled));
    }

    #[test]
    fn a_passed_deadline_reads_as_timeout() {
        let t = CancelToken::with_timeout(Some(Duration::ZERO));
        assert_eq!(t.reason(), Some(CancelReason::Timeout));
        assert!(t.sleep(Duration::from_secs(600)));
        assert_eq!(t.remaining(), Some(Duration::ZERO));
    }

    #[test]
    fn a_spent_budget_stops_the_run_and_is_shared_by_children() {
        let meter = BudgetMeter::new(Spend { cost_usd: 1.0, tokens: u64::MAX });
        let t = CancelToken::new().with_budget(meter.clone());
        let child = t.child(None);
        let plan = |cost: f64| CallPlan { prompt_cost_usd: cost, ..CallPlan::default() };
        assert!(!child.is_cancelled());
        assert_eq!(child.begin_call(plan(1.5)).err(), Some(CallRefusal::Spent));
        child.begin_call(plan(0.1)).expect("fits").finish(CallUsage { tokens: 100, cost_usd: 0.6 });
        t.begin_call(plan(0.0)).expect("fits").finish(CallUsage { tokens: 0, cost_usd: 0.5 });
        assert_eq!(t.reason(), Some(CancelReason::Budget));
        assert!(child.begin_call(plan(0.0)).is_err());
        // Each run counts what its own permits charged.
        assert_eq!(child.metered().tokens, 100);
        assert_eq!(t.metered().tokens, 0);
    }

    #[test]
    fn a_token_cap_bounds_each_completion_and_a_dropped_permit_charges_its_hold() {
        let t = CancelToken::new()
            .with_budget(BudgetMeter::new(Spend { cost_usd: f64::INFINITY, tokens: 50 }));
        let p = |prompt: u64| CallPlan { prompt_tokens: prompt, ..CallPlan::default() };
        assert!(t.begin_call(p(50)).is_err(), "a prompt that fills the cap leaves no completion");
        let permit = t.begin_call(p(10)).expect("fits");
        assert_eq!(permit.max_completion_tokens(), Some(40));
        // Two calls in flight share the cap: the second gets what is left.
        let second = t.begin_call(p(5));
        assert!(second.is_err(), "the first call's bound holds the rest");
        drop(permit);
        assert_eq!(t.budget().map(|m| m.spent().tokens), Some(50));
        assert_eq!(t.metered().tokens, 50);
        // Garbage usage never reduces what is charged.
        let t =
            CancelToken::new().with_budget(BudgetMeter::new(Spend { cost_usd: 1.0, tokens: 100 }));
        t.begin_call(p(1)).expect("fits").finish(CallUsage { tokens: 10, cost_usd: f64::NAN });
        assert_eq!(t.budget().map(|m| m.left()), Some(Spend { cost_usd: 1.0, tokens: 90 }));
    }

    #[test]
    fn a_price_bounds_the_completion_by_dollars() {
        let t = CancelToken::new()
            .with_budget(BudgetMeter::new(Spend { cost_usd: 0.01, tokens: u64::MAX }));
        let plan = CallPlan {
            prompt_tokens: 100,
            prompt_cost_usd: 0.002,
            max_completion_tokens: Some(1_000_000),
            usd_per_completion_token: Some(0.000_01),
        };
        let permit = t.begin_call(plan).expect("fits");
        // $0.008 left after the prompt buys 800 completion tokens.
        assert_eq!(permit.max_completion_tokens(), Some(800));
        permit.finish(CallUsage { tokens: 150, cost_usd: 0.0025 });
    }

    #[test]
    fn without_a_budget_a_permit_is_unbounded_but_still_metered() {
        let t = CancelToken::new().child(None);
        let permit =
            t.begin_call(CallPlan { prompt_tokens: 7, ..CallPlan::default() }).expect("no budget");
        assert_eq!(permit.max_completion_tokens(), None);
        permit.finish(CallUsage { tokens: 30, cost_usd: 0.0 });
        assert_eq!(t.metered().tokens, 30);
    }

    #[test]
    fn a_wait_for_a_human_moves_the_deadline_of_the_run_and_its_parents() {
        let parent = CancelToken::with_timeout(Some(Duration::from_millis(300)));
        let child = parent.child(Some(Duration::from_millis(300)));
        let sibling = parent.child(Some(Duration::from_millis(300)));
        let guard = child.pause();
        std::thread::sleep(Duration::from_millis(400));
        assert!(!child.is_cancelled(), "the wait does not count");
        assert!(!parent.is_cancelled(), "the parent waits on the child");
        assert_eq!(sibling.reason(), Some(CancelReason::Timeout), "a sibling's clock ran");
        drop(guard);
        assert!(!child.is_cancelled());
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(child.reason(), Some(CancelReason::Timeout), "the clock runs again");
        // A cancellation during a wait still stops the run.
        let t = CancelToken::with_timeout(Some(Duration::from_secs(60)));
        let _g = t.pause();
        t.cancel_requested();
        assert_eq!(t.reason(), Some(CancelReason::Requested));
    }

    #[test]
    fn a_child_token_never_extends_the_deadline() {
        let parent = CancelToken::with_timeout(Some(Duration::ZERO));
        assert!(parent.child(Some(Duration::from_secs(600))).is_cancelled());
        let open = CancelToken::new().child(Some(Duration::from_secs(600)));
        assert!(!open.is_cancelled());
    }
}
