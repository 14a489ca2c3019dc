//! The retention rules every backend applies the same way (semantics §3.1, §3.5):
//! the limits in force for one evaluation, a prune's argument overrides and
//! the addressability status of one child from its row's facts. Pure
//! functions of plain values, so the SQLite and PostgreSQL backends share
//! them instead of restating them.

use crate::error::{Error, Result};
use crate::model::{ChildManifest, RetainedChild, TombstoneReason, Unaddressable};

/// The retention policy a backend is opened with (`delegation.max_retained`
/// and `delegation.retained_ttl_hours` in config.yaml; the backends never
/// read the configuration themselves).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetentionPolicy {
    /// Live units kept per profile.
    pub max_retained: u32,
    /// A child's TTL after it was retained, in hours.
    pub ttl_hours: f64,
}

impl Default for RetentionPolicy {
    /// hermes's defaults: 10 units, 72 hours.
    fn default() -> Self {
        RetentionPolicy { max_retained: 10, ttl_hours: 72.0 }
    }
}

/// The retention limits in force for one evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// The evaluation's instant (epoch seconds).
    pub now: f64,
    /// Live units kept per profile (at least 1).
    pub max_retained: u32,
    /// A child's TTL after it was retained (hours, at least 0).
    pub ttl_hours: f64,
}

impl Limits {
    /// The configured limits at `now` (`max_retained` floored at 1, the TTL at 0).
    pub fn new(now: f64, policy: RetentionPolicy) -> Limits {
        Limits {
            now,
            max_retained: policy.max_retained.max(1),
            ttl_hours: policy.ttl_hours.max(0.0),
        }
    }

    /// These limits with a prune call's overrides (`max_retained` floored at
    /// 1, the TTL at 0); a TTL that is not finite is refused.
    pub fn with_overrides(
        mut self,
        max_retained: Option<u32>,
        ttl_hours: Option<f64>,
    ) -> Result<Limits> {
        if let Some(m) = max_retained {
            self.max_retained = m.max(1);
        }
        if let Some(h) = ttl_hours {
            if !h.is_finite() {
                return Err(Error::Invalid(format!("ttl_hours must be finite, got {h}")));
            }
            self.ttl_hours = h.max(0.0);
        }
        Ok(self)
    }

    /// The TTL in seconds.
    pub fn ttl_seconds(self) -> f64 {
        self.ttl_hours * 3600.0
    }

    /// Children retained before this instant are past their TTL.
    pub fn cutoff(self) -> f64 {
        self.now - self.ttl_seconds()
    }
}

/// What a backend read about one child and its unit, for [`child_status`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ChildFacts<'a> {
    /// The child's own tombstone time.
    pub tombstoned_at: Option<f64>,
    /// The child's own tombstone reason, as stored.
    pub tombstone_reason: Option<&'a str>,
    /// The operator's note of a manual tombstone.
    pub tombstone_note: Option<&'a str>,
    /// The child's TTL clock (its `retained_at`, else its unit's).
    pub retained_at: Option<f64>,
    /// Whether the unit is retained (`retained = 1`).
    pub unit_retained: bool,
    /// The unit's tombstone time.
    pub unit_tombstoned_at: Option<f64>,
    /// A prune's unit-level tombstone (time, TTL seconds then in force), if
    /// the backend records them: it covers the children of that unit.
    pub covered: Option<(f64, f64)>,
}

/// A child row joined with its unit, as either backend reads it (the same
/// columns in both: the SQLite backend's `CHILD_COLS` and the PostgreSQL
/// one's). Backends decode into this and decide addressability with
/// [`ChildRow::facts`] and [`child_status`].
#[derive(Debug, Clone, PartialEq)]
pub struct ChildRow {
    /// The engine's row id where it has one (SQLite's `rowid`, named in
    /// messages about bad rows).
    pub rowid: Option<i64>,
    /// Whether an id column was unreadable (BLOB, invalid UTF-8, NULL): such
    /// a row is skipped by lists and never resolved by lookups.
    pub malformed: bool,
    /// The entry, its `manifest` not yet parsed (see [`ChildRow::into_entry`]).
    pub entry: RetainedChild,
    /// The child's raw `manifest_json`.
    pub manifest_json: Option<String>,
    /// The child's own tombstone time.
    pub child_tombstoned_at: Option<f64>,
    /// The child's own tombstone reason, as stored.
    pub child_tombstone_reason: Option<String>,
    /// The operator's note of a manual tombstone (read by lookups only).
    pub tombstone_note: Option<String>,
    /// Whether the unit is retained (`retained = 1`).
    pub unit_retained: bool,
    /// The unit's `retained_at` (its rank in the cap).
    pub unit_retained_at: Option<f64>,
    /// The unit's tombstone time.
    pub unit_tombstoned_at: Option<f64>,
    /// A prune's unit-level tombstone, where the backend writes them: its
    /// time and the TTL in force, in seconds.
    pub covered: Option<(f64, f64)>,
}

