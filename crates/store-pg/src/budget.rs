//! Budget reservations ([`Budgets`]) on PostgreSQL, with the SQLite
//! backend's semantics: `reserve` is one `SERIALIZABLE` transaction that sums
//! the ledger rows billed to the lineage's sessions (their typed `cost_usd`
//! and `input_tokens + output_tokens` columns) and the open reservations of the lineage
//! root, and inserts the reservation only if its minimum still fits. Two
//! workers reserving at once conflict (SQLSTATE 40001) and one is retried, so
//! no interleaving — on any number of hosts — reserves past the limit.
//! A reservation's owner is the worker (lease) that made it: recovery, from
//! any host, releases those of workers whose lease expired.

use retinue_core::SettleReason;
use retinue_core::{
    BudgetLimit, BudgetStatus, Budgets, OwnerProbe, ProcessState, Reservation, ReservationDraft,
    Result, Spend, current_owner,
};

use crate::pool::{Mode, PgResult, Tx, random_hex};
use crate::store::{PgStore, SERVER_NOW};

/// What the ledger rows of `sessions` add up to, and what the open
/// reservations of `root` hold.
fn status_in(
    tx: &mut Tx<'_>,
    root: &str,
    sessions: &[String],
    limit: BudgetLimit,
) -> PgResult<BudgetStatus> {
    let mut spent = Spend::default();
    // One aggregate over the typed columns: the ledger rows billed to the
    // lineage's sessions or to the budget's member sessions, each row once.
    let row = tx.query_one(
        "SELECT COALESCE(SUM(cost_usd), 0)::DOUBLE PRECISION, \
         COALESCE(SUM(input_tokens + output_tokens), 0)::DOUBLE PRECISION \
         FROM delegation_child_usage WHERE parent_session_id = ANY($1::text[]) \
         OR parent_session_id IN \
           (SELECT session_id FROM retinue_budget_members WHERE budget_root = $2)",
        &[&sessions, &root],
    )?;
    spent = spent.plus(Spend::from_stored(row.try_get(0)?, row.try_get(1)?));
    let sum = |tx: &mut Tx<'_>, sql: &str| -> PgResult<Spend> {
        let row = tx.query_one(sql, &[&root])?;
        Ok(Spend::from_stored(row.try_get(0)?, row.try_get(1)?))
    };
    // Reservations kept as spent count as spent; open ones as reserved.
    let kept = sum(
        tx,
        "SELECT COALESCE(SUM(cost_usd), 0)::DOUBLE PRECISION, \
         COALESCE(SUM(tokens::DOUBLE PRECISION), 0)::DOUBLE PRECISION \
         FROM retinue_budget_reservations WHERE lineage_root = $1 \
         AND settled_at IS NOT NULL AND kept_spent_at IS NOT NULL",
    )?;
    spent = spent.plus(kept);
    let reserved = sum(
        tx,
        "SELECT COALESCE(SUM(cost_usd), 0)::DOUBLE PRECISION, \
         COALESCE(SUM(tokens::DOUBLE PRECISION), 0)::DOUBLE PRECISION \
         FROM retinue_budget_reservations WHERE lineage_root = $1 AND settled_at IS NULL",
    )?;
    Ok(BudgetStatus { limit, spent, reserved })
}

fn keep_in(tx: &mut Tx<'_>, id: &str, reason: &str, now: f64) -> PgResult<bool> {
    Ok(tx.execute(
        "UPDATE retinue_budget_reservations SET settled_at = $2, kept_spent_at = $2, \
         settle_reason = $3 WHERE reservation_id = $1 AND settled_at IS NULL",
        &[&id, &now, &reason],
    )? == 1)
}

fn settle_in(tx: &mut Tx<'_>, id: &str, reason: &str, now: f64) -> PgResult<bool> {
    Ok(tx.execute(
        "UPDATE retinue_budget_reservations SET settled_at = $2, settle_reason = $3 \
         WHERE reservation_id = $1 AND settled_at IS NULL",
        &[&id, &now, &reason],
    )? == 1)
}

