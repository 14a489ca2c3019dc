//! `import_state_db`: a state.db written by the SQLite backend copies into
//! PostgreSQL, reads the same through the traits, and a rerun copies nothing.

use std::sync::Arc;

use retinue_core::{
    AttributionDraft, Message, NewSession, RegistryRead, SessionStore, TotalsUpdate, UsageLedger,
    UsageTotals,
};
use retinue_store_pg::{PgOptions, PgStore};
use retinue_testkit::{T0, TempHome, dispatch_and_retain, manual_clock};

#[test]
fn a_state_db_migrates_idempotently_and_reads_the_same() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL migrate tests") else { return };
    let home = TempHome::new();
    let clock = manual_clock(T0);
    let sqlite = home.open_store(clock.clone());
    sqlite
        .create_session(&NewSession {
            id: "P".into(),
            source: "cli".into(),
            ..NewSession::default()
        })
        .expect("parent");
    let unit = dispatch_and_retain(&sqlite, "P");
    let child = NewSession {
        id: "child-sess-1".into(),
        source: "delegate".into(),
        parent_session_id: Some("P".into()),
        ..NewSession::default()
    };
    sqlite.create_session(&child).expect("child session");
    let structured = "\u{0}json:[1]".to_owned();
    for content in ["hello", structured.as_str()] {
        sqlite
            .append_message(
                "child-sess-1",
                &Message {
                    role: "user".into(),
                    content: Some(content.into()),
                    ..Message::default()
                },
            )
            .expect("message");
    }
    let draft = AttributionDraft {
        parent_session_id: "P".into(),
        usage: serde_json::json!({"cost_usd": 0.75}),
        key: Some("k".into()),
        ..AttributionDraft::default()
    };
    let delta = TotalsUpdate {
        delta: UsageTotals { cost_usd: 0.75, input_tokens: 10.0, output_tokens: 1.0 },
        catch_up: None,
    };
    assert!(sqlite.record_usage(&draft, &delta).expect("ledger"));

    // The child belongs to P's budget tree (issue #23).
    retinue_core::Budgets::join_budget(&sqlite, "P", &["child-sess-1".to_owned()])
        .expect("budget member");

    let schema = format!("mig_{}", std::process::id());
    let _ = PgStore::drop_schema(&url, &schema);
    let pg = Arc::new(
        PgStore::open(&url, PgOptions::default().with_clock(clock.clone()).with_schema(&schema))
            .expect("open"),
    );
    let report =
        pg.import_state_db(&home.db_path(), &retinue_store::StateDbReader).expect("migrate");
    assert_eq!(report.tables["async_delegations"], (1, 1));
    assert_eq!(report.tables["messages"], (2, 2));
    assert_eq!(report.tables["delegation_child_usage"], (1, 1));
    assert!((report.ledger_cost_usd - 0.75).abs() < 1e-9);
    let again =
        pg.import_state_db(&home.db_path(), &retinue_store::StateDbReader).expect("migrate again");
    assert!(again.tables.values().all(|(_, copied)| *copied == 0), "{again:?}");

    assert_eq!(
        pg.list_retained_children().expect("pg"),
        sqlite.list_retained_children().expect("sqlite")
    );
    assert!(pg.find_retained_child(&unit).expect("find").is_some());
    assert_eq!(
        retinue_core::Budgets::budget_root_of(&*pg, "child-sess-1").expect("root").as_deref(),
        Some("P"),
        "the budget tree came along"
    );
    assert_eq!(
        pg.conversation("child-sess-1").expect("pg"),
        sqlite.conversation("child-sess-1").expect("sqlite")
    );
    assert_eq!(
        pg.usage_totals_snapshot("P").expect("pg"),
        sqlite.usage_totals_snapshot("P").expect("sqlite")
    );
    // The key came along: the same attribution is not billed twice after the move.
    assert!(!pg.record_usage(&draft, &delta).expect("ledger"));
    // New ledger rows and messages get fresh ids after the copied ones.
    let id = pg
        .append_message("child-sess-1", &Message { role: "user".into(), ..Message::default() })
        .expect("append");
    assert!(id > 2);
    drop(pg);
    PgStore::drop_schema(&url, &schema).expect("drop");
}

