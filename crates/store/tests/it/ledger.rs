//! The usage ledger's persistence (`UsageLedger` for `Store`) against a real
//! SQLite file: keys, maintained totals, raw hermes rows, corrupt JSON.

use std::path::Path;
use std::sync::Arc;

use retinue_core::{
    AttributionDraft, ManualClock, NewSession, SessionCost, SessionStore, TotalsCatchUp,
    TotalsSnapshot, TotalsUpdate, UsageLedger, UsageTotals,
};
use retinue_store::{Store, StoreOptions};
use serde_json::{Value, json};
use tempfile::TempDir;

fn open(dir: &Path) -> Store {
    let clock = Arc::new(ManualClock::new(1_000.0));
    Store::open(dir.join("state.db"), StoreOptions::default().with_clock(clock))
        .expect("open state.db")
}

fn draft(parent: &str, child: &str, usage: Value, key: Option<&str>) -> AttributionDraft {
    AttributionDraft {
        parent_session_id: parent.to_owned(),
        child_session_id: child.to_owned(),
        usage,
        key: key.map(str::to_owned),
        ..AttributionDraft::default()
    }
}

fn delta(cost: f64, input: f64, output: f64) -> TotalsUpdate {
    TotalsUpdate {
        delta: UsageTotals { cost_usd: cost, input_tokens: input, output_tokens: output },
        catch_up: None,
    }
}

/// Inserts a row the way hermes does (no key, no maintained totals).
fn hermes_row(dir: &Path, parent: &str, usage: &str, aggregate: Option<&str>) {
    let conn = rusqlite::Connection::open(dir.join("state.db")).expect("open raw");
    conn.execute(
        "INSERT INTO delegation_child_usage \
         (parent_session_id, parent_turn_id, child_session_id, usage_json, aggregate_json, created_at) \
         VALUES (?1, '', 'hermes-child', ?2, ?3, 2000.0)",
        rusqlite::params![parent, usage, aggregate],
    )
    .expect("insert raw row");
}

fn count_rows(dir: &Path, table: &str) -> i64 {
    let conn = rusqlite::Connection::open(dir.join("state.db")).expect("open raw");
    conn.query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0)).expect("count")
}

#[test]
fn record_and_load_roundtrip() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    let mut first = draft("p1", "c1", json!({"cost_usd": 0.25, "tokens": {"input": 100}}), None);
    first.parent_turn_id = "turn-1".into();
    first.aggregate = Some(json!({"session_estimated_cost_usd": 1.25}));
    assert!(store.record_usage(&first, &delta(0.25, 100.0, 0.0)).unwrap());
    assert!(
        store
            .record_usage(
                &draft("p1", "c2", json!({"cost_usd": "0.75"}), None),
                &delta(0.75, 0.0, 0.0)
            )
            .unwrap()
    );
    assert!(
        store
            .record_usage(
                &draft("other", "", json!({"cost_usd": 99}), None),
                &delta(99.0, 0.0, 0.0)
            )
            .unwrap()
    );

    let recs = store.usage_attributions("p1").unwrap();
    assert_eq!(recs.len(), 2);
    assert!(recs[0].id < recs[1].id);
    insta::assert_json_snapshot!("roundtrip_records", recs, {"[].created_at" => "[ts]"});
    assert_eq!(recs[0].created_at, 1_000.0);
    assert!(store.usage_attributions("").unwrap().is_empty());
    assert!(store.usage_attributions("missing").unwrap().is_empty());

    let snap = store.usage_totals_snapshot("p1").unwrap();
    assert_eq!(
        snap.maintained,
        UsageTotals { cost_usd: 1.0, input_tokens: 100.0, output_tokens: 0.0 }
    );
    assert_eq!(snap.covered_id, recs[1].id);
    assert!(snap.pending.is_empty());
    assert_eq!(store.usage_totals_snapshot("missing").unwrap(), TotalsSnapshot::default());
    assert_eq!(store.usage_totals_snapshot("").unwrap(), TotalsSnapshot::default());
}

#[test]
fn empty_parent_writes_nothing() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    let d = draft("", "c1", json!({"cost_usd": 1}), Some("k"));
    assert!(!store.record_usage(&d, &delta(1.0, 0.0, 0.0)).unwrap());
    assert_eq!(count_rows(dir.path(), "delegation_child_usage"), 0);
    assert_eq!(count_rows(dir.path(), "retinue_usage_keys"), 0);
}

