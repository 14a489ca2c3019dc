//! The bottom layer: connections, transactions with transparent retry of
//! serialization failures and deadlocks, and the classification of
//! PostgreSQL errors into the store's one [`Error`] enum (by SQLSTATE, never
//! by message text). No `postgres` type leaves the crate.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use postgres::error::SqlState;
use postgres::types::ToSql;
use postgres::{Client, Config, NoTls, Row, Statement};
use retinue_core::{Error, Result, Source};

retinue_core::backend_fail!(Pg(postgres::Error), classify);

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
            // `Pool::tx` fills in the time spent retrying.
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
    /// `SERIALIZABLE` read-write: every change, retried on 40001/40P01.
    Write,
    /// `REPEATABLE READ READ ONLY`: several statements on one consistent
    /// snapshot, never fails to serialize.
    Read,
    /// Exactly one read-only statement in autocommit: PostgreSQL runs every
    /// statement on one snapshot, so no `BEGIN`/`COMMIT` round trips are
    /// needed. A second statement is refused (it would see another snapshot).
    ReadOne,
    /// Exactly one statement (a write, or a CTE of several) in autocommit,
    /// on a connection whose session default is `SERIALIZABLE`: the
    /// implicit transaction of the statement is exactly [`Mode::Write`]'s
    /// `BEGIN`, statement, `COMMIT`, in one round trip instead of three.
    /// Retried on 40001/40P01 as [`Mode::Write`]; a second statement is refused.
    WriteOne,
    /// Exactly one statement (a write, or a CTE of several) in autocommit
    /// on a connection with the server's default isolation (`READ
    /// COMMITTED` unless the server says otherwise): for a write whose
    /// correctness rests on row locks and the server's own triggers, not on
    /// serializability (a retain under its tenant's cap, issue #41): it
    /// never fails to serialize with other writers of its tenant. Deadlocks
    /// (40P01) are retried; a second statement is refused.
    WriteCommitted,
}

impl Mode {
    /// Whether the mode runs on a connection whose session default is
    /// `SERIALIZABLE` (only [`Mode::WriteOne`]; the others name their
    /// isolation in `BEGIN` or are reads on the server's default), so a
    /// process that never writes in one statement never opens one.
    fn serial(self) -> bool {
        matches!(self, Mode::WriteOne)
    }

    /// Whether the mode is one autocommit statement.
    fn one(self) -> bool {
        matches!(self, Mode::ReadOne | Mode::WriteOne | Mode::WriteCommitted)
    }
}

/// How long queued transactions queue from their first attempt after one
/// of them failed to serialize (a hot spot stays hot for a while; an
/// uncontended pool never queues, so pays no round trip for it).
const CONTENDED_FOR_MS: u64 = 1_000;

/// Attempts of one transaction before a serialization failure is surfaced (as `Busy`).
const MAX_ATTEMPTS: u32 = 200;

/// Prepared statements kept per connection (the SQL texts are a fixed set;
/// the bound only guards against a caller building texts without end).
const MAX_CACHED: usize = 512;

/// One pooled connection and its prepared statements, keyed by SQL text.
/// The statements die with the connection (a replaced connection starts empty).
struct Conn {
    client: Client,
    stmts: HashMap<String, Statement>,
    /// A transaction could not be ended: never pooled again.
    broken: bool,
    /// The session default is `SERIALIZABLE` (see [`Mode::WriteOne`]).
    serial: bool,
}

impl Conn {
    /// Runs `sql` with one `BIGINT` parameter, prepared once per connection.
    fn run_cached(&mut self, sql: &str, param: i64) -> std::result::Result<u64, postgres::Error> {
        let stmt = match self.stmts.get(sql) {
            Some(s) => s.clone(),
            None => {
                let s = self.client.prepare(sql)?;
                self.stmts.insert(sql.to_owned(), s.clone());
                s
            }
        };
        self.client.execute(&stmt, &[&param])
    }
}

/// A statement to run: SQL text (prepared once per connection, then cached)
/// or an already prepared statement.
pub(crate) trait Sql {
    /// The prepared statement, from the connection's cache when known.
    fn prepared(&self, tx: &mut Tx<'_>) -> PgResult<Statement>;
}

impl Sql for str {
    fn prepared(&self, tx: &mut Tx<'_>) -> PgResult<Statement> {
        tx.prepare(self)
    }
}

impl Sql for String {
    fn prepared(&self, tx: &mut Tx<'_>) -> PgResult<Statement> {
        tx.prepare(self)
    }
}

impl Sql for Statement {
    fn prepared(&self, _tx: &mut Tx<'_>) -> PgResult<Statement> {
        Ok(self.clone())
    }
}

/// Parameters of one statement.
pub(crate) type Params<'a> = [&'a (dyn ToSql + Sync)];

