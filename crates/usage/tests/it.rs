//! The usage rules against a real `state.db` (ports of hermes's usage and
//! finalize tests, plus replay, reopen, lineage, corrupt data, properties).

use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;
use retinue_core::LineageWalk;
use retinue_core::{ManualClock, NewSession, SessionStore};
use retinue_store::{Store, StoreOptions};
use retinue_usage::{
    AttributionDraft, ChildUsage, FinalizeContext, FinalizeEntry, FinalizeReport, ParentCost,
    SessionCost, Tokens, UsageLedger, UsageTotals, finalize_child_results,
    load_child_usage_attributions, load_child_usage_totals, load_lineage_usage_totals,
    record_child_usage_attribution,
};
use serde_json::{Value, json};
use tempfile::TempDir;

fn open(dir: &Path) -> Store {
    let clock = Arc::new(ManualClock::new(1_000.0));
    Store::open(dir.join("state.db"), StoreOptions::default().with_clock(clock))
        .expect("open state.db")
}

fn record(
    store: &Store,
    parent: &str,
    turn: &str,
    child: &str,
    usage: Value,
    aggregate: Option<Value>,
) {
    let draft = AttributionDraft {
        parent_session_id: parent.into(),
        parent_turn_id: turn.into(),
        child_session_id: child.into(),
        usage,
        aggregate,
        key: None,
    };
    assert!(record_child_usage_attribution(store, &draft).expect("record"));
}

fn approx(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn usage_attribution_roundtrip_and_totals() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    record(
        &store,
        "p1",
        "turn-1",
        "c1",
        json!({"cost_usd": 0.25, "tokens": {"input": 100, "output": 50}}),
        Some(json!({"session_estimated_cost_usd": 1.25})),
    );
    record(
        &store,
        "p1",
        "",
        "c2",
        json!({"cost_usd": 0.75, "tokens": {"input": 10, "output": 5}}),
        None,
    );
    record(&store, "other", "", "", json!({"cost_usd": 99.0}), None);

    let records = load_child_usage_attributions(&store, "p1").unwrap();
    assert_eq!(records.len(), 2);
    assert_eq!(records[0].parent_turn_id, "turn-1");
    assert_eq!(records[0].aggregate.as_ref().unwrap()["session_estimated_cost_usd"], json!(1.25));
    insta::assert_json_snapshot!("roundtrip_records", records, {"[].created_at" => "[ts]"});

    let totals = load_child_usage_totals(&store, "p1").unwrap();
    assert!(approx(totals.cost_usd, 1.0));
    assert!(approx(totals.input_tokens, 110.0));
    assert!(approx(totals.output_tokens, 55.0));
    assert_eq!(
        serde_json::to_value(load_child_usage_totals(&store, "missing").unwrap()).unwrap(),
        json!({"cost_usd": 0.0, "input_tokens": 0.0, "output_tokens": 0.0})
    );
}

fn durable_ctx() -> FinalizeContext<'static> {
    FinalizeContext {
        parent_session_id: "parent-durable",
        turn_id: "turn-9",
        delegation_id: "deleg_0000abcd",
        run: "spawn",
    }
}

fn durable_entries() -> Vec<FinalizeEntry> {
    vec![FinalizeEntry {
        task_index: 0,
        child_session_id: "child-durable".into(),
        usage: ChildUsage {
            cost_usd: 0.42,
            tokens: Some(Tokens { input: 7, output: 3 }),
            api_calls: 2,
            status: "completed".into(),
        },
    }]
}

#[test]
fn finalize_child_results_persists_attribution() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    let mut parent = ParentCost::new(0.0, Some("unknown".into()), Some("none".into()));
    let report = finalize_child_results(&store, &durable_ctx(), &durable_entries(), &mut parent);
    assert_eq!(report, FinalizeReport { recorded: 1, replayed: 0, ledger_ok: true });
    assert!(approx(parent.estimated_cost_usd, 0.42));
    assert_eq!(parent.cost_source.as_deref(), Some("subagent"));
    assert_eq!(parent.cost_status.as_deref(), Some("estimated"));
    assert!(approx(load_child_usage_totals(&store, "parent-durable").unwrap().cost_usd, 0.42));
    let recs = load_child_usage_attributions(&store, "parent-durable").unwrap();
    assert_eq!(recs[0].child_session_id, "child-durable");
    assert_eq!(recs[0].usage["tokens"], json!({"input": 7, "output": 3}));
    insta::assert_json_snapshot!("finalize_records", recs, {"[].created_at" => "[ts]"});
}

