//! Authority never leaks at the tool level: a foreign requester learns
//! nothing (its errors are byte-identical to those for an id that does not
//! exist, including after tombstoning and pruning), and a running child is
//! never steered by a foreign session.

use std::sync::Arc;

use retinue_config::DelegationConfig;
use retinue_core::{ChildManifest, RegistryRead, Retention, TombstoneReason};
use retinue_delegate::{ChildHandle, Delegator, DelegatorParts, LiveChild, ParentContext};
use retinue_lineage::Authority;
use retinue_store::Store;
use retinue_testkit::SessionGraphBuilder;
use retinue_testkit::scripted::{RecordingSink, ScriptedRuntime};
use serde_json::{Value, json};

use super::common::Fx;

/// A §5.4-style graph: A → B → C (compression), branches, delegate
/// children, strangers, a cycle, an ambiguous fork, a foreign profile.
fn graph(fx: &Fx) {
    SessionGraphBuilder::new(&fx.store)
        .root("A")
        .continuation("B", "A")
        .continuation("C", "B")
        .branch("BR", "A")
        .branch("BR2", "B")
        .delegate_child("DC", "A")
        .raw_session("DM", "delegate", Some("A"), None)
        .raw_session("NM", "cli", Some("A"), Some("{\"_branched_from\":null}"))
        .raw_session("BAD", "cli", Some("A"), Some("{bad"))
        .stranger("S")
        .cycle("X", "Y")
        .root("F")
        .compress("F")
        .plain_child("F1", "F")
        .plain_child("F2", "F")
        .raw_session("MP", "cli", Some("ghost"), None)
        .tool_session("T", Some("A"));
}

struct World {
    fx: Fx,
    tool: Delegator,
    runtime: Arc<ScriptedRuntime>,
}

fn world(with_unit: bool) -> World {
    let fx = Fx::new();
    graph(&fx);
    if with_unit {
        // A two-child unit spawned by B: K0 and K1.
        retinue_testkit::retain_unit(
            &*fx.store,
            "B",
            "",
            vec![
                ChildManifest {
                    subagent_id: "sa-0-0000aaaa".into(),
                    session_id: "K0".into(),
                    ..ChildManifest::default()
                },
                ChildManifest {
                    subagent_id: "sa-1-0000bbbb".into(),
                    session_id: "K1".into(),
                    ..ChildManifest::default()
                },
            ],
        );
    }
    let runtime = Arc::new(ScriptedRuntime::new());
    let tool = tool_over(&fx.store, &runtime);
    World { fx, tool, runtime }
}

fn tool_over(store: &Arc<Store>, runtime: &Arc<ScriptedRuntime>) -> Delegator {
    Delegator::new(DelegatorParts {
        backend: retinue_core::Backend::of(store.clone()),
        authority: Arc::new(Authority::new(store.clone(), store.clone(), "")),
        runtime: runtime.clone(),
        completions: Some(Arc::new(RecordingSink::default())),
        config: DelegationConfig::default().into(),
        profile: String::new(),
    })
}

/// Requesters outside the lineage of B (the spawner): every one is foreign.
const FOREIGN: &[Option<&str>] = &[
    Some("BR"),
    Some("BR2"),
    Some("DC"),
    Some("DM"),
    Some("NM"),
    Some("BAD"),
    Some("S"),
    Some("X"),
    Some("F1"),
    Some("MP"),
    Some("T"),
    Some("nope"),
    Some(""),
    Some("   "),
    Some("' OR '1'='1"),
    None,
];

fn call(tool: &Delegator, requester: Option<&str>, target: &str) -> String {
    let parent =
        ParentContext { session_id: requester.map(str::to_owned), ..ParentContext::default() };
    let out = tool.delegate_task(&json!({"goal": "hi", "follow_up": target}), Some(&parent));
    serde_json::to_string(&out).expect("json")
}

/// Every foreign answer about every id of the unit equals the answer about
/// the same id in a world where the unit never existed.
fn assert_foreign_learns_nothing(w: &World, missing: &World, id: &str, stage: &str) {
    let targets = ["sa-0-0000aaaa", "sa-1-0000bbbb", "K0", "K1", id, " sa-0-0000aaaa "];
    for target in targets {
        for requester in FOREIGN {
            let got = call(&w.tool, *requester, target);
            let want = call(&missing.tool, *requester, target);
            assert_eq!(got, want, "{stage}: {requester:?} → {target:?}");
        }
    }
    assert!(w.runtime.runs().is_empty(), "{stage}: a foreign follow-up ran a child");
}

