//! The SQLite-backed [`Store`]: the one type implementing every seam trait
//! of this crate. Opening it runs the open sequence of [`crate::db`] and then
//! adopts hermes-retained units (the backfill).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::db::{self, StoreOptions};
use crate::error::Result;
use crate::rows::Limits;
use retinue_core::{Clock, RetentionPolicy};

/// The SQLite-backed store. Cheap to share behind an `Arc`; each operation
/// takes a pooled connection.
pub struct Store {
    pub(crate) pool: db::Pool,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) retention: RetentionPolicy,
    pub(crate) profile: String,
    pub(crate) has_system_prompt: bool,
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
        let pool = db::open_pool(path.as_ref(), &opts, crate::registry::backfill::backfill)?;
        if !opts.read_only {
            // Live units, and units another writer both retained and tombstoned
            // before Retinue adopted them: they answer tombstoned (`external`),
            // never unknown. The triggers of `retinue_adoption_queue` note every
            // unit another writer retains without child rows, so an open looks
            // at that queue only, never at the whole history.
            let unadopted = pool.query("looking for unadopted units", |conn| {
                Ok(conn
                    .prepare_cached("SELECT EXISTS (SELECT 1 FROM retinue_adoption_queue)")?
                    .query_row([], |r| r.get::<_, bool>(0))?)
            })?;
            if unadopted {
                pool.write("adopting hermes-retained units", |tx| {
                    let adopted = crate::registry::backfill::backfill(tx, Some(f64::NEG_INFINITY))?;
                    // Every queued unit is covered by that backfill.
                    tx.prepare_cached("DELETE FROM retinue_adoption_queue")?.execute([])?;
                    Ok(adopted)
                })?;
            }
        }
        let has_system_prompt = pool.with("reading the sessions columns", |conn| {
            Ok(crate::conn::column_names(conn, "sessions")?.iter().any(|c| c == "system_prompt"))
        })?;
        Ok(Store {
            pool,
            clock: opts.clock,
            retention: opts.retention,
            profile: opts.profile,
            has_system_prompt,
        })
    }

    /// Opens `path` read-only (`SQLITE_OPEN_READ_ONLY`): nothing is created,
    /// upgraded, adopted or locked for writing; a missing file is
    /// [`retinue_core::Error::Missing`]. Reads answer as they would after a write
    /// adopted the file: units another writer retained are read from their
    /// `children_json` on the fly (a per-connection snapshot taken at
    /// connect, in memory). Writes through this store fail `ReadOnly`.
    pub fn open_read_only(path: impl AsRef<Path>, opts: StoreOptions) -> Result<Store> {
        Store::open(path, StoreOptions { read_only: true, ..opts })
    }

    /// The database file.
    pub fn path(&self) -> PathBuf {
        self.pool.path().to_path_buf()
    }

    /// How many times this store's connections found the database locked
    /// by another process and waited (busy-handler calls) since it was
    /// opened. Writers of one process never wait there: they queue in the
    /// file's writer gate first.
    pub fn busy_probes(&self) -> u64 {
        self.pool.busy_probes()
    }

    /// The retention policy in force.
    pub fn retention(&self) -> RetentionPolicy {
        self.retention
    }

    /// The profile key written to new units.
    pub fn profile(&self) -> &str {
        &self.profile
    }

    /// The clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The retention limits in force now.
    pub(crate) fn limits(&self) -> Limits {
        Limits::new(self.clock.now(), self.retention)
    }

    /// `PRAGMA integrity_check` result (`"ok"` when healthy).
    pub fn integrity_check(&self) -> Result<String> {
        self.pool.with("checking integrity", |conn| {
            let mut stmt = conn.prepare("PRAGMA integrity_check")?;
            let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?.join("\n"))
        })
    }

    /// The schema as `type name sql` lines (for snapshots and audits).
    pub fn schema_dump(&self) -> Result<String> {
        self.pool.with("dumping the schema", |conn| {
            Ok(db::schema_sql(conn)?
                .into_iter()
                .map(|(t, n, sql)| format!("-- {t} {n}\n{sql}\n"))
                .collect::<String>())
        })
    }
}
