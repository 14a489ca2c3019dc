//! The PostgreSQL rows of the benchmark (`cargo xtask bench --backend pg`):
//! the SQLite bench's rows (`crates/bench`, same names and fixture), each
//! registry operation through `PgStore` against its *limit*, the minimal
//! bare SQL giving the same answer on the same server (each statement
//! prepared once on one open connection). `--quick`: N = 1,000, else
//! 10,000; `--repeat K`: the one-shot N→10 collapse K times on fresh
//! copies (median); `--n N`: another N. Needs `RETINUE_PG_URL`; works in
//! scratch schemas it drops at the end (`--keep`: leaves them). `--json
//! FILE` writes every row. `--scale [--n 10000,100000,1000000]`: the scale
//! rows instead (see `scale.rs`), with `--explain FILE` the plans of the
//! hot statements at the largest N. No assertion on time; a failing
//! operation fails the run.

mod explain;
mod fixture;
mod limits;
mod scale;

use std::sync::Arc;
use std::time::Instant;

use retinue_core::{
    Claims, Clock, Completion, ManualClock, RegistryRead, ResumeClaim, Retention, TERMINAL_KEEP,
    TombstoneReason, UnitLifecycle,
};
use retinue_lineage::{Authority, LineageAuthority};
use retinue_store_pg::{PgOptions, PgStore};
use retinue_usage::AttributionDraft;
use serde_json::json;

use retinue_testkit::workload::{child_session, draft, parent_of, subagent_id, unit_id};

use crate::fixture::{LEDGERS, T0};
use crate::limits::{Limits, Res};