fn parent_session(store: &Store, id: &str, own: f64) {
    store
        .create_session(&NewSession {
            id: id.into(),
            source: "cli".into(),
            ..NewSession::default()
        })
        .expect("create session");
    let cost = SessionCost {
        estimated_cost_usd: Some(own),
        cost_status: Some("unknown".into()),
        cost_source: Some("none".into()),
    };
    assert!(store.write_session_cost(id, &cost).expect("write cost"));
}

#[test]
fn replayed_finalize_leaves_totals_unchanged() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    parent_session(&store, "parent-durable", 0.1);
    let mut entries = durable_entries();
    entries.push(FinalizeEntry {
        task_index: 1,
        child_session_id: "child-zero".into(),
        usage: ChildUsage { status: "error".into(), ..ChildUsage::default() },
    });

    let mut first = ParentCost::load(&store, "parent-durable").unwrap();
    assert!(approx(first.estimated_cost_usd, 0.1));
    let report = finalize_child_results(&store, &durable_ctx(), &entries, &mut first);
    assert_eq!(report, FinalizeReport { recorded: 2, replayed: 0, ledger_ok: true });
    let totals = load_child_usage_totals(&store, "parent-durable").unwrap();

    let mut replay = ParentCost::load(&store, "parent-durable").unwrap();
    let report = finalize_child_results(&store, &durable_ctx(), &entries, &mut replay);
    assert_eq!(report, FinalizeReport { recorded: 0, replayed: 2, ledger_ok: true });
    assert_eq!(load_child_usage_totals(&store, "parent-durable").unwrap(), totals);
    assert_eq!(load_child_usage_attributions(&store, "parent-durable").unwrap().len(), 2);
    assert_eq!(first, replay);
    assert!(approx(replay.estimated_cost_usd, 0.52));

    // The zero-cost child is recorded too.
    let recs = load_child_usage_attributions(&store, "parent-durable").unwrap();
    assert_eq!(
        recs[1].usage,
        json!({"cost_usd": 0.0, "tokens": {}, "api_calls": 0, "status": "error"})
    );

    // The session keeps its own cost; the labels are stored; loading re-applies once.
    let stored = store.session_cost("parent-durable").unwrap().unwrap();
    assert_eq!(stored.estimated_cost_usd, Some(0.1));
    assert_eq!(stored.cost_status.as_deref(), Some("estimated"));
    assert_eq!(stored.cost_source.as_deref(), Some("subagent"));
    for _ in 0..3 {
        assert_eq!(ParentCost::load(&store, "parent-durable").unwrap(), first);
    }

    // A follow-up run is a new key and adds.
    let follow = FinalizeContext { run: "follow_up-1", ..durable_ctx() };
    let mut cost = ParentCost::load(&store, "parent-durable").unwrap();
    finalize_child_results(&store, &follow, &entries[..1], &mut cost);
    assert!(approx(cost.estimated_cost_usd, 0.94));
}

#[test]
fn totals_survive_reopening_the_db() {
    let dir = TempDir::new().unwrap();
    {
        let store = open(dir.path());
        let mut parent = ParentCost::default();
        finalize_child_results(&store, &durable_ctx(), &durable_entries(), &mut parent);
    }
    let store = open(dir.path());
    let totals = load_child_usage_totals(&store, "parent-durable").unwrap();
    assert!(approx(totals.cost_usd, 0.42));
    assert_eq!((totals.input_tokens, totals.output_tokens), (7.0, 3.0));
    // A replay after the restart still writes nothing.
    let mut parent = ParentCost::default();
    let report = finalize_child_results(&store, &durable_ctx(), &durable_entries(), &mut parent);
    assert_eq!(report.replayed, 1);
    assert_eq!(load_child_usage_totals(&store, "parent-durable").unwrap(), totals);
}

/// A↔B compression lineage as the lineage crate would resolve it.
struct FakeWalk;

impl LineageWalk for FakeWalk {
    fn lineage_sessions(&self, session: &str) -> Option<Vec<String>> {
        match session {
            "A" | "B" => Some(vec!["A".into(), "B".into()]),
            _ => None,
        }
    }
}

