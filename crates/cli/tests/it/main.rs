//! The `retinue` binary on a state.db written by hermes-agent (testkit's
//! hermes fixture): every command's exit code and JSON, the help texts, the
//! demo, and that the file keeps every hermes row and object afterwards.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use retinue_store::{Store, StoreOptions};
use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
use retinue_testkit::hermes::{HERMES_TABLES, HermesSession};
use retinue_testkit::{HermesDb, HermesFixture, TempHome};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_retinue");

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs_f64()
}

/// A temporary home holding the standard hermes fixture, and the file as it
/// was written (every hermes table's rows, and the schema objects).
struct Fx {
    home: TempHome,
    fx: HermesFixture,
    before: Snapshot,
    /// The children's model: the home's config.yaml points `delegation` at it.
    model: FakeModel,
}

/// A fake model that answers `Done: <first line of the last user turn>`
/// with 100/20 tokens and $0.01, like the scripted runtime it replaced.
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

/// Points `home`'s `delegation:` section at `model`.
fn configure_model(home: &Path, model: &FakeModel) {
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test-secret\n",
        model.base_url()
    );
    std::fs::write(home.join("config.yaml"), yaml).expect("config.yaml");
}

#[derive(Debug, Clone, PartialEq)]
struct Snapshot {
    columns: BTreeMap<String, Vec<String>>,
    rows: BTreeMap<String, Vec<Value>>,
    objects: Vec<String>,
}

fn snapshot(path: &Path, columns: Option<&BTreeMap<String, Vec<String>>>) -> Snapshot {
    let mut cols = BTreeMap::new();
    let mut rows = BTreeMap::new();
    for (table, _) in HERMES_TABLES {
        let these = match columns {
            Some(c) => c[*table].clone(),
            None => HermesDb::columns(path, table),
        };
        let refs: Vec<&str> = these.iter().map(String::as_str).collect();
        rows.insert((*table).to_owned(), HermesDb::table_rows_of(path, table, &refs));
        cols.insert((*table).to_owned(), these);
    }
    let objects = HermesDb::table_rows_of(path, "sqlite_master", &["type", "name"])
        .into_iter()
        .map(|r| {
            format!("{} {}", r["type"].as_str().unwrap_or(""), r["name"].as_str().unwrap_or(""))
        })
        .collect();
    Snapshot { columns: cols, rows, objects }
}

impl Fx {
    fn new() -> Fx {
        let home = TempHome::new();
        let fx = HermesDb::standard(&home.db_path(), now());
        let before = snapshot(&home.db_path(), None);
        let model = done_model();
        configure_model(home.path(), &model);
        Fx { home, fx, before, model }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("--home").arg(self.home.path()).args(args);
        c.env_remove("HERMES_HOME").env_remove("HERMES_PROFILE");
        c
    }

    /// Runs with `--json`: exit code, parsed stdout (Null when empty), stderr.
    fn json(&self, args: &[&str]) -> (i32, Value, String) {
        let mut c = self.cmd(args);
        c.arg("--json");
        let out = c.output().expect("run retinue");
        let stdout = String::from_utf8(out.stdout).expect("utf8");
        let v = if stdout.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {stdout}"))
        };
        (out.status.code().expect("exit code"), v, String::from_utf8(out.stderr).expect("utf8"))
    }

    /// Runs with `--json`, expecting `code`.
    #[track_caller]
    fn ok(&self, code: i32, args: &[&str]) -> Value {
        let (got, v, err) = self.json(args);
        assert_eq!(got, code, "retinue {args:?}: stdout {v}, stderr {err}");
        v
    }

    /// Runs without `--json`: exit code, stdout, stderr.
    fn human(&self, args: &[&str]) -> (i32, String, String) {
        let out = self.cmd(args).output().expect("run retinue");
        (
            out.status.code().expect("exit code"),
            String::from_utf8(out.stdout).expect("utf8"),
            String::from_utf8(out.stderr).expect("utf8"),
        )
    }

    fn db(&self) -> PathBuf {
        self.home.db_path()
    }

    /// The file still opens, passes `integrity_check`, keeps every hermes
    /// table, column, index, trigger and row; rows whose key is in `changed`
    /// may differ in value, every other original row is identical.
    #[track_caller]
    fn assert_additive(&self, changed: &[(&str, &str)]) {
        let store = Store::open(self.db(), StoreOptions::default()).expect("reopen");
        assert_eq!(store.integrity_check().expect("integrity"), "ok");
        drop(store);
        let after = snapshot(&self.db(), Some(&self.before.columns));
        for object in &self.before.objects {
            assert!(after.objects.contains(object), "{object} disappeared");
        }
        for (table, key) in HERMES_TABLES {
            let now_rows = &after.rows[*table];
            for row in &self.before.rows[*table] {
                let id = &row[*key];
                let found = now_rows.iter().find(|r| &r[*key] == id);
                let found = found.unwrap_or_else(|| panic!("{table} row {id} disappeared"));
                let may_change = changed.iter().any(|(t, k)| t == table && json!(k) == *id);
                if !may_change {
                    assert_eq!(found, row, "{table} row {id} changed");
                }
            }
        }
    }
}

