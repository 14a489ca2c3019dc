//! Opening `state.db`: pragmas, the in-place upgrade of hermes files
//! (reconcile, then refinery), backfill, and the connection pool.
//!
//! # Migration history
//!
//! The schema is refinery's `migrations/V<n>__<name>.sql`, embedded at build
//! time (`embed_migrations!`) and run as one group after the reconcile step
//! has added the columns an older hermes file lacks. The schema version is
//! the highest embedded version; a file whose `refinery_schema_history`
//! names a higher one is refused. The files are append-only, and additive
//! for hermes: every statement is idempotent (`IF NOT EXISTS`) because
//! hermes-agent creates the same tables, and nothing of hermes's is renamed,
//! dropped or rebuilt (only Retinue's own indexes are ever replaced).
//!
//! - **V1** `retinue_base`: hermes's tables as hermes creates them
//!   (`sessions`, `messages`, `async_delegations`, `delegation_child_usage`)
//!   with their indexes, plus Retinue's `retinue_children` (one row per
//!   child: manifest, TTL clock, tombstone, resume claim),
//!   `retinue_usage_keys` (the ledger's idempotency keys) and
//!   `retinue_usage_totals` (maintained totals per parent, up to `covered_id`).
//! - **V2** `retinue_history_index`: a partial index of the non-retained
//!   terminal units, the only rows the history pruner reads (semantics §3.6).
//! - **V3** `retinue_totals_triggers`: triggers on `delegation_child_usage`
//!   that drop a parent's maintained totals when a row they cover is
//!   inserted, updated or deleted, whoever writes it; totals cached before
//!   are dropped once.
//! - **V4** `retinue_budget_reservations`: the reservations of
//!   `delegation.budget`, with an index of the open ones per lineage root.
//! - **V5** `retinue_unit_tombstones`: a TTL or cap prune of a whole unit
//!   writes the unit's `tombstoned_at` (as hermes does) and one row here
//!   that covers its children, instead of one row per child; an index of
//!   each unit's live children; the rank index gains the unit id and
//!   replaces V1's.
//! - **V6** `retinue_adoption_queue`: triggers queue the units another
//!   writer retains without Retinue's child rows, so an open adopts
//!   (backfills) only when the queue is not empty; what was unadopted at the
//!   upgrade is queued once.
//! - **V7** `retinue_profile_rank`: the rank index leads with
//!   `COALESCE(owner_profile, '')` after the liveness columns, so the cap
//!   ranks each profile's units among themselves (issue #17); replaces V5's.
//! - **V8** `retinue_budget_members`: each child session's budget root
//!   (first write wins), so nested spawns and follow-ups draw on one budget
//!   (issue #23).
//! - **V9** `retinue_unit_clock`: the trigger `retinue_unit_clock_moved`
//!   moves a unit's live children's TTL clocks with the unit's when another
//!   program moves it; Retinue's own writes of the unit clock hold a row of
//!   `retinue_clock_guard` inside their transaction, so the trigger leaves
//!   their per-child clocks alone (issue #22).
//! - **V10** `retinue_usage_columns`: each ledger row's usage in typed
//!   columns (the rule of `retinue_core::UsageColumns`), kept by triggers on
//!   `delegation_child_usage` so rows hermes writes are typed too; "spent"
//!   is one aggregate (issue #25).
//! - **V11** `retinue_unit_controls`: the control mailbox of background
//!   units (`steer`, `cancel`; outcomes `pending`, `taken`, `delivered`,
//!   `missed`), a partial index of the pending rows, and a trigger that
//!   deletes a unit's controls with the unit (issue #26).
//! - **V12** `retinue_change_clock`: one counter, bumped by triggers on
//!   `async_delegations` and `retinue_children` (claims excepted), that
//!   with the newest message id is the web view's change marker (issue #35).
//! - **V13** `retinue_approvals`: the approval queue (issue #37), expired
//!   by a trigger when its unit ends, deleted with it.
//!
//! Two columns of Retinue's own tables are added by the reconcile step after
//! the migrations rather than in SQL (SQLite cannot add a column
//! idempotently): `retinue_children.tombstone_note` and
//! `retinue_budget_reservations.kept_spent_at`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior, params};

