//! [`PgStore`]: opening (connection string, password lookup, schema,
//! refinery migrations) and the worker lease that stands for an owner's
//! liveness across hosts.
//!
//! # Migration history
//!
//! The schema is refinery's `migrations/V<n>__<name>.sql`, listed once in
//! `MIGRATIONS` (compiled in with `include_str!`); the schema version is
//! their count. An open whose schema is current skips the runner (one query
//! of `refinery_schema_history`); a schema newer than this binary is
//! refused; a read-only open migrates nothing and refuses a schema that is
//! not exactly current. The files are append-only.
//!
//! - **V1** `retinue_pg_base`: the tables and columns of a hermes
//!   `state.db` with PostgreSQL types (so `retinue migrate` copies rows one
//!   to one), ids `COLLATE "C"` so they order as in SQLite, JSON as `TEXT`,
//!   message content `BYTEA` (hermes's structured content starts with NUL);
//!   Retinue's `retinue_children`, `retinue_usage_keys` and
//!   `retinue_usage_totals`; the history and live-unit indexes; and
//!   `retinue_workers`, the worker leases that replace `/proc` liveness
//!   across hosts.
//! - **V2** `retinue_pg_budget_reservations`: the budget reservations, as
//!   SQLite's V4, each with its `owner_worker`, so recovery on any host
//!   releases those of workers whose lease lapsed.
//! - **V3** `retinue_pg_retention_indexes`: the per-profile cap-rank index
//!   (index-only, with `INCLUDE`), live children by TTL clock, and
//!   `retinue_profile_live`, the live units per profile, so a lookup whose
//!   profile is within its cap reads one row instead of ranking.
//! - **V4** `retinue_pg_tombstone_note`: the operator's note of a manual
//!   tombstone (issue #12).
//! - **V5** `retinue_pg_budget_members`: the budget members and
//!   `kept_spent_at`, as SQLite's V8 (issue #23).
//! - **V6** `retinue_pg_migrated_ids`: the target id of every transcript and
//!   ledger row copied from a `state.db`, per source file, so reruns of
//!   `retinue migrate` never collide ids and recognise what they copied
//!   (issue #22).
//! - **V7** `retinue_pg_usage_columns`: typed usage columns on
//!   `delegation_child_usage` (NULL until typed: the store types older and
//!   imported rows when it opens and after an import), as SQLite's V10
//!   (issue #25).
//! - **V8** `retinue_pg_unit_controls`: the control mailbox of background
//!   units, as SQLite's V11, its delete trigger a plpgsql function
//!   (issue #26).
//! - **V9** `retinue_pg_live_children_by_unit`: live children by unit, so
//!   the list's per-unit lookup is one small range whatever the generic
//!   plan (issue #28).
//! - **V10** `retinue_pg_change_clock`: a sequence advanced by row-level
//!   triggers on units and children (claims excepted), the web view's
//!   change marker with the newest message id, as SQLite's V12 (issue #35).
//! - **V11** `retinue_pg_live_count_stripes`: `retinue_profile_live` kept by
//!   the server: triggers on `async_delegations` move each tenant's live
//!   count on the stripe `pg_backend_pid() % 64` whoever writes, so a
//!   retain under the cap needs no ranking (issue #41).
//! - **V12** `retinue_pg_approvals`: the approval queue of children's risky
//!   calls, expired by a trigger when its unit ends, deleted with it
//!   (issue #37).

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Weak};
use std::time::Duration;

use postgres::Config;
pub(crate) use retinue_core::Limits;
use retinue_core::{Clock, Error, Result, RetentionPolicy, SystemClock};

use crate::pool::{Fail, Mode, PgResult, Pool, lock_key, quote_ident, random_hex};

/// Default lease of a worker, in seconds: a worker that has not renewed it
/// for this long is dead, and recovery marks its live units `unknown`.
pub const WORKER_LEASE_SECS: f64 = 60.0;

