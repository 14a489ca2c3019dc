//! Integration tests of the authority model against a real SQLite `state.db`
//! (semantics §5.4 examples, hermes's four authority tests, scoped lookups §5.5).

use std::sync::Arc;

use retinue_core::{
    ChildManifest, RegistryRead, RetainedChild, Retention, SessionGraph, SessionRow,
    TombstoneReason,
};
use retinue_lineage::{
    Authority, Denial, LineageAuthority, LineageCause, Resolution, RootError,
    check_follow_up_authority, find_for, lineage_chain, list_for, resolve_for, root,
};
use retinue_store::Store;
// The store's own mocks (feature `mocks`) do not compile at the moment, so
// the session-graph mock is declared here.
mockall::mock! {
    pub SessionGraph {}
    impl SessionGraph for SessionGraph {
        fn session(&self, id: &str) -> retinue_core::Result<Option<SessionRow>>;
        fn child_sessions(&self, parent: &str) -> retinue_core::Result<Vec<SessionRow>>;
    }
}

use retinue_testkit::{
    FIXTURE_CHILD_SESSION, FIXTURE_SUBAGENT_ID, SessionGraphBuilder, T0, TempHome,
    dispatch_and_retain, retain_unit,
};

/// Builds the §5.4 example graph.
fn example_graph(store: &Store) {
    let b = SessionGraphBuilder::new(store);
    b.root("A")
        .continuation("B", "A")
        .continuation("C", "B")
        .branch("BR", "A")
        .delegate_child("DC", "A")
        .raw_session("DM", "delegate", Some("A"), None)
        .raw_session("NM", "cli", Some("A"), Some(r#"{"_branched_from":null}"#))
        .branch("BR2", "B")
        .stranger("S")
        .cycle("X", "Y")
        .root("F")
        .compress("F")
        .plain_child("F1", "F")
        .plain_child("F2", "F")
        .chain("L", 100)
        .root("Q")
        .plain_child("Q1", "Q")
        .root("R")
        .end("R", "user_exit")
        .plain_child("R1", "R")
        .raw_session("MP", "cli", Some("ghost"), None);
}

fn setup(profile: &str) -> (TempHome, Arc<Store>) {
    let home = TempHome::new();
    let store = Arc::new(home.open_store_as(home.clock(T0), profile));
    example_graph(&store);
    (home, store)
}

fn child(subagent_id: &str, session_id: &str) -> ChildManifest {
    ChildManifest {
        subagent_id: subagent_id.into(),
        session_id: session_id.into(),
        model: Some("test/model".into()),
        goal: Some("do the thing".into()),
        ..ChildManifest::default()
    }
}

/// A retained unit spawned by `parent` with one child `sa-0-<tag>` / `K-<tag>`.
fn unit_by(store: &Store, parent: &str, owner: &str, tag: &str) -> RetainedChild {
    let sa = format!("sa-0-{tag}");
    retain_unit(store, parent, owner, vec![child(&sa, &format!("K-{tag}"))]);
    store.find_retained_child(&sa).expect("find").expect("retained unit is findable")
}

fn lineage_denied(r: Result<(), Denial>) -> bool {
    matches!(r, Err(Denial::Lineage { .. }))
}

// ---------------------------------------------------------------------------
// §5.4: every `root` row.
// ---------------------------------------------------------------------------

#[test]
fn example_root_compression_chain_resolves_to_a() {
    let (_home, store) = setup("");
    // Root, continuation, multi-hop — despite NM and DM under A (hermes: none).
    for s in ["A", "B", "C"] {
        assert_eq!(root(store.as_ref(), s), Ok("A".to_owned()), "{s}");
    }
    assert_eq!(lineage_chain(store.as_ref(), "C"), Ok(vec!["C".into(), "B".into(), "A".into()]));
}

#[test]
fn example_root_branches_have_none() {
    let (_home, store) = setup("");
    for s in ["BR", "BR2", "NM"] {
        assert_eq!(root(store.as_ref(), s), Err(RootError::Branch), "{s}");
    }
}

#[test]
fn example_root_delegate_children_have_none() {
    let (_home, store) = setup("");
    for s in ["DC", "DM"] {
        assert_eq!(root(store.as_ref(), s), Err(RootError::ForbiddenSource), "{s}");
    }
}

#[test]
fn example_root_stranger_is_its_own_root() {
    let (_home, store) = setup("");
    assert_eq!(root(store.as_ref(), "S"), Ok("S".to_owned()));
}

#[test]
fn example_root_cycle_and_fan_out_have_none() {
    let (_home, store) = setup("");
    assert_eq!(root(store.as_ref(), "X"), Err(RootError::Cycle));
    assert_eq!(root(store.as_ref(), "Y"), Err(RootError::Cycle));
    assert_eq!(root(store.as_ref(), "F1"), Err(RootError::AmbiguousContinuation));
    assert_eq!(root(store.as_ref(), "F2"), Err(RootError::AmbiguousContinuation));
}

#[test]
fn example_root_hop_limit() {
    let (_home, store) = setup("");
    assert_eq!(root(store.as_ref(), "L99"), Ok("L0".to_owned()));
    assert_eq!(root(store.as_ref(), "L100"), Err(RootError::HopLimit));
}

#[test]
fn example_root_bad_parents_and_unknown() {
    let (_home, store) = setup("");
    assert_eq!(root(store.as_ref(), "Q1"), Err(RootError::ParentNotEnded));
    assert_eq!(root(store.as_ref(), "R1"), Err(RootError::ParentNotCompression));
    assert_eq!(root(store.as_ref(), "MP"), Err(RootError::MissingParent));
    assert_eq!(root(store.as_ref(), "nope"), Err(RootError::MissingSession));
}

#[test]
fn continuation_of_a_branch_has_none() {
    let (_home, store) = setup("");
    SessionGraphBuilder::new(&store).continuation("BRC", "BR");
    assert_eq!(root(store.as_ref(), "BRC"), Err(RootError::Branch));
}

#[test]
fn malformed_model_config_has_no_root_and_never_makes_ambiguity() {
    let (_home, store) = setup("");
    SessionGraphBuilder::new(&store)
        .root("M")
        .continuation("M1", "M")
        .raw_session("MA", "cli", Some("M"), Some("[1]"))
        .raw_session("MB", "cli", Some("M"), Some("{bad"))
        .tool_session("MT", Some("M"));
    assert_eq!(root(store.as_ref(), "MA"), Err(RootError::BadModelConfig));
    assert_eq!(root(store.as_ref(), "MB"), Err(RootError::BadModelConfig));
    assert_eq!(root(store.as_ref(), "MT"), Err(RootError::ForbiddenSource));
    assert_eq!(root(store.as_ref(), "M1"), Ok("M".to_owned()));
    let e = unit_by(&store, "M", "", "m0000000");
    for bad in ["MA", "MB", "MT"] {
        assert!(lineage_denied(check_follow_up_authority(store.as_ref(), &e, Some(bad), "")));
    }
    assert_eq!(check_follow_up_authority(store.as_ref(), &e, Some("M1"), ""), Ok(()));
}

// ---------------------------------------------------------------------------
// §5.4: the authority examples (unit spawned by B, child session K).
// ---------------------------------------------------------------------------

#[test]
fn example_authority_lineage_of_b_is_allowed() {
    let (_home, store) = setup("me");
    let e = unit_by(&store, "B", "me", "b0000000");
    for ok in ["A", "B", "C"] {
        assert_eq!(check_follow_up_authority(store.as_ref(), &e, Some(ok), "me"), Ok(()), "{ok}");
    }
}

#[test]
fn example_authority_others_are_denied_by_lineage() {
    let (_home, store) = setup("me");
    let e = unit_by(&store, "B", "me", "b0000000");
    let requesters =
        [Some("BR"), Some("BR2"), Some("DC"), Some("DM"), Some("NM"), Some("S"), Some("F1")]
            .into_iter()
            .chain([Some("X"), None, Some(""), Some("  "), Some("nope"), Some("L99"), Some("Q1")]);
    for r in requesters {
        let got = check_follow_up_authority(store.as_ref(), &e, r, "me");
        assert!(lineage_denied(got.clone()), "{r:?}: {got:?}");
    }
    assert_eq!(
        check_follow_up_authority(store.as_ref(), &e, None, "me"),
        Err(Denial::Lineage { cause: LineageCause::NoRequester })
    );
    assert_eq!(
        check_follow_up_authority(store.as_ref(), &e, Some("S"), "me"),
        Err(Denial::Lineage { cause: LineageCause::DifferentRoots })
    );
}

#[test]
fn example_authority_child_itself_is_self_follow_up() {
    let (_home, store) = setup("me");
    let e = unit_by(&store, "B", "me", "b0000000");
    assert_eq!(e.child_session_id, "K-b0000000");
    assert_eq!(
        check_follow_up_authority(store.as_ref(), &e, Some("K-b0000000"), "me"),
        Err(Denial::SelfFollowUp)
    );
}

#[test]
fn example_authority_foreign_profile() {
    let (_home, store) = setup("me");
    let e = unit_by(&store, "B", "someone-else", "b0000000");
    assert_eq!(
        check_follow_up_authority(store.as_ref(), &e, Some("B"), "me"),
        Err(Denial::Profile { owner: "someone-else".into(), current: "me".into() })
    );
}

#[test]
fn example_authority_unit_spawned_by_delegate_child_is_addressable_by_nobody() {
    let (_home, store) = setup("");
    let e = unit_by(&store, "DC", "", "dc000000");
    let all = ["A", "B", "C", "BR", "BR2", "DC", "DM", "NM", "S", "X", "F", "F1", "L0", "MP"];
    for r in all {
        let got = check_follow_up_authority(store.as_ref(), &e, Some(r), "");
        assert_eq!(
            got,
            Err(Denial::Lineage { cause: LineageCause::OwnerRoot(RootError::ForbiddenSource) }),
            "{r:?}"
        );
    }
    for r in [None, Some(""), Some(" ")] {
        let got = check_follow_up_authority(store.as_ref(), &e, r, "");
        assert_eq!(got, Err(Denial::Lineage { cause: LineageCause::NoRequester }), "{r:?}");
    }
    assert_eq!(list_for(store.as_ref(), store.as_ref(), Some("A"), "").unwrap(), vec![]);
    assert_eq!(list_for(store.as_ref(), store.as_ref(), Some("DC"), "").unwrap(), vec![]);
}

#[test]
fn an_ancestor_of_the_spawner_is_allowed_and_a_descendant_too() {
    let (_home, store) = setup("");
    let e = unit_by(&store, "L50", "", "l5000000");
    for ok in ["L0", "L49", "L50", "L51", "L99"] {
        assert_eq!(check_follow_up_authority(store.as_ref(), &e, Some(ok), ""), Ok(()), "{ok}");
    }
    assert!(lineage_denied(check_follow_up_authority(store.as_ref(), &e, Some("L100"), "")));
}

// ---------------------------------------------------------------------------
// hermes's four authority tests (seed), ported.
// ---------------------------------------------------------------------------

fn seed_home(profile: &str) -> (TempHome, Store) {
    let home = TempHome::new();
    let store = home.open_store_as(home.clock(T0), profile);
    (home, store)
}

#[test]
fn lineage_authority_allows_compression_continuation() {
    let (_home, store) = seed_home("");
    SessionGraphBuilder::new(&store).root("A").compress("A").plain_child("B", "A");
    dispatch_and_retain(&store, "A");
    let entry = store.find_retained_child(FIXTURE_SUBAGENT_ID).unwrap().unwrap();
    assert_eq!(check_follow_up_authority(&store, &entry, Some("B"), ""), Ok(()));
    assert_eq!(check_follow_up_authority(&store, &entry, Some("A"), ""), Ok(()));
}

#[test]
fn lineage_authority_rejects_siblings_and_foreigners() {
    let (_home, store) = seed_home("");
    SessionGraphBuilder::new(&store)
        .root("A")
        .compress("A")
        .plain_child("B", "A")
        .branch("branch", "A")
        .delegate_child("delegatechild", "A")
        .stranger("stranger");
    dispatch_and_retain(&store, "A");
    let entry = store.find_retained_child(FIXTURE_SUBAGENT_ID).unwrap().unwrap();
    for foreign in [Some("branch"), Some("delegatechild"), Some("stranger"), None, Some("")] {
        let got = check_follow_up_authority(&store, &entry, foreign, "");
        assert!(got.is_err(), "{foreign:?}");
        assert!(got.unwrap_err().message().contains("lineage"));
    }
}

#[test]
fn lineage_authority_rejects_child_self_follow_up() {
    let (_home, store) = seed_home("");
    SessionGraphBuilder::new(&store).root("A");
    dispatch_and_retain(&store, "A");
    let entry = store.find_retained_child(FIXTURE_SUBAGENT_ID).unwrap().unwrap();
    let err = check_follow_up_authority(&store, &entry, Some(FIXTURE_CHILD_SESSION), "")
        .expect_err("self follow-up must be denied");
    assert!(err.message().contains("itself"), "{err}");
}

#[test]
fn foreign_profile_is_rejected() {
    let (_home, store) = seed_home("me");
    SessionGraphBuilder::new(&store).root("A");
    dispatch_and_retain(&store, "A");
    let mut entry = store.find_retained_child(FIXTURE_SUBAGENT_ID).unwrap().unwrap();
    entry.owner_profile = "someone-else".into();
    let err = check_follow_up_authority(&store, &entry, Some("A"), "me")
        .expect_err("foreign profile must be denied");
    assert!(err.message().contains("profile"), "{err}");
}

// ---------------------------------------------------------------------------
// Storage errors fail closed.
// ---------------------------------------------------------------------------

#[test]
fn storage_error_from_the_graph_denies() {
    let mut graph = MockSessionGraph::new();
    graph.expect_session().returning(|_| Err(retinue_core::Error::Invalid("boom".into())));
    graph.expect_child_sessions().returning(|_| Ok(vec![]));
    let (_home, store) = seed_home("");
    SessionGraphBuilder::new(&store).root("A");
    dispatch_and_retain(&store, "A");
    let entry = store.find_retained_child(FIXTURE_SUBAGENT_ID).unwrap().unwrap();
    assert!(matches!(
        check_follow_up_authority(&graph, &entry, Some("A"), ""),
        Err(Denial::Lineage { cause: LineageCause::OwnerRoot(RootError::Storage(_)) })
    ));
    assert_eq!(list_for(&store, &graph, Some("A"), "").unwrap(), vec![]);
    assert_eq!(find_for(&store, &graph, Some("A"), FIXTURE_SUBAGENT_ID, "").unwrap(), None);
    assert_eq!(
        resolve_for(&store, &graph, Some("A"), FIXTURE_SUBAGENT_ID, ""),
        Resolution::NotAddressable
    );
}

#[test]
fn storage_error_from_a_broken_file_denies() {
    let (home, store) = seed_home("");
    SessionGraphBuilder::new(&store).root("A").continuation("B", "A");
    dispatch_and_retain(&store, "A");
    let entry = store.find_retained_child(FIXTURE_SUBAGENT_ID).unwrap().unwrap();
    assert_eq!(check_follow_up_authority(&store, &entry, Some("B"), ""), Ok(()));
    // The sessions table vanishes under the store: every read fails.
    home.exec("ALTER TABLE sessions RENAME TO sessions_gone;");
    assert!(matches!(root(&store, "A"), Err(RootError::Storage(_))));
    assert!(matches!(
        check_follow_up_authority(&store, &entry, Some("B"), ""),
        Err(Denial::Lineage { cause: LineageCause::OwnerRoot(RootError::Storage(_)) })
    ));
}

#[test]
fn storage_error_from_the_registry_is_not_addressable() {
    let (home, store) = seed_home("");
    SessionGraphBuilder::new(&store).root("A");
    dispatch_and_retain(&store, "A");
    assert!(find_for(&store, &store, Some("A"), FIXTURE_SUBAGENT_ID, "").unwrap().is_some());
    // The registry's tables vanish under the store: every registry read fails.
    home.exec("ALTER TABLE async_delegations RENAME TO async_delegations_gone;");
    assert!(store.lookup(FIXTURE_SUBAGENT_ID).is_err());
    assert_eq!(
        resolve_for(&store, &store, Some("A"), FIXTURE_SUBAGENT_ID, ""),
        Resolution::NotAddressable
    );
    assert!(list_for(&store, &store, Some("A"), "").is_err());
    assert!(find_for(&store, &store, Some("A"), FIXTURE_SUBAGENT_ID, "").is_err());
}

// ---------------------------------------------------------------------------
// §5.5 scoped lookups.
// ---------------------------------------------------------------------------

#[test]
fn scoped_list_and_find() {
    let (_home, store) = setup("me");
    let by_b = unit_by(&store, "B", "me", "b0000000");
    let by_s = unit_by(&store, "S", "me", "s0000000");
    let foreign = unit_by(&store, "A", "someone-else", "f0000000");
    let (r, g): (&dyn RegistryRead, &dyn SessionGraph) = (store.as_ref(), store.as_ref());

    assert_eq!(list_for(r, g, Some("C"), "me").unwrap(), vec![by_b.clone()]);
    assert_eq!(list_for(r, g, Some("S"), "me").unwrap(), vec![by_s.clone()]);
    assert_eq!(list_for(r, g, Some("BR"), "me").unwrap(), vec![]);
    assert_eq!(list_for(r, g, None, "me").unwrap(), vec![]);
    // Same profile off: the foreign unit's lineage (A) matches.
    let mut both = list_for(r, g, Some("C"), "").unwrap();
    both.sort_by(|a, b| a.delegation_id.cmp(&b.delegation_id));
    let mut want = vec![by_b.clone(), foreign.clone()];
    want.sort_by(|a, b| a.delegation_id.cmp(&b.delegation_id));
    assert_eq!(both, want);
    // The operator listing stays unscoped.
    assert_eq!(store.list_retained_children().unwrap().len(), 3);

    // find_for: every id form; foreign = missing = None.
    for id in ["sa-0-b0000000", "K-b0000000", by_b.delegation_id.as_str()] {
        assert_eq!(find_for(r, g, Some("A"), id, "me").unwrap(), Some(by_b.clone()), "{id}");
        assert_eq!(find_for(r, g, Some("S"), id, "me").unwrap(), None, "{id}");
    }
    assert_eq!(find_for(r, g, Some("A"), "sa-0-f0000000", "me").unwrap(), None);
    assert_eq!(find_for(r, g, Some("A"), "sa-ghost", "me").unwrap(), None);
    assert_eq!(find_for(r, g, Some("K-b0000000"), "sa-0-b0000000", "me").unwrap(), None);
}

#[test]
fn scoped_resolve() {
    let (_home, store) = setup("me");
    let by_b = unit_by(&store, "B", "me", "b0000000");
    unit_by(&store, "A", "someone-else", "f0000000");
    let (r, g): (&dyn RegistryRead, &dyn SessionGraph) = (store.as_ref(), store.as_ref());

    assert_eq!(resolve_for(r, g, Some("C"), "sa-0-b0000000", "me"), Resolution::Addressable(by_b));
    assert_eq!(resolve_for(r, g, Some("S"), "sa-0-b0000000", "me"), Resolution::NotAddressable);
    assert_eq!(resolve_for(r, g, None, "sa-0-b0000000", "me"), Resolution::NotAddressable);
    assert_eq!(resolve_for(r, g, Some("K-b0000000"), "K-b0000000", "me"), Resolution::SelfTarget);
    assert_eq!(resolve_for(r, g, Some("A"), "sa-0-f0000000", "me"), Resolution::NotAddressable);
    assert_eq!(resolve_for(r, g, Some("A"), "sa-ghost", "me"), Resolution::NotAddressable);

    // Tombstoned: told only after authority.
    assert!(store.tombstone_retained_child("sa-0-b0000000", &TombstoneReason::Manual).unwrap());
    match resolve_for(r, g, Some("A"), "sa-0-b0000000", "me") {
        Resolution::Tombstoned { entry, at, reason } => {
            assert_eq!(entry.child_session_id, "K-b0000000");
            assert_eq!(at, T0);
            assert_eq!(reason, TombstoneReason::Manual);
        }
        other => panic!("expected Tombstoned, got {other:?}"),
    }
    assert_eq!(resolve_for(r, g, Some("S"), "sa-0-b0000000", "me"), Resolution::NotAddressable);
    assert_eq!(resolve_for(r, g, Some("A"), "sa-0-f0000000", "me"), Resolution::NotAddressable);
    assert_eq!(find_for(r, g, Some("A"), "sa-0-b0000000", "me").unwrap(), None);
}

#[test]
fn authority_object_over_a_shared_store() {
    let (_home, store) = setup("me");
    let by_b = unit_by(&store, "B", "me", "b0000000");
    let auth: Box<dyn LineageAuthority> =
        Box::new(Authority::new(store.clone(), store.clone(), "me"));
    assert_eq!(auth.root("C"), Ok("A".into()));
    assert_eq!(auth.check_follow_up_authority(&by_b, Some("A")), Ok(()));
    assert_eq!(auth.list_for(Some("C")).unwrap(), vec![by_b.clone()]);
    assert_eq!(auth.find_for(Some("S"), "sa-0-b0000000").unwrap(), None);
    assert_eq!(auth.resolve_for(Some("C"), "K-b0000000"), Resolution::Addressable(by_b));
}

// ---------------------------------------------------------------------------
// insta: the contractual denial texts.
// ---------------------------------------------------------------------------

#[test]
fn denial_message_snapshots() {
    insta::assert_snapshot!(
        "denial_profile",
        Denial::Profile { owner: "someone-else".into(), current: "me".into() }.message()
    );
    insta::assert_snapshot!("denial_self", Denial::SelfFollowUp.message());
    insta::assert_snapshot!(
        "denial_lineage",
        Denial::Lineage { cause: LineageCause::DifferentRoots }.message()
    );
    // Display is the same text.
    assert_eq!(Denial::SelfFollowUp.to_string(), Denial::SelfFollowUp.message());
}

#[test]
fn denials_of_the_examples_snapshot() {
    let (_home, store) = setup("me");
    let e = unit_by(&store, "B", "me", "b0000000");
    let report: Vec<(String, Result<(), Denial>)> =
        ["A", "B", "C", "BR", "BR2", "DC", "DM", "NM", "S", "F1", "X", "", "  ", "K-b0000000"]
            .into_iter()
            .map(|r| (r.to_owned(), check_follow_up_authority(store.as_ref(), &e, Some(r), "me")))
            .collect();
    insta::assert_debug_snapshot!("example_authority_outcomes", report);
}

// ---------------------------------------------------------------------------
// Roots are never stale: the store's per-connection neighbourhood cache is
// validated by `PRAGMA data_version` (other connections' commits) and the
// connection's own changes.
// ---------------------------------------------------------------------------

/// The same check twice (the second answered from the cache), then a second
/// connection — another program — edits the chain between two checks: every
/// answer is the one a fresh read gives.
#[test]
fn roots_are_never_stale_when_another_connection_edits_the_chain() {
    let (home, store) = setup("");
    // L0 … L99: depth 99 resolves to L0.
    let authority = Authority::new(store.clone(), store.clone(), "");
    let entry = unit_by(&store, "L0", "", "fresh");
    for _ in 0..3 {
        assert_eq!(root(&*store, "L99"), Ok("L0".to_owned()));
        assert_eq!(authority.check_follow_up_authority(&entry, Some("L99")), Ok(()));
    }
    let other = rusqlite::Connection::open(home.db_path()).expect("second connection");
    // Break a link halfway up: L50's parent did not end with compression.
    other
        .execute("UPDATE sessions SET end_reason = 'user_exit' WHERE id = 'L49'", [])
        .expect("edit");
    assert_eq!(root(&*store, "L99"), Err(RootError::ParentNotCompression));
    assert!(lineage_denied(authority.check_follow_up_authority(&entry, Some("L99"))));
    assert_eq!(root(&*store, "L49"), Ok("L0".to_owned()));
    // Mend it: the answer comes back at once.
    other
        .execute("UPDATE sessions SET end_reason = 'compression' WHERE id = 'L49'", [])
        .expect("mend");
    assert_eq!(root(&*store, "L99"), Ok("L0".to_owned()));
    assert_eq!(authority.check_follow_up_authority(&entry, Some("L99")), Ok(()));
    // A sibling continuation appears under L10 (ambiguous), written by another process.
    other
        .execute(
            "INSERT INTO sessions (id, source, parent_session_id, started_at) \
             VALUES ('L11b', 'cli', 'L10', 1)",
            [],
        )
        .expect("fork");
    assert_eq!(root(&*store, "L99"), Err(RootError::AmbiguousContinuation));
    other.execute("DELETE FROM sessions WHERE id = 'L11b'", []).expect("unfork");
    assert_eq!(root(&*store, "L99"), Ok("L0".to_owned()));
    // The store's own writes (through any of its connections) count too.
    SessionGraphBuilder::new(&store).plain_child("L11c", "L10");
    assert_eq!(root(&*store, "L99"), Err(RootError::AmbiguousContinuation));
}
