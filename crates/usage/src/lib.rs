//! `retinue-usage`: bills children's cost to the parent that paid for them.
//!
//! Its one job is the usage rules of the ledger (semantics §7) as pure functions
//! over plain data: folding usage JSON into totals, building a unit's
//! `usage_json`, and the re-apply (never add) roll-up of children's cost onto
//! the parent. Persistence goes through the store's [`UsageLedger`] seam, so
//! recording is idempotent (keyed) and the ledger stays the source of truth
//! for subagent cost.
//!
//! ```no_run
//! use retinue_store::{Store, StoreOptions};
//! use retinue_usage::{ParentCost, load_child_usage_totals};
//! let store = Store::open("/tmp/demo/state.db", StoreOptions::default())?;
//! let totals = load_child_usage_totals(&store, "parent-1")?;
//! let cost = ParentCost::load(&store, "parent-1")?;
//! println!("{} {}", totals.cost_usd, cost.estimated_cost_usd);
//! # Ok::<(), retinue_usage::UsageError>(())
//! ```

mod cost;
mod error;
mod fold;
mod ledger;
mod unit;

#[cfg(test)]
mod tests;

pub use cost::{
    FinalizeContext, FinalizeEntry, FinalizeReport, ParentCost, attribution_key,
    finalize_child_results,
};
pub use error::{UsageError, UsageResult};
pub use fold::{ChildSpend, budget_json, child_breakdown, fold_usage, fold_usage_text, number};
pub use ledger::{
    LineageTotals, load_child_usage_attributions, load_child_usage_totals,
    load_lineage_usage_totals, record_child_usage_attribution,
};
pub use retinue_core::{AttributionDraft, SessionCost, UsageAttribution, UsageLedger, UsageTotals};
pub use unit::{ChildRun, ChildUsage, Tokens, add_usd, merge_unit_usage};
