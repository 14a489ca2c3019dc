//! [`ApprovalQueue`] on SQLite (`retinue_approvals`, migration V13). Each
//! method is one statement or one `BEGIN IMMEDIATE` transaction; a decision
//! is an `UPDATE … WHERE state = 'pending'`, so two deciders racing record
//! exactly one decision.

use rusqlite::{Connection, OptionalExtension, params};

use crate::error::{Result, SqlResult};
use crate::rows::json_column;
use crate::store::Store;
use retinue_core::{
    ApprovalFilter, ApprovalQueue, ApprovalRequest, ApprovalScope, ApprovalState, DecideOutcome,
    Decision, EXPIRED_BY, Error, LEASE_SECS, MAX_PENDING_PER_UNIT, NewApproval, REASON_MAX_CHARS,
    Requested, Scope, new_approval_id, parse_json_opt, truncate_chars,
};

const COLUMNS: &str = "a.approval_id, a.delegation_id, a.subagent_id, a.tool, a.arguments_json, \
     a.reason, a.state, a.scope, a.requested_at, a.decided_at, a.decided_by, a.decision_reason, \
     u.owner_profile, u.parent_session_id";

const FROM: &str = "FROM retinue_approvals a \
     LEFT JOIN async_delegations u ON u.delegation_id = a.delegation_id";

fn request_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ApprovalRequest> {
    let arguments: Option<String> = json_column(r, 4)?;
    let state: String = r.get(6)?;
    Ok(ApprovalRequest {
        approval_id: r.get(0)?,
        delegation_id: r.get(1)?,
        subagent_id: r.get(2)?,
        tool: r.get(3)?,
        arguments: parse_json_opt(arguments.as_deref()).unwrap_or(serde_json::Value::Null),
        reason: r.get(5)?,
        // The CHECK constraint keeps the word one of ours; a row that is not
        // reads as expired (never as approved).
        state: ApprovalState::parse(&state).unwrap_or(ApprovalState::Expired),
        scope: ApprovalScope::parse(r.get::<_, Option<String>>(7)?.as_deref()),
        requested_at: r.get::<_, Option<f64>>(8)?.unwrap_or(0.0),
        decided_at: r.get(9)?,
        decided_by: r.get(10)?,
        decision_reason: r.get(11)?,
        owner_profile: r.get(12)?,
        parent_session_id: r.get(13)?,
    })
}

/// A request can be stored for a unit that runs, or for a finished unit
/// whose child runs a follow-up (it holds the resume claim).
const LIVE: &str = "(EXISTS (SELECT 1 FROM async_delegations WHERE delegation_id = ?2 \
     AND state IN ('pending', 'running', 'finalizing')) \
     OR EXISTS (SELECT 1 FROM retinue_children WHERE delegation_id = ?2 AND subagent_id = ?3 \
     AND resume_claim IS NOT NULL))";

/// Pending requests nobody waits for any more: their unit finished and no
/// follow-up of their child holds a live resume claim (its process died).
const ORPHANS: &str = "a.state = 'pending' \
     AND NOT EXISTS (SELECT 1 FROM async_delegations u WHERE u.delegation_id = a.delegation_id \
       AND u.state IN ('pending', 'running', 'finalizing')) \
     AND NOT EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = a.delegation_id \
       AND c.subagent_id = a.subagent_id AND c.resume_claim IS NOT NULL \
       AND c.resume_claimed_at > ?1)";

/// Expires the orphaned requests ([`ORPHANS`]) as `worker gone`.
fn expire_orphans(tx: &Connection, now: f64) -> SqlResult<usize> {
    let sql = format!(
        "UPDATE retinue_approvals AS a SET state = 'expired', decided_at = ?2, \
         decided_by = '{EXPIRED_BY}', decision_reason = 'worker gone' WHERE {ORPHANS}"
    );
    Ok(tx.prepare_cached(&sql)?.execute(params![now - LEASE_SECS, now])?)
}

fn any_orphan(conn: &Connection, now: f64) -> SqlResult<bool> {
    let sql = format!("SELECT EXISTS (SELECT 1 FROM retinue_approvals a WHERE {ORPHANS})");
    Ok(conn.prepare_cached(&sql)?.query_row(params![now - LEASE_SECS], |r| r.get(0))?)
}

fn one(conn: &Connection, id: &str) -> SqlResult<Option<ApprovalRequest>> {
    let sql = format!("SELECT {COLUMNS} {FROM} WHERE a.approval_id = ?1");
    Ok(conn.prepare_cached(&sql)?.query_row(params![id], request_row).optional()?)
}

