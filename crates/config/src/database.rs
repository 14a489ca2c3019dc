//! The `database:` section: durability, the busy timeout, team mode's URL and profile.

use std::path::Path;

use serde_yaml_ng::Value;

use retinue_core::{JournalMode, Synchronous};

use crate::LoadedConfig;

/// The `database:` section.
///
/// `Debug` never prints the connection string (it may hold a password).
#[derive(Clone, PartialEq, Default)]
pub struct DatabaseConfig {
    /// `database.journal_mode`.
    pub journal_mode: JournalMode,
    /// `database.synchronous`.
    pub synchronous: Synchronous,
    /// `database.busy_timeout_seconds`: how long a write waits for another
    /// writer's lock before failing busy; `None` (not configured) keeps
    /// the store's default (10 s). At most one hour.
    pub busy_timeout_seconds: Option<f64>,
    /// `database.url`: a PostgreSQL connection string (team mode) used
    /// when no `--db` is given; `None` = the SQLite `state.db`.
    pub url: Option<String>,
    /// `database.profile`: the tenant profile in team mode (after
    /// `--profile` and `HERMES_PROFILE`).
    pub profile: Option<String>,
}

impl std::fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("journal_mode", &self.journal_mode)
            .field("synchronous", &self.synchronous)
            .field("busy_timeout_seconds", &self.busy_timeout_seconds)
            .field("url", &self.url.as_ref().map(|_| "<set>"))
            .field("profile", &self.profile)
            .finish()
    }
}

impl DatabaseConfig {
    /// `busy_timeout_seconds` as a duration, when configured and representable.
    pub fn busy_timeout(&self) -> Option<std::time::Duration> {
        self.busy_timeout_seconds.and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
    }
}

impl LoadedConfig {
    pub(crate) fn read_database(&mut self, v: &Value, origin: &Path) {
        let mut warnings = Vec::new();
        match v.get("journal_mode").map(|m| m.as_str().map(str::to_ascii_lowercase)) {
            None => {}
            Some(Some(m)) if m == "wal" => self.database.journal_mode = JournalMode::Wal,
            Some(Some(m)) if m == "delete" => self.database.journal_mode = JournalMode::Delete,
            Some(_) => warnings.push(format!(
                "{}: database.journal_mode must be `wal` or `delete`; using wal",
                origin.display()
            )),
        }
        match v.get("synchronous").map(|m| m.as_str().map(str::to_ascii_lowercase)) {
            None => {}
            Some(Some(m)) if m == "full" => self.database.synchronous = Synchronous::Full,
            Some(Some(m)) if m == "normal" => self.database.synchronous = Synchronous::Normal,
            Some(_) => warnings.push(format!(
                "{}: database.synchronous must be `full` or `normal`; using full",
                origin.display()
            )),
        }
        match v.get("busy_timeout_seconds") {
            None | Some(Value::Null) => {}
            Some(Value::Number(n))
                if n.as_f64().is_some_and(|f| f.is_finite() && (0.0..=3600.0).contains(&f)) =>
            {
                self.database.busy_timeout_seconds = n.as_f64();
            }
            Some(_) => warnings.push(format!(
                "{}: database.busy_timeout_seconds must be a number of seconds from 0 to 3600; \
                 using the default (10)",
                origin.display()
            )),
        }
        for key in ["url", "profile"] {
            match v.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(text)) if !text.trim().is_empty() => {
                    let text = Some(text.trim().to_owned());
                    if key == "url" {
                        self.database.url = text;
                    } else {
                        self.database.profile = text;
                    }
                }
                Some(_) => warnings.push(format!(
                    "{}: database.{key} must be a non-empty string; ignored",
                    origin.display()
                )),
            }
        }
        for w in warnings {
            self.warn(w);
        }
    }
}