use crate::conn::{Adopt, RECONCILE, RECONCILE_AFTER, column_names, set_connection_pragmas};
use crate::error::{Error, Result, SqlResult, is_retryable, migration, sql};
use crate::gate::{WriterGate, busy_handler};
use retinue_core::{Clock, SystemClock};
use retinue_core::{JournalMode, RetentionPolicy, Synchronous};
use retinue_core::{RetainedChild, SessionRow};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Highest migration version this binary embeds (read from the embedded
/// migrations, so adding a migration file is all it takes).
pub(crate) fn schema_version() -> i64 {
    embedded::migrations::runner()
        .get_migrations()
        .iter()
        .map(|m| i64::from(m.version()))
        .max()
        .unwrap_or(0)
}

const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";

/// How to open a [`crate::Store`].
#[derive(Clone)]
pub struct StoreOptions {
    /// The retention policy (`delegation.max_retained`, `retained_ttl_hours`).
    pub retention: RetentionPolicy,
    /// The journal mode (`database.journal_mode`): WAL by default.
    pub journal_mode: JournalMode,
    /// Commit durability (`database.synchronous`): FULL by default.
    pub synchronous: Synchronous,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// The process profile key written to `owner_profile`.
    pub profile: String,
    /// Busy timeout for every connection (10 s by default;
    /// `database.busy_timeout_seconds` in the configuration).
    pub busy_timeout: Duration,
    /// Open `mode=ro`: no directory or file creation, no journal-mode
    /// switch, no upgrade, no backfill, no write lock (see
    /// [`crate::Store::open_read_only`]).
    pub read_only: bool,
    /// Create a missing file (and its directory) when opening for writing.
    /// When `false`, a missing file is [`Error::Missing`] and nothing is created.
    pub create_missing: bool,
}

impl std::fmt::Debug for StoreOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreOptions")
            .field("profile", &self.profile)
            .field("busy_timeout", &self.busy_timeout)
            .field("read_only", &self.read_only)
            .field("create_missing", &self.create_missing)
            .finish_non_exhaustive()
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            retention: RetentionPolicy::default(),
            journal_mode: JournalMode::default(),
            synchronous: Synchronous::default(),
            clock: Arc::new(SystemClock),
            profile: String::new(),
            busy_timeout: Duration::from_secs(10),
            read_only: false,
            create_missing: true,
        }
    }
}

impl StoreOptions {
    /// Options with this clock.
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Options with this profile key.
    #[must_use]
    pub fn with_profile(mut self, profile: impl Into<String>) -> Self {
        self.profile = profile.into();
        self
    }

    /// Options with this retention policy.
    #[must_use]
    pub fn with_retention(mut self, retention: RetentionPolicy) -> Self {
        self.retention = retention;
        self
    }
}

/// A small pool: `Connection` is `Send` but not `Sync`, so each operation
/// takes one connection and gives it back; the mutex guards only the pool.
pub(crate) struct Pool {
    path: PathBuf,
    read_only: bool,
    busy_timeout: Duration,
    synchronous: Synchronous,
    idle: Mutex<Vec<Pooled>>,
    /// This file's writers in this process queue here before `BEGIN
    /// IMMEDIATE` (see [`crate::gate`]).
    gate: Arc<WriterGate>,
    /// Busy-handler calls of this pool's connections (another process held
    /// the lock): [`crate::Store::busy_probes`].
    probes: Arc<AtomicU64>,
    adopt: Adopt,
}

/// A pooled connection and what it has read that is provably still fresh.
struct Pooled {
    conn: Connection,
    cache: ConnCache,
}

/// Most neighbourhoods one connection keeps (then it starts afresh).
const CACHED_NEIGHBOURHOODS: usize = 64;

