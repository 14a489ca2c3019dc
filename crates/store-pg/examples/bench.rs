//! The PostgreSQL rows of the benchmark (`cargo xtask bench --backend pg`):
//! each registry operation through `PgStore` against its *limit*, the
//! minimal bare SQL giving the same answer on the same server (one prepared
//! statement on one open connection). `--quick`: N = 1,000, else 10,000.
//! Needs `RETINUE_PG_URL`; works in a scratch schema it drops at the end
//! (`--keep`: leaves it, to look at plans with `EXPLAIN`).

use std::time::Instant;

use retinue_store::{
    AttributionDraft, Claims, RegistryRead, ResumeClaim, Retention, TotalsUpdate, UsageLedger,
};
use retinue_store_pg::{PgOptions, PgStore};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn time(iters: usize, mut f: impl FnMut(usize)) -> f64 {
    (0..iters)
        .map(|i| {
            let t = Instant::now();
            f(i);
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect::<Vec<_>>()
        .pipe(median)
}

trait Pipe: Sized {
    fn pipe<T>(self, f: impl FnOnce(Self) -> T) -> T {
        f(self)
    }
}
impl<T> Pipe for T {}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("RETINUE_PG_URL").map_err(|_| "RETINUE_PG_URL is unset")?;
    let quick = std::env::args().any(|a| a == "--quick");
    let n: i64 = if quick { 1_000 } else { 10_000 };
    let iters = if quick { 200 } else { 1_000 };
    let schema = format!("bench_{}", std::process::id());
    let _ = PgStore::drop_schema(&url, &schema);
    let opts = PgOptions::default().with_schema(&schema);
    let mut d = opts.config.delegation.clone();
    d.max_retained = u32::try_from(n * 2)?;
    let store = PgStore::open(&url, opts.with_delegation(d))?;

    // Bare connection for the seed and the limits.
    let mut bare = postgres::Client::connect(&url, postgres::NoTls)?;
    bare.batch_execute(&format!("SET search_path TO {schema}"))?;
    let now = store.clock().now();
    bare.execute(
        "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, state, \
         dispatched_at, updated_at, completed_at, retained, retained_at, owner_profile, \
         children_json) SELECT 'deleg_' || lpad(i::text, 8, '0'), 'o', 'P' || (i % 100), \
         'completed', $1, $1, $1, 1, $1::float8 - i, '', '[]' FROM generate_series(1::bigint, $2) i",
        &[&now, &n],
    )?;
    bare.execute(
        "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, child_session_id, \
         manifest_json, retained_at) SELECT 'deleg_' || lpad(i::text, 8, '0'), 0, \
         'sa-0-' || lpad(i::text, 8, '0'), 'cs-' || i, '{}', $1::float8 - i \
         FROM generate_series(1::bigint, $2) i",
        &[&now, &n],
    )?;
    // The per-profile live count, as the retains that would have made these units leave it.
    bare.execute(
        "INSERT INTO retinue_profile_live (profile, units) VALUES ('', $1) \
         ON CONFLICT (profile) DO UPDATE SET units = EXCLUDED.units",
        &[&n],
    )?;
    // As autovacuum leaves a settled table: statistics and the visibility map.
    bare.batch_execute("VACUUM ANALYZE")?;
    let pick = |i: usize| format!("{:08}", (i as i64 * 7919) % n + 1);

    let mut rows: Vec<(&str, f64, f64)> = Vec::new();
    let find = bare.prepare(
        "SELECT c.delegation_id, c.child_index, c.manifest_json, u.retained_at FROM \
         retinue_children c JOIN async_delegations u ON u.delegation_id = c.delegation_id \
         WHERE c.subagent_id = $1",
    )?;
    let ours = time(iters, |i| {
        let _ = store.find_retained_child(&format!("sa-0-{}", pick(i)));
    });
    let limit = time(iters, |i| {
        let _ = bare.query(&find, &[&format!("sa-0-{}", pick(i))]);
    });
    rows.push(("find a child by subagent id", ours, limit));

    let ours = time(iters, |_| {
        let _ = store.find_retained_child("nope");
    });
    let limit = time(iters, |_| {
        let _ = bare.query(&find, &[&"nope"]);
    });
    rows.push(("find a miss", ours, limit));

    let list_iters = (iters / 20).max(10);
    let list = bare.prepare(
        "SELECT c.delegation_id, c.child_index, c.manifest_json FROM async_delegations u JOIN \
         retinue_children c ON c.delegation_id = u.delegation_id WHERE u.retained = 1 AND \
         u.tombstoned_at IS NULL AND c.tombstoned_at IS NULL \
         ORDER BY u.retained_at DESC, u.delegation_id DESC, c.child_index",
    )?;
    let ours = time(list_iters, |_| {
        let _ = store.list_retained_children();
    });
    let limit = time(list_iters, |_| {
        let _ = bare.query(&list, &[]);
    });
    rows.push(("list every addressable child", ours, limit));

    let due = bare.prepare("SELECT 1")?;
    let ours = time(iters, |_| {
        let _ = store.prune_retained_children(None, None);
    });
    let limit = time(iters, |_| {
        let _ = bare.query(&due, &[]);
    });
    rows.push(("prune with nothing due (no write)", ours, limit));

    let ours = time(iters, |i| {
        let draft = AttributionDraft {
            parent_session_id: "P1".into(),
            usage: serde_json::json!({"cost_usd": 0.01}),
            key: Some(format!("k{i}")),
            ..AttributionDraft::default()
        };
        let _ = store.record_usage(&draft, &TotalsUpdate::default());
    });
    let limit = time(iters, |_| {
        let _ = bare.execute(
            "INSERT INTO delegation_child_usage (parent_session_id, usage_json, created_at) \
             VALUES ('P2', '{}', 0)",
            &[],
        );
    });
    rows.push(("record one keyed attribution (commit)", ours, limit));

    let ours = time(iters, |i| {
        let id = format!("deleg_{}", pick(i));
        if let Ok(ResumeClaim::Claimed { token }) = store.claim_resume(&id, 0) {
            let _ = store.release_resume(&id, 0, &token);
        }
    });
    let limit = time(iters, |i| {
        let id = format!("deleg_{}", pick(i));
        let _ = bare.execute(
            "UPDATE retinue_children SET resume_claim = 'x', resume_claimed_at = 0 \
             WHERE delegation_id = $1 AND child_index = 0",
            &[&id],
        );
        let _ = bare.execute(
            "UPDATE retinue_children SET resume_claim = NULL, resume_claimed_at = NULL \
             WHERE delegation_id = $1 AND child_index = 0",
            &[&id],
        );
    });
    rows.push(("resume claim + release (2 commits)", ours, limit));

    println!("PostgreSQL, N = {n} retained units, medians (µs):\n");
    println!("| operation | Retinue | limit | ratio |\n|---|---|---|---|");
    for (op, ours, limit) in rows {
        println!("| {op} | {ours:.0} | {limit:.0} | {:.2} |", ours / limit);
    }
    drop(store);
    if std::env::args().any(|a| a == "--keep") {
        println!("\nkept schema {schema} (drop it with DROP SCHEMA {schema} CASCADE)");
    } else {
        PgStore::drop_schema(&url, &schema)?;
    }
    Ok(())
}
