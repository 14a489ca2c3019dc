//! Retinue against a `state.db` written by the real, published hermes-agent.
//!
//! Run by `cargo xtask interop` between the driver's `write` and `verify`
//! phases, with `RETINUE_INTEROP_DB` naming the hermes-written file. Every
//! test but one works on its own copy of the file as hermes left it; the
//! follow-up test writes the shared file (and a report) for `verify`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use retinue_config::DelegationConfig;
use retinue_core::{
    ChildManifest, Claims, DeliveryFilter, Message, NewSession, RegistryRead, SessionGraph,
    SessionStore, SystemClock, UnitLifecycle,
};
use retinue_delegate::{Delegator, DelegatorParts, ParentContext};
use retinue_interop::{
    BIN_ENV, DB_ENV, FRESH_REPORT_FILE, HermesExpect, REPORT_FILE, columns, integrity_check,
    query_i64, query_text, schema_objects, sibling, snapshot, table_counts,
};
use retinue_lineage::{Authority, Denial, LineageAuthority, RootError, lineage_chain, root};
use retinue_store::{Store, StoreOptions};
use retinue_testkit::scripted::{RecordingSink, ScriptedRuntime};
use serde_json::{Value, json};

/// A column as `PRAGMA table_info` shows it: (name, type, NOT NULL, default).
type ColumnDecl<'a> = (&'a str, &'a str, bool, Option<&'a str>);

/// Columns Retinue needs in hermes' tables, declared as its reconcile step
/// adds them when missing (semantics §2.2–2.4): (name, type, NOT NULL, default).
const RETINUE_COLUMNS: &[(&str, &[ColumnDecl<'static>])] = &[
    (
        "async_delegations",
        &[
            ("origin_session", "TEXT", false, None),
            ("origin_ui_session_id", "TEXT", true, Some("''")),
            ("parent_session_id", "TEXT", false, None),
            ("state", "TEXT", false, None),
            ("dispatched_at", "REAL", false, None),
            ("completed_at", "REAL", false, None),
            ("updated_at", "REAL", false, None),
            ("event_json", "TEXT", false, None),
            ("result_json", "TEXT", false, None),
            ("delivery_state", "TEXT", true, Some("'pending'")),
            ("delivery_attempts", "INTEGER", true, Some("0")),
            ("delivered_at", "REAL", false, None),
            ("owner_pid", "INTEGER", false, None),
            ("owner_started_at", "INTEGER", false, None),
            ("task_json", "TEXT", false, None),
            ("delivery_claim", "TEXT", false, None),
            ("delivery_claimed_at", "REAL", false, None),
            ("origin_session_id", "TEXT", false, None),
            ("child_session_id", "TEXT", false, None),
            ("children_json", "TEXT", false, None),
            ("retained", "INTEGER", false, None),
            ("retained_at", "REAL", false, None),
            ("tombstoned_at", "REAL", false, None),
            ("owner_profile", "TEXT", false, None),
            ("usage_json", "TEXT", false, None),
        ],
    ),
    (
        "sessions",
        &[
            ("source", "TEXT", false, None),
            ("model", "TEXT", false, None),
            ("model_config", "TEXT", false, None),
            ("parent_session_id", "TEXT", false, None),
            ("started_at", "REAL", false, None),
            ("ended_at", "REAL", false, None),
            ("end_reason", "TEXT", false, None),
            ("message_count", "INTEGER", false, Some("0")),
            ("tool_call_count", "INTEGER", false, Some("0")),
            ("profile_name", "TEXT", false, None),
            ("estimated_cost_usd", "REAL", false, None),
            ("cost_status", "TEXT", false, None),
            ("cost_source", "TEXT", false, None),
        ],
    ),
    (
        "messages",
        &[
            ("session_id", "TEXT", false, None),
            ("role", "TEXT", false, None),
            ("content", "TEXT", false, None),
            ("timestamp", "REAL", false, None),
            ("active", "INTEGER", true, Some("1")),
            ("tool_call_id", "TEXT", false, None),
            ("tool_calls", "TEXT", false, None),
            ("tool_name", "TEXT", false, None),
            ("token_count", "INTEGER", false, None),
            ("finish_reason", "TEXT", false, None),
        ],
    ),
];

/// Tables Retinue may create in a hermes file (the hermes-named ones only
/// when that hermes release lacks them).
const RETINUE_TABLES: &[&str] = &[
    "async_delegations",
    "delegation_child_usage",
    "refinery_schema_history",
    "retinue_adoption_queue",
    "retinue_approvals",
    "retinue_budget_members",
    "retinue_budget_reservations",
    "retinue_change_clock",
    "retinue_children",
    "retinue_clock_guard",
    "retinue_unit_controls",
    "retinue_unit_tombstones",
    "retinue_usage_columns",
    "retinue_usage_keys",
    "retinue_usage_totals",
];

/// How many migrations the store embeds: one history row each after an upgrade.
fn migration_count() -> i64 {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../store/migrations");
    let n = std::fs::read_dir(dir)
        .expect("the store's migrations")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".sql"))
        .count();
    i64::try_from(n).expect("count")
}

