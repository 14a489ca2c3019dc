//! Where the command works: the home, the database file, the profile and
//! the output mode, resolved from the global options and the environment.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use retinue_store::{Clock, LoadedConfig, Store, StoreOptions, try_hermes_home};

use crate::cli::Cli;
use crate::error::{CliError, Result};

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

/// How a command opens the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Read-only: nothing created, upgraded, adopted or locked; a missing
    /// file is not found (exit 4).
    Read,
    /// Write to an existing file only (a missing file is not found, nothing created).
    WriteExisting,
    /// Write, creating the file and its directory when missing.
    WriteOrCreate,
}

/// The scheme of a `--db` value that looks like a URL (`scheme://…`), or
/// `None` for a file path. The one place URLs are recognised: a backend
/// for a scheme hooks in where [`Env::from_cli`] calls this.
pub(crate) fn db_url_scheme(db: &OsStr) -> Option<String> {
    let text = db.to_string_lossy();
    let (scheme, _) = text.split_once("://")?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic() && chars.all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c)))
        .then(|| scheme.to_ascii_lowercase())
}

impl Env {
    /// `--home` (else `$HERMES_HOME`, else `~/.hermes` as hermes finds it),
    /// `--db` (else `<home>/state.db`), `--profile` (else `$HERMES_PROFILE`,
    /// else `''`). A `--db` URL with an unsupported scheme, a home that is
    /// not a directory, or no home at all is a usage error.
    pub(crate) fn from_cli(cli: &Cli) -> Result<Env> {
        let home = match &cli.home {
            Some(h) => h.clone(),
            None => try_hermes_home().ok_or_else(|| {
                CliError::Usage(
                    "cannot find the hermes home: set HERMES_HOME or HOME, or pass --home DIR"
                        .to_owned(),
                )
            })?,
        };
        if let Ok(meta) = std::fs::metadata(&home)
            && !meta.is_dir()
        {
            return Err(CliError::Usage(format!(
                "the hermes home {} is a file, not a directory (--home DIR or $HERMES_HOME)",
                home.display()
            )));
        }
        if let Some(db) = &cli.db
            && let Some(scheme) = db_url_scheme(db.as_os_str())
        {
            return Err(CliError::Usage(format!(
                "--db {}: unsupported database URL scheme '{scheme}://' (--db takes a file \
                 path to a SQLite state.db)",
                crate::table::clip(&db.to_string_lossy(), 128)
            )));
        }
        let db = cli.db.clone().unwrap_or_else(|| home.join("state.db"));
        let profile = cli
            .profile
            .clone()
            .or_else(|| std::env::var("HERMES_PROFILE").ok())
            .unwrap_or_default();
        Ok(Env { home, db, profile, json: cli.json })
    }

    /// Opens the database with the home's configuration, this profile and `clock`.
    pub(crate) fn open(&self, clock: Arc<dyn Clock>, access: Access) -> Result<Arc<Store>> {
        open_store_with(&self.home, &self.db, &self.profile, clock, access)
    }
}

/// Opens `db` with `<home>/config.yaml`, `profile`, `clock` and `access`;
/// configuration warnings go to stderr.
fn open_store_with(
    home: &Path,
    db: &Path,
    profile: &str,
    clock: Arc<dyn Clock>,
    access: Access,
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
    let opts = StoreOptions {
        config,
        clock,
        profile: profile.to_owned(),
        read_only: access == Access::Read,
        create_missing: access == Access::WriteOrCreate,
        ..StoreOptions::default()
    };
    Ok(Arc::new(Store::open(db, opts)?))
}

#[cfg(test)]
mod tests {
    use super::db_url_scheme;
    use std::ffi::OsStr;

    #[test]
    fn urls_are_recognised_and_paths_are_not() {
        assert_eq!(db_url_scheme(OsStr::new("postgres://h/db")).as_deref(), Some("postgres"));
        assert_eq!(db_url_scheme(OsStr::new("SQLite+x.y-z://a")).as_deref(), Some("sqlite+x.y-z"));
        for path in ["state.db", "/tmp/a://b", "./x://y", "1abc://x", "://x", "C:\\db"] {
            assert_eq!(db_url_scheme(OsStr::new(path)), None, "{path}");
        }
    }
}
