//! The usage ledger ([`UsageLedger`]) on PostgreSQL: the ledger row, its
//! idempotency key and the maintained totals in one `SERIALIZABLE`
//! transaction, as in the SQLite backend.

use retinue_core::{
    AttributionDraft, PendingUsage, Result, SessionCost, TotalsSnapshot, TotalsUpdate,
    UsageAttribution, UsageLedger, UsageTotals, parse_json_opt,
};
use serde_json::Value;

use crate::pool::{Mode, PgResult, Tx};
use crate::store::PgStore;

fn add_totals(tx: &mut Tx<'_>, parent: &str, delta: &UsageTotals, covered_id: i64) -> PgResult<()> {
    tx.execute(
        "INSERT INTO retinue_usage_totals \
         (parent_session_id, cost_usd, input_tokens, output_tokens, covered_id) \
         VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (parent_session_id) DO UPDATE SET \
         cost_usd = retinue_usage_totals.cost_usd + EXCLUDED.cost_usd, \
         input_tokens = retinue_usage_totals.input_tokens + EXCLUDED.input_tokens, \
         output_tokens = retinue_usage_totals.output_tokens + EXCLUDED.output_tokens, \
         covered_id = EXCLUDED.covered_id",
        &[&parent, &delta.cost_usd, &delta.input_tokens, &delta.output_tokens, &covered_id],
    )?;
    Ok(())
}

/// One keyed attribution in three statements (plus `BEGIN`/`COMMIT`): the
/// key claimed together with the parent's last ledger id and covered id;
/// the ledger row inserted together with its key's `usage_id`; the totals.
fn record_in(
    tx: &mut Tx<'_>,
    draft: &AttributionDraft,
    totals: &TotalsUpdate,
    now: f64,
) -> PgResult<bool> {
    let parent = draft.parent_session_id.as_str();
    let row = tx.query_one(
        "WITH k AS (INSERT INTO retinue_usage_keys (attribution_key, usage_id, created_at) \
           SELECT $2::text, 0, $3::float8 WHERE $2::text IS NOT NULL \
           ON CONFLICT DO NOTHING RETURNING 1) \
         SELECT (SELECT count(*) FROM k), \
           (SELECT COALESCE(MAX(id), 0)::BIGINT FROM delegation_child_usage \
            WHERE parent_session_id = $1), \
           (SELECT covered_id FROM retinue_usage_totals WHERE parent_session_id = $1)",
        &[&parent, &draft.key, &now],
    )?;
    let claimed: i64 = row.try_get(0)?;
    if draft.key.is_some() && claimed == 0 {
        return Ok(false);
    }
    let prev_max: i64 = row.try_get(1)?;
    let mut covered: i64 = row.try_get::<_, Option<i64>>(2)?.unwrap_or(0);
    if let Some(c) = &totals.catch_up
        && c.from_covered_id == covered
        && c.to_id == prev_max
        && c.to_id > covered
    {
        add_totals(tx, parent, &c.delta, c.to_id)?;
        covered = c.to_id;
    }
    let aggregate = draft.aggregate.as_ref().map(Value::to_string);
    let typed = retinue_core::UsageColumns::of(&draft.usage);
    let id: i64 = tx
        .query_one(
            "WITH ins AS (INSERT INTO delegation_child_usage (parent_session_id, parent_turn_id, \
               child_session_id, usage_json, aggregate_json, created_at, cost_usd, input_tokens, \
               output_tokens, cache_read_tokens, cache_write_tokens, reasoning_tokens) \
               VALUES ($1, $2, $3, $4, $5, $6, $8, $9, $10, $11, $12, $13) RETURNING id), \
             k AS (UPDATE retinue_usage_keys SET usage_id = (SELECT id FROM ins) \
               WHERE attribution_key = $7::text) \
             SELECT id FROM ins",
            &[
                &parent,
                &draft.parent_turn_id,
                &draft.child_session_id,
                &draft.usage.to_string(),
                &aggregate,
                &now,
                &draft.key,
                &typed.cost_usd,
                &typed.input_tokens,
                &typed.output_tokens,
                &typed.cache_read_tokens,
                &typed.cache_write_tokens,
                &typed.reasoning_tokens,
            ],
        )?
        .try_get(0)?;
    // Ids of concurrent writers may be handed out out of commit order; only a
    // row above every row of the parent moves the totals (else it stays pending).
    if covered == prev_max && id > prev_max {
        add_totals(tx, parent, &totals.delta, id)?;
    }
    Ok(true)
}