/// The stored tombstone note of the child row with this subagent id.
fn stored_note(db: &Path, subagent: &str) -> String {
    HermesDb::table_rows_of(db, "retinue_children", &["subagent_id", "tombstone_note"])
        .into_iter()
        .find(|r| r["subagent_id"] == subagent)
        .and_then(|r| r["tombstone_note"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// `text` with every ISO 8601 UTC time (`2026-12-01T06:32:51Z`) replaced by `<time>`.
fn redact_iso_times(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < text.len() {
        let rest = &bytes[i..];
        let is_time = rest.len() >= 20
            && rest[..20].iter().enumerate().all(|(k, b)| match k {
                4 | 7 => *b == b'-',
                10 => *b == b'T',
                13 | 16 => *b == b':',
                19 => *b == b'Z',
                _ => b.is_ascii_digit(),
            });
        if is_time {
            out.push_str("<time>");
            i += 20;
        } else {
            let ch = text[i..].chars().next().expect("char");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn ids(v: &Value) -> Vec<String> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|e| e["child_id"].as_str().expect("child_id").to_owned())
        .collect()
}

// ---------------------------------------------------------------- help

#[test]
fn help_texts() {
    let home = TempHome::new();
    let cases: &[(&str, &[&str])] = &[
        ("top", &[]),
        ("children", &["children"]),
        ("children_list", &["children", "list"]),
        ("children_show", &["children", "show"]),
        ("children_tombstone", &["children", "tombstone"]),
        ("children_prune", &["children", "prune"]),
        ("authority", &["authority"]),
        ("lineage", &["lineage"]),
        ("usage", &["usage"]),
        ("recover", &["recover"]),
        ("delegate", &["delegate"]),
        ("demo", &["demo"]),
    ];
    for (name, args) in cases {
        let out = Command::new(BIN)
            .args(*args)
            .arg("--help")
            .env("HERMES_HOME", home.path())
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(0), "{name}");
        let text = String::from_utf8(out.stdout).expect("utf8");
        insta::assert_snapshot!(format!("help_{name}"), text);
    }
}

#[test]
fn bad_usage_exits_2() {
    let fx = Fx::new();
    for args in [
        vec![],
        vec!["frobnicate"],
        vec!["children"],
        vec!["children", "show"],
        vec!["authority", "sa-x"],
        vec!["children", "prune", "--ttl-hours", "NaN"],
        vec!["children", "prune", "--max-retained", "-3"],
        vec!["children", "tombstone", "x", "--reason", "  "],
        vec!["delegate", "--parent", "p"],
        vec!["delegate", "--parent", "p", "--goal", "g", "--tasks", "[]"],
        vec!["delegate", "--parent", "p", "--tasks", "not json"],
        vec!["delegate", "--parent", "p", "--tasks", "[{\"goal\":\"a\"}]", "--follow-up", "x"],
        vec!["delegate", "--parent", "p", "--tasks", "{\"goal\": 1}"],
        vec!["delegate", "--parent", "p", "--goal", " ", "--follow-up", "x"],
    ] {
        let (code, _, err) = fx.human(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(!err.is_empty(), "{args:?}: no message");
    }
    fx.assert_additive(&[]);
}

// ---------------------------------------------------------------- children

#[test]
fn children_list_on_a_hermes_file() {
    let fx = Fx::new();
    let v = fx.ok(0, &["children", "list"]);
    // Newest unit first, then child index; hermes's tombstoned and legacy units are hidden.
    let mut want = vec![fx.fx.solo_subagent.to_owned()];
    want.extend(fx.fx.batch_subagents.iter().map(|s| (*s).to_owned()));
    assert_eq!(ids(&v), want);
    for e in v.as_array().expect("array") {
        let mut keys: Vec<&str> =
            e.as_object().expect("object").keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "child_id",
                "child_session_id",
                "completed_at",
                "delegation_id",
                "goal",
                "model",
                "owner_profile",
                "parent_session_id",
                "retained_at",
                "state"
            ]
        );
    }
    insta::assert_json_snapshot!("children_list", v, {
        "[].retained_at" => "[ts]",
        "[].completed_at" => "[ts]",
    });
    let (code, text, _) = fx.human(&["children", "list"]);
    assert_eq!(code, 0);
    assert!(text.starts_with("CHILD "), "{text}");
    assert!(text.contains(fx.fx.batch_sessions[2]), "{text}");
    fx.assert_additive(&[]);
}

#[test]
fn children_list_scoped_to_an_owner() {
    let fx = Fx::new();
    let all = ids(&fx.ok(0, &["children", "list"]));
    // The continuation may address its own child and the root's batch.
    assert_eq!(ids(&fx.ok(0, &["children", "list", "--owner", fx.fx.continuation])), all);
    assert_eq!(ids(&fx.ok(0, &["children", "list", "--owner", fx.fx.root])), all);
    // A branch, a stranger, a missing session and a delegate child: nothing.
    for outsider in [fx.fx.branch, fx.fx.stranger, "nope", fx.fx.batch_sessions[0]] {
        assert_eq!(fx.ok(0, &["children", "list", "--owner", outsider]), json!([]), "{outsider}");
    }
    // Another profile loses the `work` unit, keeps the ownerless batch.
    let v = fx.ok(0, &["--profile", "personal", "children", "list", "--owner", fx.fx.continuation]);
    assert_eq!(ids(&v), fx.fx.batch_subagents.to_vec());
    insta::assert_json_snapshot!("children_list_owner_personal", v, {
        "[].retained_at" => "[ts]",
        "[].completed_at" => "[ts]",
    });
    fx.assert_additive(&[]);
}

#[test]
fn children_show_by_any_id() {
    let fx = Fx::new();
    let by_sa = fx.ok(0, &["children", "show", fx.fx.batch_subagents[1]]);
    assert_eq!(by_sa["child_session_id"], fx.fx.batch_sessions[1]);
    assert_eq!(fx.ok(0, &["children", "show", fx.fx.batch_sessions[1]]), by_sa);
    let by_unit = fx.ok(0, &["children", "show", fx.fx.batch]);
    assert_eq!(by_unit["child_id"], fx.fx.batch_subagents[0]);
    insta::assert_json_snapshot!("children_show", by_sa, {
        ".retained_at" => "[ts]",
        ".completed_at" => "[ts]",
    });
    // Unknown, hermes-tombstoned and never-retained ids: exit 4, a JSON error on stdout.
    let (code, v, err) = fx.json(&["children", "show", "nope"]);
    assert_eq!(
        (code, v),
        (
            4,
            json!({"error": "no retained child, child session or delegation 'nope'", "code": "not_found"})
        )
    );
    assert!(err.contains("no retained child"), "{err}");
    // A unit hermes retained and tombstoned on its own is not addressable either.
    let (code, v, _) = fx.json(&["children", "show", fx.fx.tombstoned_session]);
    assert_eq!((code, v["code"].clone()), (4, json!("not_found")));
    let (code, _, _) = fx.json(&["children", "show", fx.fx.legacy]);
    assert_eq!(code, 4);
    let (code, text, _) = fx.human(&["children", "show", fx.fx.solo_subagent]);
    assert_eq!(code, 0);
    assert!(
        text.lines().any(|l| l.starts_with("owner_profile ") && l.ends_with(" work")),
        "{text}"
    );
    fx.assert_additive(&[]);
}

#[test]
fn children_tombstone_one_child() {
    let fx = Fx::new();
    let target = fx.fx.batch_subagents[2];
    let v = fx.ok(0, &["children", "tombstone", target, "--reason", "operator cleanup"]);
    assert_eq!(v, json!({ "tombstoned": true }));
    insta::assert_json_snapshot!("children_tombstone", v);
    // Siblings stay; the child is gone, with its reason; a repeat is exit 4.
    let listed = ids(&fx.ok(0, &["children", "list"]));
    assert_eq!(listed.len(), 3);
    assert!(!listed.contains(&target.to_owned()));
    let (code, v, err) = fx.json(&["children", "show", target]);
    assert_eq!(code, 4);
    // `--reason` is a note: the reason stays `manual` (ttl/cap/external are the system's),
    // and the note is shown with it, by `show` and by the not-addressable message.
    assert!(err.contains("(reason: manual, note: operator cleanup)"), "{err}");
    let (hcode, hout, herr) = fx.human(&["children", "show", target]);
    assert_eq!((hcode, hout.as_str()), (4, ""));
    let (tcode, _, terr) = fx.human(&["children", "tombstone", target]);
    assert_eq!(tcode, 4);
    assert_eq!(terr, herr, "tombstone of a tombstoned child answers as show does");
    insta::assert_snapshot!(
        "children_show_tombstoned_with_note",
        format!(
            "exit {hcode}\nstderr: {}json: {}\n",
            redact_iso_times(&herr),
            redact_iso_times(&v.to_string())
        )
    );
    let note = stored_note(&fx.db(), target);
    assert_eq!(note, "operator cleanup");
    let (code, _, _) = fx.json(&["children", "tombstone", target]);
    assert_eq!(code, 4);
    let (code, _, _) = fx.json(&["children", "tombstone", "nope"]);
    assert_eq!(code, 4);
    let (code, _, _) = fx.json(&["children", "tombstone", fx.fx.tombstoned_session]);
    assert_eq!(code, 4);
    // A delegation id tombstones its remaining live children (default reason manual).
    let (code, text, _) = fx.human(&["children", "tombstone", fx.fx.batch]);
    assert_eq!(code, 0);
    assert!(text.contains("every live child of deleg_h0000001, reason: manual"), "{text}");
    assert_eq!(ids(&fx.ok(0, &["children", "list"])), vec![fx.fx.solo_subagent]);
    // Per-child tombstones live in retinue_children; the batch unit gets its tombstone time.
    fx.assert_additive(&[("async_delegations", fx.fx.batch)]);
}

#[test]
fn children_prune_ttl_and_cap() {
    let fx = Fx::new();
    let v = fx.ok(0, &["children", "prune"]);
    assert_eq!(v, json!({ "tombstoned": 0, "children": 0 }));
    fx.assert_additive(&[]);
    // The batch was retained 6 h ago: a 4 h TTL expires its unit and three children.
    let v = fx.ok(0, &["children", "prune", "--ttl-hours", "4"]);
    assert_eq!(v, json!({ "tombstoned": 1, "children": 3 }));
    insta::assert_json_snapshot!("children_prune", v);
    assert_eq!(ids(&fx.ok(0, &["children", "list"])), vec![fx.fx.solo_subagent]);
    let (code, _, err) = fx.json(&["children", "show", fx.fx.batch_subagents[0]]);
    assert_eq!(code, 4);
    assert!(err.contains("(reason: ttl)"), "{err}");
    // The cap: one retained unit is already the limit.
    assert_eq!(
        fx.ok(0, &["children", "prune", "--max-retained", "1"]),
        json!({ "tombstoned": 0, "children": 0 })
    );
    let (code, text, _) = fx.human(&["children", "prune", "--ttl-hours", "0"]);
    assert_eq!(code, 0);
    assert!(text.contains("tombstoned 1 unit(s), 1 child(ren)"), "{text}");
    fx.assert_additive(&[("async_delegations", fx.fx.batch), ("async_delegations", fx.fx.solo)]);
}

// ---------------------------------------------------------------- authority

#[test]
fn authority_decisions() {
    let fx = Fx::new();
    let sa0 = fx.fx.batch_subagents[0];
    let allowed = fx.ok(0, &["authority", sa0, "--caller", fx.fx.continuation]);
    assert_eq!(allowed["allowed"], true);
    assert_eq!(allowed["denial"], Value::Null);
    insta::assert_json_snapshot!("authority_allowed", allowed);
    assert_eq!(fx.ok(0, &["authority", sa0, "--caller", fx.fx.root])["allowed"], true);

    let branch = fx.ok(3, &["authority", sa0, "--caller", fx.fx.branch]);
    assert_eq!(branch["denial"], "lineage");
    insta::assert_json_snapshot!("authority_denied_lineage", branch);
    assert_eq!(fx.ok(3, &["authority", sa0, "--caller", fx.fx.stranger]), branch);
    assert_eq!(fx.ok(3, &["authority", sa0, "--caller", "ghost"]), branch);

    let itself = fx.ok(3, &["authority", sa0, "--caller", fx.fx.batch_sessions[0]]);
    assert_eq!(itself["denial"], "itself");
    insta::assert_json_snapshot!("authority_denied_itself", itself);

    // Another tenant's child is answered exactly as a missing id (#35).
    let (code, foreign, _) = fx.json(&[
        "--profile",
        "personal",
        "authority",
        fx.fx.solo_subagent,
        "--caller",
        fx.fx.continuation,
    ]);
    assert_eq!((code, foreign["code"].clone()), (4, json!("not_found")), "{foreign}");
    let text = foreign.to_string();
    assert!(!text.contains("work") && !text.contains("profile"), "{text}");
    assert!(
        text.contains(&format!(
            "no retained child, child session or delegation '{}'",
            fx.fx.solo_subagent
        )),
        "{text}"
    );

    let (code, v, _) = fx.json(&["authority", "nope", "--caller", fx.fx.root]);
    assert_eq!((code, v["code"].clone()), (4, json!("not_found")));
    let (code, _, _) = fx.json(&["authority", fx.fx.tombstoned_session, "--caller", fx.fx.root]);
    assert_eq!(code, 4);

    let (code, text, _) = fx.human(&["authority", sa0, "--caller", fx.fx.branch]);
    assert_eq!(code, 3);
    assert!(text.starts_with("denied (lineage)\nfollow_up rejected:"), "{text}");
    fx.assert_additive(&[]);
}

#[test]
fn authority_profile_from_the_environment() {
    let fx = Fx::new();
    let mut c =
        fx.cmd(&["--json", "authority", fx.fx.solo_subagent, "--caller", fx.fx.continuation]);
    let out = c.env("HERMES_PROFILE", "personal").output().expect("run");
    // Another tenant's child: missing (#35), never "denied (profile)".
    assert_eq!(out.status.code(), Some(4));
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["code"], "not_found");
    // An explicit --profile wins over the environment.
    let mut c = fx.cmd(&[
        "--json",
        "--profile",
        "work",
        "authority",
        fx.fx.solo_subagent,
        "--caller",
        fx.fx.continuation,
    ]);
    let out = c.env("HERMES_PROFILE", "personal").output().expect("run");
    assert_eq!(out.status.code(), Some(0));
}

// ---------------------------------------------------------------- lineage

#[test]
fn lineage_roots() {
    let fx = Fx::new();
    let cont = fx.ok(0, &["lineage", fx.fx.continuation]);
    assert_eq!(
        cont,
        json!({ "session_id": "h-cont", "root": "h-root", "chain": ["h-cont", "h-root"] })
    );
    insta::assert_json_snapshot!("lineage_continuation", cont);
    assert_eq!(
        fx.ok(0, &["lineage", fx.fx.root]),
        json!({ "session_id": "h-root", "root": "h-root", "chain": ["h-root"] })
    );
    let branch = fx.ok(0, &["lineage", fx.fx.branch]);
    assert_eq!(
        branch,
        json!({
            "session_id": "h-branch",
            "root": null,
            "chain": [],
            "reason": "session is a branch (_branched_from)"
        })
    );
    insta::assert_json_snapshot!("lineage_branch", branch);
    assert_eq!(fx.ok(0, &["lineage", fx.fx.batch_sessions[0]])["root"], Value::Null);
    let (code, v, err) = fx.json(&["lineage", "nope"]);
    assert_eq!((code, v), (4, json!({"error": "no session 'nope'", "code": "not_found"})));
    assert!(err.contains("no session 'nope'"), "{err}");
    let (code, text, _) = fx.human(&["lineage", fx.fx.branch]);
    assert_eq!(code, 0);
    assert!(text.contains("none (session is a branch (_branched_from))"), "{text}");
    fx.assert_additive(&[]);
}

// ---------------------------------------------------------------- usage

#[test]
fn usage_totals_and_records() {
    let fx = Fx::new();
    let root = fx.ok(0, &["usage", fx.fx.root]);
    let totals = &root["totals"];
    assert!((totals["cost_usd"].as_f64().expect("cost") - 0.06).abs() < 1e-9);
    assert_eq!(
        (totals["input_tokens"].as_f64(), totals["output_tokens"].as_f64()),
        (Some(600.0), Some(120.0))
    );
    assert_eq!(root["records"].as_array().expect("records").len(), 3);
    insta::assert_json_snapshot!("usage_root", root, { ".records[].created_at" => "[ts]" });

    // hermes's numeric-string cost counts.
    let cont = fx.ok(0, &["usage", fx.fx.continuation]);
    assert!((cont["totals"]["cost_usd"].as_f64().expect("cost") - 0.025).abs() < 1e-9);

    let lineage = fx.ok(0, &["usage", fx.fx.continuation, "--lineage"]);
    let t = &lineage["totals"];
    assert!((t["cost_usd"].as_f64().expect("cost") - 0.085).abs() < 1e-9);
    assert_eq!(
        (t["input_tokens"].as_f64(), t["output_tokens"].as_f64()),
        (Some(850.0), Some(160.0))
    );
    assert_eq!(lineage["records"].as_array().expect("records").len(), 4);
    insta::assert_json_snapshot!("usage_lineage", lineage, {
        ".records[].created_at" => "[ts]",
        ".totals.cost_usd" => insta::rounded_redaction(6),
    });

    // A session that exists nowhere is not found, like `lineage`.
    let (code, v, _) = fx.json(&["usage", "nope"]);
    assert_eq!((code, v), (4, json!({"error": "no session 'nope'", "code": "not_found"})));
    let (code, text, _) = fx.human(&["usage", fx.fx.continuation, "--lineage"]);
    assert_eq!(code, 0);
    assert!(text.contains("sessions       h-root → h-cont"), "{text}");
    assert!(text.contains("cost_usd       0.0850"), "{text}");
    fx.assert_additive(&[]);
}

// ---------------------------------------------------------------- recover

#[test]
fn recover_marks_abandoned_and_rehydrates() {
    let fx = Fx::new();
    let v = fx.ok(0, &["recover"]);
    assert_eq!(v, json!({ "abandoned": 1, "retained": 4 }));
    insta::assert_json_snapshot!("recover", v);
    assert_eq!(fx.ok(0, &["recover"]), json!({ "abandoned": 0, "retained": 4 }));
    let rows = HermesDb::table_rows_of(&fx.db(), "async_delegations", &["delegation_id", "state"]);
    let state =
        |id: &str| rows.iter().find(|r| r["delegation_id"] == id).map(|r| r["state"].clone());
    assert_eq!(state(fx.fx.abandoned), Some(json!("unknown")));
    assert_eq!(state(fx.fx.batch), Some(json!("completed")));
    let (code, text, _) = fx.human(&["recover"]);
    assert_eq!(code, 0);
    assert!(text.contains("0 abandoned delegation(s)"), "{text}");
    // Only the abandoned unit changed; retained rows are never rewritten.
    fx.assert_additive(&[("async_delegations", fx.fx.abandoned)]);
}

// ---------------------------------------------------------------- delegate

#[test]
fn delegate_without_a_model_says_which_keys_to_set_and_writes_nothing() {
    let home = TempHome::new();
    let out = Command::new(BIN)
        .arg("--home")
        .arg(home.path())
        .args(["delegate", "--goal", "anything"])
        .env_remove("OPENAI_API_KEY")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("set delegation.model and delegation.base_url"), "{err}");
    assert!(!home.db_path().exists(), "nothing may be written");
    std::fs::write(home.path().join("config.yaml"), "delegation:\n  api_mode: codex_responses\n")
        .expect("config");
    let out = Command::new(BIN)
        .arg("--home")
        .arg(home.path())
        .args(["delegate", "--goal", "x", "--model", "m", "--base-url", "http://127.0.0.1:9/v1"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("chat_completions"), "{err}");
    assert!(!home.db_path().exists(), "nothing may be written");
}

#[test]
fn delegate_without_a_parent_starts_one_and_it_can_follow_up_later() {
    let fx = Fx::new();
    let v = fx.ok(0, &["delegate", "--goal", "Draft the notes"]);
    let parent = v["parent_session_id"].as_str().expect("new parent").to_owned();
    assert!(parent.starts_with("cli_"), "{parent}");
    let child = v["results"][0]["subagent_id"].as_str().expect("child").to_owned();
    assert_eq!(v["results"][0]["summary"], "Done: Draft the notes");
    let again =
        fx.ok(0, &["delegate", "--parent", &parent, "--follow-up", &child, "--goal", "And then?"]);
    assert_eq!(again["mode"], "follow_up");
    assert_eq!(again["results"][0]["summary"], "Done: And then?");
    // The follow-up sent the child's whole transcript, in order, the new turn last.
    let requests = fx.model.requests();
    let last = requests.last().expect("a request").messages();
    let roles: Vec<&str> = last.iter().filter_map(|m| m["role"].as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user"]);
    assert_eq!(last[3]["content"], "And then?");
    // The key went to the model, and nowhere into the file.
    assert_eq!(requests[0].header("authorization"), Some("Bearer sk-test-secret"));
    let bytes = std::fs::read(fx.db()).expect("db");
    assert!(!bytes.windows(14).any(|w| w == b"sk-test-secret"));
    // Exactly one keyed ledger row per run (a spawn and a follow-up).
    let usage = fx.ok(0, &["usage", &parent]);
    assert_eq!(usage["records"].as_array().map(Vec::len), Some(2), "{usage}");
    assert_eq!(usage["totals"]["input_tokens"], 200.0);
    assert_eq!(usage["totals"]["output_tokens"], 40.0);
    let (code, text, _) = fx.human(&["delegate", "--goal", "x"]);
    assert_eq!(code, 0);
    assert!(text.starts_with("parent session cli_"), "{text}");
}

#[test]
fn delegate_spawns_on_the_configured_model() {
    let fx = Fx::new();
    let v =
        fx.ok(0, &["delegate", "--parent", fx.fx.continuation, "--goal", "Summarise the release"]);
    assert_eq!(v["results"][0]["status"], "completed");
    assert_eq!(v["results"][0]["summary"], "Done: Summarise the release");
    insta::assert_json_snapshot!("delegate_spawn", v, {
        ".delegation_id" => "[id]",
        ".results[].subagent_id" => "[sa]",
        ".results[].child_session_id" => "[sid]",
        ".results[].duration_seconds" => "[t]",
        ".results[].receipts.duration_seconds" => "[t]",
        ".results[].endpoint" => "[fake model]",
        ".total_duration_seconds" => "[t]",
    });
    // The new unit is retained, newest first, and billed to the parent.
    let listed = ids(&fx.ok(0, &["children", "list"]));
    assert_eq!(listed.len(), 5);
    assert_eq!(listed[0], v["results"][0]["subagent_id"].as_str().expect("sa"));
    let usage = fx.ok(0, &["usage", fx.fx.continuation]);
    assert_eq!(usage["records"].as_array().expect("records").len(), 2);

    let batch = fx.ok(
        0,
        &[
            "delegate",
            "--parent",
            fx.fx.root,
            "--tasks",
            r#"[{"goal":"a"},{"goal":"b","context":"c"}]"#,
        ],
    );
    assert_eq!(batch["results"].as_array().expect("results").len(), 2);
    let (code, text, _) = fx.human(&["delegate", "--parent", fx.fx.root, "--goal", "x"]);
    assert_eq!(code, 0);
    assert!(text.starts_with("delegation deleg_"), "{text}");
    assert!(text.contains("Done: x"), "{text}");
    // New units, sessions and ledger rows; the parents' cost fields are re-applied.
    fx.assert_additive(&[("sessions", fx.fx.continuation), ("sessions", fx.fx.root)]);
}

#[test]
fn delegate_follow_up_resumes_a_hermes_child() {
    let fx = Fx::new();
    let sa1 = fx.fx.batch_subagents[1];
    let v = fx.ok(
        0,
        &[
            "delegate",
            "--parent",
            fx.fx.continuation,
            "--follow-up",
            sa1,
            "--goal",
            "One more thing",
        ],
    );
    assert_eq!(v["mode"], "follow_up");
    assert_eq!(v["child_session_id"], fx.fx.batch_sessions[1]);
    insta::assert_json_snapshot!("delegate_follow_up", v, {
        ".results[].duration_seconds" => "[t]",
        ".results[].receipts.duration_seconds" => "[t]",
        ".results[].endpoint" => "[fake model]",
        ".total_duration_seconds" => "[t]",
    });
    // It ran on the child's own hermes transcript: two more messages.
    let messages =
        HermesDb::table_rows_of(&fx.db(), "messages", &["session_id", "role", "content"]);
    let child: Vec<&Value> =
        messages.iter().filter(|m| m["session_id"] == fx.fx.batch_sessions[1]).collect();
    assert_eq!(child.len(), 4);
    assert_eq!(child[2]["content"], "One more thing");
    assert_eq!(child[3]["role"], "assistant");

    // Refusals: a stranger (exit 3, the generic text), the child itself (3),
    // a tombstoned child (4: the lineage is told when and why).
    let (code, v, err) =
        fx.json(&["delegate", "--parent", fx.fx.stranger, "--follow-up", sa1, "--goal", "hi"]);
    assert_eq!(code, 3);
    assert!(v["error"].as_str().expect("error").contains("is not a running subagent"));
    assert!(err.contains("is not a running subagent"), "{err}");
    insta::assert_json_snapshot!("delegate_follow_up_refused", v);
    let (code, _, _) = fx.json(&[
        "delegate",
        "--parent",
        fx.fx.batch_sessions[1],
        "--follow-up",
        sa1,
        "--goal",
        "hi",
    ]);
    assert_eq!(code, 3);
    let sa2 = fx.fx.batch_subagents[2];
    fx.ok(0, &["children", "tombstone", sa2, "--reason", "done with it"]);
    let (code, v, _) =
        fx.json(&["delegate", "--parent", fx.fx.continuation, "--follow-up", sa2, "--goal", "hi"]);
    assert_eq!(code, 4);
    assert!(v["error"].as_str().expect("error").contains("(reason: manual)"), "{v}");
    // The followed-up unit's retention was refreshed (its row may change).
    // The resumed child session (reopened, ended again) and the paying parent's
    // cost fields change.
    fx.assert_additive(&[
        ("async_delegations", fx.fx.batch),
        ("sessions", fx.fx.batch_sessions[1]),
        ("sessions", fx.fx.continuation),
    ]);
}

// ---------------------------------------------------------------- locations

#[test]
fn db_option_and_hermes_home_env() {
    let fx = Fx::new();
    let elsewhere = TempHome::new();
    let out = Command::new(BIN)
        .arg("--home")
        .arg(elsewhere.path())
        .arg("--db")
        .arg(fx.db())
        .args(["--json", "children", "list"])
        .env_remove("HERMES_PROFILE")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0));
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(ids(&v).len(), 4);
    let out = Command::new(BIN)
        .args(["--json", "children", "list"])
        .env("HERMES_HOME", fx.home.path())
        .env_remove("HERMES_PROFILE")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0));
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(ids(&v).len(), 4);
    // Global options also work after the command.
    let (code, v, _) =
        fx.json(&["children", "list", "--profile", "personal", "--owner", fx.fx.root]);
    assert_eq!(code, 0);
    assert_eq!(ids(&v).len(), 3);
}

