//! Leases (semantics §3.7): exactly-once delivery claims of background
//! completions, single-use resume claims of retained children, and the
//! write that finishes a follow-up.

use rusqlite::{OptionalExtension, Transaction, params};
use serde_json::Value;

use crate::error::{Error, Result, SqlResult};
use crate::registry::Claims;
use crate::rows::json_column;
use crate::store::Store;
use retinue_core::{DeliveryClaim, DeliveryFilter, ResumeClaim, UsageSwap};

use retinue_core::{LEASE_SECS, MAX_DELIVERY_ATTEMPTS};

pub(crate) fn claim(store: &Store, filter: &DeliveryFilter) -> Result<Option<DeliveryClaim>> {
    let now = store.clock.now();
    store.pool.write("claiming a delivery", |tx| {
        loop {
            let row: Option<(String, i64, Option<String>)> = tx
                .prepare_cached(
                    "SELECT delegation_id, delivery_attempts, event_json FROM async_delegations \
                     WHERE delivery_state = 'pending' AND state NOT IN ('running', 'finalizing') \
                       AND event_json IS NOT NULL \
                       AND (delivery_claim IS NULL OR delivery_claimed_at IS NULL \
                            OR delivery_claimed_at + ?1 <= ?2) \
                       AND (?3 IS NULL OR origin_session = ?3) \
                       AND (?4 IS NULL OR parent_session_id = ?4) \
                       AND (?5 IS NULL OR delegation_id = ?5) \
                       AND json_valid(event_json) \
                     ORDER BY completed_at, delegation_id LIMIT 1",
                )?
                .query_row(
                    params![
                        LEASE_SECS,
                        now,
                        filter.origin_session,
                        filter.parent_session_id,
                        filter.delegation_id
                    ],
                    |r| Ok((r.get(0)?, r.get(1)?, json_column(r, 2)?)),
                )
                .optional()?;
            let Some((id, attempts, event)) = row else { return Ok(None) };
            let event: Option<Value> = event.as_deref().and_then(|s| serde_json::from_str(s).ok());
            match event {
                Some(event) if attempts < MAX_DELIVERY_ATTEMPTS => {
                    let token = crate::db::random_hex(16)?;
                    tx.prepare_cached(
                        "UPDATE async_delegations SET delivery_claim = ?1, \
                         delivery_claimed_at = ?2, delivery_attempts = delivery_attempts + 1, \
                         updated_at = ?2 WHERE delegation_id = ?3",
                    )?
                    .execute(params![token, now, id])?;
                    let attempt = u32::try_from(attempts + 1).unwrap_or(u32::MAX);
                    let event = retinue_core::CompletionEvent::from_stored(&id, event);
                    return Ok(Some(DeliveryClaim { delegation_id: id, token, attempt, event }));
                }
                _ => {
                    // Out of attempts (or, past `json_valid`, an event serde still
                    // cannot read, which would otherwise be offered forever): drop it.
                    tx.prepare_cached(
                        "UPDATE async_delegations SET delivery_state = 'dropped', \
                         updated_at = ?1 WHERE delegation_id = ?2",
                    )?
                    .execute(params![now, id])?;
                }
            }
        }
    })
}

pub(crate) fn ack(store: &Store, id: &str, token: &str) -> Result<bool> {
    let now = store.clock.now();
    store.pool.write("acknowledging a delivery", |tx| {
        let n = tx
            .prepare_cached(
                "UPDATE async_delegations SET delivery_state = 'delivered', delivered_at = ?1, \
                 updated_at = ?1 WHERE delegation_id = ?2 AND delivery_claim = ?3 \
                 AND delivery_state = 'pending'",
            )?
            .execute(params![now, id, token])?;
        Ok(n > 0)
    })
}

impl Claims for Store {
    fn claim_delivery(&self, filter: &DeliveryFilter) -> Result<Option<DeliveryClaim>> {
        claim(self, filter)
    }

    fn ack_delivery(&self, id: &str, token: &str) -> Result<bool> {
        ack(self, id, token)
    }