/// Reads a connection may answer again without reading the file: valid only
/// while nothing has changed the database since they were read. The stamp
/// is `PRAGMA data_version` (changes whenever *another* connection, in this
/// process or any other, commits) and the connection's own
/// `total_changes()` (its own inserts, updates and deletes), both taken
/// *before* the cached read; the cache is also dropped whenever the
/// connection is used for anything but a read. So an entry is only ever
/// returned when no commit at all happened since before it was read.
#[derive(Default)]
pub(crate) struct ConnCache {
    stamp: Option<(i64, u64)>,
    neighbourhoods: HashMap<(String, usize), Vec<SessionRow>>,
    list: Option<CachedList>,
}

/// The addressable list as read at one TTL cutoff. Without a commit, time
/// alone changes it only when a listed child's TTL clock passes the cutoff
/// (a unit not listed enters only when a listed one leaves, and no child
/// comes back into its TTL while the cutoff grows): it is the answer again
/// for any later cutoff up to the oldest listed child's clock.
struct CachedList {
    cutoff: f64,
    max_retained: u32,
    oldest: f64,
    rows: Vec<RetainedChild>,
}

impl ConnCache {
    /// Drops every entry unless the database is unchanged since the stamp;
    /// restamps. Call before any cached read or fill.
    pub(crate) fn validate(&mut self, conn: &Connection) -> SqlResult<()> {
        let version: i64 =
            conn.prepare_cached("PRAGMA data_version")?.query_row([], |r| r.get(0))?;
        let stamp = (version, conn.total_changes());
        if self.stamp != Some(stamp) {
            self.clear();
            self.stamp = Some(stamp);
        }
        Ok(())
    }

    fn clear(&mut self) {
        self.stamp = None;
        self.neighbourhoods.clear();
        self.list = None;
    }

    /// The cached list, if it is the answer at `cutoff` with `max_retained`.
    pub(crate) fn list(&self, cutoff: f64, max_retained: u32) -> Option<&Vec<RetainedChild>> {
        self.list
            .as_ref()
            .filter(|l| l.max_retained == max_retained && cutoff >= l.cutoff && cutoff <= l.oldest)
            .map(|l| &l.rows)
    }

    /// Keeps a list read at `cutoff` after [`ConnCache::validate`].
    pub(crate) fn keep_list(&mut self, cutoff: f64, max_retained: u32, rows: &[RetainedChild]) {
        // Every listed child is within the TTL, so has a clock; one without
        // would make the entry unusable, never wrong.
        let oldest = rows
            .iter()
            .map(|r| r.retained_at.unwrap_or(f64::NEG_INFINITY))
            .fold(f64::INFINITY, f64::min);
        self.list = Some(CachedList { cutoff, max_retained, oldest, rows: rows.to_vec() });
    }

    /// The cached neighbourhood of (`id`, `max_hops`), if any.
    pub(crate) fn neighbourhood(&self, id: &str, max_hops: usize) -> Option<&Vec<SessionRow>> {
        self.neighbourhoods.get(&(id.to_owned(), max_hops))
    }

    /// Keeps a neighbourhood read after [`ConnCache::validate`].
    pub(crate) fn keep_neighbourhood(&mut self, id: &str, max_hops: usize, rows: Vec<SessionRow>) {
        if self.neighbourhoods.len() >= CACHED_NEIGHBOURHOODS {
            self.neighbourhoods.clear();
        }
        self.neighbourhoods.insert((id.to_owned(), max_hops), rows);
    }
}

impl Pool {
    fn connect(&self) -> Result<Connection> {
        self.connect_raw().map_err(|e| e.during("opening a connection"))
    }

