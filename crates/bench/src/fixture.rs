//! Builds a benchmark database of N retained units with raw SQL (fast), in
//! the shape the store itself writes, then lets `Store::open` adopt it.

use std::path::Path;

use retinue_testkit::workload::{child_session, children_of, parent_of, subagent_id, unit_id};
use rusqlite::{Connection, params};

/// Base time of the fixture.
pub(crate) const T0: f64 = 1_800_000_000.0;
/// Longest compression chain built (L0 … L100).
pub(crate) const CHAIN: usize = 100;
/// Ledger sizes for the totals benchmark.
pub(crate) const LEDGERS: [usize; 3] = [10, 1_000, 100_000];

pub(crate) fn payload(i: usize) -> String {
    let filler = "x".repeat(440);
    format!(
        "{{\"delegation_id\":\"deleg_{i:08x}\",\"status\":\"completed\",\"summary\":\"{filler}\"}}"
    )
}

/// Writes N units into the (already migrated) database at `path`. With
/// `all_live`, every unit is retained and untombstoned (the state a prune
/// collapses); otherwise all but the newest `max_retained` are tombstoned
/// by the cap, as a prune would have left them.
pub(crate) fn populate(
    path: &Path,
    n: usize,
    max_retained: usize,
    all_live: bool,
) -> rusqlite::Result<()> {
    let mut conn = Connection::open(path)?;
    conn.pragma_update(None, "synchronous", "OFF")?;
    let tx = conn.transaction()?;
    {
        let mut session = tx.prepare(
            "INSERT OR IGNORE INTO sessions (id, source, model_config, parent_session_id, started_at, ended_at, end_reason) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )?;
        for p in 0..64 {
            session.execute(params![
                format!("p-{p}"),
                "cli",
                None::<String>,
                None::<String>,
                T0,
                None::<f64>,
                None::<String>
            ])?;
        }
        session.execute(params![
            "stranger",
            "cli",
            None::<String>,
            None::<String>,
            T0,
            None::<f64>,
            None::<String>
        ])?;
        for l in 0..=CHAIN {
            let parent = (l > 0).then(|| format!("L{}", l - 1));
            let ended = (l < CHAIN).then_some(T0);
            let reason = (l < CHAIN).then_some("compression");
            session.execute(params![
                format!("L{l}"),
                "cli",
                None::<String>,
                parent,
                T0 + l as f64,
                ended,
                reason
            ])?;
        }
        let mut unit = tx.prepare(
            "INSERT INTO async_delegations (delegation_id, origin_session, origin_ui_session_id, parent_session_id, \
             state, dispatched_at, completed_at, updated_at, event_json, result_json, delivery_state, \
             delivery_attempts, origin_session_id, child_session_id, children_json, retained, retained_at, \
             tombstoned_at, owner_profile, usage_json) \
             VALUES (?1, ?2, '', ?2, 'completed', ?3, ?3, ?3, ?4, ?4, 'delivered', 0, ?2, ?5, ?6, 1, ?3, ?7, '', \
             '{\"cost_usd\":0.01}')",
        )?;
        let mut child = tx.prepare(
            "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, child_session_id, model, \
             goal, manifest_json, retained_at, tombstoned_at, tombstone_reason) \
             VALUES (?1, ?2, ?3, ?4, 'bench/model', 'goal', ?5, ?6, ?7, ?8)",
        )?;
        for i in 0..n {
            let id = unit_id(i);
            let parent = parent_of(i);
            let at = T0 + i as f64;
            let live = all_live || i + max_retained >= n;
            let tomb = (!live).then_some(at + 1.0);
            let kids: Vec<serde_json::Value> = (0..children_of(i))
                .map(|k| {
                    serde_json::json!({"subagent_id": subagent_id(i, k), "session_id": child_session(i, k),
                        "model": "bench/model", "goal": "goal"})
                })
                .collect();
            let lone = (kids.len() == 1).then(|| child_session(i, 0));
            unit.execute(params![
                id,
                parent,
                at,
                payload(i),
                lone,
                serde_json::Value::from(kids.clone()).to_string(),
                tomb
            ])?;
            for (k, manifest) in kids.iter().enumerate() {
                child.execute(params![
                    id,
                    k as i64,
                    subagent_id(i, k),
                    child_session(i, k),
                    manifest.to_string(),
                    at,
                    tomb,
                    tomb.map(|_| "cap")
                ])?;
                session.execute(params![
                    child_session(i, k),
                    "delegate",
                    format!("{{\"_delegate_from\":\"{parent}\"}}"),
                    parent,
                    at,
                    at,
                    "completed"
                ])?;
            }
        }
        let mut ledger = tx.prepare(
            "INSERT INTO delegation_child_usage (parent_session_id, parent_turn_id, child_session_id, usage_json, created_at) \
             VALUES (?1, '', ?2, '{\"cost_usd\":0.01,\"tokens\":{\"input\":10,\"output\":2}}', ?3)",
        )?;
        for size in LEDGERS {
            let parent = format!("ledger-{size}");
            for r in 0..size {
                ledger.execute(params![parent, format!("c{r}"), T0])?;
            }
            let max_id = tx.last_insert_rowid();
            tx.execute(
                "INSERT INTO retinue_usage_totals (parent_session_id, cost_usd, input_tokens, output_tokens, covered_id) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![parent, 0.01 * size as f64, 10.0 * size as f64, 2.0 * size as f64, max_id],
            )?;
        }
    }
    tx.commit()?;
    // Start the measurements from a checkpointed, empty WAL (as a long-running
    // process has), not from one holding the whole bulk load.
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    Ok(())
}
