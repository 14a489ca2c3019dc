//! Budgets across a whole subagent tree (issue "Budgets"): before children
//! (or a follow-up) start, an allowance is reserved against the calling
//! parent's compression lineage (its root keys the budget); the runs are
//! metered against it through their [`CancelToken`]; when they end, their
//! ledger rows are written and the reservation is settled.

use std::sync::Arc;

use retinue_core::{
    BudgetLimit, BudgetStatus, Budgets, Message, Reservation, ReservationDraft, SettleReason, Spend,
};

use crate::Inner;
use crate::error::DelegateError;
use retinue_core::run::{BudgetMeter, CancelToken, MeterStore};

/// A held reservation and the meter its runs charge.
///
/// A guard: settled ([`Held::settle`]) or released ([`Held::release`]) on
/// the paths that finish, and on any other (an early return, a panic, a
/// thread that could not start) closed when dropped — kept as spent when
/// its runs spent anything, else released. Never left open.
pub(crate) struct Held {
    id: String,
    meter: Arc<BudgetMeter>,
    root: String,
    sessions: Vec<String>,
    limit: BudgetLimit,
    budgets: Arc<dyn Budgets>,
    /// Still open (neither settled nor released).
    open: bool,
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        self.open = false;
        let spent = self.meter.spent();
        let inflight = self.meter.close();
        let done = if spent == Spend::default() && inflight == Spend::default() {
            self.budgets.settle(&self.id, &SettleReason::NothingRan)
        } else {
            // What ran (or may still be in flight) is never given back.
            let hold = Spend {
                cost_usd: spent.cost_usd + inflight.cost_usd,
                tokens: spent.tokens.saturating_add(inflight.tokens),
            };
            let _ = self.budgets.set_hold(&self.id, hold);
            self.budgets.keep_as_spent(&self.id, &SettleReason::Abandoned)
        };
        if let Err(e) = done {
            log::warn!("could not close abandoned budget reservation {}: {e}", self.id);
        }
    }
}

/// The least a run needs of a dollar budget: a lineage with nothing left
/// starts nothing.
pub(crate) const MIN_COST_USD: f64 = 1e-6;

/// Tokens a text costs at about four characters a token.
pub(crate) fn tokens_of(text: &str) -> u64 {
    u64::try_from(text.chars().count().div_ceil(4)).unwrap_or(u64::MAX)
}

/// The input tokens a resume on `transcript` plus `next` will send: each
/// message's recorded `token_count` where hermes wrote one, else its
/// characters (a message's tool calls included) at four a token.
pub(crate) fn resume_estimate(transcript: &[Message], next: &str) -> u64 {
    transcript
        .iter()
        .map(|m| match m.token_count.and_then(|n| u64::try_from(n).ok()).filter(|n| *n > 0) {
            Some(n) => n,
            None => {
                tokens_of(m.content.as_deref().unwrap_or_default())
                    + tokens_of(m.tool_calls.as_deref().unwrap_or_default())
            }
        })
        .fold(tokens_of(next), u64::saturating_add)
}

/// The budget root `payer`'s delegations draw on: the root recorded for
/// `stored` (a follow-up's target child session) or for `payer` itself (a
/// child of an earlier unit spawning in its turn), else — a top-level
/// parent — its compression-lineage root. Any doubt is an error: the caller
/// refuses under a budget.
pub(crate) fn budget_root(
    inner: &Inner,
    payer: &str,
    stored: Option<&str>,
) -> Result<String, String> {
    let budgets = &inner.parts.backend.budgets;
    for session in stored.into_iter().chain(std::iter::once(payer)) {
        match budgets.budget_root_of(session) {
            Ok(Some(root)) if !root.trim().is_empty() => return Ok(root),
            Ok(_) => {}
            Err(e) => return Err(format!("reading its budget root failed: {e}")),
        }
    }
    inner.parts.authority.root(payer).map_err(|e| e.to_string())
}

/// Records `sessions` (children a unit spawns) as members of `root`'s
/// budget, so their own spawns and their follow-ups draw on it. Under a
/// budget a failure refuses; without one it is only logged.
pub(crate) fn join(inner: &Inner, root: &str, sessions: &[String]) -> Result<(), DelegateError> {
    inner
        .parts
        .backend
        .budgets
        .join_budget(root, sessions)
        .map_err(|source| DelegateError::BudgetStore { operation: "joining the budget", source })
}

