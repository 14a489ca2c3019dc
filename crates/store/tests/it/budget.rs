//! Budget reservations on a real SQLite file: refusals state the numbers,
//! settling returns the allowance, racing writers never reserve past the
//! limit, and recovery releases what a dead owner held.

use std::sync::{Arc, Barrier};

use proptest::prelude::*;
use retinue_core::{
    AttributionDraft, BudgetLimit, Budgets, MockOwnerProbe, ProcessState, Reservation,
    ReservationDraft, Spend, TotalsUpdate, UsageLedger,
};
use retinue_store::Store;
use serde_json::json;

use super::fixture::Fx;

fn draft(root: &str, cost: f64, tokens: u64, limit: BudgetLimit) -> ReservationDraft {
    ReservationDraft {
        lineage_root: root.to_owned(),
        sessions: vec![root.to_owned(), format!("{root}-cont")],
        limit,
        minimum: Spend { cost_usd: cost, tokens },
        maximum: Some(Spend { cost_usd: cost, tokens }),
        delegation_id: None,
    }
}

fn bill(store: &Store, parent: &str, cost: f64, input: u64, output: u64) {
    let usage = json!({"cost_usd": cost, "tokens": {"input": input, "output": output}});
    let row = AttributionDraft {
        parent_session_id: parent.to_owned(),
        usage,
        ..AttributionDraft::default()
    };
    store.record_usage(&row, &TotalsUpdate::default()).expect("ledger row");
}

const ONE_DOLLAR: BudgetLimit = BudgetLimit { max_cost_usd: Some(1.0), max_tokens: None };

#[test]
fn a_reservation_that_does_not_fit_is_refused_with_the_numbers() {
    let fx = Fx::new();
    bill(&fx.store, "R-cont", 0.25, 100, 10);
    let Ok(Reservation::Held { id, before, .. }) =
        fx.store.reserve(&draft("R", 0.5, 0, ONE_DOLLAR))
    else {
        panic!("the first half dollar fits");
    };
    assert_eq!(before.spent, Spend { cost_usd: 0.25, tokens: 110 });
    let refused = fx.store.reserve(&draft("R", 0.5, 0, ONE_DOLLAR)).expect("reserve");
    let Reservation::Refused(status) = refused else { panic!("0.25 + 0.5 + 0.5 > 1") };
    assert_eq!(status.reserved.cost_usd, 0.5);
    assert_eq!(status.remaining().0, Some(0.25));
    // Settling returns the allowance; the run's ledger row now counts instead.
    bill(&fx.store, "R", 0.1, 10, 0);
    assert!(fx.store.settle(&id, &"settled".into()).expect("settle"));
    assert!(!fx.store.settle(&id, &"settled".into()).expect("settle twice"));
    let now =
        fx.store.budget_status("R", &["R".into(), "R-cont".into()], ONE_DOLLAR).expect("status");
    assert!((now.spent.cost_usd - 0.35).abs() < 1e-9 && now.reserved == Spend::default());
    assert!(matches!(
        fx.store.reserve(&draft("R", 0.5, 0, ONE_DOLLAR)),
        Ok(Reservation::Held { .. })
    ));
    // Other lineages are untouched.
    assert!(matches!(
        fx.store.reserve(&draft("other", 1.0, 0, ONE_DOLLAR)),
        Ok(Reservation::Held { .. })
    ));
}

#[test]
fn an_open_ended_reservation_takes_what_is_left() {
    let fx = Fx::new();
    bill(&fx.store, "O", 0.3, 0, 0);
    let mut d = draft("O", 0.1, 0, ONE_DOLLAR);
    d.maximum = None;
    let Ok(Reservation::Held { granted, .. }) = fx.store.reserve(&d) else { panic!("held") };
    assert!((granted.cost_usd - 0.7).abs() < 1e-9, "{granted:?}");
    assert!(matches!(fx.store.reserve(&d), Ok(Reservation::Refused(_))));
}

#[test]
fn token_limits_count_input_and_output() {
    let fx = Fx::new();
    let limit = BudgetLimit { max_cost_usd: None, max_tokens: Some(1000) };
    bill(&fx.store, "T", 0.0, 600, 300);
    assert!(matches!(fx.store.reserve(&draft("T", 0.0, 101, limit)), Ok(Reservation::Refused(_))));
    assert!(matches!(fx.store.reserve(&draft("T", 0.0, 100, limit)), Ok(Reservation::Held { .. })));
}

