//! Sessions and transcripts (hermes's `sessions` and `messages` tables), and
//! the session-graph seam the lineage rules read.

use retinue_core::EndReason;
use rusqlite::{Connection, OptionalExtension, Row, Transaction, params};
use serde_json::Value;

use crate::error::{Error, Result, SqlResult};
use crate::rows::{json_column, real_column, text_column};
use crate::store::Store;
use retinue_core::{Message, NewSession, SessionRow};

pub(crate) use retinue_core::{SessionGraph, SessionStore};
use retinue_core::{compression_tip_walk, tool_call_delta};

pub(crate) fn insert_session(tx: &Transaction<'_>, s: &NewSession, now: f64) -> SqlResult<()> {
    if s.id.trim().is_empty() {
        return Err(Error::Invalid("session id must not be empty".to_owned()).into());
    }
    let model_config = match &s.model_config {
        None | Some(Value::Null) => None,
        Some(v @ Value::Object(_)) => Some(v.to_string()),
        Some(_) => {
            return Err(Error::Invalid("model_config must be a JSON object".to_owned()).into());
        }
    };
    // A parent that is not (yet) a row is not linked (the foreign key would
    // refuse it): the subquery yields NULL for it, in the same statement.
    let parent = s.parent_session_id.as_deref().map(str::trim).filter(|p| !p.is_empty());
    tx.prepare_cached(
        "INSERT INTO sessions (id, source, model, model_config, parent_session_id, started_at, \
         profile_name) VALUES (?1, ?2, ?3, ?4, (SELECT id FROM sessions WHERE id = ?5), ?6, ?7)",
    )?
    .execute(params![
        s.id,
        s.source,
        s.model,
        model_config,
        parent,
        s.started_at.unwrap_or(now),
        s.profile_name
    ])?;
    Ok(())
}

fn session_cols(has_system_prompt: bool) -> &'static str {
    if has_system_prompt {
        "id, source, model, model_config, parent_session_id, started_at, ended_at, end_reason, \
         profile_name, estimated_cost_usd, cost_status, cost_source, system_prompt"
    } else {
        "id, source, model, model_config, parent_session_id, started_at, ended_at, end_reason, \
         profile_name, estimated_cost_usd, cost_status, cost_source, NULL"
    }
}

/// `model_config` decides authority, so anything but NULL or UTF-8 text
/// (a number, a BLOB, invalid UTF-8) reads as unparseable text: the
/// lineage rules then fail closed on that row, and the rest of the read goes on.
fn model_config_column(r: &Row<'_>, idx: usize) -> rusqlite::Result<Option<String>> {
    use rusqlite::types::ValueRef;
    Ok(match r.get_ref(idx)? {
        ValueRef::Null => None,
        ValueRef::Text(b) => {
            Some(std::str::from_utf8(b).map_or_else(|_| "<unreadable>".to_owned(), str::to_owned))
        }
        _ => Some("<unreadable>".to_owned()),
    })
}

fn read_session(r: &Row<'_>) -> rusqlite::Result<SessionRow> {
    // hermes-written values: an unreadable one reads as absent (semantics §2.7).
    Ok(SessionRow {
        id: text_column(r, 0)?.unwrap_or_default(),
        source: text_column(r, 1)?.unwrap_or_default(),
        model: text_column(r, 2)?,
        model_config: model_config_column(r, 3)?,
        parent_session_id: text_column(r, 4)?,
        started_at: real_column(r, 5)?.unwrap_or(0.0),
        ended_at: real_column(r, 6)?,
        end_reason: text_column(r, 7)?,
        profile_name: text_column(r, 8)?,
        estimated_cost_usd: real_column(r, 9)?,
        cost_status: text_column(r, 10)?,
        cost_source: text_column(r, 11)?,
        system_prompt: json_column(r, 12)?,
    })
}