impl ChildRow {
    /// The entry with its manifest parsed (only for rows that are returned).
    pub fn into_entry(self) -> RetainedChild {
        let mut entry = self.entry;
        entry.manifest =
            self.manifest_json.as_deref().and_then(ChildManifest::parse).unwrap_or_default();
        entry
    }

    /// The facts the shared addressability rule reads.
    pub fn facts(&self) -> ChildFacts<'_> {
        ChildFacts {
            tombstoned_at: self.child_tombstoned_at,
            tombstone_reason: self.child_tombstone_reason.as_deref(),
            tombstone_note: self.tombstone_note.as_deref(),
            retained_at: self.entry.retained_at,
            unit_retained: self.unit_retained,
            unit_tombstoned_at: self.unit_tombstoned_at,
            covered: self.covered,
        }
    }
}

/// A child's status without the cap rank: `Some(status)` when it is not
/// live, `None` when it is (the caller then checks the rank in its profile).
pub fn child_status(f: &ChildFacts<'_>, lim: Limits) -> Option<Unaddressable> {
    if let Some(at) = f.tombstoned_at {
        let reason = TombstoneReason::parse(f.tombstone_reason);
        let note = (reason == TombstoneReason::Manual).then(|| f.tombstone_note.map(str::to_owned));
        return Some(Unaddressable::Tombstoned { at, reason, note: note.flatten() });
    }
    if let Some(at) = f.unit_tombstoned_at {
        // A prune's unit-level tombstone covers the child: it reports what a
        // per-child write at that prune would have stored.
        if let Some((pruned_at, ttl_seconds)) = f.covered.filter(|(t, _)| *t == at) {
            return Some(covered_status(f.retained_at, pruned_at, ttl_seconds));
        }
        return Some(Unaddressable::Tombstoned {
            at,
            reason: TombstoneReason::External,
            note: None,
        });
    }
    let Some(retained_at) = f.retained_at.filter(|_| f.unit_retained) else {
        return Some(Unaddressable::NeverRetained);
    };
    if retained_at < lim.cutoff() {
        let at = retained_at + lim.ttl_seconds();
        return Some(Unaddressable::Tombstoned { at, reason: TombstoneReason::Ttl, note: None });
    }
    None
}

/// The status of a child covered by its unit's prune tombstone at `pruned_at`
/// (TTL `ttl_seconds` then in force): `ttl` at its expiry (never after the
/// prune) when its TTL clock had run out by then (a missing clock counts as
/// run out), else `cap` at the prune — exactly what the prune's per-child
/// write stores.
pub fn covered_status(retained_at: Option<f64>, pruned_at: f64, ttl_seconds: f64) -> Unaddressable {
    match retained_at {
        Some(r) if r >= pruned_at - ttl_seconds => {
            Unaddressable::Tombstoned { at: pruned_at, reason: TombstoneReason::Cap, note: None }
        }
        Some(r) => Unaddressable::Tombstoned {
            at: pruned_at.min(r + ttl_seconds),
            reason: TombstoneReason::Ttl,
            note: None,
        },
        None => {
            Unaddressable::Tombstoned { at: pruned_at, reason: TombstoneReason::Ttl, note: None }
        }
    }
}

/// One candidate of a lookup, as the resolution order compares it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LookupKey<'a> {
    /// Whether the candidate is addressable (its status is `None`).
    pub addressable: bool,
    /// How it matched the id: 0 subagent id, 1 child session id, 2 delegation id.
    pub kind: u8,
    /// Its unit's `retained_at`.
    pub unit_retained_at: Option<f64>,
    /// Its unit.
    pub delegation_id: &'a str,
    /// Its index in the unit.
    pub child_index: u32,
}

/// The order in which an id's candidates resolve (semantics §3.3); the
/// first wins: addressable before not, then a subagent-id match before a
/// child-session match before a delegation-id match, then the newest unit
/// (`retained_at`), then the greater delegation id, then the lower child
/// index. Both backends sort with it.
pub fn lookup_order(a: &LookupKey<'_>, b: &LookupKey<'_>) -> std::cmp::Ordering {
    let newest = |k: &LookupKey<'_>| k.unit_retained_at.unwrap_or(f64::NEG_INFINITY);
    b.addressable
        .cmp(&a.addressable)
        .then(a.kind.cmp(&b.kind))
        .then(newest(b).total_cmp(&newest(a)))
        .then(b.delegation_id.cmp(a.delegation_id))
        .then(a.child_index.cmp(&b.child_index))
}

#[cfg(test)]
mod tests {

