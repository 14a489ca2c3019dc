//! The backend handle every command works through: the store's seam traits
//! opened from either backend — the SQLite `state.db` (a [`Store`]) or, in
//! team mode, PostgreSQL (a [`PgStore`]) — with the configuration and the
//! profile in force. Commands see only the traits, so each one runs the same
//! on both; the SQLite open keeps its access modes (read commands open the
//! file read-only).

use std::sync::Arc;

use retinue_config::LoadedConfig;
use retinue_core::Clock;
use retinue_store::Store;
use retinue_store_pg::{PgOptions, PgStore};

use crate::env::{Access, Env};
use crate::error::Result;

/// The open storage of one command: the core's [`retinue_core::Backend`]
/// (every seam; `backend.registry` and the like read through `Deref`), with
/// the configuration and profile in force.
pub(crate) struct Backend {
    /// Every seam of the open store.
    pub(crate) seams: retinue_core::Backend,
    /// `config.yaml` as the store read it.
    pub(crate) config: LoadedConfig,
    /// The process profile (in team mode, never empty).
    pub(crate) profile: String,
    /// The tenant this process acts for (decided once, from the profile):
    /// every read a command makes of sessions, units, children and the
    /// ledger goes through [`Backend::scoped`].
    pub(crate) scope: retinue_core::Scope,
    /// Team mode: the store, whose worker lease is given up when the command ends.
    pg: Option<Arc<PgStore>>,
}

impl std::ops::Deref for Backend {
    type Target = retinue_core::Backend;

    fn deref(&self) -> &retinue_core::Backend {
        &self.seams
    }
}

impl Backend {
    /// The reads of this backend inside the process's tenant scope.
    pub(crate) fn scoped(&self) -> retinue_core::Scoped<'_> {
        self.scope.reads(&self.seams)
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("profile", &self.profile)
            .field("team", &self.pg.is_some())
            .finish_non_exhaustive()
    }
}

impl Backend {
    /// Opens `env`'s database with `clock`: PostgreSQL in team mode (an
    /// explicit profile required, exit 2 without one), else the SQLite file
    /// with `access`.
    pub(crate) fn open(env: &Env, clock: Arc<dyn Clock>, access: Access) -> Result<Backend> {
        match env.team()? {
            Some(url) => Backend::open_pg(env, url, clock, access),
            None => {
                let (store, config) = env.open(clock, access)?;
                Ok(Backend::from_sqlite(store, config))
            }
        }
    }

    /// The handle over an open SQLite store, opened with `config`.
    pub(crate) fn from_sqlite(store: Arc<Store>, config: LoadedConfig) -> Backend {
        Backend {
            config,
            scope: retinue_core::Scope::of(store.profile()),
            profile: store.profile().to_owned(),
            seams: retinue_core::Backend::of(store),
            pg: None,
        }
    }

    fn open_pg(env: &Env, url: &str, clock: Arc<dyn Clock>, access: Access) -> Result<Backend> {
        env.warn_config();
        let config = env.config().clone();
        let opts = PgOptions {
            retention: config.delegation.retention(),
            clock,
            profile: env.profile.clone(),
            // A read command never migrates the schema nor registers a
            // worker: a read-only (or DML-only) role can read.
            read_only: access == Access::Read,
            ..PgOptions::default()
        };
        // Errors of the PostgreSQL backend never echo the connection string.
        let store = Arc::new(PgStore::open(url, opts)?);
        Ok(Backend {
            config,
            scope: retinue_core::Scope::of(&env.profile),
            profile: env.profile.clone(),
            seams: retinue_core::Backend::of(store.clone()),
            pg: Some(store),
        })
    }

    /// For a long command (delegate, mcp): keeps this worker's lease alive
    /// in the background, so recovery on another host leaves its units alone.
    pub(crate) fn keep_alive(&self) {
        if let Some(pg) = &self.pg {
            drop(pg.spawn_heartbeat());
        }
    }
}

impl Drop for Backend {
    /// A command's worker gives its lease up when the command ends: what it
    /// left running is recoverable at once, from any host.
    fn drop(&mut self) {
        if let Some(pg) = &self.pg
            && let Err(e) = pg.retire()
        {
            log::debug!("giving up the worker lease failed: {e}");
        }
    }
}