    fn connect_raw(&self) -> SqlResult<Connection> {
        if self.read_only {
            return crate::read_view::connect_read_only(&self.path, self.busy_timeout, self.adopt);
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let mut conn = Connection::open_with_flags(&self.path, flags)?;
        let probes = self.probes.clone();
        set_connection_pragmas(&mut conn, self.busy_timeout, probes, self.synchronous, false)?;
        Ok(conn)
    }

    /// Runs `f` on a pooled connection; a failure names `op`. The
    /// connection's read cache is dropped (`f` may write).
    pub(crate) fn with<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut Connection) -> SqlResult<T>,
    ) -> Result<T> {
        self.run(op, |p| {
            p.cache.clear();
            f(&mut p.conn)
        })
    }

    /// Runs a read `f` on a pooled connection with its read cache (see
    /// [`ConnCache`]); `f` must not write.
    pub(crate) fn cached<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Connection, &mut ConnCache) -> SqlResult<T>,
    ) -> Result<T> {
        self.run(op, |p| f(&p.conn, &mut p.cache))
    }

    fn run<T>(&self, op: &'static str, f: impl FnOnce(&mut Pooled) -> SqlResult<T>) -> Result<T> {
        let taken = self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let mut pooled = match taken {
            Some(c) => c,
            None => Pooled { conn: self.connect()?, cache: ConnCache::default() },
        };
        let started = Instant::now();
        let out = f(&mut pooled)
            .map_err(|e| e.during(op))
            .map_err(|e| with_wait(e, started, self.busy_timeout));
        // A connection left inside a transaction (it should never be) is dropped.
        if pooled.conn.is_autocommit() {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            if idle.len() < 8 {
                idle.push(pooled);
            }
        }
        out
    }

    /// Runs `f` inside one `BEGIN IMMEDIATE` transaction, after this
    /// writer's turn at the file's [`WriterGate`]; a failure names `op`.
    pub(crate) fn write<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&rusqlite::Transaction<'_>) -> SqlResult<T>,
    ) -> Result<T> {
        let started = Instant::now();
        let _turn = self.gate.enter(self.busy_timeout).map_err(|e| {
            let (waited_ms, timeout_ms) = (e.waited_ms, self.busy_timeout_ms());
            Error::Busy { operation: op, waited_ms, timeout_ms, source: Box::new(e) }
        })?;
        // The busy timeout covers the queue and the lock together; a wait
        // in the queue under 1% of it is not worth re-arming the handler.
        let queued = started.elapsed();
        let left = self.busy_timeout.saturating_sub(queued);
        self.with(op, |conn| {
            let shortened = queued > self.busy_timeout / 100;
            if shortened {
                conn.busy_handler(Some(busy_handler(left, self.probes.clone())))?;
            }
            let out = (|| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let out = f(&tx)?;
                tx.commit()?;
                Ok(out)
            })();
            if shortened {
                conn.busy_handler(Some(busy_handler(self.busy_timeout, self.probes.clone())))?;
            }
            out
        })
        // A busy failure reports the whole wait: the queue and the lock.
        .map_err(|e| with_wait(e, started, self.busy_timeout))
    }

    fn busy_timeout_ms(&self) -> u64 {
        u64::try_from(self.busy_timeout.as_millis()).unwrap_or(u64::MAX)
    }

    /// Runs a single-statement read `f` (atomic on its own: no explicit transaction).
    pub(crate) fn query<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Connection) -> SqlResult<T>,
    ) -> Result<T> {
        self.run(op, |p| f(&p.conn))
    }

    /// Runs `f` inside one deferred (read) transaction.
    /// (`BEGIN`/`COMMIT` are cached statements: no parse per read.)
    pub(crate) fn read<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Connection) -> SqlResult<T>,
    ) -> Result<T> {
        self.run(op, |p| {
            let conn = &p.conn;
            conn.prepare_cached("BEGIN DEFERRED")?.execute([])?;
            let out = f(conn);
            // A read transaction has nothing to keep: end it either way.
            let end = conn.prepare_cached("COMMIT").and_then(|mut s| s.execute([]));
            let out = out?;
            end?;
            Ok(out)
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Busy-handler calls of this pool's connections.
    pub(crate) fn busy_probes(&self) -> u64 {
        self.probes.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Refuses files that are not SQLite databases without touching them.
fn check_header(path: &Path) -> Result<()> {
    use std::io::Read;
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(Error::Io { path: path.to_path_buf(), source }),
    };
    let len = file.metadata().map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    if len.len() == 0 {
        return Ok(());
    }
    let mut head = [0u8; 16];
    let complete = len.len() >= 100 && file.read_exact(&mut head).is_ok();
    if !complete || &head != SQLITE_MAGIC {
        return Err(Error::NotADatabase { path: path.to_path_buf() });
    }
    Ok(())
}

fn table_exists(conn: &Connection, name: &str) -> SqlResult<bool> {
    Ok(conn
        .query_row("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?1", [name], |_| Ok(()))
        .optional()?
        .is_some())
}

fn check_not_newer(conn: &Connection) -> Result<()> {
    const OP: &str = "reading the schema version";
    if !table_exists(conn, "refinery_schema_history").map_err(|e| e.during(OP))? {
        return Ok(());
    }
    let found: Option<i64> = conn
        .query_row("SELECT MAX(version) FROM refinery_schema_history", [], |r| r.get(0))
        .map_err(sql(OP))?;
    match found {
        Some(v) if v > schema_version() => {
            Err(Error::SchemaTooNew { found: v, supported: schema_version() })
        }
        _ => Ok(()),
    }
}

fn reconcile(conn: &mut Connection) -> Result<()> {
    reconcile_in(conn, RECONCILE).map_err(|e| e.during("adding missing hermes columns"))
}

fn reconcile_in(conn: &mut Connection, list: &[(&str, &[(&str, &str)])]) -> SqlResult<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    for (table, columns) in list {
        if !table_exists(&tx, table)? {
            continue;
        }
        let present = column_names(&tx, table)?;
        for (name, decl) in *columns {
            if !present.iter().any(|p| p.eq_ignore_ascii_case(name)) {
                // Identifiers come from the constant table above, never from input.
                tx.execute_batch(&format!("ALTER TABLE \"{table}\" ADD COLUMN \"{name}\" {decl}"))?;
            }
        }
    }
    tx.commit()?;
    Ok(())
}

fn migrate(conn: &mut Connection) -> Result<()> {
    embedded::migrations::runner().set_grouped(true).run(conn).map_err(migration)?;
    Ok(())
}

/// What is at `path`: `Ok(false)` when nothing, `Ok(true)` for a regular
/// file; a directory, FIFO, socket or device is refused at once, without
/// opening it (opening a FIFO would block).
pub(crate) fn check_path(path: &Path) -> Result<bool> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(source) => return Err(Error::Io { path: path.to_path_buf(), source }),
    };
    let ft = meta.file_type();
    if ft.is_file() {
        return Ok(true);
    }
    let what = if ft.is_dir() { "directory" } else { special_kind(&ft) };
    Err(Error::NotAFile { path: path.to_path_buf(), what })
}

