//! Unit tests of the rules against `MockSessionGraph` (no SQLite), and the
//! property tests against an oracle written straight from the spec.

use std::sync::Arc;

use proptest::prelude::*;
use retinue_core::{Error, RetainedChild, SessionGraph, SessionRow};

// A local mock of the two row readers only: `neighbourhood` keeps its default
// (no prefetch), so these tests exercise the row-by-row walk; the prefetching
// path is covered against real SQLite in `tests/it.rs`.
mockall::mock! {
    pub SessionGraph {}
    impl SessionGraph for SessionGraph {
        fn session(&self, id: &str) -> retinue_core::Result<Option<SessionRow>>;
        fn child_sessions(&self, parent: &str) -> retinue_core::Result<Vec<SessionRow>>;
    }
}

use super::*;

fn row(id: &str, source: &str, parent: Option<&str>, mc: Option<&str>) -> SessionRow {
    SessionRow {
        id: id.to_owned(),
        source: source.to_owned(),
        parent_session_id: parent.map(str::to_owned),
        model_config: mc.map(str::to_owned),
        ..SessionRow::default()
    }
}

fn ended(mut r: SessionRow, reason: &str) -> SessionRow {
    r.ended_at = Some(1.0);
    r.end_reason = Some(reason.to_owned());
    r
}

/// A mock graph answering from `rows` (children in slice order).
fn mock_graph(rows: Vec<SessionRow>) -> MockSessionGraph {
    let rows = Arc::new(rows);
    let mut g = MockSessionGraph::new();
    let r1 = Arc::clone(&rows);
    g.expect_session().returning(move |id| Ok(r1.iter().find(|r| r.id == id).cloned()));
    g.expect_child_sessions().returning(move |p| {
        Ok(rows.iter().filter(|r| r.parent_session_id.as_deref() == Some(p)).cloned().collect())
    });
    g
}

fn entry(parent: &str, child_session: &str, owner: &str) -> RetainedChild {
    RetainedChild {
        delegation_id: "deleg_00000001".into(),
        parent_session_id: parent.into(),
        owner_profile: owner.into(),
        state: "completed".into(),
        retained_at: Some(1.0),
        completed_at: Some(1.0),
        child_index: 0,
        subagent_id: "sa-0-abc12345".into(),
        child_session_id: child_session.into(),
        manifest: retinue_core::ChildManifest::default(),
    }
}