/// The shared, hermes-written database.
fn shared_db() -> PathBuf {
    match std::env::var_os(DB_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => panic!(
            "{DB_ENV} is not set: these tests need a state.db written by hermes-agent; \
             run them with `cargo xtask interop`"
        ),
    }
}

fn expect() -> &'static HermesExpect {
    static EXPECT: OnceLock<HermesExpect> = OnceLock::new();
    EXPECT.get_or_init(|| {
        HermesExpect::load(&shared_db()).unwrap_or_else(|e| panic!("driver expectations: {e}"))
    })
}

/// The file exactly as hermes left it, copied once before any test writes the shared one.
fn pristine() -> &'static Path {
    static PRISTINE: OnceLock<PathBuf> = OnceLock::new();
    PRISTINE.get_or_init(|| {
        let db = shared_db();
        assert!(
            !sibling(&db, REPORT_FILE).exists(),
            "{} has already been used by Retinue; rerun `cargo xtask interop` for a fresh one",
            db.display()
        );
        snapshot(&db, &sibling(&db, "rust-copies/pristine")).expect("pristine snapshot")
    })
}

/// A private copy of the pristine file.
fn copy(name: &str) -> PathBuf {
    let db = shared_db();
    snapshot(pristine(), &sibling(&db, &format!("rust-copies/{name}"))).expect("copy")
}

fn open(path: &Path) -> Arc<Store> {
    let opts = StoreOptions::default().with_clock(Arc::new(SystemClock));
    Arc::new(Store::open(path, opts).unwrap_or_else(|e| panic!("open {}: {e}", path.display())))
}

fn sid(name: &str) -> &'static str {
    expect().session(name).unwrap_or_else(|| panic!("the driver wrote no session `{name}`"))
}

/// Lines of an integrity check that are not about hermes' trigram FTS index.
///
/// hermes (on its Python's SQLite) indexes text up to the first NUL in its
/// `messages_fts_trigram` table, and structured contents start with NUL +
/// `json:`; newer SQLite re-tokenizes the whole text and reports that index
/// as malformed. That is hermes' file on another SQLite, not Retinue's doing.
fn non_trigram_problems(lines: &[String]) -> Vec<&String> {
    lines.iter().filter(|l| *l != "ok" && !l.contains("messages_fts_trigram")).collect()
}

