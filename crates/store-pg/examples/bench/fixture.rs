//! The benchmark's data, written with bare set-based SQL (fast) in the shape
//! the store itself writes, as the SQLite bench's `fixture.rs` builds its
//! `state.db`: N retained units with 1–3 children each, ~512-byte event and
//! result payloads, one `sessions` row per child (parent `p-{i % 64}`), a
//! 101-session compression chain L0 … L100, a `stranger` session and
//! ledgers of 10, 1,000 and 100,000 rows with their maintained totals.

/// Base time of the fixture.
pub(crate) const T0: f64 = 1_800_000_000.0;
/// Ledger sizes for the totals rows.
pub(crate) const LEDGERS: [usize; 3] = [10, 1_000, 100_000];

/// Writes N units into the (already migrated) schema the client's
/// `search_path` points at. Units `live_from..N` are live; the older ones
/// are tombstoned by the cap, as a prune would have left them (`live_from`
/// = N − 10 for the main fixture, 0 for the collapse's all-live copies).
/// With `ledgers`, also the ledgers. Ends with `VACUUM ANALYZE`. Unit `i`
/// has `i % spread + 1` children (3: 1–3, two on average, as the SQLite
/// bench; 5: 1–5, three on average, the scale run's 3·N children).
pub(crate) fn populate(
    c: &mut postgres::Client,
    n: usize,
    live_from: usize,
    ledgers: bool,
    spread: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let units = format!(
        "(SELECT i, lpad(to_hex(i), 8, '0') AS h, 'p-' || (i % 64) AS p, {T0}::float8 + i AS at, \
         CASE WHEN i >= {live_from} THEN NULL ELSE {T0}::float8 + i + 1 END AS tomb \
         FROM generate_series(0::bigint, {n}::bigint - 1) i) s"
    );
    let manifest = "json_build_object('subagent_id', 'sa-' || k || '-' || h, 'session_id', \
         'cs-' || h || '-' || k, 'model', 'bench/model', 'goal', 'goal')";
    // The live count is written once at the end (exact, stripe 0), not
    // by the counting trigger once per row.
    c.batch_execute(&format!(
        "BEGIN;
         ALTER TABLE async_delegations DISABLE TRIGGER retinue_live_insert;
         INSERT INTO sessions (id, source, started_at)
           SELECT 'p-' || p, 'cli', {T0} FROM generate_series(0, 63) p;
         INSERT INTO sessions (id, source, started_at) VALUES ('stranger', 'cli', {T0});
         INSERT INTO sessions (id, source, parent_session_id, started_at, ended_at, end_reason)
           SELECT 'L' || l, 'cli', CASE WHEN l > 0 THEN 'L' || (l - 1) END, {T0}::float8 + l,
             CASE WHEN l < 100 THEN {T0}::float8 END, CASE WHEN l < 100 THEN 'compression' END
           FROM generate_series(0, 100) l;
         INSERT INTO async_delegations (delegation_id, origin_session, origin_ui_session_id,
             parent_session_id, state, dispatched_at, completed_at, updated_at, event_json,
             result_json, delivery_state, delivery_attempts, origin_session_id, child_session_id,
             children_json, retained, retained_at, tombstoned_at, owner_profile, usage_json)
           SELECT 'deleg_' || h, p, '', p, 'completed', at, at, at, pl, pl, 'delivered', 0, p,
             CASE WHEN i % {spread} = 0 THEN 'cs-' || h || '-0' END,
             (SELECT json_agg({manifest} ORDER BY k)::text FROM generate_series(0, i % {spread}) k),
             1, at, tomb, '', '{{\"cost_usd\":0.01}}'
           FROM (SELECT *, '{{\"delegation_id\":\"deleg_' || h || '\",\"status\":\"completed\",\
\"summary\":\"' || repeat('x', 440) || '\"}}' AS pl FROM {units}) s;
         INSERT INTO retinue_children (delegation_id, child_index, subagent_id, child_session_id,
             model, goal, manifest_json, retained_at, tombstoned_at, tombstone_reason)
           SELECT 'deleg_' || h, k, 'sa-' || k || '-' || h, 'cs-' || h || '-' || k, 'bench/model',
             'goal', {manifest}::text, at, tomb, CASE WHEN tomb IS NOT NULL THEN 'cap' END
           FROM {units}, generate_series(0, s.i % {spread}) k;
         INSERT INTO sessions (id, source, model_config, parent_session_id, started_at, ended_at,
             end_reason)
           SELECT 'cs-' || h || '-' || k, 'delegate', '{{\"_delegate_from\":\"' || p || '\"}}', p,
             at, at, 'completed'
           FROM {units}, generate_series(0, s.i % {spread}) k;
         ALTER TABLE async_delegations ENABLE TRIGGER retinue_live_insert;
         DELETE FROM retinue_profile_live;
         INSERT INTO retinue_profile_live (profile, stripe, units)
           SELECT '', 0, count(*) FROM async_delegations WHERE retained = 1 AND tombstoned_at IS NULL;
         COMMIT;"
    ))?;
    if ledgers {
        for size in LEDGERS {
            c.batch_execute(&format!(
                "BEGIN;
                 INSERT INTO delegation_child_usage (parent_session_id, parent_turn_id,
                     child_session_id, usage_json, created_at)
                   SELECT 'ledger-{size}', '', 'c' || r,
                     '{{\"cost_usd\":0.01,\"tokens\":{{\"input\":10,\"output\":2}}}}', {T0}
                   FROM generate_series(0, {size} - 1) r;
                 INSERT INTO retinue_usage_totals (parent_session_id, cost_usd, input_tokens,
                     output_tokens, covered_id)
                   SELECT 'ledger-{size}', 0.01 * {size}, 10 * {size}, 2 * {size}, max(id)
                   FROM delegation_child_usage WHERE parent_session_id = 'ledger-{size}';
                 COMMIT;"
            ))?;
        }
    }
    // As autovacuum leaves a settled table: statistics and the visibility map.
    c.batch_execute("VACUUM ANALYZE")?;
    Ok(())
}
