//! The seams to the outside world: the child runtime (a real LLM client or a
//! scripted fake), the transcript sink, the completion sink, and the
//! [`CancelToken`] a running child watches.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use retinue_core::CompletionEvent;
use retinue_core::{ExitReason, Message, Role, Spend};

/// Everything a runtime needs to build one child.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChildSpec {
    /// `sa-<index>-<8hex>`.
    pub subagent_id: String,
    /// The child's session id (for a resume: the session it continues).
    pub session_id: String,
    /// Task index in its unit.
    pub task_index: usize,
    /// The goal.
    pub goal: String,
    /// Extra context.
    pub context: Option<String>,
    /// `leaf` or `orchestrator` (as a spawn here may grant it).
    pub role: Role,
    /// Model.
    pub model: Option<String>,
    /// Provider.
    pub provider: Option<String>,
    /// Provider base URL.
    pub base_url: Option<String>,
    /// API mode.
    pub api_mode: Option<String>,
    /// Toolsets the child may use (hermes's names: `read`, `file`,
    /// `terminal`, `mcp-<server>`, `delegation`).
    pub toolsets: Vec<String>,
    /// The directory every tool of the child works in (`None`: the child
    /// gets no workspace, so no file or terminal tool works).
    pub workspace: Option<PathBuf>,
    /// The child's delegation depth (1 for a child of a top-level parent).
    pub depth: u32,
    /// Iteration budget.
    pub max_iterations: u32,
    /// Set when the child resumes an existing session.
    pub resume_session_id: Option<String>,
}

/// A built child, as the runtime identifies it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChildHandle {
    /// The subagent id.
    pub subagent_id: String,
    /// The session the child writes to.
    pub session_id: String,
    /// The toolsets the child was built with.
    pub toolsets: Vec<String>,
    /// The child's workspace.
    pub workspace: Option<PathBuf>,
    /// The child's delegation depth.
    pub depth: u32,
}

impl ChildHandle {
    /// The handle of a child built from `spec`: it writes to the session it
    /// resumes, else its own, and keeps the spec's toolsets, workspace and
    /// depth for the tools it runs.
    pub fn of(spec: &ChildSpec) -> ChildHandle {
        ChildHandle {
            subagent_id: spec.subagent_id.clone(),
            session_id: spec.resume_session_id.clone().unwrap_or_else(|| spec.session_id.clone()),
            toolsets: spec.toolsets.clone(),
            workspace: spec.workspace.clone(),
            depth: spec.depth,
        }
    }
}

/// One run's input.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunInput {
    /// The new user turn.
    pub user_message: String,
    /// The persisted dialogue (no `system` rows) for a resume; empty for a spawn.
    pub history: Vec<Message>,
    /// The system prompt, passed once.
    pub system_prompt: Option<String>,
}

/// Token counts of one run, summed over its model calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunTokens {
    /// Prompt (input) tokens, cached ones included.
    pub input: u64,
    /// Completion (output) tokens, reasoning ones included.
    pub output: u64,
    /// Prompt tokens served from the provider's cache.
    pub cached_input: u64,
    /// Completion tokens spent on reasoning.
    pub reasoning: u64,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChildOutcome {
    /// The child's final answer.
    pub final_response: Option<String>,
    /// Why the run stopped.
    pub exit_reason: ExitReason,
    /// Model API calls made.
    pub api_calls: u64,
    /// Tokens used (partial runs report what they used so far).
    pub tokens: RunTokens,
    /// Cost in US dollars.
    pub cost_usd: f64,
    /// Error text, if the run failed.
    pub error: Option<String>,
    /// Steering messages the runtime accepted but never folded into the run
    /// (they arrived after its last iteration); reported as `missed_steer`.
    pub missed_steers: Vec<String>,
    /// The model the run used, when the runtime chose it (it may differ
    /// from the child's recorded one: an override, the config of the day).
    pub model: Option<String>,
    /// The endpoint the run called (redacted), when the runtime reports it.
    pub endpoint: Option<String>,
}

impl ChildOutcome {
    /// An outcome that ended with `reason` and `error`, having done nothing.
    pub fn failed(reason: ExitReason, error: impl Into<String>) -> ChildOutcome {
        ChildOutcome { exit_reason: reason, error: Some(error.into()), ..ChildOutcome::default() }
    }
}

