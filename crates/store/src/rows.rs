//! Shared row-reading helpers of the registry: the child-row projection
//! joined with its unit, lenient JSON columns, and the retention limits in
//! force. The bottom layer of the registry: it imports only core's records.

use rusqlite::Row;

use retinue_core::UnitState;
use retinue_core::{ChildManifest, ChildRow, RetainedChild};

pub(crate) use retinue_core::Limits;

/// Reads a JSON text column the way semantics §2.7 reads JSON: corruption-tolerant.
/// NULL, and text or a BLOB that is not UTF-8, read as absent (malformed);
/// numbers read as their text. Never an error for the value itself, so one
/// bad row cannot fail a whole read, open or write.
pub(crate) fn json_column(r: &rusqlite::Row<'_>, idx: usize) -> rusqlite::Result<Option<String>> {
    use rusqlite::types::ValueRef;
    Ok(match r.get_ref(idx)? {
        ValueRef::Null => None,
        ValueRef::Integer(i) => Some(i.to_string()),
        ValueRef::Real(f) => Some(f.to_string()),
        ValueRef::Text(b) | ValueRef::Blob(b) => std::str::from_utf8(b).ok().map(str::to_owned),
    })
}

/// [`json_column`] for a row that is read on when its JSON is unreadable
/// (it then reads as malformed, semantics §2.7), with a warning naming the table,
/// the rowid and the column, so the operator can find the row.
pub(crate) fn json_column_logged(
    r: &rusqlite::Row<'_>,
    idx: usize,
    table: &str,
    column: &str,
    rowid: i64,
) -> rusqlite::Result<Option<String>> {
    use rusqlite::types::ValueRef;
    let unreadable = match r.get_ref(idx)? {
        ValueRef::Blob(_) => true,
        ValueRef::Text(b) => std::str::from_utf8(b).is_err(),
        _ => false,
    };
    if unreadable {
        log::warn!(
            "{table} rowid {rowid}: {column} is not UTF-8 text; read as malformed (absent), \
             the other rows are read on"
        );
    }
    json_column(r, idx)
}

/// Reads a time or number column leniently: a finite INTEGER or REAL reads
/// as itself; NULL, text, a BLOB or a non-finite value reads as absent, so
/// one malformed row never fails a whole read.
pub(crate) fn real_column(r: &rusqlite::Row<'_>, idx: usize) -> rusqlite::Result<Option<f64>> {
    use rusqlite::types::ValueRef;
    Ok(match r.get_ref(idx)? {
        ValueRef::Integer(i) => Some(i as f64),
        ValueRef::Real(f) if f.is_finite() => Some(f),
        _ => None,
    })
}

/// Reads an id or text column leniently: valid UTF-8 text reads as itself,
/// a number as its text; NULL, a BLOB or invalid UTF-8 reads as absent.
pub(crate) fn text_column(r: &rusqlite::Row<'_>, idx: usize) -> rusqlite::Result<Option<String>> {
    use rusqlite::types::ValueRef;
    Ok(match r.get_ref(idx)? {
        ValueRef::Text(b) => std::str::from_utf8(b).ok().map(str::to_owned),
        ValueRef::Integer(i) => Some(i.to_string()),
        _ => None,
    })
}

/// A child's TTL clock: its own `retained_at`, else (rows recorded before another
/// writer retained the unit) the unit's.
pub(crate) const CHILD_RETAINED_AT: &str =
    "COALESCE(c.retained_at, CASE WHEN u.retained = 1 THEN u.retained_at END)";

/// `p(v)`: the distinct profile keys of the live (retained, untombstoned)
/// units, in index order, then a NULL row: one seek per profile through
/// `retinue_idx_async_profile_rank` (a skip scan written out), never a scan
/// of the units.
macro_rules! live_profiles_cte {
    () => {
        "WITH RECURSIVE p(v) AS ( \
           SELECT (SELECT COALESCE(owner_profile, '') AS k FROM async_delegations \
                   WHERE retained = 1 AND tombstoned_at IS NULL ORDER BY k LIMIT 1) \
           UNION ALL \
           SELECT (SELECT COALESCE(owner_profile, '') AS k FROM async_delegations \
                   WHERE retained = 1 AND tombstoned_at IS NULL \
                     AND COALESCE(owner_profile, '') > p.v ORDER BY k LIMIT 1) \
           FROM p WHERE p.v IS NOT NULL) "
    };
}
pub(crate) use live_profiles_cte;

/// The distinct profile keys of the live units (see [`live_profiles_cte`]).
const LIVE_PROFILES: &str = concat!(live_profiles_cte!(), "SELECT v FROM p WHERE v IS NOT NULL");

/// A column value exactly as stored, bound back byte for byte: TEXT that is
/// not valid UTF-8 (a hostile writer's) stays that TEXT, where rusqlite's
/// `Value` would refuse to read it. For keys read and compared again.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RawValue {
    Null,
    Integer(i64),
    Real(f64),
    Text(Vec<u8>),
    Blob(Vec<u8>),
}