#[test]
fn known_key_writes_nothing() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    let d = draft("p1", "c1", json!({"cost_usd": 0.5}), Some("deleg_1:0:spawn"));
    assert!(store.record_usage(&d, &delta(0.5, 0.0, 0.0)).unwrap());
    assert!(!store.record_usage(&d, &delta(0.5, 0.0, 0.0)).unwrap());
    assert_eq!(count_rows(dir.path(), "delegation_child_usage"), 1);
    assert_eq!(store.usage_totals_snapshot("p1").unwrap().maintained.cost_usd, 0.5);
    // The key points at its row.
    let conn = rusqlite::Connection::open(dir.path().join("state.db")).unwrap();
    let usage_id: i64 = conn
        .query_row(
            "SELECT usage_id FROM retinue_usage_keys WHERE attribution_key = 'deleg_1:0:spawn'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(usage_id, store.usage_attributions("p1").unwrap()[0].id);
}

#[test]
fn hermes_row_is_pending_until_caught_up() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    assert!(
        store
            .record_usage(&draft("p1", "c1", json!({"cost_usd": 1}), None), &delta(1.0, 0.0, 0.0))
            .unwrap()
    );
    hermes_row(dir.path(), "p1", r#"{"cost_usd": 2, "tokens": {"input": 5, "output": 1}}"#, None);

    let snap = store.usage_totals_snapshot("p1").unwrap();
    assert_eq!(snap.maintained.cost_usd, 1.0);
    assert_eq!(snap.pending.len(), 1);
    let hermes_id = snap.pending[0].id;
    assert!(snap.pending[0].usage_json.contains("\"cost_usd\": 2"));

    // A new row without catch-up stays pending too: the totals skip nothing.
    assert!(
        store
            .record_usage(&draft("p1", "c2", json!({"cost_usd": 4}), None), &delta(4.0, 0.0, 0.0))
            .unwrap()
    );
    let snap = store.usage_totals_snapshot("p1").unwrap();
    assert_eq!(snap.maintained.cost_usd, 1.0);
    assert_eq!(snap.pending.len(), 2);

    // A stale catch-up (it misses the newest row) is ignored.
    let stale = TotalsUpdate {
        delta: UsageTotals { cost_usd: 8.0, ..UsageTotals::default() },
        catch_up: Some(TotalsCatchUp {
            from_covered_id: snap.covered_id,
            to_id: hermes_id,
            delta: UsageTotals { cost_usd: 2.0, input_tokens: 5.0, output_tokens: 1.0 },
        }),
    };
    assert!(store.record_usage(&draft("p1", "c3", json!({"cost_usd": 8}), None), &stale).unwrap());
    let snap = store.usage_totals_snapshot("p1").unwrap();
    assert_eq!(snap.maintained.cost_usd, 1.0);
    assert_eq!(snap.pending.len(), 3);

    // A current catch-up folds every pending row, then the new one.
    let current = TotalsUpdate {
        delta: UsageTotals { cost_usd: 16.0, ..UsageTotals::default() },
        catch_up: Some(TotalsCatchUp {
            from_covered_id: snap.covered_id,
            to_id: snap.pending[2].id,
            delta: UsageTotals { cost_usd: 14.0, input_tokens: 5.0, output_tokens: 1.0 },
        }),
    };
    assert!(
        store.record_usage(&draft("p1", "c4", json!({"cost_usd": 16}), None), &current).unwrap()
    );
    let snap = store.usage_totals_snapshot("p1").unwrap();
    assert_eq!(
        snap.maintained,
        UsageTotals { cost_usd: 31.0, input_tokens: 5.0, output_tokens: 1.0 }
    );
    assert!(snap.pending.is_empty());
}

