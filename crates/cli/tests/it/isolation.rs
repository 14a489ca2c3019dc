//! Isolated children (#38) through the real binary: a git worktree per
//! child, its change set reviewed, applied or discarded, receipts, and
//! follow-ups in the same worktree — with testkit's fake model scripting
//! the writes.

use std::path::{Path, PathBuf};
use std::process::Command;

use retinue_testkit::TempHome;
use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_retinue");

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgSign=false"])
        .args(args)
        .output()
        .expect("git");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A repository with `src/lib.rs` committed.
fn repository() -> tempfile::TempDir {
    let ws = tempfile::tempdir().expect("ws");
    std::fs::create_dir_all(ws.path().join("src")).expect("mkdir");
    std::fs::write(ws.path().join("src/lib.rs"), "one\ntwo\nthree\n").expect("write");
    git(ws.path(), &["init", "-q", "-b", "main"]);
    git(ws.path(), &["add", "-A"]);
    git(ws.path(), &["commit", "-q", "-m", "init"]);
    ws
}

fn retinue(home: &Path, cwd: &Path, args: &[&str]) -> (i32, Value, String) {
    let out = Command::new(BIN)
        .arg("--home")
        .arg(home)
        .arg("--json")
        .args(args)
        .current_dir(cwd)
        .env_remove("HERMES_HOME")
        .env_remove("HERMES_PROFILE")
        .output()
        .expect("run retinue");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let v = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), v, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A model whose children do what their goal says: `write X` writes
/// `src/lib.rs` with line two replaced by X; `read` reads `notes.md`;
/// `note` writes `notes.md`; anything else answers at once.
fn writing_model() -> FakeModel {
    let model = FakeModel::start();
    model.set_handler(|request| {
        let messages = request.messages();
        let last = messages.last()?;
        let user = messages.iter().rev().find(|m| m["role"] == "user")?;
        let goal = user["content"].as_str().unwrap_or_default().to_owned();
        if last["role"] == "tool" {
            let seen = last["content"].as_str().unwrap_or_default();
            return Some(Reply::text(&format!("done: {seen}")).with_usage(Usage::new(50, 10)));
        }
        let call = if let Some(x) = goal.strip_prefix("write ") {
            let x = x.lines().next().unwrap_or_default();
            Reply::tool_call(
                "w1",
                "write_file",
                json!({"path": "src/lib.rs", "content": format!("one\n{x}\nthree\n")}),
            )
        } else if goal.starts_with("note") {
            Reply::tool_call("n1", "write_file", json!({"path": "notes.md", "content": "first\n"}))
        } else if goal.starts_with("read") {
            Reply::tool_call("r1", "read_file", json!({"path": "notes.md"}))
        } else {
            Reply::text("nothing to do")
        };
        Some(call.with_usage(Usage::new(40, 8)))
    });
    model
}

fn configure(home: &Path, model: &FakeModel, extra: &str) {
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test\n  toolsets: [read, file]\n{extra}",
        model.base_url()
    );
    std::fs::write(home.join("config.yaml"), yaml).expect("config.yaml");
}

fn worktree_of(v: &Value) -> PathBuf {
    PathBuf::from(v["changes"]["worktree"].as_str().expect("worktree"))
}