/// Why a transcript write was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// The run was stopped (timeout or cancellation); its transcript is closed.
    #[error("transcript of {session_id} is closed (the run was stopped)")]
    Closed {
        /// The child's session.
        session_id: String,
    },
    /// The store could not write the message.
    #[error("could not append to {session_id}: {message}")]
    Storage {
        /// The child's session.
        session_id: String,
        /// What the store said.
        message: String,
    },
}

/// Why a runtime could not build or run a child.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeError {
    /// The child's configuration cannot work (no model, unsupported
    /// `api_mode`, missing key, …); the text says what to fix.
    #[error("{0}")]
    Config(String),
    /// Any other failure to build the child.
    #[error("{0}")]
    Build(String),
}

/// Where a running child writes its transcript.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait TranscriptSink: Send + Sync {
    /// Appends one message to the child's session.
    fn append(&self, message: &Message) -> Result<(), SinkError>;
}

/// A child runtime: builds, runs and steers children.
///
/// `run` must watch `cancel`: once [`CancelToken::is_cancelled`] is true
/// (explicit cancellation or the child's deadline), it stops as soon as it
/// can — aborting an in-flight model call where possible — and returns an
/// outcome that reports the usage spent so far, so the partial run is billed.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait ChildRuntime: Send + Sync {
    /// Builds a child (on `spec.resume_session_id` when resuming).
    fn build(&self, spec: &ChildSpec) -> Result<ChildHandle, RuntimeError>;
    /// Runs the child to an outcome, writing its output through `sink`.
    fn run(
        &self,
        child: &ChildHandle,
        input: &RunInput,
        sink: &dyn TranscriptSink,
        cancel: &CancelToken,
    ) -> ChildOutcome;
    /// Queues a message for a running child; `false` if refused.
    fn steer(&self, child: &ChildHandle, message: &str) -> bool;
}

/// Receives background completions; idempotent per `delegation_id`.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait CompletionSink: Send + Sync {
    /// Delivers one completion event; `true` once accepted (also for a repeat).
    fn deliver(&self, event: &CompletionEvent) -> bool;
}

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

/// The store side of a [`BudgetMeter`]: the lineage reservation its runs
/// grow call by call.
pub(crate) struct MeterStore {
    pub(crate) budgets: Arc<dyn retinue_core::Budgets>,
    pub(crate) reservation: String,
    /// Root, sessions and limit of the budget (`minimum`/`maximum` unused).
    pub(crate) draft: retinue_core::ReservationDraft,
}

impl std::fmt::Debug for MeterStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeterStore")
            .field("reservation", &self.reservation)
            .field("root", &self.draft.lineage_root)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct MeterState {
    /// Usage of finished calls (and the core's after-run reconciliation).
    charged: Spend,
    /// What the calls in flight may spend at most.
    inflight: Spend,
    /// What the store reservation holds now.
    held: Spend,
    /// Calls in flight of unknown price under a dollar limit: while any
    /// runs, the reservation keeps all it holds (they share that pool).
    exclusive: u32,
    /// Settled: no further call may start.
    closed: bool,
}

/// The least a call needs of a dollar budget: a budget with nothing left
/// starts nothing, even when the model has no price.
const MIN_CALL_USD: f64 = 1e-6;

fn plus(a: Spend, b: Spend) -> Spend {
    Spend { cost_usd: a.cost_usd + b.cost_usd, tokens: a.tokens.saturating_add(b.tokens) }
}

fn minus(a: Spend, b: Spend) -> Spend {
    Spend {
        cost_usd: (a.cost_usd - b.cost_usd).max(0.0),
        tokens: a.tokens.saturating_sub(b.tokens),
    }
}

/// A finite, non-negative dollar amount (anything else is 0).
fn usd(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 { v } else { 0.0 }
}

/// The spending allowance of the runs under one budget: the call's own cap
/// (in memory) and, under a lineage budget, the store reservation that each
/// model call grows by its prompt plus its bounded completion before it is
/// made ([`CancelToken::begin_call`]) and that is set back to what was spent
/// when it ends ([`CallPermit::finish`]). The delegate core owns it: a
/// runtime only asks for permits.
#[derive(Debug)]
pub struct BudgetMeter {
    cap: Spend,
    state: Mutex<MeterState>,
    store: Option<MeterStore>,
}

