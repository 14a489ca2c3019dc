//! The limits: the minimal bare SQL returning the same answer (or writing
//! the same rows) on the same server, on one open connection, each
//! statement prepared once — the SQLite bench's `limits.rs` in PostgreSQL.

use std::collections::HashMap;

use postgres::types::ToSql;
use postgres::{Client, NoTls, Statement};

/// The children of the newest `cap` ($2) live units, within the TTL ($1).
const LIST: &str = "SELECT c.delegation_id, c.child_index, c.subagent_id, c.child_session_id, \
             c.manifest_json, c.retained_at, u.parent_session_id, u.owner_profile, u.state, \
             u.completed_at \
             FROM (SELECT delegation_id, retained_at FROM async_delegations WHERE retained = 1 \
                   AND tombstoned_at IS NULL ORDER BY retained_at DESC, delegation_id DESC \
                   LIMIT $2) top \
             JOIN retinue_children c ON c.delegation_id = top.delegation_id \
             JOIN async_delegations u ON u.delegation_id = top.delegation_id \
             WHERE c.tombstoned_at IS NULL AND c.retained_at >= $1 \
             ORDER BY top.retained_at DESC, top.delegation_id DESC, c.child_index";

pub(crate) type Res<T> = Result<T, Box<dyn std::error::Error>>;

pub(crate) struct Limits {
    c: Client,
    cache: HashMap<String, Statement>,
    /// `BEGIN` of [`Limits::tx`]: the server's default isolation, unless
    /// set to `SERIALIZABLE` (the isolation the store's writes need).
    begin: &'static str,
}

impl Limits {
    /// A connection whose `search_path` is `schema`.
    pub(crate) fn open(url: &str, schema: &str) -> Res<Limits> {
        let mut c = Client::connect(url, NoTls)?;
        c.batch_execute(&format!("SET search_path TO {schema}"))?;
        Ok(Limits { c, cache: HashMap::new(), begin: "BEGIN" })
    }

    /// The raw client (seeding, plumbing).
    pub(crate) fn client(&mut self) -> &mut Client {
        &mut self.c
    }

    fn stmt(&mut self, sql: &str) -> Res<Statement> {
        if let Some(s) = self.cache.get(sql) {
            return Ok(s.clone());
        }
        let s = self.c.prepare(sql)?;
        self.cache.insert(sql.to_owned(), s.clone());
        Ok(s)
    }

