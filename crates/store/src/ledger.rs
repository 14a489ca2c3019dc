//! The usage ledger on `delegation_child_usage` (semantics §7).
//!
//! This module only persists: it knows no usage rules. The `retinue-usage`
//! crate folds usage JSON into [`UsageTotals`] and hands the store the delta
//! to add; the store keeps those deltas in `retinue_usage_totals` in the same
//! `BEGIN IMMEDIATE` transaction as the ledger row and its idempotency key.
//!
//! Maintained totals cover the parent's ledger rows up to `covered_id`. Rows
//! above it (written by another program, such as hermes) are returned raw by
//! [`UsageLedger::usage_totals_snapshot`] for the caller to fold at read time,
//! and may be folded in by a later [`UsageLedger::record_usage`] through a
//! [`TotalsCatchUp`]. Reads never write.

use rusqlite::{OptionalExtension, Transaction, params};
use serde_json::Value;

use crate::error::{Result, SqlResult};
use crate::rows::{json_column_logged, real_column, text_column};
use retinue_core::{SessionCost, parse_json_opt};

/// The ledger table (named in warnings about its rows).
const TABLE: &str = "delegation_child_usage";
use crate::store::Store;

use retinue_core::{
    AttributionDraft, PendingUsage, TotalsSnapshot, TotalsUpdate, UsageAttribution, UsageLedger,
    UsageTotals,
};

fn totals_row(tx: &rusqlite::Connection, parent: &str) -> SqlResult<Option<(UsageTotals, i64)>> {
    Ok(tx
        .prepare_cached(
            "SELECT cost_usd, input_tokens, output_tokens, covered_id \
             FROM retinue_usage_totals WHERE parent_session_id = ?1",
        )?
        .query_row([parent], |r| {
            // A cache row someone damaged (text, non-finite) is ignored: the
            // parent's rows are then folded from scratch.
            let (Some(cost_usd), Some(input_tokens), Some(output_tokens), Some(covered)) =
                (real_column(r, 0)?, real_column(r, 1)?, real_column(r, 2)?, real_column(r, 3)?)
            else {
                return Ok(None);
            };
            Ok(Some((UsageTotals { cost_usd, input_tokens, output_tokens }, covered as i64)))
        })
        .optional()?
        .flatten())
}

fn add_totals(
    tx: &Transaction<'_>,
    parent: &str,
    delta: &UsageTotals,
    covered_id: i64,
) -> SqlResult<()> {
    tx.prepare_cached(
        "INSERT INTO retinue_usage_totals \
         (parent_session_id, cost_usd, input_tokens, output_tokens, covered_id) \
         VALUES (?1, ?2, ?3, ?4, ?5) \
         ON CONFLICT(parent_session_id) DO UPDATE SET \
         cost_usd = cost_usd + excluded.cost_usd, \
         input_tokens = input_tokens + excluded.input_tokens, \
         output_tokens = output_tokens + excluded.output_tokens, \
         covered_id = excluded.covered_id",
    )?
    .execute(params![
        parent,
        delta.cost_usd,
        delta.input_tokens,
        delta.output_tokens,
        covered_id
    ])?;
    Ok(())
}

fn record_in(
    tx: &Transaction<'_>,
    draft: &AttributionDraft,
    totals: &TotalsUpdate,
    now: f64,
) -> SqlResult<bool> {
    let parent = draft.parent_session_id.as_str();
    if let Some(key) = &draft.key {
        let fresh = tx
            .prepare_cached(
                "INSERT OR IGNORE INTO retinue_usage_keys (attribution_key, usage_id, created_at) \
                 VALUES (?1, 0, ?2)",
            )?
            .execute(params![key, now])?;
        if fresh == 0 {
            return Ok(false);
        }
    }
    let prev_max: i64 = tx
        .prepare_cached(
            "SELECT COALESCE(MAX(id), 0) FROM delegation_child_usage WHERE parent_session_id = ?1",
        )?
        .query_row([parent], |r| r.get(0))?;
    let mut covered = totals_row(tx, parent)?.map_or(0, |(_, c)| c);
    if let Some(c) = &totals.catch_up
        && c.from_covered_id == covered
        && c.to_id == prev_max
        && c.to_id > covered
    {
        add_totals(tx, parent, &c.delta, c.to_id)?;
        covered = c.to_id;
    }
    tx.prepare_cached(
        "INSERT INTO delegation_child_usage \
         (parent_session_id, parent_turn_id, child_session_id, usage_json, aggregate_json, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![
        parent,
        draft.parent_turn_id,
        draft.child_session_id,
        draft.usage.to_string(),
        draft.aggregate.as_ref().map(Value::to_string),
        now
    ])?;
    let id = tx.last_insert_rowid();
    if let Some(key) = &draft.key {
        tx.prepare_cached(
            "UPDATE retinue_usage_keys SET usage_id = ?1 WHERE attribution_key = ?2",
        )?
        .execute(params![id, key])?;
    }
    if covered == prev_max {
        add_totals(tx, parent, &totals.delta, id)?;
    }
    Ok(true)
}

