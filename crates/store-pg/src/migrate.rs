//! `retinue migrate --to postgres://…`: copies a hermes `state.db`'s
//! registry, sessions, transcripts and ledger into PostgreSQL.
//!
//! The SQLite file is opened read-only (hermes keeps using it). A rerun
//! copies what is new and carries every later change (issue #22): a unit
//! changed in the source since (newer `updated_at`) takes the source's
//! state, tombstones are always carried (never undone), a session's end and
//! counts move forward. Transcript and ledger rows keep their ids when those
//! are free in the target; an id the target already uses for another row (a
//! team-mode write since the last run) gets a fresh one, recorded in
//! `retinue_migrated_ids` per source file, so ids never collide and a rerun
//! recognises what it copied. Then every source row is checked in the
//! target (its key or mapped id, its owner row, its tombstone) and the
//! ledger sums are compared: the report is only produced when all of that
//! holds. A column the file lacks (older hermes) copies as NULL. This is
//! read by the SQLite backend (`retinue_store::StateDbReader`, through
//! [`StateReader`]); this crate never links SQLite.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use postgres::types::ToSql;
use retinue_core::{Cell as Val, CellType as Ty, Error, Result, StateReader, TableSpec as Table};

use crate::pool::{Fail, Mode, PgResult, Tx};
use crate::store::PgStore;

use retinue_core::CellType::{Bytes, Float, Int, Text};

const TABLES: &[Table] = &[
    Table {
        name: "sessions",
        cols: &[
            ("id", Text),
            ("source", Text),
            ("model", Text),
            ("model_config", Text),
            ("started_at", Float),
            ("ended_at", Float),
            ("end_reason", Text),
            ("message_count", Int),
            ("tool_call_count", Int),
            ("profile_name", Text),
            ("estimated_cost_usd", Float),
            ("cost_status", Text),
            ("cost_source", Text),
            ("system_prompt", Text),
        ],
        key: 1,
    },
    Table {
        name: "messages",
        cols: &[
            ("id", Int),
            ("session_id", Text),
            ("role", Text),
            ("content", Bytes),
            ("timestamp", Float),
            ("active", Int),
            ("tool_call_id", Text),
            ("tool_calls", Text),
            ("tool_name", Text),
            ("token_count", Int),
            ("finish_reason", Text),
        ],
        key: 2,
    },
    Table {
        name: "async_delegations",
        cols: &[
            ("delegation_id", Text),
            ("origin_session", Text),
            ("origin_ui_session_id", Text),
            ("parent_session_id", Text),
            ("state", Text),
            ("dispatched_at", Float),
            ("completed_at", Float),
            ("updated_at", Float),
            ("event_json", Text),
            ("result_json", Text),
            ("delivery_state", Text),
            ("delivery_attempts", Int),
            ("delivered_at", Float),
            ("owner_pid", Int),
            ("owner_started_at", Int),
            ("task_json", Text),
            ("delivery_claim", Text),
            ("delivery_claimed_at", Float),
            ("origin_session_id", Text),
            ("child_session_id", Text),
            ("children_json", Text),
            ("retained", Int),
            ("retained_at", Float),
            ("tombstoned_at", Float),
            ("owner_profile", Text),
            ("usage_json", Text),
        ],
        key: 1,
    },
    Table {
        name: "retinue_children",
        cols: &[
            ("delegation_id", Text),
            ("child_index", Int),
            ("subagent_id", Text),
            ("child_session_id", Text),
            ("model", Text),
            ("provider", Text),
            ("goal", Text),
            ("manifest_json", Text),
            ("retained_at", Float),
            ("tombstoned_at", Float),
            ("tombstone_reason", Text),
            ("resume_claim", Text),
            ("resume_claimed_at", Float),
            ("tombstone_note", Text),
        ],
        key: 2,
    },
    Table {
        name: "delegation_child_usage",
        cols: &[
            ("id", Int),
            ("parent_session_id", Text),
            ("parent_turn_id", Text),
            ("child_session_id", Text),
            ("usage_json", Text),
            ("aggregate_json", Text),
            ("created_at", Float),
        ],
        key: 2,
    },
    Table {
        // The budget trees (issue #23): a migrated child's nested spawns and
        // follow-ups keep drawing on its tree's budget.
        name: "retinue_budget_members",
        cols: &[("session_id", Text), ("budget_root", Text)],
        key: 1,
    },
    Table {
        name: "retinue_usage_keys",
        cols: &[("attribution_key", Text), ("usage_id", Int), ("created_at", Float)],
        key: 1,
    },
    Table {
        name: "retinue_usage_totals",
        cols: &[
            ("parent_session_id", Text),
            ("cost_usd", Float),
            ("input_tokens", Float),
            ("output_tokens", Float),
            ("covered_id", Int),
        ],
        key: 1,
    },
];

