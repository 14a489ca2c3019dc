//! Team mode end to end: the `retinue` binary against PostgreSQL
//! (`RETINUE_PG_URL`, which `cargo xtask test` sets, starting a throwaway
//! cluster). Each test works in a scratch schema, selected through the
//! connection string's `options=-csearch_path=…`. Without a URL the tests
//! fail under CI or `RETINUE_REQUIRE_PG`, and skip loudly otherwise.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use retinue_store_pg::{PgOptions, PgStore};
use retinue_testkit::TempHome;
use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_retinue");

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A scratch schema (created and migrated), dropped at the end.
struct Scratch {
    url: String,
    schema: String,
    /// The URL the CLI gets: the server's, with the scratch schema as search path.
    cli_url: String,
}

impl Scratch {
    fn new(url: &str) -> Scratch {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let schema =
            format!("cli_{}_{}_{nanos}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let store = PgStore::open(url, PgOptions::default().with_schema(&schema))
            .expect("create the scratch schema");
        store.retire().expect("retire");
        let sep = if url.contains('?') { '&' } else { '?' };
        let cli_url = format!("{url}{sep}options=-csearch_path%3D{schema}");
        Scratch { url: url.to_owned(), schema, cli_url }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = PgStore::drop_schema(&self.url, &self.schema) {
            eprintln!("could not drop schema {}: {e}", self.schema);
        }
    }
}

/// A child model that answers "Done: <first line>", $0.01 and 120 tokens a run.
fn done_model() -> FakeModel {
    let model = FakeModel::start();
    model.set_handler(|request| {
        let messages = request.messages();
        let last = messages.iter().rev().find(|m| m["role"] == "user")?;
        let first = last["content"].as_str().unwrap_or_default().lines().next().unwrap_or_default();
        Some(Reply::text(&format!("Done: {first}")).with_usage(Usage::new(100, 20).cost(0.01)))
    });
    model
}

fn write_config(home: &Path, model: &FakeModel, extra: &str) {
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test-secret\n{extra}",
        model.base_url()
    );
    std::fs::write(home.join("config.yaml"), yaml).expect("config.yaml");
}

/// One `retinue` process ("host") on `home`, with `--json` and `args`.
fn run(home: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("--home")
        .arg(home)
        .arg("--json")
        .args(args)
        .env_remove("HERMES_HOME")
        .env_remove("HERMES_PROFILE")
        .output()
        .expect("run retinue")
}

/// Runs and checks the exit code; the JSON on stdout.
fn expect(code: i32, home: &Path, args: &[&str]) -> Value {
    let out = run(home, args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{args:?}\nstdout: {stdout}\nstderr: {stderr}");
    serde_json::from_str(&stdout).unwrap_or(Value::Null)
}

fn s<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    path.iter().fold(v, |v, k| &v[*k]).as_str().unwrap_or_default()
}

/// Every main command against PostgreSQL; a child spawned by one host
/// (its own home, same profile) is followed up by another.
#[test]
fn team_mode_commands_across_two_hosts() {
    let Some(url) = retinue_testkit::pg_url("team-mode CLI tests") else { return };
    let scratch = Scratch::new(&url);
    let db = scratch.cli_url.as_str();
    let model = done_model();
    let (host_a, host_b) = (TempHome::new(), TempHome::new());
    write_config(host_a.path(), &model, "");
    write_config(host_b.path(), &model, "");
    let (a, b) = (host_a.path(), host_b.path());
    let team = ["--db", db, "--profile", "team"];
    fn with_team(team: &[&str], args: &[&str]) -> Vec<String> {
        team.iter().chain(args).map(|s| (*s).to_owned()).collect()
    }
    let with = |args: &[&str]| with_team(&team, args);
    let call = |code: i32, home: &Path, args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        expect(code, home, &refs)
    };

    // Host A spawns a child.
    let spawned = call(0, a, with(&["delegate", "--goal", "write the plan"]));
    let result = &spawned["results"][0];
    assert_eq!(result["status"], "completed", "{spawned}");
    let parent = s(&spawned, &["parent_session_id"]).to_owned();
    let child = result["subagent_id"].as_str().expect("subagent id").to_owned();
    assert!(!parent.is_empty(), "{spawned}");

    // Host B sees it, with the same profile and a different home.
    let list = call(0, b, with(&["children", "list"]));
    assert!(list.as_array().is_some_and(|l| l.iter().any(|c| c["child_id"] == child.as_str())));
    let shown = call(0, b, with(&["children", "show", &child]));
    assert_eq!(shown["parent_session_id"], parent.as_str());
    assert_eq!(shown["owner_profile"], "team");
    let allowed = call(0, b, with(&["authority", &child, "--caller", &parent]));
    assert_eq!(allowed["allowed"], true);
    let lineage = call(0, b, with(&["lineage", &parent]));
    assert_eq!(lineage["root"], parent.as_str());

    // Another tenant's child is missing (exit 4, #35), never "denied (profile)".
    let other = ["--db", db, "--profile", "other", "authority", &child, "--caller", &parent];
    assert_eq!(expect(4, b, &other)["code"], "not_found");

    // Host B follows the child up.
    let follow = call(
        0,
        b,
        with(&["delegate", "--parent", &parent, "--follow-up", &child, "--goal", "and the tests"]),
    );
    assert_eq!(follow["mode"], "follow_up", "{follow}");
    assert_eq!(follow["results"][0]["status"], "completed", "{follow}");

    // One ledger: both runs are billed to the parent.
    let usage = call(0, a, with(&["usage", &parent, "--lineage"]));
    assert_eq!(usage["records"].as_array().map(Vec::len), Some(2), "{usage}");
    assert!((usage["totals"]["cost_usd"].as_f64().unwrap_or(0.0) - 0.02).abs() < 1e-9);

    // Recovery from any host: nothing is abandoned (every command gave its lease up cleanly).
    let recovered = call(0, b, with(&["recover"]));
    assert_eq!(recovered["abandoned"], 0, "{recovered}");
    assert_eq!(recovered["retained"], 1, "{recovered}");

    // Tombstone on A, gone on B; prune runs.
    call(0, a, with(&["children", "tombstone", &child, "--reason", "done"]));
    let gone =
        run(b, &with(&["children", "show", &child]).iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(gone.status.code(), Some(4));
    let pruned = call(0, b, with(&["children", "prune"]));
    assert_eq!(pruned["tombstoned"], 0);
    drop(scratch);
}

