//! Bad input never panics: malformed JSON, wrong types, huge strings, NUL
//! bytes, SQL-looking ids and non-UTF-8 bytes in `children_json`,
//! `manifest_json`, `usage_json`, `aggregate_json`, `model_config`, and in
//! the `delegate_task` arguments. Each gets a typed error or the documented
//! fallback (semantics §2.7, §6.2), and a refused operation leaves the database
//! unchanged.

use std::sync::Arc;

use proptest::prelude::*;
use retinue_config::DelegationConfig;
use retinue_core::{
    AttributionDraft, Claims, DeliveryFilter, RegistryRead, Retention, SessionGraph, SessionStore,
    TombstoneReason, UsageLedger, parse_children_json,
};
use retinue_delegate::{
    Delegator, DelegatorParts, ParentContext, parse_follow_up, parse_tasks, texts,
};
use retinue_lineage::Authority;
use retinue_testkit::SessionGraphBuilder;
use retinue_testkit::scripted::{RecordingSink, ScriptedRuntime};
use serde_json::{Value, json};

use super::common::{Fx, Hostile, T0, hostile, huge, json_value, refused_means_unchanged};

const HERMES_UNIT: &str = "deleg_4e4e4e4e";

/// A hermes-retained unit without child rows: every open and every registry
/// write backfills it from `children_json`.
fn hermes_unit(fx: &Fx, child_session: Option<&str>) {
    fx.raw()
        .execute(
            "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, \
             state, dispatched_at, updated_at, completed_at, child_session_id, retained, \
             retained_at) VALUES (?1, '', 'A', 'completed', ?2, ?2, ?2, ?3, 1, ?2)",
            rusqlite::params![HERMES_UNIT, T0, child_session],
        )
        .expect("hermes unit");
}

/// Every registry entry point on `store`: no panic; an error leaves the file as it was.
fn exercise_registry(fx: &Fx, store: &retinue_store::Store) {
    refused_means_unchanged(fx, "list", || store.list_retained_children());
    refused_means_unchanged(fx, "lookup", || store.lookup(HERMES_UNIT));
    refused_means_unchanged(fx, "find", || store.find_retained_child("hermes-child"));
    refused_means_unchanged(fx, "find sa", || store.find_retained_child("sa-0-abc12345"));
    refused_means_unchanged(fx, "unit usage", || store.unit_usage(HERMES_UNIT));
    refused_means_unchanged(fx, "claim delivery", || {
        store.claim_delivery(&DeliveryFilter::default())
    });
    refused_means_unchanged(fx, "prune", || store.prune_retained_children(None, None));
    refused_means_unchanged(fx, "tombstone", || {
        store.tombstone_retained_child("hermes-child", &TombstoneReason::Manual)
    });
    let _ = store.recover_abandoned_delegations(&retinue_core::ProcProbe);
}

fn children_json_case(value: &Hostile, child_session: Option<&str>) {
    let fx = Fx::new();
    retinue_testkit::dispatch_and_retain(&*fx.store, "A");
    hermes_unit(&fx, child_session);
    if !fx.poke(
        "async_delegations",
        "children_json",
        &format!("delegation_id = '{HERMES_UNIT}'"),
        value,
    ) {
        return;
    }
    let Some(store) = refused_means_unchanged(&fx, "open", || fx.reopen()) else { return };
    if let Ok(list) = store.list_retained_children() {
        // The documented fallback: the unit lists what §2.7 parses.
        let listed = list.iter().filter(|e| e.delegation_id == HERMES_UNIT).count();
        let want = parse_children_json(value.as_text(), child_session).len();
        if value.as_text().is_some() {
            assert_eq!(listed, want, "{value:?}");
        }
        assert!(list.iter().any(|e| e.child_session_id == "child-sess-1"), "{value:?}");
    }
    exercise_registry(&fx, &store);
}

fn manifest_json_case(value: &Hostile) {
    let fx = Fx::new();
    retinue_testkit::dispatch_and_retain(&*fx.store, "A");
    if !fx.poke("retinue_children", "manifest_json", "child_index = 0", value) {
        return; // NOT NULL: the database itself refuses the value.
    }
    exercise_registry(&fx, &fx.store);
    if let Ok(Some(entry)) = fx.store.find_retained_child("child-sess-1") {
        assert_eq!(entry.subagent_id, "sa-0-abc12345", "ids come from the indexed columns");
    }
}