/// What one migration copied and verified.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MigrationReport {
    /// Per table: (rows in the source, rows newly copied).
    pub tables: BTreeMap<String, (usize, usize)>,
    /// Per table: rows the target had whose later changes were carried over.
    pub updated: BTreeMap<String, usize>,
    /// Transcript and ledger rows given a fresh id (theirs was taken).
    pub remapped: usize,
    /// Session parent links dropped because the parent row does not exist.
    pub dangling_parents: usize,
    /// Sum of the ledger's maintained cost totals (source = target, verified).
    pub ledger_cost_usd: f64,
    /// The source's host-path profile key (hermes's: the canonical path of
    /// the state.db's home) whose units were re-keyed to this store's
    /// explicit profile, and how many units carried it (`None`: no re-key,
    /// this store has no profile).
    pub rekeyed: Option<(String, usize)>,
}

/// Binding a value in transit to a PostgreSQL parameter.
trait Bind {
    fn sql(&self) -> &(dyn ToSql + Sync);
}

impl Bind for Val {
    fn sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            Val::Text(v) => v,
            Val::Float(v) => v,
            Val::Int(v) => v,
            Val::Bytes(v) => v,
        }
    }
}

/// The PostgreSQL type a [`Ty`] binds as.
fn pg_type(ty: Ty) -> &'static str {
    match ty {
        Ty::Text => "text",
        Ty::Float => "float8",
        Ty::Int => "bigint",
        Ty::Bytes => "bytea",
    }
}

/// The target's defaults of `table`'s NOT NULL columns (catalog text of our own schema).
fn not_null_defaults(tx: &mut Tx<'_>, table: &Table) -> PgResult<BTreeMap<String, String>> {
    tx.query(
        "SELECT column_name::text, column_default::text FROM information_schema.columns \
         WHERE table_schema = current_schema() AND table_name = $1 \
         AND is_nullable = 'NO' AND column_default IS NOT NULL",
        &[&table.name],
    )?
    .iter()
    .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
    .collect::<PgResult<_>>()
}

/// The value placeholders of `cols` (numbered from `first`): a NULL where
/// the target column is `NOT NULL` with a default takes that default.
fn marks(cols: &[(&str, Ty)], first: usize, defaults: &BTreeMap<String, String>) -> Vec<String> {
    cols.iter()
        .enumerate()
        .map(|(i, (c, ty))| match defaults.get(*c) {
            Some(default) => format!("COALESCE(${}::{}, {default})", i + first, pg_type(*ty)),
            None => format!("${}::{}", i + first, pg_type(*ty)),
        })
        .collect()
}

/// What a rerun carries into a row the target already has (`t` the
/// target's row, `EXCLUDED` the source's): `None` keeps the target's row.
fn carried(table: &str) -> Option<(&'static str, Vec<(&'static str, &'static str)>)> {
    const NEWER: &str = "EXCLUDED.updated_at > t.updated_at";
    match table {
        "sessions" => Some((
            "id",
            vec![
                ("ended_at", "COALESCE(t.ended_at, EXCLUDED.ended_at)"),
                ("end_reason", "COALESCE(t.end_reason, EXCLUDED.end_reason)"),
                ("message_count", "GREATEST(t.message_count, EXCLUDED.message_count)"),
                ("tool_call_count", "GREATEST(t.tool_call_count, EXCLUDED.tool_call_count)"),
                (
                    "estimated_cost_usd",
                    "COALESCE(EXCLUDED.estimated_cost_usd, t.estimated_cost_usd)",
                ),
                ("cost_status", "COALESCE(EXCLUDED.cost_status, t.cost_status)"),
                ("cost_source", "COALESCE(EXCLUDED.cost_source, t.cost_source)"),
            ],
        )),
        // A unit changed in the source since (newer `updated_at`) takes the
        // source's state; a tombstone is always carried, never undone.
        "async_delegations" => Some((
            "delegation_id",
            [
                "state",
                "completed_at",
                "event_json",
                "result_json",
                "delivery_state",
                "delivery_attempts",
                "delivered_at",
                "children_json",
                "retained",
                "retained_at",
                "usage_json",
                "owner_profile",
            ]
            .iter()
            .map(|c| (*c, NEWER))
            .chain([
                ("tombstoned_at", "COALESCE(t.tombstoned_at, EXCLUDED.tombstoned_at)"),
                ("updated_at", "GREATEST(t.updated_at, EXCLUDED.updated_at)"),
            ])
            .collect(),
        )),
        "retinue_children" => Some((
            "delegation_id, child_index",
            vec![
                ("tombstoned_at", "COALESCE(t.tombstoned_at, EXCLUDED.tombstoned_at)"),
                (
                    "tombstone_reason",
                    "CASE WHEN t.tombstoned_at IS NULL THEN EXCLUDED.tombstone_reason \
                     ELSE t.tombstone_reason END",
                ),
                (
                    "tombstone_note",
                    "CASE WHEN t.tombstoned_at IS NULL THEN EXCLUDED.tombstone_note \
                     ELSE t.tombstone_note END",
                ),
                ("retained_at", "GREATEST(t.retained_at, EXCLUDED.retained_at)"),
            ],
        )),
        _ => None,
    }
}