/// A hermes home's units (keyed by the home's path, hermes's profile key)
/// join the explicit tenant they are migrated into; units of another
/// profile and of the empty profile copy as they are.
#[test]
fn a_home_migrates_into_an_explicit_tenant() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL migrate tests") else { return };
    let home = TempHome::new();
    let clock = manual_clock(T0);
    let key = retinue_core::default_profile_key(home.path());
    let sqlite = home.open_store_as(clock.clone(), &key);
    let child = |sa: &str| retinue_core::ChildManifest {
        subagent_id: sa.into(),
        session_id: format!("cs-{sa}"),
        ..retinue_core::ChildManifest::default()
    };
    let mine = retinue_testkit::retain_unit(&sqlite, "P", &key, vec![child("sa-mine")]);
    let other = retinue_testkit::retain_unit(&sqlite, "P", "other", vec![child("sa-other")]);
    let shared = retinue_testkit::retain_unit(&sqlite, "P", "", vec![child("sa-shared")]);

    let schema = format!("mig_tenant_{}", std::process::id());
    let _ = PgStore::drop_schema(&url, &schema);
    let pg = PgStore::open(
        &url,
        PgOptions::default().with_clock(clock.clone()).with_schema(&schema).with_profile("acme"),
    )
    .expect("open");
    let report =
        pg.import_state_db(&home.db_path(), &retinue_store::StateDbReader).expect("migrate");
    assert_eq!(report.rekeyed, Some((key.clone(), 1)));
    let profile_of = |id: &str| {
        pg.find_retained_child(id).expect("find").map(|e| e.owner_profile).unwrap_or_default()
    };
    assert_eq!(profile_of(&mine), "acme");
    assert_eq!(profile_of(&other), "other");
    assert_eq!(profile_of(&shared), "");
    // A rerun copies nothing and re-keys nothing already copied.
    let again = pg.import_state_db(&home.db_path(), &retinue_store::StateDbReader).expect("again");
    assert!(again.tables.values().all(|(_, copied)| *copied == 0), "{again:?}");
    assert_eq!(profile_of(&mine), "acme");
    drop(pg);
    // Without a tenant, profiles copy as stored.
    let _ = PgStore::drop_schema(&url, &schema);
    let pg = PgStore::open(&url, PgOptions::default().with_clock(clock).with_schema(&schema))
        .expect("open");
    assert_eq!(
        pg.import_state_db(&home.db_path(), &retinue_store::StateDbReader)
            .expect("migrate")
            .rekeyed,
        None
    );
    assert_eq!(pg.find_retained_child(&mine).expect("find").map(|e| e.owner_profile), Some(key));
    drop(pg);
    PgStore::drop_schema(&url, &schema).expect("drop");
}

/// A state.db exactly as hermes-agent writes it (never opened by Retinue:
/// no Retinue tables, hermes's nullable columns such as
/// `origin_session_id` left NULL, legacy units) migrates: a NULL where this
/// schema has a default takes the default. A NULL where a value is
/// required is refused with the row named, and nothing is copied.
#[test]
fn a_hermes_written_state_db_migrates() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL migrate tests") else { return };
    let home = TempHome::new();
    let fx = retinue_testkit::HermesDb::standard(&home.db_path(), T0);
    home.exec("UPDATE async_delegations SET origin_session_id = NULL");
    let units = retinue_testkit::HermesDb::table_rows(&home.db_path(), "async_delegations").len();
    let schema = format!("mig_hermes_{}", std::process::id());
    let _ = PgStore::drop_schema(&url, &schema);
    let pg =
        PgStore::open(&url, PgOptions::default().with_clock(manual_clock(T0)).with_schema(&schema))
            .expect("open");
    let report = pg
        .import_state_db(&home.db_path(), &retinue_store::StateDbReader)
        .expect("a hermes file migrates");
    assert_eq!(report.tables["async_delegations"], (units, units));
    assert!(pg.lookup(fx.root).is_ok());
    drop(pg);
    PgStore::drop_schema(&url, &schema).expect("drop");

    // A required value unreadable (a time that is not a number): refused,
    // the row named, nothing copied.
    home.exec(
        "UPDATE sessions SET started_at = 'not a time' WHERE id = (SELECT min(id) FROM sessions)",
    );
    let pg =
        PgStore::open(&url, PgOptions::default().with_clock(manual_clock(T0)).with_schema(&schema))
            .expect("open");
    let err = pg
        .import_state_db(&home.db_path(), &retinue_store::StateDbReader)
        .expect_err("an unreadable time is refused");
    let text = err.to_string();
    assert!(text.contains("sessions row") && text.contains("`started_at` is NULL"), "{text}");
    assert!(pg.list_retained_children().expect("list").is_empty(), "nothing copied");
    drop(pg);
    PgStore::drop_schema(&url, &schema).expect("drop");
}

