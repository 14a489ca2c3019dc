//! The budget seam: reservations against a lineage-wide spending cap
//! (semantics §8). Backends implement it atomically; the rules of what
//! counts as spent live in [`crate::spend`].

use crate::error::Result;
use crate::probe::OwnerProbe;
use crate::spend::{BudgetLimit, BudgetStatus, Reservation, ReservationDraft, Spend};
use crate::status::SettleReason;

/// Budget reservations over the ledger.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait Budgets: Send + Sync {
    /// Reserves an allowance between `draft.minimum` and `draft.maximum` if
    /// at least the minimum fits under the limit (atomically).
    fn reserve(&self, draft: &ReservationDraft) -> Result<Reservation>;
    /// Settles (or releases) a reservation; `false` if it was already settled.
    fn settle(&self, id: &str, reason: &SettleReason) -> Result<bool>;
    /// The budget of a lineage now.
    fn budget_status(
        &self,
        lineage_root: &str,
        sessions: &[String],
        limit: BudgetLimit,
    ) -> Result<BudgetStatus>;
    /// Recovery: open reservations whose owner process is gone are kept as
    /// spent (their ledger rows were never written, or the run was cut
    /// short: what they hold is the best known spend, never released as
    /// free); how many.
    fn release_abandoned_reservations(&self, probe: &dyn OwnerProbe) -> Result<usize>;
    /// Grows open reservation `id` by between `draft.minimum` and
    /// `draft.maximum` (a model call's prompt and bounded completion) if at
    /// least the minimum still fits under `draft.limit`, atomically like
    /// [`Budgets::reserve`]; `Held.granted` is the increase. A reservation
    /// that is no longer open is refused.
    fn grow(&self, id: &str, draft: &ReservationDraft) -> Result<Reservation>;
    /// Sets what open reservation `id` holds (a run's spend so far plus its
    /// calls in flight); `false` if it is not open.
    fn set_hold(&self, id: &str, hold: Spend) -> Result<bool>;
    /// Keeps open reservation `id` as spent (its runs' ledger rows could not
    /// be written): it counts as spent from now on; `false` if not open.
    fn keep_as_spent(&self, id: &str, reason: &SettleReason) -> Result<bool>;
    /// The budget root `session` was recorded under, if any.
    fn budget_root_of(&self, session: &str) -> Result<Option<String>>;
    /// Records `sessions` as members of the budget rooted at `root` (a
    /// session already recorded keeps its root).
    fn join_budget(&self, root: &str, sessions: &[String]) -> Result<()>;
}
