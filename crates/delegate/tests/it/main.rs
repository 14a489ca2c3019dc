//! Integration tests of `delegate_task` against a real store and the scripted runtime.

use std::sync::Arc;
use std::time::Duration;

use retinue_config::DelegationConfig;
use retinue_core::{
    Claims, DeliveryFilter, ManualClock, Message, NewSession, RegistryRead, Retention,
    SessionGraph, SessionStore, TombstoneReason,
};
use retinue_delegate::{ChildHandle, Delegator, DelegatorParts, LiveChild, ParentContext};
use retinue_lineage::Authority;
use retinue_store::{Store, StoreOptions};
use retinue_testkit::scripted::{RecordingSink, Script, ScriptedRuntime};
use serde_json::{Value, json};

const T0: f64 = 1_800_000_000.0;

struct Fx {
    dir: tempfile::TempDir,
    clock: Arc<ManualClock>,
    store: Arc<Store>,
    runtime: Arc<ScriptedRuntime>,
    sink: Arc<RecordingSink>,
    tool: Delegator,
}

fn tool_over(
    store: &Arc<Store>,
    runtime: &Arc<ScriptedRuntime>,
    sink: &Arc<RecordingSink>,
    config: DelegationConfig,
) -> Delegator {
    Delegator::new(DelegatorParts {
        backend: retinue_core::Backend::of(store.clone()),
        authority: Arc::new(Authority::new(store.clone(), store.clone(), "")),
        runtime: runtime.clone(),
        completions: Some(sink.clone()),
        config: config.into(),
        profile: String::new(),
    })
}

impl Fx {
    fn new() -> Fx {
        Fx::with(DelegationConfig::default(), ScriptedRuntime::new())
    }

    fn with(config: DelegationConfig, runtime: ScriptedRuntime) -> Fx {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(T0));
        let opts = StoreOptions::default()
            .with_clock(clock.clone())
            .with_retention(config.clone().retention());
        let store = Arc::new(Store::open(dir.path().join("state.db"), opts).expect("open"));
        let runtime = Arc::new(runtime);
        let sink = Arc::new(RecordingSink::default());
        let tool = tool_over(&store, &runtime, &sink, config);
        Fx { dir, clock, store, runtime, sink, tool }
    }

    fn session(&self, id: &str, source: &str, parent: Option<&str>, config: Option<Value>) {
        self.store
            .create_session(&NewSession {
                id: id.into(),
                source: source.into(),
                parent_session_id: parent.map(str::to_owned),
                model_config: config,
                ..NewSession::default()
            })
            .expect("session");
    }

    fn say(&self, sid: &str, role: &str, text: &str) {
        self.store
            .append_message(
                sid,
                &Message { role: role.into(), content: Some(text.into()), ..Message::default() },
            )
            .expect("append");
    }

    /// The seed's `_dispatch_and_retain` (testkit's shared fixture).
    fn dispatch_and_retain(&self, parent: &str) -> String {
        retinue_testkit::dispatch_and_retain(&*self.store, parent)
    }

    /// A: root; child-sess-1: its delegate child with a two-turn transcript; retained unit.
    fn resumable(&self) -> String {
        self.session("A", "cli", None, None);
        self.session("child-sess-1", "delegate", Some("A"), Some(json!({"_delegate_from": "A"})));
        self.say("child-sess-1", "system", "you are a subagent");
        self.say("child-sess-1", "user", "original goal");
        self.say("child-sess-1", "assistant", "original answer");
        self.dispatch_and_retain("A")
    }

    fn call(&self, args: Value, parent: &ParentContext) -> Value {
        self.tool.delegate_task(&args, Some(parent))
    }
}

fn parent(id: &str) -> ParentContext {
    ParentContext { session_id: Some(id.into()), ..ParentContext::default() }
}

/// A budget store in which no session has a budget root (the calls it is
/// asked for under no configured budget), for the tests that add their own
/// reservation behaviour on top.
fn rootless_budgets() -> retinue_core::MockBudgets {
    let mut budgets = retinue_core::MockBudgets::new();
    budgets.expect_budget_root_of().returning(|_| Ok(None));
    budgets.expect_join_budget().returning(|_, _| Ok(()));
    budgets
}

fn err(v: &Value) -> &str {
    v.get("error").and_then(Value::as_str).unwrap_or_else(|| panic!("expected an error, got {v}"))
}

/// Waits (up to 20 s) until the scripted runtime has started `n` runs: a
/// child is registered live and holds its claim before its run starts.
fn wait_for_runs(fx: &Fx, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while fx.runtime.runs().len() < n {
        assert!(std::time::Instant::now() < deadline, "no run started in 20 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn register_live(fx: &Fx, sa: &str, session: &str, owner: Option<&str>) {
    fx.tool.register_live(LiveChild {
        handle: ChildHandle {
            subagent_id: sa.into(),
            session_id: session.into(),
            ..ChildHandle::default()
        },
        owner_session_id: owner.map(str::to_owned),
        owner_profile: String::new(),
        accepting_steer: true,
    });
}

#[test]
fn no_parent_context_is_an_error() {
    let fx = Fx::new();
    let out = fx.tool.delegate_task(&json!({"goal": "x"}), None);
    assert_eq!(err(&out), "delegate_task requires a parent agent context.");
}

#[test]
fn follow_up_steers_running_child() {
    let fx = Fx::new();
    fx.session("A", "cli", None, None);
    register_live(&fx, "sa-live-1", "live-child-sess", Some("A"));
    let out =
        fx.call(json!({"goal": "please also check X", "follow_up": "sa-live-1"}), &parent("A"));
    assert_eq!(out["status"], "queued");
    assert_eq!(out["child_id"], "sa-live-1");
    assert_eq!(fx.runtime.steers().len(), 1);
    let out2 = fx.call(json!({"goal": "more", "follow_up": "live-child-sess"}), &parent("A"));
    assert_eq!(out2["status"], "queued");
    assert_eq!(out2["child_id"], "live-child-sess");
    assert_eq!(
        fx.runtime.steers(),
        vec![
            ("sa-live-1".to_owned(), "please also check X".to_owned()),
            ("sa-live-1".to_owned(), "more".to_owned())
        ]
    );
    insta::assert_json_snapshot!("steer_result", out);
}

#[test]
fn follow_up_is_budget_exempt() {
    let fx = Fx::new();
    fx.session("A", "cli", None, None);
    register_live(&fx, "sa-deep-1", "deep-sess", Some("A"));
    let deep = ParentContext { depth: 99, ..parent("A") };
    assert_eq!(
        fx.call(json!({"goal": "msg", "follow_up": "sa-deep-1"}), &deep)["status"],
        "queued"
    );
    fx.tool.set_spawn_paused(true);
    assert_eq!(
        fx.call(json!({"goal": "msg2", "follow_up": "sa-deep-1"}), &deep)["status"],
        "queued"
    );
    assert_eq!(
        err(&fx.call(json!({"goal": "spawn"}), &parent("A"))),
        "Delegation spawning is paused; clear the pause before retrying."
    );
    fx.tool.set_spawn_paused(false);
    assert_eq!(
        err(&fx.call(json!({"goal": "spawn"}), &deep)),
        "Delegation depth limit reached (depth=99, max_spawn_depth=1). Raise delegation.max_spawn_depth to allow deeper nesting."
    );
}

#[test]
fn follow_up_unknown_target_errors() {
    let fx = Fx::new();
    let out = fx.call(json!({"goal": "hi", "follow_up": "sa-ghost"}), &parent("A"));
    assert!(err(&out).contains("not a running subagent"));
    assert!(err(&out).contains("'sa-ghost'"));
}

#[test]
fn follow_up_requires_goal() {
    let fx = Fx::new();
    assert_eq!(
        err(&fx.call(json!({"follow_up": "sa-anything"}), &parent("A"))),
        "follow_up requires 'goal' (the message to deliver to the child)."
    );
    assert_eq!(
        err(&fx.call(json!({"follow_up": "sa", "context": "only"}), &parent("A"))),
        "follow_up requires 'goal' (the message to deliver to the child)."
    );
    assert_eq!(
        err(&fx.call(json!({"follow_up": "  ", "goal": "g"}), &parent("A"))),
        "follow_up must name a subagent; got an empty value."
    );
    assert_eq!(
        err(&fx.call(json!({"follow_up": 7, "goal": "g"}), &parent("A"))),
        "follow_up must be a string (a subagent_id, child session_id or delegation_id)."
    );
}

#[test]
fn follow_up_tombstoned_child_errors() {
    let fx = Fx::new();
    fx.resumable();
    assert!(
        fx.store.tombstone_retained_child("sa-0-abc12345", &TombstoneReason::Manual).expect("t")
    );
    let out = fx.call(json!({"goal": "hi", "follow_up": "sa-0-abc12345"}), &parent("A"));
    assert_eq!(
        err(&out),
        "follow_up target 'sa-0-abc12345' was tombstoned at 2027-01-15T08:00:00Z (reason: manual) and can no longer receive follow-ups. Its transcript is kept (session child-sess-1)."
    );
    // A foreigner learns nothing of the tombstone.
    fx.session("stranger", "cli", None, None);
    let foreign = fx.call(json!({"goal": "hi", "follow_up": "sa-0-abc12345"}), &parent("stranger"));
    let missing =
        fx.call(json!({"goal": "hi", "follow_up": "sa-0-abc12345"}), &parent("A-missing"));
    assert_eq!(foreign, missing);
    assert!(err(&foreign).contains("not a running subagent"));
}

#[test]
fn ttl_expiry_is_told_to_the_owner() {
    let fx = Fx::new();
    fx.resumable();
    fx.clock.advance(73.0 * 3600.0);
    let out = fx.call(json!({"goal": "hi", "follow_up": "child-sess-1"}), &parent("A"));
    assert!(err(&out).contains("(reason: ttl)"), "{out}");
}

#[test]
fn follow_up_resumes_completed_child() {
    let fx = Fx::with(
        DelegationConfig::default(),
        ScriptedRuntime::new().with_script(
            "one more thing",
            Script {
                reply: Some("follow-up answer".into()),
                input_tokens: 7,
                output_tokens: 3,
                cost_usd: 0.25,
                ..Script::default()
            },
        ),
    );
    let id = fx.resumable();
    fx.clock.advance(3600.0);
    let out =
        fx.call(json!({"goal": "one more thing", "follow_up": "sa-0-abc12345"}), &parent("A"));
    assert_eq!(out["mode"], "follow_up", "{out}");
    assert_eq!(out["results"][0]["summary"], "follow-up answer");
    assert_eq!(out["delegation_id"], id.as_str());
    let runs = fx.runtime.runs();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].spec.resume_session_id.as_deref(), Some("child-sess-1"));
    assert_eq!(runs[0].spec.model.as_deref(), Some("test/model"));
    assert_eq!(runs[0].spec.role, retinue_core::Role::Leaf);
    assert_eq!(
        runs[0].input.history.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(),
        ["user", "assistant"]
    );
    assert_eq!(runs[0].input.system_prompt.as_deref(), Some("you are a subagent"));
    assert!(runs[0].input.user_message.starts_with("one more thing"));
    // The transcript grew on the same session; the session is ended again.
    let conv = fx.store.conversation("child-sess-1").expect("conv");
    assert_eq!(
        conv.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(),
        ["system", "user", "assistant", "user", "assistant"]
    );
    assert_eq!(
        fx.store.session("child-sess-1").expect("s").expect("row").end_reason.as_deref(),
        Some("completed")
    );
    // retained_at refreshed, usage added, ledger billed to A, claim released.
    let entry = fx.store.find_retained_child("sa-0-abc12345").expect("find").expect("entry");
    assert_eq!(entry.retained_at, Some(T0 + 3600.0));
    let usage = fx.store.unit_usage(&id).expect("usage").expect("some");
    assert!((usage["cost_usd"].as_f64().expect("cost") - 0.75).abs() < 1e-9, "{usage}");
    let totals = retinue_usage::load_child_usage_totals(&*fx.store, "A").expect("totals");
    assert!((totals.cost_usd - 0.25).abs() < 1e-9);
    assert!(matches!(
        fx.store.claim_resume(&id, 0).expect("claim"),
        retinue_core::ResumeClaim::Claimed { .. }
    ));
    insta::assert_json_snapshot!("resume_result", out, {".delegation_id" => "[id]", ".total_duration_seconds" => "[t]", ".results[].duration_seconds" => "[t]", ".results[].receipts.duration_seconds" => "[t]"});
}