#[test]
fn parallel_isolated_children_apply_then_conflict_and_discard() {
    let home = TempHome::new();
    let ws = repository();
    let model = writing_model();
    configure(home.path(), &model, "");
    let tasks = r#"[{"goal":"write TWO by a"},{"goal":"write TWO by b"}]"#;
    let (code, v, err) =
        retinue(home.path(), ws.path(), &["delegate", "--isolation", "worktree", "--tasks", tasks]);
    assert_eq!(code, 0, "{v} {err}");
    let (a, b) = (&v["results"][0], &v["results"][1]);
    for r in [a, b] {
        assert_eq!(r["status"], "completed", "{v}");
        assert_eq!(r["changes"]["state"], "pending", "{r}");
        assert_eq!(r["receipts"]["files_written"], json!(["src/lib.rs"]), "{r}");
        assert_eq!(
            r["receipts"]["line"],
            "receipts: 1 tool call (write_file ×1); changed: src/lib.rs (+1 −1)",
            "{r}"
        );
        let worktree = worktree_of(r);
        assert!(
            worktree.starts_with(home.path().join("retinue/worktrees")),
            "{}",
            worktree.display()
        );
    }
    // Neither saw the other's edit; the user's workspace is unchanged.
    let read = |p: PathBuf| std::fs::read_to_string(p).expect("read");
    assert_eq!(read(worktree_of(a).join("src/lib.rs")), "one\nTWO by a\nthree\n");
    assert_eq!(read(worktree_of(b).join("src/lib.rs")), "one\nTWO by b\nthree\n");
    assert_eq!(read(ws.path().join("src/lib.rs")), "one\ntwo\nthree\n");
    let sa = |r: &Value| r["subagent_id"].as_str().expect("sa").to_owned();
    let (sa_a, sa_b) = (sa(a), sa(b));

    let (code, listed, _) = retinue(home.path(), ws.path(), &["changes", "--pending"]);
    assert_eq!(code, 0);
    assert_eq!(listed["changes"].as_array().map(Vec::len), Some(2), "{listed}");
    let (code, diff, _) = retinue(home.path(), ws.path(), &["changes", &sa_a, "--diff"]);
    assert_eq!(code, 0);
    assert!(diff["diff"].as_str().is_some_and(|d| d.contains("+TWO by a")), "{diff}");

    // A stranger session is answered as if nothing existed.
    let (code, denied, _) =
        retinue(home.path(), ws.path(), &["apply", &sa_a, "--parent", "stranger"]);
    assert_eq!(code, 4, "{denied}");
    assert_eq!(read(ws.path().join("src/lib.rs")), "one\ntwo\nthree\n");

    let parent = v["parent_session_id"].as_str().expect("parent").to_owned();
    let (code, applied, err) =
        retinue(home.path(), ws.path(), &["apply", &sa_a, "--parent", &parent]);
    assert_eq!(code, 0, "{applied} {err}");
    assert_eq!(applied["state"], "applied");
    assert_eq!(read(ws.path().join("src/lib.rs")), "one\nTWO by a\nthree\n");

    let (code, conflict, _) = retinue(home.path(), ws.path(), &["apply", &sa_b]);
    assert_eq!(code, 1, "{conflict}");
    assert_eq!(conflict["code"], "conflict", "{conflict}");
    assert_eq!(conflict["files"], json!(["src/lib.rs"]), "{conflict}");
    assert_eq!(
        read(ws.path().join("src/lib.rs")),
        "one\nTWO by a\nthree\n",
        "nothing half-applied"
    );

    let (code, again, _) = retinue(home.path(), ws.path(), &["apply", &sa_a]);
    assert_eq!(code, 1, "{again}");
    assert!(again["error"].as_str().is_some_and(|e| e.contains("already applied")), "{again}");

    let (code, dropped, _) = retinue(home.path(), ws.path(), &["discard", &sa_b]);
    assert_eq!(code, 0, "{dropped}");
    assert!(!worktree_of(b).exists(), "discard removes the worktree");
    let (_, shown, _) = retinue(home.path(), ws.path(), &["changes", &sa_b]);
    assert_eq!(shown["state"], "discarded");
    // children show carries the receipts of the whole transcript.
    let (code, child, _) = retinue(home.path(), ws.path(), &["children", "show", &sa_a]);
    assert_eq!(code, 0);
    assert_eq!(child["receipts"]["files_written"], json!(["src/lib.rs"]), "{child}");
}

#[test]
fn a_follow_up_continues_in_the_worktree_and_prune_keeps_unapplied_changes() {
    let home = TempHome::new();
    let ws = repository();
    let model = writing_model();
    configure(home.path(), &model, "  isolation: worktree\n");
    let (code, v, err) = retinue(home.path(), ws.path(), &["delegate", "--goal", "note it"]);
    assert_eq!(code, 0, "{v} {err}");
    let r = &v["results"][0];
    assert_eq!(r["changes"]["files"][0]["status"], "added", "{r}");
    let sa = r["subagent_id"].as_str().expect("sa").to_owned();
    let parent = v["parent_session_id"].as_str().expect("parent").to_owned();
    assert!(!ws.path().join("notes.md").exists());

    let (code, fu, err) = retinue(
        home.path(),
        ws.path(),
        &["delegate", "--parent", &parent, "--follow-up", &sa, "--goal", "read your notes"],
    );
    assert_eq!(code, 0, "{fu} {err}");
    let summary = fu["results"][0]["summary"].as_str().unwrap_or_default().to_owned();
    assert!(summary.contains("first"), "the follow-up read its own worktree: {fu}");
    assert_eq!(fu["results"][0]["receipts"]["files_read"], json!(["notes.md"]), "{fu}");
    assert_eq!(fu["results"][0]["changes"]["state"], "pending", "still pending: {fu}");

    // An isolated child that changed nothing, then both tombstoned; the
    // next delegation's sweep removes the empty worktree and keeps the
    // pending one (kept and listed).
    let (code, quiet, err) = retinue(home.path(), ws.path(), &["delegate", "--goal", "idle"]);
    assert_eq!(code, 0, "{quiet} {err}");
    assert_eq!(quiet["results"][0]["changes"]["state"], "empty", "{quiet}");
    assert_eq!(quiet["results"][0]["receipts"]["line"], "receipts: no tool calls");
    let quiet_tree = worktree_of(&quiet["results"][0]);
    for id in [&sa, quiet["results"][0]["subagent_id"].as_str().expect("sa")] {
        let (code, out, err) = retinue(home.path(), ws.path(), &["children", "tombstone", id]);
        assert_eq!(code, 0, "{out} {err}");
    }
    let (code, more, err) =
        retinue(home.path(), ws.path(), &["delegate", "--goal", "idle", "--isolation", "none"]);
    assert_eq!(code, 0, "{more} {err}");
    assert!(more["results"][0].get("changes").is_none(), "{more}");
    assert!(!quiet_tree.exists(), "the empty worktree of a tombstoned child is removed");
    assert!(worktree_of(r).exists(), "an unapplied worktree is kept");
    let (_, pending, _) = retinue(home.path(), ws.path(), &["changes", "--pending"]);
    assert_eq!(pending["changes"][0]["subagent_id"], json!(sa), "{pending}");
    // Its parent may still apply it.
    let (code, applied, err) =
        retinue(home.path(), ws.path(), &["apply", &sa, "--parent", &parent]);
    assert_eq!(code, 0, "{applied} {err}");
    assert_eq!(std::fs::read_to_string(ws.path().join("notes.md")).expect("notes"), "first\n");
}

