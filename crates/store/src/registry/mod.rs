//! The retained-subagent registry (semantics §3), split by role into four seam
//! traits, plus the umbrella [`Registry`] for the composition root.
//!
//! The traits are what a storage backend implements: synchronous,
//! object-safe, `Send + Sync`, and free of any SQLite notion (no connection,
//! row or pragma type). Every method is one transaction. Lookups are
//! unscoped; the lineage crate adds the owner scope on top.
//!
//! The traits live in `retinue-core`; the SQLite implementation on
//! [`crate::store::Store`] lives in one file per role:
//!
//! * `addressability.rs` — [`RegistryRead`]: lookups, lists, the §3.1 predicate;
//! * `units.rs` — [`UnitLifecycle`]: insert, manifest, completion, retain;
//! * `retention.rs` — [`Retention`]: tombstones, TTL/cap pruning, rehydration;
//! * `recovery.rs` — restart recovery (semantics §3.8);
//! * `history.rs` — the history pruner (semantics §3.6);
//! * `claims.rs` — [`Claims`]: resume claims, delivery claims, finishing a follow-up;
//! * `control.rs` — [`retinue_core::Controls`]: unit views, the control mailbox;
//! * `backfill.rs` — adoption of hermes-retained units, run by every write.

pub(crate) mod addressability;
pub(crate) mod backfill;
pub(crate) mod claims;
pub(crate) mod control;
pub(crate) mod history;
pub(crate) mod recovery;
pub(crate) mod retention;
pub(crate) mod units;

pub(crate) use retinue_core::{Claims, RegistryRead, Retention, UnitLifecycle};
