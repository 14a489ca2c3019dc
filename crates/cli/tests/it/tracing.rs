//! OpenTelemetry export (issue #27), against testkit's local OTLP/HTTP
//! receiver: `retinue delegate` under a caller's `TRACEPARENT` exports
//! `execute_tool delegate_task` → `invoke_agent subagent` → `chat {model}` and
//! `execute_tool {tool}`, with the GenAI attributes; a follow-up days later
//! links to the spawn's span; nothing is exported when the variables are
//! unset; a dead collector costs the delegation nothing but the spans.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
use retinue_testkit::otlp::{OtlpReceiver, ReceivedSpan};
use retinue_testkit::{HermesDb, TempHome};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_retinue");
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER: &str = "00f067aa0ba902b7";

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs_f64()
}

fn home(model: &FakeModel) -> (TempHome, String) {
    let home = TempHome::new();
    let fx = HermesDb::standard(&home.db_path(), now());
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test\n",
        model.base_url()
    );
    std::fs::write(home.path().join("config.yaml"), yaml).expect("config.yaml");
    (home, fx.root.to_owned())
}

fn run(home: &TempHome, env: &[(&str, &str)], args: &[&str]) -> Value {
    let mut c = Command::new(BIN);
    c.arg("--home").arg(home.path()).arg("--json").args(args);
    c.env_remove("HERMES_HOME").env_remove("TRACEPARENT");
    for k in
        ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME"]
    {
        c.env_remove(k);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("run retinue");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("json")
}

fn one<'a>(spans: &'a [ReceivedSpan], name: &str) -> &'a ReceivedSpan {
    let found: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "{name}: {spans:#?}");
    found[0]
}

fn model() -> FakeModel {
    let model = FakeModel::start();
    model.push(
        Reply::tool_call("call_1", "lookup", json!({"q": "x"})).with_usage(Usage::new(30, 7)),
    );
    model.set_default(Reply::text("Traced answer").with_usage(Usage::new(40, 9)));
    model
}

#[test]
fn spans_nest_under_the_callers_trace_and_a_follow_up_links_back() {
    let receiver = OtlpReceiver::start();
    let model = model();
    let (home, root) = home(&model);
    let endpoint = receiver.endpoint();
    let traceparent = format!("00-{TRACE}-{CALLER}-01");
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_SERVICE_NAME", "retinue-test"),
        ("TRACEPARENT", traceparent.as_str()),
    ];
    let out = run(&home, &env, &["delegate", "--parent", &root, "--goal", "Traced job"]);
    let sa = out["results"][0]["subagent_id"].as_str().expect("sa").to_owned();
    let session = out["results"][0]["child_session_id"].as_str().expect("session").to_owned();
    // The process flushed at exit.
    let spans = receiver.spans();
    let call = one(&spans, "execute_tool delegate_task");
    assert_eq!((call.trace_id.as_str(), call.parent_span_id.as_str()), (TRACE, CALLER));
    assert_eq!(call.service, "retinue-test");
    assert_eq!(call.attr("gen_ai.operation.name"), Some("execute_tool"));
    assert_eq!(call.attr("gen_ai.tool.name"), Some("delegate_task"));
    let agent = one(&spans, "invoke_agent subagent");
    assert_eq!(agent.parent_span_id, call.span_id);
    assert_eq!(agent.trace_id, TRACE);
    assert_eq!(agent.attr("gen_ai.operation.name"), Some("invoke_agent"));
    assert_eq!(agent.attr("gen_ai.agent.id"), Some(sa.as_str()));
    assert_eq!(agent.attr("gen_ai.conversation.id"), Some(session.as_str()));
    assert_eq!(agent.attr("gen_ai.request.model"), Some("test/fake-model"));
    assert_eq!(agent.attr("gen_ai.provider.name"), Some("openai"));
    assert_eq!(agent.attr("gen_ai.usage.input_tokens"), Some("70"));
    assert_eq!(agent.attr("gen_ai.usage.output_tokens"), Some("16"));
    assert_eq!(agent.attr("error.type"), None);
    let chats: Vec<&ReceivedSpan> =
        spans.iter().filter(|s| s.name == "chat test/fake-model").collect();
    assert_eq!(chats.len(), 2, "{spans:#?}");
    assert!(chats.iter().all(|c| c.parent_span_id == agent.span_id));
    assert!(chats.iter().any(|c| c.attr("gen_ai.usage.input_tokens") == Some("30")));
    assert!(chats.iter().all(|c| c.attr("gen_ai.operation.name") == Some("chat")));
    let tool = one(&spans, "execute_tool lookup");
    assert_eq!(tool.parent_span_id, agent.span_id);
    assert_eq!(tool.attr("gen_ai.tool.call.id"), Some("call_1"));
    assert_eq!(tool.attr("error.type"), Some("tool_error"), "no such tool was granted");

    // Days later, without the caller's context: a new trace, linked back.
    let follow = run(
        &home,
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())],
        &["delegate", "--parent", &root, "--follow-up", &sa, "--goal", "And then?"],
    );
    assert_eq!(follow["mode"], "follow_up", "{follow}");
    let later: Vec<ReceivedSpan> =
        receiver.spans().into_iter().filter(|s| s.trace_id != TRACE).collect();
    let again = one(&later, "execute_tool delegate_task");
    assert_eq!(again.parent_span_id, "", "a new root");
    assert_eq!(again.links, vec![(TRACE.to_owned(), call.span_id.clone())], "linked to the spawn");
    let resumed = one(&later, "invoke_agent subagent");
    assert_eq!(resumed.parent_span_id, again.span_id);
    assert_eq!(resumed.attr("gen_ai.agent.id"), Some(sa.as_str()));
}

