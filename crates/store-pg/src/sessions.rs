//! Sessions and transcripts ([`SessionStore`]) and the session graph
//! ([`SessionGraph`]) on PostgreSQL, with the SQLite backend's semantics.

use postgres::Row;
use postgres::types::ToSql;
use retinue_core::EndReason;
use retinue_core::{
    MAX_HOPS, Message, NewSession, Result, SessionGraph, SessionRow, SessionStore,
    compression_tip_walk, tool_call_delta,
};
use serde_json::Value;

use crate::pool::{Fail, Mode, PgResult, Tx};
use crate::store::{PgStore, invalid};

const SESSION_COLS: &str = "id, source, model, model_config, parent_session_id, started_at, \
     ended_at, end_reason, profile_name, estimated_cost_usd, cost_status, cost_source, \
     system_prompt";

pub(crate) fn insert_session(tx: &mut Tx<'_>, s: &NewSession, now: f64) -> PgResult<()> {
    if s.id.trim().is_empty() {
        return Err(invalid("session id must not be empty"));
    }
    let model_config = match &s.model_config {
        None | Some(Value::Null) => None,
        Some(v @ Value::Object(_)) => Some(v.to_string()),
        Some(_) => return Err(invalid("model_config must be a JSON object")),
    };
    // A parent that is not (yet) a row is not linked (as in SQLite).
    let parent = s.parent_session_id.as_deref().map(str::trim).filter(|p| !p.is_empty());
    tx.execute(
        "INSERT INTO sessions (id, source, model, model_config, parent_session_id, started_at, \
         profile_name) VALUES ($1, $2, $3, $4, (SELECT id FROM sessions WHERE id = $5), $6, $7)",
        &[
            &s.id,
            &s.source,
            &s.model,
            &model_config,
            &parent,
            &s.started_at.unwrap_or(now),
            &s.profile_name,
        ],
    )?;
    Ok(())
}

/// Whether a session of `sessions` names another of them as its parent
/// (then they are inserted one by one, so that the parent is linked).
pub(crate) fn chained(sessions: &[NewSession]) -> bool {
    sessions.iter().any(|s| {
        s.parent_session_id
            .as_deref()
            .map(str::trim)
            .is_some_and(|p| sessions.iter().any(|o| o.id == p))
    })
}

/// New sessions as parallel arrays, validated as [`insert_session`] does:
/// the parameters of [`sessions_from_arrays`].
pub(crate) struct SessionArrays<'a> {
    ids: Vec<&'a str>,
    sources: Vec<&'a str>,
    models: Vec<Option<&'a str>>,
    configs: Vec<Option<String>>,
    parents: Vec<Option<&'a str>>,
    started: Vec<f64>,
    profiles: Vec<Option<&'a str>>,
}