#[test]
fn cap_and_external_reasons_are_told_to_the_owner_only() {
    let fx = Fx::with(
        DelegationConfig { max_retained: 1, ..DelegationConfig::default() },
        ScriptedRuntime::new(),
    );
    fx.session("P", "cli", None, None);
    fx.session("stranger", "cli", None, None);
    let first = fx.call(json!({"goal": "first"}), &parent("P"));
    let old_sa = first["results"][0]["subagent_id"].as_str().expect("sa").to_owned();
    fx.clock.advance(10.0);
    let second = fx.call(json!({"goal": "second"}), &parent("P"));
    let new_sa = second["results"][0]["subagent_id"].as_str().expect("sa").to_owned();
    let capped = fx.call(json!({"goal": "hi", "follow_up": old_sa}), &parent("P"));
    assert!(err(&capped).contains("(reason: cap)"), "{capped}");
    assert!(err(&capped).contains("was tombstoned at 2027-01-15T08:00:10Z"), "{capped}");
    // hermes tombstones the newer unit itself: reason `external`, at its time.
    let id = second["delegation_id"].as_str().expect("id").to_owned();
    let conn =
        retinue_testkit::rusqlite::Connection::open(fx.dir.path().join("state.db")).expect("raw");
    conn.execute(
        "UPDATE async_delegations SET tombstoned_at = ?1 WHERE delegation_id = ?2",
        retinue_testkit::rusqlite::params![T0 + 20.0, id],
    )
    .expect("hermes tombstone");
    let external = fx.call(json!({"goal": "hi", "follow_up": new_sa}), &parent("P"));
    assert!(err(&external).contains("(reason: external)"), "{external}");
    assert!(err(&external).contains("2027-01-15T08:00:20Z"), "{external}");
    // A foreigner gets the generic text for both, byte for byte as for a missing id.
    for sa in [&old_sa, &new_sa] {
        let foreign = fx.call(json!({"goal": "hi", "follow_up": sa}), &parent("stranger"));
        assert_eq!(err(&foreign), retinue_delegate::texts::not_addressable(sa));
    }
}

#[test]
fn follow_up_foreign_lineage_rejected() {
    let fx = Fx::new();
    fx.resumable();
    fx.session("stranger", "cli", None, None);
    let out = fx.call(json!({"goal": "hi", "follow_up": "sa-0-abc12345"}), &parent("stranger"));
    assert!(err(&out).contains("lineage"));
    assert!(err(&out).contains("not a running subagent"));
    assert!(fx.runtime.runs().is_empty());
    // Byte-identical to a missing id of the same spelling.
    let missing_fx = Fx::new();
    let missing =
        missing_fx.call(json!({"goal": "hi", "follow_up": "sa-0-abc12345"}), &parent("stranger"));
    assert_eq!(out, missing);
    // The child itself is refused with "itself".
    let own = fx.call(json!({"goal": "hi", "follow_up": "sa-0-abc12345"}), &parent("child-sess-1"));
    assert!(err(&own).contains("itself"));
}

#[test]
fn compression_continuation_may_resume_a_branch_may_not() {
    let fx = Fx::new();
    fx.resumable();
    fx.store.end_session("A", &"compression".into()).expect("end");
    fx.session("B", "cli", Some("A"), None);
    fx.session("BR", "cli", Some("A"), Some(json!({"_branched_from": "A"})));
    let denied = fx.call(json!({"goal": "hi", "follow_up": "child-sess-1"}), &parent("BR"));
    assert!(err(&denied).contains("not a running subagent"));
    let ok = fx.call(json!({"goal": "hi", "follow_up": "child-sess-1"}), &parent("B"));
    assert_eq!(ok["mode"], "follow_up", "{ok}");
}

#[test]
fn foreign_running_child_is_never_steered() {
    let fx = Fx::new();
    fx.session("A", "cli", None, None);
    fx.session("stranger", "cli", None, None);
    register_live(&fx, "sa-live-2", "live-2", Some("A"));
    register_live(&fx, "sa-orphan", "live-3", None);
    let out = fx.call(json!({"goal": "hijack", "follow_up": "sa-live-2"}), &parent("stranger"));
    let missing =
        fx.call(json!({"goal": "hijack", "follow_up": "sa-live-2x"}), &parent("stranger"));
    assert!(err(&out).contains("not a running subagent"));
    assert_eq!(err(&out).replace("sa-live-2'", "X'"), err(&missing).replace("sa-live-2x'", "X'"));
    let orphan = fx.call(json!({"goal": "hi", "follow_up": "sa-orphan"}), &parent("A"));
    assert!(err(&orphan).contains("not a running subagent"));
    assert!(fx.runtime.steers().is_empty());
}

#[test]
fn two_concurrent_follow_ups_exactly_one_runs() {
    let fx = Fx::with(
        DelegationConfig::default(),
        ScriptedRuntime::new().with_script(
            "slow",
            Script {
                reply: Some("slow done".into()),
                delay: Duration::from_millis(1500),
                ..Script::default()
            },
        ),
    );
    fx.resumable();
    let tool = fx.tool.clone();
    let first = std::thread::spawn(move || {
        tool.delegate_task(
            &json!({"goal": "slow one", "follow_up": "sa-0-abc12345"}),
            Some(&parent("A")),
        )
    });
    wait_for_runs(&fx, 1);
    let second = fx.call(json!({"goal": "fast one", "follow_up": "sa-0-abc12345"}), &parent("A"));
    let first = first.join().expect("join");
    assert_eq!(first["mode"], "follow_up", "{first}");
    assert!(
        err(&second).contains("is busy: another follow-up is already resuming this child"),
        "{second}"
    );
    assert_eq!(fx.runtime.runs().len(), 1);
    // Free again afterwards.
    let third = fx.call(json!({"goal": "fast one", "follow_up": "sa-0-abc12345"}), &parent("A"));
    assert_eq!(third["mode"], "follow_up");
}