/// Median of `iters` timed calls of `f(i)` after an untimed `setup(i)`, in µs.
fn time_with_setup(
    iters: usize,
    mut setup: impl FnMut(usize) -> Res<()>,
    mut f: impl FnMut(usize) -> Res<()>,
) -> Res<f64> {
    let mut v = Vec::with_capacity(iters);
    for i in 0..iters {
        setup(i)?;
        let t = Instant::now();
        f(i)?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(median(v))
}

/// Medians (µs) of `fs`, each called `iters` times, in turn — the first of
/// each round rotating — so a slow spell of the shared machine falls on all
/// of them alike (timing one after the other made ratios swing by 3×).
type Timed<'a> = &'a mut dyn FnMut(usize) -> Res<()>;

fn interleaved(iters: usize, fs: &mut [Timed<'_>]) -> Res<Vec<f64>> {
    let k = fs.len();
    let mut samples = vec![Vec::with_capacity(iters); k];
    for i in 0..iters {
        for j in 0..k {
            let at = (i + j) % k;
            let t = Instant::now();
            fs[at](i)?;
            samples[at].push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(samples.into_iter().map(median).collect())
}

/// [`interleaved`] of two: (Retinue, limit).
fn pair(
    iters: usize,
    mut ours: impl FnMut(usize) -> Res<()>,
    mut limit: impl FnMut(usize) -> Res<()>,
) -> Res<(f64, f64)> {
    let v = interleaved(iters, &mut [&mut ours, &mut limit])?;
    Ok((v[0], v[1]))
}

fn time(iters: usize, f: impl FnMut(usize) -> Res<()>) -> Res<f64> {
    time_with_setup(iters, |_| Ok(()), f)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn ok<T, E: Into<Box<dyn std::error::Error>>>(r: Result<T, E>) -> Res<()> {
    r.map(|_| ()).map_err(Into::into)
}

struct Table {
    rows: Vec<(String, f64, Option<f64>)>,
}

impl Table {
    fn push(&mut self, op: &str, ours: f64, limit: Option<f64>) {
        let l = limit.map_or("-".to_owned(), |l| format!("{l:.0}"));
        let r = limit.map_or("-".to_owned(), |l| format!("{:.2}", ours / l));
        eprintln!("{op:<48} {ours:>10.0} {l:>10} {r:>6}");
        self.rows.push((op.to_owned(), ours, limit));
    }
}

/// Opens a store on a fresh `schema` (migrated, empty) and fills it.
fn fresh(
    url: &str,
    opts: &PgOptions,
    schema: &str,
    n: usize,
    live_from: usize,
    ledgers: bool,
) -> Res<(PgStore, Limits)> {
    let _ = PgStore::drop_schema(url, schema);
    let store = PgStore::open(url, opts.clone().with_schema(schema))?;
    let mut lim = Limits::open(url, schema)?;
    fixture::populate(lim.client(), n, live_from, ledgers, 3)?;
    Ok((store, lim))
}

fn main() -> Res<()> {
    let url = std::env::var("RETINUE_PG_URL").map_err(|_| "RETINUE_PG_URL is unset")?;
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let repeat: usize = args
        .iter()
        .position(|a| a == "--repeat")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
    let sizes: Option<Vec<usize>> = value("--n")
        .map(|v| v.split(',').map(str::parse).collect::<Result<Vec<usize>, _>>())
        .transpose()?;
    let json_out = value("--json").cloned();
    let keep = args.iter().any(|a| a == "--keep");
    if args.iter().any(|a| a == "--scale") {
        let sizes = sizes.unwrap_or_else(|| vec![10_000, 100_000, 1_000_000]);
        return scale::run(&url, &sizes, quick, json_out.as_deref(), value("--explain"), keep);
    }
    let n: usize =
        sizes.and_then(|s| s.first().copied()).unwrap_or(if quick { 1_000 } else { 10_000 });
    if n < 200 {
        return Err("--n: at least 200 units".into());
    }
    let (reads, writes) = if quick { (200, 20) } else { (1_000, 200) };
    let base = format!("bench_{}", std::process::id());
    let schemas: Vec<String> =
        ["", "_ours", "_limit", "_floor"].iter().map(|s| format!("{base}{s}")).collect();

    let clock = Arc::new(ManualClock::new(T0 + n as f64 + 10.0));
    // The default retention: `max_retained` 10, TTL 72 h, one profile ('').
    let opts = PgOptions::default().with_clock(clock.clone());
    let cap = i64::from(opts.retention.max_retained);
    let started = Instant::now();
    let (store, mut lim) = fresh(&url, &opts, &base, n, n.saturating_sub(10), true)?;
    let store = Arc::new(store);
    eprintln!("built N={n} in {:.1}s", started.elapsed().as_secs_f64());
    let newest = n - 1;
    let cutoff = clock.now() - opts.retention.ttl_hours * 3600.0;
    let mut t = Table { rows: Vec::new() };

    // Opening an existing schema.
    let store_opts = opts.clone().with_schema(&base);
    let (ours, limit) = pair(
        if quick { 10 } else { 50 },
        |_| ok(PgStore::open(&url, store_opts.clone())),
        |_| Limits::open_limit(&url, &base),
    )?;
    t.push("open existing db", ours, Some(limit));

    // Finds (the newest unit is live; checked before timing).
    for (op, id, column) in [
        ("find by subagent id", subagent_id(newest, 0), "subagent_id"),
        ("find by child session id", child_session(newest, 0), "child_session_id"),
        ("find by delegation id", unit_id(newest), "delegation_id"),
        ("find miss", "sa-9-ffffffff".to_owned(), "subagent_id"),
    ] {
        let hit = store.find_retained_child(&id)?.is_some();
        if hit != (op != "find miss") || lim.find(column, &id, cutoff)? != usize::from(hit) {
            return Err(format!("{op}: the fixture does not answer as expected").into());
        }
        let (ours, limit) = pair(
            reads,
            |_| ok(store.find_retained_child(&id)),
            |_| ok(lim.find(column, &id, cutoff)),
        )?;
        t.push(op, ours, Some(limit));
    }

    // Lists.
    let authority = Authority::new(store.clone(), store.clone(), "");
    let listed = store.list_retained_children()?.len();
    if listed != lim.list(cutoff, cap)? || listed == 0 {
        return Err(format!("operator list: {listed} children, the limit disagrees").into());
    }
    let owner = parent_of(newest);
    let shared = std::cell::RefCell::new(&mut lim);
    let v = interleaved(
        reads,
        &mut [
            &mut |_| ok(store.list_retained_children()),
            &mut |_| ok(shared.borrow_mut().list(cutoff, cap)),
            &mut |_| ok(authority.list_for(Some(&owner))),
            &mut |_| ok(shared.borrow_mut().list_then_lineage(cutoff, cap, &owner)),
        ],
    )?;
    t.push("operator list", v[0], Some(v[1]));
    t.push("owner-scoped list", v[2], Some(v[1]));
    t.push(
        "  same, floor = the list, then the lineages it names (two statements)",
        v[2],
        Some(v[3]),
    );

    // Authority at lineage depths (the spawner is L0; requesters walk up).
    let entry =
        store.find_retained_child(&subagent_id(newest, 0))?.ok_or("fixture child missing")?;
    for depth in [1usize, 10, 99, 100] {
        let mut e = entry.clone();
        e.parent_session_id = "L0".into();
        let requester = format!("L{depth}");
        let verdict = authority.check_follow_up_authority(&e, Some(&requester));
        if depth == 1 && verdict.is_err() {
            return Err(format!("authority, depth {depth}: denied").into());
        }
        eprintln!("authority, depth {depth}: {verdict:?}");
        let v = interleaved(
            reads,
            &mut [
                &mut |_| {
                    let _ = authority.check_follow_up_authority(&e, Some(&requester));
                    Ok(())
                },
                &mut |_| ok(shared.borrow_mut().chain(&requester)),
                &mut |_| ok(shared.borrow_mut().neighbourhoods(&[&requester, "L0"])),
            ],
        )?;
        t.push(&format!("authority, depth {depth}"), v[0], Some(v[1]));
        t.push(
            &format!("  same, floor = both neighbourhoods as bare SQL, depth {depth}"),
            v[0],
            Some(v[2]),
        );
    }
    if authority.check_follow_up_authority(&entry, Some("stranger")).is_ok() {
        return Err("authority, foreign requester: allowed".into());
    }
    let (ours, limit) = pair(
        reads,
        |_| {
            let _ = authority.check_follow_up_authority(&entry, Some("stranger"));
            Ok(())
        },
        |_| ok(lim.chain("stranger")),
    )?;
    t.push("authority, foreign requester", ours, Some(limit));

    // Ledger.
    for size in LEDGERS {
        let parent = format!("ledger-{size}");
        let totals = retinue_usage::load_child_usage_totals(&*store, &parent)?;
        if (totals.cost_usd - 0.01 * size as f64).abs() > 1e-6 {
            return Err(format!("usage totals of {parent}: {}", totals.cost_usd).into());
        }
        let (ours, limit) = pair(
            reads,
            |_| ok(retinue_usage::load_child_usage_totals(&*store, &parent)),
            |_| ok(lim.totals(&parent)),
        )?;
        t.push(&format!("usage totals, {size} rows"), ours, Some(limit));
    }

    // Prune, nothing due.
    if store.prune_retained_children(None, None)?.units != 0 {
        return Err("prune, nothing to do: the fixture had something to prune".into());
    }
    let (ours, limit) = pair(
        reads.min(500),
        |_| ok(store.prune_retained_children(None, None)),
        |_| ok(lim.prune_noop(cutoff)),
    )?;
    t.push("prune, nothing to do", ours, Some(limit));

    // Writes (one durability setting: PostgreSQL's commit is the server's).
    let now = clock.now();
    let shared = std::cell::RefCell::new(&mut lim);
    let v = interleaved(
        writes,
        &mut [
            &mut |i| {
                let id = store.insert_unit(&draft(&format!("w{i:06}"), "p-1"))?;
                ok(store.retain_completed_delegation(&id, None))
            },
            &mut |i| shared.borrow_mut().write_unit(&format!("L{i:06}"), now),
            &mut |i| shared.borrow_mut().write_unit_two_commits(&format!("W{i:06}"), now),
            &mut |i| {
                shared.borrow_mut().write_unit_two_serializable_commits(&format!("S{i:06}"), now)
            },
        ],
    )?;
    let (ours, limit, two, serial) = (v[0], v[1], v[2], v[3]);
    t.push("write path (dispatch+manifest+retain)", ours, Some(limit));
    t.push("  same, limit = two bare commits", ours, Some(two));
    t.push("  same, limit = two bare serializable commits", ours, Some(serial));
    // Each half on its own (the other untimed): dispatch, then retain.
    let ids = std::cell::RefCell::new(Vec::new());
    let dispatch = time(writes, |i| {
        ids.borrow_mut().push(store.insert_unit(&draft(&format!("d{i:06}"), "p-1"))?);
        Ok(())
    })?;
    let bare = time(writes, |i| shared.borrow_mut().dispatch(&format!("D{i:06}"), now))?;
    t.push("  dispatch alone, limit = its bare commit", dispatch, Some(bare));
    let mut pending = ids.into_inner().into_iter();
    let retain = time(writes, |_| {
        let id = pending.next().ok_or("no unit left to retain")?;
        ok(store.retain_completed_delegation(&id, None))
    })?;
    let bare = time(writes, |i| shared.borrow_mut().retain(&format!("D{i:06}"), now))?;
    t.push("  retain alone, limit = its bare commit", retain, Some(bare));
    let (record, limit) = pair(
        writes,
        |i| {
            let d = AttributionDraft {
                parent_session_id: "rec".into(),
                parent_turn_id: String::new(),
                child_session_id: format!("c{i}"),
                usage: json!({"cost_usd": 0.01, "tokens": {"input": 1, "output": 1}}),
                aggregate: None,
                key: Some(format!("rec:{i}")),
            };
            ok(retinue_usage::record_child_usage_attribution(&*store, &d))
        },
        |i| lim.record(i),
    )?;
    t.push("record attribution", record, Some(limit));
    // The limits' bare writes left live units outside the cap: settle (untimed).
    store.prune_retained_children(None, None)?;
    // Tombstone one child of a fresh live unit (setup untimed; a second
    // later, so the unit is the newest and within the cap).
    let tomb = time_with_setup(
        writes,
        |i| {
            clock.advance(1.0);
            let id = store.insert_unit(&draft(&format!("t{i:06}"), "p-2"))?;
            ok(store.retain_completed_delegation(&id, None))
        },
        |i| {
            let done = store
                .tombstone_retained_child(&format!("sa-0-t{i:06}"), &TombstoneReason::Manual)?;
            if done { Ok(()) } else { Err("tombstone one child: nothing tombstoned".into()) }
        },
    )?;
    let cell = std::cell::RefCell::new(&mut lim);
    let limit = time_with_setup(
        writes,
        |i| cell.borrow_mut().write_unit(&format!("T{i:06}"), now),
        |i| cell.borrow_mut().tombstone(&format!("sa-0-T{i:06}"), now),
    )?;
    let floor = time_with_setup(
        writes,
        |i| cell.borrow_mut().write_unit(&format!("zF{i:06}"), clock.now()),
        |i| cell.borrow_mut().tombstone_resolved(&format!("sa-0-zF{i:06}"), clock.now(), cutoff),
    )?;
    t.push("tombstone one child", tomb, Some(limit));
    t.push("  same, floor = resolve + UPDATE in one serializable transaction", tomb, Some(floor));
    // The floor's units were retained at the clock's now: later units are newer.
    clock.advance(1.0);
    // The limits' bare writes left live units outside the cap: settle (untimed).
    store.prune_retained_children(None, None)?;

    // Prune with one TTL-expired unit, and with one over-cap unit (setup untimed).
    let mut pruned = 0;
    let ttl = time_with_setup(
        writes.min(50),
        |i| {
            let id = store.insert_unit(&draft(&format!("ttl{i:06}"), "p-3"))?;
            store.retain_completed_delegation(&id, None)?;
            lim.age(&id, 73.0 * 3600.0)
        },
        |_| {
            pruned += store.prune_retained_children(None, None)?.units;
            Ok(())
        },
    )?;
    if pruned != writes.min(50) {
        return Err(format!("prune, one TTL-expired unit: {pruned} units pruned").into());
    }
    t.push("prune, one TTL-expired unit", ttl, None);
    // Each TTL prune left one unit fewer than the cap: back to the cap (untimed).
    clock.advance(1.0);
    let id = store.insert_unit(&draft("cap-fill", "p-4"))?;
    store.retain_completed_delegation(&id, None)?;
    let mut pruned = 0;
    let over = time_with_setup(
        writes.min(50),
        |i| {
            // A writer that retains one more unit without pruning.
            let id = store.insert_unit(&draft(&format!("cap{i:06}"), "p-4"))?;
            lim.retain_raw(&id, clock.now())?;
            clock.advance(1.0);
            Ok(())
        },
        |_| {
            pruned += store.prune_retained_children(None, None)?.units;
            Ok(())
        },
    )?;
    if pruned != writes.min(50) {
        return Err(format!("prune, one over-cap unit: {pruned} units pruned").into());
    }
    t.push("prune, one over-cap unit", over, None);

    // The history pruner: with nothing due, and with one terminal unit
    // beyond `TERMINAL_KEEP` (setup untimed).
    let finish_failed = |tag: String| -> Res<()> {
        let id = store.insert_unit(&draft(&tag, "p-5"))?;
        ok(store.persist_completion(&Completion {
            delegation_id: id.clone(),
            status: "failed".into(),
            event: retinue_core::CompletionEvent::from_stored(
                &id,
                json!({"type": "async_delegation", "delegation_id": id}),
            ),
            result: json!({"status": "failed"}),
            usage: None,
            background: false,
        }))
    };
    for i in 0..TERMINAL_KEEP {
        finish_failed(format!("hk{i:06}"))?;
    }
    store.prune_history()?;
    let idle = time(reads.min(500), |_| ok(store.prune_history()))?;
    t.push("history prune, nothing due", idle, None);
    let mut deleted = 0;
    let one = time_with_setup(
        writes.min(50),
        |i| finish_failed(format!("hp{i:06}")),
        |_| {
            deleted += store.prune_history()?;
            Ok(())
        },
    )?;
    if deleted == 0 {
        return Err("history prune, one unit over the keep: nothing deleted".into());
    }
    t.push("history prune, one unit over the keep", one, None);

    // Not in the SQLite bench: the resume claim and release of one child
    // (of a fresh newest unit: the fixture's have left the cap by now).
    clock.advance(1.0);
    let resumable = store.insert_unit(&draft("resume", "p-6"))?;
    store.retain_completed_delegation(&resumable, None)?;
    let (ours, limit) = pair(
        reads.min(500),
        |_| {
            let id = &resumable;
            match store.claim_resume(id, 0)? {
                ResumeClaim::Claimed { token } => ok(store.release_resume(id, 0, &token)),
                other => Err(format!("resume claim: {other:?}").into()),
            }
        },
        |_| lim.claim_release(&resumable),
    )?;
    t.push("resume claim + release, two commits", ours, Some(limit));
    let size_kib = lim.schema_kib(&base)?;

    // Collapse N → 10 in one call, on fresh all-live copies (ours and the
    // limit alternate which goes first; then the floor).
    let (mut ours, mut limit, mut floor, mut units, mut list) =
        (Vec::new(), Vec::new(), Vec::new(), 0, None);
    let mut wide = opts.retention;
    wide.max_retained = u32::try_from(n * 2)?;
    for r in 0..repeat.max(1) {
        let (mine, _) = fresh(&url, &opts.clone().with_retention(wide), &schemas[1], n, 0, false)?;
        let (_, mut copy) = fresh(&url, &opts, &schemas[2], n, 0, false)?;
        let (_, mut bare) = fresh(&url, &opts, &schemas[3], n, 0, false)?;
        if list.is_none() {
            // Every child of N live units (max_retained = 2N): the old list row.
            let all = mine.list_retained_children()?.len();
            if all != copy.list_all()? {
                return Err("list every addressable child: the limit disagrees".into());
            }
            let it = (reads / 20).max(10);
            let v = interleaved(
                it,
                &mut [&mut |_| ok(mine.list_retained_children()), &mut |_| ok(copy.list_all())],
            )?;
            list = Some((v[0], v[1]));
        }
        let mut run_ours = || -> Res<()> {
            let t = Instant::now();
            let count = mine.prune_retained_children(Some(10), Some(1e9))?;
            ours.push(t.elapsed().as_secs_f64() * 1e6);
            units = count.units;
            Ok(())
        };
        let mut run_limit = || -> Res<()> {
            let t = Instant::now();
            copy.collapse(10, clock.now())?;
            limit.push(t.elapsed().as_secs_f64() * 1e6);
            Ok(())
        };
        if r % 2 == 0 {
            run_ours()?;
            run_limit()?;
        } else {
            run_limit()?;
            run_ours()?;
        }
        let t = Instant::now();
        bare.collapse_units_only(10, clock.now())?;
        floor.push(t.elapsed().as_secs_f64() * 1e6);
    }
    if units != n - 10 {
        return Err(format!("prune N→10: {units} units pruned").into());
    }
    let (m, l, f) = (median(ours), median(limit), median(floor));
    t.push(&format!("prune N→10 ({units} units)"), m, Some(l));
    t.push("  same, limit = the unit rows' UPDATE alone", m, Some(f));
    if let Some((ours, limit)) = list {
        t.push("list every addressable child (N live units, no cap)", ours, Some(limit));
    }

    println!(
        "PostgreSQL, N = {n} retained units (10 live), {reads} reads / {writes} writes, \
         medians (µs); schema {size_kib} KiB:\n"
    );
    println!("| operation | Retinue | limit | ratio |\n|---|---:|---:|---:|");
    for (op, ours, limit) in &t.rows {
        let l = limit.map_or("-".to_owned(), |l| format!("{l:.0}"));
        let r = limit.map_or("-".to_owned(), |l| format!("{:.2}", ours / l));
        println!("| {} | {ours:.0} | {l} | {r} |", op.trim_start());
    }
    drop(store);
    if let Some(file) = json_out {
        let figures: Vec<serde_json::Value> = t
            .rows
            .iter()
            .map(|(op, ours, limit)| {
                json!({"n": n, "op": op.trim_start(), "median_us": ours, "limit_median_us": limit})
            })
            .collect();
        let doc = json!({
            "backend": "postgresql",
            "quick": quick,
            "reads": reads,
            "writes": writes,
            "schema_kib": size_kib,
            "figures": figures,
        });
        std::fs::write(&file, serde_json::to_string_pretty(&doc)?)?;
        eprintln!("wrote {file}");
    }
    if keep {
        println!("\nkept schemas {} (DROP SCHEMA … CASCADE)", schemas.join(", "));
    } else {
        for s in &schemas {
            PgStore::drop_schema(&url, s)?;
        }
    }
    Ok(())
}
