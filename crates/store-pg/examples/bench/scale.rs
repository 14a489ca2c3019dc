//! The scale rows (`--scale`): the registry at N = 10⁴ … 10⁶ units with
//! 1–5 children each (3·N children and child sessions), the newest 10 live,
//! as the main fixture otherwise. For each N: find (hit and miss), the
//! operator and owner-scoped lists, authority at depth 99, prune with
//! nothing due and the write path, each against its limit; the size of each
//! table and its indexes; with `--explain FILE`, the plans of the hot
//! statements at the largest N (`explain.rs`).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use retinue_core::{
    Claims, Clock, ManualClock, RegistryRead, ResumeClaim, Retention, TombstoneReason,
    UnitLifecycle,
};
use retinue_lineage::{Authority, LineageAuthority};
use retinue_store_pg::{PgOptions, PgStore};
use retinue_testkit::workload::{draft, parent_of, subagent_id};
use retinue_usage::AttributionDraft;
use serde_json::json;

use crate::fixture::T0;
use crate::limits::{Limits, Res};
use crate::{explain, interleaved, ok, pair};

/// One measured row at one N.
struct Row {
    n: usize,
    op: &'static str,
    ours: f64,
    limit: Option<f64>,
}

/// One explained operation.
type Op<'a> = Box<dyn FnMut() -> Res<()> + 'a>;

/// The size of one table at one N: (table, heap + TOAST KiB, indexes KiB).
type Sizes = Vec<(String, i64, i64)>;

pub(crate) fn run(
    url: &str,
    sizes: &[usize],
    quick: bool,
    json_out: Option<&str>,
    explain_out: Option<&String>,
    keep: bool,
) -> Res<()> {
    if explain_out.is_some() {
        explain::install()?;
    }
    let (reads, writes) = if quick { (200, 20) } else { (1_000, 200) };
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let mut rows: Vec<Row> = Vec::new();
    let mut tables: Vec<(usize, Sizes)> = Vec::new();
    for &n in sizes {
        if n < 200 {
            return Err("--n: at least 200 units".into());
        }
        let schema = format!("scale_{}_{n}", std::process::id());
        let _ = PgStore::drop_schema(url, &schema);
        let clock = Arc::new(ManualClock::new(T0 + n as f64 + 10.0));
        let opts = PgOptions::default().with_clock(clock.clone()).with_schema(&schema);
        let cap = i64::from(opts.retention.max_retained);
        let cutoff = clock.now() - opts.retention.ttl_hours * 3600.0;
        let store = Arc::new(PgStore::open(url, opts.clone())?);
        let mut lim = Limits::open(url, &schema)?;
        let started = Instant::now();
        crate::fixture::populate(lim.client(), n, n - 10, true, 5)?;
        eprintln!("built N={n} in {:.1}s", started.elapsed().as_secs_f64());
        let mut push = |op: &'static str, ours: f64, limit: Option<f64>| {
            let ratio = limit.map_or("-".to_owned(), |l| format!("{:.2}", ours / l));
            eprintln!("N={n:<8} {op:<40} {ours:>10.0} {:>10.0} {ratio:>6}", limit.unwrap_or(0.0));
            rows.push(Row { n, op, ours, limit });
        };
        let newest = n - 1;

        let hit = subagent_id(newest, 0);
        if store.find_retained_child(&hit)?.is_none() || lim.find("subagent_id", &hit, cutoff)? != 1
        {
            return Err(format!("N={n}: the newest child is not found").into());
        }
        let (ours, limit) = pair(
            reads,
            |_| ok(store.find_retained_child(&hit)),
            |_| ok(lim.find("subagent_id", &hit, cutoff)),
        )?;
        push("find by subagent id", ours, Some(limit));
        let miss = "sa-9-ffffffff";
        let (ours, limit) = pair(
            reads,
            |_| ok(store.find_retained_child(miss)),
            |_| ok(lim.find("subagent_id", miss, cutoff)),
        )?;
        push("find miss", ours, Some(limit));

        let listed = store.list_retained_children()?.len();
        if listed == 0 || listed != lim.list(cutoff, cap)? {
            return Err(
                format!("N={n}: operator list: {listed} children, the limit disagrees").into()
            );
        }
        let authority = Authority::new(store.clone(), store.clone(), "");
        let owner = parent_of(newest);
        if authority.list_for(Some(&owner))?.is_empty() {
            return Err(format!("N={n}: owner-scoped list is empty").into());
        }
        let v = interleaved(
            reads,
            &mut [
                &mut |_| ok(store.list_retained_children()),
                &mut |_| ok(lim.list(cutoff, cap)),
                &mut |_| ok(authority.list_for(Some(&owner))),
            ],
        )?;
        push("operator list", v[0], Some(v[1]));
        push("owner-scoped list", v[2], Some(v[1]));

        let mut entry = store.find_retained_child(&hit)?.ok_or("fixture child missing")?;
        entry.parent_session_id = "L0".into();
        if authority.check_follow_up_authority(&entry, Some("L99")).is_err() {
            return Err(format!("N={n}: authority at depth 99 denied").into());
        }
        let (ours, limit) = pair(
            reads,
            |_| {
                let _ = authority.check_follow_up_authority(&entry, Some("L99"));
                Ok(())
            },
            |_| ok(lim.chain("L99")),
        )?;
        push("authority, depth 99", ours, Some(limit));

        if store.prune_retained_children(None, None)?.units != 0 {
            return Err(format!("N={n}: prune, nothing to do: something was due").into());
        }
        let (ours, limit) = pair(
            reads.min(500),
            |_| ok(store.prune_retained_children(None, None)),
            |_| ok(lim.prune_noop(cutoff)),
        )?;
        push("prune, nothing to do", ours, Some(limit));

        let now = clock.now();
        let (ours, limit) = pair(
            writes,
            |i| {
                let id = store.insert_unit(&draft(&format!("w{i:06}"), "p-1"))?;
                ok(store.retain_completed_delegation(&id, None))
            },
            |i| lim.write_unit_two_commits(&format!("W{i:06}"), now),
        )?;
        push("write path (two bare commits)", ours, Some(limit));
        store.prune_retained_children(None, None)?;

        tables.push((n, table_sizes(&mut lim, &schema)?));
        if n == largest
            && let Some(file) = explain_out
        {
            write_plans(url, &opts, &clock, &store, &entry, n, file)?;
        }
        drop((store, lim));
        if !keep {
            PgStore::drop_schema(url, &schema)?;
        }
    }
    print_tables(sizes, &rows, &tables);
    if let Some(file) = json_out {
        let figures: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| json!({"n": r.n, "op": r.op, "median_us": r.ours, "limit_median_us": r.limit}))
            .collect();
        let sizes: Vec<serde_json::Value> = tables
            .iter()
            .flat_map(|(n, t)| {
                t.iter().map(move |(table, heap, idx)| {
                    json!({"n": n, "table": table, "table_kib": heap, "indexes_kib": idx})
                })
            })
            .collect();
        let doc = json!({
            "backend": "postgresql",
            "scale": true,
            "reads": reads,
            "writes": writes,
            "figures": figures,
            "sizes": sizes,
        });
        std::fs::write(file, serde_json::to_string_pretty(&doc)?)?;
        eprintln!("wrote {file}");
    }
    Ok(())
}