#[test]
fn not_a_database_is_exit_1_and_untouched() {
    let home = TempHome::new();
    std::fs::write(home.db_path(), b"not sqlite at all, just text").expect("write");
    let out = Command::new(BIN)
        .arg("--home")
        .arg(home.path())
        .args(["children", "list"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).expect("utf8");
    assert!(err.starts_with("retinue: ") && err.contains("not a SQLite database"), "{err}");
    assert!(out.stdout.is_empty());
    assert_eq!(std::fs::read(home.db_path()).expect("read"), b"not sqlite at all, just text");
}

// ---------------------------------------------------------------- demo

const DEMO_STEPS: [&str; 12] = [
    "setup",
    "delegate",
    "retained",
    "compress",
    "follow_up",
    "refused",
    "tombstone",
    "prune",
    "background",
    "restart",
    "usage",
    "done",
];

fn demo_events(stdout: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad event ({e}): {l}")))
        .collect()
}

#[test]
fn demo_json_tells_the_whole_lifecycle() {
    let out = Command::new(BIN).args(["demo", "--json"]).output().expect("run demo");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let events = demo_events(&out.stdout);
    let steps: Vec<&str> = events.iter().map(|e| e["step"].as_str().expect("step")).collect();
    assert_eq!(steps, DEMO_STEPS);
    let step = |name: &str| events.iter().find(|e| e["step"] == name).expect("step");
    assert_eq!(step("delegate")["result"]["results"].as_array().expect("results").len(), 3);
    assert_eq!(step("retained")["children"].as_array().expect("children").len(), 3);
    assert_eq!(step("compress")["root"], "demo-parent");
    assert_eq!(step("follow_up")["result"]["mode"], "follow_up");
    let roles: Vec<&str> = step("follow_up")["transcript"]
        .as_array()
        .expect("transcript")
        .iter()
        .map(|m| m["role"].as_str().expect("role"))
        .collect();
    // The storage survey read a file in its workspace before answering.
    assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]);
    for attempt in step("refused")["attempts"].as_array().expect("attempts") {
        assert_eq!(attempt["denial"], "lineage");
    }
    assert_eq!(step("tombstone")["children"].as_array().expect("children").len(), 2);
    assert_eq!(step("prune")["pruned"], json!({ "tombstoned": 0, "children": 1 }));
    assert_eq!(step("background")["first"]["results"][0]["status"], "delivered");
    assert_eq!(step("background")["again"]["results"][0]["status"], "already_delivered");
    assert_eq!(step("restart")["abandoned"], 1);
    assert_eq!(step("restart")["retained"], 2);
    assert_eq!(step("restart")["recovered_state"], "unknown");
    let usage = step("usage");
    assert_eq!(usage["sessions"], json!(["demo-parent", "demo-parent-2"]));
    assert!((usage["totals"]["cost_usd"].as_f64().expect("cost") - 0.0475).abs() < 1e-9);
    assert_eq!(step("done")["kept"], false);
    // The temporary home is gone.
    let home = step("setup")["home"].as_str().expect("home").to_owned();
    assert!(!Path::new(&home).exists(), "{home} left behind");
}