    fn claim_resume(&self, id: &str, child_index: u32) -> Result<ResumeClaim> {
        let now = self.clock.now();
        self.pool.write("claiming a resume", |tx| {
            type ClaimRow = (Option<f64>, Option<f64>, Option<String>, Option<f64>);
            let row: Option<ClaimRow> = tx
                .prepare_cached(
                    "SELECT c.tombstoned_at, u.tombstoned_at, c.resume_claim, c.resume_claimed_at \
                     FROM retinue_children c JOIN async_delegations u \
                       ON u.delegation_id = c.delegation_id \
                     WHERE c.delegation_id = ?1 AND c.child_index = ?2",
                )?
                .query_row(params![id, child_index], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                })
                .optional()?;
            let Some((child_tomb, unit_tomb, claim, claimed_at)) = row else {
                return Ok(ResumeClaim::Unavailable);
            };
            if child_tomb.is_some() || unit_tomb.is_some() {
                return Ok(ResumeClaim::Unavailable);
            }
            if claim.is_some() {
                let at = claimed_at.unwrap_or(f64::NEG_INFINITY);
                if at + LEASE_SECS > now {
                    return Ok(ResumeClaim::Busy { claimed_at: at, expires_at: at + LEASE_SECS });
                }
            }
            let token = crate::db::random_hex(16)?;
            tx.prepare_cached(
                "UPDATE retinue_children SET resume_claim = ?1, resume_claimed_at = ?2 \
                 WHERE delegation_id = ?3 AND child_index = ?4",
            )?
            .execute(params![token, now, id, child_index])?;
            Ok(ResumeClaim::Claimed { token })
        })
    }

    fn renew_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool> {
        let now = self.clock.now();
        self.pool.write("renewing a resume claim", |tx| {
            let n = tx
                .prepare_cached(
                    "UPDATE retinue_children SET resume_claimed_at = ?1 WHERE delegation_id = ?2 \
                     AND child_index = ?3 AND resume_claim = ?4",
                )?
                .execute(params![now, id, child_index, token])?;
            Ok(n > 0)
        })
    }

    fn release_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool> {
        self.pool.write("releasing a resume claim", |tx| release_in(tx, id, child_index, token))
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
        self.pool.write("finishing a follow-up", |tx| {
            // Nothing is written for a holder whose lease passed to someone else.
            let held = tx
                .prepare_cached(
                    "SELECT 1 FROM retinue_children WHERE delegation_id = ?1 \
                     AND child_index = ?2 AND resume_claim = ?3",
                )?
                .exists(params![id, child_index, token])?;
            if !held {
                return Ok(false);
            }
            if let Some(swap) = usage {
                let current: Option<Value> = tx
                    .prepare_cached(
                        "SELECT usage_json FROM async_delegations WHERE delegation_id = ?1",
                    )?
                    .query_row([id], |r| json_column(r, 0))
                    .optional()?
                    .flatten()
                    .and_then(|text| serde_json::from_str(&text).ok());
                if current != swap.expected {
                    return Err(Error::Stale { what: "the unit's usage_json" }.into());
                }
                tx.prepare_cached(
                    "UPDATE async_delegations SET usage_json = ?1, updated_at = ?2 \
                     WHERE delegation_id = ?3",
                )?
                .execute(params![swap.new.to_string(), now, id])?;
            }
            tx.prepare_cached(
                // Never under a unit tombstone: a covered child's reported
                // reason and time derive from its TTL clock as it was.
                "UPDATE retinue_children SET retained_at = ?1 WHERE delegation_id = ?2 \
                 AND child_index = ?3 AND tombstoned_at IS NULL AND (SELECT u.tombstoned_at \
                 FROM async_delegations u WHERE u.delegation_id = ?2) IS NULL",
            )?
            .execute(params![now, id, child_index])?;
            // Retinue's own refresh of the unit clock: held by the guard,
            // so the other children keep their own clocks (V9).
            tx.prepare_cached("INSERT OR IGNORE INTO retinue_clock_guard (held) VALUES (1)")?
                .execute([])?;
            tx.prepare_cached(
                "UPDATE async_delegations SET retained_at = ?1, updated_at = ?1 \
                 WHERE delegation_id = ?2 AND tombstoned_at IS NULL AND retained = 1",
            )?
            .execute(params![now, id])?;
            tx.prepare_cached("DELETE FROM retinue_clock_guard")?.execute([])?;
            release_in(tx, id, child_index, token)
        })
    }
}

fn release_in(tx: &Transaction<'_>, id: &str, child_index: u32, token: &str) -> SqlResult<bool> {
    let n = tx
        .prepare_cached(
            "UPDATE retinue_children SET resume_claim = NULL, resume_claimed_at = NULL \
             WHERE delegation_id = ?1 AND child_index = ?2 AND resume_claim = ?3",
        )?
        .execute(params![id, child_index, token])?;
    Ok(n > 0)
}
