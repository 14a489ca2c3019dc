//! [`Claims`] on PostgreSQL: resume and delivery claims (row locks, `SKIP
//! LOCKED` for deliveries), finishing a follow-up.

use retinue_core::{
    Claims, DeliveryClaim, DeliveryFilter, Error, LEASE_SECS, MAX_DELIVERY_ATTEMPTS, Result,
    ResumeClaim, UsageSwap, parse_json_opt,
};
use serde_json::Value;

use crate::pool::{Fail, Mode, PgResult, Tx, int, random_hex, u32_of};
use crate::store::{PgStore, SERVER_NOW};

fn release_in(tx: &mut Tx<'_>, id: &str, child_index: u32, token: &str) -> PgResult<bool> {
    let n = tx.execute(
        "UPDATE retinue_children SET resume_claim = NULL, resume_claimed_at = NULL \
         WHERE delegation_id = $1 AND child_index = $2 AND resume_claim = $3",
        &[&id, &int(child_index), &token],
    )?;
    Ok(n > 0)
}

impl Claims for PgStore {
    fn claim_delivery(&self, filter: &DeliveryFilter) -> Result<Option<DeliveryClaim>> {
        let now = self.clock.now();
        self.pool.tx("claiming a delivery", Mode::Write, |tx| {
            // Rows whose event is not JSON are never offered (SQLite: `json_valid`).
            let mut unreadable: Vec<String> = Vec::new();
            loop {
                let row = tx.query_opt(
                    &format!(
                        "SELECT delegation_id, delivery_attempts, event_json \
                     FROM async_delegations \
                     WHERE delivery_state = 'pending' AND state NOT IN ('running', 'finalizing') \
                       AND event_json IS NOT NULL \
                       AND (delivery_claim IS NULL OR delivery_claimed_at IS NULL \
                            OR delivery_claimed_at + $1 <= {SERVER_NOW} \
                            OR delivery_claimed_at > {SERVER_NOW} + $1) \
                       AND ($2::text IS NULL OR origin_session = $2) \
                       AND ($3::text IS NULL OR parent_session_id = $3) \
                       AND ($4::text IS NULL OR delegation_id = $4) \
                       AND NOT (delegation_id = ANY($5)) \
                     ORDER BY completed_at NULLS FIRST, delegation_id LIMIT 1 \
                     FOR UPDATE SKIP LOCKED"
                    ),
                    &[
                        &LEASE_SECS,
                        &filter.origin_session,
                        &filter.parent_session_id,
                        &filter.delegation_id,
                        &unreadable,
                    ],
                )?;
                let Some(row) = row else { return Ok(None) };
                let id: String = row.try_get(0)?;
                let attempts: i64 = row.try_get(1)?;
                let text: Option<String> = row.try_get(2)?;
                let Some(event) =
                    text.as_deref().and_then(|s| serde_json::from_str::<Value>(s).ok())
                else {
                    unreadable.push(id);
                    continue;
                };
                if attempts < MAX_DELIVERY_ATTEMPTS {
                    let token = random_hex(16)?;
                    tx.execute(
                        &format!(
                            "UPDATE async_delegations SET delivery_claim = $1, \
                             delivery_claimed_at = {SERVER_NOW}, \
                             delivery_attempts = delivery_attempts + 1, \
                             updated_at = $2 WHERE delegation_id = $3"
                        ),
                        &[&token, &now, &id],
                    )?;
                    let attempt = u32_of(attempts + 1);
                    let event = retinue_core::CompletionEvent::from_stored(&id, event);
                    return Ok(Some(DeliveryClaim { delegation_id: id, token, attempt, event }));
                }
                tx.execute(
                    "UPDATE async_delegations SET delivery_state = 'dropped', updated_at = $1 \
                     WHERE delegation_id = $2",
                    &[&now, &id],
                )?;
            }
        })
    }

    fn ack_delivery(&self, id: &str, token: &str) -> Result<bool> {
        let now = self.clock.now();
        self.pool.tx("acknowledging a delivery", Mode::WriteOne, |tx| {
            let n = tx.execute(
                "UPDATE async_delegations SET delivery_state = 'delivered', delivered_at = $1, \
                 updated_at = $1 WHERE delegation_id = $2 AND delivery_claim = $3 \
                 AND delivery_state = 'pending'",
                &[&now, &id, &token],
            )?;
            Ok(n > 0)
        })
    }