/// Reserves what runs for `payer` may spend under the lineage budget of
/// `delegation.budget` and the call's narrower `call` budget; `None` when
/// neither limits anything. `minimum` is what the runs need at least (the
/// first calls' prompts); each model call then grows the reservation by
/// what it may spend (see [`BudgetMeter`]). `root` is the budget's root
/// ([`budget_root`]), or why it could not be found.
pub(crate) fn reserve(
    inner: &Inner,
    payer: Option<&str>,
    root: &Result<String, String>,
    call: BudgetLimit,
    minimum: Spend,
    delegation_id: Option<&str>,
) -> Result<Option<Held>, DelegateError> {
    let lineage_limit = inner.parts.config.budget;
    let invalid = |e: retinue_core::Error| {
        let why = match e {
            retinue_core::Error::Invalid(why) => why,
            other => other.to_string(),
        };
        DelegateError::Budget { message: crate::texts::invalid_budget(&why) }
    };
    lineage_limit.check().map_err(invalid)?;
    call.check().map_err(invalid)?;
    if lineage_limit.is_unlimited() && call.is_unlimited() {
        return Ok(None);
    }
    let refuse = |why: &str| DelegateError::Budget { message: why.to_owned() };
    let budgets = inner.parts.backend.budgets.clone();
    let Some(payer) = payer.map(str::trim).filter(|p| !p.is_empty()) else {
        return Err(refuse(crate::texts::NO_BUDGET_PAYER));
    };
    let root = match root {
        Ok(r) => r.clone(),
        Err(why) => return Err(refuse(&crate::texts::budget_root_unknown(payer, why))),
    };
    // The spend of the lineage's continuations counts (the members' rows are
    // added by the store); a lineage that cannot be walked is refused.
    let sessions = inner
        .parts
        .authority
        .lineage_sessions(&root)
        .map_err(|e| refuse(&crate::texts::budget_root_unknown(payer, &e.to_string())))?;
    let draft = ReservationDraft {
        lineage_root: root.clone(),
        sessions: sessions.clone(),
        limit: lineage_limit,
        minimum,
        maximum: Some(minimum),
        delegation_id: delegation_id.map(str::to_owned),
    };
    let reservation = budgets.reserve(&draft).map_err(|source| DelegateError::BudgetStore {
        operation: "reserving the budget",
        source,
    })?;
    let (id, granted) = match reservation {
        Reservation::Held { id, granted, .. } => (id, granted),
        Reservation::Refused(status) => {
            return Err(DelegateError::Budget {
                message: crate::texts::budget_refused(&root, &status, minimum),
            });
        }
    };
    // The runs' own cap: the call's limit (the lineage's is the store's).
    let cap = Spend {
        cost_usd: call.max_cost_usd.unwrap_or(f64::INFINITY),
        tokens: call.max_tokens.unwrap_or(u64::MAX),
    };
    let meter = if lineage_limit.is_unlimited() {
        // Only the call's own limit: nothing to hold in the store.
        if let Err(e) = budgets.settle(&id, &SettleReason::CallLimitOnly) {
            log::warn!("could not release budget reservation {id}: {e}");
        }
        BudgetMeter::new(cap)
    } else {
        let store = MeterStore { budgets: Arc::clone(&budgets), reservation: id.clone(), draft };
        BudgetMeter::with_store(cap, store, granted)
    };
    Ok(Some(Held { id, meter, root, sessions, limit: lineage_limit, budgets, open: true }))
}

impl Held {
    /// `cancel`, metered against this reservation.
    pub(crate) fn token(&self, cancel: &CancelToken) -> CancelToken {
        cancel.clone().with_budget(Arc::clone(&self.meter))
    }

    /// Settles the reservation after the runs' ledger rows are written
    /// (`ledger_ok`), or keeps it as spent when they could not be (never
    /// given back as free), and returns the lineage budget as the result
    /// reports it.
    pub(crate) fn settle(mut self, ledger_ok: bool) -> Option<BudgetStatus> {
        self.open = false;
        let inflight = self.meter.close();
        let done = if ledger_ok && inflight == Spend::default() {
            self.budgets.settle(&self.id, &SettleReason::Settled)
        } else if ledger_ok {
            // Calls of an abandoned child were still in flight: what they
            // may have spent is kept (the ledger rows hold the rest).
            let _ = self.budgets.set_hold(&self.id, inflight);
            self.budgets.keep_as_spent(&self.id, &SettleReason::CallsInFlight)
        } else {
            // What the runs spent is what it holds now (their permits set it).
            let spent = self.meter.spent();
            let held = self.meter.held();
            if held.tokens < spent.tokens || held.cost_usd < spent.cost_usd {
                let _ = self.budgets.set_hold(&self.id, spent);
            }
            self.budgets.keep_as_spent(&self.id, &SettleReason::LedgerWriteFailed)
        };
        if let Err(e) = done {
            log::warn!("could not settle budget reservation {}: {e}", self.id);
        }
        if self.limit.is_unlimited() {
            return None;
        }
        match self.budgets.budget_status(&self.root, &self.sessions, self.limit) {
            Ok(status) => Some(status),
            Err(e) => {
                log::warn!("could not read the budget of {}: {e}", self.root);
                None
            }
        }
    }

    /// The budget's root.
    pub(crate) fn root(&self) -> &str {
        &self.root
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_estimates_prefer_recorded_counts() {
        let m = |content: &str, count: Option<i64>| Message {
            content: Some(content.to_owned()),
            token_count: count,
            ..Message::default()
        };
        let transcript = [m("abcdefgh", None), m("ignored text", Some(100)), m("", Some(0))];
        // 8 chars → 2, a recorded 100, an empty message 0, the new turn 1.
        assert_eq!(resume_estimate(&transcript, "abcd"), 103);
    }
}
