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
//! under). Recovery releases reservations whose owner process is gone.

use rusqlite::params;

use crate::error::{Error, Result, SqlResult};
use crate::probe::{OwnerProbe, ProcessState, current_owner};
use crate::spend::{BudgetLimit, BudgetStatus, Reservation, ReservationDraft, Spend};
use crate::store::Store;

/// Budget reservations over the ledger.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait Budgets: Send + Sync {
    /// Reserves an allowance between `draft.minimum` and `draft.maximum` if
    /// at least the minimum fits under the limit (atomically).
    fn reserve(&self, draft: &ReservationDraft) -> Result<Reservation>;
    /// Settles (or releases) a reservation; `false` if it was already settled.
    fn settle(&self, id: &str, reason: &str) -> Result<bool>;
    /// The budget of a lineage now.
    fn budget_status(
        &self,
        lineage_root: &str,
        sessions: &[String],
        limit: BudgetLimit,
    ) -> Result<BudgetStatus>;
    /// Releases open reservations whose owner process is gone; how many.
    fn release_abandoned_reservations(&self, probe: &dyn OwnerProbe) -> Result<usize>;
}

fn status_in(
    conn: &rusqlite::Connection,
    root: &str,
    sessions: &[String],
    limit: BudgetLimit,
) -> SqlResult<BudgetStatus> {
    let mut spent = Spend::default();
    let mut stmt = conn.prepare_cached(
        "SELECT COALESCE(SUM(CAST(json_extract(usage_json, '$.cost_usd') AS REAL)), 0), \
         COALESCE(SUM(CAST(json_extract(usage_json, '$.tokens.input') AS INTEGER) \
                    + CAST(json_extract(usage_json, '$.tokens.output') AS INTEGER)), 0) \
         FROM delegation_child_usage WHERE parent_session_id = ?1 AND json_valid(usage_json)",
    )?;
    for s in sessions {
        let (cost, tokens): (f64, i64) = stmt.query_row([s], |r| Ok((r.get(0)?, r.get(1)?)))?;
        if cost.is_finite() && cost > 0.0 {
            spent.cost_usd += cost;
        }
        spent.tokens = spent.tokens.saturating_add(u64::try_from(tokens).unwrap_or(0));
    }
    let (cost, tokens): (f64, i64) = conn
        .prepare_cached(
            "SELECT COALESCE(SUM(cost_usd), 0), COALESCE(SUM(tokens), 0) \
             FROM retinue_budget_reservations WHERE lineage_root = ?1 AND settled_at IS NULL",
        )?
        .query_row([root], |r| Ok((r.get(0)?, r.get(1)?)))?;
    let reserved = Spend { cost_usd: cost.max(0.0), tokens: u64::try_from(tokens).unwrap_or(0) };
    Ok(BudgetStatus { limit, spent, reserved })
}

fn reservation_id() -> Result<String> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|e| Error::Random(e.to_string()))?;
    Ok(format!("rsv_{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()))
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
                want.cost_usd,
                i64::try_from(want.tokens).unwrap_or(i64::MAX),
                pid,
                started,
                now
            ])?;
            Ok(Reservation::Held { id: id.clone(), granted: want, before })
        })
    }

    fn settle(&self, id: &str, reason: &str) -> Result<bool> {
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
            if dead && self.settle(&id, "released: owner gone")? {
                released += 1;
            }
        }
        Ok(released)
    }
}