/// Issue #22: a rerun carries what changed in the source since (a tombstone
/// made after the first run), and ids never collide with rows team mode
/// wrote in between; every rerun verifies.
#[test]
fn a_rerun_carries_later_changes_and_ids_never_collide() {
    use retinue_core::{Lookup, Retention, TombstoneReason};
    let Some(url) = retinue_testkit::pg_url("PostgreSQL migrate tests") else { return };
    let home = TempHome::new();
    let clock = manual_clock(T0);
    let sqlite = home.open_store(clock.clone());
    sqlite
        .create_session(&NewSession {
            id: "P".into(),
            source: "cli".into(),
            ..NewSession::default()
        })
        .expect("parent");
    let first = dispatch_and_retain(&sqlite, "P");
    let second = dispatch_and_retain(&sqlite, "P");
    let say = |store: &dyn SessionStore, text: &str| {
        store
            .append_message(
                "P",
                &Message { role: "user".into(), content: Some(text.into()), ..Message::default() },
            )
            .expect("message")
    };
    say(&sqlite, "one");
    let bill = |ledger: &dyn UsageLedger, cost: f64| {
        let draft = AttributionDraft {
            parent_session_id: "P".into(),
            usage: serde_json::json!({"cost_usd": cost}),
            ..AttributionDraft::default()
        };
        let delta = TotalsUpdate {
            delta: UsageTotals { cost_usd: cost, input_tokens: 0.0, output_tokens: 0.0 },
            catch_up: None,
        };
        assert!(ledger.record_usage(&draft, &delta).expect("ledger"));
    };
    bill(&sqlite, 0.5);

    let schema = format!("mig2_{}", std::process::id());
    let _ = PgStore::drop_schema(&url, &schema);
    let pg = Arc::new(
        PgStore::open(&url, PgOptions::default().with_clock(clock.clone()).with_schema(&schema))
            .expect("open"),
    );
    pg.import_state_db(&home.db_path(), &retinue_store::StateDbReader).expect("first run");
    // Team mode writes: the next message and ledger ids are taken in PostgreSQL.
    say(&*pg, "written in team mode");
    bill(&*pg, 0.25);
    // Meanwhile the source changes: a tombstone, a message, a ledger row.
    assert!(
        sqlite
            .tombstone_retained_child(&first, &TombstoneReason::Other("done with it".into()))
            .expect("tombstone")
    );
    say(&sqlite, "two");
    bill(&sqlite, 0.125);

    let report = pg
        .import_state_db(&home.db_path(), &retinue_store::StateDbReader)
        .expect("a rerun verifies");
    assert_eq!(report.tables["messages"].1, 1, "{report:?}");
    assert_eq!(report.tables["delegation_child_usage"].1, 1, "{report:?}");
    assert_eq!(report.remapped, 2, "both new source ids were taken: {report:?}");
    assert!(
        matches!(pg.lookup(&first).expect("lookup"), Lookup::NotAddressable(..)),
        "the tombstone made after the first run was not carried"
    );
    assert!(matches!(pg.lookup(&second).expect("lookup"), Lookup::Addressable(_)));
    let texts: Vec<String> =
        pg.conversation("P").expect("conversation").into_iter().filter_map(|m| m.content).collect();
    for want in ["one", "written in team mode", "two"] {
        assert_eq!(texts.iter().filter(|t| t.as_str() == want).count(), 1, "{texts:?}");
    }
    let totals = retinue_usage_totals(&pg);
    assert!((totals - 0.875).abs() < 1e-9, "ledger after the rerun: {totals}");
    // A third run has nothing new and still verifies.
    let again =
        pg.import_state_db(&home.db_path(), &retinue_store::StateDbReader).expect("third run");
    assert!(again.tables.values().all(|(_, new)| *new == 0), "{again:?}");
    assert_eq!(again.remapped, 0);
    drop(pg);
    PgStore::drop_schema(&url, &schema).expect("drop");
}