#[test]
#[ignore = "needs the hermes wheel; run by cargo xtask interop"]
fn upgrade_keeps_every_row_and_object() {
    let path = copy("upgrade");
    let counts = table_counts(&path).expect("counts");
    assert_eq!(counts, expect().row_counts, "rusqlite and hermes count the same rows");
    let objects = schema_objects(&path).expect("schema");
    let tables: Vec<String> =
        objects.keys().filter_map(|k| k.strip_prefix("table ")).map(str::to_owned).collect();
    let cols: BTreeMap<String, _> =
        tables.iter().map(|t| (t.clone(), columns(&path, t).expect("columns"))).collect();
    let integrity = integrity_check(&path).expect("integrity");
    assert!(
        non_trigram_problems(&integrity).is_empty(),
        "hermes' file: {integrity:?} (hermes SQLite {})",
        expect().sqlite_version
    );
    if integrity != ["ok"] {
        eprintln!(
            "note: hermes' file (written on SQLite {}) fails this SQLite's integrity check \
             only in its trigram index: {integrity:?}",
            expect().sqlite_version
        );
    }
    assert_eq!(query_text(&path, "PRAGMA journal_mode").expect("mode"), "wal");

    drop(open(&path));

    // Every hermes row is still there; Retinue's own tables start empty,
    // but for the typed usage columns: one row per hermes ledger row.
    let after = table_counts(&path).expect("counts");
    for (table, n) in &counts {
        assert_eq!(after.get(table), Some(n), "rows of {table}");
    }
    let added: BTreeMap<_, _> = after.iter().filter(|(t, _)| !counts.contains_key(*t)).collect();
    let ledger_rows = counts.get("delegation_child_usage").copied().unwrap_or(0);
    for (table, n) in &added {
        assert!(RETINUE_TABLES.contains(&table.as_str()), "Retinue created table {table}");
        let want = match table.as_str() {
            "refinery_schema_history" => migration_count(),
            "retinue_usage_columns" => ledger_rows,
            // The web view's change counter: its one row (#35).
            "retinue_change_clock" => 1,
            _ => 0,
        };
        assert_eq!(**n, want, "rows of {table}");
    }
    for table in RETINUE_TABLES.iter().filter(|t| t.starts_with("retinue_")) {
        assert!(added.contains_key(&(*table).to_owned()), "{table} missing");
    }

    // Every hermes object is untouched except the tables Retinue adds columns to.
    let objects_after = schema_objects(&path).expect("schema");
    for (key, sql) in &objects {
        let altered = key
            .strip_prefix("table ")
            .is_some_and(|t| columns(&path, t).expect("columns").len() > cols[t].len());
        if !altered {
            assert_eq!(objects_after.get(key), Some(sql), "{key} changed");
        }
    }
    for key in objects_after.keys().filter(|k| !objects.contains_key(*k)) {
        let name = key.split_once(' ').map_or("", |(_, n)| n);
        assert!(
            name.starts_with("retinue_")
                || RETINUE_TABLES.contains(&name)
                || ["idx_delegation_child_usage_parent", "idx_async_delegations_delivery"]
                    .contains(&name),
            "Retinue created {key} in a hermes file"
        );
    }
    // Columns: hermes' columns keep their declarations, in order; Retinue
    // appends only the columns it needs that this release lacks, declared as
    // hermes declares them.
    for (table, before) in &cols {
        let now = columns(&path, table).expect("columns");
        assert_eq!(&now[..before.len()], &before[..], "columns of {table}");
        let appended: Vec<ColumnDecl<'_>> = now[before.len()..]
            .iter()
            .map(|c| (c.name.as_str(), c.decl_type.as_str(), c.not_null, c.default.as_deref()))
            .collect();
        let want: Vec<ColumnDecl<'_>> = RETINUE_COLUMNS
            .iter()
            .filter(|(t, _)| t == table)
            .flat_map(|(_, cs)| cs.iter().copied())
            .filter(|(name, ..)| !before.iter().any(|c| c.name.eq_ignore_ascii_case(name)))
            .collect();
        assert_eq!(appended, want, "columns Retinue added to {table}");
    }
    assert_eq!(
        query_i64(&path, "SELECT version FROM schema_version").expect("version"),
        expect().schema_version
    );
    assert_eq!(integrity_check(&path).expect("integrity"), integrity, "integrity after upgrade");
    assert_eq!(query_text(&path, "PRAGMA journal_mode").expect("mode"), "wal");

    // A second open changes nothing.
    drop(open(&path));
    assert_eq!(schema_objects(&path).expect("schema"), objects_after);
    assert_eq!(table_counts(&path).expect("counts"), after);
}

