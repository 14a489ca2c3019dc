//! [`ApprovalQueue`] on PostgreSQL (`retinue_approvals`, migration V12), as
//! on SQLite: each method one statement or one `SERIALIZABLE` transaction;
//! a decision is an `UPDATE … WHERE state = 'pending'`, so two deciders on
//! two hosts record exactly one decision.

use postgres::Row;
use retinue_core::{
    ApprovalFilter, ApprovalQueue, ApprovalRequest, ApprovalScope, ApprovalState, DecideOutcome,
    Decision, EXPIRED_BY, Error, LEASE_SECS, MAX_PENDING_PER_UNIT, NewApproval, REASON_MAX_CHARS,
    Requested, Result, Scope, new_approval_id, parse_json_opt, truncate_chars,
};

use crate::pool::{Mode, PgResult, Tx};
use crate::store::PgStore;

const COLUMNS: &str = "a.approval_id, a.delegation_id, a.subagent_id, a.tool, a.arguments_json, \
     a.reason, a.state, a.scope, a.requested_at, a.decided_at, a.decided_by, a.decision_reason, \
     u.owner_profile, u.parent_session_id";

const FROM: &str = "FROM retinue_approvals a \
     LEFT JOIN async_delegations u ON u.delegation_id = a.delegation_id";

fn request_row(r: &Row) -> ApprovalRequest {
    let arguments: String = r.get(4);
    let state: String = r.get(6);
    let scope: String = r.get(7);
    ApprovalRequest {
        approval_id: r.get(0),
        delegation_id: r.get(1),
        subagent_id: r.get(2),
        tool: r.get(3),
        arguments: parse_json_opt(Some(&arguments)).unwrap_or(serde_json::Value::Null),
        reason: r.get(5),
        state: ApprovalState::parse(&state).unwrap_or(ApprovalState::Expired),
        scope: ApprovalScope::parse(Some(&scope)),
        requested_at: r.get(8),
        decided_at: r.get(9),
        decided_by: r.get(10),
        decision_reason: r.get(11),
        owner_profile: r.get(12),
        parent_session_id: r.get(13),
    }
}

/// A request can be stored for a unit that runs, or for a finished unit
/// whose child runs a follow-up (it holds the resume claim).
const LIVE: &str = "(EXISTS (SELECT 1 FROM async_delegations WHERE delegation_id = $2 \
     AND state IN ('pending', 'running', 'finalizing')) \
     OR EXISTS (SELECT 1 FROM retinue_children WHERE delegation_id = $2 AND subagent_id = $3 \
     AND resume_claim IS NOT NULL))";

/// Pending requests nobody waits for any more: their unit finished and no
/// follow-up of their child holds a live resume claim (its process died).
const ORPHANS: &str = "a.state = 'pending' \
     AND NOT EXISTS (SELECT 1 FROM async_delegations u WHERE u.delegation_id = a.delegation_id \
       AND u.state IN ('pending', 'running', 'finalizing')) \
     AND NOT EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = a.delegation_id \
       AND c.subagent_id = a.subagent_id AND c.resume_claim IS NOT NULL \
       AND c.resume_claimed_at > $1)";

/// Expires the orphaned requests ([`ORPHANS`]) as `worker gone`.
fn expire_orphans(tx: &mut Tx<'_>, now: f64) -> PgResult<u64> {
    let sql = format!(
        "UPDATE retinue_approvals AS a SET state = 'expired', decided_at = $2, \
         decided_by = '{EXPIRED_BY}', decision_reason = 'worker gone' WHERE {ORPHANS}"
    );
    tx.execute(sql.as_str(), &[&(now - LEASE_SECS), &now])
}

fn one(tx: &mut Tx<'_>, id: &str) -> PgResult<Option<ApprovalRequest>> {
    let sql = format!("SELECT {COLUMNS} {FROM} WHERE a.approval_id = $1");
    Ok(tx.query_opt(sql.as_str(), &[&id])?.as_ref().map(request_row))
}