/// A session row read by a lineage walk (its `rowid` at column 14): an
/// unreadable id (a BLOB, invalid UTF-8, NULL, a real) is not guessed at —
/// the walk cannot tell which session it is — so the read fails with
/// [`Error::MalformedRow`] naming the table and rowid (authority then fails
/// closed, `RootError::Storage`).
fn read_walk_session(r: &Row<'_>) -> rusqlite::Result<std::result::Result<SessionRow, i64>> {
    if text_column(r, 0)?.is_none() {
        return Ok(Err(r.get(14)?));
    }
    read_session(r).map(Ok)
}

/// The [`Error::MalformedRow`] of a `sessions` row with an unreadable id.
fn unreadable_session(rowid: i64) -> crate::error::Fail {
    Error::MalformedRow { table: "sessions", rowid, column: "id" }.into()
}

pub(crate) fn session_in(
    tx: &Connection,
    has_system_prompt: bool,
    id: &str,
) -> SqlResult<Option<SessionRow>> {
    let sql = format!("SELECT {} FROM sessions WHERE id = ?1", session_cols(has_system_prompt));
    Ok(tx.prepare_cached(&sql)?.query_row([id], read_session).optional()?)
}

pub(crate) fn children_in(
    tx: &Connection,
    has_system_prompt: bool,
    parent: &str,
) -> SqlResult<Vec<SessionRow>> {
    let sql = format!(
        "SELECT {}, NULL, rowid FROM sessions WHERE parent_session_id = ?1 \
         ORDER BY started_at, id",
        session_cols(has_system_prompt)
    );
    let mut stmt = tx.prepare_cached(&sql)?;
    let rows = stmt.query_map([parent], read_walk_session)?;
    let mut out = Vec::new();
    for row in rows {
        out.push(row?.map_err(unreadable_session)?);
    }
    Ok(out)
}

impl SessionGraph for Store {
    fn session(&self, id: &str) -> Result<Option<SessionRow>> {
        let sp = self.has_system_prompt;
        self.pool.query("reading a session", |conn| session_in(conn, sp, id))
    }

    fn child_sessions(&self, parent: &str) -> Result<Vec<SessionRow>> {
        let sp = self.has_system_prompt;
        self.pool.query("reading child sessions", |conn| children_in(conn, sp, parent))
    }

    fn neighbourhood(&self, id: &str, max_hops: usize) -> Result<Option<Vec<SessionRow>>> {
        let hops = i64::try_from(max_hops).unwrap_or(i64::MAX);
        // A neighbourhood this connection read while nothing has changed
        // since is answered again (the cache is provably fresh, see
        // `ConnCache`); anything else is read now.
        self.pool.cached("walking the session neighbourhood", |conn, cache| {
            cache.validate(conn)?;
            if let Some(rows) = cache.neighbourhood(id, max_hops) {
                return Ok(Some(rows.clone()));
            }
            let rows = read_neighbourhood(conn, id, hops, false)?;
            cache.keep_neighbourhood(id, max_hops, rows.clone());
            Ok(Some(rows))
        })
    }

    #[expect(clippy::needless_lifetimes)] // mockall needs the lifetime named
    fn neighbourhoods<'a>(
        &self,
        ids: &[&'a str],
        max_hops: usize,
    ) -> Result<Option<Vec<SessionRow>>> {
        let hops = i64::try_from(max_hops).unwrap_or(i64::MAX);
        // One connection, one freshness check: all from the cache when all
        // are there; otherwise all read now, in one read transaction (one
        // snapshot — cached rows of an older state are never mixed in).
        self.pool.cached("walking session neighbourhoods", |conn, cache| {
            cache.validate(conn)?;
            let mut all = Vec::new();
            if ids.iter().all(|id| cache.neighbourhood(id, max_hops).is_some()) {
                for id in ids {
                    all.extend(cache.neighbourhood(id, max_hops).into_iter().flatten().cloned());
                }
                return Ok(Some(all));
            }
            conn.prepare_cached("BEGIN DEFERRED")?.execute([])?;
            let read: SqlResult<Vec<(&str, Vec<SessionRow>)>> =
                ids.iter().map(|id| Ok((*id, read_neighbourhood(conn, id, hops, true)?))).collect();
            let end = conn.prepare_cached("COMMIT").and_then(|mut s| s.execute([]));
            let read = read?;
            end?;
            for (id, rows) in read {
                all.extend(rows.iter().cloned());
                cache.keep_neighbourhood(id, max_hops, rows);
            }
            Ok(Some(all))
        })
    }
}

