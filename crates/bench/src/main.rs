//! `retinue-bench`: measures every registry operation against the limit —
//! the minimal hand-written prepared SQL returning the same answer on the
//! same file — at N ∈ {100, 1,000, 10,000, 100,000} retained units.
//!
//! `cargo xtask bench [--quick] [--json FILE] [--n N[,N…]] [--only SECTION[,…]]
//! [--repeat K]`. `--n` picks the sizes, `--only` the sections (`open`, `find`,
//! `list`, `authority`, `usage`, `prune`, `writes`, `history`, `collapse`),
//! `--repeat` runs the one-shot N→10 collapse K times on fresh copies
//! (ours and the limit alternating) and reports the median. Prints a table; no
//! assertion on time anywhere.

mod fixture;
mod limits;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use retinue_config::DelegationConfig;
use retinue_core::{
    Completion, ManualClock, RegistryRead, Retention, Synchronous, TombstoneReason, UnitLifecycle,
};
use retinue_lineage::{Authority, LineageAuthority};
use retinue_store::{Store, StoreOptions};
use retinue_usage::AttributionDraft;
use serde_json::{Value, json};

use retinue_testkit::workload::{child_session, draft, parent_of, subagent_id, unit_id};

use crate::fixture::T0;

/// One measured operation.
#[derive(Debug, Clone)]
pub(crate) struct Figure {
    n: usize,
    op: String,
    median_us: f64,
    p90_us: f64,
    limit_median_us: Option<f64>,
}

/// Times `f` `iters` times; returns (median, p90) in µs.
pub(crate) fn time<F: FnMut(usize)>(iters: usize, f: F) -> (f64, f64) {
    time_with_setup(iters, |_| {}, f)
}