impl BudgetMeter {
    /// A meter allowing `cap` (an unlimited measure: `f64::INFINITY` /
    /// `u64::MAX`), in memory only.
    pub fn new(cap: Spend) -> Arc<BudgetMeter> {
        Arc::new(BudgetMeter { cap, state: Mutex::default(), store: None })
    }

    /// A meter over a held store reservation (`held`: what it holds now).
    pub(crate) fn with_store(cap: Spend, store: MeterStore, held: Spend) -> Arc<BudgetMeter> {
        let state = MeterState { held, ..MeterState::default() };
        Arc::new(BudgetMeter { cap, state: Mutex::new(state), store: Some(store) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MeterState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What was charged so far (finished calls, reconciled runs).
    pub fn spent(&self) -> Spend {
        self.lock().charged
    }

    /// What is left of the in-memory allowance (the call's own cap).
    pub fn left(&self) -> Spend {
        let st = self.lock();
        minus(self.cap, plus(st.charged, st.inflight))
    }

    fn exhausted(&self) -> bool {
        let spent = self.spent();
        spent.cost_usd >= self.cap.cost_usd || spent.tokens >= self.cap.tokens
    }

    /// Sets the store reservation to what is charged plus in flight (never
    /// below what was charged: nothing spent is ever given back).
    fn sync(&self, st: &mut MeterState) {
        let Some(store) = &self.store else { return };
        let mut hold = plus(st.charged, st.inflight);
        if st.exclusive > 0 {
            hold.cost_usd = hold.cost_usd.max(st.held.cost_usd);
        }
        if hold == st.held {
            return;
        }
        match store.budgets.set_hold(&store.reservation, hold) {
            Ok(_) => st.held = hold,
            Err(e) => log::warn!("could not update budget reservation {}: {e}", store.reservation),
        }
    }

    /// Charges usage the core found after a run (a runtime that did not
    /// meter its calls, or reported more than it metered).
    pub(crate) fn charge_after(&self, extra: Spend) {
        let mut st = self.lock();
        st.charged =
            plus(st.charged, Spend { cost_usd: usd(extra.cost_usd), tokens: extra.tokens });
        self.sync(&mut st);
    }

    /// Closes the meter (no call starts after this) and returns what the
    /// calls still in flight hold (an abandoned child's calls).
    pub(crate) fn close(&self) -> Spend {
        let mut st = self.lock();
        st.closed = true;
        st.inflight
    }

    /// What the store reservation holds now.
    pub(crate) fn held(&self) -> Spend {
        self.lock().held
    }

    fn begin(&self, plan: &CallPlan) -> Result<(Spend, Option<u64>, bool), CallRefusal> {
        let mut st = self.lock();
        if st.closed {
            // The unit was settled: no call may start on its reservation.
            return Err(CallRefusal::Spent);
        }
        let used = plus(st.charged, st.inflight);
        let prompt_cost = usd(plan.prompt_cost_usd);
        let price = plan.usd_per_completion_token.filter(|p| p.is_finite() && *p > 0.0);
        let exclusive = self
            .store
            .as_ref()
            .is_some_and(|s| s.draft.limit.max_cost_usd.is_some() && price.is_none());
        // The completion: what the runtime wants, within the call's own cap.
        let mut completion = plan.max_completion_tokens.unwrap_or(u64::MAX);
        let cap_left = minus(self.cap, used);
        if self.cap.tokens != u64::MAX {
            if cap_left.tokens <= plan.prompt_tokens {
                return Err(CallRefusal::Spent);
            }
            completion = completion.min(cap_left.tokens - plan.prompt_tokens);
        }
        if self.cap.cost_usd.is_finite() {
            let left = cap_left.cost_usd - prompt_cost;
            if left <= 0.0 {
                return Err(CallRefusal::Spent);
            }
            if let Some(p) = price {
                completion = completion.min(tokens_for(left, p));
            }
        }
        if let Some(store) = &self.store {
            let limit = store.draft.limit;
            let floor = if limit.max_cost_usd.is_some() { MIN_CALL_USD } else { 0.0 };
            let want = |completion: u64| Spend {
                cost_usd: used.cost_usd
                    + (prompt_cost + price.map_or(0.0, |p| p * completion as f64)).max(floor),
                tokens: used.tokens.saturating_add(plan.prompt_tokens).saturating_add(completion),
            };
            let mut most = want(completion);
            let mut minimum = minus(want(1), st.held);
            // Under a dollar limit a call of unknown price may cost
            // anything: it takes all that is left, exclusively, until it
            // ends (then the rest is given back to the other runs). Calls of
            // this meter already in such a call share that pool.
            let sharing = exclusive && st.exclusive > 0;
            if exclusive {
                most.cost_usd = f64::INFINITY;
                minimum.cost_usd = minimum.cost_usd.max(MIN_CALL_USD);
            }
            let short = (limit.max_tokens.is_some() && st.held.tokens < most.tokens)
                || (limit.max_cost_usd.is_some() && st.held.cost_usd < most.cost_usd && !sharing);
            if short {
                if sharing {
                    minimum.cost_usd = 0.0;
                }
                let draft = retinue_core::ReservationDraft {
                    minimum,
                    maximum: Some(Spend {
                        cost_usd: (most.cost_usd - st.held.cost_usd).max(0.0),
                        tokens: most.tokens.saturating_sub(st.held.tokens),
                    }),
                    ..store.draft.clone()
                };
                match store.budgets.grow(&store.reservation, &draft) {
                    Ok(retinue_core::Reservation::Held { granted, .. }) => {
                        st.held = plus(st.held, granted);
                    }
                    Ok(retinue_core::Reservation::Refused(status)) => {
                        let exceeded = status.exceeded_by(draft.minimum);
                        return Err(CallRefusal::Lineage { status, exceeded });
                    }
                    Err(e) => {
                        log::warn!("could not grow budget reservation {}: {e}", store.reservation);
                        return Err(CallRefusal::Unavailable);
                    }
                }
            }
            // What the reservation covers now bounds the completion.
            let room = minus(st.held, used);
            if limit.max_tokens.is_some() {
                completion = completion.min(room.tokens.saturating_sub(plan.prompt_tokens).max(1));
            }
            if let (Some(_), Some(p)) = (limit.max_cost_usd, price) {
                completion = completion.min(tokens_for(room.cost_usd - prompt_cost, p).max(1));
            }
        }
        if completion == 0 {
            // Nothing left to generate with: no call.
            return Err(CallRefusal::Spent);
        }
        let bounded = (completion != u64::MAX).then_some(completion);
        let mut hold = Spend {
            cost_usd: prompt_cost + price.zip(bounded).map_or(0.0, |(p, c)| p * c as f64),
            tokens: plan.prompt_tokens.saturating_add(bounded.unwrap_or(0)),
        };
        if exclusive && st.exclusive == 0 {
            // A call of unknown price may spend the whole pool it took: that
            // is what it is billed when its usage is unknown (never $0).
            hold.cost_usd = hold.cost_usd.max((st.held.cost_usd - used.cost_usd).max(0.0));
        }
        st.inflight = plus(st.inflight, hold);
        if exclusive {
            st.exclusive += 1;
        }
        Ok((hold, bounded, exclusive))
    }

    fn end(&self, hold: Spend, used: Spend, exclusive: bool) {
        let mut st = self.lock();
        if exclusive {
            st.exclusive = st.exclusive.saturating_sub(1);
        }
        st.inflight = minus(st.inflight, hold);
        st.charged = plus(st.charged, Spend { cost_usd: usd(used.cost_usd), tokens: used.tokens });
        self.sync(&mut st);
    }
}

/// Completion tokens `usd` buys at `price` a token (saturating).
fn tokens_for(usd: f64, price: f64) -> u64 {
    // A hair of slack so 0.008 / 0.00001 is 800, not 799.
    let n = (usd / price + 1e-6).floor();
    if n.is_finite() && n > 0.0 {
        // `as` saturates for floats.
        n as u64
    } else {
        0
    }
}

/// Why [`CancelToken::begin_call`] refused a model call.
#[derive(Debug, Clone, PartialEq)]
pub enum CallRefusal {
    /// The run's own allowance (the call's `budget`) is spent.
    Spent,
    /// The lineage budget cannot cover the call's prompt: `exceeded` when
    /// what is spent leaves too little, else the rest is held by running
    /// delegations.
    Lineage {
        /// The budget at the refusal.
        status: retinue_core::BudgetStatus,
        /// Spent alone leaves too little.
        exceeded: bool,
    },
    /// The budget store could not be reached: fail closed.
    Unavailable,
}

impl std::fmt::Display for CallRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallRefusal::Spent => f.write_str("the run's budget allowance is spent"),
            CallRefusal::Lineage { status, exceeded } => {
                let (cost, tokens) = status.remaining();
                if *exceeded {
                    write!(
                        f,
                        "the lineage budget is exceeded (remaining: {} USD, {} tokens)",
                        cost.map_or("unlimited".to_owned(), |c| format!("{c:.6}")),
                        tokens.map_or("unlimited".to_owned(), |t| t.to_string())
                    )
                } else {
                    write!(
                        f,
                        "the rest of the lineage budget is held by running delegations \
                         (remaining: {} USD, {} tokens)",
                        cost.map_or("unlimited".to_owned(), |c| format!("{c:.6}")),
                        tokens.map_or("unlimited".to_owned(), |t| t.to_string())
                    )
                }
            }
            CallRefusal::Unavailable => f.write_str(
                "the budget store could not be reached (refusing rather than spending unmetered)",
            ),
        }
    }
}