#[test]
fn demo_keeps_an_explicit_home_and_refuses_a_used_one() {
    let home = TempHome::new();
    let dir = home.path().join("demo");
    let out = Command::new(BIN).arg("demo").arg("--home").arg(&dir).output().expect("run demo");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let story = String::from_utf8(out.stdout).expect("utf8");
    for n in 1..=12 {
        assert!(story.contains(&format!("[{n}/12] ")), "step {n} missing:\n{story}");
    }
    assert!(story.contains("The database is kept."), "{story}");
    // The kept file is an ordinary home for the other commands.
    let out = Command::new(BIN)
        .arg("--home")
        .arg(&dir)
        .args(["--json", "children", "list"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0));
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    // The follow-up child and the background one.
    assert_eq!(ids(&v).len(), 2);
    // A second demo there refuses (exit 2); so does --db.
    let out = Command::new(BIN).arg("demo").arg("--home").arg(&dir).output().expect("run demo");
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(BIN).args(["demo", "--db", "x.db"]).output().expect("run demo");
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn demo_tells_its_whole_story_whatever_config_yaml_says() {
    let home = TempHome::new();
    let dir = home.path().join("hostile");
    std::fs::create_dir_all(&dir).expect("dir");
    let yaml = "delegation:\n  model: no/such-model\n  base_url: http://127.0.0.1:9/v1\n  \
                api_key: sk-hostile\n  retained_ttl_hours: 0.0001\n  max_retained: 1\n  \
                max_concurrent_children: 1\n  budget: {max_cost_usd: 0, max_tokens: 1}\n  \
                max_resume_tokens: 1\n  child_timeout_seconds: 30\n\
                database:\n  journal_mode: delete\n  busy_timeout_seconds: 0\n";
    std::fs::write(dir.join("config.yaml"), yaml).expect("config.yaml");
    let out = Command::new(BIN)
        .arg("demo")
        .arg("--home")
        .arg(&dir)
        .arg("--json")
        .env_remove("HERMES_HOME")
        .output()
        .expect("run demo");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let events = demo_events(&out.stdout);
    let steps: Vec<&str> = events.iter().map(|e| e["step"].as_str().expect("step")).collect();
    assert_eq!(steps, DEMO_STEPS);
    let step = |name: &str| events.iter().find(|e| e["step"] == name).expect("step");
    assert_eq!(step("retained")["children"].as_array().expect("children").len(), 3);
    assert_eq!(step("follow_up")["result"]["mode"], "follow_up");
    assert_eq!(step("prune")["pruned"], json!({ "tombstoned": 0, "children": 1 }));
    let usage = step("usage");
    assert!((usage["totals"]["cost_usd"].as_f64().expect("cost") - 0.0475).abs() < 1e-9);
    assert_eq!(std::fs::read_to_string(dir.join("config.yaml")).expect("kept"), yaml);
    insta::assert_json_snapshot!(
        "demo_hostile_config_steps",
        events.iter().map(|e| json!([e["n"], e["step"], e["title"]])).collect::<Vec<_>>()
    );
}

#[test]
fn a_demo_that_fails_midway_leaves_nothing_half_built() {
    let home = TempHome::new();
    // A home the demo creates, and one that exists with a config.yaml.
    let created = home.path().join("new");
    let existing = home.path().join("existing");
    std::fs::create_dir_all(&existing).expect("dir");
    std::fs::write(existing.join("config.yaml"), "delegation:\n  max_retained: 1\n").expect("yaml");
    for (dir, at) in [(&created, "tombstone"), (&existing, "restart"), (&existing, "setup")] {
        let out = Command::new(BIN)
            .arg("demo")
            .arg("--home")
            .arg(dir)
            .env("RETINUE_DEMO_FAIL_AT", at)
            .env_remove("HERMES_HOME")
            .output()
            .expect("run demo");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{at}: {stdout}{stderr}");
        assert!(stderr.contains(&format!("demo failure injected at step {at}")), "{stderr}");
        // The story really ran up to the failing step (the database existed).
        if at != "setup" {
            assert!(stdout.contains("[2/12] "), "{at}: {stdout}");
        }
        if dir == &created {
            assert!(!dir.exists(), "{at}: the home the demo created is left behind");
        } else {
            let mut left: Vec<String> = std::fs::read_dir(dir)
                .expect("dir")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            left.sort();
            assert_eq!(left, ["config.yaml"], "{at}: half-built files left");
            assert!(!dir.join("demo-workspace").exists());
        }
    }
}

#[test]
fn the_api_key_never_reaches_the_file_the_wal_or_the_logs() {
    const KEY: &str = "sk-live-0123456789abcdefSECRET";
    const PASSWORD: &str = "pw-userinfo-SECRET-42";
    const QUERY_KEY: &str = "sk-query-SECRET-9876";
    let home = TempHome::new();
    let fx = HermesDb::standard(&home.db_path(), now());
    let model = FakeModel::start();
    model.set_handler(|_| Some(Reply::text("ok").with_usage(Usage::new(1, 1))));
    let base = model.base_url();
    let with_secrets = base.replacen("://", &format!("://alice:{PASSWORD}@"), 1)
        + &format!("?api_key={QUERY_KEY}&region=eu");
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: \"{with_secrets}\"\n  api_key: {KEY}\n"
    );
    std::fs::write(home.path().join("config.yaml"), yaml).expect("config.yaml");
    let run = |args: &[&str]| -> (i32, String, String) {
        let out = Command::new(BIN)
            .arg("--home")
            .arg(home.path())
            .arg("--json")
            .args(args)
            .env("RETINUE_LOG", "debug")
            .env_remove("HERMES_HOME")
            .env_remove("HERMES_PROFILE")
            .output()
            .expect("run retinue");
        (
            out.status.code().expect("exit"),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stdout, mut stderr) =
        run(&["delegate", "--parent", fx.continuation, "--goal", "Check the keys"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let v: Value = serde_json::from_str(&stdout).expect("json");
    assert_eq!(v["results"][0]["summary"], "ok");
    let sa = v["results"][0]["subagent_id"].as_str().expect("sa").to_owned();
    let (code, stdout2, stderr2) =
        run(&["delegate", "--parent", fx.continuation, "--follow-up", &sa, "--goal", "again"]);
    assert_eq!(code, 0, "{stdout2}{stderr2}");
    stderr.push_str(&stderr2);
    // The model was really called with the key (so the test is not vacuous).
    let requests = model.requests();
    assert!(requests.len() >= 2, "{} requests", requests.len());
    assert!(
        requests
            .iter()
            .all(|r| r.header("authorization") == Some(format!("Bearer {KEY}").as_str())),
        "the key was not sent"
    );
    let paths: Vec<&str> = requests.iter().map(|r| r.path.as_str()).collect();
    // The spawn uses the configured URL as it is; the follow-up resumes with
    // the child's stored (credential-free) URL, so its query lost `api_key`.
    assert!(paths[0].contains(QUERY_KEY), "the query was not kept: {paths:?}");
    assert!(paths.iter().all(|p| p.contains("region=eu")), "{paths:?}");
    assert!(!stderr.is_empty(), "RETINUE_LOG=debug logged nothing");
    let db = home.db_path();
    let mut files = vec![db.clone()];
    let wal = db.with_file_name("state.db-wal");
    if wal.exists() {
        files.push(wal);
    }
    let secrets = [KEY, PASSWORD, QUERY_KEY];
    for file in &files {
        let bytes = std::fs::read(file).expect("read");
        for secret in secrets {
            assert!(
                !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                "{secret} found in {}",
                file.display()
            );
        }
    }
    for secret in secrets {
        assert!(!stderr.contains(secret), "{secret} in stderr:\n{stderr}");
        assert!(!stdout.contains(secret) && !stdout2.contains(secret), "{secret} in stdout");
    }
    // The base URL is stored without its credentials (other parameters kept).
    let dump = String::from_utf8_lossy(&std::fs::read(&db).expect("db")).into_owned();
    assert!(!dump.contains("alice:"), "userinfo stored");
}

// ------------------------------------------------------------ hostile argv

mod hostile_arguments {
    use std::os::unix::ffi::OsStringExt;

    use proptest::prelude::*;

    use super::{BIN, Fx};

    fn id() -> impl Strategy<Value = String> {
        prop_oneof![
            "\\PC{0,40}",
            Just("' OR 1=1 --".to_owned()),
            Just("sa-0-%".to_owned()),
            Just("\u{202e}evil".to_owned()),
            Just("x".repeat(20_000)),
            Just(String::new()),
            Just("   ".to_owned()),
        ]
    }

    fn argv() -> impl Strategy<Value = Vec<String>> {
        let s = || id();
        prop_oneof![
            s().prop_map(|x| vec!["children".into(), "show".into(), x]),
            (s(), s()).prop_map(|(x, y)| vec!["authority".into(), x, "--caller".into(), y]),
            s().prop_map(|x| vec!["lineage".into(), x]),
            s().prop_map(|x| vec!["usage".into(), x, "--lineage".into()]),
            s().prop_map(|x| vec!["children".into(), "list".into(), "--owner".into(), x]),
            proptest::collection::vec(s(), 0..5),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Read commands with hostile arguments: a documented exit code and a
        /// message, never a panic, and the file keeps every hermes row.
        #[test]
        fn hostile_read_arguments_never_panic(args in argv(), json in any::<bool>()) {
            let fx = Fx::new();
            let mut cmd = fx.cmd(&[]);
            cmd.args(&args);
            if json {
                cmd.arg("--json");
            }
            let out = cmd.output().expect("run retinue");
            let code = out.status.code().expect("not killed by a signal");
            let stderr = String::from_utf8_lossy(&out.stderr);
            prop_assert!([0, 1, 2, 3, 4].contains(&code), "{args:?} → {code}: {stderr}");
            prop_assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
            if code != 0 {
                prop_assert!(!stderr.trim().is_empty(), "{args:?}: exit {code} without a message");
            }
            fx.assert_additive(&[]);
        }
    }

    #[test]
    fn non_utf8_arguments_are_bad_usage() {
        let fx = Fx::new();
        let bad = std::ffi::OsString::from_vec(vec![0x73, 0x61, 0xff, 0xfe]);
        for args in
            [vec!["children".into(), "show".into(), bad.clone()], vec!["lineage".into(), bad]]
        {
            let out = std::process::Command::new(BIN)
                .arg("--home")
                .arg(fx.home.path())
                .args(&args)
                .output()
                .expect("run retinue");
            assert_eq!(out.status.code(), Some(2), "{args:?}");
            assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
        }
        fx.assert_additive(&[]);
    }
}

#[test]
fn kill_9_mid_run_keeps_the_transcript_and_recovery_marks_the_unit_unknown() {
    let fx = Fx::new();
    // The first call asks for a tool (this runtime has none: the error goes
    // back as the tool result); the second never answers in time.
    let model = FakeModel::start();
    model.push(Reply::tool_call("call_1", "lookup", json!({"q": "x"})));
    model.set_default(Reply::text("never written").delayed(std::time::Duration::from_secs(60)));
    configure_model(fx.home.path(), &model);
    let mut run = fx
        .cmd(&["delegate", "--parent", fx.fx.root, "--goal", "A long job"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let started = std::time::Instant::now();
    while model.request_count() < 2 && started.elapsed() < std::time::Duration::from_secs(30) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(model.request_count(), 2, "the second model call never started");
    run.kill().expect("SIGKILL");
    run.wait().expect("reaped");

    let units = HermesDb::table_rows_of(
        &fx.db(),
        "async_delegations",
        &["delegation_id", "state", "children_json"],
    );
    let unit = units
        .iter()
        .find(|u| u["children_json"].as_str().is_some_and(|c| c.contains("A long job")))
        .expect("the unit was recorded before the child started")
        .clone();
    let children: Value =
        serde_json::from_str(unit["children_json"].as_str().unwrap_or("[]")).expect("children");
    let session = children[0]["session_id"].as_str().expect("child session").to_owned();
    let messages =
        HermesDb::table_rows_of(&fx.db(), "messages", &["session_id", "role", "content"]);
    let transcript: Vec<&Value> = messages.iter().filter(|m| m["session_id"] == session).collect();
    let roles: Vec<&str> = transcript.iter().filter_map(|m| m["role"].as_str()).collect();
    // Everything up to the last completed step, nothing of the interrupted call.
    assert_eq!(roles, ["system", "user", "assistant", "tool"], "{transcript:?}");
    assert!(transcript.iter().all(|m| m["content"] != "never written"));

    let v = fx.ok(0, &["recover"]);
    assert!(v["abandoned"].as_u64().unwrap_or(0) >= 1, "{v}");
    let after = HermesDb::table_rows_of(&fx.db(), "async_delegations", &["delegation_id", "state"]);
    let state = after.iter().find(|u| u["delegation_id"] == unit["delegation_id"]).expect("unit");
    assert_eq!(state["state"], "unknown");
}

#[test]
fn two_processes_racing_for_the_last_dollar_never_overspend() {
    let fx = Fx::new();
    // Each child run costs $0.01 (the fake model reports it); the lineage may spend $0.01.
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  budget:\n    max_cost_usd: 0.01\n",
        fx.model.base_url()
    );
    std::fs::write(fx.home.path().join("config.yaml"), yaml).expect("config.yaml");
    for round in 0..3 {
        let parent = format!("race-{round}");
        // A parent that exists: an unknown one has no provable budget root
        // and is refused under a budget (fail closed).
        HermesDb::open(&fx.home.db_path()).session(&HermesSession {
            id: parent.clone(),
            source: "cli".to_owned(),
            started_at: now(),
            ..HermesSession::default()
        });
        let spawn = || {
            fx.cmd(&["--json", "delegate", "--parent", &parent, "--goal", "the last dollar"])
                .output()
                .expect("run")
        };
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(spawn);
            let b = s.spawn(spawn);
            (a.join().expect("a"), b.join().expect("b"))
        });
        let outs: Vec<Value> = [&a, &b]
            .iter()
            .map(|o| serde_json::from_slice(&o.stdout).unwrap_or(Value::Null))
            .collect();
        let completed = outs.iter().filter(|v| v["results"][0]["status"] == "completed").count();
        assert!(completed <= 1, "both spent the last dollar: {outs:?}");
        let usage = fx.ok(0, &["usage", &parent]);
        let spent = usage["totals"]["cost_usd"].as_f64().unwrap_or(f64::NAN);
        assert!(spent <= 0.01 + 1e-9, "overspent: {usage}");
        // The loser was told why, with the numbers.
        let loser = outs
            .iter()
            .find(|v| v["results"][0]["status"] != "completed")
            .expect("one of the two lost");
        let why = loser["error"].as_str().or_else(|| loser["results"][0]["error"].as_str());
        assert!(why.is_some_and(|w| w.contains("budget") || w.contains("Budget")), "{loser}");
    }
}

// ---------------------------------------------------------------- safe on a real hermes home (issue 12)

/// The file's bytes, mtime and the directory's entries.
fn fingerprint(db: &Path) -> (Vec<u8>, SystemTime, Vec<String>) {
    let bytes = std::fs::read(db).expect("read db");
    let mtime = std::fs::metadata(db).and_then(|m| m.modified()).expect("mtime");
    let mut names: Vec<String> = std::fs::read_dir(db.parent().expect("dir"))
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        // SQLite's own companions of a WAL database are allowed.
        .filter(|n| !n.ends_with("-wal") && !n.ends_with("-shm"))
        .collect();
    names.sort();
    (bytes, mtime, names)
}

/// Every read command, with its arguments on the standard fixture.
fn read_commands(fx: &HermesFixture) -> Vec<Vec<&'static str>> {
    vec![
        vec!["children", "list"],
        vec!["children", "list", "--owner", fx.continuation],
        vec!["children", "show", fx.batch_subagents[0]],
        vec!["children", "show", fx.solo],
        vec!["authority", fx.batch_subagents[1], "--caller", fx.continuation],
        vec!["lineage", fx.continuation],
        vec!["usage", fx.root],
        vec!["usage", fx.continuation, "--lineage"],
    ]
}

#[test]
fn read_commands_never_write_and_answer_as_after_adoption() {
    let fx = Fx::new();
    let before = fingerprint(&fx.db());
    let mut answers = Vec::new();
    for args in read_commands(&fx.fx) {
        let (code, v, err) = fx.json(&args);
        assert!(code == 0 || code == 3, "{args:?}: {code} {v} {err}");
        answers.push((code, v));
        assert_eq!(fingerprint(&fx.db()), before, "{args:?} wrote to the file");
    }
    // A write command adopts the hermes rows; every read answers the same.
    fx.ok(0, &["recover"]);
    let adopted = fingerprint(&fx.db());
    for (args, (code, v)) in read_commands(&fx.fx).into_iter().zip(&answers) {
        let (now_code, now_v, _) = fx.json(&args);
        assert_eq!((now_code, &now_v), (*code, v), "{args:?} differs after adoption");
        assert_eq!(fingerprint(&fx.db()), adopted, "{args:?} wrote to the adopted file");
    }
    // `recover` marked the abandoned hermes unit; nothing else changed.
    fx.assert_additive(&[("async_delegations", "deleg_h0000005")]);
}

#[test]
fn reads_never_wait_for_a_hermes_writer_holding_the_lock() {
    let fx = Fx::new();
    let expected = fx.ok(0, &["children", "list"]);
    let writer = HermesDb::open(&fx.db());
    writer.connection().execute_batch("BEGIN IMMEDIATE").expect("lock");
    writer
        .connection()
        .execute_batch("UPDATE sessions SET title = 'held' WHERE 0")
        .expect("write under the lock");
    // Correctness, not timing: the read answers from the last commit.
    assert_eq!(fx.ok(0, &["children", "list"]), expected);
    assert_eq!(fx.ok(0, &["lineage", fx.fx.continuation])["root"], json!(fx.fx.root));
    writer.connection().execute_batch("ROLLBACK").expect("unlock");
}

/// The waited and timeout seconds of a `database is busy: waited X s for
/// another writer's lock (busy timeout Y s)` message.
fn busy_figures(message: &str) -> (f64, f64) {
    let number_after = |key: &str| -> f64 {
        let rest =
            &message[message.find(key).unwrap_or_else(|| panic!("{key}: {message}")) + key.len()..];
        rest.split_whitespace().next().expect("number").parse().expect("seconds")
    };
    (number_after("waited "), number_after("busy timeout "))
}

#[test]
fn writes_that_must_wait_report_the_time_waited_and_the_configured_timeout() {
    let fx = Fx::new();
    let config = fx.home.path().join("config.yaml");
    let mut yaml = std::fs::read_to_string(&config).expect("config.yaml");
    yaml.push_str("database:\n  busy_timeout_seconds: 0.3\n");
    std::fs::write(&config, yaml).expect("config.yaml");
    let mut reports = Vec::new();
    // First on the hermes file (the busy is met in the open sequence, while
    // adopting it), then on the adopted file (met by the prune's own write:
    // with a TTL of 0 every live child is due; opening a current file takes
    // no lock, and a prune with nothing due writes nothing).
    for stage in ["open sequence", "prune write"] {
        let prune: &[&str] = if stage == "prune write" {
            &["children", "prune", "--ttl-hours", "0"]
        } else {
            &["children", "prune"]
        };
        if stage == "prune write" {
            assert_eq!(fx.ok(0, &["children", "prune"]), json!({ "tombstoned": 0, "children": 0 }));
        }
        let before = std::fs::read(fx.db()).expect("bytes");
        let writer = HermesDb::open(&fx.db());
        writer.connection().execute_batch("BEGIN IMMEDIATE").expect("lock");
        let started = std::time::Instant::now();
        let (code, v, err) = fx.json(prune);
        let wall = started.elapsed().as_secs_f64();
        let (hcode, _, herr) = fx.human(prune);
        // A read never waits for the writer (WAL), even with the lock held.
        let read_started = std::time::Instant::now();
        fx.ok(0, &["children", "list"]);
        assert!(read_started.elapsed().as_secs_f64() < 5.0);
        writer.connection().execute_batch("ROLLBACK").expect("unlock");
        drop(writer);
        assert_eq!((code, hcode), (1, 1), "{stage}: {v} {err}");
        assert_eq!(v["code"], "busy", "{stage}");
        let message = v["error"].as_str().expect("error");
        assert!(message.starts_with("database is busy: waited "), "{stage}: {message}");
        assert!(herr.contains("database is busy: waited "), "{stage}: {herr}");
        let (waited, timeout) = busy_figures(message);
        // The configured timeout, the time actually waited (at least the
        // timeout, never a multiple of it) and the wall clock agree.
        assert!((timeout - 0.3).abs() < 1e-9, "{stage}: {message}");
        assert!(waited >= timeout, "{stage}: {message}");
        assert!(waited <= wall + 0.05, "{stage}: waited {waited} s in {wall} s: {message}");
        assert!(wall < 0.3 * 2.0 + 1.5, "{stage}: the wait took {wall} s: {message}");
        if stage == "open sequence" {
            assert_eq!(std::fs::read(fx.db()).expect("bytes"), before, "refused adoption wrote");
        }
        let redacted = message.replacen(&format!("waited {waited:.1} s"), "waited <w> s", 1);
        reports.push(format!("{stage}: exit {code}, code {}\n  {redacted}", v["code"]));
    }
    insta::assert_snapshot!("busy_write_reports_its_wait", reports.join("\n"));
    // Once the lock is released, the same command goes through.
    assert_eq!(fx.ok(0, &["children", "prune"]), json!({ "tombstoned": 0, "children": 0 }));
}

#[test]
fn bad_rows_where_a_read_must_fail_name_the_table_and_rowid() {
    let fx = Fx::new();
    let raw = rusqlite::Connection::open(fx.db()).expect("raw");
    // A ledger row whose usage_json is not UTF-8: the ledger reads on (that
    // row counts as malformed, semantics §2.7) and a warning names table and rowid.
    raw.execute(
        "INSERT INTO delegation_child_usage (parent_session_id, parent_turn_id, \
         child_session_id, usage_json, created_at) \
         VALUES (?1, 't-bad', 'c-bad', CAST(x'fffe7b' AS TEXT), ?2)",
        rusqlite::params![fx.fx.root, now()],
    )
    .expect("bad ledger row");
    let ledger_rowid = raw.last_insert_rowid();
    let (code, _, err) = fx.json(&["usage", fx.fx.root]);
    assert_eq!(code, 0, "{err}");
    let warning = format!(
        "delegation_child_usage rowid {ledger_rowid}: usage_json is not UTF-8 text; \
         read as malformed (absent)"
    );
    assert!(err.contains(&warning), "{err}");
    // A sessions row with a BLOB id among the root's children: a lineage walk
    // cannot tell which session it is, so it fails closed naming the row.
    raw.execute(
        "INSERT INTO sessions (id, source, parent_session_id, started_at) \
         VALUES (x'ff00fe', 'cli', ?1, ?2)",
        rusqlite::params![fx.fx.root, now()],
    )
    .expect("blob id");
    let session_rowid = raw.last_insert_rowid();
    drop(raw);
    let (code, v, err) = fx.json(&["lineage", fx.fx.continuation]);
    let named = format!("sessions rowid {session_rowid} has an unreadable id");
    assert!(v.to_string().contains(&named), "{code} {v} {err}");
    insta::assert_snapshot!(
        "bad_rows_named",
        format!(
            "usage stderr: {}\nlineage exit {code}: {}",
            warning.replace(&ledger_rowid.to_string(), "<rowid>"),
            v.to_string().replace(&session_rowid.to_string(), "<rowid>")
        )
    );
}

#[test]
fn missing_state_db_is_not_found_and_nothing_is_created() {
    let tmp = TempHome::new();
    let home = tmp.path().join("typo");
    for args in [
        vec!["children", "list"],
        vec!["children", "show", "x"],
        vec!["lineage", "s"],
        vec!["usage", "s"],
        vec!["authority", "x", "--caller", "s"],
        vec!["children", "tombstone", "x"],
        vec!["children", "prune"],
        vec!["recover"],
    ] {
        let out = Command::new(BIN)
            .arg("--home")
            .arg(&home)
            .arg("--json")
            .args(&args)
            .env_remove("HERMES_HOME")
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(4), "{args:?}");
        let v: Value = serde_json::from_slice(&out.stdout).expect("json");
        let text =
            v["error"].as_str().expect("error").replace(&home.display().to_string(), "[HOME]");
        assert_eq!(text, "no state.db at [HOME]/state.db", "{args:?}");
        assert_eq!(v["code"], "not_found");
        assert!(!home.exists(), "{args:?} created the home");
    }
}

/// Runs `retinue --json ARGS` with `--db db`, in `cwd`: exit code and the error text
/// with `db` replaced by `[DB]`.
fn db_error(cwd: &Path, db: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .current_dir(cwd)
        .arg("--home")
        .arg(cwd)
        .arg("--db")
        .arg(db)
        .arg("--json")
        .args(args)
        .env_remove("HERMES_HOME")
        .output()
        .expect("run");
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    let text = v["error"].as_str().unwrap_or_default().replace(&db.display().to_string(), "[DB]");
    (out.status.code().expect("code"), text, v["code"].as_str().unwrap_or_default().to_owned())
}

/// The raw `--json` stdout of `retinue --db db ARGS`.
fn stdout_of(cwd: &Path, db: &Path, args: &[&str]) -> String {
    let out = Command::new(BIN)
        .current_dir(cwd)
        .arg("--home")
        .arg(cwd)
        .arg("--db")
        .arg(db)
        .arg("--json")
        .args(args)
        .env_remove("HERMES_HOME")
        .output()
        .expect("run");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn hostile_paths_get_a_clear_answer_at_once() {
    let tmp = TempHome::new();
    let cwd = tmp.path();
    // A directory.
    let dir = cwd.join("adir");
    std::fs::create_dir(&dir).expect("dir");
    let mut seen = Vec::new();
    for args in [&["children", "list"][..], &["children", "prune"][..]] {
        seen.push(db_error(cwd, &dir, args));
    }
    // A FIFO: refused without opening it (opening would block).
    let fifo = cwd.join("afifo");
    let made = Command::new("mkfifo").arg(&fifo).status().map(|s| s.success()).unwrap_or(false);
    if made {
        seen.push(db_error(cwd, &fifo, &["children", "list"]));
        seen.push(db_error(cwd, &fifo, &["recover"]));
    }
    // A URL is never a file path: no `postgres:` (or `mysql:`) folder appears.
    seen.push(db_error(cwd, Path::new("mysql://h/db"), &["children", "list"]));
    seen.push(db_error(cwd, Path::new("mysql://h/db"), &["recover"]));
    assert!(!cwd.join("mysql:").exists());
    // Team mode without an explicit profile is refused before connecting.
    for args in [&["children", "list"][..], &["recover"][..]] {
        let out = Command::new(BIN)
            .current_dir(cwd)
            .args(["--home"])
            .arg(cwd)
            .args(["--db", "postgres://u:hunter2@127.0.0.1:1/db", "--json"])
            .args(args)
            .env_remove("HERMES_HOME")
            .env_remove("HERMES_PROFILE")
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(2));
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("needs an explicit profile"), "{text}");
        assert!(text.contains("postgres://***@127.0.0.1:1/db") && !text.contains("hunter2"));
    }
    assert!(!cwd.join("postgres:").exists());
    // A home that is a file.
    let file = cwd.join("afile");
    std::fs::write(&file, b"not a home").expect("file");
    let out = Command::new(BIN)
        .arg("--home")
        .arg(&file)
        .args(["--json", "children", "list"])
        .output()
        .expect("run");
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    seen.push((
        out.status.code().expect("code"),
        v["error"].as_str().unwrap_or_default().replace(&file.display().to_string(), "[HOME]"),
        v["code"].as_str().unwrap_or_default().to_owned(),
    ));
    if made {
        insta::assert_debug_snapshot!("hostile_paths", seen);
    }
}

