//! The registry roles on PostgreSQL: `RegistryRead`, `UnitLifecycle`,
//! `Retention` and `Claims`, with the SQLite backend's semantics (spec
//! §3), except that the retention limits (TTL, cap) apply per profile.
//!
//! Every write is one `SERIALIZABLE` transaction (retried on 40001/40P01 by
//! the pool), so prune, cap and claims are safe under concurrent workers on
//! any number of hosts; claims also take row locks (`FOR UPDATE`, `SKIP
//! LOCKED` for deliveries) so that workers contend on rows, not on aborts.
//! Reads are one `REPEATABLE READ` snapshot.
//!
//! One file per role, as the SQLite backend's `registry/` (the two read
//! file by file): `addressability.rs`, `units.rs` and `retain.rs`,
//! `retention.rs`, `recovery.rs`, `history.rs`, `claims.rs`, `control.rs`
//! (the `Controls` seam), `backfill.rs`.

pub(crate) mod addressability;
pub(crate) mod backfill;
pub(crate) mod claims;
pub(crate) mod control;
pub(crate) mod history;
pub(crate) mod recovery;
pub(crate) mod retain;
pub(crate) mod retention;
pub(crate) mod units;
