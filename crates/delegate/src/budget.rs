//! Budgets across a whole subagent tree (issue "Budgets"): before children
//! (or a follow-up) start, an allowance is reserved against the calling
//! parent's compression lineage (its root keys the budget); the runs are
//! metered against it through their [`CancelToken`]; when they end, their
//! ledger rows are written and the reservation is settled.

use std::sync::Arc;

use retinue_store::{BudgetLimit, Budgets, Message, Reservation, ReservationDraft, Spend};
use serde_json::Value;
#[cfg(test)]
use serde_json::json;

use crate::Inner;
use crate::error::DelegateError;
use crate::runtime::{BudgetMeter, CancelToken};

/// A held reservation and the meter its runs charge.
pub(crate) struct Held {
    id: String,
    meter: Arc<BudgetMeter>,
    root: String,
    sessions: Vec<String>,
    limit: BudgetLimit,
    budgets: Arc<dyn Budgets>,
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

/// The call's `budget` argument: `{max_cost_usd, max_tokens}`, non-negative
/// numbers; anything else is an invalid argument.
pub(crate) fn parse_call_budget(args: &Value) -> Result<BudgetLimit, DelegateError> {
    let Some(raw) = args.get("budget").filter(|v| !v.is_null()) else {
        return Ok(BudgetLimit::default());
    };
    let bad = || DelegateError::InvalidArguments(crate::texts::BAD_BUDGET.to_owned());
    let obj = raw.as_object().ok_or_else(bad)?;
    let mut limit = BudgetLimit::default();
    if let Some(v) = obj.get("max_cost_usd").filter(|v| !v.is_null()) {
        let f = v.as_f64().filter(|f| f.is_finite() && *f >= 0.0).ok_or_else(bad)?;
        limit.max_cost_usd = Some(f);
    }
    if let Some(v) = obj.get("max_tokens").filter(|v| !v.is_null()) {
        limit.max_tokens = Some(v.as_u64().ok_or_else(bad)?);
    }
    Ok(limit)
}

/// Reserves what runs for `payer` may spend under the lineage budget of
/// `delegation.budget` and the call's narrower `call` budget; `None` when
/// neither limits anything. `minimum` is what the runs need at least.
pub(crate) fn reserve(
    inner: &Inner,
    payer: Option<&str>,
    call: BudgetLimit,
    minimum: Spend,
    delegation_id: Option<&str>,
) -> Result<Option<Held>, DelegateError> {
    let lineage_limit = inner.parts.config.budget;
    if lineage_limit.is_unlimited() && call.is_unlimited() {
        return Ok(None);
    }
    let refuse = |why: &str| DelegateError::Budget { message: why.to_owned() };
    let Some(budgets) = inner.parts.budgets.clone() else {
        return Err(refuse(crate::texts::NO_BUDGET_STORE));
    };
    let Some(payer) = payer.map(str::trim).filter(|p| !p.is_empty()) else {
        return Err(refuse(crate::texts::NO_BUDGET_PAYER));
    };
    let authority = &inner.parts.authority;
    // A session whose root cannot be proven (a branch, a broken chain) is a
    // budget of its own: never merged into another lineage's.
    let root = authority.root(payer).unwrap_or_else(|_| payer.to_owned());
    let sessions = authority.lineage_sessions(payer).unwrap_or_else(|_| vec![payer.to_owned()]);
    let maximum = (!call.is_unlimited()).then(|| Spend {
        cost_usd: call.max_cost_usd.unwrap_or(f64::INFINITY),
        tokens: call.max_tokens.unwrap_or(u64::MAX),
    });
    let draft = ReservationDraft {
        lineage_root: root.clone(),
        sessions: sessions.clone(),
        limit: lineage_limit,
        minimum,
        maximum,
        delegation_id: delegation_id.map(str::to_owned),
    };
    let reservation = budgets.reserve(&draft).map_err(DelegateError::Storage)?;
    let granted = match reservation {
        Reservation::Held { id, granted, .. } => (id, granted),
        Reservation::Refused(status) => {
            return Err(DelegateError::Budget {
                message: crate::texts::budget_refused(&root, &status, minimum),
            });
        }
    };
    // The runs' cap per measure: what the lineage reservation holds, or the
    // call's own limit where the lineage has none, or nothing.
    let cap = |lineage: bool, held: f64, own: Option<f64>| {
        if lineage { held } else { own.unwrap_or(f64::INFINITY) }
    };
    let tokens_cap = if lineage_limit.max_tokens.is_some() {
        granted.1.tokens
    } else {
        call.max_tokens.unwrap_or(u64::MAX)
    };
    let meter = BudgetMeter::new(Spend {
        cost_usd: cap(lineage_limit.max_cost_usd.is_some(), granted.1.cost_usd, call.max_cost_usd),
        tokens: tokens_cap,
    });
    Ok(Some(Held { id: granted.0, meter, root, sessions, limit: lineage_limit, budgets }))
}

impl Held {
    /// `cancel`, metered against this reservation.
    pub(crate) fn token(&self, cancel: &CancelToken) -> CancelToken {
        cancel.clone().with_budget(Arc::clone(&self.meter))
    }

    /// Settles the reservation (after the runs' ledger rows are written) and
    /// returns the lineage budget as the result reports it.
    pub(crate) fn settle(self) -> Option<Value> {
        if let Err(e) = self.budgets.settle(&self.id, "settled") {
            log::warn!("could not settle budget reservation {}: {e}", self.id);
        }
        if self.limit.is_unlimited() {
            return None;
        }
        match self.budgets.budget_status(&self.root, &self.sessions, self.limit) {
            Ok(status) => Some(retinue_usage::budget_json(&status)),
            Err(e) => {
                log::warn!("could not read the budget of {}: {e}", self.root);
                None
            }
        }
    }

    /// Gives the reservation back without a run (nothing was started).
    pub(crate) fn release(self) {
        if let Err(e) = self.budgets.settle(&self.id, "released: nothing ran") {
            log::warn!("could not release budget reservation {}: {e}", self.id);
        }
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

    #[test]
    fn call_budgets_are_validated() {
        assert_eq!(parse_call_budget(&json!({})).ok(), Some(BudgetLimit::default()));
        let ok = parse_call_budget(&json!({"budget": {"max_cost_usd": 0.5, "max_tokens": 10}}));
        assert_eq!(ok.ok(), Some(BudgetLimit { max_cost_usd: Some(0.5), max_tokens: Some(10) }));
        for bad in [
            json!({"budget": 3}),
            json!({"budget": {"max_cost_usd": -1}}),
            json!({"budget": {"max_tokens": 1.5}}),
        ] {
            assert!(matches!(parse_call_budget(&bad), Err(DelegateError::InvalidArguments(_))));
        }
    }
}