/// The inside of one operation: a connection in (or, for
/// [`Mode::ReadOne`], outside) a transaction, with its statement cache.
pub(crate) struct Tx<'a> {
    client: &'a mut Client,
    stmts: &'a mut HashMap<String, Statement>,
    mode: Mode,
    issued: u32,
}

impl Tx<'_> {
    /// `sql` prepared on this connection (once; later calls hit the cache).
    pub(crate) fn prepare(&mut self, sql: &str) -> PgResult<Statement> {
        if let Some(s) = self.stmts.get(sql) {
            return Ok(s.clone());
        }
        let stmt = self.client.prepare(sql)?;
        if self.stmts.len() >= MAX_CACHED {
            self.stmts.clear();
        }
        self.stmts.insert(sql.to_owned(), stmt.clone());
        Ok(stmt)
    }

    /// Counts a statement; a second one in [`Mode::ReadOne`] or
    /// [`Mode::WriteOne`] is a bug of the caller.
    fn issue(&mut self) -> PgResult<()> {
        self.issued += 1;
        if self.mode.one() && self.issued > 1 {
            return Err(Fail::Store(Error::Invalid(
                "internal: a second statement in a one-statement operation".to_owned(),
            )));
        }
        Ok(())
    }

    /// Rows of one statement.
    pub(crate) fn query<S: Sql + ?Sized>(
        &mut self,
        sql: &S,
        params: &Params<'_>,
    ) -> PgResult<Vec<Row>> {
        self.issue()?;
        let stmt = sql.prepared(self)?;
        Ok(self.client.query(&stmt, params)?)
    }

    /// The one row of one statement.
    pub(crate) fn query_one<S: Sql + ?Sized>(
        &mut self,
        sql: &S,
        params: &Params<'_>,
    ) -> PgResult<Row> {
        self.issue()?;
        let stmt = sql.prepared(self)?;
        Ok(self.client.query_one(&stmt, params)?)
    }

    /// At most one row of one statement.
    pub(crate) fn query_opt<S: Sql + ?Sized>(
        &mut self,
        sql: &S,
        params: &Params<'_>,
    ) -> PgResult<Option<Row>> {
        self.issue()?;
        let stmt = sql.prepared(self)?;
        Ok(self.client.query_opt(&stmt, params)?)
    }

    /// Rows changed by one statement.
    pub(crate) fn execute<S: Sql + ?Sized>(
        &mut self,
        sql: &S,
        params: &Params<'_>,
    ) -> PgResult<u64> {
        self.issue()?;
        let stmt = sql.prepared(self)?;
        Ok(self.client.execute(&stmt, params)?)
    }

    /// Statements without parameters (simple protocol, not cached).
    pub(crate) fn batch_execute(&mut self, sql: &str) -> PgResult<()> {
        self.issue()?;
        Ok(self.client.batch_execute(sql)?)
    }
}