fn usage_case(value: &Hostile) {
    let fx = Fx::new();
    let id = retinue_testkit::dispatch_and_retain(&*fx.store, "A");
    assert!(fx.poke("async_delegations", "usage_json", &format!("delegation_id = '{id}'"), value));
    let usage = refused_means_unchanged(&fx, "unit usage", || fx.store.unit_usage(&id));
    if let Some(usage) = usage
        && value.as_text().is_some_and(|t| serde_json::from_str::<Value>(t).is_err())
    {
        assert_eq!(usage, None, "malformed usage_json reads as absent");
    }
    // Ledger: one folded row, then a hermes row (not folded) holding `value`.
    let draft = AttributionDraft {
        parent_session_id: "P".into(),
        usage: json!({"cost_usd": 0.5, "tokens": {"input": 10, "output": 5}}),
        key: Some("k1".into()),
        ..AttributionDraft::default()
    };
    assert!(retinue_usage::record_child_usage_attribution(&*fx.store, &draft).expect("record"));
    let (expr, param) = value.bind();
    let inserted = fx.raw().execute(
        &format!(
            "INSERT INTO delegation_child_usage (parent_session_id, usage_json, aggregate_json, \
             created_at) VALUES ('P', {expr}, {}, 1.0)",
            expr.replace("?1", "?2")
        ),
        rusqlite::params![param, param],
    );
    if inserted.is_err() {
        return; // NOT NULL refuses a NULL usage_json: nothing to read.
    }
    let rows = refused_means_unchanged(&fx, "attributions", || fx.store.usage_attributions("P"));
    let totals = refused_means_unchanged(&fx, "totals", || {
        retinue_usage::load_child_usage_totals(&*fx.store, "P").map_err(store_err)
    });
    if let (Some(rows), Some(totals)) = (rows, totals) {
        let sum: f64 = rows.iter().map(|r| retinue_usage::fold_usage(&r.usage).cost_usd).sum();
        assert!(
            (sum - totals.cost_usd).abs() < 1e-9
                || !sum.is_finite()
                || !totals.cost_usd.is_finite(),
            "{value:?}: rows {sum} totals {}",
            totals.cost_usd
        );
        if value.as_text().is_some_and(|t| serde_json::from_str::<Value>(t).is_err()) {
            let hermes_row = rows.last().expect("the hermes row");
            assert_eq!(hermes_row.usage, json!({}), "malformed usage reads as {{}}");
        }
    }
    let again = AttributionDraft { key: Some("k2".into()), ..draft };
    refused_means_unchanged(&fx, "record after a hostile row", || {
        retinue_usage::record_child_usage_attribution(&*fx.store, &again).map_err(store_err)
    });
}

fn model_config_case(value: &Hostile, on_requester: bool) {
    let fx = Fx::new();
    SessionGraphBuilder::new(&fx.store).root("A").continuation("B", "A");
    retinue_testkit::dispatch_and_retain(&*fx.store, "A");
    let target = if on_requester { "B" } else { "A" };
    assert!(fx.poke("sessions", "model_config", &format!("id = '{target}'"), value));
    let root = retinue_lineage::root(&*fx.store, "B");
    let passes = match value {
        Hostile::Null => true,
        Hostile::Text(t) => retinue_lineage::check_hop("cli", Some(t)).is_ok(),
        // Integers and reals become TEXT numbers (not objects); blobs and
        // non-UTF-8 text are unreadable: all fail closed.
        _ => false,
    };
    assert_eq!(root.is_ok(), passes, "{value:?}: {root:?}");
    let _ = fx.store.compression_tip("child-sess-1");
    let _ = fx.store.session(target);
    let tool = delegator(&fx);
    let out = tool
        .delegate_task(&json!({"goal": "hi", "follow_up": "sa-0-abc12345"}), Some(&parent("B")));
    if passes {
        // Authority passed; the resume itself may stop later (no transcript here).
        assert_ne!(out["error"], texts::not_addressable("sa-0-abc12345"), "{value:?}");
    } else {
        assert_eq!(out["error"], texts::not_addressable("sa-0-abc12345"), "{value:?}");
    }
}