/// `database.url` and `database.profile` in config.yaml select team mode
/// without `--db`; without any profile the command is refused (exit 2)
/// and the password never shows.
#[test]
fn database_url_in_config_and_explicit_profile() {
    let Some(url) = retinue_testkit::pg_url("team-mode CLI tests") else { return };
    let scratch = Scratch::new(&url);
    let home = TempHome::new();
    let yaml = format!("database:\n  url: \"{}\"\n  profile: team\n", scratch.cli_url);
    std::fs::write(home.path().join("config.yaml"), yaml).expect("config.yaml");
    let list = expect(0, home.path(), &["children", "list"]);
    assert_eq!(list, Value::Array(Vec::new()));
    assert!(!home.path().join("state.db").exists(), "team mode creates no state.db");

    // A URL with a password and no profile anywhere: refused, redacted.
    let secret = "postgres://retinue:hunter2@127.0.0.1:1/retinue";
    std::fs::write(home.path().join("config.yaml"), format!("database:\n  url: {secret}\n"))
        .expect("config.yaml");
    for args in [&["children", "list"][..], &["recover"][..], &["--db", secret, "usage", "x"][..]] {
        let out = run(home.path(), args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("needs an explicit profile"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
    }
    // An unreachable server: a plain error (exit 1), the password still never shown.
    let out = run(home.path(), &["--profile", "team", "children", "list"]);
    assert_eq!(out.status.code(), Some(1));
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!text.contains("hunter2"), "{text}");
    drop(scratch);
}

/// The lineage budget holds on PostgreSQL: once the $0.01 is spent, the
/// next run of the lineage is refused with the numbers.
#[test]
fn budget_refusal_on_postgres() {
    let Some(url) = retinue_testkit::pg_url("team-mode CLI tests") else { return };
    let scratch = Scratch::new(&url);
    let model = done_model();
    let home = TempHome::new();
    write_config(home.path(), &model, "  budget:\n    max_cost_usd: 0.01\n");
    let h = home.path();
    let db = scratch.cli_url.as_str();
    let first = expect(0, h, &["--db", db, "--profile", "team", "delegate", "--goal", "spend it"]);
    assert_eq!(first["results"][0]["status"], "completed", "{first}");
    let parent = s(&first, &["parent_session_id"]).to_owned();
    let out = run(
        h,
        &["--db", db, "--profile", "team", "delegate", "--parent", &parent, "--goal", "more"],
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert_ne!(v["results"][0]["status"], "completed", "{v}");
    let why = v["error"].as_str().or_else(|| v["results"][0]["error"].as_str());
    assert!(why.is_some_and(|w| w.contains("budget") || w.contains("Budget")), "{v}");
    let usage = expect(0, h, &["--db", db, "--profile", "team", "usage", &parent, "--lineage"]);
    assert!(usage["totals"]["cost_usd"].as_f64().unwrap_or(f64::NAN) <= 0.01 + 1e-9, "{usage}");
    assert!(usage["budget"].is_object(), "{usage}");
    drop(scratch);
}

/// A hermes home migrated with `--profile` joins that tenant: its children
/// (keyed by the home's path in the state.db) are followed up in team mode
/// under the explicit profile; another tenant is still denied.
#[test]
fn migrate_into_a_tenant_then_follow_up() {
    use retinue_core::{NewSession, SessionStore};
    let Some(url) = retinue_testkit::pg_url("team-mode CLI tests") else { return };
    let scratch = Scratch::new(&url);
    let home = TempHome::new();
    let key = retinue_core::default_profile_key(home.path());
    {
        // The real clock: the CLI judges TTLs at the real time.
        let store = home.open_store_with(retinue_store::StoreOptions::default().with_profile(&key));
        store
            .create_session(&NewSession {
                id: "P".into(),
                source: "cli".into(),
                ..NewSession::default()
            })
            .expect("parent");
        retinue_testkit::retain_unit(
            &store,
            "P",
            &key,
            vec![retinue_core::ChildManifest {
                subagent_id: "sa-home".into(),
                session_id: "cs-home".into(),
                ..retinue_core::ChildManifest::default()
            }],
        );
    }
    let h = home.path();
    let migrated = expect(0, h, &["--profile", "acme", "migrate", "--to", &scratch.cli_url]);
    assert_eq!(migrated["profile"]["to"], "acme", "{migrated}");
    assert_eq!(migrated["profile"]["from"], key.as_str(), "{migrated}");
    assert_eq!(migrated["profile"]["units"], 1, "{migrated}");
    let db = scratch.cli_url.as_str();
    let allowed =
        expect(0, h, &["--db", db, "--profile", "acme", "authority", "sa-home", "--caller", "P"]);
    assert_eq!(allowed["allowed"], true, "{allowed}");
    let foreign =
        expect(4, h, &["--db", db, "--profile", "other", "authority", "sa-home", "--caller", "P"]);
    assert_eq!(foreign["code"], "not_found", "{foreign}");
    drop(scratch);
}

/// Issue #22: in team mode one tenant can neither see nor touch another's
/// children (its ids answer exactly as missing ones), nor evict them with
/// its own limits; `--all-profiles` is the operator's explicit view.
#[test]
fn tenants_cannot_touch_each_other() {
    let Some(url) = retinue_testkit::pg_url("team-mode CLI tests") else { return };
    let scratch = Scratch::new(&url);
    let db = scratch.cli_url.as_str();
    let model = done_model();
    let (acme_home, other_home) = (TempHome::new(), TempHome::new());
    write_config(acme_home.path(), &model, "");
    // The other tenant's worker keeps one retained unit and a 0-hour TTL.
    write_config(other_home.path(), &model, "  max_retained: 1\n");
    let (a, o) = (acme_home.path(), other_home.path());
    let acme = |args: &[&str]| -> Vec<String> {
        ["--db", db, "--profile", "acme"].iter().chain(args).map(|s| (*s).to_owned()).collect()
    };
    let other = |args: &[&str]| -> Vec<String> {
        ["--db", db, "--profile", "other"].iter().chain(args).map(|s| (*s).to_owned()).collect()
    };
    let call = |code: i32, home: &Path, args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        expect(code, home, &refs)
    };
    let mut acme_children = Vec::new();
    for i in 0..4 {
        let v = call(0, a, acme(&["delegate", "--goal", &format!("acme task {i}")]));
        acme_children.push(v["results"][0]["subagent_id"].as_str().expect("id").to_owned());
    }
    // The other tenant delegates (its retain prunes with a cap of 1) and prunes explicitly.
    call(0, o, other(&["delegate", "--goal", "other task"]));
    let pruned =
        call(0, o, other(&["children", "prune", "--max-retained", "1", "--ttl-hours", "0"]));
    assert_eq!(pruned["tombstoned"], 1, "only its own unit: {pruned}");
    // acme's four are all still there.
    let listed = call(0, a, acme(&["children", "list"]));
    let ids: Vec<&str> =
        listed.as_array().expect("list").iter().filter_map(|c| c["child_id"].as_str()).collect();
    for id in &acme_children {
        assert!(ids.contains(&id.as_str()), "{id} evicted by another tenant: {listed}");
    }
    // The other tenant sees none of them; its ids answer as missing ones.
    let theirs = call(0, o, other(&["children", "list"]));
    assert!(
        theirs.as_array().is_some_and(|l| l.iter().all(
            |c| !acme_children.contains(&c["child_id"].as_str().unwrap_or_default().to_owned())
        )),
        "{theirs}"
    );
    let foreign = run(
        o,
        &other(&["children", "show", &acme_children[0]])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let ghost = run(
        o,
        &other(&["children", "show", "sa-0-00000000"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert_eq!(foreign.status.code(), Some(4));
    let text = |o: &Output| {
        String::from_utf8_lossy(&o.stderr)
            .replace(&acme_children[0], "ID")
            .replace("sa-0-00000000", "ID")
    };
    assert_eq!(text(&foreign), text(&ghost), "foreign and missing ids differ");
    let tomb = run(
        o,
        &other(&["children", "tombstone", &acme_children[0]])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert_eq!(tomb.status.code(), Some(4));
    let still = call(0, a, acme(&["children", "show", &acme_children[0]]));
    assert_eq!(still["child_id"], acme_children[0].as_str());
    // The operator's explicit view sees every tenant; MCP refuses it.
    let theirs = call(0, o, other(&["delegate", "--goal", "other again"]));
    let their_child = theirs["results"][0]["subagent_id"].as_str().expect("id").to_owned();
    let scoped = call(0, a, acme(&["children", "list"]));
    assert!(
        scoped.as_array().is_some_and(|l| l.iter().all(|c| c["child_id"] != their_child.as_str()))
    );
    let all = call(0, a, acme(&["--all-profiles", "children", "list"]));
    let all_ids: Vec<&str> =
        all.as_array().expect("list").iter().filter_map(|c| c["child_id"].as_str()).collect();
    assert!(all_ids.contains(&their_child.as_str()) && all_ids.len() >= 5, "{all}");
    let refused =
        run(o, &other(&["--all-profiles", "mcp"]).iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(refused.status.code(), Some(2));
}

/// #35 on PostgreSQL: tenant b can neither spawn nor bill under tenant a's
/// session; a's session, ledger and lineage answer b as missing ones; a
/// background worker never holds the connection's password in its argv.
#[test]
fn another_tenants_session_is_missing_and_no_worker_argv_holds_the_password() {
    let Some(url) = retinue_testkit::pg_url("team-mode CLI tests") else { return };
    let scratch = Scratch::new(&url);
    let db = scratch.cli_url.as_str();
    let model = done_model();
    let home = TempHome::new();
    write_config(home.path(), &model, "");
    let h = home.path();
    let a = |args: &[&str]| -> Vec<String> {
        ["--db", db, "--profile", "a"].iter().chain(args).map(|s| (*s).to_owned()).collect()
    };
    let b = |args: &[&str]| -> Vec<String> {
        ["--db", db, "--profile", "b"].iter().chain(args).map(|s| (*s).to_owned()).collect()
    };
    let call = |code: i32, args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        expect(code, h, &refs)
    };
    let spawned = call(0, a(&["delegate", "--goal", "a's work"]));
    let parent = s(&spawned, &["parent_session_id"]).to_owned();
    let before = model.request_count();
    let stolen = call(4, b(&["delegate", "--parent", &parent, "--goal", "steal"]));
    let ghost = call(4, b(&["delegate", "--parent", "cli_000000000000", "--goal", "steal"]));
    assert_eq!(
        stolen.to_string().replace(&parent, "ID"),
        ghost.to_string().replace("cli_000000000000", "ID")
    );
    assert_eq!(model.request_count(), before, "nothing ran under a's session for b");
    for cmd in ["usage", "lineage"] {
        let foreign = call(4, b(&[cmd, &parent]));
        let missing = call(4, b(&[cmd, "cli_000000000000"]));
        assert_eq!(
            foreign.to_string().replace(&parent, "ID"),
            missing.to_string().replace("cli_000000000000", "ID"),
            "{cmd}"
        );
    }
    assert_eq!(call(0, a(&["usage", &parent]))["records"].as_array().map(Vec::len), Some(1));
    // A background worker: the URL (and any password in it) is not in its argv.
    let bg = call(0, a(&["delegate", "--background", "--goal", "in the background"]));
    let pid = bg["worker"]["pid"].as_u64().expect("worker pid");
    if let Ok(argv) = std::fs::read(format!("/proc/{pid}/cmdline")) {
        let argv = String::from_utf8_lossy(&argv);
        assert!(!argv.contains("postgres://"), "the database URL is in the worker's argv: {argv}");
    }
    let bg_parent = s(&bg, &["parent_session_id"]).to_owned();
    let unit = s(&bg, &["delegation_id"]).to_owned();
    // In team mode `wait` names its parent (exit 2 without).
    call(2, a(&["wait", &unit, "--timeout", "0"]));
    let got = call(0, a(&["wait", &unit, "--parent", &bg_parent, "--timeout", "60"]));
    assert_eq!(got["results"][0]["status"], "delivered", "{got}");
    drop(scratch);
}