#[cfg(unix)]
fn special_kind(ft: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_fifo() {
        "FIFO (named pipe)"
    } else if ft.is_socket() {
        "socket"
    } else if ft.is_char_device() {
        "character device"
    } else if ft.is_block_device() {
        "block device"
    } else {
        "special file"
    }
}

#[cfg(not(unix))]
fn special_kind(_ft: &std::fs::FileType) -> &'static str {
    "special file"
}

/// Refuses a SQLite file that has tables but neither hermes' tables
/// (`sessions`, or the delegation tables hermes's `async_delegation` module
/// creates before any `SessionDB` exists) nor Retinue's own: Retinue adopts
/// only files that are hermes' or its own.
/// The migration history table counts as Retinue's: a concurrent first open
/// creates it (refinery does, before its one migration transaction) a moment
/// before the rest of the schema.
fn check_ours(conn: &Connection, path: &Path) -> Result<()> {
    const OP: &str = "reading the schema";
    let tables: i64 = conn
        .query_row(
            "SELECT count(*) FROM main.sqlite_master WHERE type = 'table' \
             AND name NOT LIKE 'sqlite_%'",
            [],
            |r| r.get(0),
        )
        .map_err(sql(OP))?;
    if tables == 0 {
        return Ok(());
    }
    let ours: bool = conn
        .query_row(
            "SELECT EXISTS (SELECT 1 FROM main.sqlite_master WHERE type = 'table' \
             AND (name = 'sessions' OR name = 'refinery_schema_history' \
                  OR name = 'async_delegations' OR name = 'delegation_child_usage' \
                  OR name LIKE 'retinue\\_%' ESCAPE '\\'))",
            [],
            |r| r.get(0),
        )
        .map_err(sql(OP))?;
    if ours { Ok(()) } else { Err(Error::Foreign { path: path.to_path_buf() }) }
}