impl<'a> SessionArrays<'a> {
    /// The arrays of `sessions`, or the error [`insert_session`] would give.
    pub(crate) fn of(sessions: &'a [NewSession], now: f64) -> PgResult<SessionArrays<'a>> {
        let mut ids = Vec::with_capacity(sessions.len());
        let mut configs = Vec::with_capacity(sessions.len());
        for s in sessions {
            if s.id.trim().is_empty() {
                return Err(invalid("session id must not be empty"));
            }
            ids.push(s.id.as_str());
            configs.push(match &s.model_config {
                None | Some(Value::Null) => None,
                Some(v @ Value::Object(_)) => Some(v.to_string()),
                Some(_) => return Err(invalid("model_config must be a JSON object")),
            });
        }
        Ok(SessionArrays {
            ids,
            sources: sessions.iter().map(|s| s.source.as_str()).collect(),
            models: sessions.iter().map(|s| s.model.as_deref()).collect(),
            configs,
            parents: sessions
                .iter()
                .map(|s| s.parent_session_id.as_deref().map(str::trim).filter(|p| !p.is_empty()))
                .collect(),
            started: sessions.iter().map(|s| s.started_at.unwrap_or(now)).collect(),
            profiles: sessions.iter().map(|s| s.profile_name.as_deref()).collect(),
        })
    }

    /// The seven parameters, in [`sessions_from_arrays`]' order.
    pub(crate) fn params(&self) -> [&(dyn ToSql + Sync); 7] {
        [
            &self.ids,
            &self.sources,
            &self.models,
            &self.configs,
            &self.parents,
            &self.started,
            &self.profiles,
        ]
    }
}

/// The `INSERT` of [`SessionArrays`] bound as parameters `$first` …
/// `$first+6`, with `from` (extra `FROM` items ending in a comma, e.g. a CTE
/// that must have a row) before the arrays. A parent that is not (yet) a
/// row is not linked (as in SQLite).
pub(crate) fn sessions_from_arrays(first: usize, from: &str) -> String {
    let p: Vec<String> = (first..first + 7).map(|i| format!("${i}")).collect();
    format!(
        "INSERT INTO sessions (id, source, model, model_config, parent_session_id, started_at, \
         profile_name) \
         SELECT n.id, n.source, n.model, n.model_config, p.id, n.started_at, n.profile_name \
         FROM {from}unnest({}::text[], {}::text[], {}::text[], {}::text[], {}::text[], \
           {}::float8[], {}::text[]) WITH ORDINALITY \
           AS n(id, source, model, model_config, parent, started_at, profile_name, k) \
         LEFT JOIN sessions p ON p.id = n.parent ORDER BY n.k",
        p[0], p[1], p[2], p[3], p[4], p[5], p[6]
    )
}

/// Inserts `sessions` in one statement (one round trip) when none of them
/// names another of them as its parent; otherwise one by one, so a parent
/// inserted first is linked as [`insert_session`] links it.
pub(crate) fn insert_sessions(tx: &mut Tx<'_>, sessions: &[NewSession], now: f64) -> PgResult<()> {
    if sessions.len() < 2 || chained(sessions) {
        for s in sessions {
            insert_session(tx, s, now)?;
        }
        return Ok(());
    }
    let arrays = SessionArrays::of(sessions, now)?;
    tx.execute(&sessions_from_arrays(1, ""), &arrays.params())?;
    Ok(())
}

fn read_session(r: &Row) -> PgResult<SessionRow> {
    Ok(SessionRow {
        id: r.try_get(0)?,
        source: r.try_get::<_, Option<String>>(1)?.unwrap_or_default(),
        model: r.try_get(2)?,
        model_config: r.try_get(3)?,
        parent_session_id: r.try_get(4)?,
        started_at: r.try_get::<_, Option<f64>>(5)?.unwrap_or(0.0),
        ended_at: r.try_get(6)?,
        end_reason: r.try_get(7)?,
        profile_name: r.try_get(8)?,
        estimated_cost_usd: r.try_get(9)?,
        cost_status: r.try_get(10)?,
        cost_source: r.try_get(11)?,
        system_prompt: r.try_get(12)?,
    })
}

fn session_in(tx: &mut Tx<'_>, id: &str) -> PgResult<Option<SessionRow>> {
    let sql = format!("SELECT {SESSION_COLS} FROM sessions WHERE id = $1");
    tx.query_opt(&sql, &[&id])?.as_ref().map(read_session).transpose()
}

fn children_in(tx: &mut Tx<'_>, parent: &str) -> PgResult<Vec<SessionRow>> {
    let sql = format!(
        "SELECT {SESSION_COLS} FROM sessions WHERE parent_session_id = $1 ORDER BY started_at, id"
    );
    tx.query(&sql, &[&parent])?.iter().map(read_session).collect()
}

impl SessionGraph for PgStore {
    fn session(&self, id: &str) -> Result<Option<SessionRow>> {
        self.pool.tx("reading a session", Mode::ReadOne, |tx| session_in(tx, id))
    }

    fn child_sessions(&self, parent: &str) -> Result<Vec<SessionRow>> {
        self.pool.tx("reading child sessions", Mode::ReadOne, |tx| children_in(tx, parent))
    }

