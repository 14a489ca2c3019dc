//! The parent's cost: the re-apply (never add) roll-up of semantics §7.2 step 4,
//! reapply-on-load (§7.3) and `finalize_child_results` (§7.2).

use serde_json::json;

use crate::error::UsageResult;
use crate::ledger::{load_child_usage_totals, record_child_usage_attribution};
use crate::unit::ChildUsage;
use crate::{AttributionDraft, SessionCost, UsageLedger};

/// The cost a parent session carries in memory.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParentCost {
    /// The parent's own cost (what `sessions.estimated_cost_usd` keeps).
    pub own_cost_usd: f64,
    /// The children's cost billed to it (the ledger total).
    pub subagent_cost_usd: f64,
    /// Own plus subagent cost.
    pub estimated_cost_usd: f64,
    /// `cost_status` (`unknown`, `estimated`, …).
    pub cost_status: Option<String>,
    /// `cost_source` (`none`, `subagent`, …).
    pub cost_source: Option<String>,
}

fn unset(label: Option<&str>, placeholder: &str) -> bool {
    label.is_none_or(|s| s.is_empty() || s == placeholder)
}

impl ParentCost {
    /// A parent that has only its own cost so far.
    pub fn new(
        own_cost_usd: f64,
        cost_status: Option<String>,
        cost_source: Option<String>,
    ) -> Self {
        ParentCost {
            own_cost_usd,
            subagent_cost_usd: 0.0,
            estimated_cost_usd: own_cost_usd,
            cost_status,
            cost_source,
        }
    }

    /// The cost `session` must carry when (re)loaded: its stored own cost plus
    /// the ledger total, by the step-4 rule. Idempotent however often called;
    /// reads only. A missing session has an own cost of zero.
    pub fn load(ledger: &dyn UsageLedger, session: &str) -> UsageResult<ParentCost> {
        let stored = ledger.session_cost(session)?.unwrap_or_default();
        let mut cost = ParentCost::new(
            stored.estimated_cost_usd.filter(|c| c.is_finite()).unwrap_or(0.0),
            stored.cost_status,
            stored.cost_source,
        );
        cost.reapply(load_child_usage_totals(ledger, session)?.cost_usd);
        Ok(cost)
    }

    /// Re-applies (never adds) the subagent cost: estimated = own + subagent;
    /// when that is positive, an unset source becomes `subagent` and an
    /// unknown status `estimated`.
    pub fn reapply(&mut self, subagent_cost_usd: f64) {
        self.subagent_cost_usd = subagent_cost_usd;
        self.estimated_cost_usd = self.own_cost_usd + subagent_cost_usd;
        self.fix_labels();
    }

    /// Adds children's cost in memory only (the ledger write failed).
    pub fn add_in_memory(&mut self, cost_usd: f64) {
        self.subagent_cost_usd += cost_usd;
        self.estimated_cost_usd += cost_usd;
        self.fix_labels();
    }

    fn fix_labels(&mut self) {
        if self.estimated_cost_usd > 0.0 {
            if unset(self.cost_source.as_deref(), "none") {
                self.cost_source = Some("subagent".to_owned());
            }
            if unset(self.cost_status.as_deref(), "unknown") {
                self.cost_status = Some("estimated".to_owned());
            }
        }
    }
}

/// Where a finalize bills its children.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FinalizeContext<'a> {
    /// The parent's session id; `''` = nothing is recorded.
    pub parent_session_id: &'a str,
    /// The parent's current turn id, or `''`.
    pub turn_id: &'a str,
    /// The unit's id, the first part of each attribution key.
    pub delegation_id: &'a str,
    /// The run label, the last part of each key (`spawn`, `follow_up-2`, …).
    pub run: &'a str,
}

/// One child's result to bill.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FinalizeEntry {
    /// The child's task index.
    pub task_index: usize,
    /// The child's session id.
    pub child_session_id: String,
    /// What the child used.
    pub usage: ChildUsage,
}

