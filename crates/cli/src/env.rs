//! Where the command works: the home, the database (a SQLite file, or a
//! PostgreSQL URL in team mode), the profile and the output mode, resolved
//! from the global options, the environment and `config.yaml`'s `database:`.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use retinue_config::{LoadedConfig, try_hermes_home};
use retinue_core::Clock;
use retinue_store::{Store, StoreOptions};

use crate::cli::Cli;
use crate::error::{CliError, Result};

/// The resolved global options.
#[derive(Debug, Clone)]
pub(crate) struct Env {
    /// The hermes home (config.yaml lives here).
    pub(crate) home: PathBuf,
    /// The database file.
    pub(crate) db: PathBuf,
    /// Team mode: the PostgreSQL connection string (`--db postgres://…`,
    /// else `database.url`); `None` = the SQLite file `db`. Never printed
    /// (see [`redact_url`]).
    pub(crate) pg_url: Option<String>,
    /// Whether `--db` itself was the URL (not `database.url`).
    pub(crate) db_is_url: bool,
    /// The process profile key (`''` = none); in team mode also from
    /// `database.profile`.
    pub(crate) profile: String,
    /// Machine output.
    pub(crate) json: bool,
    /// `--all-profiles`: team mode's operator view across tenants.
    pub(crate) all_profiles: bool,
    /// `<home>/config.yaml`, read once per process (every consumer takes
    /// its section from here).
    config: Arc<LoadedConfig>,
    /// Whether the configuration's warnings were printed (once per process).
    warned: Arc<AtomicBool>,
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
        // A background worker gets its PostgreSQL URL by the environment
        // (never in its argv: /proc shows that to every local user).
        let worker_db = std::env::var_os(DB_URL_VAR).filter(|v| !v.is_empty());
        let db_arg: Option<PathBuf> = cli.db.clone().or_else(|| worker_db.map(PathBuf::from));
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
        let explicit = cli.profile.clone().or_else(|| std::env::var("HERMES_PROFILE").ok());
        let mut pg_url = None;
        if let Some(db) = &db_arg
            && let Some(scheme) = db_url_scheme(db.as_os_str())
        {
            if scheme == "postgres" || scheme == "postgresql" {
                pg_url = Some(db.to_string_lossy().trim().to_owned());
            } else {
                return Err(CliError::Usage(format!(
                    "--db {}: unsupported database URL scheme '{scheme}://' (--db takes a file \
                 path to a SQLite state.db)",
                    redact_url(&db.to_string_lossy())
                )));
            }
        }
        // The one read of `<home>/config.yaml` in this process.
        let config = Arc::new(LoadedConfig::load(&home));
        // `database.url` / `database.profile` (team mode) when no --db is given.
        let database = if db_arg.is_none() || pg_url.is_some() {
            config.database.clone()
        } else {
            retinue_config::DatabaseConfig::default()
        };
        if db_arg.is_none()
            && let Some(url) = database.url.as_deref()
        {
            if !retinue_store_pg::is_postgres_url(url) {
                return Err(CliError::Usage(format!(
                    "database.url in {} must be a PostgreSQL connection string \
                     (postgres://user@host:port/db), not {}",
                    home.join("config.yaml").display(),
                    redact_url(url)
                )));
            }
            pg_url = Some(url.trim().to_owned());
        }
        let db = match (&db_arg, &pg_url) {
            (Some(db), None) => db.clone(),
            _ => home.join("state.db"),
        };
        let profile = match &pg_url {
            None => explicit.unwrap_or_default(),
            Some(_) => {
                explicit.filter(|p| !p.trim().is_empty()).or(database.profile).unwrap_or_default()
            }
        };
        let db_is_url = db_arg.is_some() && pg_url.is_some();
        Ok(Env {
            home,
            db,
            pg_url,
            db_is_url,
            profile,
            json: cli.json,
            all_profiles: cli.all_profiles,
            config,
            warned: Arc::default(),
        })
    }

    /// The home's worktrees of isolated children (`HOME/retinue/worktrees`).
    pub(crate) fn worktrees(&self) -> Arc<dyn retinue_core::run::Isolation> {
        Arc::new(retinue_worktree::GitWorktrees::new(retinue_worktree::root_of(&self.home)))
    }

    /// The home's configuration, as read when the command started.
    pub(crate) fn config(&self) -> &LoadedConfig {
        &self.config
    }

    /// The configuration's warnings, on stderr the first time a command
    /// uses it (never twice in one process).
    pub(crate) fn warn_config(&self) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            for warning in &self.config.warnings {
                eprintln!("retinue: warning: {warning}");
            }
        }
    }

    /// The team-mode URL, refused without an explicit profile (exit 2): in
    /// team mode the profile is never derived from a host's path.
    pub(crate) fn team(&self) -> Result<Option<&str>> {
        match &self.pg_url {
            None => Ok(None),
            Some(url) if self.profile.trim().is_empty() => Err(CliError::Usage(format!(
                "team mode ({}) needs an explicit profile: pass --profile NAME, set \
                 HERMES_PROFILE, or set database.profile in {}",
                redact_url(url),
                self.home.join("config.yaml").display()
            ))),
            Some(url) => Ok(Some(url)),
        }
    }

    /// Opens the SQLite database with the home's configuration, this
    /// profile and `clock` (commands use [`crate::backend::Backend`]); returns
    /// the store and the configuration it was opened with.
    pub(crate) fn open(
        &self,
        clock: Arc<dyn Clock>,
        access: Access,
    ) -> Result<(Arc<Store>, LoadedConfig)> {
        if retinue_store_pg::is_postgres_url(&self.db.to_string_lossy()) {
            // Never a file named `postgres:` (team mode opens a `PgStore` instead).
            return Err(crate::error::CliError::Usage(
                "--db postgres://… is not supported here: this command works on a state.db file"
                    .to_owned(),
            ));
        }
        self.warn_config();
        let config = self.config();
        let defaults = StoreOptions::default();
        let opts = StoreOptions {
            retention: config.delegation.retention(),
            journal_mode: config.database.journal_mode,
            synchronous: config.database.synchronous,
            busy_timeout: config.database.busy_timeout().unwrap_or(defaults.busy_timeout),
            clock,
            profile: self.profile.clone(),
            read_only: access == Access::Read,
            create_missing: access == Access::WriteOrCreate,
        };
        Ok((Arc::new(Store::open(&self.db, opts)?), config.clone()))
    }
}