/// `PRAGMA quick_check`, run before any schema change: a damaged file is
/// refused (left byte-identical) instead of being written.
///
/// SQLite's check also runs the integrity check of virtual tables (hermes's
/// FTS5 `messages_fts*` indexes). Their complaints ("malformed inverted
/// index for FTS5 table main.messages_fts_trigram") say a derived search
/// index disagrees with its content — hermes's to rebuild, not damage to the
/// file's pages or to any table Retinue reads — so they are logged, not fatal.
fn check_intact(conn: &Connection) -> Result<()> {
    const OP: &str = "checking the file before changing its schema";
    let mut stmt = conn.prepare("PRAGMA quick_check").map_err(sql(OP))?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0)).map_err(sql(OP))?;
    let lines = rows.collect::<rusqlite::Result<Vec<_>>>().map_err(sql(OP))?;
    if lines.len() == 1 && lines[0] == "ok" {
        return Ok(());
    }
    let mut vt = conn
        .prepare(
            "SELECT name FROM sqlite_master WHERE type = 'table' \
             AND upper(sql) LIKE 'CREATE VIRTUAL TABLE%'",
        )
        .map_err(sql(OP))?;
    let virtual_tables = vt
        .query_map([], |r| r.get::<_, String>(0))
        .map_err(sql(OP))?
        .collect::<rusqlite::Result<Vec<_>>>()
        .map_err(sql(OP))?;
    let about_virtual = |line: &str| {
        virtual_tables.iter().any(|t| line.ends_with(&format!("main.{t}")) || line.ends_with(t))
    };
    let (derived, damage): (Vec<&String>, Vec<&String>) =
        lines.iter().partition(|l| about_virtual(l));
    for line in &derived {
        log::warn!("a virtual table's own index check failed (left to its owner): {line}");
    }
    if damage.is_empty() {
        return Ok(());
    }
    let text: Vec<&str> = damage.iter().map(|s| s.as_str()).collect();
    Err(Error::Corrupt { operation: OP, source: text.join("; ").into() })
}

/// Whether the open sequence would change the schema: a missing column,
/// a missing Retinue table or a pending migration.
fn needs_upgrade(conn: &Connection) -> SqlResult<bool> {
    for (table, columns) in RECONCILE.iter().chain(RECONCILE_AFTER) {
        if !table_exists(conn, table)? {
            return Ok(true);
        }
        let present = column_names(conn, table)?;
        if columns.iter().any(|(name, _)| !present.iter().any(|p| p.eq_ignore_ascii_case(name))) {
            return Ok(true);
        }
    }
    if !table_exists(conn, "refinery_schema_history")? {
        return Ok(true);
    }
    let v: Option<i64> =
        conn.query_row("SELECT MAX(version) FROM refinery_schema_history", [], |r| r.get(0))?;
    Ok(v.is_none_or(|v| v < schema_version()))
}

/// A busy error (also a migration that failed on a busy or locked
/// database) with the time actually waited since `started` and the busy
/// timeout in force, so the message and the configuration agree.
fn with_wait(e: Error, started: Instant, timeout: Duration) -> Error {
    let waited_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    match crate::error::busy_migration(e) {
        Error::Busy { operation, source, .. } => {
            Error::Busy { operation, waited_ms, timeout_ms, source }
        }
        other => other,
    }
}

/// Opens (creating and upgrading when writable) the database at `path`.
/// A busy error anywhere in the open sequence reports the whole time waited
/// since the open began.
pub(crate) fn open_pool(path: &Path, opts: &StoreOptions, adopt: Adopt) -> Result<Pool> {
    let started = Instant::now();
    let timeout = opts.busy_timeout;
    open_pool_timed(path, opts, adopt, started, timeout).map_err(|e| with_wait(e, started, timeout))
}

