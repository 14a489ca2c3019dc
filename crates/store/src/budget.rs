//! Budget reservations (issue "Budgets"): the lineage-wide spending cap is
//! enforced by reserving an allowance before a run starts, atomically against
//! what the lineage already spent and what others hold reserved.
//!
//! `reserve` runs in one `BEGIN IMMEDIATE` transaction: it sums the ledger
//! rows billed to the lineage's sessions (`usage_json.cost_usd`,
//! `tokens.input + tokens.output`) and the open reservations of the lineage
//! root, and inserts the new reservation only if everything still fits under
//! the limit. SQLite serialises writers, so no interleaving of processes can
//! reserve past the limit. A run's reservation is settled after its ledger
//! rows are written (so for a moment a run counts twice: conservative, never
//! under). A run grows its reservation call by call ([`Budgets::grow`]:
//! each model call's prompt plus its bounded completion, checked against the
//! limit in the same way) and sets it back to what it spent when the call
//! ends ([`Budgets::set_hold`]), so concurrent runs share what is left
//! instead of one run holding it all.
//!
//! The budget of a subagent tree is keyed by its root (the top-level
//! parent's compression-lineage root), fixed when the top-level unit is
//! created: every child session is a *member* of that budget
//! (`retinue_budget_members`), its nested spawns and follow-ups draw on it,
//! and ledger rows billed to members count as its spend.
//!
//! Nothing is ever settled as free: a reservation whose ledger rows could
//! not be written, or whose owner died, is *kept as spent*
//! (`kept_spent_at`) and counts as spent from then on.

use retinue_core::SettleReason;
use rusqlite::{OptionalExtension, params};

use crate::error::{Result, SqlResult};
use crate::store::Store;
use retinue_core::{BudgetLimit, BudgetStatus, Reservation, ReservationDraft, Spend};
use retinue_core::{OwnerProbe, ProcessState, current_owner};

pub(crate) use retinue_core::Budgets;

fn status_in(
    conn: &rusqlite::Connection,
    root: &str,
    sessions: &[String],
    limit: BudgetLimit,
) -> SqlResult<BudgetStatus> {
    let mut spent = Spend::default();
    // One indexed aggregate over the typed columns: the ledger rows billed
    // to the lineage's sessions or to the budget's member sessions (children
    // and nested children), each row once. `total()` never overflows (an
    // absurd row saturates instead of breaking every later reservation).
    let listed = serde_json::Value::from(sessions.to_vec()).to_string();
    let (cost, tokens): (f64, f64) = conn
        .prepare_cached(
            "SELECT total(cost_usd), total(input_tokens + output_tokens) \
             FROM retinue_usage_columns WHERE parent_session_id IN ( \
                 SELECT value FROM json_each(?1) \
                 UNION SELECT session_id FROM retinue_budget_members WHERE budget_root = ?2)",
        )?
        .query_row(params![listed, root], |r| Ok((r.get(0)?, r.get(1)?)))?;
    spent = spent.plus(Spend::from_stored(cost, tokens));
    let (cost, tokens): (f64, f64) = conn
        .prepare_cached(
            "SELECT total(cost_usd), total(tokens) FROM retinue_budget_reservations \
             WHERE lineage_root = ?1 AND settled_at IS NOT NULL AND kept_spent_at IS NOT NULL",
        )?
        .query_row([root], |r| Ok((r.get(0)?, r.get(1)?)))?;
    spent = spent.plus(Spend::from_stored(cost, tokens));
    let (cost, tokens): (f64, f64) = conn
        .prepare_cached(
            "SELECT total(cost_usd), total(tokens) \
             FROM retinue_budget_reservations WHERE lineage_root = ?1 AND settled_at IS NULL",
        )?
        .query_row([root], |r| Ok((r.get(0)?, r.get(1)?)))?;
    let reserved = Spend::from_stored(cost, tokens);
    Ok(BudgetStatus { limit, spent, reserved })
}

fn reservation_id() -> Result<String> {
    Ok(format!("rsv_{}", retinue_core::random_hex(8)?))
}