impl rusqlite::types::FromSql for RawValue {
    fn column_result(v: rusqlite::types::ValueRef<'_>) -> rusqlite::types::FromSqlResult<Self> {
        use rusqlite::types::ValueRef;
        Ok(match v {
            ValueRef::Null => RawValue::Null,
            ValueRef::Integer(i) => RawValue::Integer(i),
            ValueRef::Real(f) => RawValue::Real(f),
            ValueRef::Text(b) => RawValue::Text(b.to_vec()),
            ValueRef::Blob(b) => RawValue::Blob(b.to_vec()),
        })
    }
}

impl rusqlite::ToSql for RawValue {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(ToSqlOutput::Borrowed(match self {
            RawValue::Null => ValueRef::Null,
            RawValue::Integer(i) => ValueRef::Integer(*i),
            RawValue::Real(f) => ValueRef::Real(*f),
            RawValue::Text(b) => ValueRef::Text(b),
            RawValue::Blob(b) => ValueRef::Blob(b),
        }))
    }
}

/// The profile keys of [`LIVE_PROFILES`], each exactly as stored (bound back
/// as is, so comparisons stay exact whatever a writer stored).
pub(crate) fn live_profiles(conn: &rusqlite::Connection) -> rusqlite::Result<Vec<RawValue>> {
    let mut stmt = conn.prepare_cached(LIVE_PROFILES)?;
    let rows = stmt.query_map([], |r| r.get::<_, RawValue>(0))?;
    rows.collect()
}

pub(crate) const CHILD_COLS: &str = "c.delegation_id, c.child_index, c.subagent_id, c.child_session_id, \
     c.manifest_json, COALESCE(c.retained_at, CASE WHEN u.retained = 1 THEN u.retained_at END), \
     c.tombstoned_at, c.tombstone_reason, \
     u.parent_session_id, u.owner_profile, u.state, u.completed_at, u.retained, \
     u.retained_at, u.tombstoned_at, c.rowid, ut.tombstoned_at, ut.ttl_seconds";

// The child row (joined with its unit and, as `ut`, the unit-level
// tombstone of `retinue_unit_tombstones`; callers that read no tombstoned
// unit select `NULL, NULL` there) is core's `ChildRow`.

pub(crate) fn read_child_row(r: &Row<'_>) -> rusqlite::Result<ChildRow> {
    read_child_row_at(r, 0)
}

/// Reads the [`CHILD_COLS`] columns starting at column `o`.
pub(crate) fn read_child_row_at(r: &Row<'_>, o: usize) -> rusqlite::Result<ChildRow> {
    let manifest_json = json_column(r, o + 4)?;
    let delegation_id = text_column(r, o)?;
    let index = real_column(r, o + 1)?;
    let subagent_id = text_column(r, o + 2)?;
    let child_session_id = text_column(r, o + 3)?;
    // An unreadable profile (a BLOB, invalid UTF-8) must not read as the
    // empty profile, which every profile may address: the row is malformed
    // (fail closed), as with an unreadable id.
    let owner_profile = text_column(r, o + 9)?;
    let malformed = delegation_id.is_none()
        || index.is_none()
        || (subagent_id.is_none() && child_session_id.is_none())
        || (owner_profile.is_none()
            && !matches!(r.get_ref(o + 9), Ok(rusqlite::types::ValueRef::Null)));
    let retained = real_column(r, o + 12)?;
    // A tombstone whose time is unreadable still counts as a tombstone.
    let child_tombstone_reason = text_column(r, o + 7)?;
    let child_tombstoned_at = real_column(r, o + 6)?.or_else(|| {
        (!matches!(r.get_ref(o + 6), Ok(rusqlite::types::ValueRef::Null))).then_some(0.0)
    });
    let unit_tombstoned_at = real_column(r, o + 14)?.or_else(|| {
        (!matches!(r.get_ref(o + 14), Ok(rusqlite::types::ValueRef::Null))).then_some(0.0)
    });
    let child_index =
        index.filter(|i| (0.0..=f64::from(u32::MAX)).contains(i)).map_or(u32::MAX, |i| i as u32);
    Ok(ChildRow {
        rowid: Some(r.get(o + 15)?),
        malformed,
        entry: RetainedChild {
            delegation_id: delegation_id.unwrap_or_default(),
            child_index,
            subagent_id: subagent_id.unwrap_or_default(),
            child_session_id: child_session_id.unwrap_or_default(),
            retained_at: real_column(r, o + 5)?,
            parent_session_id: text_column(r, o + 8)?.unwrap_or_default(),
            owner_profile: owner_profile.unwrap_or_default(),
            state: UnitState::parse(&text_column(r, o + 10)?.unwrap_or_default()),
            completed_at: real_column(r, o + 11)?,
            manifest: ChildManifest::default(),
        },
        manifest_json,
        child_tombstoned_at,
        child_tombstone_reason,
        tombstone_note: None,
        unit_retained: retained == Some(1.0),
        unit_retained_at: real_column(r, o + 13)?,
        unit_tombstoned_at,
        covered: real_column(r, o + 16)?.zip(real_column(r, o + 17)?),
    })
}