/// One neighbourhood (see [`SessionGraph::neighbourhood`]): the ancestors
/// as rows, each with how many children its parent has (an index-only
/// count, stopped at 2), in one recursive CTE. Only the parents with more
/// than one child — where a sibling could make the continuation ambiguous —
/// cost a second (indexed) query for their children, read on the same
/// snapshot (`in_tx`: the caller holds a read transaction already). Only
/// the columns the lineage rules read are filled.
fn read_neighbourhood(
    conn: &Connection,
    id: &str,
    hops: i64,
    in_tx: bool,
) -> SqlResult<Vec<SessionRow>> {
    const SQL: &str = "WITH RECURSIVE up(id, source, model_config, parent_session_id, \
           started_at, ended_at, end_reason, n, rid) AS ( \
         SELECT id, source, model_config, parent_session_id, started_at, ended_at, \
           end_reason, 0, rowid FROM sessions WHERE id = ?1 \
         UNION ALL SELECT s.id, s.source, s.model_config, s.parent_session_id, s.started_at, \
           s.ended_at, s.end_reason, up.n + 1, s.rowid FROM up JOIN sessions s \
           ON s.id = up.parent_session_id WHERE up.n < ?2) \
       SELECT id, source, NULL, model_config, parent_session_id, started_at, ended_at, \
         end_reason, NULL, NULL, NULL, NULL, NULL, \
         (SELECT count(*) FROM (SELECT 1 FROM sessions c \
           WHERE c.parent_session_id = up.parent_session_id LIMIT 2)), rid FROM up";
    const SIBLINGS: &str = "SELECT id, source, NULL, model_config, parent_session_id, \
         started_at, ended_at, end_reason, NULL, NULL, NULL, NULL, NULL, NULL, rowid \
         FROM sessions WHERE parent_session_id = ?1";
    let ancestors = || -> SqlResult<(Vec<SessionRow>, Vec<String>)> {
        let mut crowded: Vec<String> = Vec::new();
        let mut stmt = conn.prepare_cached(SQL)?;
        let mapped = stmt.query_map(params![id, hops], |r| {
            let row = read_walk_session(r)?;
            let siblings: i64 = r.get(13)?;
            Ok((row, siblings))
        })?;
        let mut rows = Vec::new();
        for item in mapped {
            let (row, siblings) = item?;
            let row = row.map_err(unreadable_session)?;
            if siblings > 1
                && let Some(parent) = &row.parent_session_id
                && !crowded.contains(parent)
            {
                crowded.push(parent.clone());
            }
            rows.push(row);
        }
        Ok((rows, crowded))
    };
    let with_siblings = || -> SqlResult<Vec<SessionRow>> {
        let (mut rows, crowded) = ancestors()?;
        let mut stmt = conn.prepare_cached(SIBLINGS)?;
        for parent in &crowded {
            let more = stmt.query_map([parent], read_walk_session)?;
            for row in more {
                rows.push(row?.map_err(unreadable_session)?);
            }
        }
        Ok(rows)
    };
    if in_tx {
        return with_siblings();
    }
    // Common case, one statement (atomic on its own): no parent has siblings.
    let (rows, crowded) = ancestors()?;
    if crowded.is_empty() {
        return Ok(rows);
    }
    // Otherwise read the ancestors and the siblings from one snapshot.
    conn.prepare_cached("BEGIN DEFERRED")?.execute([])?;
    let read = with_siblings();
    let end = conn.prepare_cached("COMMIT").and_then(|mut s| s.execute([]));
    let rows = read?;
    end?;
    Ok(rows)
}

impl SessionStore for Store {
    fn create_session(&self, session: &NewSession) -> Result<()> {
        let now = self.clock.now();
        self.pool.write("creating a session", |tx| insert_session(tx, session, now))
    }