/// Copies `table`'s rows; returns (new rows, rows whose later changes were
/// carried). A NULL where the target column is `NOT NULL` with a default
/// (hermes leaves `origin_session_id` and others NULL; this schema says
/// `NOT NULL DEFAULT ''`) takes that default; a NULL where a value is
/// required is refused, naming the row.
fn copy_rows(tx: &mut Tx<'_>, table: &Table, rows: &[Vec<Val>]) -> PgResult<(usize, usize)> {
    let defaults = not_null_defaults(tx, table)?;
    let names: Vec<&str> = table.cols.iter().map(|(c, _)| *c).collect();
    let marks = marks(table.cols, 1, &defaults);
    let conflict = match carried(table.name) {
        None => "ON CONFLICT DO NOTHING".to_owned(),
        Some((key, sets)) => {
            // `NEWER` columns: the source's value when it is newer.
            let expr = |c: &str, e: &str| {
                if e.starts_with("EXCLUDED.updated_at") {
                    format!("CASE WHEN {e} THEN EXCLUDED.{c} ELSE t.{c} END")
                } else {
                    e.to_owned()
                }
            };
            let set: Vec<String> =
                sets.iter().map(|(c, e)| format!("{c} = {}", expr(c, e))).collect();
            let old: Vec<String> = sets.iter().map(|(c, _)| format!("t.{c}")).collect();
            let new: Vec<String> = sets.iter().map(|(c, e)| expr(c, e)).collect();
            format!(
                "ON CONFLICT ({key}) DO UPDATE SET {} WHERE ({}) IS DISTINCT FROM ({})",
                set.join(", "),
                old.join(", "),
                new.join(", ")
            )
        }
    };
    let sql = format!(
        "INSERT INTO {} AS t ({}) VALUES ({}) {conflict} RETURNING (xmax = 0)",
        table.name,
        names.join(", "),
        marks.join(", ")
    );
    let stmt = tx.prepare(&sql)?;
    let (mut new, mut updated) = (0, 0);
    for row in rows {
        let params: Vec<&(dyn ToSql + Sync)> = row.iter().map(Val::sql).collect();
        match tx.query(&stmt, &params) {
            Ok(out) => {
                for r in out {
                    if r.try_get::<_, bool>(0)? {
                        new += 1;
                    } else {
                        updated += 1;
                    }
                }
            }
            Err(Fail::Pg(e))
                if e.code() == Some(&postgres::error::SqlState::NOT_NULL_VIOLATION) =>
            {
                let column = e.as_db_error().and_then(|d| d.column()).unwrap_or("?").to_owned();
                return Err(Fail::Store(Error::Invalid(format!(
                    "cannot copy {} row `{}`: its `{column}` is NULL (or unreadable) in the \
                     state.db, and PostgreSQL requires a value; nothing was copied",
                    table.name,
                    row.first().map(Val::key_text).unwrap_or_default()
                ))));
            }
            Err(e) => return Err(e),
        }
    }
    Ok((new, updated))
}