#[test]
fn malformed_rows_read_as_empty() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    hermes_row(dir.path(), "p1", "{bad", Some("[1"));
    hermes_row(dir.path(), "p1", r#"{"cost_usd": "abc"}"#, Some("null"));
    hermes_row(dir.path(), "p1", r#"{"cost_usd": 0.1}"#, Some(r#"{"children_cost_total": 0.1}"#));
    let recs = store.usage_attributions("p1").unwrap();
    assert_eq!(recs.len(), 3);
    assert_eq!(recs[0].usage, json!({}));
    assert_eq!(recs[0].aggregate, None);
    assert_eq!(recs[1].usage, json!({"cost_usd": "abc"}));
    assert_eq!(recs[1].aggregate, None);
    assert_eq!(recs[2].aggregate, Some(json!({"children_cost_total": 0.1})));
    insta::assert_json_snapshot!("malformed_records", recs, {"[].created_at" => "[ts]"});
    let snap = store.usage_totals_snapshot("p1").unwrap();
    assert_eq!(snap.pending.iter().map(|p| p.usage_json.as_str()).collect::<Vec<_>>()[0], "{bad");
}

#[test]
fn reads_never_write() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    hermes_row(dir.path(), "p1", r#"{"cost_usd": 2}"#, None);
    let watcher = rusqlite::Connection::open(dir.path().join("state.db")).unwrap();
    let version = |c: &rusqlite::Connection| -> i64 {
        c.query_row("PRAGMA data_version", [], |r| r.get(0)).unwrap()
    };
    let before = version(&watcher);
    let _ = store.usage_totals_snapshot("p1").unwrap();
    let _ = store.usage_attributions("p1").unwrap();
    let _ = store.session_cost("p1").unwrap();
    assert_eq!(version(&watcher), before);
    assert_eq!(count_rows(dir.path(), "retinue_usage_totals"), 0);
    // A write by another connection does move it (the probe works).
    assert!(store.record_usage(&draft("p1", "", json!({}), None), &delta(0.0, 0.0, 0.0)).unwrap());
    assert_ne!(version(&watcher), before);
}

#[test]
fn totals_survive_reopen() {
    let dir = TempDir::new().unwrap();
    {
        let store = open(dir.path());
        let d = draft("p1", "c1", json!({"cost_usd": 0.5}), Some("k1"));
        assert!(store.record_usage(&d, &delta(0.5, 3.0, 4.0)).unwrap());
    }
    let store = open(dir.path());
    let snap = store.usage_totals_snapshot("p1").unwrap();
    assert_eq!(
        snap.maintained,
        UsageTotals { cost_usd: 0.5, input_tokens: 3.0, output_tokens: 4.0 }
    );
    // The key survives too.
    let d = draft("p1", "c1", json!({"cost_usd": 0.5}), Some("k1"));
    assert!(!store.record_usage(&d, &delta(0.5, 3.0, 4.0)).unwrap());
}

#[test]
fn session_cost_read_and_write() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    assert_eq!(store.session_cost("s1").unwrap(), None);
    assert!(!store.write_session_cost("s1", &SessionCost::default()).unwrap());
    store
        .create_session(&NewSession {
            id: "s1".into(),
            source: "cli".into(),
            ..NewSession::default()
        })
        .unwrap();
    assert_eq!(store.session_cost("s1").unwrap(), Some(SessionCost::default()));
    let full = SessionCost {
        estimated_cost_usd: Some(0.3),
        cost_status: Some("unknown".into()),
        cost_source: Some("none".into()),
    };
    assert!(store.write_session_cost("s1", &full).unwrap());
    assert_eq!(store.session_cost("s1").unwrap(), Some(full));
    // `None` fields stay as they are.
    let labels = SessionCost {
        estimated_cost_usd: None,
        cost_status: Some("estimated".into()),
        cost_source: Some("subagent".into()),
    };
    assert!(store.write_session_cost("s1", &labels).unwrap());
    assert_eq!(
        store.session_cost("s1").unwrap(),
        Some(SessionCost { estimated_cost_usd: Some(0.3), ..labels })
    );
}

#[test]
fn ledger_is_object_safe() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    let ledger: &dyn UsageLedger = &store;
    assert!(ledger.usage_attributions("p1").unwrap().is_empty());
}

/// Regression (reliability harness): a ledger row whose `usage_json` or
/// `aggregate_json` is a BLOB or non-UTF-8 text used to fail every read of
/// the parent's ledger; it now reads as malformed (`{}` / none).
#[test]
fn unreadable_ledger_bytes_read_as_malformed() {
    let dir = TempDir::new().expect("tempdir");
    let store = open(dir.path());
    let conn = rusqlite::Connection::open(dir.path().join("state.db")).expect("open raw");
    conn.execute_batch(
        "INSERT INTO delegation_child_usage (parent_session_id, usage_json, aggregate_json, \
         created_at) VALUES ('p', CAST(x'7bff' AS TEXT), x'ff', 1.0), \
         ('p', x'7b7d', CAST(x'5bff' AS TEXT), 2.0);",
    )
    .expect("raw rows");
    let rows = store.usage_attributions("p").expect("rows");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].usage, json!({}));
    assert_eq!(rows[0].aggregate, None);
    assert_eq!(rows[1].aggregate, None);
    let snapshot = store.usage_totals_snapshot("p").expect("snapshot");
    assert_eq!(snapshot.pending.len(), 2);
    assert!(
        store
            .record_usage(
                &draft("p", "c", json!({"cost_usd": 1.0}), Some("k")),
                &delta(1.0, 0.0, 0.0)
            )
            .expect("record after unreadable rows")
    );
}