/// What a runtime knows before one model call.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CallPlan {
    /// The prompt's tokens (an estimate is fine; it is held, then replaced
    /// by the provider's count).
    pub prompt_tokens: u64,
    /// The prompt's cost where the price is known, else 0.
    pub prompt_cost_usd: f64,
    /// The most completion tokens the runtime wants (`None`: no own limit).
    pub max_completion_tokens: Option<u64>,
    /// The price of one completion token, where known.
    pub usd_per_completion_token: Option<f64>,
}

/// What one model call used, as the provider reported it (validated).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CallUsage {
    /// Prompt plus completion tokens.
    pub tokens: u64,
    /// Dollars.
    pub cost_usd: f64,
}

/// The core's leave for one model call: its completion bound, and the hold
/// it charges. [`CallPermit::finish`] charges what the call used; a permit
/// dropped unfinished (a call whose usage is unknown or unbelievable) is
/// charged everything it held — never nothing.
#[derive(Debug)]
#[must_use = "finish the permit with the call's usage (dropping it charges its whole hold)"]
pub struct CallPermit {
    max_completion_tokens: Option<u64>,
    hold: Spend,
    meter: Option<Arc<BudgetMeter>>,
    metered: Arc<Mutex<Spend>>,
    /// A call of unknown price under a dollar limit (see [`MeterState`]).
    exclusive: bool,
    done: bool,
}

