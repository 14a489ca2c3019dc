//! A hot loop for profilers (`perf record`, callgrind): one operation, many times.
//!
//! `cargo run --release -p retinue-bench --example hot -- find|authority|list [iterations]`

use std::sync::Arc;

use retinue_core::{ManualClock, RegistryRead, Retention, UnitLifecycle};
use retinue_lineage::{Authority, LineageAuthority};
use retinue_store::{Store, StoreOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let op = args.first().map_or("find", String::as_str).to_owned();
    let iters: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("state.db");
    let clock = Arc::new(ManualClock::new(1_800_000_000.0));
    drop(Store::open(&path, StoreOptions::default().with_clock(clock.clone()))?);
    retinue_bench_fixture::populate(&path, 1000)?;
    clock.set(1_800_000_000.0 + 1010.0);
    let store = Arc::new(Store::open(&path, StoreOptions::default().with_clock(clock.clone()))?);
    let authority = Authority::new(store.clone(), store.clone(), "");
    let entry = store.find_retained_child("sa-0-000003e7")?.ok_or("fixture")?;
    let mut e = entry.clone();
    e.parent_session_id = "L0".into();
    for _ in 0..iters {
        match op.as_str() {
            "find" => drop(store.find_retained_child("sa-0-000003e7")?),
            "miss" => drop(store.find_retained_child("sa-9-ffffffff")?),
            "list" => drop(store.list_retained_children()?),
            "authority" => drop(authority.check_follow_up_authority(&e, Some("L99"))),
            "authority1" => drop(authority.check_follow_up_authority(&e, Some("L1"))),
            "retain" => {
                let draft = retinue_core::UnitDraft {
                    parent_session_id: Some("p-1".into()),
                    children: vec![retinue_core::ChildManifest {
                        subagent_id: format!("sa-0-hot{}", clock_now(&clock)),
                        ..Default::default()
                    }],
                    ..Default::default()
                };
                let id = store.insert_unit(&draft)?;
                store.retain_completed_delegation(&id, None)?;
                clock.advance(1.0);
            }
            "tombstone" => {
                let sa = format!("sa-0-hot{}", clock_now(&clock));
                let draft = retinue_core::UnitDraft {
                    parent_session_id: Some("p-1".into()),
                    children: vec![retinue_core::ChildManifest {
                        subagent_id: sa.clone(),
                        ..Default::default()
                    }],
                    ..Default::default()
                };
                let id = store.insert_unit(&draft)?;
                store.retain_completed_delegation(&id, None)?;
                if !store.tombstone_retained_child(&sa, &retinue_core::TombstoneReason::Manual)? {
                    return Err("tombstone changed nothing".into());
                }
                clock.advance(1.0);
            }
            other => return Err(format!("unknown op {other}").into()),
        }
    }
    Ok(())
}

fn clock_now(clock: &ManualClock) -> f64 {
    use retinue_core::Clock;
    clock.now()
}

#[path = "../src/fixture.rs"]
mod retinue_bench_fixture_impl;

mod retinue_bench_fixture {
    pub(crate) fn populate(path: &std::path::Path, n: usize) -> rusqlite::Result<()> {
        super::retinue_bench_fixture_impl::populate(path, n, 10, false)
    }
}