/// A → B → C compression chain plus the §5.4 children of A.
fn example_rows() -> Vec<SessionRow> {
    vec![
        ended(row("A", "cli", None, None), "compression"),
        ended(row("B", "cli", Some("A"), None), "compression"),
        row("C", "cli", Some("B"), None),
        row("BR", "cli", Some("A"), Some(r#"{"_branched_from":"A"}"#)),
        row("DC", "delegate", Some("A"), Some(r#"{"_delegate_from":"A"}"#)),
        row("DM", "delegate", Some("A"), None),
        row("NM", "cli", Some("A"), Some(r#"{"_branched_from":null}"#)),
        row("S", "cli", None, None),
    ]
}

#[test]
fn per_hop_check() {
    assert_eq!(check_hop("cli", None), Ok(()));
    assert_eq!(check_hop("cli", Some("")), Ok(()));
    assert_eq!(check_hop("cli", Some("  ")), Ok(()));
    assert_eq!(check_hop("cli", Some(r#"{"model":"x"}"#)), Ok(()));
    assert_eq!(check_hop("telegram", Some("{}")), Ok(()));
    for s in ["delegate", " Delegate ", "SUBAGENT", "tool", "\ttool\n"] {
        assert_eq!(check_hop(s, None), Err(RootError::ForbiddenSource), "{s:?}");
    }
    // Source wins over the marker.
    assert_eq!(
        check_hop("delegate", Some(r#"{"_delegate_from":"A"}"#)),
        Err(RootError::ForbiddenSource)
    );
    for mc in ["[1]", "{bad", "null", "\"x\"", "3", "[]"] {
        assert_eq!(check_hop("cli", Some(mc)), Err(RootError::BadModelConfig), "{mc:?}");
    }
    assert_eq!(check_hop("cli", Some(r#"{"_branched_from":null}"#)), Err(RootError::Branch));
    assert_eq!(check_hop("cli", Some(r#"{"_branched_from":"A"}"#)), Err(RootError::Branch));
    assert_eq!(check_hop("cli", Some(r#"{"_delegate_from":null}"#)), Err(RootError::DelegateChild));
    assert_eq!(
        check_hop("cli", Some(r#"{"_delegate_from":1,"_branched_from":1}"#)),
        Err(RootError::Branch)
    );
}

#[test]
fn root_walks_compression_continuations_only() {
    let g = mock_graph(example_rows());
    assert_eq!(root(&g, "A"), Ok("A".into()));
    assert_eq!(root(&g, "B"), Ok("A".into()));
    assert_eq!(root(&g, " C "), Ok("A".into()));
    assert_eq!(lineage_chain(&g, "C"), Ok(vec!["C".into(), "B".into(), "A".into()]));
    assert_eq!(root(&g, "BR"), Err(RootError::Branch));
    assert_eq!(root(&g, "NM"), Err(RootError::Branch));
    assert_eq!(root(&g, "DC"), Err(RootError::ForbiddenSource));
    assert_eq!(root(&g, "DM"), Err(RootError::ForbiddenSource));
    assert_eq!(root(&g, "S"), Ok("S".into()));
    assert_eq!(root(&g, "nope"), Err(RootError::MissingSession));
    assert_eq!(root(&g, ""), Err(RootError::NoSession));
    assert_eq!(root(&g, "   "), Err(RootError::NoSession));
}

#[test]
fn root_parent_conditions() {
    let g = mock_graph(vec![
        row("Q", "cli", None, None),
        row("Q1", "cli", Some("Q"), None),
        ended(row("R", "cli", None, None), "user_exit"),
        row("R1", "cli", Some("R"), None),
        ended(row("RC", "cli", None, None), "Compression"),
        row("RC1", "cli", Some("RC"), None),
        row("MP", "cli", Some("ghost"), None),
        row("BP", "cli", Some("  "), None),
        ended(row("F", "cli", None, None), "compression"),
        row("F1", "cli", Some("F"), None),
        row("F2", "cli", Some("F"), None),
    ]);
    assert_eq!(root(&g, "Q1"), Err(RootError::ParentNotEnded));
    assert_eq!(root(&g, "R1"), Err(RootError::ParentNotCompression));
    assert_eq!(root(&g, "RC1"), Err(RootError::ParentNotCompression));
    assert_eq!(root(&g, "MP"), Err(RootError::MissingParent));
    assert_eq!(root(&g, "BP"), Ok("BP".into()));
    assert_eq!(root(&g, "F1"), Err(RootError::AmbiguousContinuation));
    assert_eq!(root(&g, "F2"), Err(RootError::AmbiguousContinuation));
    assert_eq!(root(&g, "F"), Ok("F".into()));
}

#[test]
fn root_detects_cycles_and_self_parent() {
    let g = mock_graph(vec![
        ended(row("X", "cli", Some("Y"), None), "compression"),
        ended(row("Y", "cli", Some("X"), None), "compression"),
        ended(row("Z", "cli", Some("Z"), None), "compression"),
    ]);
    assert_eq!(root(&g, "X"), Err(RootError::Cycle));
    assert_eq!(root(&g, "Y"), Err(RootError::Cycle));
    assert_eq!(root(&g, "Z"), Err(RootError::Cycle));
}

#[test]
fn root_hop_limit() {
    let mut rows = vec![ended(row("L0", "cli", None, None), "compression")];
    for i in 1..=100 {
        rows.push(ended(
            row(&format!("L{i}"), "cli", Some(&format!("L{}", i - 1)), None),
            "compression",
        ));
    }
    let g = mock_graph(rows);
    assert_eq!(root(&g, "L99"), Ok("L0".into()));
    assert_eq!(lineage_chain(&g, "L99").map(|c| c.len()), Ok(MAX_HOPS));
    assert_eq!(root(&g, "L100"), Err(RootError::HopLimit));
}

#[test]
fn root_storage_errors_fail_closed() {
    let mut g = MockSessionGraph::new();
    g.expect_session().returning(|_| Err(Error::Invalid("disk on fire".into())));
    assert!(
        matches!(root(&g, "A"), Err(RootError::Storage(m)) if m.to_string().contains("disk on fire"))
    );

    let mut g = MockSessionGraph::new();
    g.expect_session().returning(|id| {
        Ok(Some(match id {
            "A" => ended(row("A", "cli", None, None), "compression"),
            _ => row(id, "cli", Some("A"), None),
        }))
    });
    g.expect_child_sessions().returning(|_| Err(Error::Invalid("corrupt".into())));
    assert!(matches!(root(&g, "B"), Err(RootError::Storage(_))));
    let denial = check_follow_up_authority(&g, &entry("A", "K", ""), Some("B"), "");
    assert!(matches!(
        denial,
        Err(Denial::Lineage { cause: LineageCause::RequesterRoot(RootError::Storage(_)) })
    ));
}

#[test]
fn authority_order_and_causes() {
    let g = mock_graph(example_rows());
    let e = entry("B", "K", "");
    for ok in ["A", "B", "C", " C "] {
        assert_eq!(check_follow_up_authority(&g, &e, Some(ok), ""), Ok(()), "{ok}");
    }
    let lineage = |cause| Err(Denial::Lineage { cause });
    assert_eq!(check_follow_up_authority(&g, &e, None, ""), lineage(LineageCause::NoRequester));
    assert_eq!(
        check_follow_up_authority(&g, &e, Some(" "), ""),
        lineage(LineageCause::NoRequester)
    );
    assert_eq!(
        check_follow_up_authority(&g, &e, Some("S"), ""),
        lineage(LineageCause::DifferentRoots)
    );
    assert_eq!(
        check_follow_up_authority(&g, &e, Some("BR"), ""),
        lineage(LineageCause::RequesterRoot(RootError::Branch))
    );
    assert_eq!(check_follow_up_authority(&g, &e, Some(" K "), ""), Err(Denial::SelfFollowUp));
    // Profile comes first, even for the child itself.
    let foreign = entry("B", "K", "someone-else");
    assert_eq!(
        check_follow_up_authority(&g, &foreign, Some("K"), "me"),
        Err(Denial::Profile { owner: "someone-else".into(), current: "me".into() })
    );
    // Either profile empty: no profile denial.
    assert_eq!(check_follow_up_authority(&g, &foreign, Some("B"), ""), Ok(()));
    assert_eq!(check_follow_up_authority(&g, &e, Some("B"), "me"), Ok(()));
    // Self needs a non-empty child session.
    let no_child = entry("B", "", "");
    assert_eq!(
        check_follow_up_authority(&g, &no_child, Some(""), ""),
        lineage(LineageCause::NoRequester)
    );
    // Owner root failures.
    let by_dc = entry("DC", "K", "");
    assert_eq!(
        check_follow_up_authority(&g, &by_dc, Some("DC"), ""),
        lineage(LineageCause::OwnerRoot(RootError::ForbiddenSource))
    );
    let ownerless = entry("", "K", "");
    assert_eq!(
        check_follow_up_authority(&g, &ownerless, Some("A"), ""),
        lineage(LineageCause::OwnerRoot(RootError::NoSession))
    );
}

#[test]
fn denial_texts() {
    assert_eq!(
        Denial::Profile { owner: "o".into(), current: "c".into() }.message(),
        "follow_up rejected: retained subagent belongs to profile 'o', not 'c'."
    );
    assert_eq!(
        Denial::SelfFollowUp.to_string(),
        "follow_up rejected: a subagent cannot follow up on itself."
    );
    let texts: Vec<String> = [
        LineageCause::NoRequester,
        LineageCause::DifferentRoots,
        LineageCause::OwnerRoot(RootError::Cycle),
        LineageCause::RequesterRoot(RootError::Storage(std::sync::Arc::new(
            retinue_core::Error::Invalid("secret".into()),
        ))),
    ]
    .into_iter()
    .map(|cause| Denial::Lineage { cause }.message())
    .collect();
    assert!(texts.iter().all(|t| t == &texts[0]), "the cause never reaches the text");
    assert_eq!(
        texts[0],
        "follow_up rejected: only the session lineage that spawned this subagent may message it \
         (compression-rotation continuations included; branches, siblings, and foreign sessions \
         are not owners)."
    );
}

#[test]
fn authority_trait_is_mockable_and_object_safe() {
    let mut m = MockLineageAuthority::new();
    m.expect_resolve_for().returning(|_, _| Resolution::SelfTarget);
    let dynamic: &dyn LineageAuthority = &m;
    assert_eq!(dynamic.resolve_for(Some("K"), "sa-0"), Resolution::SelfTarget);
}

// ---------------------------------------------------------------------------
// Property tests: `root` against an oracle written from the spec's definition.
// ---------------------------------------------------------------------------

/// Spec §1/§5.2 read as a recursive definition, with no visited set: a session
/// has a root iff it exists, is eligible, and either has no parent (it is the
/// root) or is the single eligible child of a `compression`-ended parent that
/// itself has a root — within 100 checked sessions.
fn oracle_root(rows: &[SessionRow], id: &str, checked: usize) -> Option<String> {
    let eligible = |r: &SessionRow| {
        let src = r.source.trim().to_ascii_lowercase();
        if src == "delegate" || src == "subagent" || src == "tool" {
            return false;
        }
        match r.model_config.as_deref().map(str::trim) {
            None | Some("") => true,
            Some(t) => match serde_json::from_str::<serde_json::Value>(t) {
                Ok(serde_json::Value::Object(m)) => {
                    !m.contains_key("_branched_from") && !m.contains_key("_delegate_from")
                }
                _ => false,
            },
        }
    };
    let me = rows.iter().find(|r| r.id == id)?;
    if !eligible(me) {
        return None;
    }
    let parent = me.parent_session_id.clone().unwrap_or_default();
    if parent.trim().is_empty() {
        return Some(id.to_owned());
    }
    let p = rows.iter().find(|r| r.id == parent)?;
    if p.ended_at.is_none() || p.end_reason.as_deref() != Some("compression") {
        return None;
    }
    let continuations: Vec<&str> = rows
        .iter()
        .filter(|r| r.parent_session_id.as_deref() == Some(parent.as_str()) && eligible(r))
        .map(|r| r.id.as_str())
        .collect();
    if continuations != [id] || checked + 1 >= MAX_HOPS {
        return None;
    }
    oracle_root(rows, &parent, checked + 1)
}

fn arb_forest(max: usize) -> impl Strategy<Value = Vec<SessionRow>> {
    let source = prop_oneof![
        6 => Just("cli"),
        1 => Just(" Delegate "),
        1 => Just("subagent"),
        1 => Just("tool"),
        1 => Just("telegram"),
    ];
    let mc = prop_oneof![
        6 => Just(None),
        1 => Just(Some("")),
        1 => Just(Some("{}")),
        1 => Just(Some(r#"{"_branched_from":null}"#)),
        1 => Just(Some(r#"{"_delegate_from":"x"}"#)),
        1 => Just(Some("[1]")),
        1 => Just(Some("{bad")),
    ];
    let end = prop_oneof![
        5 => Just(Some("compression")),
        1 => Just(Some("user_exit")),
        2 => Just(None),
    ];
    (1..=max).prop_flat_map(move |n| {
        // Parent index n = "ghost" (no row); n+1.. = no parent.
        let node = (source.clone(), mc.clone(), end.clone(), 0..n + 3);
        proptest::collection::vec(node, n).prop_map(move |nodes| {
            nodes
                .into_iter()
                .enumerate()
                .map(|(i, (src, mc, end, p))| {
                    let parent = match p {
                        p if p < n => Some(format!("s{p}")),
                        p if p == n => Some("ghost".to_owned()),
                        _ => None,
                    };
                    SessionRow {
                        id: format!("s{i}"),
                        source: src.to_owned(),
                        model_config: mc.map(str::to_owned),
                        parent_session_id: parent,
                        ended_at: end.map(|_| 1.0),
                        end_reason: end.map(str::to_owned),
                        ..SessionRow::default()
                    }
                })
                .collect()
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn root_matches_oracle(rows in arb_forest(12)) {
        let g = mock_graph(rows.clone());
        for r in &rows {
            let got = root(&g, &r.id).ok();
            prop_assert_eq!(got, oracle_root(&rows, &r.id, 0), "start {}", r.id);
        }
        prop_assert_eq!(root(&g, "ghost").ok(), None);
    }

    #[test]
    fn authority_iff_shared_compression_lineage(
        rows in arb_forest(10),
        spawner in 0usize..12,
        requester in 0usize..12,
    ) {
        let g = mock_graph(rows.clone());
        let e = entry(&format!("s{spawner}"), "child-sess", "");
        let req = format!("s{requester}");
        let allowed = check_follow_up_authority(&g, &e, Some(&req), "").is_ok();
        let expected = match (
            oracle_root(&rows, &format!("s{spawner}"), 0),
            oracle_root(&rows, &req, 0),
        ) {
            (Some(a), Some(b)) => a == b,
            _ => false,
        };
        prop_assert_eq!(allowed, expected);
    }

    #[test]
    fn long_chains_match_oracle(len in 90usize..110, cut in 0usize..110) {
        // A compression chain s0 → … → s<len-1>; maybe one link made ambiguous.
        let mut rows: Vec<SessionRow> = (0..len)
            .map(|i| {
                let parent = (i > 0).then(|| format!("s{}", i - 1));
                ended(row(&format!("s{i}"), "cli", parent.as_deref(), None), "compression")
            })
            .collect();
        if cut < len {
            rows.push(row("extra", "cli", Some(&format!("s{cut}")), None));
        }
        let g = mock_graph(rows.clone());
        let last = format!("s{}", len - 1);
        prop_assert_eq!(root(&g, &last).ok(), oracle_root(&rows, &last, 0));
    }
}

#[test]
fn forbidden_sources_fold_case_and_trim() {
    for source in [" DeLeGaTe ", "TOOL", "Subagent\t", "\u{3000}tool"] {
        assert_eq!(check_hop(source, None), Err(RootError::ForbiddenSource), "{source:?}");
    }
    for source in ["delegates", "tools", "sub agent", "cli", "", "K\u{212A}"] {
        assert_eq!(check_hop(source, None), Ok(()), "{source:?}");
    }
}

/// Failure injection at the `RegistryRead` seam: a registry error is returned
/// by the listing calls and fails closed on the tool path.
#[test]
fn registry_read_errors_fail_closed() {
    let mut registry = retinue_core::MockRegistryRead::new();
    registry
        .expect_list_retained_children()
        .returning(|| Err(Error::Invalid("injected storage failure".into())));
    registry
        .expect_find_retained_child()
        .returning(|_| Err(Error::Invalid("injected storage failure".into())));
    registry.expect_lookup().returning(|_| Err(Error::Invalid("injected storage failure".into())));
    let graph = mock_graph(vec![row("P", "cli", None, None)]);
    assert!(list_for(&registry, &graph, Some("P"), "").is_err());
    assert!(find_for(&registry, &graph, Some("P"), "sa-0-x", "").is_err());
    assert_eq!(resolve_for(&registry, &graph, Some("P"), "sa-0-x", ""), Resolution::NotAddressable);
}