#[test]
fn lineage_totals_across_compression() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    record(
        &store,
        "A",
        "",
        "c1",
        json!({"cost_usd": 0.5, "tokens": {"input": 10, "output": 1}}),
        None,
    );
    record(
        &store,
        "B",
        "",
        "c2",
        json!({"cost_usd": 0.25, "tokens": {"input": 5, "output": 2}}),
        None,
    );
    record(&store, "stranger", "", "c3", json!({"cost_usd": 9}), None);

    for session in ["A", "B"] {
        let got = load_lineage_usage_totals(&store, &FakeWalk, session).unwrap();
        assert!(got.lineage_resolved);
        assert_eq!(
            got.totals,
            UsageTotals { cost_usd: 0.75, input_tokens: 15.0, output_tokens: 3.0 }
        );
    }
    let own = load_lineage_usage_totals(&store, &FakeWalk, "stranger").unwrap();
    assert!(!own.lineage_resolved);
    assert_eq!(own.totals.cost_usd, 9.0);
}

#[test]
fn malformed_usage_values_are_skipped_per_field() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    record(
        &store,
        "p1",
        "",
        "c1",
        json!({"cost_usd": "abc", "tokens": {"input": "12", "output": [1]}}),
        None,
    );
    record(&store, "p1", "", "c2", json!("not an object"), Some(json!({})));
    record(&store, "p1", "", "c3", json!({"cost_usd": "0.5", "tokens": null}), Some(Value::Null));
    let totals = load_child_usage_totals(&store, "p1").unwrap();
    assert_eq!(totals, UsageTotals { cost_usd: 0.5, input_tokens: 12.0, output_tokens: 0.0 });
    let recs = load_child_usage_attributions(&store, "p1").unwrap();
    assert!(recs.iter().all(|r| r.aggregate.is_none()));
    insta::assert_json_snapshot!("malformed_records", recs, {"[].created_at" => "[ts]"});
}

#[test]
fn empty_parent_records_nothing() {
    let dir = TempDir::new().unwrap();
    let store = open(dir.path());
    let draft = AttributionDraft { usage: json!({"cost_usd": 1}), ..AttributionDraft::default() };
    assert!(!record_child_usage_attribution(&store, &draft).unwrap());
    assert!(load_child_usage_attributions(&store, "").unwrap().is_empty());
    let ledger: &dyn UsageLedger = &store;
    assert_eq!(ledger.usage_totals_snapshot("").unwrap().covered_id, 0);
}

fn distinct_records() -> impl Strategy<Value = Vec<(u32, u32, u32)>> {
    proptest::collection::vec((0u32..10_000, 0u32..5_000, 0u32..5_000), 1..8)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn totals_equal_sum_of_distinct_records_in_any_order(
        (records, order) in distinct_records().prop_flat_map(|recs| {
            let n = recs.len();
            // Every record at least once, some twice, in a shuffled order.
            let order = proptest::collection::vec(0..n, 0..n)
                .prop_map(move |extra| (0..n).chain(extra).collect::<Vec<_>>())
                .prop_shuffle();
            (Just(recs), order)
        })
    ) {
        let dir = TempDir::new().unwrap();
        let store = open(dir.path());
        for &i in &order {
            let (cents, input, output) = records[i];
            let draft = AttributionDraft {
                parent_session_id: "p".into(),
                child_session_id: format!("c{i}"),
                usage: json!({"cost_usd": f64::from(cents) / 100.0, "tokens": {"input": input, "output": output}}),
                key: Some(format!("deleg:{i}:spawn")),
                ..AttributionDraft::default()
            };
            record_child_usage_attribution(&store, &draft).unwrap();
        }
        let want = records.iter().fold(UsageTotals::default(), |acc, &(c, i, o)| UsageTotals {
            cost_usd: acc.cost_usd + f64::from(c) / 100.0,
            input_tokens: acc.input_tokens + f64::from(i),
            output_tokens: acc.output_tokens + f64::from(o),
        });
        let got = load_child_usage_totals(&store, "p").unwrap();
        prop_assert!((got.cost_usd - want.cost_usd).abs() < 1e-6, "{got:?} vs {want:?}");
        prop_assert_eq!(got.input_tokens, want.input_tokens);
        prop_assert_eq!(got.output_tokens, want.output_tokens);
        prop_assert_eq!(load_child_usage_attributions(&store, "p").unwrap().len(), records.len());
    }
}