impl Budgets for PgStore {
    fn reserve(&self, draft: &ReservationDraft) -> Result<Reservation> {
        let id = format!("rsv_{}", random_hex(8)?);
        let now = self.clock.now();
        let (pid, started) = current_owner();
        self.pool.tx("reserving budget", Mode::Write, |tx| {
            let before = status_in(tx, &draft.lineage_root, &draft.sessions, draft.limit)?;
            if !before.fits(draft.minimum) {
                return Ok(Reservation::Refused(before));
            }
            let want = before.grant(draft.minimum, draft.maximum);
            let (cost, tokens) = (want.stored_cost(), want.stored_tokens());
            tx.execute(
                "INSERT INTO retinue_budget_reservations (reservation_id, lineage_root, \
                 delegation_id, cost_usd, tokens, owner_pid, owner_started_at, owner_worker, \
                 created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                &[
                    &id,
                    &draft.lineage_root,
                    &draft.delegation_id,
                    &cost,
                    &tokens,
                    &pid,
                    &started,
                    &self.worker_id,
                    &now,
                ],
            )?;
            Ok(Reservation::Held { id: id.clone(), granted: want, before })
        })
    }

    fn settle(&self, id: &str, reason: &SettleReason) -> Result<bool> {
        let reason = reason.as_str();
        let now = self.clock.now();
        self.pool
            .tx("settling a budget reservation", Mode::Write, |tx| settle_in(tx, id, reason, now))
    }

    fn budget_status(
        &self,
        lineage_root: &str,
        sessions: &[String],
        limit: BudgetLimit,
    ) -> Result<BudgetStatus> {
        self.pool
            .tx("reading a budget", Mode::Read, |tx| status_in(tx, lineage_root, sessions, limit))
    }

    /// Releases the open reservations of workers whose lease expired (or
    /// that no worker row knows); a reservation without a worker (none are
    /// written so, but a copied row may be) is judged by `probe` like SQLite.
    fn release_abandoned_reservations(&self, probe: &dyn OwnerProbe) -> Result<usize> {
        let now = self.clock.now();
        let can_probe = probe.probe(i64::from(std::process::id())).is_some();
        self.pool.tx("releasing abandoned budget reservations", Mode::Write, |tx| {
            let rows = tx.query(
                &format!(
                    "SELECT r.reservation_id, r.owner_pid, r.owner_started_at, r.owner_worker, \
                     w.lease_expires_at >= {SERVER_NOW} FROM retinue_budget_reservations r \
                     LEFT JOIN retinue_workers w ON w.worker_id = r.owner_worker \
                     WHERE r.settled_at IS NULL FOR UPDATE OF r SKIP LOCKED"
                ),
                &[],
            )?;
            let mut released = 0;
            for r in rows {
                let id: String = r.try_get(0)?;
                let pid: Option<i64> = r.try_get(1)?;
                let started: Option<i64> = r.try_get(2)?;
                let worker: Option<String> = r.try_get(3)?;
                // Judged by the server: a lease not yet past on its clock.
                let leased: Option<bool> = r.try_get(4)?;
                let dead = match (worker, pid) {
                    (Some(_), _) => leased != Some(true),
                    (None, _) if !can_probe => false,
                    (None, None) => true,
                    (None, Some(pid)) => match probe.probe(pid) {
                        Some(ProcessState::Dead) => true,
                        Some(ProcessState::Alive { started_at }) => {
                            started.is_some() && started_at.is_some() && started != started_at
                        }
                        None => false,
                    },
                };
                if dead && keep_in(tx, &id, "kept as spent: owner gone", now)? {
                    released += 1;
                }
            }
            Ok(released)
        })
    }

    fn grow(&self, id: &str, draft: &ReservationDraft) -> Result<Reservation> {
        self.pool.tx("growing a budget reservation", Mode::Write, |tx| {
            let open = tx.query_opt(
                "SELECT cost_usd, tokens FROM retinue_budget_reservations \
                 WHERE reservation_id = $1 AND settled_at IS NULL FOR UPDATE",
                &[&id],
            )?;
            let before = status_in(tx, &draft.lineage_root, &draft.sessions, draft.limit)?;
            let Some(row) = open else {
                return Ok(Reservation::Refused(before));
            };
            let (cost, tokens): (f64, i64) = (row.try_get(0)?, row.try_get(1)?);
            if !before.fits(draft.minimum) {
                return Ok(Reservation::Refused(before));
            }
            let more = before.grant(draft.minimum, draft.maximum);
            let hold = Spend::from_stored(cost, tokens as f64).plus(more);
            let (cost, tokens) = (hold.stored_cost(), hold.stored_tokens());
            tx.execute(
                "UPDATE retinue_budget_reservations SET cost_usd = $2, tokens = $3 \
                 WHERE reservation_id = $1",
                &[&id, &cost, &tokens],
            )?;
            Ok(Reservation::Held { id: id.to_owned(), granted: more, before })
        })
    }

    fn set_hold(&self, id: &str, hold: Spend) -> Result<bool> {
        let (cost, tokens) = (hold.stored_cost(), hold.stored_tokens());
        self.pool.tx("setting a budget reservation", Mode::Write, |tx| {
            Ok(tx.execute(
                "UPDATE retinue_budget_reservations SET cost_usd = $2, tokens = $3 \
                 WHERE reservation_id = $1 AND settled_at IS NULL",
                &[&id, &cost, &tokens],
            )? == 1)
        })
    }

    fn keep_as_spent(&self, id: &str, reason: &SettleReason) -> Result<bool> {
        let reason = reason.as_str();
        let now = self.clock.now();
        self.pool.tx("keeping a budget reservation as spent", Mode::Write, |tx| {
            keep_in(tx, id, reason, now)
        })
    }

    fn budget_root_of(&self, session: &str) -> Result<Option<String>> {
        self.pool.tx("reading a session's budget root", Mode::Read, |tx| {
            match tx.query_opt(
                "SELECT budget_root FROM retinue_budget_members WHERE session_id = $1",
                &[&session],
            )? {
                Some(row) => Ok(Some(row.try_get(0)?)),
                None => Ok(None),
            }
        })
    }

    fn join_budget(&self, root: &str, sessions: &[String]) -> Result<()> {
        if sessions.is_empty() {
            return Ok(());
        }
        self.pool.tx("recording budget members", Mode::Write, |tx| {
            for s in sessions {
                tx.execute(
                    "INSERT INTO retinue_budget_members (session_id, budget_root) \
                     VALUES ($1, $2) ON CONFLICT (session_id) DO NOTHING",
                    &[s, &root],
                )?;
            }
            Ok(())
        })
    }
}
