//! Exactly-once completion hand-off for background units (spec §3.7).

use rusqlite::{OptionalExtension, params};
use serde_json::Value;

use crate::error::Result;
use crate::registry::LEASE_SECS;
use crate::{DeliveryClaim, DeliveryFilter, Store};

/// Attempts after which a completion is dropped.
pub const MAX_DELIVERY_ATTEMPTS: i64 = 8;

pub(crate) fn claim(store: &Store, filter: &DeliveryFilter) -> Result<Option<DeliveryClaim>> {
    let now = store.clock.now();
    store.pool.write(|tx| {
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
                    |r| Ok((r.get(0)?, r.get(1)?, crate::model::json_column(r, 2)?)),
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
    store.pool.write(|tx| {
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
