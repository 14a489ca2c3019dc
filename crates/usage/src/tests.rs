//! Unit tests of the pure rules, with the ledger mocked.

use mockall::predicate::eq;
use retinue_core::{
    MockLineageWalk, MockUsageLedger, PendingUsage, TotalsCatchUp, TotalsSnapshot, TotalsUpdate,
};
use serde_json::{Value, json};

use crate::*;

fn totals(cost_usd: f64, input_tokens: f64, output_tokens: f64) -> UsageTotals {
    UsageTotals { cost_usd, input_tokens, output_tokens }
}

fn check_fold(usage: Value, want: UsageTotals) {
    assert_eq!(fold_usage(&usage), want, "fold of {usage}");
    assert_eq!(fold_usage_text(&usage.to_string()), want, "fold of text {usage}");
}

#[test]
fn fold_counts_numbers_and_numeric_strings_per_field() {
    check_fold(
        json!({"cost_usd": 0.25, "tokens": {"input": 100, "output": 50}}),
        totals(0.25, 100.0, 50.0),
    );
    check_fold(
        json!({"cost_usd": "0.5", "tokens": {"input": " 7 ", "output": "x"}}),
        totals(0.5, 7.0, 0.0),
    );
    check_fold(
        json!({"cost_usd": "abc", "tokens": {"input": null, "output": 3}}),
        totals(0.0, 0.0, 3.0),
    );
    check_fold(json!({"cost_usd": true, "tokens": [1, 2]}), totals(0.0, 0.0, 0.0));
    check_fold(json!({"cost_usd": "NaN", "tokens": {"input": "inf"}}), totals(0.0, 0.0, 0.0));
    check_fold(json!([1, 2]), UsageTotals::default());
    check_fold(json!("0.3"), UsageTotals::default());
    assert_eq!(fold_usage_text("{bad"), UsageTotals::default());
    assert_eq!(fold_usage_text(""), UsageTotals::default());
}

#[test]
fn record_with_empty_parent_touches_nothing() {
    let ledger = MockUsageLedger::new();
    let draft = AttributionDraft { usage: json!({"cost_usd": 1}), ..AttributionDraft::default() };
    assert!(!record_child_usage_attribution(&ledger, &draft).unwrap());
}

#[test]
fn record_folds_pending_rows_as_a_catch_up() {
    let mut ledger = MockUsageLedger::new();
    ledger.expect_usage_totals_snapshot().with(eq("p1")).times(1).returning(|_| {
        Ok(TotalsSnapshot {
            maintained: totals(1.0, 0.0, 0.0),
            covered_id: 3,
            pending: vec![
                PendingUsage {
                    id: 4,
                    usage_json: r#"{"cost_usd":"2","tokens":{"input":5}}"#.into(),
                },
                PendingUsage { id: 6, usage_json: "{bad".into() },
            ],
        })
    });
    ledger
        .expect_record_usage()
        .withf(|draft, update| {
            draft.aggregate.is_none()
                && draft.key.as_deref() == Some("k")
                && *update
                    == TotalsUpdate {
                        delta: totals(0.5, 1.0, 2.0),
                        catch_up: Some(TotalsCatchUp {
                            from_covered_id: 3,
                            to_id: 6,
                            delta: totals(2.0, 5.0, 0.0),
                        }),
                    }
        })
        .times(1)
        .returning(|_, _| Ok(true));
    let draft = AttributionDraft {
        parent_session_id: "p1".into(),
        usage: json!({"cost_usd": 0.5, "tokens": {"input": 1, "output": 2}}),
        aggregate: Some(json!({})),
        key: Some("k".into()),
        ..AttributionDraft::default()
    };
    assert!(record_child_usage_attribution(&ledger, &draft).unwrap());
}

#[test]
fn totals_add_pending_rows_to_maintained() {
    let mut ledger = MockUsageLedger::new();
    ledger.expect_usage_totals_snapshot().returning(|_| {
        Ok(TotalsSnapshot {
            maintained: totals(1.0, 10.0, 5.0),
            covered_id: 2,
            pending: vec![PendingUsage {
                id: 9,
                usage_json: r#"{"cost_usd":0.5,"tokens":{"output":"1"}}"#.into(),
            }],
        })
    });
    assert_eq!(load_child_usage_totals(&ledger, "p1").unwrap(), totals(1.5, 10.0, 6.0));
    assert_eq!(load_child_usage_totals(&ledger, "").unwrap(), UsageTotals::default());
    assert!(load_child_usage_attributions(&ledger, "").unwrap().is_empty());
}