#[test]
fn foreign_and_corrupt_files_are_refused_unmodified() {
    let tmp = TempHome::new();
    let cwd = tmp.path();
    // A SQLite file that is neither hermes' nor Retinue's.
    let foreign = cwd.join("foreign.db");
    {
        let db = HermesDb::open(&foreign);
        db.connection()
            .execute_batch("CREATE TABLE notes (x TEXT); INSERT INTO notes VALUES ('a');")
            .expect("ddl");
    }
    let before = std::fs::read(&foreign).expect("read");
    let mut seen = Vec::new();
    for args in [&["children", "list"][..], &["recover"][..], &["usage", "s"][..]] {
        seen.push(db_error(cwd, &foreign, args));
        assert_eq!(std::fs::read(&foreign).expect("read"), before, "{args:?} modified it");
    }
    // `migrate` checks its source as the read commands do (before any connection).
    let migrate = db_error(cwd, &foreign, &["migrate", "--to", "postgres://u@127.0.0.1:1/db"]);
    assert_eq!(migrate, seen[0], "migrate refuses a foreign file as `children list` does");
    assert_eq!(std::fs::read(&foreign).expect("read"), before, "migrate modified it");
    // A hermes file with a damaged page: refused before any schema change, byte-identical.
    let home = TempHome::new();
    let fxd = HermesDb::standard(&home.db_path(), now());
    drop(fxd);
    let intact: Vec<(i32, String)> = [&["children", "list"][..], &["usage", "h-root"][..]]
        .iter()
        .map(|args| {
            let (code, _, _) = db_error(cwd, &home.db_path(), args);
            (code, stdout_of(cwd, &home.db_path(), args))
        })
        .collect();
    let mut bytes = std::fs::read(home.db_path()).expect("read");
    let page = 4096;
    assert!(bytes.len() > 3 * page, "fixture too small");
    for b in &mut bytes[2 * page..2 * page + 200] {
        *b = 0xA5;
    }
    std::fs::write(home.db_path(), &bytes).expect("corrupt");
    for args in [&["recover"][..], &["children", "prune"][..]] {
        let (code, text, kind) = db_error(cwd, &home.db_path(), args);
        assert_eq!(code, 1, "{args:?}: {text}");
        assert!(text.contains("database is corrupt"), "{args:?}: {text}");
        assert_eq!(kind, "corrupt");
        assert_eq!(std::fs::read(home.db_path()).expect("read"), bytes, "{args:?} wrote");
    }
    // Reads meet the damage as an error (`corrupt`), never as a wrong or empty answer.
    for (args, (code0, out0)) in
        [&["children", "list"][..], &["usage", "h-root"][..]].iter().zip(&intact)
    {
        let (code, text, kind) = db_error(cwd, &home.db_path(), args);
        if code == 0 {
            assert_eq!((code, stdout_of(cwd, &home.db_path(), args)), (*code0, out0.clone()));
        } else {
            assert_eq!(kind, "corrupt", "{args:?}: {text}");
        }
    }
    insta::assert_debug_snapshot!("foreign_file", seen);
}