#[test]
fn concurrent_follow_ups_on_siblings_both_count_in_the_unit_usage() {
    let slow = Script {
        reply: Some("ok".into()),
        delay: Duration::from_millis(200),
        cost_usd: 0.5,
        ..Script::default()
    };
    let fx =
        Fx::with(DelegationConfig::default(), ScriptedRuntime::new().with_script("again", slow));
    fx.session("P", "cli", None, None);
    let out = fx.call(json!({"tasks": [{"goal": "one"}, {"goal": "two"}]}), &parent("P"));
    let id = out["delegation_id"].as_str().expect("id").to_owned();
    let sas: Vec<String> = out["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| r["subagent_id"].as_str().unwrap_or("").to_owned())
        .collect();
    let handles: Vec<_> = sas
        .iter()
        .map(|sa| {
            let tool = fx.tool.clone();
            let sa = sa.clone();
            std::thread::spawn(move || {
                tool.delegate_task(&json!({"goal": "again", "follow_up": sa}), Some(&parent("P")))
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().expect("join")["mode"], "follow_up");
    }
    let usage = fx.store.unit_usage(&id).expect("usage").expect("some");
    let runs: Vec<u64> = usage["children"]
        .as_array()
        .expect("children")
        .iter()
        .map(|c| c["runs"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(runs, [2, 2], "{usage}");
    assert!((usage["cost_usd"].as_f64().expect("cost") - 1.02).abs() < 1e-9, "{usage}");
}

#[test]
fn sync_delegation_is_retained_and_resumable() {
    let fx = Fx::new();
    fx.session("P", "cli", None, None);
    let out = fx.call(json!({"goal": "write the report", "context": "Q3"}), &parent("P"));
    let results = out["results"].as_array().expect("results");
    assert_eq!(results.len(), 1);
    assert_eq!(results[0]["status"], "completed", "{out}");
    assert_eq!(results[0]["summary"], "Done: write the report");
    let sa = results[0]["subagent_id"].as_str().expect("sa").to_owned();
    let sid = results[0]["child_session_id"].as_str().expect("sid").to_owned();
    assert!(sa.starts_with("sa-0-") && sa.len() == 13);
    let listed = fx.store.list_retained_children().expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].child_id(), sa);
    // The child session is a delegate child of P with its opening turns.
    let row = fx.store.session(&sid).expect("s").expect("row");
    assert_eq!(row.source, "delegate");
    assert_eq!(row.parent_session_id.as_deref(), Some("P"));
    assert_eq!(
        fx.store.conversation(&sid).expect("c").iter().map(|m| m.role.as_str()).collect::<Vec<_>>(),
        ["system", "user", "assistant"]
    );
    // Billed once to P.
    let recs = retinue_usage::load_child_usage_attributions(&*fx.store, "P").expect("recs");
    assert_eq!(recs.len(), 1);
    let again = fx.call(json!({"goal": "and the appendix", "follow_up": sa}), &parent("P"));
    assert_eq!(again["mode"], "follow_up", "{again}");
    assert_eq!(fx.store.conversation(&sid).expect("c").len(), 5);
    insta::assert_json_snapshot!("sync_result", out, {
        ".delegation_id" => "[id]", ".total_duration_seconds" => "[t]",
        ".results[].duration_seconds" => "[t]", ".results[].subagent_id" => "[sa]",
        ".results[].receipts.duration_seconds" => "[t]",
        ".results[].child_session_id" => "[sid]"
    });
}

#[test]
fn batch_with_one_failed_child_and_a_failed_unit() {
    let fx = Fx::with(
        DelegationConfig::default(),
        ScriptedRuntime::new().with_script(
            "explode",
            Script { fail: Some("model refused".into()), ..Script::default() },
        ),
    );
    fx.session("P", "cli", None, None);
    let out = fx.call(
        json!({"tasks": [{"goal": "fine"}, {"goal": "explode now"}, {"goal": "also fine"}]}),
        &parent("P"),
    );
    let statuses: Vec<&str> = out["results"]
        .as_array()
        .expect("r")
        .iter()
        .map(|r| r["status"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(statuses, ["completed", "error", "completed"]);
    assert_eq!(out["results"][1]["error"], "model refused");
    assert_eq!(
        fx.store.list_retained_children().expect("list").len(),
        3,
        "batches are retained whole"
    );
    let failed = fx.call(json!({"goal": "explode again"}), &parent("P"));
    assert_eq!(failed["results"][0]["status"], "error");
    assert_eq!(
        fx.store.list_retained_children().expect("list").len(),
        3,
        "a failed unit is not retained"
    );
    let too_many = fx.call(
        json!({"tasks": [{"goal": "a"}, {"goal": "b"}, {"goal": "c"}, {"goal": "d"}]}),
        &parent("P"),
    );
    assert_eq!(err(&too_many), "Too many tasks: 4 exceeds delegation.max_concurrent_children (3).");
}

#[test]
fn a_child_that_times_out() {
    let config = DelegationConfig { child_timeout_seconds: 0.2, ..DelegationConfig::default() };
    let fx = Fx::with(
        config,
        ScriptedRuntime::new().with_script(
            "hang",
            Script {
                reply: Some("late".into()),
                delay: Duration::from_secs(2),
                ..Script::default()
            },
        ),
    );
    fx.session("P", "cli", None, None);
    let out = fx.call(json!({"goal": "hang around"}), &parent("P"));
    assert_eq!(out["results"][0]["status"], "timeout", "{out}");
    assert_eq!(out["results"][0]["exit_reason"], "timeout");
    assert!(fx.store.list_retained_children().expect("list").is_empty());
}

#[test]
fn background_completion_is_delivered_exactly_once() {
    let fx = Fx::new();
    fx.session("P", "cli", None, None);
    let bg = ParentContext { can_receive_detached: true, ..parent("P") };
    let out = fx.call(json!({"goal": "in the background", "background": true}), &bg);
    assert_eq!(out["status"], "dispatched", "{out}");
    assert_eq!(out["mode"], "background");
    assert_eq!(out["count"], 1);
    assert_eq!(out["children"][0]["goal"], "in the background");
    fx.tool.wait_background();
    let events = fx.sink.events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["delegation_id"], out["delegation_id"]);
    assert_eq!(events[0]["status"], "completed");
    // A competing consumer finds nothing left to claim.
    assert!(fx.store.claim_delivery(&DeliveryFilter::default()).expect("claim").is_none());
    assert_eq!(fx.store.list_retained_children().expect("list").len(), 1);
    // A parent that cannot receive detached results runs synchronously, with a note.
    let sync = fx.call(json!({"goal": "no detach", "background": true}), &parent("P"));
    assert_eq!(sync["results"][0]["status"], "completed");
    assert_eq!(sync["note"], "This parent cannot receive detached results; ran synchronously.");
    insta::assert_json_snapshot!("background_result", out, {".delegation_id" => "[id]", ".children[].subagent_id" => "[sa]", ".children[].session_id" => "[sid]"});
}

#[test]
fn a_steer_the_child_never_folded_in_is_reported_as_missed() {
    let script = Script {
        reply: Some("done".into()),
        delay: Duration::from_millis(1500),
        miss_steers: true,
        accept_steer: true,
        ..Script::default()
    };
    let fx = Fx::with(
        DelegationConfig::default(),
        ScriptedRuntime::new().with_script("long task", script),
    );
    fx.session("P", "cli", None, None);
    let bg = ParentContext { can_receive_detached: true, ..parent("P") };
    let out = fx.call(json!({"goal": "long task", "background": true}), &bg);
    let sa = out["children"][0]["subagent_id"].as_str().expect("sa").to_owned();
    wait_for_runs(&fx, 1);
    let steer = fx.call(json!({"goal": "also check the logs", "follow_up": sa}), &parent("P"));
    assert_eq!(steer["status"], "queued", "{steer}");
    fx.tool.wait_background();
    let events = fx.sink.events();
    assert_eq!(events.len(), 1);
    assert_eq!(
        events[0]["results"][0]["missed_steer"],
        json!(["also check the logs"]),
        "{}",
        events[0]
    );
    // Once the child has finished, steering is closed: a follow-up resumes it instead.
    let after = fx.call(json!({"goal": "and now?", "follow_up": sa}), &parent("P"));
    assert_eq!(after["mode"], "follow_up", "{after}");
}

#[test]
fn follow_up_after_restart_resumes_with_full_transcript() {
    let fx = Fx::new();
    fx.resumable();
    let path = fx.dir.path().join("state.db");
    let clock = fx.clock.clone();
    drop(fx.tool);
    drop(fx.store);
    let opts = StoreOptions::default().with_clock(clock.clone());
    let store = Arc::new(Store::open(&path, opts).expect("reopen"));
    let report = store.recover_abandoned_delegations(&retinue_core::ProcProbe);
    assert_eq!(report.addressable, 1);
    let runtime = Arc::new(ScriptedRuntime::new());
    let tool = tool_over(
        &store,
        &runtime,
        &Arc::new(RecordingSink::default()),
        DelegationConfig::default(),
    );
    let out = tool.delegate_task(
        &json!({"goal": "after restart", "follow_up": "child-sess-1"}),
        Some(&parent("A")),
    );
    assert_eq!(out["mode"], "follow_up", "{out}");
    assert_eq!(runtime.runs()[0].input.history.len(), 2);
}

#[test]
fn delegate_schema_exposes_follow_up() {
    let fx = Fx::new();
    let schema = fx.tool.schema();
    assert_eq!(schema["parameters"]["properties"]["follow_up"]["type"], "string");
    assert_eq!(schema["parameters"]["required"], json!([]));
    insta::assert_json_snapshot!("delegate_task_schema", schema);
}

#[test]
fn config_defaults_include_retention_knobs() {
    let c = DelegationConfig::default();
    assert_eq!((c.max_retained, c.retained_ttl_hours), (10, 72.0));
}

/// Failure injection at the trait seams, with mockall (the crate's own
/// dev-dependency turns the `mocks` feature on, so plain `cargo test` runs these).
mod seams {
    use std::sync::Arc;

    use retinue_config::DelegationConfig;
    use retinue_core::{Error, Lookup, MockRegistry, MockSessionStore, MockUsageLedger};
    use retinue_delegate::{Delegator, DelegatorParts, MockChildRuntime, ParentContext};
    use retinue_lineage::{MockLineageAuthority, Resolution};
    use serde_json::json;

    fn tool(
        registry: MockRegistry,
        authority: MockLineageAuthority,
        runtime: MockChildRuntime,
    ) -> Delegator {
        let mut sessions = MockSessionStore::new();
        sessions.expect_session().returning(|_| Ok(None));
        let sessions = Arc::new(sessions);
        // No budget is configured: the budget store is only asked for roots.
        let budgets = super::rootless_budgets();
        Delegator::new(DelegatorParts {
            backend: retinue_core::Backend {
                registry: Arc::new(registry),
                sessions: sessions.clone(),
                graph: sessions,
                ledger: Arc::new(MockUsageLedger::new()),
                budgets: Arc::new(budgets),
                controls: Arc::new({
                    let mut c = retinue_core::MockControls::new();
                    c.expect_take_controls().returning(|_| Ok(Vec::new()));
                    c
                }),
                // No tool asks for approval here: the queue is never touched.
                approvals: Arc::new(retinue_core::MockApprovalQueue::new()),
            },
            authority: Arc::new(authority),
            runtime: Arc::new(runtime),
            completions: None,
            config: DelegationConfig::default().into(),
            profile: String::new(),
        })
    }

    fn parent() -> ParentContext {
        ParentContext { session_id: Some("P".into()), ..ParentContext::default() }
    }

    #[test]
    fn unit_write_failure_starts_no_child() {
        let mut registry = MockRegistry::new();
        registry.expect_lookup().returning(|_| Ok(Lookup::Unknown));
        registry
            .expect_insert_unit()
            .times(1)
            .returning(|_| Err(Error::Invalid("disk on fire".into())));
        let mut runtime = MockChildRuntime::new();
        runtime.expect_build().never();
        runtime.expect_run().never();
        // The spawn proves its budget root (the parent's lineage root) first.
        let mut authority = MockLineageAuthority::new();
        authority.expect_root().returning(|s| Ok(s.to_owned()));
        let out = tool(registry, authority, runtime)
            .delegate_task(&json!({"goal": "anything"}), Some(&parent()));
        assert_eq!(out, json!({"error": "Failed to persist delegation; no child was started."}));
    }

    #[test]
    fn validation_errors_touch_nothing() {
        let mut registry = MockRegistry::new();
        registry.expect_insert_unit().never();
        let mut runtime = MockChildRuntime::new();
        runtime.expect_build().never();
        let t = tool(registry, MockLineageAuthority::new(), runtime);
        for args in [
            json!({}),
            json!({"tasks": "x"}),
            json!({"tasks": [{"goal": " "}]}),
            json!("not an object"),
        ] {
            let out = t.delegate_task(&args, Some(&parent()));
            assert!(out.get("error").is_some(), "{out}");
        }
        insta::assert_json_snapshot!("error_result", t.delegate_task(&json!({}), Some(&parent())));
    }

    #[test]
    fn denied_follow_up_never_claims_or_builds() {
        let mut registry = MockRegistry::new();
        registry.expect_claim_resume().never();
        registry.expect_lookup().never().returning(|_| Ok(Lookup::Unknown));
        let mut authority = MockLineageAuthority::new();
        authority.expect_resolve_for().times(1).returning(|_, _| Resolution::NotAddressable);
        let mut runtime = MockChildRuntime::new();
        runtime.expect_build().never();
        runtime.expect_steer().never();
        let out = tool(registry, authority, runtime)
            .delegate_task(&json!({"goal": "hi", "follow_up": "sa-x"}), Some(&parent()));
        assert!(
            out["error"]
                .as_str()
                .unwrap_or_default()
                .starts_with("follow_up target 'sa-x' is not a running subagent")
        );
    }

    #[test]
    fn storage_error_on_claim_fails_closed() {
        let mut registry = MockRegistry::new();
        registry
            .expect_claim_resume()
            .times(1)
            .returning(|_, _| Err(Error::Invalid("locked".into())));
        let mut authority = MockLineageAuthority::new();
        authority.expect_resolve_for().returning(|_, _| {
            Resolution::Addressable(retinue_core::RetainedChild {
                delegation_id: "deleg_1".into(),
                parent_session_id: "P".into(),
                owner_profile: String::new(),
                state: "completed".into(),
                retained_at: Some(1.0),
                completed_at: Some(1.0),
                child_index: 0,
                subagent_id: "sa-0-x".into(),
                child_session_id: "cs".into(),
                manifest: retinue_core::ChildManifest::default(),
            })
        });
        let mut runtime = MockChildRuntime::new();
        runtime.expect_build().never();
        let out = tool(registry, authority, runtime)
            .delegate_task(&json!({"goal": "hi", "follow_up": "sa-0-x"}), Some(&parent()));
        assert!(out["error"].as_str().unwrap_or_default().contains("not a running subagent"));
    }
}

/// Stopping children: deadlines, cancellation, panics.
mod stopping {
    use std::sync::Arc;
    use std::time::Duration;

    use retinue_config::DelegationConfig;
    use retinue_core::{ChildStatus, ExitReason, RegistryRead, SessionGraph, SessionStore};
    use retinue_delegate::{
        CancelToken, DelegateError, DelegateErrorKind, DelegateOutcome, DelegateRequest,
        MockChildRuntime, RuntimeError, SpawnRequest, TaskSpec,
    };
    use retinue_testkit::scripted::{Script, ScriptedRuntime};
    use serde_json::json;

    use super::{Fx, parent};

    fn spawn(goal: &str) -> DelegateRequest {
        DelegateRequest::Spawn(SpawnRequest {
            tasks: vec![TaskSpec { goal: goal.into(), ..TaskSpec::default() }],
            ..SpawnRequest::default()
        })
    }

    fn slow(tokens: u64) -> ScriptedRuntime {
        ScriptedRuntime::new().with_script(
            "slow",
            Script {
                reply: Some("late".into()),
                delay: Duration::from_secs(600),
                input_tokens: tokens,
                output_tokens: 7,
                cost_usd: 0.25,
                ..Script::default()
            },
        )
    }

    #[test]
    fn a_timed_out_child_is_stopped_and_billed_for_what_it_spent() {
        let config = DelegationConfig { child_timeout_seconds: 0.2, ..DelegationConfig::default() };
        let fx = Fx::with(config, slow(40));
        fx.session("P", "cli", None, None);
        let out = fx.tool.delegate(&spawn("slow work"), &parent("P"), &CancelToken::new());
        let Ok(DelegateOutcome::Completed(unit)) = out else { panic!("{out:?}") };
        let child = &unit.results[0];
        assert_eq!(child.status, ChildStatus::Timeout);
        assert_eq!(child.exit_reason, ExitReason::Timeout);
        assert_eq!(child.error.as_deref(), Some("Subagent timed out after 0 seconds."));
        assert_eq!((child.tokens.input, child.tokens.output), (40, 7));
        let totals = retinue_usage::load_child_usage_totals(&*fx.store, "P").expect("totals");
        assert_eq!((totals.input_tokens, totals.output_tokens, totals.cost_usd), (40.0, 7.0, 0.25));
        // The stopped child never wrote its late answer.
        let transcript = fx.store.conversation(&child.child_session_id).expect("transcript");
        assert!(transcript.iter().all(|m| m.content.as_deref() != Some("late")), "{transcript:?}");
        let session = fx.store.session(&child.child_session_id).expect("row").expect("session");
        assert_eq!(session.end_reason.as_deref(), Some("timeout"));
    }

    #[test]
    fn cancelling_the_call_interrupts_its_children_and_bills_them() {
        let fx = Fx::with(DelegationConfig::default(), slow(11));
        fx.session("P", "cli", None, None);
        let cancel = CancelToken::new();
        let stopper = cancel.clone();
        let waiter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            stopper.cancel();
        });
        let out = fx.tool.delegate(&spawn("slow work"), &parent("P"), &cancel);
        waiter.join().expect("canceller");
        let Ok(DelegateOutcome::Completed(unit)) = out else { panic!("{out:?}") };
        let child = &unit.results[0];
        assert_eq!(child.status, ChildStatus::Interrupted);
        assert_eq!(child.exit_reason, ExitReason::Interrupted);
        assert_eq!(child.tokens.input, 11);
        let totals = retinue_usage::load_child_usage_totals(&*fx.store, "P").expect("totals");
        assert_eq!(totals.input_tokens, 11.0);
        // An interrupted child is not retained.
        assert!(fx.store.list_retained_children().expect("list").is_empty());
    }

    #[test]
    fn a_huge_or_odd_timeout_never_panics() {
        for seconds in [f64::MAX, f64::INFINITY, 1e300, f64::NAN, -1.0] {
            let config =
                DelegationConfig { child_timeout_seconds: seconds, ..DelegationConfig::default() };
            let fx = Fx::with(config, ScriptedRuntime::new());
            fx.session("P", "cli", None, None);
            let out = fx.call(json!({"goal": "quick"}), &parent("P"));
            assert_eq!(out["results"][0]["status"], "completed", "{seconds}: {out}");
        }
    }

    #[test]
    fn a_panicking_child_is_reported_as_its_error_and_its_siblings_complete() {
        let fx = Fx::with(
            DelegationConfig::default(),
            ScriptedRuntime::new().with_script(
                "explode",
                Script { panic: Some("kaboom".into()), ..Script::default() },
            ),
        );
        fx.session("P", "cli", None, None);
        let out = fx.call(
            json!({"tasks": [{"goal": "fine"}, {"goal": "explode now"}, {"goal": "also fine"}]}),
            &parent("P"),
        );
        let results = out["results"].as_array().expect("results");
        assert_eq!(results.len(), 3, "{out}");
        assert_eq!(results[1]["status"], "error");
        assert!(results[1]["error"].as_str().unwrap_or_default().contains("kaboom"), "{out}");
        assert_eq!(results[0]["status"], "completed");
        assert_eq!(results[2]["status"], "completed");
    }

    #[test]
    fn a_runtime_that_cannot_build_says_why() {
        let fx = Fx::new();
        fx.session("P", "cli", None, None);
        let mut runtime = MockChildRuntime::new();
        runtime
            .expect_build()
            .times(1)
            .returning(|_| Err(RuntimeError::Config("set delegation.model".into())));
        runtime.expect_run().never();
        let tool = super::tool_with_runtime(&fx, Arc::new(runtime));
        let out = tool.delegate(&spawn("anything"), &parent("P"), &CancelToken::new());
        let Ok(DelegateOutcome::Completed(unit)) = out else { panic!("{out:?}") };
        assert_eq!(unit.results[0].status, ChildStatus::Error);
        assert_eq!(
            unit.results[0].error.as_deref(),
            Some("Failed to build subagent: set delegation.model")
        );
    }

    #[test]
    fn typed_errors_carry_their_class() {
        let fx = Fx::new();
        let none = fx.tool.delegate(
            &DelegateRequest::Spawn(SpawnRequest::default()),
            &parent("P"),
            &CancelToken::new(),
        );
        assert!(matches!(&none, Err(e) if e.kind() == DelegateErrorKind::Usage), "{none:?}");
        let deep = super::ParentContext { depth: 5, ..parent("P") };
        let refused = fx.tool.delegate(&spawn("x"), &deep, &CancelToken::new());
        assert!(matches!(refused, Err(DelegateError::DepthExceeded { depth: 5, max: 1 })));
        // The JSON adapter reports the depth refusal first, whatever the tasks say.
        let out = fx.tool.delegate_task(&json!({"tasks": "garbage"}), Some(&deep));
        assert!(out["error"].as_str().unwrap_or_default().starts_with("Delegation depth limit"));
    }
}

/// Failure injection at the transcript and completion sinks.
mod sinks {
    use std::sync::Arc;

    use retinue_config::DelegationConfig;
    use retinue_core::{Claims, DeliveryFilter, ExitReason};
    use retinue_delegate::{
        ChildHandle, ChildRuntime, ChildSpec, Delegator, DelegatorParts, MockCompletionSink,
        MockTranscriptSink, RunInput, SinkError,
    };
    use retinue_lineage::Authority;
    use retinue_testkit::scripted::ScriptedRuntime;
    use serde_json::json;

    use super::{Fx, ParentContext, parent};

    #[test]
    fn a_closed_transcript_ends_the_run_with_an_error() {
        let runtime = ScriptedRuntime::new();
        let spec = ChildSpec {
            subagent_id: "sa-0-x".into(),
            session_id: "s".into(),
            ..ChildSpec::default()
        };
        let child: ChildHandle = runtime.build(&spec).expect("build");
        let mut sink = MockTranscriptSink::new();
        sink.expect_append()
            .times(1)
            .returning(|_| Err(SinkError::Closed { session_id: "s".into() }));
        let input = RunInput { user_message: "hello".into(), ..RunInput::default() };
        let outcome = runtime.run(&child, &input, &sink, &retinue_delegate::RunContext::default());
        assert_eq!(outcome.exit_reason, ExitReason::Error);
        assert_eq!(
            outcome.error.as_deref(),
            Some("transcript write failed: transcript of s is closed (the run was stopped)")
        );
    }

    #[test]
    fn a_refused_delivery_stays_pending_until_a_sink_accepts_it() {
        let fx = Fx::new();
        fx.session("P", "cli", None, None);
        let mut refusing = MockCompletionSink::new();
        refusing.expect_deliver().times(1).returning(|_| false);
        let tool = Delegator::new(DelegatorParts {
            backend: retinue_core::Backend::of(fx.store.clone()),
            authority: Arc::new(Authority::new(fx.store.clone(), fx.store.clone(), "")),
            runtime: Arc::new(ScriptedRuntime::new()),
            completions: Some(Arc::new(refusing)),
            config: DelegationConfig::default().into(),
            profile: String::new(),
        });
        let bg = ParentContext { can_receive_detached: true, ..parent("P") };
        let out = tool.delegate_task(&json!({"goal": "later", "background": true}), Some(&bg));
        tool.wait_background();
        let id = out["delegation_id"].as_str().expect("id").to_owned();
        // The refused claim's lease runs out; the completion is offered again.
        fx.clock.advance(retinue_core::LEASE_SECS + 1.0);
        let claim = fx.store.claim_delivery(&DeliveryFilter::default()).expect("claim");
        let claim = claim.expect("the refused completion is still pending");
        assert_eq!(claim.delegation_id, id);
        assert_eq!(claim.event.raw["status"], "completed");
    }
}

fn tool_with_runtime(fx: &Fx, runtime: Arc<dyn retinue_delegate::ChildRuntime>) -> Delegator {
    Delegator::new(parts_over(fx, runtime, DelegationConfig::default()))
}

/// Every seam over `fx`'s store, with `runtime` and `config`.
fn parts_over(
    fx: &Fx,
    runtime: Arc<dyn retinue_delegate::ChildRuntime>,
    config: DelegationConfig,
) -> DelegatorParts {
    DelegatorParts {
        backend: retinue_core::Backend::of(fx.store.clone()),
        authority: Arc::new(Authority::new(fx.store.clone(), fx.store.clone(), "")),
        runtime,
        completions: None,
        config: config.into(),
        profile: String::new(),
    }
}

/// Budgets across a lineage (issue "Budgets"), on a real store with the
/// scripted runtime ($0.01, 100 + 20 tokens per child run).
mod budgets {
    use retinue_config::DelegationConfig;
    use retinue_core::{BudgetLimit, Claims, ResumeClaim, SessionStore};
    use retinue_testkit::scripted::ScriptedRuntime;
    use serde_json::{Value, json};

    use super::{Fx, err, parent};

    fn dollars(max: f64) -> DelegationConfig {
        DelegationConfig {
            budget: BudgetLimit { max_cost_usd: Some(max), max_tokens: None },
            ..DelegationConfig::default()
        }
    }

    fn remaining(out: &Value) -> f64 {
        out["budget"]["remaining"]["cost_usd"].as_f64().unwrap_or(f64::NAN)
    }

    #[test]
    fn a_lineage_budget_is_shared_by_its_continuation_and_refuses_when_spent() {
        let fx = Fx::with(dollars(0.02), ScriptedRuntime::new());
        fx.session("A", "cli", None, None);
        let first = fx.call(json!({"goal": "one"}), &parent("A"));
        assert_eq!(first["results"][0]["status"], "completed", "{first}");
        assert!((remaining(&first) - 0.01).abs() < 1e-9, "{first}");
        assert_eq!(first["budget"]["reserved"]["cost_usd"], 0.0);
        // The compression continuation is the same conversation: one budget.
        fx.store.end_session("A", &"compression".into()).expect("end");
        fx.session("A2", "cli", Some("A"), None);
        let second = fx.call(json!({"goal": "two"}), &parent("A2"));
        assert_eq!(second["results"][0]["status"], "completed", "{second}");
        assert!(remaining(&second).abs() < 1e-9, "{second}");
        let refused = fx.call(json!({"goal": "three"}), &parent("A2"));
        let text = err(&refused);
        assert!(
            text.starts_with("Budget exceeded for the session lineage rooted at 'A'"),
            "{text}"
        );
        assert!(text.contains("spent $0.0200") && text.contains("limit $0.0200"), "{text}");
        assert!(text.contains("remaining $0.0000"), "{text}");
        // Nothing was recorded for the refused call.
        let units = retinue_testkit::HermesDb::table_rows_of(
            &fx.dir.path().join("state.db"),
            "async_delegations",
            &["delegation_id"],
        );
        assert_eq!(units.len(), 2);
        // A stranger's lineage has its own budget.
        fx.session("S", "cli", None, None);
        let other = fx.call(json!({"goal": "elsewhere"}), &parent("S"));
        assert_eq!(other["results"][0]["status"], "completed", "{other}");
    }

    #[test]
    fn a_child_that_would_cross_the_budget_stops_with_exit_reason_budget() {
        let fx = Fx::with(dollars(0.015), ScriptedRuntime::new());
        fx.session("A", "cli", None, None);
        let first = fx.call(json!({"goal": "one"}), &parent("A"));
        assert_eq!(first["results"][0]["status"], "completed");
        let second = fx.call(json!({"goal": "two"}), &parent("A"));
        assert_eq!(second["results"][0]["exit_reason"], "budget", "{second}");
        assert_eq!(second["results"][0]["status"], "error");
        // Nothing was spent past the limit.
        let totals = retinue_usage::load_child_usage_totals(&*fx.store, "A").expect("totals");
        assert!(totals.cost_usd <= 0.015 + 1e-9, "{totals:?}");
    }

    #[test]
    fn a_call_budget_narrows_and_never_widens() {
        let fx = Fx::with(DelegationConfig::default(), ScriptedRuntime::new());
        fx.session("A", "cli", None, None);
        let narrowed =
            fx.call(json!({"goal": "g", "budget": {"max_cost_usd": 0.005}}), &parent("A"));
        assert_eq!(narrowed["results"][0]["exit_reason"], "budget", "{narrowed}");
        assert!(narrowed.get("budget").is_none(), "no lineage budget to report: {narrowed}");
        let bad = fx.call(json!({"goal": "g", "budget": {"max_cost_usd": -1}}), &parent("A"));
        assert!(err(&bad).starts_with("budget must be an object"));

        let fx = Fx::with(dollars(0.01), ScriptedRuntime::new());
        fx.session("A", "cli", None, None);
        let wide = fx.call(json!({"goal": "g", "budget": {"max_cost_usd": 5.0}}), &parent("A"));
        assert_eq!(wide["results"][0]["status"], "completed", "{wide}");
        let again = fx.call(json!({"goal": "g", "budget": {"max_cost_usd": 5.0}}), &parent("A"));
        assert!(err(&again).starts_with("Budget exceeded"), "{again}");
    }

    #[test]
    fn a_huge_resume_is_refused_with_its_estimate_and_frees_its_claim() {
        let config = DelegationConfig { max_resume_tokens: 5, ..DelegationConfig::default() };
        let fx = Fx::with(config, ScriptedRuntime::new());
        let id = fx.resumable();
        let out =
            fx.call(json!({"goal": "tell me more", "follow_up": "child-sess-1"}), &parent("A"));
        let text = err(&out);
        assert!(text.contains("would send about"), "{text}");
        assert!(text.contains("delegation.max_resume_tokens (5)"), "{text}");
        assert!(text.contains("Start a fresh child"), "{text}");
        // The claim was given back: the child can be resumed at once.
        assert!(matches!(fx.store.claim_resume(&id, 0), Ok(ResumeClaim::Claimed { .. })));
    }

    #[test]
    fn a_follow_up_is_billed_against_the_requesters_budget() {
        let fx = Fx::with(dollars(0.01), ScriptedRuntime::new());
        fx.resumable();
        let ok = fx.call(json!({"goal": "more", "follow_up": "child-sess-1"}), &parent("A"));
        assert_eq!(ok["mode"], "follow_up", "{ok}");
        assert!(remaining(&ok).abs() < 1e-9, "{ok}");
        // Charged: the note never says "budget-exempt" (issue #22).
        let note = ok["note"].as_str().unwrap_or_default();
        assert!(!note.contains("budget-exempt") && note.contains("charged"), "{note}");
        let refused = fx.call(json!({"goal": "more", "follow_up": "child-sess-1"}), &parent("A"));
        assert!(err(&refused).starts_with("Budget exceeded"), "{refused}");
    }
}

/// Failure injection at the budget seam.
mod budget_seam {
    use std::sync::Arc;

    use retinue_config::DelegationConfig;
    use retinue_core::{BudgetLimit, BudgetStatus, Error, MockBudgets, Reservation, Spend};
    use retinue_delegate::{Delegator, DelegatorParts};
    use retinue_lineage::Authority;
    use retinue_testkit::scripted::ScriptedRuntime;
    use serde_json::json;

    use super::{Fx, err, parent};

    fn tool(fx: &Fx, budgets: MockBudgets, runtime: Arc<ScriptedRuntime>) -> Delegator {
        Delegator::new(DelegatorParts {
            backend: retinue_core::Backend {
                budgets: Arc::new(budgets),
                ..retinue_core::Backend::of(fx.store.clone())
            },
            authority: Arc::new(Authority::new(fx.store.clone(), fx.store.clone(), "")),
            runtime,
            completions: None,
            config: DelegationConfig {
                budget: BudgetLimit { max_cost_usd: Some(1.0), max_tokens: None },
                ..DelegationConfig::default()
            }
            .into(),
            profile: String::new(),
        })
    }

    #[test]
    fn a_failing_budget_store_starts_nothing() {
        let fx = Fx::new();
        fx.session("A", "cli", None, None);
        let mut budgets = super::rootless_budgets();
        budgets.expect_set_hold().returning(|_, _| Ok(true));
        budgets.expect_grow().returning(|id, d| {
            Ok(Reservation::Held {
                id: id.to_owned(),
                granted: d.minimum,
                before: BudgetStatus { limit: d.limit, ..BudgetStatus::default() },
            })
        });
        budgets
            .expect_reserve()
            .times(1)
            .returning(|_| Err(Error::Invalid("budget table on fire".into())));
        budgets.expect_settle().never();
        let runtime = Arc::new(ScriptedRuntime::new());
        let out = tool(&fx, budgets, runtime.clone())
            .delegate_task(&json!({"goal": "g"}), Some(&parent("A")));
        // The budget store's failure says so (not "Failed to persist delegation").
        assert_eq!(
            err(&out),
            "Budget check failed while reserving the budget (invalid input: budget table on \
             fire); no child was started."
        );
        assert!(runtime.runs().is_empty());
    }

    #[test]
    fn a_refused_reservation_is_reported_and_nothing_is_settled() {
        let fx = Fx::new();
        fx.session("A", "cli", None, None);
        let mut budgets = super::rootless_budgets();
        budgets.expect_set_hold().returning(|_, _| Ok(true));
        budgets.expect_grow().returning(|id, d| {
            Ok(Reservation::Held {
                id: id.to_owned(),
                granted: d.minimum,
                before: BudgetStatus { limit: d.limit, ..BudgetStatus::default() },
            })
        });
        budgets.expect_reserve().times(1).returning(|d| {
            Ok(Reservation::Refused(BudgetStatus {
                limit: d.limit,
                spent: Spend { cost_usd: 0.75, tokens: 0 },
                reserved: Spend { cost_usd: 0.25, tokens: 0 },
            }))
        });
        budgets.expect_settle().never();
        let runtime = Arc::new(ScriptedRuntime::new());
        let out = tool(&fx, budgets, runtime.clone())
            .delegate_task(&json!({"goal": "g"}), Some(&parent("A")));
        let text = err(&out);
        assert!(
            text.contains("spent $0.7500") && text.contains("reserved by running children $0.2500"),
            "{text}"
        );
        assert!(text.contains("remaining $0.0000"), "{text}");
        assert!(runtime.runs().is_empty());
    }

    #[test]
    fn a_held_reservation_is_settled_once_after_the_run() {
        let fx = Fx::new();
        fx.session("A", "cli", None, None);
        let mut budgets = super::rootless_budgets();
        budgets.expect_set_hold().returning(|_, _| Ok(true));
        budgets.expect_grow().returning(|id, d| {
            Ok(Reservation::Held {
                id: id.to_owned(),
                granted: d.minimum,
                before: BudgetStatus { limit: d.limit, ..BudgetStatus::default() },
            })
        });
        budgets.expect_reserve().times(1).returning(|d| {
            Ok(Reservation::Held {
                id: "rsv_1".into(),
                granted: Spend { cost_usd: 1.0, tokens: 0 },
                before: BudgetStatus { limit: d.limit, ..BudgetStatus::default() },
            })
        });
        budgets.expect_settle().times(1).withf(|id, _| id == "rsv_1").returning(|_, _| Ok(true));
        budgets
            .expect_budget_status()
            .times(1)
            .returning(|_, _, limit| Ok(BudgetStatus { limit, ..BudgetStatus::default() }));
        let out = tool(&fx, budgets, Arc::new(ScriptedRuntime::new()))
            .delegate_task(&json!({"goal": "g"}), Some(&parent("A")));
        assert_eq!(out["results"][0]["status"], "completed", "{out}");
        assert_eq!(out["budget"]["remaining"]["cost_usd"], 1.0);
    }
}

/// Issue #23: budgets over the whole tree, bounded calls shared by
/// concurrent runs, no spend lost — on a real store.
mod budget_tree {
    use std::sync::Arc;
    use std::time::Duration;

    use retinue_config::DelegationConfig;
    use retinue_core::{
        AttributionDraft, BudgetLimit, Budgets, Result, SessionCost, TotalsSnapshot, TotalsUpdate,
        UsageAttribution, UsageLedger,
    };
    use retinue_delegate::{Delegator, DelegatorParts};
    use retinue_testkit::scripted::{Script, ScriptedRuntime};
    use serde_json::{Value, json};

    use super::{Fx, err, parent};

    fn limit(cost: Option<f64>, tokens: Option<u64>) -> DelegationConfig {
        DelegationConfig {
            budget: BudgetLimit { max_cost_usd: cost, max_tokens: tokens },
            max_concurrent_children: 3,
            ..DelegationConfig::default()
        }
    }

    fn child_session(out: &Value) -> String {
        out["results"][0]["child_session_id"].as_str().expect("child session").to_owned()
    }

    #[test]
    fn a_nested_spawn_draws_on_the_top_level_budget() {
        let fx = Fx::with(limit(Some(0.02), None), ScriptedRuntime::new());
        fx.session("A", "cli", None, None);
        let first = fx.call(json!({"goal": "orchestrate"}), &parent("A"));
        assert_eq!(first["results"][0]["status"], "completed", "{first}");
        let kid = child_session(&first);
        // The child joined its tree's budget when it was created.
        assert_eq!(fx.store.budget_root_of(&kid).expect("root").as_deref(), Some("A"));
        // The orchestrator child spawns in its turn: same budget, not a fresh one.
        let nested = fx.call(json!({"goal": "grandchild"}), &parent(&kid));
        assert_eq!(nested["results"][0]["status"], "completed", "{nested}");
        let grandkid = child_session(&nested);
        assert_eq!(fx.store.budget_root_of(&grandkid).expect("root").as_deref(), Some("A"));
        assert!(nested["budget"]["remaining"]["cost_usd"].as_f64().is_some_and(|r| r < 1e-9));
        // Spent by the tree: refused at every level.
        for payer in ["A", kid.as_str(), grandkid.as_str()] {
            let refused = fx.call(json!({"goal": "more"}), &parent(payer));
            assert!(err(&refused).starts_with("Budget exceeded"), "{payer}: {refused}");
        }
    }

    #[test]
    fn a_budget_root_that_cannot_be_proven_refuses() {
        let fx = Fx::with(limit(Some(1.0), None), ScriptedRuntime::new());
        // An unknown parent, and a delegate session nobody recorded.
        let out = fx.call(json!({"goal": "g"}), &parent("no-such-session"));
        assert!(err(&out).contains("cannot be determined"), "{out}");
        fx.session("A", "cli", None, None);
        fx.session("orphan-kid", "delegate", Some("A"), Some(json!({"_delegate_from": "A"})));
        let out = fx.call(json!({"goal": "g"}), &parent("orphan-kid"));
        assert!(err(&out).contains("cannot be determined"), "{out}");
        assert!(fx.runtime.runs().is_empty(), "nothing ran");
    }

    #[test]
    fn concurrent_runs_share_a_token_budget_instead_of_one_holding_it_all() {
        // Each run: 100 prompt + 20 completion tokens, slow enough to overlap.
        let slow = Script {
            input_tokens: 100,
            output_tokens: 20,
            delay: Duration::from_millis(300),
            ..Script::default()
        };
        let fx = Fx::with(
            limit(None, Some(100_000)),
            ScriptedRuntime::new().with_script("work", slow.clone()),
        );
        fx.session("A", "cli", None, None);
        let outs: Vec<Value> = std::thread::scope(|s| {
            let calls: Vec<_> = (0..3)
                .map(|_| s.spawn(|| fx.call(json!({"goal": "work"}), &parent("A"))))
                .collect();
            calls.into_iter().map(|c| c.join().expect("join")).collect()
        });
        for out in &outs {
            assert_eq!(out["results"][0]["status"], "completed", "{out}");
        }
        // A tight budget: whatever interleaving, the spend never passes it.
        let fx = Fx::with(limit(None, Some(250)), ScriptedRuntime::new().with_script("work", slow));
        fx.session("B", "cli", None, None);
        let outs: Vec<Value> = std::thread::scope(|s| {
            let calls: Vec<_> = (0..3)
                .map(|_| s.spawn(|| fx.call(json!({"goal": "work"}), &parent("B"))))
                .collect();
            calls.into_iter().map(|c| c.join().expect("join")).collect()
        });
        let status = fx
            .store
            .budget_status(
                "B",
                &["B".to_owned()],
                BudgetLimit { max_cost_usd: None, max_tokens: Some(250) },
            )
            .expect("status");
        assert!(status.spent.tokens <= 250, "overspent: {status:?} {outs:?}");
        assert_eq!(status.reserved.tokens, 0, "every reservation settled: {status:?}");
        let held = outs.iter().filter_map(|o| o.get("error").and_then(Value::as_str)).any(|e| {
            e.starts_with("Budget held by running delegations") || e.starts_with("Budget exceeded")
        }) || outs.iter().any(|o| o["results"][0]["exit_reason"] == "budget");
        assert!(held, "a third 120-token run cannot fit in 250: {outs:?}");
    }

    /// The store's ledger, except that writing a row fails.
    struct BrokenLedger(Arc<retinue_store::Store>);

    impl UsageLedger for BrokenLedger {
        fn record_usage(&self, _: &AttributionDraft, _: &TotalsUpdate) -> Result<bool> {
            Err(retinue_core::Error::Invalid("ledger disk full".into()))
        }
        fn usage_attributions(&self, parent: &str) -> Result<Vec<UsageAttribution>> {
            self.0.usage_attributions(parent)
        }
        fn usage_totals_snapshot(&self, parent: &str) -> Result<TotalsSnapshot> {
            self.0.usage_totals_snapshot(parent)
        }
        fn session_cost(&self, session: &str) -> Result<Option<SessionCost>> {
            self.0.session_cost(session)
        }
        fn write_session_cost(&self, session: &str, cost: &SessionCost) -> Result<bool> {
            self.0.write_session_cost(session, cost)
        }
    }

    #[test]
    fn a_failed_ledger_write_fails_the_call_and_keeps_the_spend() {
        let config = limit(Some(0.015), None);
        let fx = Fx::with(config.clone(), ScriptedRuntime::new());
        fx.session("A", "cli", None, None);
        let parts = super::parts_over(&fx, Arc::new(ScriptedRuntime::new()), config);
        let tool = Delegator::new(DelegatorParts {
            backend: retinue_core::Backend {
                ledger: Arc::new(BrokenLedger(fx.store.clone())),
                ..parts.backend.clone()
            },
            ..parts
        });
        let out = tool.delegate_task(&json!({"goal": "g"}), Some(&parent("A")));
        assert_eq!(out["results"][0]["status"], "completed", "{out}");
        assert!(out["ledger_error"].as_str().is_some_and(|e| e.contains("kept")), "{out}");
        // The $0.01 run is kept as spent although no ledger row exists.
        let status = fx
            .store
            .budget_status(
                "A",
                &["A".to_owned()],
                BudgetLimit { max_cost_usd: Some(0.015), max_tokens: None },
            )
            .expect("status");
        assert!((status.spent.cost_usd - 0.01).abs() < 1e-9, "{status:?}");
        assert_eq!(status.reserved.cost_usd, 0.0, "{status:?}");
        // $0.005 left cannot pay for a $0.01 call: refused before the call.
        let again = fx.call(json!({"goal": "g"}), &parent("A"));
        assert_eq!(again["results"][0]["exit_reason"], "budget", "{again}");
        let why = again["results"][0]["error"].as_str().unwrap_or_default();
        assert!(why.contains("exceeded"), "{again}");
        assert_eq!(again["budget"]["spent"]["cost_usd"], 0.01, "{again}");
    }

    /// A runtime that never asks for permits (an embedder's): the core
    /// still charges what it reports.
    struct Unmetered;

    impl retinue_delegate::ChildRuntime for Unmetered {
        fn build(
            &self,
            spec: &retinue_delegate::ChildSpec,
        ) -> std::result::Result<retinue_delegate::ChildHandle, retinue_delegate::RuntimeError>
        {
            Ok(retinue_delegate::ChildHandle {
                subagent_id: spec.subagent_id.clone(),
                session_id: spec.session_id.clone(),
                ..Default::default()
            })
        }
        fn run(
            &self,
            _: &retinue_delegate::ChildHandle,
            _: &retinue_delegate::RunInput,
            _: &dyn retinue_delegate::TranscriptSink,
            _: &retinue_delegate::RunContext,
        ) -> retinue_delegate::ChildOutcome {
            retinue_delegate::ChildOutcome {
                final_response: Some("done".into()),
                exit_reason: retinue_core::ExitReason::Completed,
                api_calls: 1,
                tokens: retinue_delegate::RunTokens {
                    input: 700,
                    output: 300,
                    ..Default::default()
                },
                ..retinue_delegate::ChildOutcome::default()
            }
        }
        fn steer(&self, _: &retinue_delegate::ChildHandle, _: &str) -> bool {
            false
        }
    }

    #[test]
    fn a_runtime_that_skips_permits_is_still_charged_by_the_core() {
        let config = limit(None, Some(1500));
        let fx = Fx::with(config.clone(), ScriptedRuntime::new());
        fx.session("A", "cli", None, None);
        let tool = Delegator::new(super::parts_over(&fx, Arc::new(Unmetered), config));
        let out = tool.delegate_task(&json!({"goal": "g"}), Some(&parent("A")));
        assert_eq!(out["budget"]["spent"]["tokens"], 1000, "{out}");
        let out = tool.delegate_task(&json!({"goal": "g"}), Some(&parent("A")));
        assert_eq!(out["budget"]["spent"]["tokens"], 2000, "{out}");
        let refused = tool.delegate_task(&json!({"goal": "g"}), Some(&parent("A")));
        assert!(err(&refused).starts_with("Budget exceeded"), "{refused}");
    }
}

/// Issue #23: the no-overspend property — random mixes of concurrent
/// spawns, nested spawns (a child as the payer) and follow-ups never spend
/// past a token budget, and every reservation is settled at the end.
mod no_overspend {
    use proptest::prelude::*;
    use retinue_config::DelegationConfig;
    use retinue_core::{BudgetLimit, Budgets};
    use retinue_testkit::scripted::{Script, ScriptedRuntime};
    use serde_json::{Value, json};

    use super::{Fx, parent};

    #[derive(Debug, Clone)]
    enum Op {
        /// `n` spawns at once, from the root or from a child (nested).
        Spawn { n: usize, nested: bool, script: usize },
        /// A follow-up on the newest child.
        FollowUp { script: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..=3, any::<bool>(), 0usize..4).prop_map(|(n, nested, script)| Op::Spawn {
                n,
                nested,
                script
            }),
            (0usize..4).prop_map(|script| Op::FollowUp { script }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        #[test]
        fn a_token_budget_is_never_overspent(
            limit in 100u64..1200,
            outputs in proptest::collection::vec(1u64..150, 4),
            ops in proptest::collection::vec(op(), 1..7),
        ) {
            let budget = BudgetLimit { max_cost_usd: None, max_tokens: Some(limit) };
            let mut runtime = ScriptedRuntime::new();
            for (i, out) in outputs.iter().enumerate() {
                let script = Script { input_tokens: 40, output_tokens: *out, ..Script::default() };
                runtime = runtime.with_script(&format!("work-{i}"), script);
            }
            let config = DelegationConfig {
                budget,
                max_concurrent_children: 3,
                ..DelegationConfig::default()
            };
            let fx = Fx::with(config, runtime);
            fx.session("A", "cli", None, None);
            let mut children: Vec<(String, String)> = Vec::new();
            for op in ops {
                let outs: Vec<Value> = match op {
                    Op::Spawn { n, nested, script } => {
                        let payer = match children.last() {
                            Some((_, session)) if nested => session.clone(),
                            _ => "A".to_owned(),
                        };
                        let goal = format!("work-{script}");
                        std::thread::scope(|s| {
                            let calls: Vec<_> = (0..n)
                                .map(|_| s.spawn(|| fx.call(json!({"goal": goal}), &parent(&payer))))
                                .collect();
                            calls.into_iter().map(|c| c.join().expect("join")).collect()
                        })
                    }
                    Op::FollowUp { script } => match children.last() {
                        Some((id, _)) => vec![fx.call(
                            json!({"goal": format!("work-{script}"), "follow_up": id}),
                            &parent("A"),
                        )],
                        None => Vec::new(),
                    },
                };
                for out in &outs {
                    for r in out["results"].as_array().into_iter().flatten() {
                        let fresh = r["status"] == "completed" && out.get("mode").is_none();
                        if let (true, Some(id), Some(s)) =
                            (fresh, r["subagent_id"].as_str(), r["child_session_id"].as_str())
                        {
                            children.push((id.to_owned(), s.to_owned()));
                        }
                    }
                }
                let status = fx.store.budget_status("A", &["A".to_owned()], budget).expect("status");
                prop_assert!(status.spent.tokens <= limit, "overspent: {status:?} after {outs:?}");
                prop_assert_eq!(status.reserved.tokens, 0, "unsettled: {:?}", status);
            }
        }
    }
}

/// Issue #22: a drawn subagent id that is already stored is drawn again.
mod ids {
    use std::sync::{Arc, Mutex};

    use retinue_config::DelegationConfig;
    use retinue_core::{Lookup, RegistryRead};
    use retinue_delegate::{Delegator, DelegatorParts};
    use retinue_testkit::scripted::ScriptedRuntime;
    use serde_json::json;

    use super::{Fx, parent};

    fn parts(fx: &Fx) -> DelegatorParts {
        super::parts_over(fx, Arc::new(ScriptedRuntime::new()), DelegationConfig::default())
    }

    #[test]
    fn a_colliding_id_is_drawn_again() {
        let fx = Fx::with(DelegationConfig::default(), ScriptedRuntime::new());
        fx.session("A", "cli", None, None);
        // The source's first draws repeat: every spawn would get the same ids.
        let draws: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(
            [
                "deadbeef",
                "0000000000000001",
                "deadbeef",
                "0000000000000001",
                "cafef00d",
                "0000000000000002",
            ]
            .map(str::to_owned)
            .to_vec(),
        ));
        let source = Arc::clone(&draws);
        let ids = Arc::new(move |n: usize| {
            let mut d = source.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if d.is_empty() { "f".repeat(n * 2) } else { d.remove(0) }
        });
        let tool = Delegator::new_with_ids(parts(&fx), ids);
        let first = tool.delegate_task(&json!({"goal": "one"}), Some(&parent("A")));
        assert_eq!(first["results"][0]["subagent_id"], "sa-0-deadbeef", "{first}");
        // The second spawn draws the same ids first: they are taken, so it draws again.
        let second = tool.delegate_task(&json!({"goal": "two"}), Some(&parent("A")));
        assert_eq!(second["results"][0]["subagent_id"], "sa-0-cafef00d", "{second}");
        assert_eq!(second["results"][0]["child_session_id"], "sess_0000000000000002");
        // Each id still names exactly its own child.
        let Lookup::Addressable(old) = fx.store.lookup("sa-0-deadbeef").expect("lookup") else {
            panic!("the first child is gone");
        };
        assert_eq!(old.child_session_id, "sess_0000000000000001");
        // A source that only ever repeats a taken id gives up, starting nothing.
        let stuck = Delegator::new_with_ids(
            parts(&fx),
            Arc::new(|n: usize| if n == 4 { "deadbeef".to_owned() } else { "1".repeat(n * 2) }),
        );
        let out = stuck.delegate_task(&json!({"goal": "three"}), Some(&parent("A")));
        assert!(out["error"].as_str().is_some_and(|e| e.contains("unused child id")), "{out}");
        // A failing source (empty draws) starts nothing, not even a first child.
        let empty = Delegator::new_with_ids(parts(&fx), Arc::new(|_: usize| String::new()));
        let out = empty.delegate_task(&json!({"goal": "four"}), Some(&parent("A")));
        assert!(out["error"].as_str().is_some_and(|e| e.contains("unused child id")), "{out}");
        assert!(fx.store.lookup("sa-0-").is_ok_and(|l| matches!(l, Lookup::Unknown)));
    }
}

/// Review of #23: a call of unknown price under a dollar limit that ends
/// without its usage (a dropped permit) is billed the pool it held.
mod unknown_price {
    use std::sync::Arc;

    use retinue_config::DelegationConfig;
    use retinue_core::{BudgetLimit, Budgets, ExitReason};
    use retinue_delegate::{
        CallPlan, ChildHandle, ChildOutcome, ChildRuntime, ChildSpec, Delegator, RunInput,
        RuntimeError, TranscriptSink,
    };
    use retinue_testkit::scripted::ScriptedRuntime;
    use serde_json::json;

    use super::{Fx, err, parent};

    /// Takes leave for a call, then loses it (no usage ever reported).
    struct Vanishing;

    impl ChildRuntime for Vanishing {
        fn build(&self, spec: &ChildSpec) -> Result<ChildHandle, RuntimeError> {
            Ok(ChildHandle {
                subagent_id: spec.subagent_id.clone(),
                session_id: spec.session_id.clone(),
                ..Default::default()
            })
        }
        fn run(
            &self,
            _: &ChildHandle,
            _: &RunInput,
            _: &dyn TranscriptSink,
            ctx: &retinue_delegate::RunContext,
        ) -> ChildOutcome {
            let permit =
                ctx.cancel.begin_call(CallPlan { prompt_tokens: 10, ..CallPlan::default() });
            drop(permit);
            ChildOutcome::failed(ExitReason::Error, "the connection vanished")
        }
        fn steer(&self, _: &ChildHandle, _: &str) -> bool {
            false
        }
    }

    #[test]
    fn a_lost_unpriced_call_is_billed_the_pool_it_held() {
        let limit = BudgetLimit { max_cost_usd: Some(1.0), max_tokens: None };
        let config = DelegationConfig { budget: limit, ..DelegationConfig::default() };
        let fx = Fx::with(config.clone(), ScriptedRuntime::new());
        fx.session("A", "cli", None, None);
        let tool = Delegator::new(super::parts_over(&fx, Arc::new(Vanishing), config));
        let out = tool.delegate_task(&json!({"goal": "g"}), Some(&parent("A")));
        assert_eq!(out["results"][0]["status"], "error", "{out}");
        let status = fx.store.budget_status("A", &["A".to_owned()], limit).expect("status");
        assert!(
            status.spent.cost_usd > 0.99,
            "the lost call was billed less than its pool: {status:?}"
        );
        let again = tool.delegate_task(&json!({"goal": "g"}), Some(&parent("A")));
        assert!(err(&again).starts_with("Budget exceeded"), "{again}");
    }
}

/// Background units from the parent's side (issue #26): wait (exactly
/// once, peek, foreign ≡ missing), steer and cancel through the registry's
/// mailbox, the inbox, and queueing beyond the background capacity.
mod background_units {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    use retinue_config::DelegationConfig;
    use retinue_core::{ControlOutcome, UnitState};
    use retinue_delegate::{CancelToken, DelegateErrorKind, Delegator, ParentContext, WaitState};
    use retinue_testkit::scripted::{Script, ScriptedRuntime};
    use serde_json::{Value, json};

    use super::{Fx, parent, parts_over, wait_for_runs};

    fn bg(id: &str) -> ParentContext {
        ParentContext { can_receive_detached: true, ..parent(id) }
    }

    /// A fixture whose delegator has no completion sink: results wait in
    /// the registry for a waiter (as under `retinue mcp` and the CLI).
    fn fixture(script: Script, config: DelegationConfig) -> (Fx, Delegator) {
        let runtime = ScriptedRuntime::new().with_script("", script);
        let fx = Fx::with(config.clone(), runtime);
        let tool = Delegator::new(parts_over(&fx, fx.runtime.clone(), config));
        fx.session("P", "cli", None, None);
        fx.session("Q", "cli", None, None);
        (fx, tool)
    }

    fn slow() -> Script {
        Script {
            reply: Some("slow answer".into()),
            delay: Duration::from_secs(30),
            accept_steer: true,
            ..Script::default()
        }
    }

    fn dispatch(tool: &Delegator, goal: &str, who: &str) -> Value {
        let out = tool.delegate_task(&json!({"goal": goal, "background": true}), Some(&bg(who)));
        assert_eq!(out["status"], "dispatched", "{out}");
        out
    }

    fn ids(v: &Value) -> Vec<String> {
        vec![v["delegation_id"].as_str().expect("id").to_owned()]
    }

    #[test]
    fn wait_delivers_once_peek_reads_and_foreign_ids_look_missing() {
        let (_fx, tool) = fixture(Script::default(), DelegationConfig::default());
        let out = dispatch(&tool, "quick", "P");
        let c = tool.collector();
        let long = Duration::from_secs(20);
        let peek = c.wait(&ids(&out), &bg("P"), long, true, &CancelToken::new()).expect("peek");
        assert_eq!(peek.entries[0].state, WaitState::Peeked);
        let first = c.wait(&ids(&out), &bg("P"), long, false, &CancelToken::new()).expect("wait");
        assert!(!first.timed_out);
        assert_eq!(first.entries[0].state, WaitState::Delivered);
        let json = first.to_json();
        assert_eq!(json["results"][0]["status"], "delivered");
        assert_eq!(json["results"][0]["result"]["results"][0]["summary"], "Done: quick", "{json}");
        let again = c.wait(&ids(&out), &bg("P"), long, false, &CancelToken::new()).expect("wait");
        assert_eq!(again.entries[0].state, WaitState::AlreadyDelivered);
        assert!(again.to_json()["results"][0].get("result").is_none(), "never again");
        // Another session (even of the same profile) and a made-up id: the same answer.
        let foreign = c.wait(&ids(&out), &bg("Q"), long, false, &CancelToken::new()).expect("w");
        let missing = c
            .wait(&["deleg_nope".to_owned()], &bg("P"), long, false, &CancelToken::new())
            .expect("w");
        assert_eq!(foreign.entries[0].state, WaitState::NotFound);
        assert_eq!(missing.entries[0].state, WaitState::NotFound);
        assert_eq!(foreign.entries[0].unit, None);
        // And the inbox has nothing left either.
        assert!(c.take_inbox(&bg("P")).is_empty());
    }

    #[test]
    fn a_cancelled_wait_consumes_nothing() {
        let (_fx, tool) = fixture(Script::default(), DelegationConfig::default());
        let out = dispatch(&tool, "quick", "P");
        tool.wait_background();
        let c = tool.collector();
        let gave_up = CancelToken::new();
        gave_up.cancel();
        let r = c.wait(&ids(&out), &bg("P"), Duration::from_secs(5), false, &gave_up).expect("w");
        assert_eq!(r.entries[0].state, WaitState::Peeked, "its caller gave up: nothing consumed");
        let r = c
            .wait(&ids(&out), &bg("P"), Duration::from_secs(5), false, &CancelToken::new())
            .expect("wait");
        assert_eq!(r.entries[0].state, WaitState::Delivered, "still there for the next wait");
    }

    #[test]
    fn an_inbox_claim_never_acknowledged_comes_back() {
        let (fx, tool) = fixture(Script::default(), DelegationConfig::default());
        let out = dispatch(&tool, "claimed", "P");
        tool.wait_background();
        let c = tool.collector();
        let claimed = c.claim_inbox(&bg("P"));
        assert_eq!(claimed.len(), 1);
        // The answer that carried it never went out (a cancelled call).
        drop(claimed);
        assert!(c.take_inbox(&bg("P")).is_empty(), "leased, not yet back");
        fx.clock.advance(retinue_core::LEASE_SECS + 1.0);
        let again = c.take_inbox(&bg("P"));
        assert_eq!(again.iter().map(|e| e.id.clone()).collect::<Vec<_>>(), ids(&out));
        assert!(c.take_inbox(&bg("P")).is_empty(), "and then once only");
    }

    #[test]
    fn a_wait_that_times_out_names_what_still_runs() {
        let (_fx, tool) = fixture(slow(), DelegationConfig::default());
        let out = dispatch(&tool, "slow", "P");
        let c = tool.collector();
        let r = c
            .wait(&ids(&out), &bg("P"), Duration::from_millis(300), false, &CancelToken::new())
            .expect("wait");
        assert!(r.timed_out);
        assert_eq!(r.entries[0].state, WaitState::Running);
        assert_eq!(r.to_json()["still_running"], json!(ids(&out)));
        c.cancel_unit(&ids(&out)[0], &bg("P")).expect("cancel");
        tool.wait_background();
    }

    #[test]
    fn eight_racing_waiters_get_one_result_between_them() {
        let (_fx, tool) = fixture(
            Script { delay: Duration::from_millis(300), ..Script::default() },
            DelegationConfig::default(),
        );
        let out = dispatch(&tool, "contended", "P");
        let barrier = Barrier::new(8);
        let states: Vec<WaitState> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let (c, barrier, ids) = (tool.collector(), &barrier, ids(&out));
                    s.spawn(move || {
                        barrier.wait();
                        let r = c
                            .wait(
                                &ids,
                                &bg("P"),
                                Duration::from_secs(20),
                                false,
                                &CancelToken::new(),
                            )
                            .expect("wait");
                        r.entries[0].state
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("waiter")).collect()
        });
        let delivered = states.iter().filter(|s| **s == WaitState::Delivered).count();
        assert_eq!(delivered, 1, "{states:?}");
        assert!(
            states.iter().all(|s| matches!(s, WaitState::Delivered | WaitState::AlreadyDelivered))
        );
    }

    #[test]
    fn cancel_stops_the_children_and_a_finished_unit_refuses() {
        let (fx, tool) = fixture(slow(), DelegationConfig::default());
        let out = dispatch(&tool, "slow", "P");
        wait_for_runs(&fx, 1);
        let c = tool.collector();
        let sa = out["children"][0]["subagent_id"].as_str().expect("sa").to_owned();
        // Another session may not cancel it (foreign ≡ missing).
        let denied = c.cancel_unit(&sa, &bg("Q")).expect_err("foreign");
        assert_eq!(denied.kind(), DelegateErrorKind::Denied);
        let r = c.cancel_unit(&sa, &bg("P")).expect("cancel");
        assert_eq!(r.outcome, ControlOutcome::Delivered);
        assert_eq!(r.state, UnitState::Interrupted, "{r:?}");
        let got = c
            .wait(&ids(&out), &bg("P"), Duration::from_secs(20), false, &CancelToken::new())
            .expect("wait")
            .to_json();
        let child = &got["results"][0]["result"]["results"][0];
        assert_eq!(child["exit_reason"], "cancelled", "{got}");
        assert_eq!(child["status"], "interrupted");
        let again = c.cancel_unit(&sa, &bg("P")).expect_err("finished");
        assert!(again.to_string().contains("already finished (interrupted)"), "{again}");
        tool.wait_background();
    }

    #[test]
    fn steer_reaches_the_running_child_and_a_late_one_is_missed() {
        let (fx, tool) = fixture(
            Script { delay: Duration::from_millis(1500), accept_steer: true, ..Script::default() },
            DelegationConfig::default(),
        );
        let out = dispatch(&tool, "steerable", "P");
        wait_for_runs(&fx, 1);
        let c = tool.collector();
        let sa = out["children"][0]["subagent_id"].as_str().expect("sa").to_owned();
        let r = c.steer(&sa, "look left", &bg("P")).expect("steer");
        assert_eq!(r.outcome, ControlOutcome::Delivered);
        assert_eq!(r.to_json()["status"], "delivered");
        assert!(fx.runtime.steers().iter().any(|(s, m)| *s == sa && m == "look left"));
        assert!(c.steer(&sa, "", &bg("P")).is_err(), "an empty message is refused");
        assert_eq!(
            c.steer(&sa, "from a stranger", &bg("Q")).expect_err("foreign").kind(),
            DelegateErrorKind::Denied
        );
        tool.wait_background();
        let late = c.steer(&sa, "too late", &bg("P")).expect("steer");
        assert_eq!(late.outcome, ControlOutcome::Missed);
        assert_eq!(late.to_json()["status"], "missed_steer");
    }

    #[test]
    fn a_steer_taken_after_the_children_ended_is_reported_in_the_result() {
        let (fx, tool) = fixture(
            Script { delay: Duration::from_millis(600), ..Script::default() },
            DelegationConfig::default(),
        );
        let out = dispatch(&tool, "steer refused", "P");
        wait_for_runs(&fx, 1);
        let c = tool.collector();
        let sa = out["children"][0]["subagent_id"].as_str().expect("sa").to_owned();
        // The scripted child refuses steering (accept_steer false): missed, and the
        // unit's result says so.
        let r = c.steer(&sa, "ignored", &bg("P")).expect("steer");
        assert_eq!(r.outcome, ControlOutcome::Missed);
        let got = c
            .wait(&ids(&out), &bg("P"), Duration::from_secs(20), false, &CancelToken::new())
            .expect("wait")
            .to_json();
        assert_eq!(got["results"][0]["result"]["results"][0]["missed_steer"], json!(["ignored"]));
    }

    #[test]
    fn units_beyond_the_capacity_queue_and_all_finish() {
        let config = DelegationConfig { max_concurrent_children: 2, ..DelegationConfig::default() };
        let (_fx, tool) =
            fixture(Script { delay: Duration::from_millis(200), ..Script::default() }, config);
        let outs: Vec<Value> = (0..6).map(|i| dispatch(&tool, &format!("unit {i}"), "P")).collect();
        assert_eq!(outs.iter().filter(|o| o["queued"] == true).count(), 4, "{outs:?}");
        assert!(outs[5]["note"].as_str().expect("note").contains("queued"));
        let all: Vec<String> = outs.iter().flat_map(ids).collect();
        let r = tool
            .collector()
            .wait(&all, &bg("P"), Duration::from_secs(30), false, &CancelToken::new())
            .expect("wait");
        assert!(!r.timed_out);
        assert!(r.entries.iter().all(|e| e.state == WaitState::Delivered), "{r:?}");
    }

    /// Counts the children running at once around a scripted runtime; a
    /// run waits for `open` first (bounded), so no unit can finish while
    /// the test is still dispatching, however slow the machine.
    struct Gauge {
        inner: Arc<ScriptedRuntime>,
        now: AtomicUsize,
        peak: AtomicUsize,
        open: std::sync::atomic::AtomicBool,
    }

    impl retinue_delegate::ChildRuntime for Gauge {
        fn build(
            &self,
            spec: &retinue_delegate::ChildSpec,
        ) -> Result<retinue_delegate::ChildHandle, retinue_delegate::RuntimeError> {
            self.inner.build(spec)
        }

        fn run(
            &self,
            child: &retinue_delegate::ChildHandle,
            input: &retinue_delegate::RunInput,
            sink: &dyn retinue_delegate::TranscriptSink,
            ctx: &retinue_delegate::RunContext,
        ) -> retinue_delegate::ChildOutcome {
            let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(n, Ordering::SeqCst);
            let until = std::time::Instant::now() + Duration::from_secs(30);
            while !self.open.load(Ordering::SeqCst) && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(2));
            }
            let out = self.inner.run(child, input, sink, ctx);
            self.now.fetch_sub(1, Ordering::SeqCst);
            out
        }

        fn steer(&self, child: &retinue_delegate::ChildHandle, message: &str) -> bool {
            self.inner.steer(child, message)
        }
    }

    #[test]
    fn fifty_background_units_run_at_most_the_capacity_at_once_and_none_is_lost() {
        let config = DelegationConfig { max_concurrent_children: 4, ..DelegationConfig::default() };
        let runtime = ScriptedRuntime::new()
            .with_script("", Script { delay: Duration::from_millis(40), ..Script::default() });
        let fx = Fx::with(config.clone(), ScriptedRuntime::new());
        fx.session("P", "cli", None, None);
        let gauge = Arc::new(Gauge {
            inner: Arc::new(runtime),
            now: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            open: std::sync::atomic::AtomicBool::new(false),
        });
        let tool = Delegator::new(parts_over(&fx, gauge.clone(), config));
        let outs: Vec<Value> =
            (0..50).map(|i| dispatch(&tool, &format!("unit {i}"), "P")).collect();
        let queued = outs.iter().filter(|o| o["queued"] == true).count();
        assert!(queued >= 46, "at most 4 start at once, the rest queue: {queued} queued");
        gauge.open.store(true, Ordering::SeqCst);
        let all: Vec<String> = outs.iter().flat_map(ids).collect();
        let r = tool
            .collector()
            .wait(&all, &bg("P"), Duration::from_secs(60), false, &CancelToken::new())
            .expect("wait");
        assert!(!r.timed_out);
        assert_eq!(r.entries.iter().filter(|e| e.state == WaitState::Delivered).count(), 50);
        let peak = gauge.peak.load(Ordering::SeqCst);
        assert!((1..=4).contains(&peak), "{peak} children ran at once");
    }

    #[test]
    fn a_queued_unit_cancelled_before_it_starts_runs_nothing() {
        let config = DelegationConfig { max_concurrent_children: 1, ..DelegationConfig::default() };
        let (fx, tool) = fixture(slow(), config);
        let first = dispatch(&tool, "holds the slot", "P");
        let queued = dispatch(&tool, "waits for it", "P");
        assert_eq!(queued["queued"], true);
        wait_for_runs(&fx, 1);
        let c = tool.collector();
        let r = c.cancel_unit(&ids(&queued)[0], &bg("P")).expect("cancel");
        assert_eq!(r.state, UnitState::Interrupted);
        let got = c
            .wait(&ids(&queued), &bg("P"), Duration::from_secs(20), false, &CancelToken::new())
            .expect("wait")
            .to_json();
        let child = &got["results"][0]["result"]["results"][0];
        assert_eq!(child["exit_reason"], "cancelled", "{got}");
        assert_eq!(fx.runtime.runs().len(), 1, "the queued child never ran");
        c.cancel_unit(&ids(&first)[0], &bg("P")).expect("cancel the first");
        tool.wait_background();
    }

    #[test]
    fn the_inbox_hands_each_completion_over_once() {
        let (_fx, tool) = fixture(Script::default(), DelegationConfig::default());
        let a = dispatch(&tool, "a", "P");
        let b = dispatch(&tool, "b", "P");
        let other = dispatch(&tool, "q's", "Q");
        tool.wait_background();
        let c = tool.collector();
        let mut got: Vec<String> = c.take_inbox(&bg("P")).into_iter().map(|e| e.id).collect();
        got.sort();
        let mut want = [ids(&a), ids(&b)].concat();
        want.sort();
        assert_eq!(got, want);
        assert!(c.take_inbox(&bg("P")).is_empty(), "exactly once");
        assert_eq!(c.take_inbox(&bg("Q")).len(), 1);
        assert_eq!(
            c.wait(&ids(&other), &bg("Q"), Duration::ZERO, false, &CancelToken::new())
                .expect("wait")
                .entries[0]
                .state,
            WaitState::AlreadyDelivered
        );
    }
}

// The crate's other suite, in this one test binary.
mod guards;