#[test]
fn two_writers_racing_for_the_last_dollar_one_wins() {
    for _ in 0..20 {
        let fx = Fx::new();
        let path = fx.dir.path().join("state.db");
        let a = Arc::new(super::fixture::open(&path, &fx.clock, Default::default()));
        let b = Arc::new(super::fixture::open(&path, &fx.clock, Default::default()));
        bill(&a, "L", 0.5, 0, 0);
        let gate = Arc::new(Barrier::new(2));
        let race = |s: Arc<Store>, g: Arc<Barrier>| {
            std::thread::spawn(move || {
                g.wait();
                s.reserve(&draft("L", 0.5, 0, ONE_DOLLAR)).expect("reserve")
            })
        };
        let ra = race(a.clone(), gate.clone());
        let rb = race(b.clone(), gate);
        let outcomes = [ra.join().expect("a"), rb.join().expect("b")];
        let held = outcomes.iter().filter(|o| matches!(o, Reservation::Held { .. })).count();
        assert_eq!(held, 1, "{outcomes:?}");
    }
}

#[test]
fn recovery_releases_the_reservations_of_dead_owners_only() {
    let fx = Fx::new();
    let Ok(Reservation::Held { .. }) = fx.store.reserve(&draft("D", 0.4, 0, ONE_DOLLAR)) else {
        panic!("held");
    };
    let mut alive = MockOwnerProbe::new();
    alive.expect_probe().returning(|_| Some(ProcessState::Alive { started_at: None }));
    assert_eq!(fx.store.release_abandoned_reservations(&alive).expect("release"), 0);
    let mut blind = MockOwnerProbe::new();
    blind.expect_probe().returning(|_| None);
    assert_eq!(fx.store.release_abandoned_reservations(&blind).expect("release"), 0);
    let mut dead = MockOwnerProbe::new();
    // The probe answers (so liveness can be told) and says the owner is gone.
    dead.expect_probe().returning(|_| Some(ProcessState::Dead));
    assert_eq!(fx.store.release_abandoned_reservations(&dead).expect("release"), 1);
    let status = fx.store.budget_status("D", &["D".into()], ONE_DOLLAR).expect("status");
    assert_eq!(status.reserved, Spend::default());
}

