//! The harnesses at CI size: 20 SIGKILLs, 4 processes × 8 threads, and
//! 20,000 oracle forests (300 of them through a real store).

use std::path::PathBuf;
use std::time::Duration;

use retinue_torture::rng::Rng;
use retinue_torture::{contention, crash, oracle};

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_retinue-torture"))
}

#[test]
fn crash_harness_20_kills() {
    let dir = tempfile::tempdir().expect("tempdir");
    let seed = Rng::os_seed();
    let opts = crash::CrashOptions {
        exe: exe(),
        dir: dir.path().to_path_buf(),
        kills: 20,
        seed,
        min_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(250),
    };
    let report = crash::run(&opts).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    println!("{}", report.to_json());
    assert_eq!(report.kills, 20);
    assert!(report.ops_logged > 0, "the worker made no progress: {report:?}");
}

#[test]
fn contention_harness_4_procs_8_threads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let seed = Rng::os_seed();
    let opts = contention::ContentionOptions {
        exe: exe(),
        dir: dir.path().to_path_buf(),
        procs: 4,
        threads: 8,
        ops: 200,
        seed,
    };
    let report = contention::run(&opts).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    println!("{}", report.to_json());
    assert_eq!(report.ops, 800);
    assert_eq!(report.busy, 0);
    assert!(report.counts.get("wait").copied().unwrap_or(0) > 0, "the waiter leg ran");
    assert_eq!(report.raced_units, 24, "8 waiters raced for each of 24 results");
}

#[test]
fn oracle_agrees_on_20000_forests() {
    let seed = Rng::os_seed();
    let report = oracle::run(20_000, 300, seed, 2).expect("oracle");
    println!("{}", report.to_json());
    assert_eq!(report.disagreements, 0, "{:?}", report.examples);
    assert_eq!(report.cases, 20_000);
    assert_eq!(report.db_cases, 300);
    // The generator reaches every verdict, and both sides of the walk limit.
    for verdict in [
        "Root",
        "Cycle",
        "MissingSession",
        "ForbiddenSource",
        "BadModelConfig",
        "Branch",
        "DelegateChild",
        "MissingParent",
        "ParentNotEnded",
        "ParentNotCompression",
        "AmbiguousContinuation",
        "HopLimit",
        "NoSession",
        "Storage",
    ] {
        assert!(
            report.verdicts.get(verdict).copied().unwrap_or(0) > 0,
            "{verdict} never generated"
        );
    }
    assert_eq!(report.max_links_resolved, 99);
}

/// The checker is not vacuous: each kind of damage a crash could do is caught.
#[test]
fn crash_checker_catches_damage() {
    let damage = [
        (
            "DELETE FROM retinue_children WHERE rowid = (SELECT max(rowid) FROM retinue_children)",
            "half-written",
        ),
        ("DELETE FROM sessions WHERE rowid = (SELECT max(rowid) FROM sessions)", "half-written"),
        (
            "DELETE FROM delegation_child_usage WHERE id = (SELECT max(id) FROM delegation_child_usage)",
            "ledger row",
        ),
        ("UPDATE retinue_usage_totals SET cost_usd = cost_usd + 1", "ledger totals"),
        (
            "UPDATE retinue_children SET tombstoned_at = NULL, tombstone_reason = NULL \
          WHERE tombstone_reason = 'manual'",
            "lost",
        ),
    ];
    for (sql, what) in damage {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = std::process::Command::new(exe())
            .arg("worker")
            .arg("--db")
            .arg(dir.path().join("state.db"))
            .arg("--log")
            .arg(dir.path().join("ops.log"))
            .args(["--seed", "11", "--max-ops", "300"])
            .status()
            .expect("worker");
        assert!(status.success());
        crash::check(dir.path()).expect("an undamaged run passes");
        let conn = rusqlite::Connection::open(dir.path().join("state.db")).expect("raw");
        assert!(conn.execute(sql, []).expect(sql) > 0, "{sql} changed nothing");
        drop(conn);
        let err = crash::check(dir.path()).expect_err(sql);
        assert!(err.contains(what), "{sql}: {err}");
    }
}