impl UsageLedger for PgStore {
    fn record_usage(&self, draft: &AttributionDraft, totals: &TotalsUpdate) -> Result<bool> {
        if draft.parent_session_id.is_empty() {
            return Ok(false);
        }
        let now = self.clock.now();
        self.pool.tx("recording child usage", Mode::Write, |tx| record_in(tx, draft, totals, now))
    }

    fn usage_attributions(&self, parent: &str) -> Result<Vec<UsageAttribution>> {
        if parent.is_empty() {
            return Ok(Vec::new());
        }
        self.pool.tx("reading usage attributions", Mode::ReadOne, |tx| {
            let rows = tx.query(
                "SELECT id, parent_session_id, parent_turn_id, child_session_id, usage_json, \
                 aggregate_json, created_at FROM delegation_child_usage \
                 WHERE parent_session_id = $1 ORDER BY id",
                &[&parent],
            )?;
            rows.iter()
                .map(|r| {
                    let usage: Option<String> = r.try_get(4)?;
                    let aggregate: Option<String> = r.try_get(5)?;
                    Ok(UsageAttribution {
                        id: r.try_get(0)?,
                        parent_session_id: r.try_get(1)?,
                        parent_turn_id: r.try_get::<_, Option<String>>(2)?.unwrap_or_default(),
                        child_session_id: r.try_get::<_, Option<String>>(3)?.unwrap_or_default(),
                        usage: parse_json_opt(usage.as_deref())
                            .unwrap_or_else(|| Value::Object(serde_json::Map::new())),
                        aggregate: parse_json_opt(aggregate.as_deref()).filter(|v| !v.is_null()),
                        created_at: r.try_get::<_, Option<f64>>(6)?.unwrap_or_default(),
                    })
                })
                .collect()
        })
    }

    fn usage_totals_snapshot(&self, parent: &str) -> Result<TotalsSnapshot> {
        if parent.is_empty() {
            return Ok(TotalsSnapshot::default());
        }
        // One statement in autocommit (one round trip, one snapshot): the
        // maintained row and the parent's ledger rows above its
        // `covered_id`, a range of `idx_delegation_child_usage_parent`
        // probed once per call through the lateral join. The row
        // comparisons name both columns of the index, where a plain
        // `id > covered_id` let a generic plan walk the primary key through
        // every other parent's rows (docs/pg-plans.md).
        const SNAPSHOT: &str = "SELECT t.cost_usd, t.input_tokens, t.output_tokens, \
               t.covered_id, p.id, p.usage_json \
             FROM (VALUES (1)) one \
             LEFT JOIN retinue_usage_totals t ON t.parent_session_id = $1 \
             LEFT JOIN LATERAL (SELECT u.id, u.usage_json FROM delegation_child_usage u \
               WHERE (u.parent_session_id, u.id) > ($1, COALESCE(t.covered_id, 0)) \
                 AND (u.parent_session_id, u.id) <= ($1, 9223372036854775807)) p ON TRUE \
             ORDER BY p.id";
        self.pool.tx("reading usage totals", Mode::ReadOne, |tx| {
            let rows = tx.query(SNAPSHOT, &[&parent])?;
            let mut out = TotalsSnapshot::default();
            for (i, r) in rows.iter().enumerate() {
                if i == 0 {
                    out.covered_id = r.try_get::<_, Option<i64>>(3)?.unwrap_or_default();
                    out.maintained = UsageTotals {
                        cost_usd: r.try_get::<_, Option<f64>>(0)?.unwrap_or_default(),
                        input_tokens: r.try_get::<_, Option<f64>>(1)?.unwrap_or_default(),
                        output_tokens: r.try_get::<_, Option<f64>>(2)?.unwrap_or_default(),
                    };
                }
                if let Some(id) = r.try_get::<_, Option<i64>>(4)? {
                    out.pending.push(PendingUsage {
                        id,
                        usage_json: r.try_get::<_, Option<String>>(5)?.unwrap_or_default(),
                    });
                }
            }
            Ok(out)
        })
    }