    fn neighbourhood(&self, id: &str, max_hops: usize) -> Result<Option<Vec<SessionRow>>> {
        // The siblings through the parent index: `= ANY (ARRAY(…))` makes the
        // ancestors' parents one array parameter; an `IN (SELECT …)` over the
        // CTE was planned as a hash semi-join over a scan of every session.
        const SQL: &str = "WITH RECURSIVE up(id, source, model_config, parent_session_id, \
               started_at, ended_at, end_reason, n) AS ( \
             SELECT id, source, model_config, parent_session_id, started_at, ended_at, \
               end_reason, 0::BIGINT FROM sessions WHERE id = $1 \
             UNION ALL SELECT s.id, s.source, s.model_config, s.parent_session_id, s.started_at, \
               s.ended_at, s.end_reason, up.n + 1 FROM up JOIN sessions s \
               ON s.id = up.parent_session_id WHERE up.n < $2) \
           SELECT id, source, NULL::text, model_config, parent_session_id, started_at, ended_at, \
             end_reason, NULL::text, NULL::float8, NULL::text, NULL::text, NULL::text FROM up \
           UNION ALL \
           SELECT s.id, s.source, NULL::text, s.model_config, s.parent_session_id, s.started_at, \
             s.ended_at, s.end_reason, NULL::text, NULL::float8, NULL::text, NULL::text, NULL::text \
             FROM sessions s WHERE s.parent_session_id = ANY (ARRAY( \
               SELECT parent_session_id FROM up WHERE parent_session_id IS NOT NULL)) \
             AND s.id NOT IN (SELECT id FROM up)";
        let hops = i64::try_from(max_hops.min(MAX_HOPS * 100)).unwrap_or(i64::MAX);
        self.pool.tx("walking the session neighbourhood", Mode::ReadOne, |tx| {
            let rows = tx.query(SQL, &[&id, &hops])?;
            rows.iter().map(read_session).collect::<PgResult<Vec<_>>>().map(Some)
        })
    }

    #[expect(clippy::needless_lifetimes)] // mockall needs the lifetime named
    fn neighbourhoods<'a>(
        &self,
        ids: &[&'a str],
        max_hops: usize,
    ) -> Result<Option<Vec<SessionRow>>> {
        // The same statement with every start at once: one round trip, one
        // snapshot. Shared ancestors come once per start (the walk keeps
        // the first copy of a row). Each step up is a primary-key probe: the
        // lateral `LIMIT 1` keeps the generic plan from hashing a scan of
        // every session per step (it guesses ten starts, not one or two).
        const SQL: &str = "WITH RECURSIVE up(id, source, model_config, parent_session_id, \
               started_at, ended_at, end_reason, n) AS ( \
             SELECT id, source, model_config, parent_session_id, started_at, ended_at, \
               end_reason, 0::BIGINT FROM sessions WHERE id = ANY ($1) \
             UNION ALL SELECT s.id, s.source, s.model_config, s.parent_session_id, s.started_at, \
               s.ended_at, s.end_reason, up.n + 1 FROM up CROSS JOIN LATERAL (SELECT * \
               FROM sessions x WHERE x.id = up.parent_session_id LIMIT 1) s WHERE up.n < $2) \
           SELECT id, source, NULL::text, model_config, parent_session_id, started_at, ended_at, \
             end_reason, NULL::text, NULL::float8, NULL::text, NULL::text, NULL::text FROM up \
           UNION ALL \
           SELECT s.id, s.source, NULL::text, s.model_config, s.parent_session_id, s.started_at, \
             s.ended_at, s.end_reason, NULL::text, NULL::float8, NULL::text, NULL::text, NULL::text \
             FROM sessions s WHERE s.parent_session_id = ANY (ARRAY( \
               SELECT DISTINCT parent_session_id FROM up WHERE parent_session_id IS NOT NULL)) \
             AND s.id NOT IN (SELECT id FROM up)";
        let hops = i64::try_from(max_hops.min(MAX_HOPS * 100)).unwrap_or(i64::MAX);
        let ids: Vec<&str> = ids.to_vec();
        self.pool.tx("walking session neighbourhoods", Mode::ReadOne, |tx| {
            let rows = tx.query(SQL, &[&ids, &hops])?;
            rows.iter().map(read_session).collect::<PgResult<Vec<_>>>().map(Some)
        })
    }
}

impl SessionStore for PgStore {
    fn create_session(&self, session: &NewSession) -> Result<()> {
        let now = self.clock.now();
        self.pool.tx("creating a session", Mode::WriteOne, |tx| insert_session(tx, session, now))
    }

