//! The usage ledger's records and its persistence seam (semantics §7).
//! Plain data in and out; the `retinue-usage` crate holds the rules that
//! fold usage JSON into totals.

use serde::Serialize;
use serde_json::Value;

use crate::error::Result;
use crate::model::SessionCost;

/// The three ledger totals, as floats (hermes's API shape).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct UsageTotals {
    /// Sum of `usage.cost_usd`.
    pub cost_usd: f64,
    /// Sum of `usage.tokens.input`.
    pub input_tokens: f64,
    /// Sum of `usage.tokens.output`.
    pub output_tokens: f64,
}

impl UsageTotals {
    /// The field-wise sum of `self` and `other`.
    #[must_use]
    pub fn plus(self, other: UsageTotals) -> UsageTotals {
        UsageTotals {
            cost_usd: self.cost_usd + other.cost_usd,
            input_tokens: self.input_tokens + other.input_tokens,
            output_tokens: self.output_tokens + other.output_tokens,
        }
    }
}

/// One ledger row to write.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AttributionDraft {
    /// The paying parent session; empty = nothing is written.
    pub parent_session_id: String,
    /// The parent's turn (`''` if none).
    pub parent_turn_id: String,
    /// The child session (`''` if none).
    pub child_session_id: String,
    /// The child's usage object (stored as `usage_json`).
    pub usage: Value,
    /// Optional aggregate snapshot (stored as `aggregate_json`; `None` = NULL).
    pub aggregate: Option<Value>,
    /// Idempotency key: a key already recorded writes nothing.
    pub key: Option<String>,
}

/// A stored ledger row, as hermes's `load_child_usage_attributions` returns it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UsageAttribution {
    /// Ledger row id (insertion order); not part of the hermes record.
    #[serde(skip)]
    pub id: i64,
    /// The paying parent session.
    pub parent_session_id: String,
    /// The parent's turn (`''` if none).
    pub parent_turn_id: String,
    /// The child session (`''` if none).
    pub child_session_id: String,
    /// The usage object; malformed stored JSON reads as `{}`.
    pub usage: Value,
    /// The aggregate snapshot; NULL or malformed reads as `None`.
    pub aggregate: Option<Value>,
    /// Creation time, epoch seconds.
    pub created_at: f64,
}

/// A ledger row not yet folded into the maintained totals.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingUsage {
    /// Ledger row id.
    pub id: i64,
    /// The raw `usage_json` text, unparsed.
    pub usage_json: String,
}

/// A parent's maintained totals plus the rows they do not cover yet.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TotalsSnapshot {
    /// Totals of the parent's rows with `id <= covered_id`.
    pub maintained: UsageTotals,
    /// Highest ledger id folded into `maintained` (0 = none).
    pub covered_id: i64,
    /// The parent's rows with `id > covered_id`, oldest first.
    pub pending: Vec<PendingUsage>,
}

/// Folds pending rows into the maintained totals, compare-and-swap style:
/// applied only if the totals still cover exactly `from_covered_id` and
/// `to_id` is the parent's newest row before the one being recorded.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TotalsCatchUp {
    /// The `covered_id` the delta was computed from.
    pub from_covered_id: i64,
    /// The newest pending row id the delta covers.
    pub to_id: i64,
    /// The fold of the pending rows `(from_covered_id, to_id]`.
    pub delta: UsageTotals,
}

/// What a recorded row does to the maintained totals.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TotalsUpdate {
    /// The caller's fold of the new row's usage.
    pub delta: UsageTotals,
    /// Pending rows to fold in first, if they still match.
    pub catch_up: Option<TotalsCatchUp>,
}

/// The persistence seam of the usage ledger. Plain data in and out; no
/// usage rules (the `retinue-usage` crate folds JSON into totals).
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait UsageLedger: Send + Sync {
    /// Writes one ledger row, its key and the maintained totals in one
    /// transaction. `totals.delta` is the caller's fold of `draft.usage`; it
    /// is added to the totals only when no earlier row of the parent is
    /// unfolded (after applying `totals.catch_up`, if it still matches).
    ///
    /// Returns `false` and writes nothing for an empty parent or a key
    /// already recorded.
    fn record_usage(&self, draft: &AttributionDraft, totals: &TotalsUpdate) -> Result<bool>;

    /// The exact parent's rows, oldest first; an empty id → `[]`.
    fn usage_attributions(&self, parent: &str) -> Result<Vec<UsageAttribution>>;

    /// The parent's maintained totals and its unfolded rows; unknown or empty
    /// parent → zeros and no rows.
    fn usage_totals_snapshot(&self, parent: &str) -> Result<TotalsSnapshot>;

    /// A session's cost fields; `None` if the session does not exist.
    fn session_cost(&self, session: &str) -> Result<Option<SessionCost>>;

    /// Writes a session's cost fields; `None` fields are left unchanged.
    /// Returns `false` if the session does not exist.
    fn write_session_cost(&self, session: &str, cost: &SessionCost) -> Result<bool>;
}