#[test]
#[ignore = "needs the hermes wheel; run by cargo xtask interop"]
fn lineage_agrees_with_hermes() {
    let path = copy("lineage");
    let store = open(&path);
    let ex = expect();
    let names = |ids: &[String]| {
        ids.iter().map(|i| ex.name_of(i).unwrap_or(i)).collect::<Vec<_>>().join(" > ")
    };
    let mut notes = Vec::new();
    for (name, id) in &ex.sessions {
        let hermes = &ex.lineage[name];
        match root(&*store, id) {
            Ok(r) => {
                let chain = lineage_chain(&*store, id).expect("chain");
                assert_eq!(chain.first(), Some(id));
                assert_eq!(chain.last(), Some(&r));
                // Retinue's ancestors are exactly hermes' compression ancestors.
                if let Some(hermes_ancestors) = &hermes.compression_ancestors {
                    let ancestors: BTreeSet<&str> = chain[1..]
                        .iter()
                        .map(|s| ex.name_of(s).expect("a driver session"))
                        .collect();
                    let hermes_ancestors: BTreeSet<&str> =
                        hermes_ancestors.iter().map(String::as_str).collect();
                    assert_eq!(ancestors, hermes_ancestors, "ancestors of {name}");
                }
                // Same conversation: hermes continues it to the same tip as from the root,
                // and Retinue's compression tip of the root is hermes' tip.
                let tip = store.compression_tip(&r).expect("tip");
                if let Some(hermes_tip) = &hermes.compression_tip {
                    let root_name = ex.name_of(&r).expect("root is a driver session");
                    assert_eq!(Some(hermes_tip), ex.lineage[root_name].compression_tip.as_ref());
                    assert_eq!(&tip, hermes_tip, "compression tip of {name}'s root");
                }
                // hermes' get_compression_lineage follows the oldest non-branch child,
                // delegate children included: where it differs, say so (not a failure).
                let mut conversation = lineage_chain(&*store, &tip).expect("chain of the tip");
                conversation.reverse();
                if let Some(hermes_lineage) =
                    hermes.compression_lineage.as_ref().filter(|l| **l != conversation)
                {
                    notes.push(format!(
                        "{name}: hermes get_compression_lineage [{}], Retinue's lineage [{}]",
                        names(hermes_lineage),
                        names(&conversation)
                    ));
                }
            }
            Err(e) => {
                // Sessions Retinue gives no root are not continued by hermes either,
                // nor are they the tip hermes continues any other session to.
                if let Some(hermes_tip) = &hermes.compression_tip {
                    assert_eq!(hermes_tip, id, "hermes continues {name}");
                    assert!(
                        !ex.lineage
                            .iter()
                            .any(|(other, l)| other != name
                                && l.compression_tip.as_ref() == Some(id)),
                        "hermes continues another session to {name}"
                    );
                }
                notes.push(format!("{name}: no root ({e})"));
            }
        }
    }
    let pinned: Vec<(&str, Result<String, RootError>)> = vec![
        ("root", Ok(sid("root").to_owned())),
        ("c1", Ok(sid("root").to_owned())),
        ("c2", Ok(sid("root").to_owned())),
        ("stranger", Ok(sid("stranger").to_owned())),
        ("branch", Err(RootError::Branch)),
        ("k1", Err(RootError::ForbiddenSource)),
        ("k2", Err(RootError::ForbiddenSource)),
        ("k3", Err(RootError::DelegateChild)),
    ];
    for (name, want) in pinned {
        assert_eq!(root(&*store, sid(name)), want, "root of {name}");
    }
    assert_eq!(
        lineage_chain(&*store, sid("c2")).expect("chain"),
        [sid("c2"), sid("c1"), sid("root")]
    );
    eprintln!("lineage notes:\n  {}", notes.join("\n  "));
}

fn delegator(store: &Arc<Store>, runtime: &Arc<ScriptedRuntime>) -> Delegator {
    Delegator::new(DelegatorParts {
        backend: retinue_core::Backend::of(store.clone()),
        authority: Arc::new(Authority::new(store.clone(), store.clone(), "")),
        runtime: runtime.clone(),
        completions: Some(Arc::new(RecordingSink::default())),
        config: DelegationConfig::default().into(),
        profile: String::new(),
    })
}

fn parent(id: &str) -> ParentContext {
    ParentContext { session_id: Some(id.to_owned()), ..ParentContext::default() }
}

fn transcript_json(store: &Store, id: &str) -> Vec<Value> {
    store
        .conversation(id)
        .expect("conversation")
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect()
}

