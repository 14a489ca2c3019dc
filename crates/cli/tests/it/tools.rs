//! `retinue delegate` with tools (#24): the children read, write and run
//! commands in their workspace through the real binary, its sandbox helper
//! mode and testkit's fake model scripting the tool calls.

use std::path::Path;
use std::process::Command;

use retinue_testkit::TempHome;
use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
use retinue_testkit::rusqlite::Connection;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_retinue");
const SECRET: &str = "sk-caller-env-secret-0042";

fn configure(home: &Path, model: &FakeModel, extra: &str) {
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test-secret\n{extra}",
        model.base_url()
    );
    std::fs::write(home.join("config.yaml"), yaml).expect("config.yaml");
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
        .env("OPENAI_API_KEY", SECRET)
        .env("RETINUE_PROBE_VAR", SECRET)
        .env("HERMES_PROBE_VAR", SECRET)
        .output()
        .expect("run retinue");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let v = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), v, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The rows of `session` as (role, content, tool_call_id, tool_name).
fn transcript(db: &Path, session: &str) -> Vec<(String, String, Option<String>, Option<String>)> {
    let conn = Connection::open(db).expect("open");
    let mut st = conn
        .prepare(
            "SELECT role, COALESCE(content, ''), tool_call_id, tool_name FROM messages \
             WHERE session_id = ?1 ORDER BY id",
        )
        .expect("prepare");
    st.query_map([session], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .expect("query")
        .map(|r| r.expect("row"))
        .collect()
}

/// A model that, for each child, first calls `call` (name, arguments) and
/// answers `final` once a tool result is back.
fn scripted(call: &'static str, args: Value, answer: &'static str) -> FakeModel {
    let model = FakeModel::start();
    model.set_handler(move |request| {
        let messages = request.messages();
        let last = messages.last()?;
        if last["role"] == "tool" {
            return Some(Reply::text(answer).with_usage(Usage::new(50, 10)));
        }
        Some(Reply::tool_call("call-1", call, args.clone()).with_usage(Usage::new(40, 8)))
    });
    model
}

#[test]
fn a_child_runs_a_sandboxed_command_and_never_sees_the_callers_secrets() {
    // Where the kernel cannot host the sandbox, the terminal is refused
    // (the tools crate's tests check that refusal).
    let probe_ws = tempfile::tempdir().expect("probe workspace");
    let probe = Command::new(BIN)
        .args(["__sandbox", "--probe", "--workspace"])
        .arg(probe_ws.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("probe");
    let pid = probe.id();
    let probe = probe.wait_with_output().expect("probe");
    // The probe's pids cgroup, where it made one (the terminal removes its own).
    let _ = std::fs::remove_dir(format!("/sys/fs/cgroup/pids/retinue-{pid}"));
    let why = String::from_utf8_lossy(&probe.stderr);
    if !probe.status.success()
        && (why.contains("user namespaces are unavailable")
            || why.contains("Landlock is not available"))
    {
        // CI sets RETINUE_REQUIRE_SANDBOX: there a missing sandbox fails.
        assert!(
            std::env::var_os("RETINUE_REQUIRE_SANDBOX").is_none(),
            "RETINUE_REQUIRE_SANDBOX is set but the sandbox is unavailable: {why}"
        );
        eprintln!("note: SKIPPED: no sandbox on this machine: {why}");
        return;
    }
    assert!(probe.status.success(), "the sandbox could not be set up: {why}");
    let home = TempHome::new();
    let ws = tempfile::tempdir().expect("ws");
    let model = scripted("terminal", json!({"command": "env; echo made > out.txt"}), "ran it");
    configure(home.path(), &model, "  toolsets: [read, terminal]\n");
    let (code, v, err) = retinue(
        home.path(),
        ws.path(),
        &["delegate", "--goal", "run env", "--toolsets", "terminal"],
    );
    assert_eq!(code, 0, "{v} {err}");
    let r = &v["results"][0];
    assert_eq!(r["status"], "completed", "{v}");
    assert_eq!(r["toolsets"], json!(["terminal"]));
    assert_eq!(std::fs::read_to_string(ws.path().join("out.txt")).expect("out"), "made\n");
    let rows = transcript(&home.db_path(), r["child_session_id"].as_str().expect("sid"));
    let tool = rows.iter().find(|r| r.0 == "tool").expect("tool row");
    assert_eq!(tool.2.as_deref(), Some("call-1"));
    assert_eq!(tool.3.as_deref(), Some("terminal"));
    let out: Value = serde_json::from_str(&tool.1).expect("terminal JSON");
    let text = out["output"].as_str().expect("output");
    assert!(text.contains("HOME="), "{text}");
    assert!(!text.contains(SECRET), "a caller's secret reached the command: {text}");
    assert!(!text.contains("sk-test-secret"));
    for var in ["OPENAI_", "RETINUE_", "HERMES_"] {
        assert!(!text.contains(var), "{var} reached the command: {text}");
    }
}

#[test]
fn toolsets_only_narrow_and_a_follow_up_restores_toolsets_workspace_and_history() {
    let home = TempHome::new();
    let ws = tempfile::tempdir().expect("ws");
    std::fs::write(ws.path().join("notes.md"), "alpha beta\n").expect("notes");
    let model = scripted("read_file", json!({"path": "notes.md"}), "read it");
    configure(home.path(), &model, "");
    // The default grant is `read`: asking for `file` is dropped, with a reason.
    let (code, v, err) = retinue(
        home.path(),
        ws.path(),
        &["delegate", "--goal", "read notes", "--toolsets", "read,file"],
    );
    assert_eq!(code, 0, "{v} {err}");
    let r = &v["results"][0];
    assert_eq!(r["toolsets"], json!(["read"]));
    assert_eq!(r["toolsets_dropped"][0]["toolset"], "file");
    assert!(r["toolsets_dropped"][0]["reason"].as_str().expect("reason").contains("narrow"));
    let sid = r["child_session_id"].as_str().expect("sid").to_owned();
    let sa = r["subagent_id"].as_str().expect("sa").to_owned();
    let rows = transcript(&home.db_path(), &sid);
    assert!(rows.iter().any(|r| r.0 == "tool" && r.1.contains("1|alpha beta")), "{rows:?}");
    let parent = v["parent_session_id"].as_str().map(str::to_owned);

    // The follow-up runs from another directory: the child works in its own.
    let elsewhere = tempfile::tempdir().expect("elsewhere");
    let before = model.request_count();
    let mut args = vec!["delegate", "--follow-up", &sa, "--goal", "again"];
    if let Some(p) = parent.as_deref() {
        args.extend(["--parent", p]);
    }
    args.extend(["--workspace", ws.path().to_str().expect("utf8")]);
    let (code, v, err) = retinue(home.path(), elsewhere.path(), &args);
    assert_eq!(code, 0, "{v} {err}");
    let reqs = model.requests();
    let resumed = &reqs[before];
    let messages = resumed.messages();
    let roles: Vec<&str> = messages.iter().filter_map(|m| m["role"].as_str()).collect();
    assert!(roles.windows(2).any(|w| w == ["assistant", "tool"]), "{roles:?}");
    let offered: Vec<String> = resumed.body["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(offered, ["read_file", "search_files"]);
    let follow_rows = transcript(&home.db_path(), &sid);
    assert!(follow_rows.iter().filter(|r| r.0 == "tool").count() >= 2);

    // The workspace is gone: the follow-up is refused, clearly, before any call.
    let kept = ws.path().to_path_buf();
    drop(ws);
    assert!(!kept.exists());
    let count = model.request_count();
    let mut args = vec!["delegate", "--follow-up", &sa, "--goal", "once more"];
    if let Some(p) = parent.as_deref() {
        args.extend(["--parent", p]);
    }
    let (code, v, err) = retinue(home.path(), elsewhere.path(), &args);
    assert_eq!(code, 4, "{v} {err}");
    assert!(v["error"].as_str().expect("error").contains("workspace"), "{v}");
    assert_eq!(model.request_count(), count);
}

#[test]
fn an_orchestrator_child_delegates_a_grandchild_on_the_same_registry() {
    let home = TempHome::new();
    let ws = tempfile::tempdir().expect("ws");
    let model = orchestrating_model();
    configure(home.path(), &model, "  max_spawn_depth: 2\n");
    let (code, v, err) = retinue(
        home.path(),
        ws.path(),
        &["delegate", "--tasks", r#"[{"goal":"orchestrate","role":"orchestrator"}]"#],
    );
    assert_eq!(code, 0, "{v} {err}");
    let r = &v["results"][0];
    assert_eq!(r["status"], "completed", "{v}");
    assert_eq!(r["toolsets"], json!(["read", "delegation"]));
    let child_session = r["child_session_id"].as_str().expect("sid").to_owned();
    let rows = transcript(&home.db_path(), &child_session);
    let result = rows.iter().find(|r| r.0 == "tool").expect("delegate_task result");
    // The JSON, then the grandchild's receipts line.
    let (json_text, receipts) = result.1.split_once('\n').expect("a receipts line");
    let inner: Value = serde_json::from_str(json_text).expect("delegate_task JSON");
    assert_eq!(inner["results"][0]["summary"], "grandchild found it", "{inner}");
    assert_eq!(receipts, "receipts: no tool calls");
    assert_eq!(inner["results"][0]["receipts"]["line"], "receipts: no tool calls");
    // The orchestrator's model reads it: its next request carries the line.
    let carried = model.requests().iter().any(|rq| {
        rq.messages().iter().any(|m| {
            m["role"] == "tool"
                && m["content"].as_str().is_some_and(|c| c.ends_with("\nreceipts: no tool calls"))
        })
    });
    assert!(carried, "the parent model's request carries the receipts line");
    let grand_sa = inner["results"][0]["subagent_id"].as_str().expect("grand sa").to_owned();
    // The grandchild is retained under the child's session, in the same
    // registry.
    // Follow-ups of the grandchild follow hermes's authority rules
    // unchanged (semantics §5.2): its owner is a delegate session, which has no
    // lineage root, so neither the orchestrator nor the top-level parent may
    // message it — the grandchild is retained and inspectable, not
    // addressable.
    let parent = v["parent_session_id"].as_str().expect("parent").to_owned();
    for caller in [&child_session, &parent] {
        let (code, auth, err) =
            retinue(home.path(), ws.path(), &["authority", &grand_sa, "--caller", caller]);
        assert_eq!(code, 3, "{auth} {err}");
        assert_eq!(auth["denial"], "lineage", "{auth}");
    }
    let (code, listed, _) = retinue(home.path(), ws.path(), &["children", "list"]);
    assert_eq!(code, 0);
    let text = listed.to_string();
    assert!(text.contains(&grand_sa), "{text}");
    // Its usage rolls into the child's session totals.
    let (code, usage, err) = retinue(home.path(), ws.path(), &["usage", &child_session]);
    assert_eq!(code, 0, "{usage} {err}");
    let records = usage["records"].as_array().expect("records");
    assert!(!records.is_empty(), "the grandchild's run is billed to the child: {usage}");
}

/// Kills a spawned server however the test ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_child_calls_a_streamable_http_mcp_server() {
    use std::io::{BufRead, BufReader};
    // The MCP server: Retinue's own, over streamable HTTP on 127.0.0.1.
    let server_home = TempHome::new();
    let mut server = Killed(
        Command::new(BIN)
            .arg("--home")
            .arg(server_home.path())
            .args(["mcp", "--http", "127.0.0.1:0", "--new-session"])
            .env_remove("HERMES_HOME")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start retinue mcp --http"),
    );
    let stderr = server.0.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let url = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| {
            l.split_whitespace().find(|w| w.starts_with("http://127.0.0.1:")).map(str::to_owned)
        })
        .expect("the server's address");
    std::thread::spawn(move || lines.for_each(drop));
    let home = TempHome::new();
    let ws = tempfile::tempdir().expect("ws");
    let model = scripted("mcp__remote__list_subagents", json!({}), "listed them");
    configure(
        home.path(),
        &model,
        &format!("mcp_servers:\n  remote:\n    url: {url}\n    timeout: 20\n"),
    );
    let (code, v, err) = retinue(home.path(), ws.path(), &["delegate", "--goal", "list"]);
    assert_eq!(code, 0, "{v} {err}");
    let r = &v["results"][0];
    assert_eq!(r["toolsets"], json!(["read", "mcp-remote"]), "{v}");
    let rows = transcript(&home.db_path(), r["child_session_id"].as_str().expect("sid"));
    let tool = rows.iter().find(|r| r.0 == "tool").expect("tool row");
    assert_eq!(tool.3.as_deref(), Some("mcp__remote__list_subagents"));
    assert!(tool.1.contains("subagents"), "{}", tool.1);
    let offered: Vec<String> = model.requests()[0].body["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
        .collect();
    assert!(offered.contains(&"mcp__remote__delegate_task".to_owned()), "{offered:?}");
}

/// The model of the orchestrator tests: the child delegates a grandchild
/// (40 + 5 tokens), the grandchild answers (30 + 5), the child relays (60 + 5).
fn orchestrating_model() -> FakeModel {
    let model = FakeModel::start();
    model.set_handler(|request| {
        let messages = request.messages();
        let first_user = messages.iter().find(|m| m["role"] == "user")?;
        let goal = first_user["content"].as_str().unwrap_or_default().to_owned();
        let last = messages.last()?;
        if goal.starts_with("grand") {
            return Some(Reply::text("grandchild found it").with_usage(Usage::new(30, 5)));
        }
        if last["role"] == "tool" {
            return Some(Reply::text("child relayed it").with_usage(Usage::new(60, 5)));
        }
        Some(
            Reply::tool_call("d1", "delegate_task", json!({"goal": "grand task"}))
                .with_usage(Usage::new(40, 5)),
        )
    });
    model
}

#[test]
fn the_whole_tree_grandchild_included_draws_on_one_budget() {
    let home = TempHome::new();
    let ws = tempfile::tempdir().expect("ws");
    let model = orchestrating_model();
    configure(home.path(), &model, "  max_spawn_depth: 2\n  budget: {max_tokens: 100000}\n");
    let (code, v, err) = retinue(
        home.path(),
        ws.path(),
        &["delegate", "--tasks", r#"[{"goal":"orchestrate","role":"orchestrator"}]"#],
    );
    assert_eq!(code, 0, "{v} {err}");
    assert_eq!(v["results"][0]["summary"], "child relayed it", "{v}");
    // Spent: the child's two calls and the grandchild's one, 145 tokens,
    // all counted against the top-level budget; nothing left reserved.
    assert_eq!(v["budget"]["spent"]["tokens"], 145, "{v}");
    assert_eq!(v["budget"]["reserved"]["tokens"], 0, "{v}");
}

/// #35 bad input: a workspace on a read-only mount. The child's write is a
/// clear tool error the model reads, nothing is written, the run completes.
/// (The mount is made in a user and mount namespace of this test's own.)
#[test]
fn a_workspace_on_a_read_only_mount_gives_the_child_a_clear_error() {
    let usable = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !usable {
        assert!(
            std::env::var_os("RETINUE_REQUIRE_SANDBOX").is_none(),
            "RETINUE_REQUIRE_SANDBOX is set but unshare cannot make a mount namespace"
        );
        eprintln!("note: SKIPPED: no user and mount namespaces here");
        return;
    }
    let home = TempHome::new();
    let ws = tempfile::tempdir().expect("ws");
    let model = scripted("write_file", json!({"path": "new.txt", "content": "x"}), "tried");
    configure(home.path(), &model, "  toolsets: [read, file]\n");
    let script = format!(
        "mount --bind {ws} {ws} && mount -o remount,bind,ro {ws} && exec {bin} --home {home} \
         --json delegate --workspace {ws} --toolsets file --goal write",
        ws = ws.path().display(),
        bin = BIN,
        home = home.path().display()
    );
    let out = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "sh", "-c", &script])
        .env_remove("HERMES_HOME")
        .output()
        .expect("run");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert_eq!(out.status.code(), Some(0), "{v} {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(v["results"][0]["status"], "completed", "{v}");
    assert!(!ws.path().join("new.txt").exists());
    let rows =
        transcript(&home.db_path(), v["results"][0]["child_session_id"].as_str().expect("s"));
    let tool = rows.iter().find(|r| r.0 == "tool").expect("tool row");
    assert!(tool.1.contains("read-only file system"), "{}", tool.1);
}

/// #35 bad input: a home given through `..` that lands inside the
/// workspace is still hidden from the child.
#[test]
fn a_home_given_through_dotdot_inside_the_workspace_is_still_unreachable() {
    let ws = tempfile::tempdir().expect("ws");
    let home = ws.path().join("sub/../.retinue-home");
    std::fs::create_dir_all(ws.path().join("sub")).expect("sub");
    std::fs::create_dir_all(&home).expect("home");
    let model = scripted("read_file", json!({"path": ".retinue-home/config.yaml"}), "tried");
    configure(&home, &model, "");
    let (code, v, err) = retinue(&home, ws.path(), &["delegate", "--goal", "read the config"]);
    assert_eq!(code, 0, "{v} {err}");
    let rows = transcript(
        &ws.path().join(".retinue-home/state.db"),
        v["results"][0]["child_session_id"].as_str().expect("s"),
    );
    let tool = rows.iter().find(|r| r.0 == "tool").expect("tool row");
    assert!(tool.1.contains("never reach"), "{}", tool.1);
    assert!(!tool.1.contains("sk-test-secret"), "{}", tool.1);
}