fn store_err(e: retinue_usage::UsageError) -> retinue_core::Error {
    match e {
        retinue_usage::UsageError::Store(e) => e,
        other => retinue_core::Error::Invalid(other.to_string()),
    }
}

pub(crate) fn delegator(fx: &Fx) -> Delegator {
    Delegator::new(DelegatorParts {
        backend: retinue_core::Backend::of(fx.store.clone()),
        authority: Arc::new(Authority::new(fx.store.clone(), fx.store.clone(), "")),
        runtime: Arc::new(ScriptedRuntime::new()),
        completions: Some(Arc::new(RecordingSink::default())),
        config: DelegationConfig::default().into(),
        profile: String::new(),
    })
}

pub(crate) fn parent(id: &str) -> ParentContext {
    ParentContext { session_id: Some(id.into()), ..ParentContext::default() }
}

fn documented_task_error(e: &str) -> bool {
    e == texts::TASKS_NOT_ARRAY
        || e == texts::NO_GOAL_OR_TASKS
        || (e.starts_with("Task ")
            && (e.ends_with("must be an object with a 'goal'.")
                || e.ends_with("is missing a 'goal'.")))
        || e.starts_with("Too many tasks: ")
}

fn check_parsers(args: &Value) {
    match parse_tasks(args, 3) {
        Ok(tasks) => {
            assert!(!tasks.is_empty() && tasks.len() <= 3);
            assert!(tasks.iter().all(|t| !t.goal.trim().is_empty()));
        }
        Err(e) => assert!(documented_task_error(&e.to_string()), "undocumented task error {e:?}"),
    }
    match parse_follow_up(args) {
        None => assert!(args.get("follow_up").is_none_or(Value::is_null)),
        Some(Ok(fu)) => assert!(!fu.target.trim().is_empty() && !fu.text.trim().is_empty()),
        Some(Err(e)) => assert!(
            [texts::FOLLOW_UP_NOT_STRING, texts::FOLLOW_UP_BLANK, texts::FOLLOW_UP_NO_GOAL]
                .contains(&e.to_string().as_str()),
            "undocumented follow-up error {e:?}"
        ),
    }
}

/// `delegate_task` end to end: always one JSON object; an error changes nothing.
fn check_tool(fx: &Fx, tool: &Delegator, args: &Value) {
    let before = fx.dump();
    let out = tool.delegate_task(args, Some(&parent("A")));
    assert!(out.is_object(), "{out}");
    if let Some(e) = out.get("error") {
        assert!(e.is_string(), "{out}");
        assert_eq!(before, fx.dump(), "refused call {args} changed the database: {out}");
    }
}

fn args_strategy() -> impl Strategy<Value = Value> {
    let field = prop_oneof![
        json_value(),
        prop::sample::select(super::common::NASTY_TEXTS).prop_map(Value::from),
        Just(json!("sa-0-abc12345")),
        Just(json!("child-sess-1")),
        Just(json!("[{\"goal\": \"from a string\"}]")),
        Just(json!([{"goal": "a"}, {"goal": "b", "role": "orchestrator"}])),
    ];
    prop::collection::vec(
        (
            prop::sample::select(vec![
                "goal",
                "context",
                "tasks",
                "role",
                "background",
                "follow_up",
            ]),
            field,
        ),
        0..5,
    )
    .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48, failure_persistence: None, ..ProptestConfig::default()
    })]

    #[test]
    fn children_json_never_panics(v in hostile(), sid in prop::option::of(Just("hermes-child"))) {
        children_json_case(&v, sid);
    }

    #[test]
    fn manifest_json_never_panics(v in hostile()) {
        manifest_json_case(&v);
    }

    #[test]
    fn usage_json_never_panics(v in hostile()) {
        usage_case(&v);
    }

    #[test]
    fn model_config_fails_closed(v in hostile(), on_requester in any::<bool>()) {
        model_config_case(&v, on_requester);
    }

    #[test]
    fn argument_parsers_give_documented_errors(args in args_strategy(), raw in json_value()) {
        check_parsers(&args);
        check_parsers(&raw);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 32, failure_persistence: None, ..ProptestConfig::default()
    })]

    #[test]
    fn delegate_task_refusals_change_nothing(calls in prop::collection::vec(args_strategy(), 1..6)) {
        let fx = Fx::new();
        SessionGraphBuilder::new(&fx.store).root("A");
        retinue_testkit::dispatch_and_retain(&*fx.store, "A");
        let tool = delegator(&fx);
        for args in &calls {
            check_tool(&fx, &tool, args);
        }
        tool.wait_background();
    }
}