/// A worker whose lease lapsed this long ago (seconds) loses its row at the
/// next heartbeat of any worker (it is dead either way).
pub const FORGET_WORKERS_AFTER_SECS: f64 = 3_600.0;

/// The server's clock in the unit of the worker-lease columns (seconds since
/// the epoch, `DOUBLE PRECISION`): worker leases are written and judged with
/// it only.
/// `clock_timestamp()`, not `now()`: a retried or long transaction must not
/// judge a lease by the time it began.
pub(crate) const SERVER_NOW: &str = "extract(epoch FROM clock_timestamp())::float8";

/// The schema's migrations, in order (refinery's `V<n>__<name>`).
const MIGRATIONS: &[(&str, &str)] = &[
    ("V1__retinue_pg_base", include_str!("../migrations/V1__retinue_pg_base.sql")),
    (
        "V2__retinue_pg_budget_reservations",
        include_str!("../migrations/V2__retinue_pg_budget_reservations.sql"),
    ),
    (
        "V3__retinue_pg_retention_indexes",
        include_str!("../migrations/V3__retinue_pg_retention_indexes.sql"),
    ),
    (
        "V4__retinue_pg_tombstone_note",
        include_str!("../migrations/V4__retinue_pg_tombstone_note.sql"),
    ),
    (
        "V5__retinue_pg_budget_members",
        include_str!("../migrations/V5__retinue_pg_budget_members.sql"),
    ),
    ("V6__retinue_pg_migrated_ids", include_str!("../migrations/V6__retinue_pg_migrated_ids.sql")),
    (
        "V7__retinue_pg_usage_columns",
        include_str!("../migrations/V7__retinue_pg_usage_columns.sql"),
    ),
    (
        "V8__retinue_pg_unit_controls",
        include_str!("../migrations/V8__retinue_pg_unit_controls.sql"),
    ),
    (
        "V9__retinue_pg_live_children_by_unit",
        include_str!("../migrations/V9__retinue_pg_live_children_by_unit.sql"),
    ),
    (
        "V10__retinue_pg_change_clock",
        include_str!("../migrations/V10__retinue_pg_change_clock.sql"),
    ),
    (
        "V11__retinue_pg_live_count_stripes",
        include_str!("../migrations/V11__retinue_pg_live_count_stripes.sql"),
    ),
    ("V12__retinue_pg_approvals", include_str!("../migrations/V12__retinue_pg_approvals.sql")),
];

const SCHEMA_VERSION: i32 = MIGRATIONS.len() as i32;

/// How to open a [`PgStore`].
#[derive(Clone)]
pub struct PgOptions {
    /// The retention policy (`delegation.max_retained`, `retained_ttl_hours`).
    pub retention: RetentionPolicy,
    /// The clock of the timestamps written (dispatch, completion,
    /// retention). Never of a lease: worker leases and delivery and resume
    /// claims are taken, renewed and judged on the server's clock
    /// (`clock_timestamp()`), so a host whose clock is off neither loses its
    /// units or claims early nor keeps a dead worker's units or a lapsed
    /// claim late.
    pub clock: Arc<dyn Clock>,
    /// The tenant: new units' `owner_profile`; retention limits apply per profile.
    pub profile: String,
    /// A schema to use instead of the search path's (created if missing);
    /// `[A-Za-z0-9_]` only.
    pub schema: Option<String>,
    /// This worker's lease, in seconds ([`WORKER_LEASE_SECS`] by default).
    pub lease_secs: f64,
    /// Idle connections kept, of each kind (reads and explicit transactions
    /// on the server's default isolation; one-statement writes on
    /// connections whose default is `SERIALIZABLE`).
    pub pool_size: usize,
    /// Read only: the schema is never migrated (a read-only or DML-only
    /// role can read when it is current; when it is behind, opening says
    /// so), and no worker is registered.
    pub read_only: bool,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            retention: RetentionPolicy::default(),
            clock: Arc::new(SystemClock),
            profile: String::new(),
            schema: None,
            lease_secs: WORKER_LEASE_SECS,
            pool_size: 8,
            read_only: false,
        }
    }
}