    fn append_message(&self, session_id: &str, m: &Message) -> Result<i64> {
        let now = self.clock.now();
        self.pool.write("appending a message", |tx| {
            let exists =
                tx.prepare_cached("SELECT 1 FROM sessions WHERE id = ?1")?.exists([session_id])?;
            if !exists {
                return Err(Error::NotFound { what: "session", id: session_id.to_owned() }.into());
            }
            tx.prepare_cached(
                "INSERT INTO messages (session_id, role, content, timestamp, active, tool_call_id, \
                 tool_calls, tool_name, token_count, finish_reason) \
                 VALUES (?1, ?2, ?3, ?4, 1, ?5, ?6, ?7, ?8, ?9)",
            )?
            .execute(params![
                session_id,
                m.role,
                m.content,
                if m.timestamp > 0.0 { m.timestamp } else { now },
                m.tool_call_id,
                m.tool_calls,
                m.tool_name,
                m.token_count,
                m.finish_reason
            ])?;
            let id = tx.last_insert_rowid();
            tx.prepare_cached(
                "UPDATE sessions SET message_count = COALESCE(message_count, 0) + 1, \
                 tool_call_count = COALESCE(tool_call_count, 0) + ?2 WHERE id = ?1",
            )?
            .execute(params![session_id, tool_call_delta(m.tool_calls.as_deref())])?;
            Ok(id)
        })
    }

    fn end_session(&self, id: &str, reason: &EndReason) -> Result<bool> {
        let reason = reason.as_str();
        let now = self.clock.now();
        self.pool.write("ending a session", |tx| {
            let n = tx
                .prepare_cached(
                    // First reason wins: a compression link is never overwritten.
                    "UPDATE sessions SET ended_at = ?1, end_reason = CASE \
                     WHEN end_reason = 'compression' THEN end_reason ELSE ?2 END \
                     WHERE id = ?3 AND ended_at IS NULL",
                )?
                .execute(params![now, reason, id])?;
            Ok(n > 0)
        })
    }

    fn reopen_session(&self, id: &str) -> Result<bool> {
        self.pool.write("reopening a session", |tx| {
            let n = tx
                .prepare_cached(
                    // A session that ended with `compression` keeps that link (semantics §6.3).
                    "UPDATE sessions SET \
                     ended_at = CASE WHEN end_reason = 'compression' THEN ended_at END, \
                     end_reason = CASE WHEN end_reason = 'compression' THEN end_reason END \
                     WHERE id = ?1",
                )?
                .execute([id])?;
            Ok(n > 0)
        })
    }

    fn conversation(&self, id: &str) -> Result<Vec<Message>> {
        self.pool.query("reading a conversation", |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, role, content, timestamp, tool_call_id, tool_calls, tool_name, \
                 token_count, finish_reason FROM messages \
                 WHERE session_id = ?1 AND COALESCE(active, 1) = 1 ORDER BY id",
            )?;
            let rows = stmt.query_map([id], |r| {
                Ok(Message {
                    id: r.get(0)?,
                    role: r.get::<_, Option<String>>(1)?.unwrap_or_default(),
                    content: r.get(2)?,
                    timestamp: r.get::<_, Option<f64>>(3)?.unwrap_or(0.0),
                    tool_call_id: r.get(4)?,
                    tool_calls: r.get(5)?,
                    tool_name: r.get(6)?,
                    token_count: r.get(7)?,
                    finish_reason: r.get(8)?,
                })
            })?;
            Ok(rows.collect::<rusqlite::Result<_>>()?)
        })
    }

    fn compression_tip(&self, id: &str) -> Result<String> {
        let sp = self.has_system_prompt;
        self.pool.read("following the compression tip", |tx| {
            let mut has_messages = tx.prepare_cached(
                "SELECT 1 FROM messages WHERE session_id = ?1 AND COALESCE(active, 1) = 1",
            )?;
            let start = session_in(tx, sp, id)?;
            compression_tip_walk(
                id,
                start,
                |parent| children_in(tx, sp, parent),
                |session| Ok(has_messages.exists([session])?),
            )
        })
    }
}