#[test]
fn nothing_is_exported_unless_configured_and_a_dead_collector_changes_nothing() {
    let receiver = OtlpReceiver::start();
    let model = model();
    let (home, root) = home(&model);
    let quiet = run(&home, &[], &["delegate", "--parent", &root, "--goal", "Untraced"]);
    assert_eq!(quiet["results"][0]["status"], "completed");
    assert_eq!(receiver.requests(), 0, "exported without OTEL_EXPORTER_OTLP_ENDPOINT");
    let dead = OtlpReceiver::dead_endpoint();
    let out = run(
        &home,
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", dead.as_str())],
        &["delegate", "--parent", &root, "--goal", "Collector down"],
    );
    assert_eq!(out["results"][0]["status"], "completed", "{out}");
    assert_eq!(out["results"][0]["summary"], "Traced answer");
}

/// #35: a collector URL's credentials never show — userinfo and query
/// values are masked in the export warning (it printed
/// `http://bob:PASS@…/v1/traces?k=…` in clear).
#[test]
fn the_export_warning_never_shows_the_collectors_credentials() {
    let model = model();
    let (home, root) = home(&model);
    let dead = OtlpReceiver::dead_endpoint();
    let hostport = dead.trim_start_matches("http://").trim_end_matches('/').to_owned();
    let endpoint = format!("http://bob:PASSWORD-1234@{hostport}/v1/traces?k=QUERYSECRET");
    let out = Command::new(BIN)
        .arg("--home")
        .arg(home.path())
        .args(["--json", "delegate", "--parent", &root, "--goal", "Collector down"])
        .env_remove("HERMES_HOME")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &endpoint)
        .output()
        .expect("run");
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("could not be exported"), "no export warning: {stderr}");
    assert!(!stderr.contains("PASSWORD-1234") && !stderr.contains("QUERYSECRET"), "{stderr}");
    assert!(stderr.contains("***@"), "{stderr}");
}

#[test]
fn an_approval_is_an_event_on_the_tool_span() {
    let receiver = OtlpReceiver::start();
    let model = FakeModel::start();
    model.push(
        Reply::tool_call("call_rm", "terminal", json!({"command": "rm -rf build"}))
            .with_usage(Usage::new(30, 7)),
    );
    model.set_default(Reply::text("Gave up").with_usage(Usage::new(40, 9)));
    let (home, root) = self::home(&model);
    let ws = tempfile::tempdir().expect("ws");
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test\n  \
         toolsets: [read, terminal]\n  approvals: {{timeout_s: 1}}\n",
        model.base_url()
    );
    std::fs::write(home.path().join("config.yaml"), yaml).expect("config.yaml");
    let endpoint = receiver.endpoint();
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())];
    let workspace = ws.path().to_string_lossy().into_owned();
    let out = run(
        &home,
        &env,
        &[
            "delegate",
            "--parent",
            &root,
            "--goal",
            "clean",
            "--toolsets",
            "terminal",
            "--workspace",
            &workspace,
        ],
    );
    assert_eq!(out["results"][0]["status"], "completed", "{out}");
    let spans = receiver.spans();
    let tool = one(&spans, "execute_tool terminal");
    let names: Vec<&str> = tool.events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["retinue.approval.requested", "retinue.approval.decided"], "{tool:#?}");
    let decided = &tool.events[1].1;
    let attr = |k: &str| decided.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
    assert_eq!(attr("retinue.approval.state"), Some("expired"));
    assert_eq!(attr("retinue.approval.decided_by"), Some("retinue"));
    assert!(attr("retinue.approval.id").is_some_and(|id| id.starts_with("appr_")));
}