impl UsageLedger for Store {
    fn record_usage(&self, draft: &AttributionDraft, totals: &TotalsUpdate) -> Result<bool> {
        if draft.parent_session_id.is_empty() {
            return Ok(false);
        }
        let now = self.clock.now();
        self.pool.write("recording child usage", |tx| record_in(tx, draft, totals, now))
    }

    fn usage_attributions(&self, parent: &str) -> Result<Vec<UsageAttribution>> {
        if parent.is_empty() {
            return Ok(Vec::new());
        }
        self.pool.read("reading usage attributions", |tx| {
            let mut stmt = tx.prepare_cached(
                "SELECT id, parent_session_id, parent_turn_id, child_session_id, usage_json, \
                 aggregate_json, created_at FROM delegation_child_usage \
                 WHERE parent_session_id = ?1 ORDER BY id",
            )?;
            let rows = stmt.query_map([parent], |r| {
                let id: i64 = r.get(0)?;
                let usage = json_column_logged(r, 4, TABLE, "usage_json", id)?;
                let aggregate = json_column_logged(r, 5, TABLE, "aggregate_json", id)?;
                Ok(UsageAttribution {
                    id,
                    parent_session_id: text_column(r, 1)?.unwrap_or_default(),
                    parent_turn_id: text_column(r, 2)?.unwrap_or_default(),
                    child_session_id: text_column(r, 3)?.unwrap_or_default(),
                    usage: parse_json_opt(usage.as_deref())
                        .unwrap_or_else(|| Value::Object(serde_json::Map::new())),
                    aggregate: parse_json_opt(aggregate.as_deref()).filter(|v| !v.is_null()),
                    created_at: real_column(r, 6)?.unwrap_or_default(),
                })
            })?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
    }

    fn usage_totals_snapshot(&self, parent: &str) -> Result<TotalsSnapshot> {
        if parent.is_empty() {
            return Ok(TotalsSnapshot::default());
        }
        self.pool.read("reading usage totals", |tx| {
            let (maintained, covered_id) = totals_row(tx, parent)?.unwrap_or_default();
            let mut stmt = tx.prepare_cached(
                "SELECT id, usage_json FROM delegation_child_usage \
                 WHERE parent_session_id = ?1 AND id > ?2 ORDER BY id",
            )?;
            let pending = stmt
                .query_map(params![parent, covered_id], |r| {
                    let id: i64 = r.get(0)?;
                    Ok(PendingUsage {
                        id,
                        usage_json: json_column_logged(r, 1, TABLE, "usage_json", id)?
                            .unwrap_or_default(),
                    })
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(TotalsSnapshot { maintained, covered_id, pending })
        })
    }

    fn session_cost(&self, session: &str) -> Result<Option<SessionCost>> {
        self.pool.read("reading a session cost", |tx| {
            Ok(tx
                .prepare_cached(
                    "SELECT estimated_cost_usd, cost_status, cost_source FROM sessions WHERE id = ?1",
                )?
                .query_row([session], |r| {
                    Ok(SessionCost {
                        estimated_cost_usd: r.get(0)?,
                        cost_status: r.get(1)?,
                        cost_source: r.get(2)?,
                    })
                })
                .optional()?)
        })
    }

    fn write_session_cost(&self, session: &str, cost: &SessionCost) -> Result<bool> {
        self.pool.write("writing a session cost", |tx| {
            let n = tx
                .prepare_cached(
                    "UPDATE sessions SET \
                     estimated_cost_usd = COALESCE(?1, estimated_cost_usd), \
                     cost_status = COALESCE(?2, cost_status), \
                     cost_source = COALESCE(?3, cost_source) \
                     WHERE id = ?4",
                )?
                .execute(params![
                    cost.estimated_cost_usd,
                    cost.cost_status,
                    cost.cost_source,
                    session
                ])?;
            Ok(n > 0)
        })
    }
}