#[test]
fn isolation_outside_a_repository_is_refused_before_anything_runs() {
    let home = TempHome::new();
    let ws = tempfile::tempdir().expect("ws");
    let model = writing_model();
    configure(home.path(), &model, "");
    let (code, v, err) =
        retinue(home.path(), ws.path(), &["delegate", "--isolation", "worktree", "--goal", "x"]);
    assert_eq!(code, 2, "{v} {err}");
    assert!(v["error"].as_str().is_some_and(|e| e.contains("needs a git repository")), "{v}");
    assert!(model.requests().is_empty(), "no child ran");
    let (code, bad, _) =
        retinue(home.path(), ws.path(), &["delegate", "--isolation", "sideways", "--goal", "x"]);
    assert_eq!(code, 2, "{bad}");
}

#[test]
fn a_follow_up_without_its_worktree_record_is_refused_not_shared() {
    let home = TempHome::new();
    let ws = repository();
    let model = writing_model();
    configure(home.path(), &model, "  isolation: worktree\n");
    let (code, v, err) = retinue(home.path(), ws.path(), &["delegate", "--goal", "note it"]);
    assert_eq!(code, 0, "{v} {err}");
    let sa = v["results"][0]["subagent_id"].as_str().expect("sa").to_owned();
    let parent = v["parent_session_id"].as_str().expect("parent").to_owned();
    std::fs::remove_file(home.path().join(format!("retinue/worktrees/{sa}.json"))).expect("rm");
    let (code, fu, _) = retinue(
        home.path(),
        ws.path(),
        &["delegate", "--parent", &parent, "--follow-up", &sa, "--goal", "note it again"],
    );
    assert_ne!(code, 0, "{fu}");
    assert!(!ws.path().join("notes.md").exists(), "never written into the shared workspace");
}

#[test]
fn an_isolated_child_cannot_commit_and_its_failing_command_is_in_its_receipts() {
    let probe_ws = tempfile::tempdir().expect("probe workspace");
    let probe = Command::new(BIN)
        .args(["__sandbox", "--probe", "--workspace"])
        .arg(probe_ws.path())
        .output()
        .expect("probe");
    if !probe.status.success() {
        let why = String::from_utf8_lossy(&probe.stderr);
        assert!(std::env::var_os("RETINUE_REQUIRE_SANDBOX").is_none(), "no sandbox: {why}");
        eprintln!("note: SKIPPED: no sandbox on this machine: {why}");
        return;
    }
    let home = TempHome::new();
    let ws = repository();
    let model = FakeModel::start();
    model.set_handler(|request| {
        let last = request.messages().last()?.clone();
        if last["role"] == "tool" {
            return Some(Reply::text("committed, I promise").with_usage(Usage::new(50, 10)));
        }
        let command = "echo x >> src/lib.rs; git commit -qam sneaky";
        Some(
            Reply::tool_call("t1", "terminal", json!({"command": command}))
                .with_usage(Usage::new(40, 8)),
        )
    });
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test\n  toolsets: [terminal]\n  approvals: {{mode: allow}}\n",
        model.base_url()
    );
    std::fs::write(home.path().join("config.yaml"), yaml).expect("config.yaml");
    let (code, v, err) = retinue(
        home.path(),
        ws.path(),
        &["delegate", "--isolation", "worktree", "--goal", "commit"],
    );
    assert_eq!(code, 0, "{v} {err}");
    let r = &v["results"][0];
    let exit = r["receipts"]["commands"][0]["exit_code"].as_i64().expect("an exit code");
    assert_ne!(exit, 0, "git cannot reach the worktree's git directory: {r}");
    assert!(
        r["receipts"]["line"].as_str().is_some_and(|l| l.contains(&format!("exit {exit}"))),
        "{r}"
    );
    // The edit is in the change set; the branch holds only Retinue's commit.
    assert_eq!(r["changes"]["files"][0]["path"], "src/lib.rs", "{r}");
    let branch = format!("retinue/{}", r["subagent_id"].as_str().expect("sa"));
    let log = git(ws.path(), &["log", "--format=%an %s", &branch, "-2"]);
    assert!(log.starts_with("retinue retinue: changes of"), "{log}");
    assert!(!log.contains("sneaky"), "{log}");
}
