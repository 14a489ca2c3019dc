//! The money rules of a run: the [`BudgetMeter`] a run's model calls ask
//! for leave ([`CallPermit`]), growing and settling the lineage
//! reservation in the budget store; the stores only store.

use std::sync::{Arc, Mutex, PoisonError};

use crate::Spend;

/// The store side of a [`BudgetMeter`]: the lineage reservation its runs
/// grow call by call (the orchestrator's; not for runtimes).
#[doc(hidden)]
pub struct MeterStore {
    /// The budget store.
    pub budgets: Arc<dyn crate::Budgets>,
    /// The reservation's id.
    pub reservation: String,
    /// Root, sessions and limit of the budget (`minimum`/`maximum` unused).
    pub draft: crate::ReservationDraft,
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
pub(super) fn usd(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 { v } else { 0.0 }
}

/// The spending allowance of the runs under one budget: the call's own cap
/// (in memory) and, under a lineage budget, the store reservation that each
/// model call grows by its prompt plus its bounded completion before it is
/// made ([`CancelToken::begin_call`](super::CancelToken::begin_call)) and that is set back to what was spent
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
    #[doc(hidden)]
    pub fn with_store(cap: Spend, store: MeterStore, held: Spend) -> Arc<BudgetMeter> {
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

    pub(super) fn exhausted(&self) -> bool {
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
    #[doc(hidden)]
    pub fn charge_after(&self, extra: Spend) {
        let mut st = self.lock();
        st.charged =
            plus(st.charged, Spend { cost_usd: usd(extra.cost_usd), tokens: extra.tokens });
        self.sync(&mut st);
    }

    /// Closes the meter (no call starts after this) and returns what the
    /// calls still in flight hold (an abandoned child's calls).
    #[doc(hidden)]
    pub fn close(&self) -> Spend {
        let mut st = self.lock();
        st.closed = true;
        st.inflight
    }

    /// What the store reservation holds now.
    #[doc(hidden)]
    pub fn held(&self) -> Spend {
        self.lock().held
    }

    pub(super) fn begin(&self, plan: &CallPlan) -> Result<(Spend, Option<u64>, bool), CallRefusal> {
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
                let draft = crate::ReservationDraft {
                    minimum,
                    maximum: Some(Spend {
                        cost_usd: (most.cost_usd - st.held.cost_usd).max(0.0),
                        tokens: most.tokens.saturating_sub(st.held.tokens),
                    }),
                    ..store.draft.clone()
                };
                match store.budgets.grow(&store.reservation, &draft) {
                    Ok(crate::Reservation::Held { granted, .. }) => {
                        st.held = plus(st.held, granted);
                    }
                    Ok(crate::Reservation::Refused(status)) => {
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

/// Why [`CancelToken::begin_call`](super::CancelToken::begin_call) refused a model call.
#[derive(Debug, Clone, PartialEq)]
pub enum CallRefusal {
    /// The run's own allowance (the call's `budget`) is spent.
    Spent,
    /// The lineage budget cannot cover the call's prompt: `exceeded` when
    /// what is spent leaves too little, else the rest is held by running
    /// delegations.
    Lineage {
        /// The budget at the refusal.
        status: crate::BudgetStatus,
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
    pub(super) max_completion_tokens: Option<u64>,
    pub(super) hold: Spend,
    pub(super) meter: Option<Arc<BudgetMeter>>,
    pub(super) metered: Arc<Mutex<Spend>>,
    /// A call of unknown price under a dollar limit (see [`MeterState`]).
    pub(super) exclusive: bool,
    pub(super) done: bool,
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
