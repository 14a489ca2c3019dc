//! `retinue mcp` as an agent host runs it (a child process on stdio),
//! driven by rmcp's client with the MCP Tasks extension (issue #26): a task
//! outlives its server — a restarted server answers `tasks/get` from the
//! registry, and a task whose server was killed mid-run is `failed` with its
//! unit recovered as `unknown`; another session's task id answers exactly as
//! an unknown one.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
use retinue_testkit::{HermesDb, TempHome};
use rmcp_client::model::{
    CallToolRequestParams, ClientCapabilities, ClientConfig, ClientRequest, GetTaskParams, Request,
    ServerResult,
};
use rmcp_client::service::RunningService;
use rmcp_client::transport::TokioChildProcess;
use rmcp_client::{ClientHandler, RoleClient, ServiceExt};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_retinue");

#[derive(Clone, Default)]
struct TasksClient;

impl ClientHandler for TasksClient {
    fn get_info(&self) -> ClientConfig {
        let mut info = ClientConfig::default();
        info.capabilities = ClientCapabilities::builder().enable_tasks().build();
        info
    }
}

type Client = RunningService<RoleClient, TasksClient>;

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs_f64()
}

/// `retinue mcp --session SESSION` on `home`; returns the client and the
/// server's pid.
async fn serve(home: &TempHome, session: &str) -> (Client, u32) {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("--home").arg(home.path()).args(["mcp", "--session", session]);
    cmd.env_remove("HERMES_HOME").env_remove("HERMES_PROFILE").kill_on_drop(true);
    let (transport, _stderr) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start retinue mcp");
    let pid = transport.id().expect("pid");
    (TasksClient.serve(transport).await.expect("initialize"), pid)
}

async fn create(client: &Client, goal: &str) -> String {
    let request = ClientRequest::CallToolRequest(Request::new(
        CallToolRequestParams::new("delegate_task")
            .with_arguments(json!({"goal": goal}).as_object().expect("object").clone()),
    ));
    match client.send_request(request).await.expect("tools/call") {
        ServerResult::CreateTaskResult(handle) => handle.task.task_id,
        other => panic!("expected a task handle, got {other:?}"),
    }
}

async fn get(client: &Client, id: &str) -> Result<Value, String> {
    let request = ClientRequest::GetTaskRequest(Request::new(GetTaskParams::new(id)));
    match client.send_request(request).await {
        Ok(ServerResult::GetTaskResult(r)) => Ok(serde_json::to_value(r).expect("json")),
        Ok(other) => panic!("unexpected {other:?}"),
        Err(e) => Err(e.to_string()),
    }
}