    fn session_cost(&self, session: &str) -> Result<Option<SessionCost>> {
        self.pool.tx("reading a session cost", Mode::ReadOne, |tx| {
            let row = tx.query_opt(
                "SELECT estimated_cost_usd, cost_status, cost_source FROM sessions WHERE id = $1",
                &[&session],
            )?;
            row.map(|r| {
                Ok(SessionCost {
                    estimated_cost_usd: r.try_get(0)?,
                    cost_status: r.try_get(1)?,
                    cost_source: r.try_get(2)?,
                })
            })
            .transpose()
        })
    }

    fn write_session_cost(&self, session: &str, cost: &SessionCost) -> Result<bool> {
        self.pool.tx("writing a session cost", Mode::WriteOne, |tx| {
            let n = tx.execute(
                "UPDATE sessions SET \
                 estimated_cost_usd = COALESCE($1, estimated_cost_usd), \
                 cost_status = COALESCE($2, cost_status), \
                 cost_source = COALESCE($3, cost_source) \
                 WHERE id = $4",
                &[&cost.estimated_cost_usd, &cost.cost_status, &cost.cost_source, &session],
            )?;
            Ok(n > 0)
        })
    }
}

impl PgStore {
    /// Types the ledger rows that have no typed columns yet (written before
    /// the columns existed, or copied by an import) with the core rule, in
    /// batches; returns how many. A no-op once every row is typed.
    pub(crate) fn type_usage_rows(&self) -> Result<usize> {
        // Nothing to type (every open after the first): one read, no transaction.
        // (In the partial index's order: an `EXISTS` was planned as a
        // sequential scan of the whole ledger when the statistics were stale.)
        let untyped = self.pool.tx("typing ledger rows", Mode::ReadOne, |tx| {
            Ok(tx
                .query_opt(
                    "SELECT id FROM delegation_child_usage WHERE cost_usd IS NULL \
                     ORDER BY id LIMIT 1",
                    &[],
                )?
                .is_some())
        })?;
        if !untyped {
            return Ok(0);
        }
        let mut typed = 0;
        loop {
            let n = self.pool.tx("typing ledger rows", Mode::Write, |tx| {
                let rows = tx.query(
                    "SELECT id, usage_json FROM delegation_child_usage WHERE cost_usd IS NULL \
                     ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED",
                    &[],
                )?;
                for r in &rows {
                    let id: i64 = r.try_get(0)?;
                    let text: Option<String> = r.try_get(1)?;
                    let c = retinue_core::UsageColumns::of_json_text(text.as_deref());
                    tx.execute(
                        "UPDATE delegation_child_usage SET cost_usd = $2, input_tokens = $3, \
                         output_tokens = $4, cache_read_tokens = $5, cache_write_tokens = $6, \
                         reasoning_tokens = $7 WHERE id = $1",
                        &[
                            &id,
                            &c.cost_usd,
                            &c.input_tokens,
                            &c.output_tokens,
                            &c.cache_read_tokens,
                            &c.cache_write_tokens,
                            &c.reasoning_tokens,
                        ],
                    )?;
                }
                Ok(rows.len())
            })?;
            typed += n;
            if n == 0 {
                return Ok(typed);
            }
        }
    }
}