fn open_pool_timed(
    path: &Path,
    opts: &StoreOptions,
    adopt: Adopt,
    started: Instant,
    timeout: Duration,
) -> Result<Pool> {
    let exists = check_path(path)?;
    if !exists && (opts.read_only || !opts.create_missing) {
        return Err(Error::Missing { path: path.to_path_buf() });
    }
    check_header(path)?;
    if !opts.read_only
        && let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
    {
        std::fs::create_dir_all(dir)
            .map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
    }
    let pool = Pool {
        path: path.to_path_buf(),
        read_only: opts.read_only,
        busy_timeout: timeout,
        synchronous: opts.synchronous,
        idle: Mutex::new(Vec::new()),
        gate: crate::gate::gate_for(path),
        probes: Arc::default(),
        adopt,
    };
    let mut conn = pool.connect()?;
    // Read-only probes first: a corrupt, foreign or newer file is refused untouched.
    conn.query_row("SELECT count(*) FROM main.sqlite_master", [], |r| r.get::<_, i64>(0))
        .map_err(sql("reading the schema"))?;
    check_ours(&conn, path)?;
    check_not_newer(&conn)?;
    if opts.read_only {
        pool.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Pooled { conn, cache: ConnCache::default() });
        return Ok(pool);
    }
    // Before the first schema change or journal switch, the file must be intact.
    let journal: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .map_err(sql("reading the journal mode"))?;
    let wal_wanted = opts.journal_mode == JournalMode::Wal;
    let switch = wal_wanted && !journal.eq_ignore_ascii_case("wal");
    // A file whose schema is current (every table and column, the newest
    // migration recorded) needs neither the reconciling transactions nor
    // the migration runner: the common open reads and writes nothing else.
    let current = exists && !needs_upgrade(&conn).map_err(|e| e.during("reading the schema"))?;
    if exists && (switch || !current) {
        check_intact(&conn)?;
    }
    set_journal_mode(&conn, opts.journal_mode).map_err(|e| e.during("setting the journal mode"))?;
    let mut attempt = 0;
    if !current {
        loop {
            let step = reconcile(&mut conn).and_then(|()| migrate(&mut conn)).and_then(|()| {
                reconcile_in(&mut conn, RECONCILE_AFTER)
                    .map_err(|e| e.during("adding missing retinue columns"))
            });
            match step {
                Ok(()) => break,
                // A busy that already waited out the timeout is final: retrying
                // would multiply the wait past what the configuration promises.
                // Early busies (SQLite's deadlock avoidance) and races are retried.
                Err(e) if attempt < 3 && is_retryable(&e) && started.elapsed() < timeout => {
                    attempt += 1;
                    std::thread::sleep(Duration::from_millis(20 * attempt));
                    check_not_newer(&conn)?;
                }
                Err(e) => return Err(e),
            }
        }
    }
    pool.idle
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(Pooled { conn, cache: ConnCache::default() });
    Ok(pool)
}

fn set_journal_mode(conn: &Connection, wanted: JournalMode) -> SqlResult<()> {
    let current: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
    let current = current.to_ascii_lowercase();
    if current == "wal" || current == "memory" {
        // Never downgrade a WAL file: other processes may rely on it.
        return Ok(());
    }
    let target = match wanted {
        JournalMode::Wal => "WAL",
        JournalMode::Delete => "DELETE",
    };
    let got: rusqlite::Result<String> =
        conn.pragma_update_and_check(None, "journal_mode", target, |r| r.get(0));
    match got {
        Ok(mode) if mode.eq_ignore_ascii_case(target) => Ok(()),
        Ok(mode) => {
            log::warn!("journal_mode {target} unavailable (got {mode}); continuing");
            Ok(())
        }
        Err(e) => {
            log::warn!("journal_mode {target} failed ({e}); falling back to DELETE");
            conn.pragma_update(None, "journal_mode", "DELETE")?;
            Ok(())
        }
    }
}

pub(crate) use retinue_core::random_hex;

/// The `sqlite_master` rows of the schema, for snapshots and checks.
pub(crate) fn schema_sql(conn: &Connection) -> SqlResult<Vec<(String, String, String)>> {
    let mut stmt = conn.prepare(
        "SELECT type, name, COALESCE(sql, '') FROM sqlite_master \
         WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name",
    )?;
    let rows = stmt.query_map(params![], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
}
