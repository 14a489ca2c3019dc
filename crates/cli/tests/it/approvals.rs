//! Approvals (#37) through the real binary: the fake model scripts a risky
//! terminal call (`rm -rf build` in a workspace that has `build/`), the
//! child waits in `retinue delegate` (its own process), and another
//! process decides with `retinue approve` / `retinue deny`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use retinue_testkit::TempHome;
use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
use retinue_testkit::rusqlite::Connection;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_retinue");

/// Whether this kernel hosts the terminal's sandbox (CI requires it).
fn sandbox_available() -> bool {
    let ws = tempfile::tempdir().expect("probe workspace");
    let probe = Command::new(BIN)
        .args(["__sandbox", "--probe", "--workspace"])
        .arg(ws.path())
        .output()
        .expect("probe");
    if probe.status.success() {
        return true;
    }
    let why = String::from_utf8_lossy(&probe.stderr);
    assert!(
        std::env::var_os("RETINUE_REQUIRE_SANDBOX").is_none(),
        "RETINUE_REQUIRE_SANDBOX is set but the sandbox is unavailable: {why}"
    );
    eprintln!("note: SKIPPED: no sandbox on this machine: {why}");
    false
}

/// A model that runs `rm -rf build`, then answers with what the tool said.
fn rm_model() -> FakeModel {
    let model = FakeModel::start();
    model.set_handler(|request| {
        let messages = request.messages();
        let last = messages.last()?;
        if last["role"] == "tool" {
            let said = last["content"].as_str().unwrap_or_default().to_owned();
            return Some(Reply::text(&format!("tool said: {said}")).with_usage(Usage::new(50, 10)));
        }
        Some(
            Reply::tool_call("call-1", "terminal", json!({"command": "rm -rf build"}))
                .with_usage(Usage::new(40, 8)),
        )
    });
    model
}

struct World {
    home: TempHome,
    ws: tempfile::TempDir,
    _model: FakeModel,
}

fn world(extra: &str) -> World {
    let home = TempHome::new();
    let ws = tempfile::tempdir().expect("ws");
    std::fs::create_dir(ws.path().join("build")).expect("build/");
    std::fs::write(ws.path().join("build/out.o"), "obj").expect("build/out.o");
    let model = rm_model();
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test\n  \
         toolsets: [read, terminal]\n{extra}",
        model.base_url()
    );
    std::fs::write(home.path().join("config.yaml"), yaml).expect("config.yaml");
    World { home, ws, _model: model }
}

fn command(w: &World, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("--home")
        .arg(w.home.path())
        .arg("--json")
        .args(args)
        .current_dir(w.ws.path())
        .env_remove("HERMES_HOME")
        .env_remove("HERMES_PROFILE")
        .stdin(Stdio::null());
    c
}

fn run(w: &World, args: &[&str]) -> (i32, Value) {
    let out = command(w, args).output().expect("run retinue");
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), v)
}

fn spawn_delegate(w: &World, extra: &[&str]) -> Child {
    let mut args = vec!["delegate", "--goal", "clean the build", "--toolsets", "terminal"];
    args.extend_from_slice(extra);
    command(w, &args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn")
}

/// The first pending request, once one appears (within 30 s).
fn pending(w: &World) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, v) = run(w, &["approvals"]);
        // Exit 4 until the delegating process has created the state.db.
        assert!(
            code == 0
                || (code == 4 && v["error"].as_str().is_some_and(|e| e.contains("no state.db"))),
            "{v}"
        );
        if let Some(first) = v["approvals"].as_array().and_then(|a| a.first()) {
            return first.clone();
        }
        assert!(Instant::now() < deadline, "no approval request within 30 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn finish(child: Child) -> (i32, Value, String) {
    let out = child.wait_with_output().expect("delegate");
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), v, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The tool result the child's model read.
fn tool_result(w: &World, session: &str) -> String {
    let conn = Connection::open(w.home.db_path()).expect("open");
    conn.query_row(
        "SELECT COALESCE(content, '') FROM messages WHERE session_id = ?1 AND role = 'tool'",
        [session],
        |r| r.get(0),
    )
    .expect("a tool row")
}