impl ApprovalQueue for Store {
    fn request_approval(&self, new: &NewApproval) -> Result<Requested> {
        let id = new_approval_id()?;
        let arguments = serde_json::to_string(&new.arguments)
            .map_err(|e| Error::Invalid(format!("the call's arguments: {e}")))?;
        let reason = truncate_chars(&new.reason, REASON_MAX_CHARS);
        let now = self.clock.now();
        self.pool.write("requesting an approval", |tx| {
            let standing = format!(
                "SELECT {COLUMNS} {FROM} WHERE a.subagent_id = ?1 AND a.tool = ?2 \
                 AND a.scope = 'always' AND a.state = 'approved' ORDER BY a.decided_at DESC"
            );
            let covering = tx
                .prepare_cached(&standing)?
                .query_map(params![new.subagent_id, new.tool], request_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?
                .into_iter()
                .find(|r| r.covers(&new.tool, &new.arguments));
            if let Some(r) = covering {
                return Ok(Requested::Covered(r));
            }
            let pending: i64 = tx
                .prepare_cached(
                    "SELECT count(*) FROM retinue_approvals \
                     WHERE delegation_id = ?1 AND state = 'pending'",
                )?
                .query_row(params![new.delegation_id], |r| r.get(0))?;
            if pending >= i64::from(MAX_PENDING_PER_UNIT) {
                return Ok(Requested::TooMany);
            }
            // Only a live unit (or a running follow-up) takes a request:
            // nothing could ever expire one of a unit that ended.
            let insert = format!(
                "INSERT INTO retinue_approvals (approval_id, delegation_id, subagent_id, \
                 tool, arguments_json, reason, requested_at) \
                 SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7 WHERE {LIVE}"
            );
            let n = tx.prepare_cached(&insert)?.execute(params![
                id,
                new.delegation_id,
                new.subagent_id,
                new.tool,
                arguments,
                reason,
                now
            ])?;
            if n == 0 {
                return Ok(Requested::UnitEnded);
            }
            match one(tx, &id)? {
                Some(r) => Ok(Requested::Pending(r)),
                None => Ok(Requested::UnitEnded),
            }
        })
    }

    fn approval(&self, id: &str, scope: &Scope) -> Result<Option<ApprovalRequest>> {
        let row = self.pool.read("reading an approval", |conn| one(conn, id.trim()))?;
        Ok(row.filter(|r| scope.admits(r.owner_profile.as_deref())))
    }

    fn list_approvals(&self, filter: &ApprovalFilter) -> Result<Vec<ApprovalRequest>> {
        let now = self.clock.now();
        // Best effort: a read-only open lists them as they are.
        if self.pool.read("looking for orphaned approvals", |conn| any_orphan(conn, now))?
            && let Err(e) =
                self.pool.write("expiring orphaned approvals", |tx| expire_orphans(tx, now))
        {
            log::debug!("orphaned approvals left pending: {e}");
        }
        let limit = if filter.limit == 0 {
            i64::MAX
        } else {
            i64::try_from(filter.limit).unwrap_or(i64::MAX)
        };
        self.pool.read("listing approvals", |conn| {
            let sql = format!(
                "SELECT {COLUMNS} {FROM} \
                 WHERE (?1 IS NULL OR COALESCE(u.owner_profile, '') IN ('', ?1)) \
                   AND (?2 = 0 OR a.state = 'pending') \
                   AND (?3 IS NULL OR a.delegation_id = ?3) \
                   AND (?5 IS NULL OR a.subagent_id = ?5) \
                 ORDER BY a.requested_at DESC, a.approval_id LIMIT ?4"
            );
            Ok(conn
                .prepare_cached(&sql)?
                .query_map(
                    params![
                        filter.profile,
                        filter.pending_only,
                        filter.delegation_id,
                        limit,
                        filter.subagent_id
                    ],
                    request_row,
                )?
                .collect::<rusqlite::Result<Vec<_>>>()?)
        })
    }

    fn decide_approval(
        &self,
        id: &str,
        scope: &Scope,
        decision: &Decision,
    ) -> Result<DecideOutcome> {
        decision.check()?;
        let (scope_word, reason, by) =
            (decision.stored_scope(), decision.stored_reason(), decision.stored_by());
        let now = self.clock.now();
        let id = id.trim();
        self.pool.write("deciding an approval", |tx| {
            expire_orphans(tx, now)?;
            let Some(current) = one(tx, id)?.filter(|r| scope.admits(r.owner_profile.as_deref()))
            else {
                return Ok(DecideOutcome::Missing);
            };
            let n = tx
                .prepare_cached(
                    "UPDATE retinue_approvals SET state = ?1, scope = ?2, decided_at = ?3, \
                     decided_by = ?4, decision_reason = ?5 \
                     WHERE approval_id = ?6 AND state = 'pending'",
                )?
                .execute(params![
                    decision.state.as_str(),
                    scope_word.as_str(),
                    now,
                    by,
                    reason,
                    id
                ])?;
            let after = one(tx, id)?.unwrap_or(current);
            Ok(if n == 1 {
                DecideOutcome::Decided(after)
            } else {
                DecideOutcome::AlreadyDecided(after)
            })
        })
    }
}
