//! The seams to the outside world: the child runtime (a real LLM client or a
//! scripted fake), the transcript sink, the completion sink, and the
//! [`CancelToken`] a running child watches.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use retinue_store::{ExitReason, Message, Spend};
use serde_json::Value;

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
    /// `leaf` or `orchestrator`.
    pub role: String,
    /// Model.
    pub model: Option<String>,
    /// Provider.
    pub provider: Option<String>,
    /// Provider base URL.
    pub base_url: Option<String>,
    /// API mode.
    pub api_mode: Option<String>,
    /// Toolsets the child may use.
    pub toolsets: Vec<String>,
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
    fn deliver(&self, event: &Value) -> bool;
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
}

/// The spending allowance of the runs under one budget reservation, shared
/// by their tokens: runtimes [`CancelToken::charge`] each model call's usage
/// and ask [`CancelToken::would_exceed`] before the next one.
#[derive(Debug)]
pub struct BudgetMeter {
    cap: Spend,
    spent: Mutex<Spend>,
}

impl BudgetMeter {
    /// A meter allowing `cap` (an unlimited measure: `f64::INFINITY` / `u64::MAX`).
    pub fn new(cap: Spend) -> Arc<BudgetMeter> {
        Arc::new(BudgetMeter { cap, spent: Mutex::new(Spend::default()) })
    }

    /// What was charged so far.
    pub fn spent(&self) -> Spend {
        *self.spent.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What is left of the allowance.
    pub fn left(&self) -> Spend {
        let spent = self.spent();
        Spend {
            cost_usd: (self.cap.cost_usd - spent.cost_usd).max(0.0),
            tokens: self.cap.tokens.saturating_sub(spent.tokens),
        }
    }

    fn charge(&self, cost_usd: f64, tokens: u64) {
        let mut spent = self.spent.lock().unwrap_or_else(PoisonError::into_inner);
        if cost_usd.is_finite() && cost_usd > 0.0 {
            spent.cost_usd += cost_usd;
        }
        spent.tokens = spent.tokens.saturating_add(tokens);
    }

    fn exhausted(&self) -> bool {
        let spent = self.spent();
        spent.cost_usd >= self.cap.cost_usd || spent.tokens >= self.cap.tokens
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
        CancelToken { state: Arc::default(), deadline, budget: None }
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

    /// Charges one model call's usage to the run's budget (no-op without one).
    pub fn charge(&self, cost_usd: f64, tokens: u64) {
        if let Some(meter) = &self.budget {
            meter.charge(cost_usd, tokens);
        }
    }

    /// Whether a next call expected to use `next` (tokens, and dollars where
    /// a price is known) would cross the allowance (always `false` without a
    /// budget).
    pub fn would_exceed(&self, next: Spend) -> bool {
        self.budget.as_ref().is_some_and(|m| {
            let left = m.left();
            m.exhausted() || next.tokens > left.tokens || next.cost_usd > left.cost_usd
        })
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
        CancelToken { state: Arc::clone(&self.state), deadline, budget: self.budget.clone() }
    }

    /// Stops the run (idempotent; the first reason wins).
    pub fn cancel(&self) {
        self.fire(CancelReason::Cancelled);
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
        let tokens = |n: u64| Spend { cost_usd: 0.0, tokens: n };
        assert!(!child.is_cancelled() && !child.would_exceed(tokens(10)));
        assert!(child.would_exceed(Spend { cost_usd: 1.5, tokens: 0 }));
        child.charge(0.6, 100);
        t.charge(0.5, 0);
        assert_eq!(t.reason(), Some(CancelReason::Budget));
        assert!(child.would_exceed(tokens(0)));
        let tokens = CancelToken::new()
            .with_budget(BudgetMeter::new(Spend { cost_usd: f64::INFINITY, tokens: 50 }));
        let t = tokens;
        let n = |n: u64| Spend { cost_usd: 0.0, tokens: n };
        assert!(t.would_exceed(n(51)) && !t.would_exceed(n(50)));
        t.charge(f64::NAN, 10);
        assert_eq!(t.budget().map(|m| m.left().tokens), Some(40));
    }

    #[test]
    fn a_child_token_never_extends_the_deadline() {
        let parent = CancelToken::with_timeout(Some(Duration::ZERO));
        assert!(parent.child(Some(Duration::from_secs(600))).is_cancelled());
        let open = CancelToken::new().child(Some(Duration::from_secs(600)));
        assert!(!open.is_cancelled());
    }
}
