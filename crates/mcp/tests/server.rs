//! Drives the MCP server through rmcp's client over an in-process duplex
//! transport, with children on the real runtime against testkit's fake
//! model server: initialize, list tools, delegate with progress, follow up,
//! list, show, tombstone, usage, a restarted server in the same project,
//! another project denied, concurrency and cancellation.

#![expect(clippy::unwrap_used)]

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use retinue_core::SystemClock;
use retinue_delegate::{Delegator, DelegatorParts};
use retinue_lineage::Authority;
use retinue_mcp::{McpParts, RetinueServer, ServerOptions, SessionChoice};
use retinue_runtime::{ChatRuntime, NoTools, RuntimeConfig};
use retinue_store::{Store, StoreOptions};
use retinue_testkit::TempHome;
use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientRequest, ProgressNotificationParam, Request,
};
use rmcp::service::{NotificationContext, PeerRequestOptions, RunningService};
use rmcp::{ClientHandler, RoleClient, ServiceExt};
use serde_json::{Value, json};

/// A client that records progress and log notifications, and declares the
/// MCP Tasks extension when `tasks` is set.
#[derive(Clone, Default)]
struct Recorder {
    progress: Arc<Mutex<Vec<ProgressNotificationParam>>>,
    logged: Arc<Mutex<Vec<Value>>>,
    tasks: bool,
}

#[expect(deprecated)] // notifications/message: what the server announces completions with
impl ClientHandler for Recorder {
    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        self.progress.lock().unwrap().push(params);
    }

    async fn on_logging_message(
        &self,
        params: rmcp::model::LoggingMessageNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        self.logged.lock().unwrap().push(params.data);
    }

    fn get_info(&self) -> rmcp::model::ClientConfig {
        let mut info = rmcp::model::ClientConfig::default();
        if self.tasks {
            info.capabilities = rmcp::model::ClientCapabilities::builder().enable_tasks().build();
        }
        info
    }
}

type Client = RunningService<RoleClient, Recorder>;

/// The fake model: `Done: <first line of the last user turn>`, 1000/200
/// tokens, $0.004; a goal containing "slow" streams slowly, one containing
/// "sleepy" answers after a minute.
fn fake_model() -> FakeModel {
    let model = FakeModel::start();
    model.set_handler(|request| {
        let messages = request.messages();
        let last = messages.iter().rev().find(|m| m["role"] == "user")?;
        let text = last["content"].as_str().unwrap_or_default().to_owned();
        let first = text.lines().next().unwrap_or_default().to_owned();
        let usage = Usage::new(1000, 200).cost(0.004);
        if first.contains("sleepy") {
            return Some(
                Reply::text("too late").with_usage(usage).delayed(Duration::from_secs(60)),
            );
        }
        if first.contains("slow") {
            let long = "word ".repeat(200);
            return Some(Reply::text(&long).with_usage(usage).chunk_delay(Duration::from_secs(5)));
        }
        Some(
            Reply::text(&format!("Done: {first}"))
                .with_usage(usage)
                .delayed(Duration::from_millis(300)),
        )
    });
    model
}

fn open(home: &TempHome) -> Arc<Store> {
    Arc::new(home.open_store_with(StoreOptions::default().with_clock(Arc::new(SystemClock))))
}

/// A server as `retinue mcp` wires it, acting for `choice`.
fn server(
    home: &TempHome,
    model: &FakeModel,
    choice: &SessionChoice,
    stream: bool,
) -> RetinueServer {
    let store = open(home);
    let config = retinue_config::DelegationConfig {
        model: "fake-model".into(),
        base_url: model.base_url(),
        stream,
        ..retinue_config::DelegationConfig::default()
    };
    let config_budget = config.budget;
    let runtime =
        ChatRuntime::new(RuntimeConfig::from_delegation(&config).unwrap(), Arc::new(NoTools))
            .unwrap();
    let authority = Arc::new(Authority::new(store.clone(), store.clone(), ""));
    let delegator = Delegator::new(DelegatorParts {
        backend: retinue_core::Backend::of(store.clone()),
        authority: authority.clone(),
        runtime: Arc::new(runtime),
        completions: None,
        config: (&config).into(),
        profile: String::new(),
    });
    let parent = retinue_mcp::resolve_session(store.as_ref(), choice, "").unwrap();
    let parts = McpParts {
        workspace_refused: None,
        profile: String::new(),
        backend: retinue_core::Backend::of(store.clone()),
        budget: config_budget,
        authority,
        delegator: Ok(delegator),
        workspace: None,
        toolsets: Vec::new(),
    };
    let project = parent.project.map(|p| p.display().to_string());
    let options = ServerOptions { progress_interval: Duration::from_millis(50) };
    RetinueServer::new(parts, parent.id, project, options)
}