// ---------------------------------------------------------------- budgets that hold (issue 23)

#[test]
fn an_invalid_budget_setting_is_exit_2_with_no_model_call() {
    let fx = Fx::new();
    for (setting, shown) in [
        ("max_cost_usd: -5", "= -5"),
        ("max_cost_usd: .nan", "NaN"),
        ("max_cost_usd: .inf", "inf"),
        ("max_cost_usd: \"5\"", "= \"5\""),
        ("max_tokens: -100", "= -100"),
        ("max_tokens: 1.5", "= 1.5"),
    ] {
        let yaml = format!(
            "delegation:\n  model: test/fake-model\n  base_url: {}\n  budget:\n    {setting}\n",
            fx.model.base_url()
        );
        std::fs::write(fx.home.path().join("config.yaml"), yaml).expect("config.yaml");
        let (code, _, err) = fx.human(&["delegate", "--goal", "spend freely"]);
        assert_eq!(code, 2, "{setting}: {err}");
        assert!(err.contains("delegation.budget."), "{setting}: {err}");
        assert!(err.to_lowercase().contains(&shown.to_lowercase()), "{setting}: {err}");
        assert_eq!(err.matches("is invalid").count(), 1, "said once: {err}");
        assert_eq!(fx.model.request_count(), 0, "{setting}: a model call was made");
    }
}