/// A small pool of synchronous clients (each operation takes one).
pub(crate) struct Pool {
    config: Config,
    schema: Option<String>,
    /// Idle connections on the server's default isolation (reads).
    idle: Mutex<Vec<Conn>>,
    /// Idle connections whose session default is `SERIALIZABLE` (writes).
    idle_serial: Mutex<Vec<Conn>>,
    /// Idle connections kept, per kind.
    max_idle: usize,
    /// Transactions run again after a serialization failure or deadlock.
    retries: AtomicU64,
    /// The server has no advisory locks: queued transactions run unqueued.
    no_advisory_locks: AtomicBool,
    /// Until when (ms since `born`) queued transactions queue from their
    /// first attempt: set by a serialization failure of one of them.
    contended_until_ms: AtomicU64,
    /// The pool's creation, the origin of `contended_until_ms`.
    born: Instant,
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
        Pool {
            config,
            schema,
            idle: Mutex::new(Vec::new()),
            idle_serial: Mutex::new(Vec::new()),
            max_idle,
            retries: AtomicU64::new(0),
            no_advisory_locks: AtomicBool::new(false),
            contended_until_ms: AtomicU64::new(0),
            born: Instant::now(),
        }
    }

    /// A new connection with the search path set; `serial`: its session
    /// default isolation is `SERIALIZABLE` (for [`Mode::WriteOne`]).
    fn connect(&self, serial: bool) -> PgResult<Client> {
        let mut client = self.config.connect(NoTls)?;
        // Each statement is prepared once per connection and planned once
        // for every value (a generic plan): PostgreSQL's default re-plans a
        // statement on every call while its per-value estimate looks
        // cheaper, which for the lineage walk or a skewed ledger costs more
        // than running it. The statements are written so that their
        // generic plans are the right ones (each kept, with its buffers, in
        // docs/pg-plans.md).
        // (PostgreSQL 12 and later; a server without the setting plans as it likes.)
        if let Err(e) = client.batch_execute("SET plan_cache_mode = force_generic_plan")
            && e.code() != Some(&SqlState::UNDEFINED_OBJECT)
        {
            return Err(e.into());
        }
        if let Some(schema) = &self.schema {
            client.batch_execute(&format!("SET search_path TO {}", quote_ident(schema)))?;
        }
        if serial {
            client.batch_execute("SET default_transaction_isolation = 'serializable'")?;
        }
        Ok(client)
    }

    /// The idle list of one kind of connection.
    fn idle_of(&self, serial: bool) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        let list = if serial { &self.idle_serial } else { &self.idle };
        list.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An idle connection of the kind `mode` runs on, else a new one.
    fn take(&self, mode: Mode) -> PgResult<Conn> {
        let serial = mode.serial();
        let pooled = self.idle_of(serial).pop();
        match pooled {
            Some(c) if !c.client.is_closed() => Ok(c),
            _ => Ok(Conn {
                client: self.connect(serial)?,
                stmts: HashMap::new(),
                broken: false,
                serial,
            }),
        }
    }

    fn give(&self, conn: Conn) {
        if conn.broken || conn.client.is_closed() {
            return;
        }
        let mut idle = self.idle_of(conn.serial);
        if idle.len() < self.max_idle {
            idle.push(conn);
        }
    }

    /// Runs `f` in one transaction (or, for [`Mode::ReadOne`], one
    /// autocommit statement); serialization failures and deadlocks are
    /// retried with jittered backoff (so `f` must be re-runnable). A
    /// failure surfaced as `Busy` reports the time spent retrying.
    pub(crate) fn tx<T>(
        &self,
        operation: &'static str,
        mode: Mode,
        f: impl FnMut(&mut Tx<'_>) -> PgResult<T>,
    ) -> Result<T> {
        self.tx_queued(operation, mode, None, f)
    }

    /// [`Pool::tx`] for a transaction that contends on one hot spot (every
    /// retain of a tenant prunes that tenant's live units): its first
    /// attempt runs as any other (no extra round trip when nothing
    /// contends); once it failed to serialize, each retry — and, for a
    /// second after any queued transaction of this pool failed, every first
    /// attempt too — first takes the session advisory lock `queue` and
    /// holds it until the transaction has ended, so the writers of one hot
    /// spot take turns instead of failing each other again (16 processes ×
    /// 8 threads on one tenant: ~5 retries per operation without it). The lock is taken before `BEGIN`, so the
    /// snapshot is taken after the wait. It is an optimisation only: a
    /// server without advisory locks (CockroachDB) runs the same
    /// transactions unqueued, retried on 40001.
    pub(crate) fn tx_queued<T>(
        &self,
        operation: &'static str,
        mode: Mode,
        queue: Option<i64>,
        mut f: impl FnMut(&mut Tx<'_>) -> PgResult<T>,
    ) -> Result<T> {
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut conn = match self.take(mode) {
                Ok(c) => c,
                // A refused connection (server restarting, too many clients) is retried briefly.
                Err(e) if attempt < 5 => {
                    log::debug!("{operation}: connecting failed ({e:?}); retrying");
                    backoff(attempt);
                    continue;
                }
                Err(e) => return Err(waited(e.during(operation), started)),
            };
            let mut queued = queue.filter(|_| {
                (attempt > 1 || self.contended()) && !self.no_advisory_locks.load(Ordering::Relaxed)
            });
            if let Some(key) = queued
                && let Err(e) = conn.run_cached("SELECT pg_advisory_lock($1)", key)
            {
                if matches!(e.code(), Some(c) if *c == SqlState::UNDEFINED_FUNCTION
                    || *c == SqlState::FEATURE_NOT_SUPPORTED)
                {
                    // A server without advisory locks (CockroachDB): retries alone.
                    self.no_advisory_locks.store(true, Ordering::Relaxed);
                    queued = None;
                } else {
                    conn.broken = true;
                    self.give(conn);
                    return Err(waited(Fail::Pg(e).during(operation), started));
                }
            }
            let result = run_once(&mut conn, mode, &mut f);
            if let Some(key) = queued
                && conn.run_cached("SELECT pg_advisory_unlock($1)", key).is_err()
            {
                // A lock that may still be held must not go back to the pool.
                conn.broken = true;
            }
            match result {
                Ok(v) => {
                    self.give(conn);
                    return Ok(v);
                }
                Err(Fail::Pg(e)) if is_retryable(&e) && attempt < MAX_ATTEMPTS => {
                    self.retries.fetch_add(1, Ordering::Relaxed);
                    if queue.is_some() {
                        self.mark_contended();
                    }
                    self.give(conn);
                    backoff(attempt);
                }
                Err(e) => {
                    if matches!(&e, Fail::Pg(p) if is_stale_statement(p)) {
                        // A cached plan outlived a schema change: start the cache afresh.
                        conn.stmts.clear();
                    }
                    self.give(conn);
                    return Err(waited(e.during(operation), started));
                }
            }
        }
    }

    /// Milliseconds since the pool was created.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether a queued transaction failed to serialize within the last
    /// [`CONTENDED_FOR_MS`]: then queued transactions queue from their first
    /// attempt (two round trips more each, instead of aborts and backoff).
    fn contended(&self) -> bool {
        self.now_ms() < self.contended_until_ms.load(Ordering::Relaxed)
    }

    fn mark_contended(&self) {
        self.contended_until_ms
            .fetch_max(self.now_ms().saturating_add(CONTENDED_FOR_MS), Ordering::Relaxed);
    }

    /// Transactions this pool ran again after SQLSTATE 40001 or 40P01.
    pub(crate) fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// Runs `f` on a connection outside any transaction (DDL, migrations).
    pub(crate) fn with<T>(
        &self,
        operation: &'static str,
        f: impl FnOnce(&mut Client) -> PgResult<T>,
    ) -> Result<T> {
        let mut conn = self.take(Mode::Read).map_err(|e| e.during(operation))?;
        let result = f(&mut conn.client);
        // DDL may have invalidated what was prepared.
        conn.stmts.clear();
        self.give(conn);
        result.map_err(|e| e.during(operation))
    }
}