fn table_sizes(lim: &mut Limits, schema: &str) -> Res<Sizes> {
    let rows = lim.client().query(
        "SELECT c.relname::text, (pg_table_size(c.oid) / 1024)::bigint, \
           (pg_indexes_size(c.oid) / 1024)::bigint \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relkind = 'r' AND pg_total_relation_size(c.oid) > 65536 \
         ORDER BY pg_total_relation_size(c.oid) DESC",
        &[&schema],
    )?;
    rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?))).collect()
}

fn print_tables(sizes: &[usize], rows: &[Row], tables: &[(usize, Sizes)]) {
    let mut out = String::from("| operation |");
    for n in sizes {
        let _ = write!(out, " N = {n} | limit | ratio |");
    }
    out.push_str("\n|---|");
    out.push_str(&"---:|".repeat(3 * sizes.len()));
    let mut ops: Vec<&str> = Vec::new();
    for r in rows {
        if !ops.contains(&r.op) {
            ops.push(r.op);
        }
    }
    for op in ops {
        let _ = write!(out, "\n| {op} |");
        for n in sizes {
            match rows.iter().find(|r| r.op == op && r.n == *n) {
                Some(r) => {
                    let l = r.limit.map_or("-".to_owned(), |l| format!("{l:.0}"));
                    let q = r.limit.map_or("-".to_owned(), |l| format!("{:.2}", r.ours / l));
                    let _ = write!(out, " {:.0} | {l} | {q} |", r.ours);
                }
                None => out.push_str(" - | - | - |"),
            }
        }
    }
    println!("PostgreSQL at scale, medians (µs):\n\n{out}\n");
    println!("| N | table | table KiB | indexes KiB |\n|---:|---|---:|---:|");
    for (n, t) in tables {
        for (table, heap, idx) in t {
            println!("| {n} | {table} | {heap} | {idx} |");
        }
    }
}