impl std::fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOptions")
            .field("profile", &self.profile)
            .field("schema", &self.schema)
            .field("lease_secs", &self.lease_secs)
            .finish_non_exhaustive()
    }
}

impl PgOptions {
    /// These options with `clock`.
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// These options with the tenant `profile`.
    #[must_use]
    pub fn with_profile(mut self, profile: impl Into<String>) -> Self {
        self.profile = profile.into();
        self
    }

    /// These options for reading only (see [`PgOptions::read_only`]).
    #[must_use]
    pub fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// These options with a schema of their own.
    #[must_use]
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// These options with this retention policy.
    #[must_use]
    pub fn with_retention(mut self, retention: RetentionPolicy) -> Self {
        self.retention = retention;
        self
    }
}

/// The PostgreSQL-backed store: implements every seam trait of
/// `retinue-core` with the same semantics. Cheap to share behind an `Arc`.
pub struct PgStore {
    pub(crate) pool: Pool,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) retention: RetentionPolicy,
    pub(crate) profile: String,
    pub(crate) worker_id: String,
    pub(crate) lease_secs: f64,
    /// The advisory lock retries of this tenant's pruning writes queue on
    /// (see [`Pool::tx_queued`]).
    pub(crate) prune_queue: i64,
    /// The tenant was at its cap at this store's last retain: the next
    /// retain prunes, so it ranks at once (issue #41).
    pub(crate) prune_hint: AtomicBool,
    /// Retains of this store (every so many ranks, to verify the count).
    pub(crate) retains: AtomicU64,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("profile", &self.profile)
            .field("worker", &self.worker_id)
            .finish_non_exhaustive()
    }
}

/// Whether `url` names a PostgreSQL database (`postgres://` or `postgresql://`).
pub fn is_postgres_url(url: &str) -> bool {
    let u = url.trim_start();
    u.starts_with("postgres://") || u.starts_with("postgresql://")
}

/// The password for `host:port:db:user` from a `.pgpass` text (libpq's format).
fn pgpass_lookup(text: &str, host: &str, port: &str, db: &str, user: &str) -> Option<String> {
    fn fields(line: &str) -> Vec<String> {
        let mut out = vec![String::new()];
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    if let (Some(next), Some(last)) = (chars.next(), out.last_mut()) {
                        last.push(next);
                    }
                }
                ':' => out.push(String::new()),
                c => {
                    if let Some(last) = out.last_mut() {
                        last.push(c);
                    }
                }
            }
        }
        out
    }
    text.lines().filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty()).find_map(
        |line| {
            let f = fields(line);
            let ok = |i: usize, v: &str| f.get(i).is_some_and(|x| x == "*" || x == v);
            (f.len() == 5 && ok(0, host) && ok(1, port) && ok(2, db) && ok(3, user))
                .then(|| f[4].clone())
        },
    )
}

/// Parses a connection string and completes it like libpq: user from
/// `PGUSER`/`USER`, password from `PGPASSWORD` or `PGPASSFILE`/`~/.pgpass`.
/// The string is never echoed in an error (it may hold a password).
pub(crate) fn connection_config(url: &str) -> Result<Config> {
    let mut config = Config::from_str(url.trim()).map_err(|_| {
        Error::Invalid(
            "unreadable PostgreSQL connection string (postgres://user@host:port/db)".into(),
        )
    })?;
    if config.get_user().is_none() {
        let user = std::env::var("PGUSER")
            .or_else(|_| std::env::var("USER"))
            .unwrap_or_else(|_| "postgres".to_owned());
        config.user(&user);
    }
    if config.get_hosts().is_empty() {
        config.host("127.0.0.1");
    }
    if config.get_password().is_none() {
        if let Ok(pw) = std::env::var("PGPASSWORD") {
            config.password(pw);
        } else {
            let file = std::env::var_os("PGPASSFILE")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pgpass")));
            if let Some(text) = file.and_then(|f| std::fs::read_to_string(f).ok()) {
                let host = match config.get_hosts().first() {
                    Some(postgres::config::Host::Tcp(h)) => h.clone(),
                    _ => "localhost".to_owned(),
                };
                let port = config.get_ports().first().copied().unwrap_or(5432).to_string();
                let user = config.get_user().unwrap_or_default().to_owned();
                let db = config.get_dbname().unwrap_or(&user).to_owned();
                if let Some(pw) = pgpass_lookup(&text, &host, &port, &db, &user) {
                    config.password(pw);
                }
            }
        }
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(10));
    }
    config.application_name("retinue");
    Ok(config)
}