#[test]
fn a_valid_token_budget_bounds_each_call_and_succeeds() {
    // A valid token budget: the call carries its completion bound and the
    // command succeeds; the spend is on the ledger.
    let fx = Fx::new();
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  budget:\n    max_tokens: 100000\n",
        fx.model.base_url()
    );
    std::fs::write(fx.home.path().join("config.yaml"), yaml).expect("config.yaml");
    let out = fx.ok(0, &["delegate", "--goal", "bounded"]);
    assert_eq!(out["results"][0]["status"], "completed", "{out}");
    assert!(out.get("ledger_error").is_none(), "{out}");
    assert_eq!(out["budget"]["spent"]["tokens"], 120, "{out}");
    let sent = &fx.model.requests()[0].body;
    assert!(sent["max_completion_tokens"].as_u64().is_some_and(|n| n < 100_000), "{sent}");
}

// ---------------------------------------------------------------- tenants (issue 22)

#[test]
fn a_profiled_process_prunes_only_its_own_tenant() {
    let fx = Fx::new();
    // The fixture's solo unit belongs to the tenant `work`; the others are
    // unprofiled (hermes's, every tenant's).
    let solo = fx.fx.solo_subagent;
    assert_eq!(fx.ok(0, &["children", "show", solo])["owner_profile"], "work");
    // Another tenant's cap of 1 and TTL of 0 h prune its own and the
    // unprofiled units, never `work`'s.
    let v = fx.ok(
        0,
        &["--profile", "other", "children", "prune", "--max-retained", "1", "--ttl-hours", "0"],
    );
    assert!(v["tombstoned"].as_u64().is_some_and(|n| n > 0), "{v}");
    assert_eq!(fx.ok(0, &["children", "show", solo])["child_id"], solo, "work's unit was evicted");
    // `work`'s own process prunes it.
    let v = fx.ok(0, &["--profile", "work", "children", "prune", "--ttl-hours", "0"]);
    assert_eq!(v["tombstoned"], 1, "{v}");
    let (code, _, _) = fx.json(&["children", "show", solo]);
    assert_eq!(code, 4);
}

// ---------------------------------------------------------------- trust boundaries (issue 22)

fn sessions_count(fx: &Fx) -> usize {
    HermesDb::table_rows(&fx.home.db_path(), "sessions").len()
}

#[test]
fn an_unknown_parent_or_bad_arguments_write_nothing() {
    let fx = Fx::new();
    let before = sessions_count(&fx);
    let (code, _, err) = fx.json(&["delegate", "--parent", "no-such-session", "--goal", "x"]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("no session 'no-such-session'"), "{err}");
    let (code, _, err) = fx.json(&["delegate", "--tasks", "[]"]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(sessions_count(&fx), before, "a refused call left a session behind");
    assert_eq!(fx.model.request_count(), 0);
}

#[test]
fn every_child_failing_is_exit_1_with_the_results() {
    let fx = Fx::new();
    let failing = FakeModel::start();
    failing.set_default(Reply::unauthorized());
    configure_model(fx.home.path(), &failing);
    let (code, v, err) = fx.json(&["delegate", "--goal", "doomed"]);
    assert_eq!(code, 1, "{v} {err}");
    assert_eq!(v["results"][0]["status"], "error", "{v}");
    assert!(err.contains("every child failed"), "{err}");
    assert!(!err.contains("sk-test-secret") && !v.to_string().contains("sk-test-secret"));
}

#[test]
fn the_key_never_goes_over_plain_http_to_another_host() {
    let fx = Fx::new();
    let yaml = "delegation:\n  model: m\n  base_url: http://alice:PW@10.9.8.7:8000/v1?api_key=K123\n  api_key: sk-test-secret\n";
    std::fs::write(fx.home.path().join("config.yaml"), yaml).expect("config.yaml");
    let before = sessions_count(&fx);
    let (code, _, err) = fx.human(&["delegate", "--goal", "x"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("allow_insecure_http"), "{err}");
    for secret in ["PW", "K123", "sk-test-secret"] {
        assert!(!err.contains(secret), "{secret} leaked: {err}");
    }
    assert_eq!(sessions_count(&fx), before);
}

#[test]
fn a_follow_up_uses_the_configured_endpoint_never_the_stored_one() {
    let fx = Fx::new();
    let out = fx.ok(0, &["delegate", "--goal", "first task"]);
    let parent = out["parent_session_id"].as_str().expect("parent").to_owned();
    let child = out["results"][0]["subagent_id"].as_str().expect("child").to_owned();
    // Someone who can write the database plants their own endpoint.
    let planted = FakeModel::start();
    planted.set_default(Reply::text("stolen").with_usage(Usage::new(1, 1)));
    let db = HermesDb::open(&fx.home.db_path());
    let changed = db
        .connection()
        .execute(
            "UPDATE retinue_children SET manifest_json = json_set(manifest_json, '$.base_url', ?1)",
            [planted.base_url()],
        )
        .expect("plant");
    assert!(changed > 0);
    db.connection()
        .execute(
            "UPDATE async_delegations SET children_json = json_set(children_json, '$[0].base_url', ?1) \
             WHERE json_valid(children_json) AND json_array_length(children_json) > 0",
            [planted.base_url()],
        )
        .expect("plant");
    let v = fx.ok(
        0,
        &[
            "delegate",
            "--parent",
            &parent,
            "--follow-up",
            &child,
            "--goal",
            "more",
            "--model",
            "other/model",
        ],
    );
    assert_eq!(planted.request_count(), 0, "the key went to the planted endpoint");
    assert_eq!(v["results"][0]["status"], "completed", "{v}");
    assert_eq!(v["results"][0]["model"], "other/model", "{v}");
    assert_eq!(v["results"][0]["endpoint"], fx.model.base_url(), "{v}");
    let last = fx.model.requests().pop().expect("a request");
    assert_eq!(last.body["model"], "other/model");
}

/// A WAL-mode state.db on a read-only mount (a backup snapshot, another
/// user's home) is read as an immutable snapshot, and says so (issue #22).
/// The mount is made read-only inside a private user and mount namespace.
#[test]
fn a_wal_file_on_a_read_only_mount_is_read_as_a_snapshot() {
    let fx = Fx::new();
    let unshare = std::process::Command::new("unshare").arg("--version").output();
    if !unshare.is_ok_and(|o| o.status.success()) {
        panic!("unshare (util-linux) is needed for this test");
    }
    let expected = ids(&fx.ok(0, &["children", "list"]));
    {
        let db = HermesDb::open(&fx.home.db_path());
        let mode: String =
            db.connection().query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0)).expect("wal");
        assert_eq!(mode, "wal");
    }
    let dir = fx.home.path().to_string_lossy().into_owned();
    let script = format!(
        "mount --bind '{dir}' '{dir}' && mount -o remount,bind,ro '{dir}' && \
         touch '{dir}/probe' 2>/dev/null && exit 90; \
         exec '{BIN}' --home '{dir}' --json children list"
    );
    let out = std::process::Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "sh", "-c", &script])
        .env_remove("HERMES_HOME")
        .output()
        .expect("unshare");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let listed: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(ids(&listed), expected, "{stderr}");
    assert!(stderr.contains("immutable snapshot"), "{stderr}");
}