fn check_reapply(
    status: Option<&str>,
    source: Option<&str>,
    subagent: f64,
    want: (Option<&str>, Option<&str>),
) {
    let mut cost = ParentCost::new(0.0, status.map(str::to_owned), source.map(str::to_owned));
    cost.reapply(subagent);
    assert_eq!(
        (cost.cost_status.as_deref(), cost.cost_source.as_deref()),
        want,
        "status {status:?} source {source:?} subagent {subagent}"
    );
    assert_eq!(cost.estimated_cost_usd, subagent);
}

#[test]
fn reapply_sets_labels_only_when_unset_and_positive() {
    let fixed = (Some("estimated"), Some("subagent"));
    check_reapply(None, None, 0.42, fixed);
    check_reapply(Some(""), Some(""), 0.42, fixed);
    check_reapply(Some("unknown"), Some("none"), 0.42, fixed);
    check_reapply(Some("exact"), Some("provider"), 0.42, (Some("exact"), Some("provider")));
    check_reapply(Some("unknown"), Some("none"), 0.0, (Some("unknown"), Some("none")));
    check_reapply(Some("Unknown"), Some("None"), 0.1, (Some("Unknown"), Some("None")));
}

#[test]
fn reapply_never_adds() {
    let mut cost = ParentCost::new(0.1, None, None);
    cost.reapply(0.4);
    cost.reapply(0.4);
    assert!((cost.estimated_cost_usd - 0.5).abs() < 1e-12);
    assert_eq!(cost.own_cost_usd, 0.1);
    assert_eq!(cost.subagent_cost_usd, 0.4);
}

#[test]
fn parent_cost_load_is_idempotent() {
    let mut ledger = MockUsageLedger::new();
    ledger.expect_session_cost().with(eq("p1")).times(2).returning(|_| {
        Ok(Some(SessionCost {
            estimated_cost_usd: Some(0.1),
            cost_status: Some("unknown".into()),
            cost_source: Some("none".into()),
        }))
    });
    ledger.expect_usage_totals_snapshot().times(2).returning(|_| {
        Ok(TotalsSnapshot { maintained: totals(0.42, 0.0, 0.0), ..TotalsSnapshot::default() })
    });
    let first = ParentCost::load(&ledger, "p1").unwrap();
    let second = ParentCost::load(&ledger, "p1").unwrap();
    assert_eq!(first, second);
    assert!((first.estimated_cost_usd - 0.52).abs() < 1e-12);
    assert_eq!(first.cost_source.as_deref(), Some("subagent"));
    assert_eq!(first.cost_status.as_deref(), Some("estimated"));
}

fn entry(index: usize, cost: f64) -> FinalizeEntry {
    FinalizeEntry {
        task_index: index,
        child_session_id: format!("child-{index}"),
        usage: ChildUsage { cost_usd: cost, status: "completed".into(), ..ChildUsage::default() },
    }
}

#[test]
fn finalize_without_parent_session_adds_in_memory_only() {
    let ledger = MockUsageLedger::new();
    let mut cost = ParentCost::new(0.1, Some("unknown".into()), Some("none".into()));
    let ctx =
        FinalizeContext { delegation_id: "deleg_1", run: "spawn", ..FinalizeContext::default() };
    let report = finalize_child_results(&ledger, &ctx, &[entry(0, 0.2)], &mut cost);
    assert_eq!(report, FinalizeReport { recorded: 0, replayed: 0, ledger_ok: true });
    assert!((cost.estimated_cost_usd - 0.3).abs() < 1e-12);
    assert_eq!(cost.cost_source.as_deref(), Some("subagent"));
}

#[test]
fn finalize_ledger_failure_adds_in_memory_and_warns() {
    let mut ledger = MockUsageLedger::new();
    ledger.expect_usage_totals_snapshot().returning(|_| Ok(TotalsSnapshot::default()));
    ledger
        .expect_record_usage()
        .returning(|_, _| Err(retinue_core::Error::Invalid("disk on fire".into())));
    ledger.expect_write_session_cost().never();
    let mut cost = ParentCost::new(0.0, Some("unknown".into()), Some("none".into()));
    let ctx = FinalizeContext {
        parent_session_id: "p1",
        turn_id: "t",
        delegation_id: "deleg_1",
        run: "spawn",
    };
    let report = finalize_child_results(&ledger, &ctx, &[entry(0, 0.25), entry(1, 0.5)], &mut cost);
    assert!(!report.ledger_ok);
    assert!((cost.estimated_cost_usd - 0.75).abs() < 1e-12);
    assert_eq!(cost.cost_status.as_deref(), Some("estimated"));
}

#[test]
fn finalize_keys_each_child_run() {
    let ctx = FinalizeContext {
        parent_session_id: "p",
        turn_id: "",
        delegation_id: "deleg_ab",
        run: "spawn",
    };
    assert_eq!(attribution_key(&ctx, 2).as_deref(), Some("deleg_ab:2:spawn"));
    let unkeyed = FinalizeContext { delegation_id: "", ..ctx };
    assert_eq!(attribution_key(&unkeyed, 2), None);
}