/// For a read-only open: the schema must be exactly current (nothing is
/// migrated); a clear error says what to do when it is not.
fn check_current(client: &mut postgres::Client, schema: Option<&str>) -> PgResult<()> {
    if let Some(schema) = schema {
        client.batch_execute(&format!("SET search_path TO {}", quote_ident(schema)))?;
    }
    let history = client
        .query_one("SELECT to_regclass('refinery_schema_history') IS NOT NULL", &[])?
        .try_get::<_, bool>(0)?;
    let found: Option<i32> = if history {
        client.query_one("SELECT MAX(version) FROM refinery_schema_history", &[])?.try_get(0)?
    } else {
        None
    };
    match found {
        Some(v) if v == SCHEMA_VERSION => Ok(()),
        Some(v) if v > SCHEMA_VERSION => {
            Err(Error::SchemaTooNew { found: i64::from(v), supported: i64::from(SCHEMA_VERSION) }
                .into())
        }
        found => Err(Error::Invalid(format!(
            "the PostgreSQL schema is {} and this retinue needs version {SCHEMA_VERSION}; a read \
             command never changes it: run a write command (e.g. `retinue recover`) once with a \
             role that may migrate the schema",
            found.map_or_else(|| "not created yet".to_owned(), |v| format!("at version {v}"))
        ))
        .into()),
    }
}

/// Whether the schema is exactly current, in one round trip (the simple
/// protocol: no statement to prepare on a connection that runs it once);
/// `false` on any doubt (no history table yet, another error), and the full
/// migration then decides. As the SQLite backend's open fast path, a
/// current schema is not re-validated: refinery's checks of applied
/// migrations (a changed checksum, a missing version) run when a migration
/// is due, not on every open.
fn is_current(client: &mut postgres::Client) -> bool {
    let Ok(messages) = client.simple_query("SELECT MAX(version) FROM refinery_schema_history")
    else {
        return false;
    };
    messages.iter().any(|m| match m {
        postgres::SimpleQueryMessage::Row(r) => {
            r.get(0).and_then(|v| v.parse::<i32>().ok()) == Some(SCHEMA_VERSION)
        }
        _ => false,
    })
}

fn migrate(client: &mut postgres::Client, schema: Option<&str>) -> PgResult<()> {
    // A current schema is not migrated again (the connection's search path
    // names it already): an open is then one round trip, not a dozen.
    if is_current(client) {
        return Ok(());
    }
    if let Some(schema) = schema {
        client.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {}", quote_ident(schema)))?;
        client.batch_execute(&format!("SET search_path TO {}", quote_ident(schema)))?;
    }
    let history = client
        .query_one("SELECT to_regclass('refinery_schema_history') IS NOT NULL", &[])?
        .try_get::<_, bool>(0)?;
    if history {
        let found: Option<i32> = client
            .query_one("SELECT MAX(version) FROM refinery_schema_history", &[])?
            .try_get(0)?;
        if let Some(found) = found
            && found > SCHEMA_VERSION
        {
            return Err(Error::SchemaTooNew {
                found: i64::from(found),
                supported: i64::from(SCHEMA_VERSION),
            }
            .into());
        }
    }
    let migration = |name: &str, sql: &str| {
        refinery_pg::Migration::unapplied(name, sql)
            .map_err(|e| Error::Migration { source: Box::new(e) })
    };
    let migrations =
        MIGRATIONS.iter().map(|(name, sql)| migration(name, sql)).collect::<Result<Vec<_>>>()?;
    refinery_pg::Runner::new(&migrations)
        .run(client)
        .map_err(|e| Error::Migration { source: Box::new(e) })?;
    Ok(())
}

