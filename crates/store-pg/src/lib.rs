//! `retinue-store-pg`: Retinue's PostgreSQL backend ("team mode").
//!
//! [`PgStore`] implements every seam trait of `retinue-core` — the four
//! registry roles ([`retinue_core::RegistryRead`], [`retinue_core::UnitLifecycle`],
//! [`retinue_core::Retention`], [`retinue_core::Claims`]), sessions and
//! transcripts ([`retinue_core::SessionStore`], [`retinue_core::SessionGraph`]) and the
//! usage ledger ([`retinue_core::UsageLedger`]) and budget reservations
//! ([`retinue_core::Budgets`]) — on PostgreSQL through the
//! synchronous `postgres` client, so one registry, one ledger and one
//! authority serve agent workers on many hosts. The semantics are the
//! SQLite backend's (the shared conformance suite of `retinue-testkit` runs
//! against both), with two differences that only show with several tenants
//! or hosts:
//!
//! * the retention limits (TTL, cap) apply per profile (`owner_profile`), so
//!   one tenant's delegations never evict another's retained children;
//! * an owner's liveness is a worker lease ([`PgStore::heartbeat`],
//!   [`PgStore::spawn_heartbeat`]) instead of `/proc`: recovery, from any host,
//!   marks the live units of a worker whose lease expired `unknown`.
//!
//! Every multi-row change is one `SERIALIZABLE` transaction, retried
//! transparently on SQLSTATE 40001/40P01 (a retain under the tenant's cap is
//! one READ COMMITTED statement, kept exact by the live-count triggers);
//! claims take row locks (`FOR UPDATE`, `SKIP LOCKED` for deliveries). An
//! advisory lock only queues a tenant's contended writers
//! (`pool::tx_queued`), and a server without one (CockroachDB) runs the same
//! transactions unqueued; no LISTEN/NOTIFY is on any path.
//! Errors are the store's one [`retinue_core::Error`] enum, classified by
//! SQLSTATE; no `postgres` type is in a public signature, and the connection
//! string (which may hold a password) is never logged.
//!
//! ```no_run
//! use retinue_core::RegistryRead;
//! use retinue_store_pg::{PgOptions, PgStore};
//! let store = PgStore::open("postgres://retinue@127.0.0.1:5432/retinue", PgOptions::default())?;
//! println!("{} addressable children", store.list_retained_children()?.len());
//! # Ok::<(), retinue_core::Error>(())
//! ```

mod approvals;
mod budget;
mod ledger;
mod migrate;
mod pool;
mod registry;
mod rows;
mod sessions;
mod store;

pub use migrate::MigrationReport;
pub use store::{
    FORGET_WORKERS_AFTER_SECS, PgOptions, PgStore, WORKER_LEASE_SECS, is_postgres_url,
};