#[derive(Debug, Clone)]
enum Op {
    Reserve { store: usize, cents: u32 },
    Finish { pick: usize, used_pct: u32 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..2, 1u32..60).prop_map(|(store, cents)| Op::Reserve { store, cents }),
        (0usize..8, 0u32..=100).prop_map(|(pick, used_pct)| Op::Finish { pick, used_pct }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever the interleaving of reservations and settlements over two
    /// connections, with each run spending at most its allowance, the
    /// lineage never spends (nor holds) more than its limit.
    #[test]
    fn no_interleaving_overspends(ops in proptest::collection::vec(op(), 1..40)) {
        let fx = Fx::new();
        let path = fx.dir.path().join("state.db");
        let stores = [
            super::fixture::open(&path, &fx.clock, Default::default()),
            super::fixture::open(&path, &fx.clock, Default::default()),
        ];
        let mut open: Vec<(usize, String, f64)> = Vec::new();
        for op in ops {
            match op {
                Op::Reserve { store, cents } => {
                    let want = f64::from(cents) / 100.0;
                    if let Reservation::Held { id, .. } =
                        stores[store].reserve(&draft("P", want, 0, ONE_DOLLAR)).expect("reserve")
                    {
                        open.push((store, id, want));
                    }
                }
                Op::Finish { pick, used_pct } => {
                    if open.is_empty() {
                        continue;
                    }
                    let (store, id, allowance) = open.remove(pick % open.len());
                    bill(&stores[store], "P", allowance * f64::from(used_pct) / 100.0, 0, 0);
                    stores[store].settle(&id, &"settled".into()).expect("settle");
                }
            }
            let s = stores[0].budget_status("P", &["P".into()], ONE_DOLLAR).expect("status");
            prop_assert!(s.spent.cost_usd + s.reserved.cost_usd <= 1.0 + 1e-9, "{s:?}");
        }
    }
}

/// Failure injection at the clock seam: a clock that jumps back (NTP, a VM
/// restore) or reads garbage never revives, expires or loses a child.
#[test]
fn a_clock_that_goes_backwards_or_reads_garbage_changes_nothing_it_should_not() {
    use std::sync::Mutex;

    use retinue_core::{MockClock, RegistryRead, Retention};
    use retinue_store::StoreOptions;

    const T0: f64 = 1_800_000_000.0;
    let times = Arc::new(Mutex::new(vec![T0, T0]));
    let feed = times.clone();
    let mut clock = MockClock::new();
    clock.expect_now().returning(move || {
        let mut t = feed.lock().expect("times");
        if t.len() > 1 { t.remove(0) } else { t[0] }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions::default().with_clock(Arc::new(clock));
    let store = Store::open(dir.path().join("state.db"), opts).expect("open");
    let id = retinue_testkit::dispatch_and_retain(&store, "A");
    assert_eq!(store.list_retained_children().expect("list").len(), 1);
    // The clock jumps back a week: the child is neither expired nor revived,
    // and a prune has nothing to do.
    *times.lock().expect("times") = vec![T0 - 7.0 * 86_400.0];
    assert_eq!(store.list_retained_children().expect("list")[0].delegation_id, id);
    let pruned = store.prune_retained_children(None, None).expect("prune");
    assert_eq!((pruned.units, pruned.children), (0, 0));
    // A clock reading NaN never tombstones anything either.
    *times.lock().expect("times") = vec![f64::NAN];
    let pruned = store.prune_retained_children(None, None).expect("prune");
    assert_eq!((pruned.units, pruned.children), (0, 0));
    *times.lock().expect("times") = vec![T0];
    assert_eq!(store.list_retained_children().expect("list").len(), 1);
}

/// The typed usage columns (issue #25) agree with the core rule
/// (`UsageColumns`) for every row, whoever writes it: the triggers type a
/// row another writer inserts raw, hostile values included.
#[test]
fn typed_usage_columns_follow_the_core_rule_for_raw_rows() {
    let fx = Fx::new();
    let raw = fx.raw();
    let rows = [
        r#"{"cost_usd": 0.25, "tokens": {"input": 100, "output": 20}}"#,
        r#"{"cost_usd": "0.5", "tokens": {"input": "7", "output": true, "cache_read": 3, "cache_write": 2, "reasoning": 9}}"#,
        r#"{"cost_usd": -4, "tokens": {"input": -1, "output": {"x": 1}}}"#,
        r#"{"cost_usd": " 12abc", "tokens": {"input": "NaN"}}"#,
        r#"{not json"#,
        r#"[]"#,
    ];
    for (i, text) in rows.iter().enumerate() {
        raw.execute(
            "INSERT INTO delegation_child_usage (parent_session_id, parent_turn_id, \
             child_session_id, usage_json, created_at) VALUES ('HERMES', '', ?1, ?2, 1.0)",
            rusqlite::params![format!("c{i}"), text],
        )
        .expect("raw insert");
    }
    let mut stmt = raw
        .prepare(
            "SELECT u.usage_json, c.cost_usd, c.input_tokens, c.output_tokens, \
             c.cache_read_tokens, c.cache_write_tokens, c.reasoning_tokens \
             FROM delegation_child_usage u JOIN retinue_usage_columns c ON c.usage_id = u.id \
             ORDER BY u.id",
        )
        .expect("prepare");
    let typed: Vec<(String, [f64; 6])> = stmt
        .query_map([], |r| {
            Ok((r.get(0)?, [r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?]))
        })
        .expect("query")
        .collect::<rusqlite::Result<_>>()
        .expect("rows");
    assert_eq!(typed.len(), rows.len(), "every raw row is typed");
    for (text, got) in typed {
        let c = retinue_core::UsageColumns::of_json_text(Some(&text));
        let want = [
            c.cost_usd,
            c.input_tokens,
            c.output_tokens,
            c.cache_read_tokens,
            c.cache_write_tokens,
            c.reasoning_tokens,
        ];
        assert_eq!(got, want, "{text}");
    }
    // Spent is their sum: $0.75 + $12, 100 + 20 + 7 + 1 tokens.
    let limit = BudgetLimit { max_cost_usd: Some(100.0), max_tokens: None };
    let st = fx.store.budget_status("HERMES", &["HERMES".to_owned()], limit).expect("status");
    assert!((st.spent.cost_usd - 12.75).abs() < 1e-9, "{st:?}");
    assert_eq!(st.spent.tokens, 128, "{st:?}");
    // An update retypes the row; a delete drops it.
    raw.execute(
        "UPDATE delegation_child_usage SET usage_json = '{\"cost_usd\": 1}' \
         WHERE child_session_id = 'c0'",
        [],
    )
    .expect("update");
    raw.execute("DELETE FROM delegation_child_usage WHERE child_session_id = 'c3'", [])
        .expect("delete");
    let st = fx.store.budget_status("HERMES", &["HERMES".to_owned()], limit).expect("status");
    assert!((st.spent.cost_usd - 1.5).abs() < 1e-9, "{st:?}");
    assert_eq!(st.spent.tokens, 8, "{st:?}");
}