/// What a finalize did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FinalizeReport {
    /// Rows written.
    pub recorded: usize,
    /// Entries whose key was already recorded (a replay).
    pub replayed: usize,
    /// `false` when a ledger write failed and the cost was added in memory.
    pub ledger_ok: bool,
}

/// The attribution key of one child run: `<delegation_id>:<index>:<run>`.
pub fn attribution_key(ctx: &FinalizeContext<'_>, task_index: usize) -> Option<String> {
    (!ctx.delegation_id.is_empty())
        .then(|| format!("{}:{task_index}:{}", ctx.delegation_id, ctx.run))
}

/// Bills children's results to the parent (semantics §7.2 steps 2–4): records one
/// keyed attribution per entry (zero cost too), then re-applies the ledger
/// total onto `cost` and persists the cost labels through the ledger.
/// Replaying the same finalize records nothing and changes no total.
///
/// Never fails: if the ledger cannot be written or read, the batch is added
/// to `cost` in memory and a warning is logged. Callers serialize finalizes
/// per parent.
pub fn finalize_child_results(
    ledger: &dyn UsageLedger,
    ctx: &FinalizeContext<'_>,
    entries: &[FinalizeEntry],
    cost: &mut ParentCost,
) -> FinalizeReport {
    let batch: f64 = entries.iter().map(|e| e.usage.cost_usd).sum();
    let mut report = FinalizeReport { ledger_ok: true, ..FinalizeReport::default() };
    if ctx.parent_session_id.is_empty() {
        cost.add_in_memory(batch);
        return report;
    }
    match bill(ledger, ctx, entries, cost, batch, &mut report) {
        Ok(()) => {
            if let Err(e) = store_labels(ledger, ctx.parent_session_id, cost) {
                log::warn!(
                    "could not store the cost labels of session {}: {e}",
                    ctx.parent_session_id
                );
            }
        }
        Err(e) => {
            log::warn!(
                "usage ledger write failed for session {}; adding {batch} USD in memory: {e}",
                ctx.parent_session_id
            );
            report.ledger_ok = false;
            cost.add_in_memory(batch);
        }
    }
    report
}

/// Persists the rolled-up labels if the stored session's differ (its own
/// cost is left as it is: the ledger stays the source of subagent cost).
fn store_labels(ledger: &dyn UsageLedger, session: &str, cost: &ParentCost) -> UsageResult<()> {
    if cost.cost_status.is_none() && cost.cost_source.is_none() {
        return Ok(());
    }
    let Some(stored) = ledger.session_cost(session)? else {
        return Ok(());
    };
    if stored.cost_status == cost.cost_status && stored.cost_source == cost.cost_source {
        return Ok(());
    }
    let write = SessionCost {
        estimated_cost_usd: None,
        cost_status: cost.cost_status.clone(),
        cost_source: cost.cost_source.clone(),
    };
    ledger.write_session_cost(session, &write)?;
    Ok(())
}

fn bill(
    ledger: &dyn UsageLedger,
    ctx: &FinalizeContext<'_>,
    entries: &[FinalizeEntry],
    cost: &mut ParentCost,
    batch: f64,
    report: &mut FinalizeReport,
) -> UsageResult<()> {
    let before = load_child_usage_totals(ledger, ctx.parent_session_id)?.cost_usd;
    // The aggregate as it will stand after step 4, were the batch new.
    let aggregate = json!({
        "session_estimated_cost_usd": cost.own_cost_usd + before + batch,
        "children_cost_total": batch,
    });
    for entry in entries {
        let draft = AttributionDraft {
            parent_session_id: ctx.parent_session_id.to_owned(),
            parent_turn_id: ctx.turn_id.to_owned(),
            child_session_id: entry.child_session_id.clone(),
            usage: entry.usage.to_json(),
            aggregate: Some(aggregate.clone()),
            key: attribution_key(ctx, entry.task_index),
        };
        if record_child_usage_attribution(ledger, &draft)? {
            report.recorded += 1;
        } else {
            report.replayed += 1;
        }
    }
    cost.reapply(load_child_usage_totals(ledger, ctx.parent_session_id)?.cost_usd);
    Ok(())
}