async fn connect(server: RetinueServer) -> Client {
    let (server_io, client_io) = tokio::io::duplex(1 << 16);
    tokio::spawn(async move {
        let running = server.serve(server_io).await.unwrap();
        let _ = running.waiting().await;
    });
    Recorder::default().serve(client_io).await.unwrap()
}

async fn call(client: &Client, tool: &str, args: Value) -> CallToolResult {
    let Value::Object(args) = args else { panic!("arguments must be an object") };
    client
        .call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(args))
        .await
        .unwrap()
}

fn ok(result: &CallToolResult) -> Value {
    assert_eq!(result.is_error, Some(false), "expected success, got {result:?}");
    result.structured_content.clone().expect("structured content")
}

fn err_text(result: &CallToolResult) -> String {
    assert_eq!(result.is_error, Some(true), "expected a tool error, got {result:?}");
    let value = serde_json::to_value(&result.content[0]).unwrap();
    value["text"].as_str().unwrap().to_owned()
}

fn project(dir: &Path) -> SessionChoice {
    SessionChoice::Project(dir.to_path_buf())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_story_over_mcp() {
    let home = TempHome::new();
    let model = fake_model();
    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();

    // Day 1, project A.
    let server_a = server(&home, &model, &project(dir_a.path()), false);
    let session_a = server_a.session_id().to_owned();
    assert!(session_a.starts_with("mcp_"));
    let client = connect(server_a).await;
    let info = client.peer_info().expect("initialized");
    assert_eq!(info.server_info.as_ref().unwrap().name, "retinue");
    assert!(info.instructions.as_deref().unwrap().contains(&session_a));

    let tools = client.list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(
        names,
        [
            "delegate_task",
            "list_subagents",
            "show_subagent",
            "tombstone_subagent",
            "subagent_usage",
            "wait_subagents",
            "steer_subagent",
            "cancel_subagent",
            "list_approvals",
            "decide_approval",
            "subagent_changes",
            "apply_changes",
            "discard_changes"
        ]
    );
    let schema = serde_json::to_value(&*tools[0].input_schema).unwrap();
    assert!(schema["properties"]["follow_up"]["description"].is_string());
    assert!(schema["properties"]["tasks"]["items"]["required"] == json!(["goal"]));

    // Delegate, with a progress token: notifications arrive while the child runs.
    let handle = client
        .send_cancellable_request(
            ClientRequest::CallToolRequest(Request::new(
                CallToolRequestParams::new("delegate_task").with_arguments(
                    json!({"goal": "Survey the storage layer"}).as_object().unwrap().clone(),
                ),
            )),
            PeerRequestOptions::no_options(),
        )
        .await
        .unwrap();
    let response = handle.await_response().await.unwrap();
    let rmcp::model::ServerResult::CallToolResult(result) = response else {
        panic!("unexpected response {response:?}")
    };
    let spawned = ok(&result);
    assert_eq!(spawned["results"][0]["status"], "completed", "{spawned}");
    assert_eq!(spawned["results"][0]["summary"], "Done: Survey the storage layer");
    let child = spawned["results"][0]["subagent_id"].as_str().unwrap().to_owned();
    let progress = client.service().progress.lock().unwrap().clone();
    assert!(!progress.is_empty(), "no progress notification");
    assert!(progress[0].message.as_deref().unwrap().contains("1 subagent(s)"));

    // Follow up.
    let again = ok(&call(
        &client,
        "delegate_task",
        json!({"follow_up": child, "goal": "Which index answers a lookup?"}),
    )
    .await);
    assert_eq!(again["mode"], "follow_up");
    assert_eq!(again["results"][0]["summary"], "Done: Which index answers a lookup?");

    // List and show.
    let listed = ok(&call(&client, "list_subagents", json!({})).await);
    assert_eq!(listed["session_id"], session_a);
    assert_eq!(listed["subagents"][0]["subagent_id"], child);
    assert_eq!(listed["subagents"][0]["goal"], "Survey the storage layer");
    let shown = ok(&call(&client, "show_subagent", json!({"id": child})).await);
    assert_eq!(shown["retained"], true);
    assert_eq!(shown["status"], "completed");
    assert_eq!(shown["last_answer"], "Done: Which index answers a lookup?");
    assert_eq!(shown["usage"]["runs"], 2);
    assert_eq!(shown["usage"]["totals"]["input_tokens"], 2000.0);

    // Usage over the lineage.
    let usage = ok(&call(&client, "subagent_usage", json!({})).await);
    assert!((usage["totals"]["cost_usd"].as_f64().unwrap() - 0.008).abs() < 1e-9, "{usage}");
    assert_eq!(usage["children"].as_array().unwrap().len(), 1);
    assert_eq!(usage["children"][0]["subagent_id"], child);
    assert_eq!(usage["children"][0]["runs"], 2);
    client.cancel().await.unwrap();

    // Day 2: a restarted server in the same project is the same session and
    // follows up yesterday's child.
    let server_a2 = server(&home, &model, &project(dir_a.path()), false);
    assert_eq!(server_a2.session_id(), session_a);
    let client = connect(server_a2).await;
    let day2 = ok(&call(
        &client,
        "delegate_task",
        json!({"follow_up": child, "goal": "And the busy timeout?"}),
    )
    .await);
    assert_eq!(day2["results"][0]["summary"], "Done: And the busy timeout?");

    // Another project never sees or reaches it: foreign ≡ missing.
    let server_b = server(&home, &model, &project(dir_b.path()), false);
    assert_ne!(server_b.session_id(), session_a);
    let other = connect(server_b).await;
    let denied =
        err_text(&call(&other, "delegate_task", json!({"follow_up": child, "goal": "hi"})).await);
    let missing = err_text(
        &call(&other, "delegate_task", json!({"follow_up": "sa-0-00000000", "goal": "hi"})).await,
    );
    assert_eq!(denied.replace(&child, "ID"), missing.replace("sa-0-00000000", "ID"));
    assert!(denied.contains("is not a running subagent or a retained completed child"));
    assert_eq!(err_text(&call(&other, "show_subagent", json!({"id": child})).await), denied);
    assert_eq!(err_text(&call(&other, "tombstone_subagent", json!({"id": child})).await), denied);
    assert_eq!(ok(&call(&other, "list_subagents", json!({})).await)["subagents"], json!([]));
    let their_usage = ok(&call(&other, "subagent_usage", json!({})).await);
    assert_eq!(their_usage["children"], json!([]));
    assert_eq!(their_usage["totals"]["cost_usd"], 0.0);
    other.cancel().await.unwrap();

    // Tombstone one of two new children; the other stays addressable.
    let batch = ok(&call(
        &client,
        "delegate_task",
        json!({"tasks": [{"goal": "Draft the notes"}, {"goal": "List the changes"}]}),
    )
    .await);
    let gone = batch["results"][0]["subagent_id"].as_str().unwrap().to_owned();
    let kept = batch["results"][1]["subagent_id"].as_str().unwrap().to_owned();
    let tomb =
        ok(&call(&client, "tombstone_subagent", json!({"id": gone, "reason": "superseded"})).await);
    assert_eq!(tomb["tombstoned"], true);
    assert_eq!(tomb["reason"], "manual");
    assert_eq!(tomb["tombstone_note"], "superseded");
    let shown = ok(&call(&client, "show_subagent", json!({"id": gone})).await);
    assert_eq!(shown["retained"], false);
    assert_eq!(shown["tombstoned"]["reason"], "manual");
    assert_eq!(shown["last_answer"], "Done: Draft the notes");
    let refused =
        err_text(&call(&client, "delegate_task", json!({"follow_up": gone, "goal": "more"})).await);
    assert!(refused.contains("was tombstoned"), "{refused}");
    assert!(
        err_text(&call(&client, "tombstone_subagent", json!({"id": gone})).await)
            .contains("was tombstoned")
    );
    let ids: Vec<Value> = ok(&call(&client, "list_subagents", json!({})).await)["subagents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["subagent_id"].clone())
        .collect();
    assert!(
        ids.contains(&json!(kept)) && ids.contains(&json!(child)) && !ids.contains(&json!(gone))
    );

    // Bad arguments are tool errors with the tool's own texts.
    let bad_call = call(&client, "delegate_task", json!({"tasks": "nope"})).await;
    let bad = err_text(&bad_call);
    assert!(!bad.is_empty());
    // The host gets the error's kind to branch on, beside hermes's text.
    assert_eq!(bad_call.structured_content, Some(json!({"error": bad, "code": "usage"})));
    assert!(
        err_text(&call(&client, "show_subagent", json!({})).await)
            .contains("missing argument `id`")
    );
    client.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_call_does_not_block_and_can_be_cancelled() {
    let home = TempHome::new();
    let model = fake_model();
    let dir = tempfile::tempdir().unwrap();
    let server = server(&home, &model, &project(dir.path()), true);
    let session = server.session_id().to_owned();
    let client = connect(server).await;

    // Three chunks 5 s apart: 10 s or more if nobody cancels.
    let handle = client
        .send_cancellable_request(
            ClientRequest::CallToolRequest(Request::new(
                CallToolRequestParams::new("delegate_task")
                    .with_arguments(json!({"goal": "a slow survey"}).as_object().unwrap().clone()),
            )),
            PeerRequestOptions::no_options(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;

    // Other requests are answered while it runs: the list comes back while
    // the child has billed nothing yet (it is still mid-answer).
    let listed = ok(&call(&client, "list_subagents", json!({})).await);
    assert_eq!(listed["subagents"], json!([]));
    let store = open(&home);
    let billed = retinue_usage::load_child_usage_attributions(store.as_ref(), &session).unwrap();
    assert!(billed.is_empty(), "the list waited for the long call to end: {billed:?}");
    assert!(!client.service().progress.lock().unwrap().is_empty());

    // Cancel: the child stops and its spent usage is billed as interrupted.
    handle.cancel(Some("user pressed Esc".into())).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        let rows = retinue_usage::load_child_usage_attributions(store.as_ref(), &session).unwrap();
        if let Some(row) = rows.first() {
            break row.usage["status"].as_str().unwrap_or_default().to_owned();
        }
        assert!(Instant::now() < deadline, "no ledger row after the cancel");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Interrupted, not completed: the child was stopped before its answer's
    // last chunk (which no uncancelled run reaches in under 10 s).
    assert_eq!(status, "interrupted");
    // The server is still serving.
    ok(&call(&client, "subagent_usage", json!({})).await);
    client.cancel().await.unwrap();
}

#[test]
fn sessions_resolve_as_documented() {
    let home = TempHome::new();
    let store = open(&home);
    let dir = tempfile::tempdir().unwrap();
    let first = retinue_mcp::resolve_session(store.as_ref(), &project(dir.path()), "").unwrap();
    assert!(first.created);
    let again = retinue_mcp::resolve_session(store.as_ref(), &project(dir.path()), "").unwrap();
    assert_eq!((again.id.as_str(), again.created), (first.id.as_str(), false));
    let row = retinue_core::SessionGraph::session(store.as_ref(), &first.id).unwrap().unwrap();
    assert_eq!(row.source, "mcp");
    let profiled =
        retinue_mcp::resolve_session(store.as_ref(), &project(dir.path()), "coder").unwrap();
    assert_ne!(profiled.id, first.id);
    let fresh = retinue_mcp::resolve_session(store.as_ref(), &SessionChoice::New, "").unwrap();
    assert!(fresh.created && fresh.id != first.id);
    let named = retinue_mcp::resolve_session(
        store.as_ref(),
        &SessionChoice::Existing(fresh.id.clone()),
        "",
    )
    .unwrap();
    assert_eq!(named.id, fresh.id);
    let missing =
        retinue_mcp::resolve_session(store.as_ref(), &SessionChoice::Existing("nope".into()), "");
    assert!(matches!(missing, Err(retinue_mcp::McpError::NoSession(_))));
    // Another tenant's session (#35): exactly as a missing one.
    let foreign = retinue_mcp::resolve_session(
        store.as_ref(),
        &SessionChoice::Existing(profiled.id.clone()),
        "other",
    );
    assert!(matches!(foreign, Err(retinue_mcp::McpError::NoSession(_))), "{foreign:?}");
    let own = retinue_mcp::resolve_session(
        store.as_ref(),
        &SessionChoice::Existing(profiled.id.clone()),
        "coder",
    );
    assert!(own.is_ok());
    // A project session row another tenant planted under this tenant's id
    // is never adopted.
    let dir2 = tempfile::tempdir().unwrap();
    let canonical = dir2.path().canonicalize().unwrap();
    let id = retinue_mcp::project_session_id(&canonical, "victim");
    retinue_core::SessionStore::create_session(
        store.as_ref(),
        &retinue_core::NewSession {
            id: id.clone(),
            source: "mcp".into(),
            profile_name: Some("attacker".into()),
            ..retinue_core::NewSession::default()
        },
    )
    .unwrap();
    let planted = retinue_mcp::resolve_session(store.as_ref(), &project(dir2.path()), "victim");
    assert!(matches!(planted, Err(retinue_mcp::McpError::NoSession(_))), "{planted:?}");
}

async fn connect_with(server: RetinueServer, recorder: Recorder) -> Client {
    let (server_io, client_io) = tokio::io::duplex(1 << 16);
    tokio::spawn(async move {
        let running = server.serve(server_io).await.unwrap();
        let _ = running.waiting().await;
    });
    recorder.serve(client_io).await.unwrap()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < Duration::from_secs(30), "{what}: not within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A host without Tasks: `background: true` returns at once; the result is
/// announced, delivered once (to `wait_subagents`, or attached to the next
/// tool result), and a running child can be steered or cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_delegation_for_hosts_without_tasks() {
    let home = TempHome::new();
    let model = fake_model();
    let dir = tempfile::tempdir().unwrap();
    let recorder = Recorder::default();
    let client =
        connect_with(server(&home, &model, &project(dir.path()), false), recorder.clone()).await;

    let started = Instant::now();
    let d =
        ok(&call(&client, "delegate_task", json!({"goal": "Index the docs", "background": true}))
            .await);
    assert!(started.elapsed() < Duration::from_millis(300), "returns before the child's 300 ms");
    assert_eq!(d["status"], "dispatched", "{d}");
    let id = d["delegation_id"].as_str().unwrap().to_owned();
    let got =
        ok(&call(&client, "wait_subagents", json!({"ids": [id], "timeout_seconds": 30})).await);
    assert_eq!(got["results"][0]["status"], "delivered", "{got}");
    assert_eq!(got["results"][0]["result"]["results"][0]["summary"], "Done: Index the docs");
    let again =
        ok(&call(&client, "wait_subagents", json!({"ids": [id], "timeout_seconds": 0})).await);
    assert_eq!(again["results"][0]["status"], "already_delivered");
    eventually("the completion is announced", || {
        recorder.logged.lock().unwrap().iter().any(|l| l["delegation_id"] == id.as_str())
    })
    .await;

    // Not waited for: attached to the next tool result, once.
    let d2 =
        ok(&call(&client, "delegate_task", json!({"goal": "Count the files", "background": true}))
            .await);
    let id2 = d2["delegation_id"].as_str().unwrap().to_owned();
    eventually("the second unit finishes", || {
        recorder.logged.lock().unwrap().iter().any(|l| l["delegation_id"] == id2.as_str())
    })
    .await;
    let listed = ok(&call(&client, "list_subagents", json!({})).await);
    assert_eq!(listed["delivered"][0]["delegation_id"], id2, "{listed}");
    assert_eq!(listed["delivered"][0]["result"]["results"][0]["summary"], "Done: Count the files");
    let next = ok(&call(&client, "list_subagents", json!({})).await);
    assert!(next.get("delivered").is_none(), "delivered once: {next}");

    // Steer, then cancel, a slow child; bad input is a tool error.
    let slow =
        ok(&call(&client, "delegate_task", json!({"goal": "a sleepy crawl", "background": true}))
            .await);
    let sid = slow["children"][0]["subagent_id"].as_str().unwrap().to_owned();
    let unit = slow["delegation_id"].as_str().unwrap().to_owned();
    eventually("the slow child calls the model", || model.request_count() >= 3).await;
    let steered =
        ok(&call(&client, "steer_subagent", json!({"id": sid, "message": "faster"})).await);
    assert_eq!(steered["status"], "delivered", "{steered}");
    let cancelled = ok(&call(&client, "cancel_subagent", json!({"id": unit})).await);
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    let stopped = ok(&call(&client, "wait_subagents", json!({"ids": [unit]})).await);
    assert_eq!(stopped["results"][0]["result"]["results"][0]["exit_reason"], "cancelled");
    assert!(
        err_text(&call(&client, "cancel_subagent", json!({"id": unit})).await)
            .contains("already finished")
    );
    let late = ok(&call(&client, "steer_subagent", json!({"id": sid, "message": "late"})).await);
    assert_eq!(late["status"], "missed_steer");
    assert!(err_text(&call(&client, "wait_subagents", json!({"ids": []})).await).contains("'ids'"));
    assert!(
        err_text(
            &call(&client, "wait_subagents", json!({"ids": [unit], "timeout_seconds": 9999})).await
        )
        .contains("timeout_seconds")
    );
    // Another project's session: foreign ≡ missing.
    let dir_b = tempfile::tempdir().unwrap();
    let other = connect(server(&home, &model, &project(dir_b.path()), false)).await;
    let theirs =
        ok(&call(&other, "wait_subagents", json!({"ids": [id2], "timeout_seconds": 0})).await);
    assert_eq!(theirs["results"][0], json!({"id": id2, "status": "not_found"}));
    assert!(
        err_text(&call(&other, "cancel_subagent", json!({"id": unit})).await)
            .contains("not a running subagent")
    );
    other.cancel().await.unwrap();
    client.cancel().await.unwrap();
}

async fn task_request(client: &Client, request: ClientRequest) -> rmcp::model::ServerResult {
    client.send_request(request).await.unwrap_or_else(|e| panic!("request failed: {e}"))
}

async fn get_task(client: &Client, id: &str) -> Result<Value, String> {
    let request = ClientRequest::GetTaskRequest(Request::new(rmcp::model::GetTaskParams::new(id)));
    match client.send_request(request).await {
        Ok(rmcp::model::ServerResult::GetTaskResult(r)) => Ok(serde_json::to_value(r).unwrap()),
        Ok(other) => panic!("unexpected {other:?}"),
        Err(e) => Err(e.to_string()),
    }
}

/// A host with MCP Tasks: `delegate_task` answers with a task handle at
/// once; `tasks/get` polls the registry (also from a restarted server);
/// `tasks/cancel` stops the children; another session's task is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_tasks_create_poll_cancel_and_survive_a_restart() {
    let home = TempHome::new();
    let model = fake_model();
    let dir = tempfile::tempdir().unwrap();
    let tasks = Recorder { tasks: true, ..Recorder::default() };
    let client =
        connect_with(server(&home, &model, &project(dir.path()), false), tasks.clone()).await;
    let info = client.peer_info().unwrap();
    assert!(info.capabilities.supports_tasks(), "the server declares the Tasks extension");

    let create = |goal: &str| {
        ClientRequest::CallToolRequest(Request::new(
            CallToolRequestParams::new("delegate_task")
                .with_arguments(json!({"goal": goal}).as_object().unwrap().clone()),
        ))
    };
    let rmcp::model::ServerResult::CreateTaskResult(handle) =
        task_request(&client, create("Summarise the spec")).await
    else {
        panic!("expected a task handle")
    };
    let task_id = handle.task.task_id.clone();
    assert_eq!(handle.task.status, rmcp::model::TaskStatus::Working);
    let mut state = get_task(&client, &task_id).await.unwrap();
    let started = Instant::now();
    while state["status"] == "working" {
        assert!(started.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
        state = get_task(&client, &task_id).await.unwrap();
    }
    assert_eq!(state["status"], "completed", "{state}");
    let body = &state["result"]["structuredContent"];
    assert_eq!(body["results"][0]["summary"], "Done: Summarise the spec", "{state}");
    // Read through tasks/get: never attached to a later tool result again.
    let listed = ok(&call(&client, "list_subagents", json!({})).await);
    assert!(listed.get("delivered").is_none(), "{listed}");

    // Cancel a slow one.
    let rmcp::model::ServerResult::CreateTaskResult(slow) =
        task_request(&client, create("a sleepy dig")).await
    else {
        panic!("expected a task handle")
    };
    let slow_id = slow.task.task_id.clone();
    let cancel = ClientRequest::CancelTaskRequest(Request::new(
        rmcp::model::CancelTaskParams::new(slow_id.clone()),
    ));
    task_request(&client, cancel).await;
    let cancelled = get_task(&client, &slow_id).await.unwrap();
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    // `tasks/update` is implied by the tasks capability (#35): answered
    // with a clear error, never "method not found".
    let update = ClientRequest::UpdateTaskRequest(Request::new(
        rmcp::model::UpdateTaskParams::new(task_id.clone(), Default::default()),
    ));
    let refused = client.send_request(update).await.expect_err("nothing to update");
    assert!(refused.to_string().contains("not waiting for input"), "{refused}");
    client.cancel().await.unwrap();

    // A restarted server (same project, same session) answers for both.
    let again =
        connect_with(server(&home, &model, &project(dir.path()), false), tasks.clone()).await;
    assert_eq!(get_task(&again, &task_id).await.unwrap()["status"], "completed");
    assert_eq!(get_task(&again, &slow_id).await.unwrap()["status"], "cancelled");
    // Another session: exactly as unknown.
    let dir_b = tempfile::tempdir().unwrap();
    let other = connect_with(server(&home, &model, &project(dir_b.path()), false), tasks).await;
    let foreign = get_task(&other, &task_id).await.unwrap_err();
    let unknown = get_task(&other, "deleg_00000000").await.unwrap_err();
    assert_eq!(foreign.replace(&task_id, "ID"), unknown.replace("deleg_00000000", "ID"));
    other.cancel().await.unwrap();
    again.cancel().await.unwrap();
}

/// `logging` is declared, so `logging/setLevel` is answered (#35: the MCP
/// Inspector sets it right after connecting) and honoured: above `notice`,
/// the completion notice is not sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(deprecated)]
async fn logging_set_level_is_answered_and_honoured() {
    let home = TempHome::new();
    let model = fake_model();
    let dir = tempfile::tempdir().unwrap();
    let recorder = Recorder::default();
    let client =
        connect_with(server(&home, &model, &project(dir.path()), false), recorder.clone()).await;
    client
        .peer()
        .set_level(rmcp::model::SetLevelRequestParams::new(rmcp::model::LoggingLevel::Warning))
        .await
        .expect("logging/setLevel is answered");
    let d = ok(&call(&client, "delegate_task", json!({"goal": "Quiet", "background": true})).await);
    let id = d["delegation_id"].as_str().unwrap().to_owned();
    let got =
        ok(&call(&client, "wait_subagents", json!({"ids": [id], "timeout_seconds": 30})).await);
    assert_eq!(got["results"][0]["status"], "delivered", "{got}");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(recorder.logged.lock().unwrap().is_empty(), "a notice went out above the level");
    // Back to debug: the next completion is announced.
    client
        .peer()
        .set_level(rmcp::model::SetLevelRequestParams::new(rmcp::model::LoggingLevel::Debug))
        .await
        .expect("set again");
    let d = ok(&call(&client, "delegate_task", json!({"goal": "Loud", "background": true})).await);
    let id = d["delegation_id"].as_str().unwrap().to_owned();
    eventually("the completion is announced", || {
        recorder.logged.lock().unwrap().iter().any(|l| l["delegation_id"] == id.as_str())
    })
    .await;
    client.cancel().await.unwrap();
}

/// #35: `mcp --http` answers only its own loopback Host with its port, and an
/// `Origin` only when it is a loopback page of that port (the transport's
/// MUST against DNS rebinding); no `Origin` is a non-browser client.
#[test]
fn mcp_over_http_validates_host_and_origin() {
    use std::io::{Read, Write};
    let home = TempHome::new();
    let model = fake_model();
    let dir = tempfile::tempdir().unwrap();
    let srv = server(&home, &model, &project(dir.path()), false);
    let shutdown = retinue_mcp::McpShutdown::new();
    let (tx, rx) = std::sync::mpsc::channel();
    let stopper = shutdown.clone();
    let thread = std::thread::spawn(move || {
        retinue_mcp::serve_http(srv, "127.0.0.1:0".parse().unwrap(), &stopper, |bound| {
            tx.send(bound).unwrap();
        })
    });
    let addr = rx.recv_timeout(Duration::from_secs(10)).expect("listening");
    let port = addr.port();
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#;
    let status = |host: &str, origin: Option<&str>| {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let origin = origin.map(|o| format!("Origin: {o}\r\n")).unwrap_or_default();
        write!(
            s,
            "POST /mcp HTTP/1.1\r\nHost: {host}\r\n{origin}Content-Type: application/json\r\n\
             Accept: application/json, text/event-stream\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut head = [0u8; 12];
        s.read_exact(&mut head).unwrap();
        String::from_utf8_lossy(&head[9..12]).into_owned()
    };
    let here = format!("127.0.0.1:{port}");
    assert_eq!(status(&here, None), "200");
    assert_eq!(status(&here, Some(&format!("http://127.0.0.1:{port}"))), "200");
    assert_eq!(
        status(&format!("localhost:{port}"), Some(&format!("http://localhost:{port}"))),
        "200"
    );
    for origin in [
        "http://evil.example".to_owned(),
        format!("http://evil.example:{port}"),
        format!("http://127.0.0.1:{}", port.wrapping_add(1)),
        "null".to_owned(),
    ] {
        assert_eq!(status(&here, Some(&origin)), "403", "{origin}");
    }
    assert_eq!(status(&format!("evil.example:{port}"), None), "403");
    shutdown.stop();
    thread.join().unwrap().unwrap();
}

fn git(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgSign=false"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A server for `choice` whose children work in isolated worktrees of the
/// repository `workspace`.
fn isolated_server(
    home: &TempHome,
    model: &FakeModel,
    choice: &SessionChoice,
    workspace: &Path,
) -> RetinueServer {
    let store = open(home);
    let config = retinue_config::DelegationConfig {
        model: "fake-model".into(),
        base_url: model.base_url(),
        ..retinue_config::DelegationConfig::default()
    };
    let runtime =
        ChatRuntime::new(RuntimeConfig::from_delegation(&config).unwrap(), Arc::new(NoTools))
            .unwrap();
    let authority = Arc::new(Authority::new(store.clone(), store.clone(), ""));
    let worktrees = retinue_worktree::GitWorktrees::new(retinue_worktree::root_of(home.path()));
    let delegator = Delegator::new(DelegatorParts {
        backend: retinue_core::Backend::of(store.clone()),
        authority: authority.clone(),
        runtime: Arc::new(runtime),
        completions: None,
        config: (&config).into(),
        profile: String::new(),
    })
    .with_isolation(Arc::new(worktrees));
    let parent = retinue_mcp::resolve_session(store.as_ref(), choice, "").unwrap();
    let parts = McpParts {
        workspace_refused: None,
        profile: String::new(),
        backend: retinue_core::Backend::of(store.clone()),
        budget: config.budget,
        authority,
        delegator: Ok(delegator),
        workspace: Some(workspace.to_path_buf()),
        toolsets: Vec::new(),
    };
    let options = ServerOptions { progress_interval: Duration::from_millis(50) };
    RetinueServer::new(parts, parent.id, None, options)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolated_children_and_their_change_sets_over_mcp() {
    let home = TempHome::new();
    let model = fake_model();
    let repo = tempfile::tempdir().unwrap();
    std::fs::write(repo.path().join("README"), "hello\n").unwrap();
    git(repo.path(), &["init", "-q", "-b", "main"]);
    git(repo.path(), &["add", "-A"]);
    git(repo.path(), &["commit", "-q", "-m", "init"]);
    let client = connect(isolated_server(&home, &model, &project(repo.path()), repo.path())).await;

    let result =
        call(&client, "delegate_task", json!({"goal": "Look around", "isolation": "worktree"}))
            .await;
    let spawned = ok(&result);
    let child = &spawned["results"][0];
    assert_eq!(child["changes"]["state"], "empty", "{spawned}");
    // The receipts reach the calling model as their own text block.
    let second = serde_json::to_value(&result.content[1]).unwrap();
    assert_eq!(second["text"], "receipts: no tool calls");
    let id = child["subagent_id"].as_str().unwrap().to_owned();
    let worktree = std::path::PathBuf::from(child["changes"]["worktree"].as_str().unwrap());

    // What the child would have written (the runtime here has no tools);
    // its follow-up records it.
    std::fs::write(worktree.join("README"), "hello\nfrom the child\n").unwrap();
    let again =
        ok(&call(&client, "delegate_task", json!({"follow_up": id, "goal": "Done?"})).await);
    assert_eq!(again["results"][0]["changes"]["state"], "pending", "{again}");
    let pending = ok(&call(&client, "subagent_changes", json!({"pending": true})).await);
    assert_eq!(pending["changes"][0]["subagent_id"], json!(id), "{pending}");
    let shown = ok(&call(&client, "subagent_changes", json!({"id": id, "diff": true})).await);
    assert!(shown["diff"].as_str().unwrap().contains("+from the child"), "{shown}");
    assert_eq!(std::fs::read_to_string(repo.path().join("README")).unwrap(), "hello\n");

    // Another project's session is answered as if it did not exist.
    let elsewhere = tempfile::tempdir().unwrap();
    let other =
        connect(isolated_server(&home, &model, &project(elsewhere.path()), elsewhere.path())).await;
    let foreign = err_text(&call(&other, "apply_changes", json!({"id": id})).await);
    let missing = err_text(&call(&other, "apply_changes", json!({"id": "sa-0-00000000"})).await);
    assert_eq!(foreign.replace(&id, "ID"), missing.replace("sa-0-00000000", "ID"));
    other.cancel().await.unwrap();

    let applied = ok(&call(&client, "apply_changes", json!({"id": id})).await);
    assert_eq!(applied["state"], "applied");
    assert_eq!(
        std::fs::read_to_string(repo.path().join("README")).unwrap(),
        "hello\nfrom the child\n"
    );
    let twice = call(&client, "apply_changes", json!({"id": id})).await;
    assert!(err_text(&twice).contains("already applied"));
    let dropped = ok(&call(&client, "discard_changes", json!({"id": id})).await);
    assert_eq!(dropped["state"], "discarded");
    assert!(!worktree.exists());
    client.cancel().await.unwrap();
}
