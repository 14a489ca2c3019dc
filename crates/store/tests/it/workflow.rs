//! Delivery hand-off, resume claims, restart recovery and the history pruner.

use retinue_core::{
    Claims, Completion, DeliveryFilter, OwnerProbe, ProcProbe, ProcessState, RegistryRead,
    ResumeClaim, Retention, TombstoneReason, UnitLifecycle, UsageSwap, current_owner,
};
use serde_json::json;

use super::fixture::{Fx, T0, child, ids};

/// A scripted liveness probe.
struct Probe(fn(i64) -> Option<ProcessState>);

impl OwnerProbe for Probe {
    fn probe(&self, pid: i64) -> Option<ProcessState> {
        (self.0)(pid)
    }
}

fn complete(fx: &Fx, id: &str, status: &str, background: bool) {
    fx.store
        .persist_completion(&Completion {
            delegation_id: id.to_owned(),
            status: status.into(),
            event: retinue_core::CompletionEvent::from_stored(
                id,
                json!({"delegation_id": id, "status": status}),
            ),
            result: json!({"status": status}),
            usage: None,
            background,
        })
        .expect("persist");
}

#[test]
fn delivery_is_claimed_once_and_re_claimable_after_the_lease() {
    let fx = Fx::new();
    fx.insert_delegation("deleg_bg1", "p", "running");
    let filter = DeliveryFilter::default();
    assert!(
        fx.store.claim_delivery(&filter).expect("claim").is_none(),
        "running is not deliverable"
    );
    complete(&fx, "deleg_bg1", "completed", true);
    let first = fx.store.claim_delivery(&filter).expect("claim").expect("one");
    assert_eq!(first.attempt, 1);
    assert_eq!(first.token.len(), 32);
    assert_eq!(first.event.raw["delegation_id"], "deleg_bg1");
    // A competing consumer gets nothing while the lease holds.
    assert!(fx.store.claim_delivery(&filter).expect("claim").is_none());
    fx.clock.advance(300.0);
    let second = fx.store.claim_delivery(&filter).expect("claim").expect("re-claim");
    assert_eq!(second.attempt, 2);
    assert!(!fx.store.ack_delivery("deleg_bg1", &first.token).expect("ack"), "stale token");
    assert!(fx.store.ack_delivery("deleg_bg1", &second.token).expect("ack"));
    assert!(!fx.store.ack_delivery("deleg_bg1", &second.token).expect("ack"), "only once");
    fx.clock.advance(1000.0);
    assert!(fx.store.claim_delivery(&filter).expect("claim").is_none());
}

#[test]
fn ninth_claim_drops_the_delivery() {
    let fx = Fx::new();
    fx.insert_delegation("deleg_bg2", "p", "running");
    complete(&fx, "deleg_bg2", "failed", true);
    for attempt in 1..=8 {
        let c = fx.store.claim_delivery(&DeliveryFilter::default()).expect("claim").expect("claim");
        assert_eq!(c.attempt, attempt);
        fx.clock.advance(300.0);
    }
    assert!(fx.store.claim_delivery(&DeliveryFilter::default()).expect("claim").is_none());
    let state: String = fx
        .raw()
        .query_row(
            "SELECT delivery_state FROM async_delegations WHERE delegation_id='deleg_bg2'",
            [],
            |r| r.get(0),
        )
        .expect("row");
    assert_eq!(state, "dropped");
}

#[test]
fn delivery_filter_scopes_by_parent() {
    let fx = Fx::new();
    fx.insert_delegation("deleg_p1", "p1", "running");
    complete(&fx, "deleg_p1", "completed", true);
    let other =
        DeliveryFilter { parent_session_id: Some("p2".into()), ..DeliveryFilter::default() };
    assert!(fx.store.claim_delivery(&other).expect("claim").is_none());
    let mine = DeliveryFilter { parent_session_id: Some("p1".into()), ..DeliveryFilter::default() };
    assert!(fx.store.claim_delivery(&mine).expect("claim").is_some());
}

