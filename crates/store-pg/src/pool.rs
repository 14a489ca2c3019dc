//! The bottom layer: connections, transactions with transparent retry of
//! serialization failures and deadlocks, and the classification of
//! PostgreSQL errors into the store's one [`Error`] enum (by SQLSTATE, never
//! by message text). No `postgres` type leaves the crate.

use std::sync::Mutex;
use std::time::Duration;

use postgres::error::SqlState;
use postgres::{Client, Config, IsolationLevel, NoTls, Transaction};
use retinue_store::{Error, Result, Source};

/// A failure inside an operation, before its context is attached.
#[derive(Debug)]
pub(crate) enum Fail {
    /// A database error, not yet classified.
    Pg(postgres::Error),
    /// A domain error.
    Store(Error),
}

impl From<postgres::Error> for Fail {
    fn from(e: postgres::Error) -> Self {
        Fail::Pg(e)
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::Store(e)
    }
}

impl Fail {
    /// The public error, naming `operation`.
    pub(crate) fn during(self, operation: &'static str) -> Error {
        match self {
            Fail::Pg(e) => classify(operation, e),
            Fail::Store(e) => e,
        }
    }
}

/// Result of the inside of an operation.
pub(crate) type PgResult<T> = std::result::Result<T, Fail>;

/// Whether the transaction may simply be run again (SQLSTATE 40001, 40P01).
fn is_retryable(e: &postgres::Error) -> bool {
    matches!(e.code(), Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE
        || *c == SqlState::T_R_DEADLOCK_DETECTED)
}

/// Classifies by SQLSTATE.
pub(crate) fn classify(operation: &'static str, e: postgres::Error) -> Error {
    let code = e.code().map(|c| c.code().to_owned()).unwrap_or_default();
    let source: Source = Box::new(e);
    match code.as_str() {
        c if c.starts_with("23") => Error::Conflict { operation, source },
        "40001" | "40P01" | "55P03" | "57014" | "53300" => {
            // PostgreSQL waits on its own (lock_timeout); the wait is not measured here.
            Error::Busy { operation, waited_ms: 0, timeout_ms: 0, source }
        }
        "53100" => Error::DiskFull { operation, source },
        "25006" => Error::ReadOnly { operation, source },
        "XX001" | "XX002" => Error::Corrupt { operation, source },
        _ => Error::Database { operation, source },
    }
}

/// How a transaction runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `SERIALIZABLE` read-write: every multi-row change, retried on 40001/40P01.
    Write,
    /// `REPEATABLE READ READ ONLY`: one consistent snapshot, never fails to serialize.
    Read,
}

/// Attempts of one transaction before a serialization failure is surfaced (as `Busy`).
const MAX_ATTEMPTS: u32 = 200;

/// A small pool of synchronous clients (each operation takes one).
pub(crate) struct Pool {
    config: Config,
    schema: Option<String>,
    idle: Mutex<Vec<Client>>,
    max_idle: usize,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the config: it may hold a password.
        f.debug_struct("Pool").field("schema", &self.schema).finish_non_exhaustive()
    }
}

/// `"name"` with embedded quotes doubled.
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl Pool {
    pub(crate) fn new(config: Config, schema: Option<String>, max_idle: usize) -> Pool {
        Pool { config, schema, idle: Mutex::new(Vec::new()), max_idle }
    }

    /// A new connection with the search path set.
    pub(crate) fn connect(&self) -> PgResult<Client> {
        let mut client = self.config.connect(NoTls)?;
        if let Some(schema) = &self.schema {
            client.batch_execute(&format!("SET search_path TO {}", quote_ident(schema)))?;
        }
        Ok(client)
    }

    fn take(&self) -> PgResult<Client> {
        let pooled = self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
        match pooled {
            Some(c) if !c.is_closed() => Ok(c),
            _ => self.connect(),
        }
    }

    fn give(&self, client: Client) {
        if client.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if idle.len() < self.max_idle {
            idle.push(client);
        }
    }

    /// Runs `f` in one transaction; serialization failures and deadlocks
    /// are retried with jittered backoff (so `f` must be re-runnable).
    pub(crate) fn tx<T>(
        &self,
        operation: &'static str,
        mode: Mode,
        mut f: impl FnMut(&mut Transaction<'_>) -> PgResult<T>,
    ) -> Result<T> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut client = match self.take() {
                Ok(c) => c,
                // A refused connection (server restarting, too many clients) is retried briefly.
                Err(e) if attempt < 5 => {
                    log::debug!("{operation}: connecting failed ({e:?}); retrying");
                    backoff(attempt);
                    continue;
                }
                Err(e) => return Err(e.during(operation)),
            };
            let result = run_once(&mut client, mode, &mut f);
            match result {
                Ok(v) => {
                    self.give(client);
                    return Ok(v);
                }
                Err(Fail::Pg(e)) if is_retryable(&e) && attempt < MAX_ATTEMPTS => {
                    self.give(client);
                    backoff(attempt);
                }
                Err(e) => {
                    self.give(client);
                    return Err(e.during(operation));
                }
            }
        }
    }

    /// Runs `f` on a connection outside any transaction (DDL, migrations).
    pub(crate) fn with<T>(
        &self,
        operation: &'static str,
        f: impl FnOnce(&mut Client) -> PgResult<T>,
    ) -> Result<T> {
        let mut client = self.take().map_err(|e| e.during(operation))?;
        let result = f(&mut client);
        self.give(client);
        result.map_err(|e| e.during(operation))
    }
}

fn run_once<T>(
    client: &mut Client,
    mode: Mode,
    f: &mut impl FnMut(&mut Transaction<'_>) -> PgResult<T>,
) -> PgResult<T> {
    let mut tx = match mode {
        Mode::Write => client.build_transaction().isolation_level(IsolationLevel::Serializable),
        Mode::Read => client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true),
    }
    .start()?;
    let value = f(&mut tx)?;
    tx.commit()?;
    Ok(value)
}

/// Sleeps 1–2× an exponential step (2 ms doubling, capped at 100 ms).
fn backoff(attempt: u32) {
    let step = 2u64.saturating_mul(1 << attempt.min(6)).min(100);
    let mut b = [0u8; 1];
    let jitter = getrandom::fill(&mut b).map_or(0, |()| u64::from(b[0]) * step / 255);
    std::thread::sleep(Duration::from_millis(step + jitter));
}

/// `bytes` random bytes as lowercase hex.
pub(crate) fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| Error::Random(e.to_string()))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// `u32` → `i64` for a parameter.
pub(crate) fn int(v: u32) -> i64 {
    i64::from(v)
}

/// `i64` (a count or index) → `u32`, saturating.
pub(crate) fn u32_of(v: i64) -> u32 {
    u32::try_from(v).unwrap_or(if v < 0 { 0 } else { u32::MAX })
}

/// `u64` row count → `usize`.
pub(crate) fn count(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}