    #[test]
    fn lookup_order_prefers_addressable_then_kind_then_newest() {
        use super::{LookupKey, lookup_order};
        let k = |addressable, kind, at: f64, id: &'static str| LookupKey {
            addressable,
            kind,
            unit_retained_at: Some(at),
            delegation_id: id,
            child_index: 0,
        };
        let mut keys = [
            k(false, 0, 9.0, "d9"),
            k(true, 2, 9.0, "d8"),
            k(true, 0, 1.0, "d1"),
            k(true, 0, 5.0, "d5"),
        ];
        keys.sort_by(lookup_order);
        let ids: Vec<&str> = keys.iter().map(|k| k.delegation_id).collect();
        assert_eq!(ids, ["d5", "d1", "d8", "d9"]);
    }

    use super::*;

    const LIM: Limits = Limits { now: 10_000.0, max_retained: 2, ttl_hours: 1.0 };

    fn live(retained_at: f64) -> ChildFacts<'static> {
        ChildFacts { retained_at: Some(retained_at), unit_retained: true, ..ChildFacts::default() }
    }

    #[test]
    fn a_live_child_within_its_ttl_has_no_status() {
        assert_eq!(child_status(&live(LIM.cutoff()), LIM), None);
    }

    #[test]
    fn past_the_ttl_a_child_is_ttl_tombstoned_at_its_expiry() {
        let status = child_status(&live(LIM.cutoff() - 1.0), LIM);
        assert_eq!(
            status,
            Some(Unaddressable::Tombstoned {
                at: LIM.now - 1.0,
                reason: TombstoneReason::Ttl,
                note: None
            })
        );
    }

    #[test]
    fn only_a_manual_tombstone_shows_its_note() {
        let manual = ChildFacts {
            tombstoned_at: Some(5.0),
            tombstone_reason: Some("manual"),
            tombstone_note: Some("done"),
            ..live(LIM.now)
        };
        assert!(matches!(
            child_status(&manual, LIM),
            Some(Unaddressable::Tombstoned { reason: TombstoneReason::Manual, note: Some(n), .. }) if n == "done"
        ));
        let cap = ChildFacts { tombstone_reason: Some("cap"), ..manual };
        assert!(matches!(
            child_status(&cap, LIM),
            Some(Unaddressable::Tombstoned { reason: TombstoneReason::Cap, note: None, .. })
        ));
    }

    #[test]
    fn a_unit_tombstone_is_external_unless_a_prune_covers_it() {
        let external = ChildFacts { unit_tombstoned_at: Some(7.0), ..live(LIM.now) };
        assert!(matches!(
            child_status(&external, LIM),
            Some(Unaddressable::Tombstoned { reason: TombstoneReason::External, .. })
        ));
        let covered = ChildFacts { covered: Some((7.0, 3600.0)), ..external };
        assert!(matches!(
            child_status(&covered, LIM),
            Some(Unaddressable::Tombstoned { reason: TombstoneReason::Cap, at, .. }) if at == 7.0
        ));
        // A covering row of another prune time does not cover this tombstone.
        let stale = ChildFacts { covered: Some((8.0, 3600.0)), ..external };
        assert!(matches!(
            child_status(&stale, LIM),
            Some(Unaddressable::Tombstoned { reason: TombstoneReason::External, .. })
        ));
    }

    #[test]
    fn never_retained_without_a_clock_or_a_retained_unit() {
        let unretained = ChildFacts { unit_retained: false, ..live(LIM.now) };
        assert_eq!(child_status(&unretained, LIM), Some(Unaddressable::NeverRetained));
        let no_clock = ChildFacts { retained_at: None, ..live(LIM.now) };
        assert_eq!(child_status(&no_clock, LIM), Some(Unaddressable::NeverRetained));
    }

    #[test]
    fn covered_children_report_what_a_per_child_write_stored() {
        let ttl = |at| Unaddressable::Tombstoned { at, reason: TombstoneReason::Ttl, note: None };
        assert_eq!(covered_status(Some(100.0), 200.0, 50.0), ttl(150.0));
        assert_eq!(covered_status(None, 200.0, 50.0), ttl(200.0));
        assert!(matches!(
            covered_status(Some(150.0), 200.0, 50.0),
            Unaddressable::Tombstoned { reason: TombstoneReason::Cap, at, .. } if at == 200.0
        ));
    }

    #[test]
    fn overrides_floor_and_refuse_non_finite_ttls() {
        let lim = LIM.with_overrides(Some(0), Some(-3.0)).expect("finite");
        assert_eq!((lim.max_retained, lim.ttl_hours), (1, 0.0));
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(matches!(LIM.with_overrides(None, Some(bad)), Err(Error::Invalid(_))));
        }
        assert_eq!(LIM.with_overrides(None, None).expect("none"), LIM);
    }
}