#[test]
fn approved_the_command_runs_and_the_wait_does_not_count_towards_the_child_timeout() {
    if !sandbox_available() {
        return;
    }
    let w = world("  child_timeout_seconds: 3\n");
    let child = spawn_delegate(&w, &[]);
    let request = pending(&w);
    for key in [
        "approval_id",
        "delegation_id",
        "subagent_id",
        "tool",
        "arguments",
        "reason",
        "state",
        "requested_at",
        "decided_at",
        "decided_by",
        "decision_reason",
    ] {
        assert!(request.get(key).is_some(), "{key} missing: {request}");
    }
    assert_eq!(request["tool"], "terminal");
    assert_eq!(request["state"], "pending");
    assert_eq!(request["arguments"], json!({"command": "rm -rf build"}));
    assert!(w.ws.path().join("build").exists(), "nothing ran before the decision");
    // Longer than the child's own timeout: the wait is not counted.
    std::thread::sleep(Duration::from_secs(4));
    let id = request["approval_id"].as_str().expect("id");
    let (code, v) = run(&w, &["approve", id]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(
        (v["state"].as_str(), v["decided_by"].as_str()),
        (Some("approved"), Some("operator"))
    );
    let (code, v, err) = finish(child);
    assert_eq!(code, 0, "{v} {err}");
    let r = &v["results"][0];
    assert_eq!(r["status"], "completed", "{v}");
    assert!(!w.ws.path().join("build").exists(), "the approved command ran");
    let said = tool_result(&w, r["child_session_id"].as_str().expect("sid"));
    assert!(said.starts_with(&format!("[approved by operator ({id})]")), "{said}");
    // Decided once: a second decision is told so.
    let (code, v) = run(&w, &["deny", id]);
    assert_eq!((code, v["code"].as_str()), (1, Some("already_decided")), "{v}");
    let (code, v) = run(&w, &["approvals", "--all"]);
    assert_eq!(code, 0);
    assert_eq!(v["approvals"][0]["state"], "approved");
}

#[test]
fn denied_the_workspace_is_untouched_and_the_model_reads_who_and_why() {
    if !sandbox_available() {
        return;
    }
    let w = world("");
    let child = spawn_delegate(&w, &[]);
    let request = pending(&w);
    let id = request["approval_id"].as_str().expect("id");
    // Unknown and foreign ids are one answer: exit 4.
    let (code, v) = run(&w, &["approve", "appr_000000000000"]);
    assert_eq!((code, v["code"].as_str()), (4, Some("not_found")), "{v}");
    let (code, _) = run(&w, &["approve", id, "--parent", "a-stranger-session"]);
    assert_eq!(code, 4, "a stranger's decision is refused as a missing id");
    let (code, v) = run(&w, &["approvals", "--parent", "a-stranger-session"]);
    assert_eq!((code, v["approvals"].as_array().map(Vec::len)), (0, Some(0)), "{v}");
    // The child's own parent may decide (the follow-up rule).
    let parent = {
        let conn = Connection::open(w.home.db_path()).expect("open");
        conn.query_row(
            "SELECT parent_session_id FROM async_delegations WHERE delegation_id = ?1",
            [request["delegation_id"].as_str().expect("unit")],
            |r| r.get::<_, String>(0),
        )
        .expect("parent")
    };
    let (code, v) = run(&w, &["deny", id, "--reason", "not on a Friday", "--parent", &parent]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["decided_by"], format!("session:{parent}"));
    let (code, v, err) = finish(child);
    assert_eq!(code, 0, "{v} {err}");
    assert!(w.ws.path().join("build/out.o").exists(), "a denied command never runs");
    let r = &v["results"][0];
    let said = tool_result(&w, r["child_session_id"].as_str().expect("sid"));
    assert!(said.contains(&format!("denied by session:{parent}: not on a Friday")), "{said}");
    assert!(r["summary"].as_str().unwrap_or_default().contains("not on a Friday"), "{v}");
    // The decision is part of the child's story in `children show`.
    let (code, shown) = run(&w, &["children", "show", r["subagent_id"].as_str().expect("sa")]);
    assert_eq!(code, 0, "{shown}");
    assert_eq!(shown["approvals"][0]["approval_id"], id, "{shown}");
    assert_eq!(shown["approvals"][0]["state"], "denied");
    assert_eq!(shown["approvals"][0]["decision_reason"], "not on a Friday");
}

#[test]
fn an_unanswered_request_expires_and_racing_deciders_record_one_decision() {
    if !sandbox_available() {
        return;
    }
    let w = world("  approvals: {timeout_s: 2}\n");
    let (code, v) = run(&w, &["delegate", "--goal", "clean", "--toolsets", "terminal"]);
    assert_eq!(code, 0, "{v}");
    let said = tool_result(&w, v["results"][0]["child_session_id"].as_str().expect("sid"));
    assert!(said.contains("approval expired after 2 s"), "{said}");
    assert!(w.ws.path().join("build").exists());
    let (_, all) = run(&w, &["approvals", "--all"]);
    assert_eq!(all["approvals"][0]["state"], "expired", "{all}");

    // Two deciders at once, from two processes: one wins.
    let w = world("");
    let child = spawn_delegate(&w, &[]);
    let id = pending(&w)["approval_id"].as_str().expect("id").to_owned();
    let racers: Vec<Child> = ["approve", "deny"]
        .iter()
        .map(|verb| command(&w, &[verb, &id]).stdout(Stdio::piped()).spawn().expect("racer"))
        .collect();
    let mut codes: Vec<i32> = racers
        .into_iter()
        .map(|r| r.wait_with_output().expect("racer").status.code().unwrap_or(-1))
        .collect();
    codes.sort_unstable();
    assert_eq!(codes, vec![0, 1], "exactly one decision is recorded");
    let (code, v, err) = finish(child);
    assert_eq!(code, 0, "{v} {err}");
}

#[test]
fn a_background_childs_request_is_answered_from_another_process_and_a_dead_worker_expires_it() {
    if !sandbox_available() {
        return;
    }
    let w = world("");
    let (code, v) =
        run(&w, &["delegate", "--goal", "clean", "--toolsets", "terminal", "--background"]);
    assert_eq!(code, 0, "{v}");
    let unit = v["delegation_id"].as_str().expect("unit").to_owned();
    let id = pending(&w)["approval_id"].as_str().expect("id").to_owned();
    let (code, v) = run(&w, &["approve", &id]);
    assert_eq!(code, 0, "{v}");
    let (code, v) = run(&w, &["wait", &unit, "--timeout", "60"]);
    assert_eq!(code, 0, "{v}");
    assert!(!w.ws.path().join("build").exists(), "the background child ran it");

    // A worker killed while its request waits: recovery expires it.
    let w = world("");
    let mut child = spawn_delegate(&w, &[]);
    let id = pending(&w)["approval_id"].as_str().expect("id").to_owned();
    child.kill().expect("kill -9");
    let _ = child.wait();
    let (code, v) = run(&w, &["approvals"]);
    assert_eq!(code, 0);
    assert_eq!(v["approvals"][0]["approval_id"], id, "a pending request survives its worker");
    let (code, v) = run(&w, &["recover"]);
    assert_eq!(code, 0, "{v}");
    let (_, v) = run(&w, &["approvals", "--all"]);
    assert_eq!(v["approvals"][0]["state"], "expired", "{v}");
    assert_eq!(v["approvals"][0]["decision_reason"], "worker gone", "{v}");
    let (code, v) = run(&w, &["approve", &id]);
    assert_eq!((code, v["code"].as_str()), (1, Some("already_decided")), "{v}");
    assert!(w.ws.path().join("build").exists());
}

#[test]
fn a_decision_for_a_unit_cancelled_meanwhile_is_told_it_came_too_late() {
    if !sandbox_available() {
        return;
    }
    let w = world("");
    let (code, v) =
        run(&w, &["delegate", "--goal", "clean", "--toolsets", "terminal", "--background"]);
    assert_eq!(code, 0, "{v}");
    let unit = v["delegation_id"].as_str().expect("unit").to_owned();
    let id = pending(&w)["approval_id"].as_str().expect("id").to_owned();
    let (code, v) = run(&w, &["cancel", &unit]);
    assert_eq!(code, 0, "{v}");
    let (code, v) = run(&w, &["approve", &id]);
    assert_eq!((code, v["code"].as_str()), (1, Some("already_decided")), "{v}");
    let (_, all) = run(&w, &["approvals", "--all"]);
    assert_eq!(all["approvals"][0]["state"], "expired", "{all}");
    assert!(w.ws.path().join("build").exists(), "a cancelled unit's call never ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_views_approve_button_in_chromium_runs_the_waiting_call() {
    use fantoccini::Locator;

    use super::web_browser::{browser, browser_available, chromedriver, serve, target_dir, until};
    if !browser_available() || !sandbox_available() {
        return;
    }
    let w = world("");
    let child = spawn_delegate(&w, &[]);
    let id = pending(&w)["approval_id"].as_str().expect("id").to_owned();
    let (_server, base, printed) = serve(w.home.path());
    assert!(printed.contains("?approve="), "{printed}");
    let (_driver, webdriver) = chromedriver();
    let c = browser(&webdriver).await;
    // Without the printed address's key the view shows no buttons.
    c.goto(&format!("{base}/")).await.expect("open the tree");
    let shown = format!("div.approval[data-approval='{id}'] .meta");
    until(&c, "the pending approval", &shown, |t| t.contains("pending")).await;
    assert!(c.find(Locator::Css("div.approval form")).await.is_err(), "no key, no buttons");
    c.goto(&printed).await.expect("open the printed address");
    until(&c, "the buttons", "div.approval form button", |t| t.contains("Approve")).await;
    let call = until(&c, "its call", "div.approval pre.call", |t| t.contains("rm -rf")).await;
    assert_eq!(call, "rm -rf build");
    std::fs::write(target_dir().join("approval.png"), c.screenshot().await.expect("shot"))
        .expect("write");
    let button = format!("div.approval[data-approval='{id}'] button[value='approve']");
    c.find(Locator::Css(&button)).await.expect("the approve button").click().await.expect("click");
    // The post returns to the tree, where the request is no longer pending.
    let (code, v, err) = tokio::task::spawn_blocking(move || finish(child)).await.expect("join");
    assert_eq!(code, 0, "{v} {err}");
    assert!(!w.ws.path().join("build").exists(), "the approved command ran");
    let (_, all) = run(&w, &["approvals", "--all"]);
    assert_eq!(all["approvals"][0]["state"], "approved", "{all}");
    assert_eq!(all["approvals"][0]["decided_by"], "web", "{all}");
    c.close().await.expect("close");
}