#[test]
fn resume_claim_is_single_use_and_leased() {
    let fx = Fx::new();
    fx.seed_unit();
    let ResumeClaim::Claimed { token } = fx.store.claim_resume("deleg_test0001", 0).expect("claim")
    else {
        panic!("expected a claim")
    };
    match fx.store.claim_resume("deleg_test0001", 0).expect("claim") {
        ResumeClaim::Busy { claimed_at, expires_at } => {
            assert!((claimed_at - T0).abs() < 1e-6);
            assert!((expires_at - (T0 + 300.0)).abs() < 1e-6);
        }
        other => panic!("expected busy, got {other:?}"),
    }
    fx.clock.advance(100.0);
    assert!(fx.store.renew_resume("deleg_test0001", 0, &token).expect("renew"));
    fx.clock.advance(250.0);
    assert!(matches!(
        fx.store.claim_resume("deleg_test0001", 0).expect("c"),
        ResumeClaim::Busy { .. }
    ));
    assert!(!fx.store.release_resume("deleg_test0001", 0, "not-the-token").expect("release"));
    assert!(fx.store.release_resume("deleg_test0001", 0, &token).expect("release"));
    let ResumeClaim::Claimed { token: t2 } = fx.store.claim_resume("deleg_test0001", 0).expect("c")
    else {
        panic!("released claim is free")
    };
    fx.clock.advance(300.0);
    assert!(matches!(
        fx.store.claim_resume("deleg_test0001", 0).expect("c"),
        ResumeClaim::Claimed { .. }
    ));
    assert!(!fx.store.renew_resume("deleg_test0001", 0, &t2).expect("renew"), "lease was lost");
    assert_eq!(fx.store.claim_resume("deleg_missing", 0).expect("c"), ResumeClaim::Unavailable);
    fx.store.tombstone_retained_child("sa-0-abc12345", &TombstoneReason::Manual).expect("t");
    assert_eq!(fx.store.claim_resume("deleg_test0001", 0).expect("c"), ResumeClaim::Unavailable);
}

#[test]
fn follow_up_refresh_keeps_the_child_past_its_original_ttl() {
    let fx = Fx::new();
    let kids = [child("sa-0", "cs-0", None, None), child("sa-1", "cs-1", None, None)];
    fx.dispatch_and_retain("deleg_h", "p", &kids);
    fx.clock.advance(70.0 * 3600.0);
    let ResumeClaim::Claimed { token } = fx.store.claim_resume("deleg_h", 0).expect("claim") else {
        panic!("claim")
    };
    assert!(
        fx.store
            .finish_follow_up(
                "deleg_h",
                0,
                &token,
                Some(&UsageSwap {
                    expected: Some(json!({"cost_usd": 0.5})),
                    new: json!({"cost_usd": 1.0})
                })
            )
            .expect("finish")
    );
    fx.clock.advance(30.0 * 3600.0);
    let pruned = fx.store.prune_retained_children(None, None).expect("prune");
    assert_eq!(pruned.children, 1);
    assert_eq!(ids(&fx.store), vec!["sa-0"]);
    assert_eq!(fx.store.unit_usage("deleg_h").expect("usage"), Some(json!({"cost_usd": 1.0})));
}

#[test]
fn a_stale_usage_swap_changes_nothing_and_keeps_the_claim() {
    let fx = Fx::new();
    fx.seed_unit(); // usage_json = {"cost_usd": 0.5}
    fx.clock.advance(60.0);
    let ResumeClaim::Claimed { token } = fx.store.claim_resume("deleg_test0001", 0).expect("claim")
    else {
        panic!("claim")
    };
    let stale =
        UsageSwap { expected: Some(json!({"cost_usd": 0.25})), new: json!({"cost_usd": 9.0}) };
    let err =
        fx.store.finish_follow_up("deleg_test0001", 0, &token, Some(&stale)).expect_err("stale");
    assert!(matches!(err, retinue_core::Error::Stale { .. }), "{err:?}");
    assert_eq!(
        fx.store.unit_usage("deleg_test0001").expect("usage"),
        Some(json!({"cost_usd": 0.5}))
    );
    assert!(matches!(
        fx.store.claim_resume("deleg_test0001", 0).expect("c"),
        ResumeClaim::Busy { .. }
    ));
    let entry = fx.store.find_retained_child("sa-0-abc12345").expect("find").expect("entry");
    assert_eq!(entry.retained_at, Some(T0), "retained_at untouched");
    let fresh =
        UsageSwap { expected: Some(json!({"cost_usd": 0.5})), new: json!({"cost_usd": 0.75}) };
    assert!(fx.store.finish_follow_up("deleg_test0001", 0, &token, Some(&fresh)).expect("finish"));
    assert_eq!(
        fx.store.unit_usage("deleg_test0001").expect("usage"),
        Some(json!({"cost_usd": 0.75}))
    );
}