/// What [`copy_with_ids`] did: (new rows, source id → target id, rows
/// remapped, the target ids of the rows inserted by this run).
type IdCopy = (usize, BTreeMap<i64, i64>, usize, Vec<i64>);

/// The columns that say a transcript or ledger row at an id is the same
/// row as the source's (a copy from an earlier run).
fn identity_cols(table: &str) -> &'static [usize] {
    match table {
        // session_id, role, content, tool_call_id, tool_calls, tool_name
        "messages" => &[1, 2, 3, 6, 7, 8],
        // parent_session_id, parent_turn_id, child_session_id, usage_json
        "delegation_child_usage" => &[1, 2, 3, 4],
        _ => &[1],
    }
}

/// Copies an id-keyed table (`messages`, `delegation_child_usage`): each
/// source row keeps its id when the target has no row there, is recognised
/// when the row there is its earlier copy, and gets a fresh id when another
/// row holds it; every source id's target id is recorded for `source`.
/// Returns (new rows, source id → target id, rows remapped, the target ids
/// of the rows inserted by this run).
fn copy_with_ids(
    tx: &mut Tx<'_>,
    table: &Table,
    rows: &[Vec<Val>],
    source: &str,
) -> PgResult<IdCopy> {
    let defaults = not_null_defaults(tx, table)?;
    let mut known: BTreeMap<i64, i64> = BTreeMap::new();
    for r in tx.query(
        "SELECT source_id, target_id FROM retinue_migrated_ids WHERE source = $1 AND tbl = $2",
        &[&source, &table.name],
    )? {
        known.insert(r.try_get(0)?, r.try_get(1)?);
    }
    let names: Vec<&str> = table.cols.iter().map(|(c, _)| *c).collect();
    let with_id = tx.prepare(&format!(
        "INSERT INTO {} ({}) VALUES ({}) RETURNING id",
        table.name,
        names.join(", "),
        marks(table.cols, 1, &defaults).join(", ")
    ))?;
    let fresh = tx.prepare(&format!(
        "INSERT INTO {} ({}) VALUES ({}) RETURNING id",
        table.name,
        names[1..].join(", "),
        marks(&table.cols[1..], 1, &defaults).join(", ")
    ))?;
    let ident = identity_cols(table.name);
    let same_sql = format!(
        "SELECT {} FROM {} WHERE id = $1",
        ident.iter().map(|i| format!("{}::text", table.cols[*i].0)).collect::<Vec<_>>().join(", "),
        table.name
    );
    let same = tx.prepare(&same_sql)?;
    let record = tx.prepare(
        "INSERT INTO retinue_migrated_ids (source, tbl, source_id, target_id) \
         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    )?;
    let (mut new, mut remapped) = (0, 0);
    let mut map = BTreeMap::new();
    // Target ids this source already owns (mapped before, or given in this
    // run): a row there is never taken for another source row's copy.
    let mut owned: BTreeSet<i64> = known.values().copied().collect();
    let mut placed = Vec::new();
    for row in rows {
        let Val::Int(Some(sid)) = row[0] else { continue };
        if let Some(tid) = known.get(&sid) {
            map.insert(sid, *tid);
            continue;
        }
        let there = tx.query_opt(&same, &[&sid])?;
        let there_was_none = there.is_none();
        let tid = match there {
            Some(_) if owned.contains(&sid) => {
                let params: Vec<&(dyn ToSql + Sync)> = row[1..].iter().map(Val::sql).collect();
                remapped += 1;
                new += 1;
                tx.query_one(&fresh, &params)?.try_get(0)?
            }
            Some(r) => {
                let mine = ident.iter().enumerate().all(|(k, i)| {
                    let theirs: Option<String> = r.try_get(k).ok().flatten();
                    let ours = match &row[*i] {
                        Val::Bytes(Some(b)) => Some(format!(
                            "\\x{}",
                            b.iter().map(|x| format!("{x:02x}")).collect::<String>()
                        )),
                        other => Some(other.key_text()),
                    };
                    theirs.unwrap_or_default() == ours.unwrap_or_default()
                });
                if mine {
                    sid
                } else {
                    let params: Vec<&(dyn ToSql + Sync)> = row[1..].iter().map(Val::sql).collect();
                    remapped += 1;
                    new += 1;
                    tx.query_one(&fresh, &params)?.try_get(0)?
                }
            }
            None => {
                let params: Vec<&(dyn ToSql + Sync)> = row.iter().map(Val::sql).collect();
                new += 1;
                tx.query_one(&with_id, &params)?.try_get(0)?
            }
        };
        tx.execute(&record, &[&source, &table.name, &sid, &tid])?;
        if !known.contains_key(&sid) && (tid != sid || there_was_none) {
            placed.push(tid);
        }
        owned.insert(tid);
        map.insert(sid, tid);
    }
    Ok((new, map, remapped, placed))
}

/// Every source key must be in the target, owned by the same row (for
/// tables keyed by an id: the same second column).
fn verify(tx: &mut Tx<'_>, table: &Table, rows: &[Vec<Val>]) -> PgResult<()> {
    let a = table.cols[0].0;
    let sql = if table.key == 2 {
        let b = table.cols[1].0;
        format!("SELECT count(*) FROM {} WHERE {a}::text = $1 AND {b}::text = $2", table.name)
    } else {
        format!("SELECT count(*) FROM {} WHERE {a}::text = $1", table.name)
    };
    let stmt = tx.prepare(&sql)?;
    for row in rows {
        let k1 = row[0].key_text();
        let found: i64 = if table.key == 2 {
            tx.query_one(&stmt, &[&k1, &row[1].key_text()])?.try_get(0)?
        } else {
            tx.query_one(&stmt, &[&k1])?.try_get(0)?
        };
        if found != 1 {
            return Err(Fail::Store(Error::Invalid(format!(
                "verification failed: {} row `{k1}` is missing or belongs to another row in the \
                 target (ids already used by another source?)",
                table.name
            ))));
        }
    }
    Ok(())
}

/// Every source row of an id-keyed table has a target row, owned by the
/// same session (or ledger parent).
fn verify_mapped(
    tx: &mut Tx<'_>,
    table: &Table,
    rows: &[Vec<Val>],
    map: &BTreeMap<i64, i64>,
) -> PgResult<()> {
    let owner = table.cols[1].0;
    let stmt = tx.prepare(&format!(
        "SELECT count(*) FROM {} WHERE id = $1 AND {owner}::text = $2",
        table.name
    ))?;
    for row in rows {
        let Val::Int(Some(sid)) = row[0] else { continue };
        let found: i64 = match map.get(&sid) {
            Some(tid) => tx.query_one(&stmt, &[tid, &row[1].key_text()])?.try_get(0)?,
            None => 0,
        };
        if found != 1 {
            return Err(Fail::Store(Error::Invalid(format!(
                "verification failed: {} row {sid} of the source has no copy in the target",
                table.name
            ))));
        }
    }
    Ok(())
}

/// A tombstone of the source is in the target (carried, never undone).
fn verify_tombstones(tx: &mut Tx<'_>, table: &Table, rows: &[Vec<Val>]) -> PgResult<()> {
    let Some(at) = table.cols.iter().position(|(c, _)| *c == "tombstoned_at") else {
        return Ok(());
    };
    let sql = if table.key == 2 {
        format!(
            "SELECT tombstoned_at IS NOT NULL FROM {} WHERE {}::text = $1 AND {}::text = $2",
            table.name, table.cols[0].0, table.cols[1].0
        )
    } else {
        format!(
            "SELECT tombstoned_at IS NOT NULL FROM {} WHERE {}::text = $1",
            table.name, table.cols[0].0
        )
    };
    let stmt = tx.prepare(&sql)?;
    for row in rows.iter().filter(|r| matches!(r[at], Val::Float(Some(_)))) {
        let k1 = row[0].key_text();
        let carried: Option<bool> = if table.key == 2 {
            tx.query_opt(&stmt, &[&k1, &row[1].key_text()])?.map(|r| r.try_get(0)).transpose()?
        } else {
            tx.query_opt(&stmt, &[&k1])?.map(|r| r.try_get(0)).transpose()?
        };
        if carried != Some(true) {
            return Err(Fail::Store(Error::Invalid(format!(
                "verification failed: {} row `{k1}` is tombstoned in the source but not in the \
                 target",
                table.name
            ))));
        }
    }
    Ok(())
}

/// The dollars of a ledger row's `usage_json` (0 when absent or unreadable).
fn ledger_cost(usage_json: Option<&str>) -> f64 {
    usage_json
        .and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok())
        .and_then(|v| v.get("cost_usd").and_then(serde_json::Value::as_f64))
        .filter(|c| c.is_finite())
        .unwrap_or(0.0)
}