    fn rows(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Res<usize> {
        let s = self.stmt(sql)?;
        Ok(self.c.query(&s, params)?.len())
    }

    fn exec(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Res<u64> {
        let s = self.stmt(sql)?;
        Ok(self.c.execute(&s, params)?)
    }

    /// `f` in one bare transaction (`BEGIN` … `COMMIT`, the server's default
    /// isolation), rolled back on error.
    fn tx<T>(&mut self, f: impl FnOnce(&mut Limits) -> Res<T>) -> Res<T> {
        self.c.batch_execute(self.begin)?;
        match f(self) {
            Ok(v) => {
                self.c.batch_execute("COMMIT")?;
                Ok(v)
            }
            Err(e) => {
                let _ = self.c.batch_execute("ROLLBACK");
                Err(e)
            }
        }
    }

    /// Opening: a fresh connection to the schema, then one trivial query.
    pub(crate) fn open_limit(url: &str, schema: &str) -> Res<()> {
        let mut c = Client::connect(url, NoTls)?;
        c.batch_execute(&format!("SET search_path TO {schema}; SELECT 1"))?;
        Ok(())
    }

    /// The newest addressable child matching `column` = `id`.
    pub(crate) fn find(&mut self, column: &str, id: &str, cutoff: f64) -> Res<usize> {
        let sql = format!(
            "SELECT c.delegation_id, c.child_index, c.subagent_id, c.child_session_id, \
             c.manifest_json, c.retained_at, u.parent_session_id, u.owner_profile, u.state, \
             u.completed_at FROM retinue_children c \
             JOIN async_delegations u ON u.delegation_id = c.delegation_id \
             WHERE c.{column} = $1 AND c.tombstoned_at IS NULL AND u.retained = 1 \
             AND u.tombstoned_at IS NULL AND c.retained_at >= $2 \
             ORDER BY u.retained_at DESC LIMIT 1"
        );
        self.rows(&sql, &[&id, &cutoff])
    }

    /// The children of the newest `cap` live units, within the TTL.
    pub(crate) fn list(&mut self, cutoff: f64, cap: i64) -> Res<usize> {
        self.rows(LIST, &[&cutoff, &cap])
    }

    /// Every live child (all N units live, no cap): the old PostgreSQL list
    /// row's limit, with the columns an answer has (as [`Limits::list`]'s).
    pub(crate) fn list_all(&mut self) -> Res<usize> {
        self.rows(
            "SELECT c.delegation_id, c.child_index, c.subagent_id, c.child_session_id, \
             c.manifest_json, c.retained_at, u.parent_session_id, u.owner_profile, u.state, \
             u.completed_at FROM async_delegations u \
             JOIN retinue_children c ON c.delegation_id = u.delegation_id WHERE u.retained = 1 \
             AND u.tombstoned_at IS NULL AND c.tombstoned_at IS NULL \
             ORDER BY u.retained_at DESC, u.delegation_id DESC, c.child_index",
            &[],
        )
    }

    /// The rows an authority check must read (semantics §5.2, as the
    /// lineage walk reads them): each start's ancestors, up to 100 links,
    /// and their parents' children, with the columns the rule reads. (Each
    /// step a primary-key probe: a plain join was planned as a hash join
    /// over every session, 15 ms at depth 99.)
    pub(crate) fn neighbourhoods(&mut self, starts: &[&str]) -> Res<usize> {
        let starts: Vec<&str> = starts.to_vec();
        self.rows(
            "WITH RECURSIVE up(id, source, model_config, parent_session_id, end_reason, n) AS ( \
               SELECT id, source, model_config, parent_session_id, end_reason, 0 FROM sessions \
               WHERE id = ANY($1) \
               UNION ALL SELECT s.id, s.source, s.model_config, s.parent_session_id, \
               s.end_reason, up.n + 1 FROM up CROSS JOIN LATERAL (SELECT * FROM sessions x \
               WHERE x.id = up.parent_session_id LIMIT 1) s WHERE up.n < 100) \
             SELECT id, source, model_config, parent_session_id, end_reason FROM up \
             UNION ALL SELECT s.id, s.source, s.model_config, s.parent_session_id, s.end_reason \
             FROM sessions s WHERE s.parent_session_id = ANY (ARRAY( \
               SELECT parent_session_id FROM up WHERE parent_session_id IS NOT NULL)) \
             AND s.id NOT IN (SELECT id FROM up)",
            &[&starts],
        )
    }

    /// The floor of an owner-scoped list: [`Limits::list`], then (the
    /// spawners are known only from its rows) the neighbourhoods of the
    /// requester and every distinct spawner, whose lineages the rule compares.
    pub(crate) fn list_then_lineage(&mut self, cutoff: f64, cap: i64, owner: &str) -> Res<usize> {
        let s = self.stmt(LIST)?;
        let rows = self.c.query(&s, &[&cutoff, &cap])?;
        let mut starts: Vec<String> = vec![owner.to_owned()];
        for r in &rows {
            if let Some(p) = r.try_get::<_, Option<String>>(6)?
                && !starts.contains(&p)
            {
                starts.push(p);
            }
        }
        let starts: Vec<&str> = starts.iter().map(String::as_str).collect();
        Ok(rows.len() + self.neighbourhoods(&starts)?)
    }

    /// The session and its ancestors, up to 100 links.
    pub(crate) fn chain(&mut self, session: &str) -> Res<usize> {
        self.rows(
            "WITH RECURSIVE up(id, parent, source, n) AS ( \
               SELECT id, parent_session_id, source, 0 FROM sessions WHERE id = $1 \
               UNION ALL SELECT s.id, s.parent_session_id, s.source, up.n + 1 FROM sessions s \
               JOIN up ON s.id = up.parent WHERE up.n < 100) \
             SELECT id, source FROM up",
            &[&session],
        )
    }

    /// The maintained totals row.
    pub(crate) fn totals(&mut self, parent: &str) -> Res<usize> {
        self.rows(
            "SELECT cost_usd, input_tokens, output_tokens FROM retinue_usage_totals \
             WHERE parent_session_id = $1",
            &[&parent],
        )
    }

    /// "Is any live child of a live retained unit past its TTL?" (The SQLite
    /// limit's `EXISTS` gets a generic plan that scans the table here: the
    /// oldest live child through the TTL index instead.)
    pub(crate) fn prune_noop(&mut self, cutoff: f64) -> Res<usize> {
        self.rows(
            "SELECT (SELECT c.retained_at FROM retinue_children c \
             JOIN async_delegations u ON u.delegation_id = c.delegation_id \
             WHERE c.tombstoned_at IS NULL AND c.retained_at < $1 \
             AND u.retained = 1 AND u.tombstoned_at IS NULL \
             ORDER BY c.retained_at LIMIT 1) IS NOT NULL",
            &[&cutoff],
        )
    }

    fn children_and_sessions(&mut self, tag: &str, now: f64, retained: bool) -> Res<()> {
        let id = format!("deleg_{tag}");
        let at = retained.then_some(now);
        for k in 0..2i64 {
            self.exec(
                "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, \
                 child_session_id, manifest_json, retained_at) VALUES ($1, $2, $3, $4, '{}', $5)",
                &[&id, &k, &format!("sa-{k}-{tag}"), &format!("cs-{tag}-{k}"), &at],
            )?;
            self.exec(
                "INSERT INTO sessions (id, source, model_config, parent_session_id, started_at) \
                 VALUES ($1, 'delegate', '{}', 'p-1', $2)",
                &[&format!("cs-{tag}-{k}"), &now],
            )?;
        }
        Ok(())
    }

    /// The retain's cap as bare SQL, in one statement: the live units
    /// beyond the newest 10 of the profile (one, in steady state) and their
    /// live children tombstoned — the rows the store's retain writes too.
    fn cap(&mut self, now: f64) -> Res<()> {
        self.exec(
            "WITH o AS (UPDATE async_delegations SET tombstoned_at = $1, updated_at = $1 \
               WHERE delegation_id IN (SELECT delegation_id FROM async_delegations \
                 WHERE retained = 1 AND tombstoned_at IS NULL AND COALESCE(owner_profile, '') = '' \
                 ORDER BY COALESCE(owner_profile, ''), retained_at DESC NULLS LAST, \
                   delegation_id DESC OFFSET 10) RETURNING delegation_id) \
             UPDATE retinue_children SET tombstoned_at = $1, tombstone_reason = 'cap' \
             WHERE tombstoned_at IS NULL AND delegation_id IN (SELECT delegation_id FROM o)",
            &[&now],
        )?;
        Ok(())
    }

    /// One bare transaction writing a retained unit with two children and
    /// their sessions, and the cap it pushes out.
    pub(crate) fn write_unit(&mut self, tag: &str, now: f64) -> Res<()> {
        self.tx(|l| {
            l.exec(
                "INSERT INTO async_delegations (delegation_id, origin_session, \
                 parent_session_id, state, dispatched_at, updated_at, task_json, children_json, \
                 retained, retained_at, owner_profile) VALUES ($1, 'p-1', 'p-1', 'completed', \
                 $2, $2, '{}', '[]', 1, $2, '')",
                &[&format!("deleg_{tag}"), &now],
            )?;
            l.children_and_sessions(tag, now, true)?;
            l.cap(now)
        })
    }

    /// Two bare transactions, as the real flow needs (dispatch before the
    /// children run, retain after): the unit with its manifest and sessions,
    /// then the retain with the cap it pushes out.
    pub(crate) fn write_unit_two_commits(&mut self, tag: &str, now: f64) -> Res<()> {
        self.dispatch(tag, now)?;
        self.retain(tag, now)
    }

    /// The first of [`Limits::write_unit_two_commits`]' transactions: the
    /// unit, its manifest and its sessions.
    pub(crate) fn dispatch(&mut self, tag: &str, now: f64) -> Res<()> {
        let id = format!("deleg_{tag}");
        self.tx(|l| {
            l.exec(
                "INSERT INTO async_delegations (delegation_id, origin_session, \
                 parent_session_id, state, dispatched_at, updated_at, task_json, children_json, \
                 owner_profile) VALUES ($1, 'p-1', 'p-1', 'running', $2, $2, '{}', '[]', '')",
                &[&id, &now],
            )?;
            l.children_and_sessions(tag, now, false)
        })
    }

    /// The second: the retain and the cap it pushes out.
    pub(crate) fn retain(&mut self, tag: &str, now: f64) -> Res<()> {
        let id = format!("deleg_{tag}");
        self.tx(|l| {
            l.exec(
                "UPDATE async_delegations SET retained = 1, retained_at = $2, updated_at = $2 \
                 WHERE delegation_id = $1",
                &[&id, &now],
            )?;
            l.exec(
                "UPDATE retinue_children SET retained_at = $2 WHERE delegation_id = $1",
                &[&id, &now],
            )?;
            l.cap(now)
        })
    }

    /// [`Limits::write_unit_two_commits`] with both transactions
    /// `SERIALIZABLE`, the isolation the store's writes run at (so that
    /// concurrent retains of one tenant cannot both miss the cap).
    pub(crate) fn write_unit_two_serializable_commits(&mut self, tag: &str, now: f64) -> Res<()> {
        self.begin = "BEGIN ISOLATION LEVEL SERIALIZABLE";
        let r = self.write_unit_two_commits(tag, now);
        self.begin = "BEGIN";
        r
    }

    /// One bare transaction: a ledger row, its key and the totals.
    pub(crate) fn record(&mut self, i: usize) -> Res<()> {
        self.tx(|l| {
            let s = l.stmt(
                "INSERT INTO delegation_child_usage (parent_session_id, child_session_id, \
                 usage_json, created_at) VALUES ('lim-rec', $1, '{\"cost_usd\":0.01}', 0) \
                 RETURNING id",
            )?;
            let id: i64 = l.c.query_one(&s, &[&format!("c{i}")])?.try_get(0)?;
            l.exec(
                "INSERT INTO retinue_usage_keys (attribution_key, usage_id, created_at) \
                 VALUES ($1, $2, 0)",
                &[&format!("lim:{i}"), &id],
            )?;
            l.exec(
                "INSERT INTO retinue_usage_totals (parent_session_id, cost_usd, covered_id) \
                 VALUES ('lim-rec', 0.01, $1) ON CONFLICT (parent_session_id) DO UPDATE \
                 SET cost_usd = retinue_usage_totals.cost_usd + 0.01, covered_id = $1",
                &[&id],
            )?;
            Ok(())
        })
    }

    /// One bare transaction tombstoning one child written by `write_unit`.
    pub(crate) fn tombstone(&mut self, subagent_id: &str, now: f64) -> Res<()> {
        self.tx(|l| {
            l.exec(
                "UPDATE retinue_children SET tombstoned_at = $1, tombstone_reason = 'manual' \
                 WHERE subagent_id = $2 AND tombstoned_at IS NULL",
                &[&now, &subagent_id],
            )?;
            Ok(())
        })
    }

    /// The floor of a tombstone as the contract needs it: the id resolved
    /// (the find's bare SELECT: a tombstone takes exactly the row a lookup
    /// shows) and the child's bare UPDATE, in one `SERIALIZABLE` transaction
    /// (so that a concurrent retain or prune cannot interleave).
    pub(crate) fn tombstone_resolved(
        &mut self,
        subagent_id: &str,
        now: f64,
        cutoff: f64,
    ) -> Res<()> {
        self.c.batch_execute("BEGIN ISOLATION LEVEL SERIALIZABLE")?;
        let r = (|| -> Res<()> {
            if self.find("subagent_id", subagent_id, cutoff)? != 1 {
                return Err("tombstone floor: not found".into());
            }
            self.exec(
                "UPDATE retinue_children SET tombstoned_at = $1, tombstone_reason = 'manual' \
                 WHERE subagent_id = $2 AND tombstoned_at IS NULL",
                &[&now, &subagent_id],
            )?;
            Ok(())
        })();
        self.c.batch_execute(if r.is_ok() { "COMMIT" } else { "ROLLBACK" })?;
        r
    }

    /// Moves a unit's retention `secs` into the past (unit and children).
    pub(crate) fn age(&mut self, id: &str, secs: f64) -> Res<()> {
        self.tx(|l| {
            l.exec(
                "UPDATE async_delegations SET retained_at = retained_at - $2 \
                 WHERE delegation_id = $1",
                &[&id, &secs],
            )?;
            l.exec(
                "UPDATE retinue_children SET retained_at = retained_at - $2 \
                 WHERE delegation_id = $1",
                &[&id, &secs],
            )?;
            Ok(())
        })
    }

    /// Retains a unit as a writer that does not prune would: the flag and
    /// time of the unit and its children (the server's triggers count it
    /// live), no prune.
    pub(crate) fn retain_raw(&mut self, id: &str, now: f64) -> Res<()> {
        self.tx(|l| {
            l.exec(
                "UPDATE async_delegations SET retained = 1, retained_at = $2, updated_at = $2 \
                 WHERE delegation_id = $1",
                &[&id, &now],
            )?;
            l.exec(
                "UPDATE retinue_children SET retained_at = $2 WHERE delegation_id = $1",
                &[&id, &now],
            )?;
            Ok(())
        })
    }

    /// The cap collapse to `keep` units as two bare set-based UPDATEs in one transaction.
    pub(crate) fn collapse(&mut self, keep: i64, now: f64) -> Res<u64> {
        const OVER: &str = "SELECT delegation_id FROM async_delegations WHERE retained = 1 \
             AND tombstoned_at IS NULL ORDER BY retained_at DESC, delegation_id DESC OFFSET $2";
        self.tx(|l| {
            l.c.execute(
                &format!(
                    "UPDATE retinue_children SET tombstoned_at = $1, tombstone_reason = 'cap' \
                     WHERE tombstoned_at IS NULL AND delegation_id IN ({OVER})"
                ),
                &[&now, &keep],
            )?;
            Ok(l.c.execute(
                &format!(
                    "UPDATE async_delegations SET tombstoned_at = $1, updated_at = $1 \
                     WHERE delegation_id IN ({OVER})"
                ),
                &[&now, &keep],
            )?)
        })
    }

    /// The floor: the unit rows' `tombstoned_at` (and `updated_at`) alone,
    /// one bare UPDATE in one transaction.
    pub(crate) fn collapse_units_only(&mut self, keep: i64, now: f64) -> Res<u64> {
        self.tx(|l| {
            Ok(l.c.execute(
                "UPDATE async_delegations SET tombstoned_at = $1, updated_at = $1 \
                 WHERE delegation_id IN (SELECT delegation_id FROM async_delegations \
                 WHERE retained = 1 AND tombstoned_at IS NULL \
                 ORDER BY retained_at DESC, delegation_id DESC OFFSET $2)",
                &[&now, &keep],
            )?)
        })
    }

    /// Takes and releases one child's resume claim (two bare commits).
    pub(crate) fn claim_release(&mut self, id: &str) -> Res<()> {
        self.exec(
            "UPDATE retinue_children SET resume_claim = 'x', resume_claimed_at = 0 \
             WHERE delegation_id = $1 AND child_index = 0",
            &[&id],
        )?;
        self.exec(
            "UPDATE retinue_children SET resume_claim = NULL, resume_claimed_at = NULL \
             WHERE delegation_id = $1 AND child_index = 0",
            &[&id],
        )?;
        Ok(())
    }

    /// Total size of the schema's tables and indexes, in KiB.
    pub(crate) fn schema_kib(&mut self, schema: &str) -> Res<i64> {
        Ok(self
            .c
            .query_one(
                "SELECT (COALESCE(sum(pg_total_relation_size(c.oid)), 0) / 1024)::bigint \
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relkind = 'r'",
                &[&schema],
            )?
            .try_get(0)?)
    }
}
