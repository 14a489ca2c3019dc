//! Recording and reading the ledger through the [`UsageLedger`] seam
//! (semantics §7.1), with totals folded from the store's maintained snapshot.

use std::collections::HashSet;

use retinue_core::{LineageWalk, MAX_HOPS, TotalsCatchUp, TotalsUpdate};
use serde::Serialize;
use serde_json::Value;

use crate::error::UsageResult;
use crate::fold::{fold_usage, fold_usage_text};
use crate::{AttributionDraft, UsageAttribution, UsageLedger, UsageTotals};

/// Totals over a whole compression lineage.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct LineageTotals {
    /// The summed totals.
    #[serde(flatten)]
    pub totals: UsageTotals,
    /// `false` when the root failed and only the session's own totals count.
    pub lineage_resolved: bool,
    /// The sessions summed, root first.
    #[serde(skip)]
    pub sessions: Vec<String>,
}

fn is_empty_aggregate(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        _ => false,
    }
}

/// Records one attribution (semantics §7.1). An empty parent is a no-op; a known
/// key writes nothing. Returns whether a row was written.
///
/// The row's fold is added to the maintained totals in the same transaction;
/// rows another program wrote since are folded in first when still current.
pub fn record_child_usage_attribution(
    ledger: &dyn UsageLedger,
    draft: &AttributionDraft,
) -> UsageResult<bool> {
    if draft.parent_session_id.is_empty() {
        return Ok(false);
    }
    let mut draft = draft.clone();
    if draft.aggregate.as_ref().is_some_and(is_empty_aggregate) {
        draft.aggregate = None;
    }
    let snapshot = ledger.usage_totals_snapshot(&draft.parent_session_id)?;
    let catch_up = snapshot.pending.last().map(|last| TotalsCatchUp {
        from_covered_id: snapshot.covered_id,
        to_id: last.id,
        delta: snapshot
            .pending
            .iter()
            .fold(UsageTotals::default(), |acc, p| acc.plus(fold_usage_text(&p.usage_json))),
    });
    let update = TotalsUpdate { delta: fold_usage(&draft.usage), catch_up };
    Ok(ledger.record_usage(&draft, &update)?)
}

/// The exact parent's attributions, oldest first; an empty id → `[]`.
pub fn load_child_usage_attributions(
    ledger: &dyn UsageLedger,
    parent: &str,
) -> UsageResult<Vec<UsageAttribution>> {
    if parent.is_empty() {
        return Ok(Vec::new());
    }
    Ok(ledger.usage_attributions(parent)?)
}

/// The exact parent's totals (unknown parent → zeros): the maintained totals
/// plus the fold of the rows they do not cover yet. `aggregate` is ignored.
pub fn load_child_usage_totals(ledger: &dyn UsageLedger, parent: &str) -> UsageResult<UsageTotals> {
    if parent.is_empty() {
        return Ok(UsageTotals::default());
    }
    let snapshot = ledger.usage_totals_snapshot(parent)?;
    Ok(snapshot
        .pending
        .iter()
        .fold(snapshot.maintained, |acc, p| acc.plus(fold_usage_text(&p.usage_json))))
}

/// Totals over `session`'s whole compression lineage (semantics §7.1); a failed
/// root → the session's own totals with `lineage_resolved: false`.
pub fn load_lineage_usage_totals(
    ledger: &dyn UsageLedger,
    walk: &dyn LineageWalk,
    session: &str,
) -> UsageResult<LineageTotals> {
    let Some(lineage) = walk.lineage_sessions(session) else {
        return Ok(LineageTotals {
            totals: load_child_usage_totals(ledger, session)?,
            lineage_resolved: false,
            sessions: vec![session.to_owned()],
        });
    };
    let mut seen = HashSet::new();
    let mut out = LineageTotals { lineage_resolved: true, ..LineageTotals::default() };
    for id in lineage.into_iter().take(MAX_HOPS + 1) {
        if id.is_empty() || !seen.insert(id.clone()) {
            continue;
        }
        out.totals = out.totals.plus(load_child_usage_totals(ledger, &id)?);
        out.sessions.push(id);
    }
    Ok(out)
}