#[test]
fn foreign_requesters_learn_nothing_before_and_after_tombstone_and_prune() {
    let w = world(true);
    let missing = world(false);
    let id = w.fx.store.list_retained_children().expect("list")[0].delegation_id.clone();
    let before = w.fx.dump();
    assert_foreign_learns_nothing(&w, &missing, &id, "addressable");
    assert_eq!(before, w.fx.dump(), "foreign follow-ups wrote to the database");
    // The owner lineage sees the tombstone; foreigners still see "missing".
    assert!(
        w.fx.store.tombstone_retained_child("sa-0-0000aaaa", &TombstoneReason::Manual).expect("t")
    );
    assert!(call(&w.tool, Some("C"), "sa-0-0000aaaa").contains("was tombstoned at"));
    assert_foreign_learns_nothing(&w, &missing, &id, "tombstoned");
    // Past the TTL and pruned: the same.
    w.fx.clock.advance(100.0 * 3600.0);
    missing.fx.clock.advance(100.0 * 3600.0);
    let pruned = w.fx.store.prune_retained_children(None, None).expect("prune");
    assert_eq!(pruned.children, 1);
    assert!(call(&w.tool, Some("A"), "sa-1-0000bbbb").contains("(reason: ttl)"));
    assert_foreign_learns_nothing(&w, &missing, &id, "pruned");
    // The child itself is told "itself" (semantics §5.1), nothing more.
    assert!(call(&w.tool, Some("K1"), "sa-1-0000bbbb").contains("cannot follow up on itself"));
}

#[test]
fn a_foreign_profile_learns_nothing() {
    let w = world(true);
    let missing = world(false);
    let other = Delegator::new(DelegatorParts {
        authority: Arc::new(Authority::new(w.fx.store.clone(), w.fx.store.clone(), "other-home")),
        profile: "other-home".into(),
        ..parts(&w)
    });
    retinue_testkit::retain_unit(
        &*w.fx.store,
        "A",
        "my-home",
        vec![ChildManifest {
            subagent_id: "sa-0-0000cccc".into(),
            session_id: "KP".into(),
            ..ChildManifest::default()
        }],
    );
    for requester in [Some("A"), Some("B"), Some("C")] {
        assert_eq!(
            call(&other, requester, "sa-0-0000cccc"),
            call(&missing.tool, requester, "sa-0-0000cccc")
        );
        assert_eq!(call(&other, requester, "KP"), call(&missing.tool, requester, "KP"));
    }
}

fn parts(w: &World) -> DelegatorParts {
    DelegatorParts {
        backend: retinue_core::Backend::of(w.fx.store.clone()),
        authority: Arc::new(Authority::new(w.fx.store.clone(), w.fx.store.clone(), "")),
        runtime: w.runtime.clone(),
        completions: None,

        config: DelegationConfig::default().into(),
        profile: String::new(),
    }
}

fn live(w: &World, sa: &str, session: &str, owner: Option<&str>, profile: &str) {
    w.tool.register_live(LiveChild {
        handle: ChildHandle {
            subagent_id: sa.into(),
            session_id: session.into(),
            ..ChildHandle::default()
        },
        owner_session_id: owner.map(str::to_owned),
        owner_profile: profile.into(),
        accepting_steer: true,
    });
}

#[test]
fn a_running_child_is_never_steered_by_a_foreign_session() {
    let w = world(false);
    let missing = world(false);
    live(&w, "sa-0-live0001", "LIVE1", Some("B"), "");
    live(&w, "sa-0-orphan01", "LIVE2", None, "");
    live(&w, "sa-0-blank001", "LIVE3", Some("  "), "");

    for requester in FOREIGN.iter().chain([&Some("LIVE1")]) {
        for target in ["sa-0-live0001", "LIVE1"] {
            let got = call(&w.tool, *requester, target);
            assert_eq!(got, call(&missing.tool, *requester, target), "{requester:?} → {target}");
        }
    }
    // Ownerless records and foreign profiles are never steered, even by the lineage.
    for requester in [Some("A"), Some("B"), Some("C")] {
        for target in ["sa-0-orphan01", "LIVE2", "sa-0-blank001"] {
            let got = call(&w.tool, requester, target);
            assert_eq!(got, call(&missing.tool, requester, target), "{requester:?} → {target}");
        }
    }
    // A running child of another profile: this process (profile `me`) may not steer it.
    let mine = Delegator::new(DelegatorParts {
        authority: Arc::new(Authority::new(w.fx.store.clone(), w.fx.store.clone(), "me")),
        profile: "me".into(),
        ..parts(&w)
    });
    mine.register_live(LiveChild {
        handle: ChildHandle {
            subagent_id: "sa-0-prof0001".into(),
            session_id: "LIVE4".into(),
            ..ChildHandle::default()
        },
        owner_session_id: Some("B".into()),
        owner_profile: "someone-else".into(),
        accepting_steer: true,
    });
    for requester in [Some("A"), Some("B"), Some("C")] {
        for target in ["sa-0-prof0001", "LIVE4"] {
            assert_eq!(call(&mine, requester, target), call(&missing.tool, requester, target));
        }
    }
    assert!(w.runtime.steers().is_empty(), "a foreign session steered: {:?}", w.runtime.steers());
    // The lineage itself may steer.
    let ok: Value = serde_json::from_str(&call(&w.tool, Some("C"), "sa-0-live0001")).expect("json");
    assert_eq!(ok["status"], "queued");
    assert_eq!(w.runtime.steers().len(), 1);
}