impl CallPermit {
    /// The most completion tokens the call may produce: send it as
    /// `max_completion_tokens` (or `max_tokens`). `None`: unbounded.
    pub fn max_completion_tokens(&self) -> Option<u64> {
        self.max_completion_tokens
    }

    /// What the permit holds (prompt plus bounded completion).
    pub fn hold(&self) -> Spend {
        self.hold
    }

    /// Charges the call's `used` usage.
    pub fn finish(mut self, used: CallUsage) {
        self.charge(Spend { cost_usd: usd(used.cost_usd), tokens: used.tokens });
    }

    fn charge(&mut self, used: Spend) {
        if self.done {
            return;
        }
        self.done = true;
        if let Some(meter) = &self.meter {
            meter.end(self.hold, used, self.exclusive);
        }
        let mut m = self.metered.lock().unwrap_or_else(PoisonError::into_inner);
        *m = plus(*m, used);
    }
}

impl Drop for CallPermit {
    fn drop(&mut self) {
        let hold = self.hold;
        self.charge(hold);
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
        CancelToken { state: Arc::default(), deadline, budget: None, metered: Arc::default() }
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
        let deadline = match (self.deadline, own) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        CancelToken {
            state: Arc::clone(&self.state),
            deadline,
            budget: self.budget.clone(),
            metered: Arc::default(),
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
                self.deadline.filter(|d| Instant::now() >= *d).map(|_| CancelReason::Timeout)
            })
            .or_else(|| {
                self.budget.as_ref().filter(|m| m.exhausted()).map(|_| CancelReason::Budget)
            })
    }

    /// Whether the run must stop now.
    pub fn is_cancelled(&self) -> bool {
        self.reason().is_some()
    }

    /// The deadline, if any.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Time left before the deadline (`None`: no deadline; zero: passed).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline.map(|d| d.saturating_duration_since(Instant::now()))
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
    fn a_child_token_never_extends_the_deadline() {
        let parent = CancelToken::with_timeout(Some(Duration::ZERO));
        assert!(parent.child(Some(Duration::from_secs(600))).is_cancelled());
        let open = CancelToken::new().child(Some(Duration::from_secs(600)));
        assert!(!open.is_cancelled());
    }
}