/// Like [`time`], with an untimed `setup(i)` before each timed call.
pub(crate) fn time_with_setup<S: FnMut(usize), F: FnMut(usize)>(
    iters: usize,
    mut setup: S,
    mut f: F,
) -> (f64, f64) {
    let samples: Vec<f64> = (0..iters)
        .map(|i| {
            setup(i);
            let start = Instant::now();
            f(i);
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    median_p90(samples)
}

/// (median, p90) of samples in µs.
fn median_p90(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let pick = |q: f64| {
        samples.get(((samples.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0)
    };
    (pick(0.5), pick(0.9))
}

struct Bench {
    figures: Vec<Figure>,
    quick: bool,
    /// Sections to run (empty: all).
    only: Vec<String>,
    /// Runs of the one-shot N→10 collapse.
    repeat: usize,
}

impl Bench {
    fn push(&mut self, n: usize, op: &str, ours: (f64, f64), limit: Option<(f64, f64)>) {
        let f = Figure {
            n,
            op: op.to_owned(),
            median_us: ours.0,
            p90_us: ours.1,
            limit_median_us: limit.map(|l| l.0),
        };
        let ratio = f
            .limit_median_us
            .filter(|l| *l > 0.0)
            .map_or(String::from("-"), |l| format!("{:.2}", f.median_us / l));
        let limit = f.limit_median_us.map_or(String::from("-"), |l| format!("{l:.1}"));
        println!(
            "{:>7} {:<44} {:>11.1} {:>11.1} {:>11} {:>7}",
            n, op, f.median_us, f.p90_us, limit, ratio
        );
        self.figures.push(f);
    }

    fn runs(&self, section: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|s| s == section)
    }

    fn reads(&self) -> usize {
        if self.quick { 200 } else { 2_000 }
    }

    fn writes(&self) -> usize {
        if self.quick { 20 } else { 200 }
    }
}

fn options(clock: &Arc<ManualClock>, sync: Synchronous) -> StoreOptions {
    StoreOptions {
        synchronous: sync,
        retention: DelegationConfig::default().retention(),
        ..StoreOptions::default().with_clock(clock.clone())
    }
}

fn rss_peak_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}

fn reset_rss_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn build(
    dir: &Path,
    name: &str,
    n: usize,
    all_live: bool,
) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let path = dir.join(name);
    let clock = Arc::new(ManualClock::new(T0));
    drop(Store::open(&path, options(&clock, Synchronous::Normal))?);
    fixture::populate(&path, n, 10, all_live)?;
    Ok(path)
}

fn run_size(b: &mut Bench, n: usize) -> Result<(), Box<dyn std::error::Error>> {
    reset_rss_peak();
    let dir = tempfile::tempdir()?;
    let started = Instant::now();
    let path = build(dir.path(), "state.db", n, false)?;
    eprintln!("built N={n} in {:.1}s", started.elapsed().as_secs_f64());
    let clock = Arc::new(ManualClock::new(T0 + n as f64 + 10.0));
    let store = Arc::new(Store::open(&path, options(&clock, Synchronous::Full))?);
    let lim = limits::Limits::open(&path)?;
    let (reads, writes) = (b.reads(), b.writes());
    let newest = n - 1;
    let cutoff = clock_now(&clock) - 72.0 * 3600.0;

    // Opening an existing DB.
    if b.runs("open") {
        let open = time(if b.quick { 10 } else { 50 }, |_| {
            drop(Store::open(&path, options(&clock, Synchronous::Full)));
        });
        b.push(n, "open existing db", open, Some(time(50, |_| lim.open_limit(&path))));
    }

    // Finds.
    for (op, id) in [
        ("find by subagent id", subagent_id(newest, 0)),
        ("find by child session id", child_session(newest, 0)),
        ("find by delegation id", unit_id(newest)),
        ("find miss", "sa-9-ffffffff".to_owned()),
    ] {
        if !b.runs("find") {
            break;
        }
        let ours = time(reads, |_| {
            let _ = store.find_retained_child(&id);
        });
        let column = match op {
            "find by subagent id" | "find miss" => "subagent_id",
            "find by child session id" => "child_session_id",
            _ => "delegation_id",
        };
        let limit = time(reads, |_| lim.find(column, &id, cutoff));
        b.push(n, op, ours, Some(limit));
    }
    let authority = Authority::new(store.clone(), store.clone(), "");
    if b.runs("list") {
        let list = time(reads, |_| {
            let _ = store.list_retained_children();
        });
        b.push(n, "operator list", list, Some(time(reads, |_| lim.list(cutoff))));
        let owner = parent_of(newest);
        let scoped = time(reads, |_| {
            let _ = authority.list_for(Some(&owner));
        });
        b.push(n, "owner-scoped list", scoped, Some(time(reads, |_| lim.list(cutoff))));
        // The web view's poll (#35: O(1), goal <= 1 ms at 10^5 units).
        let marker = time(reads, |_| {
            let _ = retinue_core::Controls::change_marker(&*store);
        });
        b.push(n, "web view change marker", marker, None);
    }

    // Authority at lineage depths (the spawner is L0; requesters walk up).
    let entry =
        store.find_retained_child(&subagent_id(newest, 0))?.ok_or("fixture child missing")?;
    for depth in [1usize, 10, 99, 100] {
        if !b.runs("authority") {
            break;
        }
        let mut e = entry.clone();
        e.parent_session_id = "L0".into();
        let requester = format!("L{depth}");
        let ours = time(reads, |_| {
            let _ = authority.check_follow_up_authority(&e, Some(&requester));
        });
        let limit = time(reads, |_| lim.chain(&requester));
        b.push(n, &format!("authority, depth {depth}"), ours, Some(limit));
    }
    if b.runs("authority") {
        let foreign = time(reads, |_| {
            let _ = authority.check_follow_up_authority(&entry, Some("stranger"));
        });
        b.push(
            n,
            "authority, foreign requester",
            foreign,
            Some(time(reads, |_| lim.chain("stranger"))),
        );
    }

    // Ledger.
    for size in fixture::LEDGERS {
        if !b.runs("usage") {
            break;
        }
        let parent = format!("ledger-{size}");
        let ours = time(reads, |_| {
            let _ = retinue_usage::load_child_usage_totals(&*store, &parent);
        });
        b.push(
            n,
            &format!("usage totals, {size} rows"),
            ours,
            Some(time(reads, |_| lim.totals(&parent))),
        );
    }

    // Prune, nothing due.
    if b.runs("prune") {
        let noop = time(reads.min(500), |_| {
            let _ = store.prune_retained_children(None, None);
        });
        b.push(
            n,
            "prune, nothing to do",
            noop,
            Some(time(reads.min(500), |_| lim.prune_noop(cutoff))),
        );
    }

    // Writes, at both durability settings.
    for sync in [Synchronous::Full, Synchronous::Normal] {
        if !b.runs("writes") {
            break;
        }
        let label = if sync == Synchronous::Full { "full" } else { "normal" };
        let s = Store::open(&path, options(&clock, sync))?;
        let l = limits::Limits::open_with(&path, label)?;
        let ours = time(writes, |i| {
            let tag = format!("{label}{i:06}");
            if let Ok(id) = s.insert_unit(&draft(&tag, "p-1")) {
                let _ = s.retain_completed_delegation(&id, None);
            }
        });
        let limit = time(writes, |i| l.write_unit(&format!("L{label}{i:06}"), clock_now(&clock)));
        b.push(n, &format!("write path (dispatch+manifest+retain), {label}"), ours, Some(limit));
        let two = time(writes, |i| {
            l.write_unit_two_commits(&format!("W{label}{i:06}"), clock_now(&clock))
        });
        b.push(n, &format!("  same, limit = two bare commits, {label}"), ours, Some(two));
        let record = time(writes, |i| {
            let d = AttributionDraft {
                parent_session_id: format!("rec-{label}"),
                parent_turn_id: String::new(),
                child_session_id: format!("c{i}"),
                usage: json!({"cost_usd": 0.01, "tokens": {"input": 1, "output": 1}}),
                aggregate: None,
                key: Some(format!("{label}:{i}")),
            };
            let _ = retinue_usage::record_child_usage_attribution(&s, &d);
        });
        b.push(
            n,
            &format!("record attribution, {label}"),
            record,
            Some(time(writes, |i| l.record(label, i))),
        );
        // Tombstone one child of a fresh live unit (setup untimed). The
        // clock moves on per setup so the fresh unit is the newest: with
        // equal times a random id can rank beyond the cap, be pruned by its
        // own retain, and the tombstone would time a no-op.
        let hits = std::cell::Cell::new(0usize);
        let tomb = time_with_setup(
            writes,
            |i| {
                clock.advance(1.0);
                if let Ok(id) = s.insert_unit(&draft(&format!("t{label}{i:06}"), "p-2")) {
                    let _ = s.retain_completed_delegation(&id, None);
                }
            },
            |i| {
                if let Ok(true) = s.tombstone_retained_child(
                    &format!("sa-0-t{label}{i:06}"),
                    &TombstoneReason::Manual,
                ) {
                    hits.set(hits.get() + 1);
                }
            },
        );
        if hits.get() != writes {
            return Err(format!(
                "tombstone one child, {label}: {} of {writes} tombstones changed nothing",
                writes - hits.get()
            )
            .into());
        }
        let limit = time_with_setup(
            writes,
            |i| l.write_unit(&format!("T{label}{i:06}"), clock_now(&clock)),
            |i| l.tombstone(&format!("sa-0-T{label}{i:06}"), clock_now(&clock)),
        );
        b.push(n, &format!("tombstone one child, {label}"), tomb, Some(limit));
    }

    if b.runs("prune") {
        // Prune with one TTL-expired unit, and with one over-cap unit (setup untimed).
        let raw = limits::Limits::open(&path)?;
        let ttl = time_with_setup(
            writes.min(50),
            |i| {
                if let Ok(id) = store.insert_unit(&draft(&format!("ttl{i:06}"), "p-3")) {
                    let _ = store.retain_completed_delegation(&id, None);
                    raw.age(&id, 73.0 * 3600.0);
                }
            },
            |_| {
                let _ = store.prune_retained_children(None, None);
            },
        );
        b.push(n, "prune, one TTL-expired unit", ttl, None);
        let cap = time_with_setup(
            writes.min(50),
            |i| {
                // Another writer (hermes) retains one more unit without pruning.
                if let Ok(id) = store.insert_unit(&draft(&format!("cap{i:06}"), "p-4")) {
                    raw.retain_raw(&id, clock_now(&clock));
                }
                clock.advance(1.0);
            },
            |_| {
                let _ = store.prune_retained_children(None, None);
            },
        );
        b.push(n, "prune, one over-cap unit", cap, None);
    }
    if b.runs("history") {
        // The history pruner, run after every spawn: with nothing due, and with
        // one terminal unit beyond `TERMINAL_KEEP` (setup untimed). Neither may
        // grow with N (the retained units are never read).
        let finish_failed = |tag: String| {
            if let Ok(id) = store.insert_unit(&draft(&tag, "p-5")) {
                let _ = store.persist_completion(&Completion {
                    delegation_id: id.clone(),
                    status: "failed".into(),
                    event: retinue_core::CompletionEvent::from_stored(
                        &id,
                        json!({"type": "async_delegation", "delegation_id": id}),
                    ),
                    result: json!({"status": "failed"}),
                    usage: None,
                    background: false,
                });
            }
        };
        for i in 0..retinue_core::TERMINAL_KEEP {
            finish_failed(format!("hk{i:06}"));
        }
        let _ = store.prune_history();
        let idle = time(reads.min(500), |_| {
            let _ = store.prune_history();
        });
        b.push(n, "history prune, nothing due", idle, None);
        let one = time_with_setup(
            writes.min(50),
            |i| finish_failed(format!("hp{i:06}")),
            |_| {
                let _ = store.prune_history();
            },
        );
        b.push(n, "history prune, one unit over the keep", one, None);
    }
    // Collapse N → 10 in one call, on fresh copies (ours and the limit
    // alternate which goes first).
    if b.runs("collapse") {
        let live = build(dir.path(), "live.db", n, true)?;
        let (mut ours, mut limit, mut floor, mut units) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for r in 0..b.repeat.max(1) {
            let mine = dir.path().join("live-ours.db");
            let copy = dir.path().join("live-limit.db");
            let bare = dir.path().join("live-floor.db");
            for p in [&mine, &copy, &bare] {
                for suffix in ["-wal", "-shm"] {
                    let _ = std::fs::remove_file(p.with_extension(format!("db{suffix}")));
                }
                std::fs::copy(&live, p)?;
            }
            let run_ours = |ours: &mut Vec<f64>,
                            units: &mut usize|
             -> Result<(), Box<dyn std::error::Error>> {
                let ls = Store::open(&mine, options(&clock, Synchronous::Full))?;
                let start = Instant::now();
                let count = ls.prune_retained_children(Some(10), Some(1e9))?;
                ours.push(start.elapsed().as_secs_f64() * 1e6);
                *units = count.units;
                Ok(())
            };
            let run_limit = |limit: &mut Vec<f64>| -> Result<(), Box<dyn std::error::Error>> {
                let lc = limits::Limits::open(&copy)?;
                let start = Instant::now();
                lc.collapse(10, clock_now(&clock));
                limit.push(start.elapsed().as_secs_f64() * 1e6);
                Ok(())
            };
            if r % 2 == 0 {
                run_ours(&mut ours, &mut units)?;
                run_limit(&mut limit)?;
            } else {
                run_limit(&mut limit)?;
                run_ours(&mut ours, &mut units)?;
            }
            let lf = limits::Limits::open(&bare)?;
            let start = Instant::now();
            lf.collapse_units_only(10, clock_now(&clock));
            floor.push(start.elapsed().as_secs_f64() * 1e6);
        }
        let (m, p) = median_p90(ours);
        let (lm, lp) = median_p90(limit);
        b.push(n, &format!("prune N→10 ({units} units)"), (m, p), Some((lm, lp)));
        let (fm, fp) = median_p90(floor);
        b.push(n, "  same, limit = the unit rows' UPDATE alone", (m, p), Some((fm, fp)));
    }
    println!(
        "{n:>7} {:<44} peak RSS {} KiB, DB {} KiB",
        "memory and size",
        rss_peak_kib().unwrap_or(0),
        std::fs::metadata(&path).map(|m| m.len() / 1024).unwrap_or(0)
    );
    b.figures.push(Figure {
        n,
        op: "peak RSS KiB".into(),
        median_us: rss_peak_kib().unwrap_or(0) as f64,
        p90_us: 0.0,
        limit_median_us: None,
    });
    b.figures.push(Figure {
        n,
        op: "db size KiB".into(),
        median_us: std::fs::metadata(&path).map(|m| m.len() / 1024).unwrap_or(0) as f64,
        p90_us: 0.0,
        limit_median_us: None,
    });
    Ok(())
}

fn clock_now(clock: &ManualClock) -> f64 {
    use retinue_core::Clock;
    clock.now()
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
    let json_out = value("--json").cloned();
    let list = |flag: &str| -> Vec<String> {
        value(flag)
            .map(|v| {
                v.split(',').map(|s| s.trim().replace('_', "")).filter(|s| !s.is_empty()).collect()
            })
            .unwrap_or_default()
    };
    let mut sizes: Vec<usize> = list("--n").iter().filter_map(|s| s.parse().ok()).collect();
    if sizes.is_empty() {
        sizes = if quick { vec![100, 1_000] } else { vec![100, 1_000, 10_000, 100_000] };
    }
    let repeat = value("--repeat").and_then(|v| v.parse().ok()).unwrap_or(1);
    let mut b = Bench { figures: Vec::new(), quick, only: list("--only"), repeat };
    println!(
        "{:>7} {:<44} {:>11} {:>11} {:>11} {:>7}",
        "N", "operation", "median µs", "p90 µs", "limit µs", "ratio"
    );
    for n in sizes {
        if let Err(e) = run_size(&mut b, n) {
            eprintln!("benchmark at N={n} failed: {e}");
            return std::process::ExitCode::FAILURE;
        }
    }
    if let Some(file) = json_out {
        let figures: Vec<Value> = b
            .figures
            .iter()
            .map(|f| json!({"n": f.n, "op": f.op, "median_us": f.median_us, "p90_us": f.p90_us, "limit_median_us": f.limit_median_us}))
            .collect();
        let doc = json!({"backend": "sqlite", "quick": quick, "figures": figures});
        if let Err(e) =
            std::fs::write(&file, serde_json::to_string_pretty(&doc).unwrap_or_default())
        {
            eprintln!("cannot write {file}: {e}");
            return std::process::ExitCode::FAILURE;
        }
    }
    std::process::ExitCode::SUCCESS
}
