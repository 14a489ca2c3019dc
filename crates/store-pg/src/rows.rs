//! Shared row readers: the child⋈unit projection (the same columns as the
//! SQLite backend's) and the per-profile key.

use postgres::Row;
use retinue_core::{ChildManifest, ChildRow, RetainedChild, UnitState};

use crate::pool::{PgResult, u32_of};

/// A child's TTL clock: its own `retained_at`, else its unit's.
pub(crate) const CHILD_RETAINED_AT: &str =
    "COALESCE(c.retained_at, CASE WHEN u.retained = 1 THEN u.retained_at END)";

/// The child⋈unit projection read by [`read_child_row_at`].
pub(crate) const CHILD_COLS: &str = "c.delegation_id, c.child_index, c.subagent_id, \
     c.child_session_id, c.manifest_json, \
     COALESCE(c.retained_at, CASE WHEN u.retained = 1 THEN u.retained_at END), \
     c.tombstoned_at, c.tombstone_reason, \
     u.parent_session_id, u.owner_profile, u.state, u.completed_at, u.retained, \
     u.retained_at, u.tombstoned_at, c.tombstone_note";

/// A unit's tenant key: retention limits apply per profile (NULL = `''`).
pub(crate) const PROFILE: &str = "COALESCE(owner_profile, '')";

/// [`PROFILE`] of the unit aliased `u`.
pub(crate) const PROFILE_U: &str = "COALESCE(u.owner_profile, '')";

/// Reads the [`CHILD_COLS`] columns starting at column `o`.
pub(crate) fn read_child_row_at(r: &Row, o: usize) -> PgResult<ChildRow> {
    let index: i64 = r.try_get(o + 1)?;
    let retained: Option<i64> = r.try_get(o + 12)?;
    let state: Option<String> = r.try_get(o + 10)?;
    Ok(ChildRow {
        rowid: None,
        malformed: false,
        entry: RetainedChild {
            delegation_id: r.try_get(o)?,
            child_index: u32_of(index),
            subagent_id: r.try_get::<_, Option<String>>(o + 2)?.unwrap_or_default(),
            child_session_id: r.try_get::<_, Option<String>>(o + 3)?.unwrap_or_default(),
            retained_at: r.try_get(o + 5)?,
            parent_session_id: r.try_get::<_, Option<String>>(o + 8)?.unwrap_or_default(),
            owner_profile: r.try_get::<_, Option<String>>(o + 9)?.unwrap_or_default(),
            state: UnitState::parse(state.as_deref().unwrap_or_default()),
            completed_at: r.try_get(o + 11)?,
            manifest: ChildManifest::default(),
        },
        manifest_json: r.try_get(o + 4)?,
        child_tombstoned_at: r.try_get(o + 6)?,
        child_tombstone_reason: r.try_get(o + 7)?,
        tombstone_note: r.try_get(o + 15)?,
        unit_retained: retained == Some(1),
        unit_retained_at: r.try_get(o + 13)?,
        unit_tombstoned_at: r.try_get(o + 14)?,
        // This backend writes no unit-level prune tombstones.
        covered: None,
    })
}