async fn until_not_working(client: &Client, id: &str) -> Value {
    let started = Instant::now();
    loop {
        let state = get(client, id).await.expect("tasks/get");
        if state["status"] != "working" {
            return state;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "still working: {state}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_outlive_their_server_and_belong_to_their_session() {
    let home = TempHome::new();
    let fx = HermesDb::standard(&home.db_path(), now());
    let other_session = "other-session";
    HermesDb::open(&home.db_path()).session(&retinue_testkit::hermes::HermesSession {
        id: other_session.to_owned(),
        source: "cli".to_owned(),
        started_at: now(),
        ..Default::default()
    });
    let model = FakeModel::start();
    model.set_handler(|request| {
        let messages = request.messages();
        let last = messages.iter().rev().find(|m| m["role"] == "user")?;
        let text = last["content"].as_str().unwrap_or_default().to_owned();
        let reply = Reply::text(&format!("Done: {}", text.lines().next().unwrap_or_default()))
            .with_usage(Usage::new(10, 5));
        Some(if text.contains("sleepy") { reply.delayed(Duration::from_secs(60)) } else { reply })
    });
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test\n",
        model.base_url()
    );
    std::fs::write(home.path().join("config.yaml"), yaml).expect("config.yaml");

    let (first, pid) = serve(&home, fx.root).await;
    let done = create(&first, "Quick answer").await;
    let finished = until_not_working(&first, &done).await;
    assert_eq!(finished["status"], "completed", "{finished}");
    let sleepy = create(&first, "A sleepy crawl").await;
    assert_eq!(get(&first, &sleepy).await.expect("get")["status"], "working");
    let started = Instant::now();
    while model.request_count() < 2 {
        assert!(started.elapsed() < Duration::from_secs(30), "the sleepy child never called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The server dies mid-run (no shutdown: SIGKILL).
    let killed = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
    assert!(killed.expect("kill").success());
    drop(first);

    let (second, _) = serve(&home, fx.root).await;
    let after = get(&second, &done).await.expect("get");
    assert_eq!(after["status"], "completed", "a finished task's result survives: {after}");
    assert_eq!(after["result"]["structuredContent"]["results"][0]["summary"], "Done: Quick answer");
    let abandoned = get(&second, &sleepy).await.expect("get");
    assert_eq!(abandoned["status"], "failed", "{abandoned}");
    assert_eq!(abandoned["error"]["data"]["state"], "unknown", "{abandoned}");

    // Another session's server: exactly as an unknown id.
    let (stranger, _) = serve(&home, other_session).await;
    let foreign = get(&stranger, &done).await.expect_err("foreign");
    let unknown = get(&stranger, "deleg_00000000").await.expect_err("unknown");
    assert_eq!(foreign.replace(&done, "ID"), unknown.replace("deleg_00000000", "ID"));
    stranger.cancel().await.expect("close");
    second.cancel().await.expect("close");
}

/// The host's trace context (`_meta.traceparent`, SEP-414) becomes the
/// parent of the delegation's spans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_requests_traceparent_parents_the_delegation_spans() {
    use retinue_testkit::otlp::OtlpReceiver;
    let receiver = OtlpReceiver::start();
    let home = TempHome::new();
    let fx = HermesDb::standard(&home.db_path(), now());
    let model = FakeModel::start();
    model.set_default(Reply::text("traced").with_usage(Usage::new(10, 5)));
    let yaml = format!(
        "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test\n",
        model.base_url()
    );
    std::fs::write(home.path().join("config.yaml"), yaml).expect("config.yaml");
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("--home").arg(home.path()).args(["mcp", "--session", fx.root]);
    cmd.env_remove("HERMES_HOME").env_remove("TRACEPARENT").kill_on_drop(true);
    cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint());
    let (transport, _stderr) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start retinue mcp");
    let client = ().serve(transport).await.expect("initialize");
    let mut meta = rmcp_client::model::MetaObject::new();
    meta.set_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    let mut params = CallToolRequestParams::new("delegate_task")
        .with_arguments(json!({"goal": "Traced over MCP"}).as_object().expect("object").clone());
    params.meta = Some(rmcp_client::model::RequestMetaObject(meta));
    let result = client.call_tool(params).await.expect("tools/call");
    assert_eq!(result.is_error, Some(false), "{result:?}");
    let spans = receiver.wait_for(|s| s.iter().any(|s| s.name == "invoke_agent subagent"));
    let call = spans
        .iter()
        .find(|s| s.name == "execute_tool delegate_task")
        .unwrap_or_else(|| panic!("no call span: {spans:#?}"));
    assert_eq!(call.trace_id, "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(call.parent_span_id, "b7ad6b7169203331");
    client.cancel().await.expect("close");
}

/// #35: `retinue mcp` started in `/` (or the user's home) never makes it the
/// workspace: `delegate_task` refuses the workspace-bound toolsets, saying
/// how to set the project directory; the registry tools still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_server_started_in_root_refuses_the_workspace_toolsets() {
    let home = TempHome::new();
    let model = FakeModel::start();
    model.set_default(Reply::text("should not run").with_usage(Usage::new(1, 1)));
    std::fs::write(
        home.path().join("config.yaml"),
        format!("delegation:\n  model: m\n  base_url: {}\n", model.base_url()),
    )
    .expect("config");
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("--home").arg(home.path()).args(["mcp", "--new-session"]).current_dir("/");
    cmd.env_remove("HERMES_HOME").env_remove("HERMES_PROFILE").kill_on_drop(true);
    let (transport, _stderr) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start retinue mcp");
    let client = ().serve(transport).await.expect("initialize");
    let call = |args: Value| {
        let params = CallToolRequestParams::new("delegate_task")
            .with_arguments(args.as_object().expect("object").clone());
        client.call_tool(params)
    };
    let refused = call(json!({"goal": "read /etc"})).await.expect("answered");
    assert_eq!(refused.is_error, Some(true));
    let text = serde_json::to_string(&refused.content).expect("json");
    assert!(text.contains("refused as a workspace") && text.contains("--workspace"), "{text}");
    let refused = call(json!({"goal": "x", "toolsets": ["terminal"]})).await.expect("answered");
    assert_eq!(refused.is_error, Some(true));
    assert_eq!(model.request_count(), 0, "no child ran");
    let listed = client
        .call_tool(CallToolRequestParams::new("list_subagents"))
        .await
        .expect("list_subagents");
    assert_ne!(listed.is_error, Some(true));
    client.cancel().await.expect("close");
}