fn write_json(path: &Path, value: &Value) {
    let text = serde_json::to_string_pretty(value).expect("json");
    std::fs::write(path, text + "\n").unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Retinue adopts hermes' finished batch `u1` (hermes 0.19 keeps no
/// manifest, so Retinue records it) and retains it; authority over hermes'
/// graph; the continuation `c2` follows up `k1`, which resumes on the session
/// and transcript hermes wrote. Returns the report entry of the appended turns.
fn adopt_and_follow_up(store: &Arc<Store>, tool: &Delegator, runtime: &ScriptedRuntime) -> Value {
    let ex = expect();
    let u1 = &ex.units["u1"];
    let k1 = &u1.children[0];

    // hermes 0.19 has no retention: its unit is a plain completed row.
    assert_eq!(store.list_retained_children().expect("list"), []);
    let manifests: Vec<ChildManifest> = u1
        .children
        .iter()
        .map(|c| ChildManifest {
            subagent_id: c.subagent_id.clone(),
            session_id: c.session_id.clone(),
            model: Some(c.model.clone()),
            goal: Some(c.goal.clone()),
            ..ChildManifest::default()
        })
        .collect();
    assert!(store.record_dispatched_children(&u1.delegation_id, &manifests).expect("manifest"));
    assert!(store.retain_completed_delegation(&u1.delegation_id, None).expect("retain"));
    let listed = store.list_retained_children().expect("list");
    assert_eq!(
        listed.iter().map(|c| c.child_session_id.as_str()).collect::<Vec<_>>(),
        [sid("k1"), sid("k2")]
    );
    assert!(
        listed
            .iter()
            .all(|c| c.parent_session_id == sid("c1")
                && c.state == retinue_core::UnitState::Completed)
    );

    // Authority over hermes' graph: the lineage may, everyone else may not.
    let authority = Authority::new(store.clone(), store.clone(), "");
    let entry = &listed[0];
    for ok in ["root", "c1", "c2"] {
        assert_eq!(authority.check_follow_up_authority(entry, Some(sid(ok))), Ok(()), "{ok}");
    }
    for no in ["branch", "stranger", "k2", "k3"] {
        let denial = authority.check_follow_up_authority(entry, Some(sid(no)));
        assert!(matches!(denial, Err(Denial::Lineage { .. })), "{no}: {denial:?}");
    }
    assert_eq!(
        authority.check_follow_up_authority(entry, Some(sid("k1"))),
        Err(Denial::SelfFollowUp)
    );

    // The branch is refused; the continuation c2 resumes k1 on its own transcript.
    let denied = tool.delegate_task(
        &json!({"goal": "quokka from the branch", "follow_up": k1.subagent_id}),
        Some(&parent(sid("branch"))),
    );
    assert!(denied["error"].as_str().is_some_and(|e| e.contains("not a running subagent")));
    let before = store.conversation(&k1.session_id).expect("conversation");
    let hermes_rows = &ex.transcripts["k1"];
    assert_eq!(
        before.iter().map(|m| m.id).collect::<Vec<_>>(),
        hermes_rows.iter().map(|m| m.id).collect::<Vec<_>>()
    );
    let goal = "quokka check: re-verify the db.connect audit";
    let out = tool.delegate_task(
        &json!({"goal": goal, "follow_up": k1.subagent_id}),
        Some(&parent(sid("c2"))),
    );
    assert_eq!(out["mode"], "follow_up", "{out}");
    assert_eq!(out["child_session_id"], k1.session_id.as_str());
    assert_eq!(out["delegation_id"], u1.delegation_id.as_str());
    assert_eq!(out["results"][0]["status"], "completed", "{out}");
    let runs = runtime.runs();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].spec.resume_session_id.as_deref(), Some(k1.session_id.as_str()));
    assert_eq!(runs[0].spec.subagent_id, k1.subagent_id);
    assert_eq!(runs[0].spec.model.as_deref(), Some(k1.model.as_str()));
    // hermes keeps the child's prompt in sessions.system_prompt, not in a message.
    let prompt = store.session(&k1.session_id).expect("row").expect("k1").system_prompt;
    assert!(prompt.as_deref().is_some_and(|p| p.starts_with("You are a focused subagent")));
    assert_eq!(runs[0].input.system_prompt, prompt);
    assert_eq!(
        runs[0].input.history.iter().map(|m| (m.id, m.role.as_str())).collect::<Vec<_>>(),
        hermes_rows.iter().map(|m| (m.id, m.role.as_str())).collect::<Vec<_>>()
    );
    let after = store.conversation(&k1.session_id).expect("conversation");
    assert_eq!(after[..before.len()], before[..], "hermes' turns are untouched");
    let appended = &after[before.len()..];
    assert_eq!(
        appended.iter().map(|m| (m.role.as_str(), m.content.as_deref())).collect::<Vec<_>>(),
        [("user", Some(goal)), ("assistant", Some(format!("Done: {goal}").as_str()))]
    );
    let k1_row = store.session(&k1.session_id).expect("row").expect("k1");
    assert!(k1_row.ended_at.is_some());
    let refreshed = store.find_retained_child(&k1.subagent_id).expect("find").expect("entry");
    assert!(refreshed.retained_at >= entry.retained_at);
    json!({
        "session_id": k1.session_id,
        "messages": appended.iter().map(|m| json!({"role": m.role, "content": m.content})).collect::<Vec<_>>(),
        "end_reason": k1_row.end_reason,
        "search_token": "quokka",
    })
}