    fn append_message(&self, session_id: &str, m: &Message) -> Result<i64> {
        let now = self.clock.now();
        let ts = if m.timestamp > 0.0 { m.timestamp } else { now };
        let content = m.content.as_deref().map(str::as_bytes);
        let delta = tool_call_delta(m.tool_calls.as_deref());
        // One statement: the session's counters and the message, inserted
        // only when the session row exists (so both or neither).
        self.pool.tx("appending a message", Mode::WriteOne, |tx| {
            let row = tx.query_opt(
                "WITH s AS (UPDATE sessions SET message_count = COALESCE(message_count, 0) + 1, \
                   tool_call_count = COALESCE(tool_call_count, 0) + $10 WHERE id = $1 \
                   RETURNING id) \
                 INSERT INTO messages (session_id, role, content, timestamp, active, \
                 tool_call_id, tool_calls, tool_name, token_count, finish_reason) \
                 SELECT s.id, $2, $3, $4, 1, $5, $6, $7, $8, $9 FROM s RETURNING id",
                &[
                    &session_id,
                    &m.role,
                    &content,
                    &ts,
                    &m.tool_call_id,
                    &m.tool_calls,
                    &m.tool_name,
                    &m.token_count,
                    &m.finish_reason,
                    &delta,
                ],
            )?;
            match row {
                Some(r) => Ok(r.try_get(0)?),
                None => Err(Fail::Store(retinue_core::Error::NotFound {
                    what: "session",
                    id: session_id.to_owned(),
                })),
            }
        })
    }

    fn end_session(&self, id: &str, reason: &EndReason) -> Result<bool> {
        let reason = reason.as_str();
        let now = self.clock.now();
        self.pool.tx("ending a session", Mode::WriteOne, |tx| {
            let n = tx.execute(
                "UPDATE sessions SET ended_at = $1, end_reason = $2 \
                 WHERE id = $3 AND ended_at IS NULL",
                &[&now, &reason, &id],
            )?;
            Ok(n > 0)
        })
    }

    fn reopen_session(&self, id: &str) -> Result<bool> {
        self.pool.tx("reopening a session", Mode::WriteOne, |tx| {
            let n = tx.execute(
                "UPDATE sessions SET ended_at = NULL, end_reason = NULL WHERE id = $1",
                &[&id],
            )?;
            Ok(n > 0)
        })
    }

    fn conversation(&self, id: &str) -> Result<Vec<Message>> {
        self.pool.tx("reading a conversation", Mode::ReadOne, |tx| {
            let rows = tx.query(
                "SELECT id, role, content, timestamp, tool_call_id, tool_calls, tool_name, \
                 token_count, finish_reason FROM messages \
                 WHERE session_id = $1 AND COALESCE(active, 1) = 1 ORDER BY id",
                &[&id],
            )?;
            rows.iter()
                .map(|r| {
                    let content: Option<Vec<u8>> = r.try_get(2)?;
                    Ok(Message {
                        id: r.try_get(0)?,
                        role: r.try_get::<_, Option<String>>(1)?.unwrap_or_default(),
                        content: content.map(|b| String::from_utf8_lossy(&b).into_owned()),
                        timestamp: r.try_get::<_, Option<f64>>(3)?.unwrap_or(0.0),
                        tool_call_id: r.try_get(4)?,
                        tool_calls: r.try_get(5)?,
                        tool_name: r.try_get(6)?,
                        token_count: r.try_get(7)?,
                        finish_reason: r.try_get(8)?,
                    })
                })
                .collect()
        })
    }

    fn compression_tip(&self, id: &str) -> Result<String> {
        self.pool.tx("following the compression tip", Mode::Read, |tx| {
            let start = session_in(tx, id)?;
            let tx = std::cell::RefCell::new(tx);
            compression_tip_walk(
                id,
                start,
                |parent| children_in(&mut tx.borrow_mut(), parent),
                |session| {
                    Ok(tx
                        .borrow_mut()
                        .query_opt(
                            "SELECT 1 FROM messages WHERE session_id = $1 \
                             AND COALESCE(active, 1) = 1 LIMIT 1",
                            &[&session],
                        )?
                        .is_some())
                },
            )
        })
    }
}