#[test]
fn ten_megabytes_everywhere() {
    let big = huge();
    let value = Hostile::Text(big.clone());
    children_json_case(&value, Some("hermes-child"));
    manifest_json_case(&value);
    usage_case(&value);
    model_config_case(&value, true);
    let fx = Fx::new();
    SessionGraphBuilder::new(&fx.store).root("A");
    retinue_testkit::dispatch_and_retain(&*fx.store, "A");
    let tool = delegator(&fx);
    // A 10 MB follow-up id: refused, echoed cut to 128 characters.
    let before = fx.dump();
    let out = tool.delegate_task(&json!({"goal": "hi", "follow_up": big}), Some(&parent("A")));
    let e = out["error"].as_str().expect("error");
    assert!(e.len() < 1000 && e.contains("is not a running subagent"), "{}", &e[..200]);
    assert_eq!(before, fx.dump());
    // 10 MB of garbage `tasks`: the documented error.
    let out = tool.delegate_task(&json!({"tasks": big}), Some(&parent("A")));
    assert_eq!(out["error"], texts::TASKS_NOT_ARRAY);
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let out = tool.delegate_task(&json!({"tasks": deep}), Some(&parent("A")));
    assert_eq!(out["error"], texts::TASKS_NOT_ARRAY);
    assert_eq!(before, fx.dump());
    // A 10 MB goal runs; its manifest goal is cut to 200 characters.
    let out = tool.delegate_task(&json!({"goal": big}), Some(&parent("A")));
    assert_eq!(out["results"][0]["status"], "completed", "{}", &out.to_string()[..300]);
    let listed = fx.store.list_retained_children().expect("list");
    assert!(
        listed.iter().all(|e| e.manifest.goal.as_ref().is_none_or(|g| g.chars().count() <= 200))
    );
}

#[test]
fn nul_bytes_and_sql_ids_are_plain_data() {
    let fx = Fx::new();
    SessionGraphBuilder::new(&fx.store).root("A");
    let id = retinue_testkit::dispatch_and_retain(&*fx.store, "A");
    let tool = delegator(&fx);
    let before = fx.dump();
    for target in [
        "sa-0-abc12345\0",
        "\0sa-0-abc12345",
        "sa-0-abc1\u{0}2345",
        "' OR '1'='1",
        "sa-0-abc12345' --",
        "%",
        "_",
        "sa-0-%",
        "deleg_%",
        "*",
        "child-sess-1; DROP TABLE sessions;",
        "SA-0-ABC12345",
    ] {
        assert_eq!(fx.store.find_retained_child(target).expect("find"), None, "{target:?}");
        assert!(
            !fx.store.tombstone_retained_child(target, &TombstoneReason::Manual).expect("t"),
            "{target:?}"
        );
        let out =
            tool.delegate_task(&json!({"goal": "hi", "follow_up": target}), Some(&parent("A")));
        assert_eq!(out["error"], texts::not_addressable(target), "{target:?}");
    }
    assert_eq!(before, fx.dump(), "SQL-looking ids are data, never SQL");
    assert!(fx.store.find_retained_child(&id).expect("find").is_some());
    // NUL inside goals and contexts is kept as data.
    let out =
        tool.delegate_task(&json!({"goal": "a\u{0}b", "context": "\u{0}"}), Some(&parent("A")));
    assert_eq!(out["results"][0]["status"], "completed", "{out}");
}
