//! `retinue-store`: the only crate of Retinue that knows SQL.
//!
//! It owns one SQLite file, `<HERMES_HOME>/state.db`, shared with the Python
//! hermes-agent: the schema and its in-place upgrade of hermes files, the
//! retained-subagent registry ([`RegistryRead`], [`UnitLifecycle`],
//! [`Retention`], [`Claims`]; [`Registry`] is all four), sessions and transcripts
//! ([`SessionStore`], [`SessionGraph`]), the usage ledger ([`UsageLedger`]),
//! and the configuration. Other crates see plain record types and
//! object-safe traits; no rusqlite type crosses this boundary.
//!
//! ```no_run
//! use retinue_store::{RegistryRead, Store, StoreOptions};
//! let store = Store::open("/tmp/demo/state.db", StoreOptions::default())?;
//! for child in store.list_retained_children()? {
//!     println!("{} {}", child.child_id(), child.child_session_id);
//! }
//! # Ok::<(), retinue_store::Error>(())
//! ```

mod budget;
mod clock;
mod config;
mod db;
mod error;
mod ledger;
mod model;
mod probe;
mod registry;
mod rows;
mod rules;
mod sessions;
mod spend;
mod status;
mod store;

pub use budget::Budgets;
pub use clock::{Clock, ManualClock, SystemClock, iso8601};
pub use config::{
    DatabaseConfig, DelegationConfig, JournalMode, LoadedConfig, McpServerConfig, ModelPrice,
    Synchronous, TerminalConfig, default_profile_key, hermes_home, try_hermes_home, user_home,
};
pub use db::StoreOptions;
pub use error::{Error, ErrorKind, Result, Source};
pub use ledger::*;
pub use model::*;
pub use probe::{OwnerProbe, ProcProbe, ProcessState, current_owner};
pub use registry::claims::{LEASE_SECS, MAX_DELIVERY_ATTEMPTS};
pub use registry::history::{DELIVERED_MAX_AGE_SECS, PENDING_KEEP, TERMINAL_KEEP};
pub use registry::{Claims, Registry, RegistryRead, Retention, UnitLifecycle};
pub use rules::{ChildFacts, Limits, child_status, covered_status};
pub use sessions::{MAX_HOPS, SessionGraph, SessionStore};
pub use spend::{BudgetLimit, BudgetStatus, Reservation, ReservationDraft, Spend};
pub use status::{ChildStatus, ExitReason, Role, UnitState};
pub use store::Store;

#[cfg(any(test, feature = "mocks"))]
pub use budget::MockBudgets;
#[cfg(any(test, feature = "mocks"))]
pub use clock::MockClock;
#[cfg(any(test, feature = "mocks"))]
pub use probe::MockOwnerProbe;
#[cfg(any(test, feature = "mocks"))]
pub use registry::{MockRegistry, MockRegistryRead};
#[cfg(any(test, feature = "mocks"))]
pub use sessions::{MockSessionGraph, MockSessionStore};
