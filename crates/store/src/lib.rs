//! `retinue-store`: the only crate of Retinue that knows SQL.
//!
//! It owns one SQLite file, `<HERMES_HOME>/state.db`, shared with the Python
//! hermes-agent: the schema and its in-place upgrade of hermes files, the
//! retained-subagent registry ([`Registry`]), sessions and transcripts
//! ([`SessionStore`], [`SessionGraph`]), the usage ledger ([`UsageLedger`]),
//! and the configuration. Other crates see plain record types and
//! object-safe traits; no rusqlite type crosses this boundary.
//!
//! ```no_run
//! use retinue_store::{Registry, Store, StoreOptions};
//! let store = Store::open("/tmp/demo/state.db", StoreOptions::default())?;
//! for child in store.list_retained_children()? {
//!     println!("{} {}", child.child_id(), child.child_session_id);
//! }
//! # Ok::<(), retinue_store::Error>(())
//! ```

mod clock;
mod config;
mod db;
mod delivery;
mod error;
mod history;
mod ledger;
mod model;
mod recovery;
mod registry;
mod sessions;
mod status;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use clock::{Clock, ManualClock, SystemClock, iso8601};
pub use config::{
    DatabaseConfig, DelegationConfig, JournalMode, LoadedConfig, ModelPrice, Synchronous,
    default_profile_key, hermes_home,
};
pub use db::StoreOptions;
pub use delivery::MAX_DELIVERY_ATTEMPTS;
pub use error::{Error, Result};
pub use history::{DELIVERED_MAX_AGE_SECS, PENDING_KEEP, TERMINAL_KEEP};
pub use ledger::*;
pub use model::*;
pub use recovery::{OwnerProbe, ProcProbe, ProcessState, current_owner};
pub use registry::{LEASE_SECS, Registry};
pub use sessions::{MAX_HOPS, SessionGraph, SessionStore};
pub use status::{ChildStatus, ExitReason, Role, UnitState};

#[cfg(any(test, feature = "mocks"))]
pub use clock::MockClock;
#[cfg(any(test, feature = "mocks"))]
pub use recovery::MockOwnerProbe;
#[cfg(any(test, feature = "mocks"))]
pub use registry::MockRegistry;
#[cfg(any(test, feature = "mocks"))]
pub use sessions::{MockSessionGraph, MockSessionStore};

/// The SQLite-backed store. Cheap to share behind an `Arc`; each operation
/// takes a pooled connection.
pub struct Store {
    pool: db::Pool,
    clock: Arc<dyn Clock>,
    config: LoadedConfig,
    profile: String,
    has_system_prompt: bool,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.pool.path())
            .field("profile", &self.profile)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens `path`: creates it and its directory, sets the pragmas, upgrades
    /// a hermes file in place and backfills. Idempotent.
    pub fn open(path: impl AsRef<Path>, opts: StoreOptions) -> Result<Store> {
        let pool = db::open_pool(path.as_ref(), &opts)?;
        let has_system_prompt = pool.with(|conn| {
            Ok(db::column_names(conn, "sessions")?.iter().any(|c| c == "system_prompt"))
        })?;
        Ok(Store {
            pool,
            clock: opts.clock,
            config: opts.config,
            profile: opts.profile,
            has_system_prompt,
        })
    }

    /// Opens `<home>/state.db` with `<home>/config.yaml` and the home's profile key.
    pub fn open_home(home: impl AsRef<Path>, clock: Arc<dyn Clock>) -> Result<Store> {
        let home = home.as_ref();
        let opts = StoreOptions {
            config: LoadedConfig::load(home),
            clock,
            profile: default_profile_key(home),
            ..StoreOptions::default()
        };
        Store::open(home.join("state.db"), opts)
    }

    /// The database file.
    pub fn path(&self) -> PathBuf {
        self.pool.path().to_path_buf()
    }

    /// The configuration in force.
    pub fn config(&self) -> &LoadedConfig {
        &self.config
    }

    /// The profile key written to new units.
    pub fn profile(&self) -> &str {
        &self.profile
    }

    /// The clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// `PRAGMA integrity_check` result (`"ok"` when healthy).
    pub fn integrity_check(&self) -> Result<String> {
        self.pool.with(|conn| {
            let mut stmt = conn.prepare("PRAGMA integrity_check")?;
            let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?.join("\n"))
        })
    }

    /// The schema as `type name sql` lines (for snapshots and audits).
    pub fn schema_dump(&self) -> Result<String> {
        self.pool.with(|conn| {
            Ok(db::schema_sql(conn)?
                .into_iter()
                .map(|(t, n, sql)| format!("-- {t} {n}\n{sql}\n"))
                .collect::<String>())
        })
    }
}