    fn claim_resume(&self, id: &str, child_index: u32) -> Result<ResumeClaim> {
        let token = random_hex(16)?;
        // One statement (one round trip, `SERIALIZABLE` in autocommit): the
        // child's row as it was, and the claim taken when the child and its
        // unit are live and no unexpired claim holds it. A concurrent
        // writer of the row fails the statement (40001) and it runs again.
        // The lease is the server's (`SERVER_NOW`, read once), never a host's.
        // A lease that cannot be the server's (taken after now plus a lease,
        // NaN, infinite: a row another program planted) holds nothing.
        let sql = format!(
            "WITH t AS (SELECT {SERVER_NOW} AS now), \
           cur AS (SELECT c.tombstoned_at AS ct, u.tombstoned_at AS ut, \
               c.resume_claim AS claim, c.resume_claimed_at AS at \
             FROM retinue_children c JOIN async_delegations u \
               ON u.delegation_id = c.delegation_id \
             WHERE c.delegation_id = $1 AND c.child_index = $2), \
           upd AS (UPDATE retinue_children SET resume_claim = $3, \
               resume_claimed_at = (SELECT now FROM t) \
             WHERE delegation_id = $1 AND child_index = $2 AND tombstoned_at IS NULL \
               AND (resume_claim IS NULL OR COALESCE(resume_claimed_at, '-Infinity'::float8) \
                 + $4 <= (SELECT now FROM t) OR resume_claimed_at > (SELECT now FROM t) + $4) \
               AND EXISTS (SELECT 1 FROM cur WHERE ut IS NULL) RETURNING 1) \
         SELECT ct, ut, claim, at, EXISTS (SELECT 1 FROM upd) FROM cur"
        );
        self.pool.tx("claiming a resume", Mode::WriteOne, |tx| {
            let row = tx.query_opt(&sql, &[&id, &int(child_index), &token, &LEASE_SECS])?;
            let Some(row) = row else { return Ok(ResumeClaim::Unavailable) };
            if row.try_get::<_, bool>(4)? {
                return Ok(ResumeClaim::Claimed { token: token.clone() });
            }
            let child_tomb: Option<f64> = row.try_get(0)?;
            let unit_tomb: Option<f64> = row.try_get(1)?;
            let claim: Option<String> = row.try_get(2)?;
            let claimed_at: Option<f64> = row.try_get(3)?;
            Ok(match claim {
                Some(_) if child_tomb.is_none() && unit_tomb.is_none() => {
                    let at = claimed_at.unwrap_or(f64::NEG_INFINITY);
                    ResumeClaim::Busy { claimed_at: at, expires_at: at + LEASE_SECS }
                }
                // Tombstoned (or, failing closed, anything else not claimed).
                _ => ResumeClaim::Unavailable,
            })
        })
    }

    fn renew_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool> {
        let sql = format!(
            "UPDATE retinue_children SET resume_claimed_at = {SERVER_NOW} \
             WHERE delegation_id = $1 AND child_index = $2 AND resume_claim = $3"
        );
        self.pool.tx("renewing a resume claim", Mode::WriteOne, |tx| {
            let n = tx.execute(&sql, &[&id, &int(child_index), &token])?;
            Ok(n > 0)
        })
    }

    fn release_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool> {
        self.pool.tx("releasing a resume claim", Mode::WriteOne, |tx| {
            release_in(tx, id, child_index, token)
        })
    }

    #[expect(clippy::needless_lifetimes)]
    fn finish_follow_up<'a>(
        &self,
        id: &str,
        child_index: u32,
        token: &str,
        usage: Option<&'a UsageSwap>,
    ) -> Result<bool> {
        let now = self.clock.now();
        self.pool.tx("finishing a follow-up", Mode::Write, |tx| {
            let held = tx
                .query_opt(
                    "SELECT 1 FROM retinue_children WHERE delegation_id = $1 \
                     AND child_index = $2 AND resume_claim = $3 FOR UPDATE",
                    &[&id, &int(child_index), &token],
                )?
                .is_some();
            if !held {
                return Ok(false);
            }
            if let Some(swap) = usage {
                let current: Option<Value> = match tx.query_opt(
                    "SELECT usage_json FROM async_delegations WHERE delegation_id = $1 FOR UPDATE",
                    &[&id],
                )? {
                    Some(r) => parse_json_opt(r.try_get::<_, Option<String>>(0)?.as_deref()),
                    None => None,
                };
                if current != swap.expected {
                    return Err(Fail::Store(Error::Stale { what: "the unit's usage_json" }));
                }
                tx.execute(
                    "UPDATE async_delegations SET usage_json = $1, updated_at = $2 \
                     WHERE delegation_id = $3",
                    &[&swap.new.to_string(), &now, &id],
                )?;
            }
            tx.execute(
                "UPDATE retinue_children SET retained_at = $1 WHERE delegation_id = $2 \
                 AND child_index = $3 AND tombstoned_at IS NULL",
                &[&now, &id, &int(child_index)],
            )?;
            tx.execute(
                "UPDATE async_delegations SET retained_at = $1, updated_at = $1 \
                 WHERE delegation_id = $2 AND tombstoned_at IS NULL AND retained = 1",
                &[&now, &id],
            )?;
            release_in(tx, id, child_index, token)
        })
    }
}