impl PgStore {
    /// Connects to `url` (`postgres://user@host:port/db`), migrates the
    /// schema (idempotent; safe when several workers start at once) and
    /// registers this process as a worker with a fresh lease.
    pub fn open(url: &str, opts: PgOptions) -> Result<PgStore> {
        if let Some(s) = &opts.schema
            && (s.is_empty() || !s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        {
            return Err(Error::Invalid(format!("schema name `{s}` must be [A-Za-z0-9_]+")));
        }
        if !opts.lease_secs.is_finite() || opts.lease_secs <= 0.0 {
            return Err(Error::Invalid("the worker lease must be a positive number".into()));
        }
        let config = connection_config(url)?;
        let pool = Pool::new(config, opts.schema.clone(), opts.pool_size.max(1));
        if opts.read_only {
            pool.with("connecting to PostgreSQL and checking its schema", |c| {
                check_current(c, opts.schema.as_deref())
            })?;
            return PgStore::over(pool, opts);
        }
        // Workers starting together race on CREATE TABLE IF NOT EXISTS: retry.
        let mut attempt: u32 = 0;
        loop {
            attempt += 1;
            match pool.with("connecting to PostgreSQL and migrating its schema", |c| {
                migrate(c, opts.schema.as_deref())
            }) {
                Ok(()) => break,
                Err(e @ Error::SchemaTooNew { .. }) => return Err(e),
                Err(e) if attempt >= 5 => return Err(e),
                Err(e) => {
                    log::debug!("migration attempt {attempt} failed ({e}); retrying");
                    std::thread::sleep(Duration::from_millis(50 * u64::from(attempt)));
                }
            }
        }
        let store = PgStore::over(pool, opts)?;
        store.beat(Mode::Write)?;
        store.type_usage_rows()?;
        Ok(store)
    }

    /// The store over `pool` with `opts` and a fresh worker id (registered
    /// by the caller's first heartbeat, if any).
    fn over(pool: Pool, opts: PgOptions) -> Result<PgStore> {
        let queue =
            format!("retinue prune\0{}\0{}", opts.schema.as_deref().unwrap_or(""), opts.profile);
        Ok(PgStore {
            prune_queue: lock_key(&queue),
            pool,
            clock: opts.clock,
            retention: opts.retention,
            profile: opts.profile,
            worker_id: format!("w-{}", random_hex(8)?),
            lease_secs: opts.lease_secs,
            prune_hint: AtomicBool::new(false),
            retains: AtomicU64::new(0),
        })
    }

    /// This process's worker id (written to the units it dispatches).
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// The tenant profile of new units.
    pub fn profile(&self) -> &str {
        &self.profile
    }

    /// The retention policy in force.
    pub fn retention(&self) -> RetentionPolicy {
        self.retention
    }

    /// Transactions this store ran again after a serialization failure or
    /// a deadlock (SQLSTATE 40001, 40P01) since it was opened: the retries
    /// its callers never see.
    pub fn serialization_retries(&self) -> u64 {
        self.pool.retries()
    }

    /// The clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Renews this worker's lease (registering it if needed), and forgets
    /// workers whose lease lapsed more than [`FORGET_WORKERS_AFTER_SECS`]
    /// ago: to recovery and to the budget, a worker without a row is a
    /// worker whose lease lapsed, so nothing changes but the table's size.
    pub fn heartbeat(&self) -> Result<()> {
        self.beat(Mode::WriteOne)
    }

    /// [`PgStore::heartbeat`] in `mode`: at open, [`Mode::Write`] on the
    /// connection the migration left idle (no second connection just for it).
    fn beat(&self, mode: Mode) -> Result<()> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default();
        let pid = i64::from(std::process::id());
        // Every time here is the server's (`SERVER_NOW`), never this host's.
        let sql = format!(
            "WITH t AS (SELECT {SERVER_NOW} AS now), \
             gone AS (DELETE FROM retinue_workers WHERE lease_expires_at < (SELECT now FROM t) - $5 \
               AND worker_id <> $1) \
             INSERT INTO retinue_workers (worker_id, owner_profile, host, pid, started_at, \
             heartbeat_at, lease_expires_at) SELECT $1, $2, $3, $4, t.now, t.now, t.now + $6 FROM t \
             ON CONFLICT (worker_id) DO UPDATE SET heartbeat_at = EXCLUDED.heartbeat_at, \
             lease_expires_at = EXCLUDED.lease_expires_at"
        );
        self.pool.tx("renewing the worker lease", mode, |tx| {
            tx.execute(
                &sql,
                &[
                    &self.worker_id,
                    &self.profile,
                    &host,
                    &pid,
                    &FORGET_WORKERS_AFTER_SECS,
                    &self.lease_secs,
                ],
            )?;
            Ok(())
        })
    }