/// Retinue delivers the completion hermes left pending on `u2`; returns its id.
fn deliver_hermes_completion(store: &Store) -> String {
    let u2 = &expect().units["u2"];
    let claim = store
        .claim_delivery(&DeliveryFilter {
            parent_session_id: Some(sid("c2").to_owned()),
            ..DeliveryFilter::default()
        })
        .expect("claim")
        .expect("hermes' pending completion");
    assert_eq!(claim.delegation_id, u2.delegation_id);
    assert_eq!(claim.event.raw["type"], "async_delegation");
    assert_eq!(claim.event.raw["summary"], "Summary for rollback: all three call sites updated.");
    assert!(store.ack_delivery(&claim.delegation_id, &claim.token).expect("ack"));
    u2.delegation_id.clone()
}

/// The shared file: Retinue adopts and follows up hermes' children, delivers
/// hermes' pending completion and spawns its own unit from hermes' live tip;
/// `verify` then checks all of it from hermes' side.
#[test]
#[ignore = "needs the hermes wheel; run by cargo xtask interop"]
fn hermes_child_is_followed_up_on_its_own_session() {
    pristine();
    let ex = expect();
    let db = shared_db();
    let store = open(&db);
    let runtime = Arc::new(ScriptedRuntime::new());
    let tool = delegator(&store, &runtime);
    let mut appended = Vec::new();
    let mut delivered = serde_json::Map::new();
    let mut billed_runs = 1.0;
    if ex.units.contains_key("u1") && ex.units.contains_key("u2") {
        appended.push(adopt_and_follow_up(&store, &tool, &runtime));
        delivered.insert(deliver_hermes_completion(&store), json!("delivered"));
        billed_runs += 1.0;
    } else {
        eprintln!(
            "note: hermes {} keeps no durable delegations: nothing to adopt or deliver",
            ex.hermes_version
        );
    }

    // Retinue's own delegation from hermes' live tip.
    let spawned = tool.delegate_task(
        &json!({"goal": "quokka census of the backup job"}),
        Some(&parent(sid("c2"))),
    );
    let result = &spawned["results"][0];
    assert_eq!(result["status"], "completed", "{spawned}");
    let new_unit = spawned["delegation_id"].as_str().expect("unit").to_owned();
    let new_child = result["child_session_id"].as_str().expect("child").to_owned();
    assert_eq!(
        store.session(&new_child).expect("row").expect("child").parent_session_id.as_deref(),
        Some(sid("c2"))
    );
    // Neither Retinue's child nor a follow-up moved hermes' compression tip.
    assert_eq!(store.compression_tip(sid("root")).expect("tip"), sid("c2"));
    // Every run is billed to the requester, c2 (0.01 USD each, scripted).
    let totals = retinue_usage::load_child_usage_totals(&*store, sid("c2")).expect("totals");
    assert!((totals.cost_usd - 0.01 * billed_runs).abs() < 1e-9, "{totals:?}");

    let report = json!({
        "appended": appended,
        "unit_delivery": delivered,
        "created_sessions": [{
            "session_id": new_child,
            "parent_session_id": sid("c2"),
            "messages": transcript_json(&store, &new_child),
        }],
        "units": [{"delegation_id": new_unit, "state": "completed", "delivery_state": "delivered"}],
    });
    drop(tool);
    drop(store);
    write_json(&sibling(&db, REPORT_FILE), &report);
}

/// A database Retinue creates from scratch, for hermes to adopt in `verify`.
#[test]
#[ignore = "needs the hermes wheel; run by cargo xtask interop"]
fn retinue_created_database_for_hermes() {
    let db = shared_db();
    let dir = sibling(&db, "retinue-first");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("clean");
    }
    let path = dir.join("state.db");
    let store = open(&path);
    let session = |id: &str, parent: Option<&str>| {
        store
            .create_session(&NewSession {
                id: id.to_owned(),
                source: "cli".to_owned(),
                model: Some("test/model".to_owned()),
                parent_session_id: parent.map(str::to_owned),
                ..NewSession::default()
            })
            .expect("session");
    };
    let say = |id: &str, role: &str, text: &str| {
        store
            .append_message(
                id,
                &Message {
                    role: role.to_owned(),
                    content: Some(text.to_owned()),
                    ..Message::default()
                },
            )
            .expect("append");
    };
    session("retinue-a", None);
    say("retinue-a", "user", "Count the wombats.");
    say("retinue-a", "assistant", "Delegating after compaction.");
    assert!(store.end_session("retinue-a", &retinue_core::EndReason::Compression).expect("end"));
    session("retinue-b", Some("retinue-a"));
    say("retinue-b", "user", "[CONTEXT COMPACTION] wombats");
    let runtime = Arc::new(ScriptedRuntime::new());
    let tool = delegator(&store, &runtime);
    let out = tool.delegate_task(&json!({"goal": "wombat census"}), Some(&parent("retinue-b")));
    let unit = out["delegation_id"].as_str().expect("unit").to_owned();
    let child = out["results"][0]["child_session_id"].as_str().expect("child").to_owned();
    let again = tool.delegate_task(
        &json!({"goal": "wombat recount", "follow_up": child}),
        Some(&parent("retinue-b")),
    );
    assert_eq!(again["mode"], "follow_up", "{again}");
    let sessions: Vec<Value> = ["retinue-a", "retinue-b", child.as_str()]
        .iter()
        .map(|id| json!({"session_id": id, "messages": transcript_json(&store, id)}))
        .collect();
    let tool_session = child_with_tool_turns(&store, "retinue-b");
    drop(tool);
    drop(store);
    write_json(
        &sibling(&db, FRESH_REPORT_FILE),
        &json!({
            "db": path,
            "sessions": sessions,
            "compression_tips": {"retinue-a": "retinue-b", "retinue-b": "retinue-b", (child.clone()): child},
            "units": [{"delegation_id": unit, "state": "completed"}],
            "search_token": "wombat",
            "tool_sessions": [tool_session],
        }),
    );
}