/// SIGINT and SIGTERM stop a running `delegate` cleanly (issue #22): the
/// blocked model call is abandoned, the child is reported interrupted, the
/// unit is recorded (never left `running`) and the exit code is 128 + signal.
#[test]
fn a_signal_stops_delegate_cleanly() {
    for (signal, code) in [("-TERM", 143), ("-INT", 130)] {
        let fx = Fx::new();
        let slow = FakeModel::start();
        // Without the signal the command would wait a minute for this answer.
        slow.set_default(
            Reply::text("too late").with_usage(Usage::new(1, 1)).delayed(Duration::from_secs(60)),
        );
        configure_model(fx.home.path(), &slow);
        let mut child = fx
            .cmd(&["--json", "delegate", "--goal", "wait for me"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        let started = std::time::Instant::now();
        while slow.request_count() == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the call never reached the model"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let status = std::process::Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
        // A liveness bound for the harness (the answer is 60 s away).
        let waited = std::time::Instant::now();
        let out = loop {
            if child.try_wait().expect("wait").is_some() {
                break child.wait_with_output().expect("output");
            }
            assert!(
                waited.elapsed() < Duration::from_secs(30),
                "{signal}: the command did not stop"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{signal}: {stderr}");
        let v: Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(v["interrupted"], true, "{v}");
        assert_eq!(v["results"][0]["status"], "interrupted", "{v}");
        let id = v["delegation_id"].as_str().expect("delegation id");
        let units = HermesDb::table_rows(&fx.home.db_path(), "async_delegations");
        let unit = units.iter().find(|u| u["delegation_id"] == id).expect("the unit");
        assert_eq!(unit["state"], "interrupted", "{unit}");
    }
}

/// `retinue mcp` recovers dead units when it starts (issue #22): a server
/// killed mid-delegate never leaves its unit `running` once it is back.
#[test]
fn mcp_recovers_dead_units_at_start() {
    let fx = Fx::new();
    let before: BTreeMap<String, Value> =
        HermesDb::table_rows(&fx.home.db_path(), "async_delegations")
            .into_iter()
            .map(|u| (u["delegation_id"].as_str().unwrap_or_default().to_owned(), u))
            .collect();
    let slow = FakeModel::start();
    slow.set_default(Reply::text("too late").delayed(Duration::from_secs(60)));
    configure_model(fx.home.path(), &slow);
    let mut child = fx.cmd(&["--json", "delegate", "--goal", "killed"]).spawn().expect("spawn");
    let started = std::time::Instant::now();
    while slow.request_count() == 0 {
        assert!(started.elapsed() < Duration::from_secs(30), "the call never reached the model");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    let state_of = |fx: &Fx| -> BTreeMap<String, String> {
        HermesDb::table_rows(&fx.home.db_path(), "async_delegations")
            .iter()
            .map(|u| {
                (
                    u["delegation_id"].as_str().unwrap_or_default().to_owned(),
                    u["state"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    };
    let units = state_of(&fx);
    let killed: Vec<&String> = units
        .iter()
        .filter(|(id, state)| *state == "running" && !before.contains_key(*id))
        .map(|(id, _)| id)
        .collect();
    assert_eq!(killed.len(), 1, "the killed command left its unit running: {units:?}");
    let killed = killed[0].clone();
    let out =
        fx.cmd(&["mcp", "--new-session"]).stdin(std::process::Stdio::null()).output().expect("mcp");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("abandoned delegation"), "{stderr}");
    let after = state_of(&fx);
    assert_ne!(after.get(&killed).map(String::as_str), Some("running"), "{stderr}");
}

/// Issue #22: `retinue mcp` answers malformed and oversized messages with
/// JSON-RPC errors (the client never waits forever) and keeps serving.
#[test]
fn mcp_answers_malformed_and_oversized_messages() {
    use std::io::{BufRead, Write};
    let fx = Fx::new();
    let mut server = fx
        .cmd(&["mcp", "--new-session"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("mcp");
    let mut stdin = server.stdin.take().expect("stdin");
    let stdout = server.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let next = || -> Value {
        let line = rx.recv_timeout(Duration::from_secs(30)).expect("an answer");
        serde_json::from_str(&line).expect("a JSON answer")
    };
    writeln!(stdin, "{{this is not json").expect("write");
    let v = next();
    assert_eq!(v["error"]["code"], -32700, "{v}");
    assert_eq!(v["id"], Value::Null);
    writeln!(stdin, "{{\"id\": 5, \"no\": \"jsonrpc\"}}").expect("write");
    let v = next();
    assert_eq!((v["error"]["code"].as_i64(), v["id"].as_i64()), (Some(-32600), Some(5)), "{v}");
    let huge = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"ping\",\"pad\":\"{}\"}}",
        "x".repeat(17 << 20)
    );
    writeln!(stdin, "{huge}").expect("write");
    let v = next();
    assert_eq!(v["error"]["code"], -32600, "{v}");
    // Still serving: a real request gets its answer.
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "0"}}});
    writeln!(stdin, "{init}").expect("write");
    let v = next();
    assert_eq!(v["id"], 1, "{v}");
    assert!(v["result"]["serverInfo"].is_object(), "{v}");
    drop(stdin);
    let status = server.wait().expect("exit");
    assert!(status.success(), "{status:?}");
}

/// Issue #22: a configuration warning is printed once, not once per load.
#[test]
fn a_config_warning_is_printed_once() {
    let fx = Fx::new();
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  stream: maybe\n",
        fx.model.base_url()
    );
    std::fs::write(fx.home.path().join("config.yaml"), yaml).expect("config.yaml");
    for args in [&["children", "list"][..], &["delegate", "--goal", "warned once"][..]] {
        let (_, _, err) = fx.json(args);
        assert_eq!(
            err.matches("delegation.stream has the wrong type").count(),
            1,
            "{args:?}: {err}"
        );
    }
}

/// Issue #22: an endpoint's secrets (userinfo, query values) appear nowhere:
/// not in retry warnings, errors, `--json` output or the stored columns.
#[test]
fn endpoint_secrets_never_leak() {
    let fx = Fx::new();
    let flaky = FakeModel::start();
    flaky.push_all([Reply::server_error(503), Reply::server_error(502), Reply::unauthorized()]);
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: http://alice:PW1234@{}/v1?api_key=QK5678\n  api_key: sk-test-secret\n",
        flaky.addr()
    );
    std::fs::write(fx.home.path().join("config.yaml"), yaml).expect("config.yaml");
    let out = fx
        .cmd(&["--json", "delegate", "--goal", "leak nothing"])
        .env("RETINUE_LOG", "warn")
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("retry"), "no retry warning to check: {stderr}");
    assert!(
        flaky.requests().iter().all(|r| r.header("authorization") == Some("Bearer sk-test-secret"))
    );
    let stored = format!(
        "{:?}{:?}",
        HermesDb::table_rows(&fx.home.db_path(), "async_delegations"),
        HermesDb::table_rows(&fx.home.db_path(), "retinue_children")
    );
    for secret in ["PW1234", "QK5678", "alice:", "sk-test-secret"] {
        assert!(!stdout.contains(secret), "{secret} in --json: {stdout}");
        assert!(!stderr.contains(secret), "{secret} in stderr: {stderr}");
        assert!(!stored.contains(secret), "{secret} in a stored column");
    }
}

/// Issue #22: `retinue mcp` in a working directory that was deleted says
/// what to do.
#[test]
fn mcp_in_a_deleted_directory_says_what_to_do() {
    let fx = Fx::new();
    let gone = tempfile::tempdir().expect("dir");
    let path = gone.path().join("project");
    // The directory is removed under a shell that stays in it, which then
    // starts the server there.
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "mkdir -p '{p}' && cd '{p}' && rmdir '{p}' && exec '{BIN}' --home '{h}' mcp </dev/null",
            p = path.display(),
            h = fx.home.path().display()
        ))
        .env_remove("HERMES_HOME")
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--session") && stderr.contains("--new-session"), "{stderr}");
}

/// Issue #22: the "no price" warning is logged once per model, not per call.
#[test]
fn the_no_price_warning_is_given_once() {
    let fx = Fx::new();
    let free = FakeModel::start();
    free.set_default(Reply::text("done").with_usage(Usage::new(10, 2)));
    configure_model(fx.home.path(), &free);
    let tasks = json!([{"goal": "a"}, {"goal": "b"}, {"goal": "c"}]).to_string();
    let out = fx
        .cmd(&["--json", "delegate", "--tasks", &tasks])
        .env("RETINUE_LOG", "warn")
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("no price for model").count(), 1, "{stderr}");
}

// ---------------------------------------------------------------- containment (#35)

#[test]
fn another_tenants_session_child_and_ledger_are_answered_as_missing() {
    let fx = Fx::new();
    let v = fx.ok(0, &["--profile", "a", "delegate", "--goal", "a's work"]);
    let parent = v["parent_session_id"].as_str().expect("parent").to_owned();
    let child = v["results"][0]["subagent_id"].as_str().expect("child").to_owned();
    let requests = fx.model.requests().len();
    // Tenant b cannot spawn (or bill) under a's session: "no session", exit 4,
    // the text of a session that does not exist.
    let (code, foreign, _) =
        fx.json(&["--profile", "b", "delegate", "--parent", &parent, "--goal", "steal"]);
    let (code_missing, missing, _) =
        fx.json(&["--profile", "b", "delegate", "--parent", "cli_nope", "--goal", "steal"]);
    assert_eq!((code, code_missing), (4, 4), "{foreign} / {missing}");
    assert_eq!(
        foreign["error"].as_str().map(|t| t.replace(&parent, "ID")),
        missing["error"].as_str().map(|t| t.replace("cli_nope", "ID"))
    );
    assert_eq!(fx.model.requests().len(), requests, "no child ran for b");
    // usage, lineage, authority, children show: exactly as missing.
    for (args, ghost) in [
        (vec!["usage", parent.as_str()], vec!["usage", "cli_nope"]),
        (vec!["lineage", parent.as_str()], vec!["lineage", "cli_nope"]),
        (vec!["children", "show", child.as_str()], vec!["children", "show", "sa-nope"]),
        (
            vec!["authority", child.as_str(), "--caller", parent.as_str()],
            vec!["authority", "sa-nope", "--caller", parent.as_str()],
        ),
    ] {
        let mut b = vec!["--profile", "b"];
        b.extend(&args);
        let (code, out, _) = fx.json(&b);
        let mut g = vec!["--profile", "b"];
        g.extend(&ghost);
        let (code_g, out_g, _) = fx.json(&g);
        assert_eq!((code, code_g), (4, 4), "{args:?}: {out} / {out_g}");
        let shown = out.to_string().replace(&parent, "ID").replace(&child, "ID");
        let shown_g = out_g.to_string().replace("cli_nope", "ID").replace("sa-nope", "ID");
        assert_eq!(shown, shown_g, "{args:?}");
        assert!(!shown.contains("\"a\"") && !shown.contains("profile 'a'"), "{shown}");
    }
    // wait / steer / cancel: another tenant's unit is not found, as a missing one.
    let unit = v["delegation_id"].as_str().expect("unit").to_owned();
    let (code, w, _) =
        fx.json(&["--profile", "b", "wait", &unit, "--parent", &parent, "--timeout", "0"]);
    assert_eq!((code, w["results"][0]["status"].clone()), (4, json!("not_found")), "{w}");
    let (c1, s1, _) =
        fx.json(&["--profile", "b", "steer", &child, "--message", "x", "--parent", &parent]);
    let (c2, s2, _) =
        fx.json(&["--profile", "b", "steer", "sa-nope", "--message", "x", "--parent", &parent]);
    assert_eq!(c1, c2, "{s1} / {s2}");
    assert_eq!(s1.to_string().replace(&child, "ID"), s2.to_string().replace("sa-nope", "ID"));
    let (c1, s1, _) = fx.json(&["--profile", "b", "cancel", &unit, "--parent", &parent]);
    let (c2, s2, _) = fx.json(&["--profile", "b", "cancel", "deleg_nope", "--parent", &parent]);
    assert_eq!(c1, c2, "{s1} / {s2}");
    assert_eq!(s1.to_string().replace(&unit, "ID"), s2.to_string().replace("deleg_nope", "ID"));
    // children list / list --all: not listed.
    for args in [
        vec!["--profile", "b", "children", "list"],
        vec!["--profile", "b", "children", "list", "--all"],
    ] {
        let listed = fx.ok(0, &args);
        assert!(!listed.to_string().contains(&child), "{args:?}: {listed}");
    }
    // Tenant a still sees its own.
    assert_eq!(
        fx.ok(0, &["--profile", "a", "usage", &parent])["records"].as_array().map(Vec::len),
        Some(1)
    );
    fx.ok(0, &["--profile", "a", "children", "show", &child]);
    // A tenant name with SQL metacharacters is just a name.
    fx.ok(4, &["--profile", "a' OR '1'='1", "usage", &parent]);
}

#[test]
fn a_workspace_of_root_or_the_home_directory_is_refused_naming_the_flag() {
    let fx = Fx::new();
    let dir = tempfile::tempdir().expect("tmp");
    let link = dir.path().join("to-root");
    std::os::unix::fs::symlink("/", &link).expect("link");
    let home = std::env::var("HOME").expect("HOME");
    for ws in ["/", "/etc", "/tmp", link.to_str().expect("utf8"), home.as_str()] {
        let (code, _, err) = fx.human(&["delegate", "--workspace", ws, "--goal", "x"]);
        assert_eq!(code, 2, "{ws}: {err}");
        assert!(err.contains("--workspace"), "{ws}: {err}");
    }
    // Retinue's own home is never a workspace either.
    let (code, _, err) = fx.human(&[
        "delegate",
        "--workspace",
        fx.home.path().to_str().expect("utf8"),
        "--goal",
        "x",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("Retinue's home"), "{err}");
    // Run from `/` with no --workspace: refused too, never a silent `/`.
    let out = fx.cmd(&["delegate", "--goal", "x"]).current_dir("/").output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the current directory"));
    assert!(fx.model.requests().is_empty(), "no child ran");
}

// The crate's other suites, in this one test binary (one link, one process
// start per run).
mod approvals;
mod background;
mod conventions;
mod isolation;
mod mcp_tasks;
mod pg;
mod tools;
mod tracing;
mod web_browser;