    /// Gives the lease up now (a clean shutdown): this worker's row is
    /// deleted, so its live units (if any) become recoverable at once — a
    /// worker without a row is one whose lease lapsed — and a short-lived
    /// process (every CLI invocation) leaves no row behind.
    pub fn retire(&self) -> Result<()> {
        self.pool.tx("retiring the worker", Mode::Write, |tx| {
            tx.execute("DELETE FROM retinue_workers WHERE worker_id = $1", &[&self.worker_id])?;
            Ok(())
        })
    }

    /// Renews the lease every third of it on a background thread, until the
    /// store is dropped.
    pub fn spawn_heartbeat(self: &Arc<Self>) -> std::thread::JoinHandle<()> {
        let weak: Weak<PgStore> = Arc::downgrade(self);
        let period = Duration::from_secs_f64((self.lease_secs / 3.0).max(0.05));
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(period);
                let Some(store) = weak.upgrade() else { return };
                if let Err(e) = store.heartbeat() {
                    log::warn!("renewing the worker lease failed: {e}");
                }
            }
        })
    }

    /// The retention limits in force now.
    pub(crate) fn limits(&self) -> Limits {
        Limits::new(self.clock.now(), self.retention)
    }

    /// Deletes everything this store holds (tests and benches on a scratch schema).
    pub fn truncate_all(&self) -> Result<()> {
        self.pool.tx("truncating", Mode::Write, |tx| {
            tx.batch_execute(
                "TRUNCATE messages, delegation_child_usage, retinue_children, async_delegations, \
                 retinue_usage_keys, retinue_usage_totals, retinue_workers, sessions, \
                 retinue_budget_reservations, retinue_profile_live",
            )?;
            Ok(())
        })?;
        self.heartbeat()
    }

    /// Drops a schema and everything in it (test clean-up).
    pub fn drop_schema(url: &str, schema: &str) -> Result<()> {
        let pool = Pool::new(connection_config(url)?, None, 1);
        pool.with("dropping a schema", |c| {
            c.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", quote_ident(schema)))?;
            Ok(())
        })
    }
}

/// Fail helper for domain errors inside transactions.
pub(crate) fn invalid(msg: &str) -> Fail {
    Fail::Store(Error::Invalid(msg.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pgpass_matches_like_libpq() {
        let text = "# comment\nother:5432:*:bob:nope\n127.0.0.1:*:retinue:alice:s3cr\\:et\n";
        assert_eq!(
            pgpass_lookup(text, "127.0.0.1", "5433", "retinue", "alice").as_deref(),
            Some("s3cr:et")
        );
        assert_eq!(pgpass_lookup(text, "127.0.0.1", "5433", "retinue", "bob"), None);
    }

    #[test]
    fn bad_urls_are_refused_without_echo() {
        let err = connection_config("postgres://u:hunter2@host:notaport/db").err();
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(is_postgres_url("postgresql://x/y") && !is_postgres_url("/tmp/state.db"));
    }
}