/// A Retinue child of `parent` that reads a file in its workspace through
/// the real runtime and toolbox (testkit's fake model scripts the call):
/// its session id and its rows as stored, tool fields included, for
/// hermes to read back in `verify`.
fn child_with_tool_turns(store: &Arc<Store>, parent_session: &str) -> Value {
    use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
    let ws = tempfile::tempdir().expect("workspace");
    std::fs::write(ws.path().join("wombats.txt"), "wombat count: 42\n").expect("file");
    let model = FakeModel::start();
    model.set_handler(|request| {
        let last = request.messages().last().cloned()?;
        Some(if last["role"] == "tool" {
            Reply::text("There are 42 wombats.").with_usage(Usage::new(30, 6))
        } else {
            Reply::tool_call("call_wombat_read", "read_file", json!({"path": "wombats.txt"}))
                .with_usage(Usage::new(20, 4))
        })
    });
    let config = retinue_runtime::RuntimeConfig::new(model.base_url(), "test/model")
        .with_api_key("sk-interop");
    let toolbox = Arc::new(retinue_tools::Toolbox::new(retinue_tools::ToolboxConfig::default()));
    let runtime = Arc::new(retinue_runtime::ChatRuntime::new(config, toolbox).expect("runtime"));
    let tool = Delegator::new(DelegatorParts {
        backend: retinue_core::Backend::of(store.clone()),
        authority: Arc::new(Authority::new(store.clone(), store.clone(), "")),
        runtime,
        completions: None,
        config: DelegationConfig::default().into(),
        profile: String::new(),
    });
    let ctx = ParentContext { workspace: Some(ws.path().to_path_buf()), ..parent(parent_session) };
    let out = tool.delegate_task(&json!({"goal": "count the wombats with tools"}), Some(&ctx));
    assert_eq!(out["results"][0]["status"], "completed", "{out}");
    let child = out["results"][0]["child_session_id"].as_str().expect("child").to_owned();
    let messages: Vec<Value> = store
        .conversation(&child)
        .expect("conversation")
        .iter()
        .map(|m| {
            json!({
                "role": m.role,
                "content": m.content,
                "tool_call_id": m.tool_call_id,
                "tool_name": m.tool_name,
                "tool_calls": m.tool_calls.as_deref().and_then(|t| serde_json::from_str::<Value>(t).ok()),
            })
        })
        .collect();
    let roles: Vec<&str> = messages.iter().filter_map(|m| m["role"].as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
    json!({"session_id": child, "messages": messages})
}

/// hermes wrote `k1`'s transcript with a tool call and its result; Retinue's
/// real runtime resumes it with each result right after its call, the
/// shape every OpenAI-compatible server accepts.
#[test]
#[ignore = "needs the hermes wheel; run by cargo xtask interop"]
fn a_hermes_transcript_with_tool_turns_resumes_on_the_wire() {
    use retinue_delegate::{ChildRuntime, ChildSpec, RunInput, TranscriptSink};
    use retinue_testkit::fake_model::{FakeModel, Reply};
    let ex = expect();
    let Some(u1) = ex.units.get("u1") else {
        eprintln!("note: hermes {} keeps no durable delegations", ex.hermes_version);
        return;
    };
    let k1 = &u1.children[0];
    let store = open(&copy("tool-turns"));
    let history: Vec<Message> = store
        .conversation(&k1.session_id)
        .expect("conversation")
        .into_iter()
        .filter(|m| m.role != "system")
        .collect();
    assert!(history.iter().any(|m| m.tool_calls.is_some()), "hermes wrote a tool call");
    assert!(history.iter().any(|m| m.role == "tool"), "hermes wrote a tool result");
    let model = FakeModel::start();
    model.push(Reply::text("resumed"));
    let config =
        retinue_runtime::RuntimeConfig::new(model.base_url(), "test/model").with_api_key("sk-x");
    let rt = retinue_runtime::ChatRuntime::new(config, Arc::new(retinue_runtime::NoTools))
        .expect("runtime");
    let spec = ChildSpec {
        subagent_id: k1.subagent_id.clone(),
        session_id: k1.session_id.clone(),
        resume_session_id: Some(k1.session_id.clone()),
        ..ChildSpec::default()
    };
    struct Discard;
    impl TranscriptSink for Discard {
        fn append(&self, _m: &Message) -> Result<(), retinue_delegate::SinkError> {
            Ok(())
        }
    }
    let handle = rt.build(&spec).expect("build");
    let input = RunInput { user_message: "and now?".into(), history, system_prompt: None };
    let out = rt.run(&handle, &input, &Discard, &retinue_core::run::RunContext::default());
    assert_eq!(out.final_response.as_deref(), Some("resumed"), "{out:?}");
    let sent = model.requests()[0].messages();
    for (i, m) in sent.iter().enumerate() {
        if let Some(calls) = m["tool_calls"].as_array() {
            for (j, call) in calls.iter().enumerate() {
                let result = &sent[i + 1 + j];
                assert_eq!(result["role"], "tool", "{sent:?}");
                assert_eq!(result["tool_call_id"], call["id"], "{sent:?}");
            }
        }
    }
    assert!(sent.iter().any(|m| m["role"] == "tool"), "{sent:?}");
    assert_eq!(sent.last().expect("last")["content"], "and now?");
}

/// `retinue lineage SESSION --db FILE --json` agrees with the library (and so with hermes).
#[test]
#[ignore = "needs the hermes wheel; run by cargo xtask interop"]
fn cli_lineage_agrees() {
    let Some(bin) = std::env::var_os(BIN_ENV).filter(|b| !b.is_empty()) else {
        eprintln!("note: {BIN_ENV} is not set; the `retinue lineage` comparison is skipped");
        return;
    };
    let path = copy("cli");
    let store = open(&path);
    for (name, id) in &expect().sessions {
        let out = Command::new(&bin)
            .args(["lineage", id, "--db"])
            .arg(&path)
            .arg("--json")
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", PathBuf::from(&bin).display()));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!(
                "retinue lineage {name}: not JSON ({e}), status {}, stdout {stdout:?}, stderr {:?}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        });
        assert_eq!(v["session_id"], id.as_str(), "{name}: {v}");
        match lineage_chain(&*store, id) {
            Ok(chain) => {
                assert!(out.status.success(), "{name}: {}", out.status);
                assert_eq!(v["root"], json!(chain.last()), "{name}: {v}");
                assert_eq!(v["chain"], json!(chain), "{name}: {v}");
            }
            Err(_) => assert_eq!(v["root"], Value::Null, "{name}: {v}"),
        }
    }
}

/// Issue #22: hermes's `async_delegation` module may create its table before
/// any `SessionDB` exists; Retinue adopts that file as hermes's (every row
/// kept), and hermes keeps using it (`early-verify`).
#[test]
#[ignore = "needs the hermes wheel; run by cargo xtask interop"]
fn a_file_hermes_delegations_wrote_first_is_adopted() {
    let Some(path) = std::env::var_os("RETINUE_INTEROP_EARLY_DB").map(PathBuf::from) else {
        panic!("RETINUE_INTEROP_EARLY_DB is not set: run `cargo xtask interop`");
    };
    if !path.exists() {
        eprintln!("note: this hermes release writes no durable delegations; nothing to adopt");
        return;
    }
    let before = table_counts(&path).expect("counts");
    assert!(!before.contains_key("sessions"), "{before:?}");
    drop(open(&path));
    let after = table_counts(&path).expect("counts");
    assert_eq!(after.get("async_delegations"), before.get("async_delegations"));
    assert!(after.contains_key("sessions"), "{after:?}");
}