/// `Busy` with the time actually spent since `started`.
fn waited(e: Error, started: Instant) -> Error {
    match e {
        Error::Busy { operation, timeout_ms, source, .. } => {
            let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            Error::Busy { operation, waited_ms: ms, timeout_ms, source }
        }
        other => other,
    }
}

/// A prepared statement the server no longer knows or can no longer run as
/// prepared (26000 invalid statement name; 0A000 "cached plan must not change
/// result type" after a schema change).
fn is_stale_statement(e: &postgres::Error) -> bool {
    matches!(e.code(), Some(c) if *c == SqlState::INVALID_SQL_STATEMENT_NAME
        || *c == SqlState::FEATURE_NOT_SUPPORTED)
}

fn run_once<T>(
    conn: &mut Conn,
    mode: Mode,
    f: &mut impl FnMut(&mut Tx<'_>) -> PgResult<T>,
) -> PgResult<T> {
    let begin = match mode {
        Mode::Write => Some("BEGIN ISOLATION LEVEL SERIALIZABLE"),
        Mode::Read => Some("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"),
        Mode::ReadOne | Mode::WriteOne | Mode::WriteCommitted => None,
    };
    let Some(begin) = begin else {
        let mut tx = Tx { client: &mut conn.client, stmts: &mut conn.stmts, mode, issued: 0 };
        return f(&mut tx);
    };
    conn.client.batch_execute(begin)?;
    let mut tx = Tx { client: &mut conn.client, stmts: &mut conn.stmts, mode, issued: 0 };
    match f(&mut tx) {
        Ok(value) => {
            // A failed COMMIT (e.g. 40001 at commit) ends the transaction too.
            conn.client.batch_execute("COMMIT")?;
            Ok(value)
        }
        Err(e) => {
            if conn.client.batch_execute("ROLLBACK").is_err() {
                // The connection is unusable: drop it rather than pool it.
                conn.broken = true;
            }
            Err(e)
        }
    }
}

/// Sleeps 1–2× an exponential step (2 ms doubling, capped at 100 ms).
fn backoff(attempt: u32) {
    let step = 2u64.saturating_mul(1 << attempt.min(6)).min(100);
    let mut b = [0u8; 1];
    let jitter = getrandom::fill(&mut b).map_or(0, |()| u64::from(b[0]) * step / 255);
    std::thread::sleep(Duration::from_millis(step + jitter));
}

/// The advisory-lock key of a named hot spot: FNV-1a of `name`, the same in
/// every process and every build (std's hashers promise neither).
pub(crate) fn lock_key(name: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from_ne_bytes(h.to_ne_bytes())
}

pub(crate) use retinue_core::random_hex;

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
