//! The retained registry: the seed's tests and the spec's further cases.

use retinue_config::DelegationConfig;
use retinue_core::{
    Completion, Lookup, PruneCount, RegistryRead, Retention, TombstoneReason, Unaddressable,
    UnitLifecycle,
};
use serde_json::json;

use super::fixture::{Fx, T0, child, ids, seed_child};

#[test]
fn retain_and_list_children() {
    let fx = Fx::new();
    fx.seed_unit();
    let entries = fx.store.list_retained_children().expect("list");
    assert_eq!(entries.len(), 1);
    let e = &entries[0];
    assert_eq!(e.child_id(), "sa-0-abc12345");
    assert_eq!(e.child_session_id, "child-sess-1");
    assert_eq!(e.manifest.model.as_deref(), Some("test/model"));
    assert_eq!(e.delegation_id, "deleg_test0001");
    insta::assert_json_snapshot!("list_entries", entries, {
        "[].retained_at" => "[ts]", "[].completed_at" => "[ts]"
    });
}

#[test]
fn manual_tombstone_note_is_reported_by_lookup_read_write_and_read_only() {
    let fx = Fx::new();
    fx.seed_unit();
    let reason = TombstoneReason::Other("operator cleanup".to_owned());
    assert!(fx.store.tombstone_retained_child("sa-0-abc12345", &reason).expect("t"));
    let ro = retinue_store::Store::open_read_only(
        fx.db(),
        retinue_store::StoreOptions::default()
            .with_clock(fx.clock.clone())
            .with_retention(fx.store.retention()),
    )
    .expect("open read-only");
    for store in [&fx.store, &ro] {
        match store.lookup("child-sess-1").expect("lookup") {
            Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason, note, .. }) => {
                assert_eq!(reason, TombstoneReason::Manual);
                assert_eq!(note.as_deref(), Some("operator cleanup"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // A later prune keeps the manual reason and its note.
    fx.clock.advance(100.0 * 3600.0);
    fx.store.prune_retained_children(None, None).expect("prune");
    match fx.store.lookup("child-sess-1").expect("lookup") {
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason, note, .. }) => {
            assert_eq!((reason, note), (TombstoneReason::Manual, Some("operator cleanup".into())));
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn find_retained_child_by_any_id() {
    let fx = Fx::new();
    fx.seed_unit();
    for key in ["sa-0-abc12345", "child-sess-1", "deleg_test0001", "  child-sess-1\n"] {
        let found = fx.store.find_retained_child(key).expect("find");
        assert_eq!(found.map(|e| e.child_session_id), Some("child-sess-1".to_owned()), "{key}");
    }
    for miss in ["nope", "", "   ", "SA-0-ABC12345", "' OR 1=1 --", "sa-0-abc1234%"] {
        assert!(fx.store.find_retained_child(miss).expect("find").is_none(), "{miss}");
    }
}

#[test]
fn tombstone_removes_addressability_only() {
    let fx = Fx::new();
    fx.seed_unit();
    assert!(
        fx.store.tombstone_retained_child("sa-0-abc12345", &TombstoneReason::Manual).expect("t")
    );
    assert!(fx.store.find_retained_child("sa-0-abc12345").expect("find").is_none());
    assert!(
        !fx.store.tombstone_retained_child("sa-0-abc12345", &TombstoneReason::Manual).expect("t")
    );
    let (tomb, cj): (Option<f64>, Option<String>) = fx
        .raw()
        .query_row(
            "SELECT tombstoned_at, children_json FROM async_delegations \
             WHERE delegation_id='deleg_test0001'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("row");
    assert!(tomb.is_some());
    assert!(cj.unwrap_or_default().contains("child-sess-1"));
    match fx.store.lookup("child-sess-1").expect("lookup") {
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { at, reason, .. }) => {
            assert_eq!(reason, TombstoneReason::Manual);
            assert!((at - T0).abs() < 1e-6);
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn ttl_prune_tombstones_expired_rows() {
    let fx = Fx::new();
    fx.seed_unit();
    fx.clock.advance(100.0 * 3600.0);
    // Hidden before any prune writes it down.
    assert!(fx.store.list_retained_children().expect("list").is_empty());
    let pruned = fx.store.prune_retained_children(None, Some(72.0)).expect("prune");
    assert_eq!(pruned, PruneCount { units: 1, children: 1 });
    assert!(fx.store.list_retained_children().expect("list").is_empty());
    match fx.store.lookup("sa-0-abc12345").expect("lookup") {
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason, .. }) => {
            assert_eq!(reason, TombstoneReason::Ttl);
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn cap_prune_keeps_newest() {
    let fx = Fx::new();
    for i in 0..4 {
        fx.dispatch_and_retain(
            &format!("deleg_cap{i:05}"),
            "parent-1",
            &[child(&format!("sa-{i}"), &format!("cs-{i}"), None, None)],
        );
        fx.clock.advance(1.0);
    }
    let count = fx.store.prune_retained_children(Some(2), Some(9999.0)).expect("prune");
    assert_eq!(count, PruneCount { units: 2, children: 2 });
    let remaining: std::collections::BTreeSet<String> = fx
        .store
        .list_retained_children()
        .expect("list")
        .into_iter()
        .map(|e| e.delegation_id)
        .collect();
    assert_eq!(remaining, ["deleg_cap00002", "deleg_cap00003"].map(str::to_owned).into());
}

#[test]
fn over_cap_children_are_hidden_before_prune() {
    let fx = Fx::with_config(DelegationConfig { max_retained: 1, ..DelegationConfig::default() });
    fx.insert_delegation("deleg_a", "p", "running");
    fx.insert_delegation("deleg_b", "p", "running");
    fx.store
        .record_dispatched_children("deleg_a", &[child("sa-a", "cs-a", None, None)])
        .expect("r");
    fx.store
        .record_dispatched_children("deleg_b", &[child("sa-b", "cs-b", None, None)])
        .expect("r");
    // Raw retain (as hermes would, without pruning): both retained.
    fx.raw()
        .execute_batch(&format!(
            "UPDATE async_delegations SET retained=1, retained_at={T0} WHERE delegation_id='deleg_a';
             UPDATE async_delegations SET retained=1, retained_at={} WHERE delegation_id='deleg_b';",
            T0 + 1.0
        ))
        .expect("raw retain");
    assert_eq!(ids(&fx.store), vec!["sa-b"]);
    match fx.store.lookup("sa-a").expect("lookup") {
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason, .. }) => {
            assert_eq!(reason, TombstoneReason::Cap);
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn completion_persist_retains_only_success() {
    let fx = Fx::new();
    fx.insert_delegation("deleg_ok000001", "parent-1", "running");
    fx.insert_delegation("deleg_err00001", "parent-1", "running");
    fx.store
        .record_dispatched_children("deleg_ok000001", &[child("sa-ok", "cs-ok", None, None)])
        .expect("r");
    fx.store
        .record_dispatched_children("deleg_err00001", &[child("sa-err", "cs-err", None, None)])
        .expect("r");
    for (id, status) in [("deleg_ok000001", "completed"), ("deleg_err00001", "error")] {
        let done = fx
            .store
            .persist_completion(&Completion {
                delegation_id: id.to_owned(),
                status: status.into(),
                event: retinue_core::CompletionEvent::from_stored(
                    id,
                    json!({"delegation_id": id, "status": status}),
                ),
                result: json!({"status": status, "summary": null}),
                usage: Some(json!({"cost_usd": 0.1})),
                background: false,
            })
            .expect("persist");
        assert!(done);
    }
    let listed: Vec<String> = fx
        .store
        .list_retained_children()
        .expect("list")
        .into_iter()
        .map(|e| e.delegation_id)
        .collect();
    assert_eq!(listed, vec!["deleg_ok000001"]);
    assert_eq!(
        fx.store.unit_usage("deleg_err00001").expect("usage"),
        Some(json!({"cost_usd": 0.1}))
    );
    assert_eq!(fx.store.lookup("sa-err").expect("lookup").clone(), {
        let Lookup::NotAddressable(e, _) = fx.store.lookup("sa-err").expect("l") else {
            panic!("expected known")
        };
        Lookup::NotAddressable(e, Unaddressable::NeverRetained)
    });
}

#[test]
fn per_child_tombstone_in_a_batch() {
    let fx = Fx::new();
    let kids = [
        child("sa-0", "cs-0", None, None),
        child("sa-1", "cs-1", None, None),
        child("sa-2", "cs-2", None, None),
    ];
    fx.dispatch_and_retain("deleg_batch001", "parent-1", &kids);
    assert!(fx.store.tombstone_retained_child("cs-1", &TombstoneReason::Manual).expect("t"));
    assert_eq!(ids(&fx.store), vec!["sa-0", "sa-2"]);
    let unit_tomb = |fx: &Fx| -> Option<f64> {
        fx.raw()
            .query_row(
                "SELECT tombstoned_at FROM async_delegations WHERE delegation_id='deleg_batch001'",
                [],
                |r| r.get(0),
            )
            .expect("row")
    };
    assert!(unit_tomb(&fx).is_none());
    assert!(fx.store.tombstone_retained_child("sa-0", &TombstoneReason::Manual).expect("t"));
    assert!(unit_tomb(&fx).is_none());
    assert!(fx.store.tombstone_retained_child("sa-2", &TombstoneReason::Manual).expect("t"));
    assert!(unit_tomb(&fx).is_some(), "last child tombstones the unit");

    let fx = Fx::new();
    fx.dispatch_and_retain("deleg_batch002", "parent-1", &kids);
    assert!(
        fx.store.tombstone_retained_child("deleg_batch002", &TombstoneReason::Manual).expect("t")
    );
    assert!(ids(&fx.store).is_empty());
    assert!(
        !fx.store.tombstone_retained_child("deleg_batch002", &TombstoneReason::Manual).expect("t")
    );
}

#[test]
fn corrupt_children_json_yields_no_children_and_no_panic() {
    for (n, (cj, csid, expected)) in [
        ("not json", None, 0usize),
        ("{bad", None, 0),
        ("{}", None, 0),
        ("[1,null,\"x\"]", None, 0),
        ("[]", Some("cs-synth"), 1),
        ("[1, {\"subagent_id\": \"sa-ok\"}]", None, 1),
    ]
    .into_iter()
    .enumerate()
    {
        let fx = Fx::new();
        let id = format!("deleg_corrupt{n}");
        fx.insert_delegation(&id, "p", "completed");
        fx.raw()
            .execute(
                "UPDATE async_delegations SET children_json=?1, child_session_id=?2, retained=1, \
                 retained_at=?3, usage_json='{oops' WHERE delegation_id=?4",
                rusqlite::params![cj, csid, T0, id],
            )
            .expect("raw");
        let listed = fx.store.list_retained_children().expect("list before backfill");
        assert!(listed.is_empty(), "no child rows until a write backfills");
        fx.store.prune_retained_children(None, None).expect("prune backfills");
        assert_eq!(fx.store.list_retained_children().expect("list").len(), expected, "{cj}");
        assert_eq!(fx.store.unit_usage(&id).expect("usage"), None);
        if let Some(sid) = csid {
            assert!(fx.store.find_retained_child(sid).expect("find").is_some());
        }
    }
}

#[test]
fn tombstoned_unit_is_never_re_retained() {
    let fx = Fx::new();
    fx.seed_unit();
    fx.store.tombstone_retained_child("deleg_test0001", &TombstoneReason::Manual).expect("t");
    assert!(!fx.store.retain_completed_delegation("deleg_test0001", None).expect("retain"));
    assert!(fx.store.list_retained_children().expect("list").is_empty());
    assert!(!fx.store.retain_completed_delegation("deleg_missing", None).expect("retain"));
    assert!(!fx.store.record_dispatched_children("", &[seed_child()]).expect("record"));
    assert!(
        !fx.store.record_dispatched_children("deleg_missing", &[seed_child()]).expect("record")
    );
}

#[test]
fn newest_unit_wins_for_a_shared_session_id() {
    let fx = Fx::new();
    fx.dispatch_and_retain("deleg_old", "p", &[child("sa-old", "shared", None, None)]);
    fx.clock.advance(5.0);
    fx.dispatch_and_retain("deleg_new", "p", &[child("sa-new", "shared", None, None)]);
    let found = fx.store.find_retained_child("shared").expect("find").expect("some");
    assert_eq!(found.delegation_id, "deleg_new");
    // subagent match beats a session match.
    fx.dispatch_and_retain("deleg_x", "p", &[child("shared-sa", "cs-x", None, None)]);
    fx.dispatch_and_retain("deleg_y", "p", &[child("sa-y", "shared-sa", None, None)]);
    let found = fx.store.find_retained_child("shared-sa").expect("find").expect("some");
    assert_eq!(found.delegation_id, "deleg_x");
}

#[test]
fn lookup_query_plans_use_indexes() {
    let fx = Fx::new();
    fx.seed_unit();
    let raw = fx.raw();
    for (sql, index) in [
        (
            "SELECT * FROM retinue_children c WHERE c.subagent_id = 'x'",
            "retinue_idx_children_subagent",
        ),
        (
            "SELECT * FROM retinue_children c WHERE c.child_session_id = 'x'",
            "retinue_idx_children_session",
        ),
        (
            "SELECT delegation_id FROM async_delegations WHERE retained = 1 AND tombstoned_at IS NULL",
            "retinue_idx_async_profile_rank",
        ),
        // The per-profile cap: a profile's live units in rank order, and
        // the next profile key (the skip scan over profiles).
        (
            "SELECT u.retained_at, u.delegation_id FROM async_delegations u \
             WHERE u.retained = 1 AND u.tombstoned_at IS NULL \
             AND COALESCE(u.owner_profile, '') = 'p' \
             ORDER BY u.retained_at DESC, u.delegation_id DESC LIMIT 1 OFFSET 9",
            "COVERING INDEX retinue_idx_async_profile_rank (retained=? AND tombstoned_at=? AND <expr>=?)",
        ),
        (
            "SELECT COALESCE(owner_profile, '') AS k FROM async_delegations \
             WHERE retained = 1 AND tombstoned_at IS NULL AND COALESCE(owner_profile, '') > 'p' \
             ORDER BY k LIMIT 1",
            "COVERING INDEX retinue_idx_async_profile_rank (retained=? AND tombstoned_at=? AND <expr>>?)",
        ),
    ] {
        let plan: Vec<String> = raw
            .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .expect("p")
            .query_map([], |r| r.get::<_, String>(3))
            .expect("q")
            .map(|r| r.expect("row"))
            .collect();
        assert!(plan.iter().any(|p| p.contains(index)), "{sql}: {plan:?}");
        assert!(!plan.iter().any(|p| p.contains("TEMP B-TREE")), "sorts: {sql}: {plan:?}");
    }
}

mod invariant {
    use proptest::prelude::*;
    use retinue_config::DelegationConfig;
    use retinue_core::{RegistryRead, Retention};

    use super::super::fixture::{Fx, child};

    /// The profiles units are written with: NULL and '' are one key.
    const PROFILES: [Option<&str>; 4] = [None, Some(""), Some("a"), Some("b")];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Spec §3.1: the addressable set before `prune(t)` equals the live set after it.
        #[test]
        fn addressable_before_prune_equals_after(
            units in proptest::collection::vec((0u32..200, 1usize..4, proptest::option::of(0usize..3), 0usize..4), 1..12),
            max in 1u32..5,
            advance_h in 0u32..150,
        ) {
            let fx = Fx::with_config(DelegationConfig { max_retained: 100, retained_ttl_hours: 72.0, ..DelegationConfig::default() });
            for (i, (age_h, n, tomb, profile)) in units.iter().enumerate() {
                let id = format!("deleg_p{i:03}");
                let kids: Vec<_> = (0..*n).map(|k| child(&format!("sa-{i}-{k}"), &format!("cs-{i}-{k}"), None, None)).collect();
                fx.dispatch_and_retain(&id, "p", &kids);
                // The cap applies per profile; NULL and '' are the same (empty) profile.
                fx.raw().execute("UPDATE async_delegations SET owner_profile = ?1 WHERE delegation_id = ?2",
                    rusqlite::params![PROFILES[*profile], id]).expect("profile");
                fx.raw().execute("UPDATE retinue_children SET retained_at = retained_at - ?1 WHERE delegation_id = ?2",
                    rusqlite::params![f64::from(*age_h) * 3600.0, id]).expect("age");
                fx.raw().execute("UPDATE async_delegations SET retained_at = retained_at - ?1 WHERE delegation_id = ?2",
                    rusqlite::params![f64::from(*age_h) * 3600.0, id]).expect("age");
                if let Some(k) = tomb.filter(|k| k < n) {
                    fx.store.tombstone_retained_child(&format!("sa-{i}-{k}"), &retinue_core::TombstoneReason::Manual).expect("t");
                }
            }
            fx.clock.advance(f64::from(advance_h) * 3600.0);
            let store = super::super::fixture::delegation_of(&fx.store);
            let store = super::super::fixture::open(&fx.db(), &fx.clock, DelegationConfig { max_retained: max, ..store });
            let before = store.list_retained_children().expect("list");
            store.prune_retained_children(None, None).expect("prune");
            let after = store.list_retained_children().expect("list");
            prop_assert_eq!(&before, &after);
            // The live set written down by the prune, read raw (no TTL or cap
            // applied by the reader), is exactly what was addressable before it.
            use retinue_core::Clock;
            let cutoff = fx.clock.now() - 72.0 * 3600.0;
            let mut live: Vec<String> = fx
                .raw()
                .prepare(
                    "SELECT c.subagent_id FROM retinue_children c JOIN async_delegations u \
                     ON u.delegation_id = c.delegation_id WHERE u.retained = 1 \
                     AND u.tombstoned_at IS NULL AND c.tombstoned_at IS NULL AND c.retained_at >= ?1",
                )
                .expect("prepare")
                .query_map([cutoff], |r| r.get(0))
                .expect("query")
                .map(|r| r.expect("row"))
                .collect();
            live.sort();
            let mut was: Vec<String> = before.iter().map(|e| e.subagent_id.clone()).collect();
            was.sort();
            prop_assert_eq!(&was, &live);
            // A model of the spec: per profile key, the newest `max` units
            // with a child inside its TTL, each listing those children.
            let mut expected: Vec<String> = Vec::new();
            for key in ["", "a", "b"] {
                let mut ranked: Vec<(u32, String, usize)> = units
                    .iter()
                    .enumerate()
                    .filter(|(_, u)| PROFILES[u.3].unwrap_or("") == key)
                    .filter(|(_, u)| u.0 + advance_h <= 72 && (u.1 > 1 || u.2.is_none_or(|k| k >= u.1)))
                    .map(|(i, u)| (u.0, format!("deleg_p{i:03}"), i))
                    .collect();
                ranked.sort_by(|x, y| x.0.cmp(&y.0).then_with(|| y.1.cmp(&x.1)));
                for (_, _, i) in ranked.iter().take(max as usize) {
                    let (_, n, tomb, _) = units[*i];
                    expected.extend((0..n).filter(|k| tomb != Some(*k)).map(|k| format!("sa-{i}-{k}")));
                }
            }
            expected.sort();
            prop_assert_eq!(was, expected);
            // Newest unit first across profiles, children in index order.
            let order: Vec<(Option<f64>, String, u32)> = before.iter()
                .map(|e| (e.retained_at, e.delegation_id.clone(), e.child_index)).collect();
            let mut sorted = order.clone();
            sorted.sort_by(|x, y| y.0.unwrap_or(f64::NEG_INFINITY).total_cmp(&x.0.unwrap_or(f64::NEG_INFINITY))
                .then_with(|| y.1.cmp(&x.1)).then_with(|| x.2.cmp(&y.2)));
            prop_assert_eq!(order, sorted);
        }
    }
}

#[test]
fn reads_and_a_no_op_prune_never_write() {
    let fx = Fx::new();
    fx.seed_unit();
    let raw = fx.raw();
    let version = |c: &rusqlite::Connection| -> i64 {
        c.query_row("PRAGMA data_version", [], |r| r.get(0)).expect("data_version")
    };
    let before = version(&raw);
    for _ in 0..3 {
        fx.store.list_retained_children().expect("list");
        fx.store.find_retained_child("sa-0-abc12345").expect("find");
        fx.store.lookup("nope").expect("lookup");
        assert_eq!(
            fx.store.prune_retained_children(None, None).expect("prune"),
            PruneCount::default()
        );
    }
    assert_eq!(version(&raw), before, "another connection committed nothing");
    fx.clock.advance(73.0 * 3600.0);
    assert_eq!(fx.store.prune_retained_children(None, None).expect("prune").units, 1);
    assert_ne!(version(&raw), before, "a due prune writes");
}

/// Regression (reliability harness): a JSON column holding a BLOB or TEXT
/// that is not UTF-8 used to fail the whole open, every registry write (the
/// backfill read it) and every list; it now reads as malformed (semantics §2.7).
#[test]
fn unreadable_json_bytes_read_as_malformed() {
    for (n, expr) in ["CAST(x'5bff' AS TEXT)", "x'5b5d'", "x'ff00'"].into_iter().enumerate() {
        let fx = Fx::new();
        fx.dispatch_and_retain("deleg_readable", "p", &[seed_child()]);
        let id = format!("deleg_bytes{n}");
        fx.insert_delegation(&id, "p", "completed");
        fx.raw()
            .execute_batch(&format!(
                "UPDATE async_delegations SET children_json = {expr}, \
                 child_session_id = CAST(x'ff' AS TEXT), \
                 usage_json = {expr}, task_json = {expr}, event_json = {expr}, retained = 1, \
                 retained_at = {T0} WHERE delegation_id = '{id}'; \
                 UPDATE retinue_children SET manifest_json = {expr} \
                 WHERE delegation_id = 'deleg_readable';"
            ))
            .expect("raw");
        let reopened = fx.reopen();
        reopened.prune_retained_children(None, None).expect("writes still backfill");
        let listed = reopened.list_retained_children().expect("list");
        assert_eq!(listed.len(), 1, "{expr}: only the readable unit has a child");
        assert_eq!(listed[0].child_session_id, "child-sess-1", "ids come from the columns");
        assert_eq!(listed[0].manifest.model, None, "{expr}: the manifest reads as absent");
        let usage = reopened.unit_usage(&id).expect("usage");
        assert!(usage.is_none() || usage == Some(json!([])), "{expr}: {usage:?}");
        let report = reopened.recover_abandoned_delegations(&retinue_core::ProcProbe);
        assert_eq!(report.error, None, "{expr}");
    }
}

#[test]
fn a_failing_unit_write_leaves_nothing_behind() {
    use retinue_core::{NewSession, SessionStore, UnitDraft};
    let fx = Fx::new();
    fx.store
        .create_session(&NewSession {
            id: "taken".into(),
            source: "cli".into(),
            ..NewSession::default()
        })
        .expect("session");
    let draft = UnitDraft {
        parent_session_id: Some("taken".into()),
        children: vec![
            child("sa-0-new", "fresh", None, None),
            child("sa-1-new", "taken", None, None),
        ],
        child_sessions: ["fresh", "taken"]
            .map(|id| NewSession {
                id: id.into(),
                source: "delegate".into(),
                ..NewSession::default()
            })
            .to_vec(),
        ..UnitDraft::default()
    };
    let err = fx.store.insert_unit(&draft).expect_err("the second child session exists");
    assert!(matches!(err, retinue_core::Error::Conflict { .. }), "{err:?}");
    let count = |sql: &str| -> i64 { fx.raw().query_row(sql, [], |r| r.get(0)).expect("count") };
    assert_eq!(count("SELECT count(*) FROM async_delegations"), 0);
    assert_eq!(count("SELECT count(*) FROM retinue_children"), 0);
    assert_eq!(count("SELECT count(*) FROM sessions"), 1);
    // A parent that has no row is stored unlinked, in the same statement.
    let ok = UnitDraft {
        parent_session_id: Some("ghost".into()),
        children: vec![child("sa-0-g", "g-child", None, None)],
        child_sessions: vec![NewSession {
            id: "g-child".into(),
            source: "delegate".into(),
            parent_session_id: Some("ghost".into()),
            ..NewSession::default()
        }],
        ..UnitDraft::default()
    };
    let id = fx.store.insert_unit(&ok).expect("insert");
    assert!(id.starts_with("deleg_") && id.len() == 14, "{id}");
    let parent: Option<String> = fx
        .raw()
        .query_row("SELECT parent_session_id FROM sessions WHERE id = 'g-child'", [], |r| r.get(0))
        .expect("row");
    assert_eq!(parent, None);
}

/// A prune's unit tombstone covers its children (one row per unit, none per
/// child), and every child reports exactly what it reported at the prune's
/// instant, before it: `ttl` at its own expiry, `cap` at the prune, a manual
/// tombstone as written, a hermes unit tombstone as `external` — read-write
/// and read-only, and still so later.
#[test]
fn unit_tombstones_cover_children_with_unchanged_answers() {
    let fx = Fx::new();
    let h = 3600.0;
    let unit = |id: &str, kids: &[&str]| {
        let children: Vec<_> =
            kids.iter().map(|k| child(k, &format!("cs-{k}"), None, None)).collect();
        fx.dispatch_and_retain(id, "p", &children);
        fx.clock.advance(h);
    };
    unit("deleg_old", &["sa-o0", "sa-o1"]); // T0: every child expires (TTL, whole unit)
    unit("deleg_part", &["sa-p0", "sa-p1"]); // T0+1h: one child expires, one was refreshed
    unit("deleg_man", &["sa-m0", "sa-m1"]); // T0+2h: one manual tombstone, then capped
    unit("deleg_cap", &["sa-c0"]); // T0+3h: kept (the cap is 2)
    unit("deleg_keep", &["sa-k0", "sa-k1"]); // T0+4h: kept
    unit("deleg_ext", &["sa-e0"]); // T0+5h: tombstoned by hermes
    assert!(fx.store.tombstone_retained_child("sa-m0", &TombstoneReason::Manual).expect("t"));
    let raw = fx.raw();
    raw.execute(
        "UPDATE retinue_children SET retained_at = ?1 WHERE subagent_id = 'sa-p1'",
        [T0 + 5.0 * h],
    )
    .expect("refresh");
    raw.execute(
        "UPDATE async_delegations SET tombstoned_at = ?1 WHERE delegation_id = 'deleg_ext'",
        [T0 + 5.5 * h],
    )
    .expect("hermes tombstone");
    fx.clock.advance(67.5 * h); // now T0+73.5h: the cutoff is T0+1.5h
    let all =
        ["sa-o0", "sa-o1", "sa-p0", "sa-p1", "sa-m0", "sa-m1", "sa-c0", "sa-k0", "sa-k1", "sa-e0"];
    let answers = |store: &retinue_store::Store| -> Vec<String> {
        all.iter().map(|id| format!("{id}: {:?}", store.lookup(id).expect("lookup"))).collect()
    };
    let config = DelegationConfig { max_retained: 2, ..DelegationConfig::default() };
    let store = super::fixture::open(&fx.db(), &fx.clock, config.clone());
    let before = answers(&store);
    let own_rows = |raw: &rusqlite::Connection| -> i64 {
        raw.query_row(
            "SELECT count(*) FROM retinue_children WHERE tombstoned_at IS NOT NULL",
            [],
            |r| r.get(0),
        )
        .expect("count")
    };
    let rows_before = own_rows(&raw);
    let count = store.prune_retained_children(None, None).expect("prune");
    // deleg_old (TTL), deleg_part and deleg_man (cap); 2 + 2 + 1 children.
    assert_eq!(count, PruneCount { units: 3, children: 5 });
    // Only sa-p0 (expired in a unit that stayed live until the cap) got a row.
    assert_eq!(own_rows(&raw) - rows_before, 1);
    assert_eq!(answers(&store), before);
    let status = |id: &str| match store.lookup(id).expect("lookup") {
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { at, reason, .. }) => (reason, at),
        other => panic!("{id}: {other:?}"),
    };
    let t = fx.clock_now();
    assert_eq!(status("sa-o0"), (TombstoneReason::Ttl, T0 + 72.0 * h));
    assert_eq!(status("sa-p0"), (TombstoneReason::Ttl, T0 + 73.0 * h));
    assert_eq!(status("sa-p1"), (TombstoneReason::Cap, t));
    assert_eq!(status("sa-m0").0, TombstoneReason::Manual);
    assert_eq!(status("sa-m1"), (TombstoneReason::Cap, t));
    assert_eq!(status("sa-e0"), (TombstoneReason::External, T0 + 5.5 * h));
    assert_eq!(ids(&store), vec!["sa-k0", "sa-k1", "sa-c0"]);
    // hermes sees its unit tombstones, written at the prune.
    let unit_tomb = |id: &str| -> Option<f64> {
        raw.query_row(
            "SELECT tombstoned_at FROM async_delegations WHERE delegation_id = ?1",
            [id],
            |r| r.get(0),
        )
        .expect("unit")
    };
    for id in ["deleg_old", "deleg_part", "deleg_man"] {
        assert_eq!(unit_tomb(id), Some(t), "{id}");
    }
    // Later, and read-only, nothing moves (the live units are left out: their TTL runs on).
    let tombstoned = |v: Vec<String>| -> Vec<String> {
        v.into_iter().filter(|a| !a.starts_with("sa-c0") && !a.starts_with("sa-k")).collect()
    };
    fx.clock.advance(10.0 * h);
    assert_eq!(tombstoned(answers(&store)), tombstoned(before.clone()));
    let ro = retinue_store::Store::open_read_only(
        fx.db(),
        retinue_store::StoreOptions::default()
            .with_clock(fx.clock.clone())
            .with_retention(config.retention()),
    )
    .expect("read-only");
    assert_eq!(tombstoned(answers(&ro)), tombstoned(before));
    // Another writer clears the unit's tombstone and sets its own: `external`.
    raw.execute(
        "UPDATE async_delegations SET tombstoned_at = ?1 WHERE delegation_id = 'deleg_man'",
        [t + 7.0],
    )
    .expect("hermes re-tombstone");
    assert_eq!(status("sa-m1"), (TombstoneReason::External, t + 7.0));
    assert_eq!(status("sa-m0").0, TombstoneReason::Manual);
}

/// A unit whose `owner_profile` is unreadable (a BLOB, invalid UTF-8) is
/// never read as the empty profile (which every profile may address): its
/// children are skipped by lists and lookups, and it ranks only among its
/// own key, so it never evicts another profile's children.
#[test]
fn unreadable_profiles_fail_closed_and_rank_apart() {
    let fx = Fx::with_config(DelegationConfig { max_retained: 2, ..DelegationConfig::default() });
    for (i, profile) in ["x'00ff'", "CAST(x'ff' AS TEXT)", "'p'", "'p'"].into_iter().enumerate() {
        let id = format!("deleg_h{i}");
        fx.dispatch_and_retain(
            &id,
            "parent",
            &[child(&format!("sa-h{i}"), &format!("cs-h{i}"), None, None)],
        );
        fx.raw()
            .execute(&format!("UPDATE async_delegations SET owner_profile = {profile} WHERE delegation_id = ?1"), [&id])
            .expect("profile");
        fx.clock.advance(1.0);
    }
    let listed: Vec<String> = fx
        .store
        .list_retained_children()
        .expect("list")
        .into_iter()
        .map(|e| e.subagent_id)
        .collect();
    assert_eq!(listed, vec!["sa-h3", "sa-h2"]);
    for hostile in ["sa-h0", "sa-h1", "deleg_h0", "cs-h1"] {
        assert!(fx.store.find_retained_child(hostile).expect("find").is_none(), "{hostile}");
    }
    // Three keys, each within a cap of 2: nothing to prune.
    let n = fx.store.prune_retained_children(None, None).expect("prune");
    assert_eq!(n.units, 0);
    let n = fx.store.prune_retained_children(Some(1), None).expect("prune");
    assert_eq!(n.units, 1, "only profile p is over a cap of 1");
    assert_eq!(ids(&fx.store), vec!["sa-h3"]);
}

/// Issue #22: a unit clock another program writes (hermes refreshing or
/// backdating a unit) moves its live children's clocks as hermes sees them;
/// Retinue's own follow-up refresh stays per child.
#[test]
fn a_unit_clock_written_by_another_program_moves_its_children() {
    use retinue_core::{Claims, Lookup, ResumeClaim};
    let fx = Fx::with_config(DelegationConfig {
        retained_ttl_hours: 72.0,
        ..DelegationConfig::default()
    });
    fx.dispatch_and_retain(
        "deleg_clock",
        "parent",
        &[child("sa-c0", "cs-c0", None, None), child("sa-c1", "cs-c1", None, None)],
    );
    let live = |id: &str| matches!(fx.store.lookup(id).expect("lookup"), Lookup::Addressable(_));
    assert!(live("sa-c0") && live("sa-c1"));
    // hermes backdates the unit by 100 hours: past its 72 h TTL, both children expire.
    use retinue_core::Clock;
    let now = fx.clock.now();
    fx.raw()
        .execute(
            "UPDATE async_delegations SET retained_at = ?1 WHERE delegation_id = 'deleg_clock'",
            [now - 100.0 * 3600.0],
        )
        .expect("hermes backdates");
    assert!(!live("sa-c0") && !live("sa-c1"), "the children ignored hermes's unit clock");
    // hermes refreshes it again: both live again, as hermes sees them.
    fx.raw()
        .execute(
            "UPDATE async_delegations SET retained_at = ?1 WHERE delegation_id = 'deleg_clock'",
            [now],
        )
        .expect("hermes refreshes");
    assert!(live("sa-c0") && live("sa-c1"));
    // Retinue's own follow-up of child 1, 71 hours on: only its clock moves.
    fx.clock.advance(71.0 * 3600.0);
    let ResumeClaim::Claimed { token } = fx.store.claim_resume("deleg_clock", 1).expect("claim")
    else {
        panic!("claim");
    };
    assert!(fx.store.finish_follow_up("deleg_clock", 1, &token, None).expect("finish"));
    fx.clock.advance(2.0 * 3600.0);
    assert!(!live("sa-c0"), "child 0 kept its own (older) clock");
    assert!(live("sa-c1"), "child 1's follow-up refreshed its clock");
}