/// The plans of each hot operation's statements at N, as the store runs
/// them, into `file` (Markdown).
fn write_plans(
    url: &str,
    opts: &PgOptions,
    clock: &ManualClock,
    store: &Arc<PgStore>,
    entry: &retinue_core::RetainedChild,
    n: usize,
    file: &str,
) -> Res<()> {
    let explaining = Arc::new(PgStore::open(&explain::url_with_auto_explain(url), opts.clone())?);
    // A live child now (the writes have pushed the fixture's out of the cap).
    let live = store.list_retained_children()?.into_iter().next().ok_or("nothing live")?;
    let hit = live.subagent_id.clone();
    let owner = live.parent_session_id.clone();
    let authority = Authority::new(explaining.clone(), explaining.clone(), "");
    let seq = std::cell::Cell::new(0usize);
    let ops: Vec<(&str, Op<'_>)> = vec![
        ("find by subagent id (a live hit)", Box::new(|| ok(explaining.find_retained_child(&hit)))),
        ("find miss", Box::new(|| ok(explaining.find_retained_child("sa-9-ffffffff")))),
        ("operator list", Box::new(|| ok(explaining.list_retained_children()))),
        (
            "owner-scoped list (the list, then every spawner's and the requester's neighbourhood in one statement)",
            Box::new(|| ok(authority.list_for(Some(&owner)))),
        ),
        (
            "authority at depth 99 (both walks in one statement)",
            Box::new(|| {
                let _ = authority.check_follow_up_authority(entry, Some("L99"));
                Ok(())
            }),
        ),
        (
            "usage totals (100,000 ledger rows)",
            Box::new(|| ok(retinue_usage::load_child_usage_totals(&*explaining, "ledger-100000"))),
        ),
        ("prune, nothing to do", Box::new(|| ok(explaining.prune_retained_children(None, None)))),
        (
            "write path: dispatch (unit, children, sessions) then retain (with its prune)",
            Box::new(|| {
                seq.set(seq.get() + 1);
                let id = explaining.insert_unit(&draft(&format!("x{:06}", seq.get()), "p-1"))?;
                ok(explaining.retain_completed_delegation(&id, None))
            }),
        ),
        (
            "tombstone one child (of a live unit retained before, untimed, by another connection)",
            Box::new(|| {
                // A second later: the newest unit, within the cap.
                seq.set(seq.get() + 1);
                clock.advance(1.0);
                let id = store.insert_unit(&draft(&format!("t{:06}", seq.get()), "p-2"))?;
                store.retain_completed_delegation(&id, None)?;
                let child = format!("sa-0-t{:06}", seq.get());
                if explaining.tombstone_retained_child(&child, &TombstoneReason::Manual)? {
                    Ok(())
                } else {
                    Err("tombstone: nothing tombstoned".into())
                }
            }),
        ),
        (
            "resume claim + release",
            Box::new(|| match explaining.claim_resume(&live.delegation_id, live.child_index)? {
                ResumeClaim::Claimed { token } => {
                    ok(explaining.release_resume(&live.delegation_id, live.child_index, &token))
                }
                other => Err(format!("resume claim: {other:?}").into()),
            }),
        ),
        (
            "record attribution",
            Box::new(|| {
                seq.set(seq.get() + 1);
                ok(retinue_usage::record_child_usage_attribution(
                    &*explaining,
                    &AttributionDraft {
                        parent_session_id: "rec".into(),
                        parent_turn_id: String::new(),
                        child_session_id: format!("c{}", seq.get()),
                        usage: json!({"cost_usd": 0.01, "tokens": {"input": 1, "output": 1}}),
                        aggregate: None,
                        key: Some(format!("rec:{}", seq.get())),
                    },
                ))
            }),
        ),
    ];
    let mut md = format!(
        "# PostgreSQL plans of the hot statements\n\n\
         Written by `cargo xtask bench --backend pg -- --scale --explain docs/pg-plans.md` at \
         N = {n} units ({} children, 10 live), PostgreSQL {}: `auto_explain` \
         (`log_analyze`, `log_buffers`, `log_min_duration = 0`) on the store's own \
         connections, so each plan is the one the server ran for the store's prepared \
         statement (the sixth call of each operation; five before it settle the plan cache). \
         Compare a later run's file with this one: a plan that turns into a sequential scan, \
         or whose buffers grow with N, is a regression.\n",
        3 * n,
        server_version(url)?,
    );
    for (name, mut f) in ops {
        let plans = explain::plans(&mut f)?;
        let _ = write!(md, "\n## {name}\n");
        if plans.is_empty() {
            md.push_str("\n(no statement captured)\n");
        }
        for p in plans {
            let text = p.trim_start_matches("NOTICE: ").trim_end();
            let _ = write!(md, "\n```\n{text}\n```\n");
        }
    }
    std::fs::write(file, md)?;
    eprintln!("wrote {file}");
    Ok(())
}

fn server_version(url: &str) -> Res<String> {
    let mut c = postgres::Client::connect(url, postgres::NoTls)?;
    Ok(c.query_one("SHOW server_version", &[])?.try_get(0)?)
}