impl PgStore {
    /// Copies the `state.db` at `source`, read by `reader` (the SQLite
    /// backend's `StateDbReader`), into this database (idempotent) and
    /// verifies the result; see the module documentation.
    pub fn import_state_db(
        &self,
        source: &Path,
        reader: &dyn StateReader,
    ) -> Result<MigrationReport> {
        let dump = reader.read_state(source, TABLES)?;
        let data = dump.tables;
        let parents = dump.parents;
        // Units keyed by the source home's path (hermes's profile key) join
        // this store's explicit tenant: in team mode a profile is never a
        // host's path. Other profiles (and the empty one) copy as they are.
        let mut data = data;
        let rekeyed = TABLES
            .iter()
            .position(|t| t.name == "async_delegations")
            .and_then(|i| self.rekey_home_profile(source, &TABLES[i], &mut data[i]));
        // The source file's identity for its id mappings.
        let source_key = std::fs::canonicalize(source)
            .unwrap_or_else(|_| source.to_path_buf())
            .to_string_lossy()
            .into_owned();
        let ledger_at = TABLES.iter().position(|t| t.name == "delegation_child_usage");
        let source_ledger: f64 = ledger_at
            .map(|i| {
                data[i]
                    .iter()
                    .map(|r| match &r[4] {
                        Val::Text(t) => ledger_cost(t.as_deref()),
                        _ => 0.0,
                    })
                    .sum()
            })
            .unwrap_or(0.0);
        let mut tables = BTreeMap::new();
        let mut updated = BTreeMap::new();
        let mut remapped = 0;
        let mut target_ledger = 0.0;
        let lim = self.limits();
        let dangling_parents = self.pool.tx("copying a state.db", Mode::Write, |tx| {
            tables.clear();
            updated.clear();
            remapped = 0;
            let mut maps: BTreeMap<&str, BTreeMap<i64, i64>> = BTreeMap::new();
            for (table, rows) in TABLES.iter().zip(&data) {
                match table.name {
                    "messages" | "delegation_child_usage" => {
                        let (new, map, moved, placed) =
                            copy_with_ids(tx, table, rows, &source_key)?;
                        if table.name == "delegation_child_usage" {
                            // A row placed at or below its parent's covered id
                            // would never be folded: that parent's totals are
                            // dropped and folded afresh.
                            tx.execute(
                                "DELETE FROM retinue_usage_totals t USING delegation_child_usage u \
                                 WHERE u.id = ANY($1) AND u.parent_session_id = t.parent_session_id \
                                 AND u.id <= t.covered_id",
                                &[&placed],
                            )?;
                        }
                        remapped += moved;
                        tables.insert(table.name.to_owned(), (rows.len(), new));
                        maps.insert(table.name, map);
                    }
                    "retinue_usage_keys" => {
                        // The key names its ledger row by the target's id.
                        let ledger = maps.get("delegation_child_usage");
                        let rows: Vec<Vec<Val>> = rows
                            .iter()
                            .map(|r| {
                                let id = match r[1] {
                                    Val::Int(Some(sid)) => ledger
                                        .and_then(|m| m.get(&sid).copied())
                                        .or(Some(sid)),
                                    _ => None,
                                };
                                vec![
                                    Val::Text(Some(r[0].key_text())),
                                    Val::Int(id),
                                    match r[2] {
                                        Val::Float(f) => Val::Float(f),
                                        _ => Val::Float(None),
                                    },
                                ]
                            })
                            .collect();
                        let (new, _) = copy_rows(tx, table, &rows)?;
                        tables.insert(table.name.to_owned(), (rows.len(), new));
                    }
                    "retinue_usage_totals" => {
                        // Totals cover ledger ids: a parent with a row that
                        // moved is folded afresh by the target instead.
                        let moved: BTreeSet<String> = ledger_at
                            .map(|i| {
                                data[i]
                                    .iter()
                                    .filter(|r| match r[0] {
                                        Val::Int(Some(sid)) => maps
                                            .get("delegation_child_usage")
                                            .and_then(|m| m.get(&sid))
                                            .is_some_and(|tid| *tid != sid),
                                        _ => false,
                                    })
                                    .map(|r| r[1].key_text())
                                    .collect()
                            })
                            .unwrap_or_default();
                        let kept: Vec<&Vec<Val>> =
                            rows.iter().filter(|r| !moved.contains(&r[0].key_text())).collect();
                        let kept: Vec<Vec<Val>> = kept
                            .into_iter()
                            .map(|r| {
                                r.iter()
                                    .map(|v| match v {
                                        Val::Text(t) => Val::Text(t.clone()),
                                        Val::Float(f) => Val::Float(*f),
                                        Val::Int(i) => Val::Int(*i),
                                        Val::Bytes(b) => Val::Bytes(b.clone()),
                                    })
                                    .collect()
                            })
                            .collect();
                        let (new, _) = copy_rows(tx, table, &kept)?;
                        tables.insert(table.name.to_owned(), (rows.len(), new));
                    }
                    _ => {
                        let (new, changed) = copy_rows(tx, table, rows)?;
                        tables.insert(table.name.to_owned(), (rows.len(), new));
                        updated.insert(table.name.to_owned(), changed);
                    }
                }
            }
            // Parent links after every session exists; a parent that does not is not linked.
            let mut dangling = 0;
            for (id, parent) in &parents {
                let n = tx.execute(
                    "UPDATE sessions SET parent_session_id = $2 WHERE id = $1 \
                     AND parent_session_id IS NULL AND EXISTS (SELECT 1 FROM sessions WHERE id = $2)",
                    &[id, parent],
                )?;
                let linked = tx
                    .query_opt(
                        "SELECT 1 FROM sessions WHERE id = $1 AND parent_session_id = $2",
                        &[id, parent],
                    )?
                    .is_some();
                if n == 0 && !linked {
                    dangling += 1;
                }
            }
            for seq in ["messages", "delegation_child_usage"] {
                tx.execute(
                    &format!(
                        "SELECT setval(pg_get_serial_sequence('{seq}', 'id'), \
                         GREATEST((SELECT COALESCE(MAX(id), 0) FROM {seq}), 1))"
                    ),
                    &[],
                )?;
            }
            for (table, rows) in TABLES.iter().zip(&data) {
                match maps.get(table.name) {
                    Some(map) => verify_mapped(tx, table, rows, map)?,
                    None if table.name == "retinue_usage_keys" => {}
                    None => verify(tx, table, rows)?,
                }
                verify_tombstones(tx, table, rows)?;
            }
            // The ledger: the source's rows and their copies add up the same.
            let ids: Vec<i64> = maps
                .get("delegation_child_usage")
                .map(|m| m.values().copied().collect())
                .unwrap_or_default();
            target_ledger = tx
                .query(
                    "SELECT usage_json FROM delegation_child_usage WHERE id = ANY($1)",
                    &[&ids],
                )?
                .iter()
                .map(|r| Ok(ledger_cost(r.try_get::<_, Option<String>>(0)?.as_deref())))
                .sum::<PgResult<f64>>()?;
            // Adopt and prune what was copied, as any write of this backend
            // leaves it (child rows for retained units; no live unit without
            // a live child; the per-profile live counts exact).
            crate::registry::retention::adopt_and_prune(tx, lim, &self.profile)?;
            Ok(dangling)
        })?;
        if (target_ledger - source_ledger).abs() > 1e-6 * source_ledger.abs().max(1.0) {
            return Err(Error::Invalid(format!(
                "verification failed: ledger sums differ (source {source_ledger}, target \
                 {target_ledger})"
            )));
        }
        // The copied ledger rows get their typed columns (the core rule).
        self.type_usage_rows()?;
        Ok(MigrationReport {
            tables,
            updated,
            remapped,
            dangling_parents,
            ledger_cost_usd: source_ledger,
            rekeyed,
        })
    }

    /// Re-keys the `async_delegations` rows of `units` whose `owner_profile`
    /// is the profile key of `source`'s home to this store's profile.
    fn rekey_home_profile(
        &self,
        source: &Path,
        table: &Table,
        units: &mut [Vec<Val>],
    ) -> Option<(String, usize)> {
        if self.profile.trim().is_empty() {
            return None;
        }
        let home = source.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let from = retinue_core::default_profile_key(home);
        let col = table.cols.iter().position(|(c, _)| *c == "owner_profile")?;
        let mut n = 0;
        for row in units.iter_mut() {
            if let Some(Val::Text(Some(p))) = row.get_mut(col)
                && *p == from
            {
                p.clone_from(&self.profile);
                n += 1;
            }
        }
        Some((from, n))
    }
}