/// The variable a background worker reads its `--db` PostgreSQL URL from.
pub(crate) const DB_URL_VAR: &str = "RETINUE_WORKER_DB_URL";

/// `url` as every message shows it: [`retinue_core::redact_endpoint`]
/// (the one redaction of model, MCP, OTLP and PostgreSQL URLs: userinfo
/// and query values masked), clipped.
pub(crate) fn redact_url(url: &str) -> String {
    crate::table::clip(&retinue_core::redact_endpoint(url), 128)
}

/// What no child of this process may reach: the home, the directory of
/// the database (so its `-wal`, `-shm`, `-journal` and `-retinue-writers` files, present or
/// not, are out of reach too), this binary (the sandbox helper: replaced,
/// it would run unconfined) and the configured MCP servers' programs.
pub(crate) fn protected(
    env: &Env,
    mcp: &[retinue_config::McpServerConfig],
) -> retinue_tools::workspace::Protected {
    let mut hidden = vec![env.home.clone()];
    if env.pg_url.is_none()
        && let Ok(db) = std::path::absolute(&env.db)
        && let Some(dir) = db.parent()
    {
        hidden.push(dir.to_path_buf());
    }
    // The binary, by path: the sandbox cannot replace it (the helper itself
    // is run as /proc/self/exe, the running inode, whatever the path holds).
    hidden.extend(std::env::current_exe().ok());
    for server in mcp {
        if let Some(command) = &server.command {
            let path = std::path::Path::new(command);
            if path.is_absolute() {
                hidden.push(path.to_path_buf());
            } else if command.contains('/') {
                hidden.extend(server.cwd.as_ref().map(|cwd| std::path::Path::new(cwd).join(path)));
            }
        }
    }
    retinue_tools::workspace::Protected { hidden }
}

/// The terminal's sandbox helper: this binary's hidden `__sandbox` mode.
/// It is started as `/proc/self/exe`: always the binary that is running,
/// never what its path holds by then (a child that swapped the file would
/// otherwise run unconfined).
pub(crate) fn sandbox_helper() -> Option<retinue_tools::terminal::Helper> {
    let program = std::path::PathBuf::from("/proc/self/exe");
    program.exists().then(|| retinue_tools::terminal::Helper {
        program,
        prefix: vec![crate::SANDBOX_SUBCOMMAND.into()],
    })
}

#[cfg(test)]
mod tests {
    use super::{db_url_scheme, redact_url};
    use std::ffi::OsStr;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact_url("postgres://u:hunter2@h:5432/db"), "postgres://***@h:5432/db");
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://***@h/db");
        assert_eq!(
            redact_url("postgresql://h/db?user=u&password=hunter2&x=1"),
            "postgresql://h/db?user=***&password=***&x=***"
        );
        assert!(!redact_url("postgres://u:p@ss:w@rd@h/db").contains("rd@h"));
        for raw in ["postgres://u:pa/ss@h/db", "postgres://u:a/b@c/d@h:5432/db?sslmode=require"] {
            let shown = redact_url(raw);
            assert!(!shown.contains("pa/ss") && !shown.contains("a/b"), "{raw} -> {shown}");
            assert!(shown.starts_with("postgres://***@h"), "{raw} -> {shown}");
        }
    }

    #[test]
    fn urls_are_recognised_and_paths_are_not() {
        assert_eq!(db_url_scheme(OsStr::new("postgres://h/db")).as_deref(), Some("postgres"));
        assert_eq!(db_url_scheme(OsStr::new("SQLite+x.y-z://a")).as_deref(), Some("sqlite+x.y-z"));
        for path in ["state.db", "/tmp/a://b", "./x://y", "1abc://x", "://x", "C:\\db"] {
            assert_eq!(db_url_scheme(OsStr::new(path)), None, "{path}");
        }
    }
}