impl ApprovalQueue for PgStore {
    fn request_approval(&self, new: &NewApproval) -> Result<Requested> {
        let id = new_approval_id()?;
        let arguments = serde_json::to_string(&new.arguments)
            .map_err(|e| Error::Invalid(format!("the call's arguments: {e}")))?;
        let reason = truncate_chars(&new.reason, REASON_MAX_CHARS);
        let now = self.clock.now();
        let cap = i64::from(MAX_PENDING_PER_UNIT);
        self.pool.tx("requesting an approval", Mode::Write, |tx| {
            let standing = format!(
                "SELECT {COLUMNS} {FROM} WHERE a.subagent_id = $1 AND a.tool = $2 \
                 AND a.scope = 'always' AND a.state = 'approved' ORDER BY a.decided_at DESC"
            );
            let covering = tx
                .query(standing.as_str(), &[&new.subagent_id, &new.tool])?
                .iter()
                .map(request_row)
                .find(|r| r.covers(&new.tool, &new.arguments));
            if let Some(r) = covering {
                return Ok(Requested::Covered(r));
            }
            let pending: i64 = tx
                .query_one(
                    "SELECT count(*) FROM retinue_approvals \
                     WHERE delegation_id = $1 AND state = 'pending'",
                    &[&new.delegation_id],
                )?
                .get(0);
            if pending >= cap {
                return Ok(Requested::TooMany);
            }
            let insert = format!(
                "INSERT INTO retinue_approvals (approval_id, delegation_id, subagent_id, \
                 tool, arguments_json, reason, requested_at) \
                 SELECT $1, $2, $3, $4, $5, $6, $7 WHERE {LIVE}"
            );
            let n = tx.execute(
                insert.as_str(),
                &[&id, &new.delegation_id, &new.subagent_id, &new.tool, &arguments, &reason, &now],
            )?;
            if n == 0 {
                return Ok(Requested::UnitEnded);
            }
            Ok(one(tx, &id)?.map_or(Requested::UnitEnded, Requested::Pending))
        })
    }

    fn approval(&self, id: &str, scope: &Scope) -> Result<Option<ApprovalRequest>> {
        let id = id.trim();
        let row = self.pool.tx("reading an approval", Mode::Read, |tx| one(tx, id))?;
        Ok(row.filter(|r| scope.admits(r.owner_profile.as_deref())))
    }

    fn list_approvals(&self, filter: &ApprovalFilter) -> Result<Vec<ApprovalRequest>> {
        let now = self.clock.now();
        let any = self.pool.tx("looking for orphaned approvals", Mode::ReadOne, |tx| {
            let sql = format!("SELECT EXISTS (SELECT 1 FROM retinue_approvals a WHERE {ORPHANS})");
            Ok(tx.query_one(sql.as_str(), &[&(now - LEASE_SECS)])?.get::<_, bool>(0))
        })?;
        if any {
            self.pool
                .tx("expiring orphaned approvals", Mode::Write, |tx| expire_orphans(tx, now))?;
        }
        let limit = if filter.limit == 0 {
            i64::MAX
        } else {
            i64::try_from(filter.limit).unwrap_or(i64::MAX)
        };
        self.pool.tx("listing approvals", Mode::Read, |tx| {
            let sql = format!(
                "SELECT {COLUMNS} {FROM} \
                 WHERE ($1::TEXT IS NULL OR COALESCE(u.owner_profile, '') IN ('', $1)) \
                   AND (NOT $2 OR a.state = 'pending') \
                   AND ($3::TEXT IS NULL OR a.delegation_id = $3) \
                   AND ($5::TEXT IS NULL OR a.subagent_id = $5) \
                 ORDER BY a.requested_at DESC, a.approval_id LIMIT $4"
            );
            let rows = tx.query(
                sql.as_str(),
                &[
                    &filter.profile,
                    &filter.pending_only,
                    &filter.delegation_id,
                    &limit,
                    &filter.subagent_id,
                ],
            )?;
            Ok(rows.iter().map(request_row).collect())
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
        self.pool.tx("deciding an approval", Mode::Write, |tx| {
            expire_orphans(tx, now)?;
            let Some(current) = one(tx, id)?.filter(|r| scope.admits(r.owner_profile.as_deref()))
            else {
                return Ok(DecideOutcome::Missing);
            };
            let n = tx.execute(
                "UPDATE retinue_approvals SET state = $1, scope = $2, decided_at = $3, \
                 decided_by = $4, decision_reason = $5 \
                 WHERE approval_id = $6 AND state = 'pending'",
                &[&decision.state.as_str(), &scope_word.as_str(), &now, &by, &reason, &id],
            )?;
            let after = one(tx, id)?.unwrap_or(current);
            Ok(if n == 1 {
                DecideOutcome::Decided(after)
            } else {
                DecideOutcome::AlreadyDecided(after)
            })
        })
    }
}