impl Budgets for Store {
    fn reserve(&self, draft: &ReservationDraft) -> Result<Reservation> {
        let id = reservation_id()?;
        let now = self.clock.now();
        let (pid, started) = current_owner();
        self.pool.write("reserving budget", |tx| {
            let before = status_in(tx, &draft.lineage_root, &draft.sessions, draft.limit)?;
            if !before.fits(draft.minimum) {
                return Ok(Reservation::Refused(before));
            }
            let want = before.grant(draft.minimum, draft.maximum);
            tx.prepare_cached(
                "INSERT INTO retinue_budget_reservations (reservation_id, lineage_root, \
                 delegation_id, cost_usd, tokens, owner_pid, owner_started_at, created_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?
            .execute(params![
                id,
                draft.lineage_root,
                draft.delegation_id,
                want.stored_cost(),
                want.stored_tokens(),
                pid,
                started,
                now
            ])?;
            Ok(Reservation::Held { id: id.clone(), granted: want, before })
        })
    }

    fn settle(&self, id: &str, reason: &SettleReason) -> Result<bool> {
        let reason = reason.as_str();
        let now = self.clock.now();
        self.pool.write("settling a budget reservation", |tx| {
            Ok(tx
                .prepare_cached(
                    "UPDATE retinue_budget_reservations SET settled_at = ?2, settle_reason = ?3 \
                     WHERE reservation_id = ?1 AND settled_at IS NULL",
                )?
                .execute(params![id, now, reason])?
                == 1)
        })
    }

    fn budget_status(
        &self,
        lineage_root: &str,
        sessions: &[String],
        limit: BudgetLimit,
    ) -> Result<BudgetStatus> {
        self.pool.read("reading a budget", |conn| status_in(conn, lineage_root, sessions, limit))
    }

    fn release_abandoned_reservations(&self, probe: &dyn OwnerProbe) -> Result<usize> {
        // If liveness cannot be probed here, release nothing.
        if probe.probe(i64::from(std::process::id())).is_none() {
            return Ok(0);
        }
        let open: Vec<(String, Option<i64>, Option<i64>)> =
            self.pool.read("listing open budget reservations", |conn| {
                let mut stmt = conn.prepare_cached(
                    "SELECT reservation_id, owner_pid, owner_started_at \
                     FROM retinue_budget_reservations WHERE settled_at IS NULL",
                )?;
                let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })?;
        let mut released = 0;
        for (id, pid, started) in open {
            let dead = match pid {
                None => true,
                Some(pid) => match probe.probe(pid) {
                    Some(ProcessState::Dead) => true,
                    Some(ProcessState::Alive { started_at }) => {
                        started.is_some() && started_at.is_some() && started != started_at
                    }
                    None => false,
                },
            };
            if dead && self.keep_as_spent(&id, &SettleReason::OwnerGone)? {
                released += 1;
            }
        }
        Ok(released)
    }

    fn grow(&self, id: &str, draft: &ReservationDraft) -> Result<Reservation> {
        self.pool.write("growing a budget reservation", |tx| {
            let open: Option<(f64, i64)> = tx
                .prepare_cached(
                    "SELECT cost_usd, tokens FROM retinue_budget_reservations \
                     WHERE reservation_id = ?1 AND settled_at IS NULL",
                )?
                .query_row([id], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()?;
            let before = status_in(tx, &draft.lineage_root, &draft.sessions, draft.limit)?;
            let Some((cost, tokens)) = open else {
                return Ok(Reservation::Refused(before));
            };
            if !before.fits(draft.minimum) {
                return Ok(Reservation::Refused(before));
            }
            let more = before.grant(draft.minimum, draft.maximum);
            let hold = Spend::from_stored(cost, tokens as f64).plus(more);
            tx.prepare_cached(
                "UPDATE retinue_budget_reservations SET cost_usd = ?2, tokens = ?3 \
                 WHERE reservation_id = ?1",
            )?
            .execute(params![id, hold.stored_cost(), hold.stored_tokens()])?;
            Ok(Reservation::Held { id: id.to_owned(), granted: more, before })
        })
    }

    fn set_hold(&self, id: &str, hold: Spend) -> Result<bool> {
        self.pool.write("setting a budget reservation", |tx| {
            Ok(tx
                .prepare_cached(
                    "UPDATE retinue_budget_reservations SET cost_usd = ?2, tokens = ?3 \
                     WHERE reservation_id = ?1 AND settled_at IS NULL",
                )?
                .execute(params![id, hold.stored_cost(), hold.stored_tokens()])?
                == 1)
        })
    }

    fn keep_as_spent(&self, id: &str, reason: &SettleReason) -> Result<bool> {
        let reason = reason.as_str();
        let now = self.clock.now();
        self.pool.write("keeping a budget reservation as spent", |tx| {
            Ok(tx
                .prepare_cached(
                    "UPDATE retinue_budget_reservations SET settled_at = ?2, kept_spent_at = ?2, \
                     settle_reason = ?3 WHERE reservation_id = ?1 AND settled_at IS NULL",
                )?
                .execute(params![id, now, reason])?
                == 1)
        })
    }

    fn budget_root_of(&self, session: &str) -> Result<Option<String>> {
        self.pool.read("reading a session's budget root", |conn| {
            Ok(conn
                .prepare_cached(
                    "SELECT budget_root FROM retinue_budget_members WHERE session_id = ?1",
                )?
                .query_row([session], |r| r.get(0))
                .optional()?)
        })
    }

    fn join_budget(&self, root: &str, sessions: &[String]) -> Result<()> {
        if sessions.is_empty() {
            return Ok(());
        }
        self.pool.write("recording budget members", |tx| {
            let mut stmt = tx.prepare_cached(
                "INSERT INTO retinue_budget_members (session_id, budget_root) VALUES (?1, ?2) \
                 ON CONFLICT(session_id) DO NOTHING",
            )?;
            for s in sessions {
                stmt.execute(params![s, root])?;
            }
            Ok(())
        })
    }
}