/// The ledger total of `P` as the usage crate folds it (maintained totals
/// plus the rows they do not cover yet).
fn retinue_usage_totals(pg: &PgStore) -> f64 {
    let snap = pg.usage_totals_snapshot("P").expect("snapshot");
    snap.pending.iter().fold(snap.maintained.cost_usd, |acc, p| {
        acc + serde_json::from_str::<serde_json::Value>(&p.usage_json)
            .ok()
            .and_then(|v| v["cost_usd"].as_f64())
            .unwrap_or(0.0)
    })
}

/// A migration into one tenant counts every tenant's live units exactly:
/// the copied units of another profile over that profile's cap are ranked
/// (the oldest is beyond the cap) instead of read as within it, which a
/// live count left too low would do (failing open).
#[test]
fn a_migration_counts_every_tenants_live_units() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL migrate tests") else { return };
    let home = TempHome::new();
    let clock = manual_clock(T0);
    let sqlite = home.open_store(clock.clone());
    let child = |sa: &str| retinue_core::ChildManifest {
        subagent_id: sa.into(),
        session_id: format!("cs-{sa}"),
        ..retinue_core::ChildManifest::default()
    };
    let mut theirs = Vec::new();
    for i in 0..3 {
        clock.advance(1.0);
        theirs.push(retinue_testkit::retain_unit(
            &sqlite,
            "P",
            "other",
            vec![child(&format!("sa-o{i}"))],
        ));
    }
    let schema = format!("mig_count_{}", std::process::id());
    let _ = PgStore::drop_schema(&url, &schema);
    let pg = PgStore::open(
        &url,
        PgOptions::default().with_clock(clock.clone()).with_schema(&schema).with_profile("acme"),
    )
    .expect("open");
    pg.import_state_db(&home.db_path(), &retinue_store::StateDbReader).expect("migrate");
    drop(pg);
    // The other tenant, with a cap of 2: its oldest unit is beyond it.
    let retention = retinue_core::RetentionPolicy {
        max_retained: 2,
        ..retinue_core::RetentionPolicy::default()
    };
    let other = PgStore::open(
        &url,
        PgOptions::default()
            .with_clock(clock)
            .with_schema(&schema)
            .with_profile("other")
            .with_retention(retention),
    )
    .expect("open as the other tenant");
    assert!(matches!(
        other.lookup("sa-o0").expect("lookup"),
        retinue_core::Lookup::NotAddressable(
            _,
            retinue_core::Unaddressable::Tombstoned {
                reason: retinue_core::TombstoneReason::Cap,
                ..
            }
        )
    ));
    for sa in ["sa-o1", "sa-o2"] {
        assert!(other.find_retained_child(sa).expect("find").is_some(), "{sa}");
    }
    let listed: Vec<String> =
        other.list_retained_children().expect("list").into_iter().map(|e| e.subagent_id).collect();
    assert_eq!(listed, ["sa-o2", "sa-o1"]);
    drop(other);
    PgStore::drop_schema(&url, &schema).expect("drop");
}
