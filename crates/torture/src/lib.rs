//! `retinue-torture`: the reliability and security harnesses of Retinue.
//!
//! Each harness is a library function (so the integration tests run it at
//! CI size) and a subcommand of the `retinue-torture` binary (so
//! `cargo xtask reliability --full` runs it at full size):
//!
//! * [`crash`]: a [`worker`] process dispatches, retains, tombstones, follows
//!   up and bills usage in a loop and is killed with SIGKILL at random
//!   moments; after every kill the database is checked (integrity, every
//!   logged operation present, no half-written unit, ledger totals, restart
//!   recovery).
//! * [`contention`]: several processes × threads run a mixed workload on one
//!   `state.db`: no `Busy` reaches a caller, no lost update, no double claim,
//!   every completion delivered exactly once.
//! * [`oracle`]: random session forests compare `retinue_lineage::root` with
//!   an independent oracle written from the spec's definition (§5.2).
//!
//! * [`hostile`]: hostile files and homes (corrupt page, FIFO, directory,
//!   socket, read-only directory, a hermes writer holding the lock).
//!
//! [`dump`] renders a whole database as text, so tests can prove that a
//! refused operation changed nothing.

pub mod contention;
pub mod crash;
pub mod dump;
pub mod hostile;
pub mod oracle;
pub mod pg_worker;
pub mod rng;
pub mod worker;

use std::path::Path;
use std::sync::Arc;

use retinue_config::DelegationConfig;
use retinue_core::SystemClock;
use retinue_store::{Store, StoreOptions};

/// A harness failure: what was violated, in words.
pub type Failure = String;

/// A harness result.
pub type Outcome<T> = Result<T, Failure>;

/// Adds context to any displayable error.
pub trait Context<T> {
    /// Maps the error to a [`Failure`] prefixed with `what`.
    fn ctx(self, what: &str) -> Outcome<T>;
}

impl<T, E: std::fmt::Display> Context<T> for Result<T, E> {
    fn ctx(self, what: &str) -> Outcome<T> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

/// The profile key the harness workers write.
pub const PROFILE: &str = "torture";

/// Opens the store the way the harness workers do: the wall clock, profile
/// [`PROFILE`], and `max_retained` as given (TTL stays at 72 h).
pub fn open_store(path: &Path, max_retained: u32) -> Outcome<Store> {
    let delegation = DelegationConfig { max_retained, ..DelegationConfig::default() };
    let opts = StoreOptions::default()
        .with_clock(Arc::new(SystemClock))
        .with_profile(PROFILE)
        .with_retention(delegation.retention());
    Store::open(path, opts).ctx(&format!("open {}", path.display()))
}

/// Seconds since `start`, rounded to milliseconds.
pub fn secs_since(start: std::time::Instant) -> f64 {
    (start.elapsed().as_secs_f64() * 1000.0).round() / 1000.0
}