#[test]
fn recover_abandoned_delegations_rehydrates_retained() {
    let fx = Fx::new();
    fx.seed_unit();
    let store = fx.reopen();
    let report = store.recover_abandoned_delegations(&ProcProbe);
    assert_eq!(report.error, None);
    assert_eq!(report.addressable, 1);
    let entries = store.list_retained_children().expect("list");
    assert_eq!(
        entries.iter().map(|e| e.child_session_id.as_str()).collect::<Vec<_>>(),
        ["child-sess-1"]
    );
    // Retained rows keep their state even though they were `running` with no owner.
    assert_eq!(entries[0].state, retinue_core::UnitState::Running);
}

#[test]
fn dead_owners_become_unknown_and_retained_rows_are_untouched() {
    let fx = Fx::new();
    fx.seed_unit(); // retained, state running, owner NULL
    for (id, pid, fp) in [
        ("deleg_dead", Some(999_999_i64), None),
        ("deleg_nopid", None, None),
        ("deleg_alive", Some(42), Some(7_i64)),
        ("deleg_reused", Some(43), Some(8)),
    ] {
        fx.insert_delegation(id, "p", "running");
        fx.raw()
            .execute("UPDATE async_delegations SET owner_pid=?1, owner_started_at=?2, task_json='{\"goal\":\"g\"}' WHERE delegation_id=?3",
                rusqlite::params![pid, fp, id])
            .expect("owner");
    }
    let probe = Probe(|pid| match pid {
        42 => Some(ProcessState::Alive { started_at: Some(7) }),
        43 => Some(ProcessState::Alive { started_at: Some(9) }), // pid reused: fingerprint mismatch
        _ => Some(ProcessState::Dead),
    });
    let report = fx.store.recover_abandoned_delegations(&probe);
    assert_eq!(report.abandoned, 3);
    assert_eq!(report.addressable, 1);
    let state = |id: &str| -> (String, Option<String>) {
        fx.raw()
            .query_row(
                "SELECT state, event_json FROM async_delegations WHERE delegation_id=?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("row")
    };
    assert_eq!(state("deleg_alive").0, "running");
    assert_eq!(state("deleg_test0001").0, "running");
    let (s, event) = state("deleg_dead");
    assert_eq!(s, "unknown");
    let event: serde_json::Value = serde_json::from_str(&event.expect("event")).expect("json");
    assert_eq!(event["status"], "unknown");
    assert_eq!(event["type"], "async_delegation");
    assert_eq!(event["goal"], "g");
    assert_eq!(
        event["error"],
        "Delegation owner exited before recording a terminal result; outcome unknown."
    );
    assert_eq!(state("deleg_reused").0, "unknown");
    // The synthetic completion is deliverable.
    assert!(
        fx.store.claim_delivery(&retinue_core::DeliveryFilter::default()).expect("c").is_some()
    );
}

#[test]
fn recovery_without_a_probe_classifies_nothing_but_rehydrates() {
    let fx = Fx::new();
    fx.seed_unit();
    fx.insert_delegation("deleg_x", "p", "running");
    fx.raw()
        .execute("UPDATE async_delegations SET owner_pid=5 WHERE delegation_id='deleg_x'", [])
        .expect("u");
    let probe = Probe(|_| None);
    fx.clock.advance(100.0 * 3600.0);
    let report = fx.store.recover_abandoned_delegations(&probe);
    assert_eq!(report.abandoned, 0);
    assert_eq!(report.addressable, 0, "rehydration pruned the expired child");
    let tomb: Option<f64> = fx
        .raw()
        .query_row(
            "SELECT tombstoned_at FROM async_delegations WHERE delegation_id='deleg_test0001'",
            [],
            |r| r.get(0),
        )
        .expect("row");
    assert!(tomb.is_some());
}

#[test]
fn this_process_is_alive_to_the_proc_probe() {
    let (pid, fp) = current_owner();
    match ProcProbe.probe(pid) {
        Some(ProcessState::Alive { started_at }) => assert_eq!(started_at, fp),
        None => {} // not Linux
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn history_pruner_never_deletes_retained_or_running_rows() {
    let fx = Fx::new();
    for i in 0..5 {
        fx.dispatch_and_retain(
            &format!("deleg_keep{i}"),
            "p",
            &[child(&format!("sa-k{i}"), &format!("cs-k{i}"), None, None)],
        );
    }
    fx.store.tombstone_retained_child("sa-k0", &TombstoneReason::Manual).expect("t");
    for i in 0..3 {
        fx.insert_delegation(&format!("deleg_run{i}"), "p", "running");
    }
    for i in 0..60 {
        let id = format!("deleg_term{i:03}");
        fx.insert_delegation(&id, "p", "running");
        complete(&fx, &id, "failed", false);
    }
    fx.clock.advance(-10.0 * 86_400.0);
    for i in 0..100 {
        let id = format!("deleg_old{i:03}");
        fx.insert_delegation(&id, "p", "running");
        complete(&fx, &id, "failed", false);
    }
    fx.clock.advance(10.0 * 86_400.0);
    let deleted = fx.store.prune_history().expect("prune");
    assert_eq!(deleted, 110, "100 old delivered rows, then 10 terminal rows beyond 50");
    let count = |sql: &str| -> i64 { fx.raw().query_row(sql, [], |r| r.get(0)).expect("q") };
    assert_eq!(count("SELECT count(*) FROM async_delegations WHERE retained = 1"), 5);
    assert_eq!(
        count(
            "SELECT count(*) FROM async_delegations WHERE state = 'running' AND retained IS NULL"
        ),
        3
    );
    assert_eq!(
        count("SELECT count(*) FROM async_delegations WHERE retained IS NULL AND state = 'failed'"),
        50
    );
    assert_eq!(ids(&fx.store).len(), 4);
}

#[test]
fn review_fixes_hold() {
    // Retaining again never revives a child past its TTL.
    let fx = Fx::new();
    let kids = [child("sa-0", "cs-0", None, None), child("sa-1", "cs-1", None, None)];
    fx.dispatch_and_retain("deleg_r", "p", &kids);
    fx.raw()
        .execute("UPDATE retinue_children SET retained_at = retained_at - 73 * 3600 WHERE child_index = 1", [])
        .expect("age");
    fx.raw().execute("UPDATE async_delegations SET tombstoned_at = NULL", []).expect("noop");
    assert!(fx.store.retain_completed_delegation("deleg_r", None).expect("retain"));
    assert_eq!(ids(&fx.store), vec!["sa-0"], "the expired sibling was tombstoned, not revived");

    // A holder whose lease passed to someone else writes nothing.
    let fx = Fx::new();
    fx.seed_unit();
    let ResumeClaim::Claimed { token: old } =
        fx.store.claim_resume("deleg_test0001", 0).expect("c")
    else {
        panic!("claim")
    };
    fx.clock.advance(301.0);
    let ResumeClaim::Claimed { token: new } =
        fx.store.claim_resume("deleg_test0001", 0).expect("c")
    else {
        panic!("re-claim after the lease")
    };
    let swap =
        UsageSwap { expected: Some(json!({"cost_usd": 0.5})), new: json!({"cost_usd": 7.0}) };
    assert!(!fx.store.finish_follow_up("deleg_test0001", 0, &old, Some(&swap)).expect("finish"));
    assert_eq!(
        fx.store.unit_usage("deleg_test0001").expect("usage"),
        Some(json!({"cost_usd": 0.5}))
    );
    assert!(fx.store.release_resume("deleg_test0001", 0, &new).expect("release"));

    // A child past its TTL that no prune has written down yet keeps `ttl` and
    // its expiry time: a manual tombstone does not touch it, a prune writes the same.
    let fx = Fx::new();
    fx.seed_unit();
    fx.clock.advance(80.0 * 3600.0);
    let before = fx.store.lookup("sa-0-abc12345").expect("lookup");
    assert!(
        !fx.store.tombstone_retained_child("sa-0-abc12345", &TombstoneReason::Manual).expect("t")
    );
    assert_eq!(fx.store.lookup("sa-0-abc12345").expect("lookup"), before);
    match &before {
        retinue_core::Lookup::NotAddressable(
            _,
            retinue_core::Unaddressable::Tombstoned { reason, .. },
        ) => assert_eq!(*reason, TombstoneReason::Ttl),
        other => panic!("unexpected {other:?}"),
    }
    fx.store.prune_retained_children(None, None).expect("prune");
    assert_eq!(fx.store.lookup("sa-0-abc12345").expect("lookup"), before);
}

#[test]
fn no_probe_classifies_not_even_ownerless_rows() {
    let fx = Fx::new();
    fx.insert_delegation("deleg_nopid", "p", "running");
    let report = fx.store.recover_abandoned_delegations(&Probe(|_| None));
    assert_eq!(report.abandoned, 0);
    let state: String = fx
        .raw()
        .query_row(
            "SELECT state FROM async_delegations WHERE delegation_id='deleg_nopid'",
            [],
            |r| r.get(0),
        )
        .expect("row");
    assert_eq!(state, "running");
}

#[test]
fn delivery_by_unit_and_unreadable_events_are_left_alone() {
    let fx = Fx::new();
    for id in ["deleg_a1", "deleg_b1"] {
        fx.insert_delegation(id, "", "running");
        complete(&fx, id, "completed", true);
    }
    let only_b =
        DeliveryFilter { delegation_id: Some("deleg_b1".into()), ..DeliveryFilter::default() };
    let claim = fx.store.claim_delivery(&only_b).expect("claim").expect("b");
    assert_eq!(claim.delegation_id, "deleg_b1");
    assert!(fx.store.claim_delivery(&only_b).expect("claim").is_none());
    // An unreadable event (another writer's) is never offered and never dropped.
    fx.raw()
        .execute(
            "UPDATE async_delegations SET event_json = '{bad' WHERE delegation_id = 'deleg_a1'",
            [],
        )
        .expect("raw");
    assert!(fx.store.claim_delivery(&DeliveryFilter::default()).expect("claim").is_none());
    let state: String = fx
        .raw()
        .query_row(
            "SELECT delivery_state FROM async_delegations WHERE delegation_id='deleg_a1'",
            [],
            |r| r.get(0),
        )
        .expect("row");
    assert_eq!(state, "pending");
}

/// The history pruner reads only non-retained rows through an index (the
/// partial history index, or the `retained IS NULL` range of the retention
/// index): never a scan of the retained units or of the child rows.
#[test]
fn history_pruner_uses_the_history_index() {
    let fx = Fx::new();
    let plan = |sql: &str| -> String {
        let raw = fx.raw();
        let mut stmt = raw.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).expect("plan");
        let rows = stmt.query_map([], |r| r.get::<_, String>(3)).expect("rows");
        rows.collect::<rusqlite::Result<Vec<_>>>().expect("collect").join("\n")
    };
    let terminal = "retained IS NULL AND state NOT IN ('running', 'finalizing')";
    for sql in [
        format!(
            "SELECT 1 FROM async_delegations WHERE {terminal} AND delivery_state = 'delivered' \
             AND COALESCE(delivered_at, updated_at) < 1"
        ),
        format!(
            "SELECT 1 FROM async_delegations WHERE {terminal} AND delivery_state = 'pending' \
             ORDER BY updated_at"
        ),
        format!(
            "SELECT count(*) FROM async_delegations WHERE {terminal} AND delivery_state != 'pending'"
        ),
    ] {
        let p = plan(&sql);
        let indexed = p.contains("USING INDEX retinue_idx_async_history")
            || p.contains("USING INDEX retinue_idx_async_profile_rank (retained=?)")
            || p.contains("USING COVERING INDEX retinue_idx_async_profile_rank (retained=?)");
        assert!(indexed, "{sql}\n{p}");
    }
    assert_eq!(fx.store.prune_history().expect("prune"), 0);
}
