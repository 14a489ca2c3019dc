//! Where the command works: the home, the database file, the profile and
//! the output mode, resolved from the global options and the environment.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use retinue_store::{Clock, LoadedConfig, Store, StoreOptions, hermes_home};

use crate::cli::Cli;
use crate::error::Result;

/// The resolved global options.
#[derive(Debug, Clone)]
pub(crate) struct Env {
    /// The hermes home (config.yaml lives here).
    pub(crate) home: PathBuf,
    /// The database file.
    pub(crate) db: PathBuf,
    /// The process profile key (`''` = none).
    pub(crate) profile: String,
    /// Machine output.
    pub(crate) json: bool,
}

impl Env {
    /// `--home` (else `$HERMES_HOME`, else `~/.hermes`), `--db` (else
    /// `<home>/state.db`), `--profile` (else `$HERMES_PROFILE`, else `''`).
    pub(crate) fn from_cli(cli: &Cli) -> Env {
        let home = cli.home.clone().unwrap_or_else(hermes_home);
        let db = cli.db.clone().unwrap_or_else(|| home.join("state.db"));
        let profile = cli
            .profile
            .clone()
            .or_else(|| std::env::var("HERMES_PROFILE").ok())
            .unwrap_or_default();
        Env { home, db, profile, json: cli.json }
    }

    /// Opens the database with the home's configuration, this profile and `clock`.
    pub(crate) fn open(&self, clock: Arc<dyn Clock>) -> Result<Arc<Store>> {
        open_store(&self.home, &self.db, &self.profile, clock)
    }
}

/// Opens `db` with `<home>/config.yaml`, `profile` and `clock`; configuration
/// warnings go to stderr.
pub(crate) fn open_store(
    home: &Path,
    db: &Path,
    profile: &str,
    clock: Arc<dyn Clock>,
) -> Result<Arc<Store>> {
    if retinue_store_pg::is_postgres_url(&db.to_string_lossy()) {
        // Never a file named `postgres:`: team mode is `migrate --to` only, so far.
        return Err(crate::error::CliError::Usage(
            "--db postgres://… is not supported by this command yet; use \
             `retinue migrate --to postgres://…` to copy a state.db into PostgreSQL"
                .to_owned(),
        ));
    }
    let config = LoadedConfig::load(home);
    for warning in &config.warnings {
        eprintln!("retinue: warning: {warning}");
    }
    let opts =
        StoreOptions { config, clock, profile: profile.to_owned(), ..StoreOptions::default() };
    Ok(Arc::new(Store::open(db, opts)?))
}