#[test]
fn lineage_failed_root_uses_own_totals() {
    let mut walk = MockLineageWalk::new();
    walk.expect_lineage_sessions().with(eq("B")).returning(|_| None);
    let mut ledger = MockUsageLedger::new();
    ledger.expect_usage_totals_snapshot().with(eq("B")).returning(|_| {
        Ok(TotalsSnapshot { maintained: totals(0.5, 1.0, 1.0), ..TotalsSnapshot::default() })
    });
    let got = load_lineage_usage_totals(&ledger, &walk, "B").unwrap();
    assert!(!got.lineage_resolved);
    assert_eq!(got.totals, totals(0.5, 1.0, 1.0));
    assert_eq!(
        serde_json::to_value(&got).unwrap(),
        json!({"cost_usd": 0.5, "input_tokens": 1.0, "output_tokens": 1.0, "lineage_resolved": false})
    );
}

#[test]
fn lineage_sums_each_session_once() {
    let mut walk = MockLineageWalk::new();
    walk.expect_lineage_sessions()
        .returning(|_| Some(vec!["A".into(), "B".into(), "A".into(), String::new()]));
    let mut ledger = MockUsageLedger::new();
    ledger.expect_usage_totals_snapshot().times(2).returning(|p| {
        let cost = if p == "A" { 1.0 } else { 2.0 };
        Ok(TotalsSnapshot { maintained: totals(cost, 0.0, 0.0), ..TotalsSnapshot::default() })
    });
    let got = load_lineage_usage_totals(&ledger, &walk, "B").unwrap();
    assert!(got.lineage_resolved);
    assert_eq!(got.totals.cost_usd, 3.0);
    assert_eq!(got.sessions, vec!["A".to_owned(), "B".to_owned()]);
}

fn run(
    subagent: &str,
    session: &str,
    cost: f64,
    input: u64,
    output: u64,
    status: &str,
) -> ChildRun {
    ChildRun {
        subagent_id: subagent.into(),
        child_session_id: session.into(),
        usage: ChildUsage {
            cost_usd: cost,
            tokens: Some(Tokens { input, output }),
            api_calls: 1,
            status: status.into(),
        },
    }
}

#[test]
fn unit_usage_sums_results_and_follow_ups_add() {
    let spawn = merge_unit_usage(
        None,
        &[
            run("sa-0-aaaa0000", "c0", 0.1, 10, 5, "completed"),
            run("sa-1-bbbb1111", "c1", 0.2, 1, 2, "error"),
        ],
    );
    insta::assert_json_snapshot!("unit_usage_spawn", spawn);
    assert_eq!(spawn["cost_usd"], json!(0.3));
    let follow =
        merge_unit_usage(Some(&spawn), &[run("sa-0-aaaa0000", "c0", 0.05, 3, 3, "completed")]);
    insta::assert_json_snapshot!("unit_usage_follow_up", follow);
    assert_eq!(follow["children"][0]["runs"], json!(2));
    assert_eq!(follow["cost_usd"], json!(0.35));
}

#[test]
fn unit_usage_tolerates_bad_existing_json() {
    let from_retain = merge_unit_usage(Some(&json!({"cost_usd": 0.5})), &[]);
    assert_eq!(
        from_retain,
        json!({"cost_usd": 0.5, "tokens": {"input": 0, "output": 0}, "api_calls": 0, "children": []})
    );
    let bad = merge_unit_usage(Some(&json!([1])), &[]);
    assert_eq!(bad["cost_usd"], json!(0.0));
    let odd = json!({"cost_usd": "x", "children": [1, {"subagent_id": "sa-0", "runs": "2"}]});
    let merged = merge_unit_usage(Some(&odd), &[run("sa-0", "c", 0.1, 1, 1, "completed")]);
    assert_eq!(merged["children"].as_array().map(Vec::len), Some(1));
    assert_eq!(merged["children"][0]["runs"], json!(3));
}

#[test]
fn child_usage_json_shape() {
    let with = ChildUsage {
        cost_usd: 0.42,
        tokens: Some(Tokens { input: 7, output: 3 }),
        api_calls: 2,
        status: "completed".into(),
    };
    assert_eq!(
        with.to_json(),
        json!({"cost_usd": 0.42, "tokens": {"input": 7, "output": 3}, "api_calls": 2, "status": "completed"})
    );
    assert_eq!(ChildUsage::default().to_json()["tokens"], json!({}));
    assert_eq!(add_usd(0.1, 0.2), 0.3);
}
