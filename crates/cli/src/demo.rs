//! `retinue demo`: the whole retained-subagent lifecycle on a fresh home, in
//! a few seconds and with no network (manual clock, children on the real
//! runtime against a fake model server on 127.0.0.1), told
//! step by step with what is now in the database — or, with `--json`, one
//! JSON event per line.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use retinue_config::DelegationConfig;
use retinue_config::LoadedConfig;
use retinue_core::{
    ChildManifest, Claims, Clock, DeliveryFilter, Lookup, ManualClock, NewSession, OwnerProbe,
    ProcProbe, ProcessState, RegistryRead, RetainedChild, Retention, SessionStore, SystemClock,
    TombstoneReason, Unaddressable, UnitDraft, UnitLifecycle, current_owner, iso8601,
};
use retinue_delegate::{CancelToken, DelegateOutcome, DelegateRequest, Delegator, ParentContext};
use retinue_fake_model::{FakeModel, Reply, Usage};
use retinue_lineage::{check_follow_up_authority, lineage_chain, root};
use retinue_runtime::{ChatRuntime, RuntimeConfig};
use retinue_store::{Store, StoreOptions};
use retinue_usage::{load_child_usage_attributions, load_lineage_usage_totals};
use serde_json::{Value, json};

use crate::commands::{children_table, delegate_human, delegator, denial_kind, usage_human, when};
use crate::env::Env;
use crate::error::{CliError, Result};
use crate::table::{Table, clip, key_values, wrap};
use crate::{Output, print_stdout};

/// How long before now the demo's story starts: its manual clock ends at the
/// wall clock, so a kept database reads right with the other commands.
const STORY_HOURS: f64 = 100.0;
const HOUR: f64 = 3600.0;
const STEPS: usize = 12;

const PARENT: &str = "demo-parent";
const CONTINUATION: &str = "demo-parent-2";
const BRANCH: &str = "demo-branch";
const STRANGER: &str = "demo-stranger";
const INFLIGHT_SUBAGENT: &str = "sa-0-0ff11e00";
const INFLIGHT_SESSION: &str = "demo-inflight-child";
const MODEL: &str = "demo/fake-model";

const TASKS: [(&str, &str, u64, u64, f64); 3] = [
    (
        "Survey the storage layer",
        "The store owns one SQLite file; every write is a single BEGIN IMMEDIATE transaction.",
        1200,
        300,
        0.0125,
    ),
    (
        "Audit the authority rules",
        "Only compression continuations inherit authority; branches and strangers are refused.",
        1800,
        420,
        0.021,
    ),
    (
        "Check the cost ledger",
        "Each child run bills one keyed ledger row to the parent that paid for it.",
        900,
        210,
        0.009,
    ),
];
const FOLLOW_UP: &str = "Follow-up: which index answers a lookup by subagent id?";
const BACKGROUND_GOAL: &str = "Draft the release notes";
const FOLLOW_UP_REPLY: &str =
    "retinue_idx_children_subagent: a lookup by id never scans children_json.";

/// The file the storage survey reads in the demo's workspace.
const NOTES_FILE: &str = "STORAGE.md";
const NOTES: &str = "# Storage\n\nThe store owns one SQLite file; every write is a single \
                     BEGIN IMMEDIATE transaction.\n";

/// The demo's model: testkit's fake OpenAI-compatible server on 127.0.0.1,
/// answering each task (and the follow-up) with its scripted reply and usage.
/// The storage survey first reads `STORAGE.md` in its workspace with a
/// `read_file` tool call. The children reach it through the real runtime,
/// over real HTTP.
fn fake_model() -> FakeModel {
    let model = FakeModel::start();
    model.set_handler(|request| {
        let messages = request.messages();
        let first = messages.iter().find(|m| m["role"] == "user");
        let surveying =
            first.and_then(|m| m["content"].as_str()).is_some_and(|t| t.contains(TASKS[0].0));
        let read_yet = messages.iter().any(|m| m["role"] == "tool");
        if surveying && !read_yet {
            return Some(
                Reply::tool_call("call-read-1", "read_file", json!({ "path": NOTES_FILE }))
                    .with_usage(Usage::new(600, 40).cost(0.0)),
            );
        }
        let last = messages.iter().rev().find(|m| m["role"] == "user")?;
        let text = last["content"].as_str().unwrap_or_default();
        let (reply, input, output, cost) = if text.contains("Follow-up:") {
            (FOLLOW_UP_REPLY, 400, 90, 0.004)
        } else {
            TASKS
                .iter()
                .find(|t| text.contains(t.0))
                .map(|t| (t.1, t.2, t.3, t.4))
                .unwrap_or(("Done.", 100, 20, 0.001))
        };
        Some(Reply::text(reply).with_usage(Usage::new(input, output).cost(cost)))
    });
    model
}

/// The runtime over `model`, and the `delegation:` settings the story pins
/// (whatever a `config.yaml` in the home says).
fn demo_runtime(model: &FakeModel) -> Result<(ChatRuntime, DelegationConfig)> {
    let config = DelegationConfig {
        model: MODEL.to_owned(),
        base_url: model.base_url(),
        api_key: retinue_config::ApiKey::new("demo-key"),
        ..DelegationConfig::default()
    };
    // The children get the default `read` toolset over the demo's workspace.
    let tools = Arc::new(retinue_tools::Toolbox::new(retinue_tools::ToolboxConfig::default()));
    let runtime = RuntimeConfig::from_delegation(&config)
        .and_then(|c| ChatRuntime::new(c, tools))
        .map_err(|e| CliError::Failed(format!("cannot start the demo's runtime: {e}")))?;
    Ok((runtime, config))
}

/// After the "restart", the process that owned the in-flight unit is gone.
struct SimulatedRestart {
    old_pid: i64,
}

impl OwnerProbe for SimulatedRestart {
    fn probe(&self, pid: i64) -> Option<ProcessState> {
        if pid == self.old_pid { Some(ProcessState::Dead) } else { ProcProbe.probe(pid) }
    }
}

/// Prints the steps as they happen.
struct Story {
    json: bool,
    n: usize,
}

impl Story {
    fn step(&mut self, name: &str, title: &str, body: &str, data: Value) -> Result<()> {
        // Test seam (debug builds only): fail the story at this step, to prove
        // a failed demo leaves nothing half-built behind.
        if cfg!(debug_assertions)
            && std::env::var("RETINUE_DEMO_FAIL_AT").is_ok_and(|at| at.trim() == name)
        {
            return Err(CliError::Failed(format!("demo failure injected at step {name}")));
        }
        self.n += 1;
        if self.json {
            // `step`, `n` and `title` first, then the step's data.
            let head = format!(
                "{{\"step\":{},\"n\":{},\"title\":{}",
                Value::from(name),
                self.n,
                Value::from(title)
            );
            let rest = match &data {
                Value::Object(m) if !m.is_empty() => format!(",{}", &data.to_string()[1..]),
                _ => "}".to_owned(),
            };
            print_stdout(&format!("{head}{rest}\n"))?;
        } else {
            let head = format!("[{}/{STEPS}] {title}", self.n);
            let mut text = format!("\n{head}\n{}\n", "─".repeat(head.chars().count()));
            text.push_str(body);
            if !body.ends_with('\n') {
                text.push('\n');
            }
            print_stdout(&text)?;
        }
        Ok(())
    }
}

/// A paragraph of the story, wrapped for an 88-column terminal.
fn para(text: &str) -> String {
    wrap(text, 88)
}

fn failed(what: &str, detail: impl std::fmt::Display) -> CliError {
    CliError::Failed(format!("demo: {what}: {detail}"))
}

/// One `delegate_task` call as a model makes it (`args` is the tool call's
/// JSON), through the typed core: the outcome and the tool's JSON result.
fn call_tool(
    what: &str,
    tool: &Delegator,
    args: &Value,
    parent: &ParentContext,
) -> Result<(DelegateOutcome, Value)> {
    let request = DelegateRequest::from_json(args).map_err(|e| failed(what, e))?;
    let outcome =
        tool.delegate(&request, parent, &CancelToken::new()).map_err(|e| failed(what, e))?;
    let out = outcome.to_json();
    Ok((outcome, out))
}

fn parent_ctx(session: &str) -> ParentContext {
    ParentContext {
        session_id: Some(session.to_owned()),
        model: Some(MODEL.to_owned()),
        ..ParentContext::default()
    }
}

fn session(
    store: &Store,
    id: &str,
    parent: Option<&str>,
    model_config: Option<Value>,
) -> Result<()> {
    store.create_session(&NewSession {
        id: id.to_owned(),
        source: "cli".to_owned(),
        model: Some(MODEL.to_owned()),
        model_config,
        parent_session_id: parent.map(str::to_owned),
        ..NewSession::default()
    })?;
    Ok(())
}

fn entries_json(entries: &[RetainedChild]) -> Value {
    Value::Array(entries.iter().map(RetainedChild::to_json).collect())
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    path.iter().try_fold(v, |v, k| v.get(*k)).and_then(Value::as_str).unwrap_or_default()
}

/// The demo home: `--home DIR` (must not hold a state.db), else a temp dir.
fn demo_home(home: Option<&Path>) -> Result<(Option<tempfile::TempDir>, PathBuf)> {
    match home {
        Some(dir) => {
            if dir.join("state.db").exists() {
                return Err(CliError::Usage(format!(
                    "demo needs a fresh home, and {} already has a state.db",
                    dir.display()
                )));
            }
            std::fs::create_dir_all(dir)?;
            Ok((None, dir.to_path_buf()))
        }
        None => {
            let tmp = tempfile::Builder::new().prefix("retinue-demo-").tempdir()?;
            let path = tmp.path().to_path_buf();
            Ok((Some(tmp), path))
        }
    }
}

/// The demo's store: the limits its story needs are pinned (the default
/// `delegation:` and `database:` settings), whatever a `config.yaml` in the
/// home says.
fn demo_store(db: &Path, profile: &str, clock: Arc<ManualClock>) -> Result<Arc<Store>> {
    let opts = StoreOptions {
        retention: LoadedConfig::default().delegation.retention(),
        clock,
        profile: profile.to_owned(),
        ..StoreOptions::default()
    };
    Ok(Arc::new(Store::open(db, opts)?))
}

/// `retinue demo [--home DIR]`. When the story fails, nothing half-built is
/// left in `--home DIR`: the database (and its companions) is removed, and
/// the directory too if the demo created it.
pub(crate) fn run(env: &Env, home: Option<&Path>) -> Result<Output> {
    let created_dir = home.is_some_and(|d| !d.exists());
    // Only a database this run creates is ever removed.
    let fresh = home.is_some_and(|d| !d.join("state.db").exists());
    let home_had_workspace = home.is_some_and(|d| d.join("demo-workspace").exists());
    let out = run_story(env, home);
    if out.is_err()
        && fresh
        && let Some(dir) = home
    {
        for name in [
            "state.db",
            "state.db-wal",
            "state.db-shm",
            "state.db-journal",
            "state.db-retinue-writers",
        ] {
            let _ = std::fs::remove_file(dir.join(name));
        }
        // The children's workspace, when this run made it.
        if !home_had_workspace {
            let _ = std::fs::remove_file(dir.join("demo-workspace").join(NOTES_FILE));
            let _ = std::fs::remove_dir(dir.join("demo-workspace"));
        }
        if created_dir {
            let _ = std::fs::remove_dir(dir);
        }
    }
    out
}

/// The story's state, carried from step to step.
struct Demo {
    story: Story,
    /// The temporary home, deleted at the end (`None`: `--home DIR`, kept).
    tmp: Option<tempfile::TempDir>,
    home: PathBuf,
    db: PathBuf,
    profile: String,
    /// The story's start (100 h ago).
    t0: f64,
    clock: Arc<ManualClock>,
    /// The open store (`None` while the simulated restart has it closed).
    store: Option<Arc<Store>>,
    /// The fake model the children call (alive as long as the tool).
    model: Option<FakeModel>,
    /// The `delegate_task` tool, once the model is up.
    tool: Option<Delegator>,
    /// The children's workspace.
    workspace: PathBuf,
    /// The unit and children of step 2.
    children: Children,
}

/// Three children of the unit the parent delegates.
#[derive(Debug, Clone, Default)]
struct Children {
    sa0: String,
    sid0: String,
    sa1: String,
    sa2: String,
}

impl Demo {
    fn store(&self) -> Result<Arc<Store>> {
        self.store.clone().ok_or_else(|| failed("store", "closed"))
    }

    fn tool(&self) -> Result<Delegator> {
        self.tool.clone().ok_or_else(|| failed("delegate_task", "no tool yet"))
    }
}

/// One step of the story.
type Step = fn(&mut Demo) -> Result<()>;

/// The story, in order.
const STORY: &[Step] = &[
    setup, delegate, retained, compress, follow_up, refused, tombstone, prune, background, restart,
    usage,
];

fn run_story(env: &Env, home: Option<&Path>) -> Result<Output> {
    let (tmp, home) = demo_home(home)?;
    let db = home.join("state.db");
    let t0 = (SystemClock.now() - STORY_HOURS * HOUR).floor();
    let clock = Arc::new(ManualClock::new(t0));
    let store = demo_store(&db, &env.profile, clock.clone())?;
    let mut d = Demo {
        story: Story { json: env.json, n: 0 },
        tmp,
        workspace: home.join("demo-workspace"),
        home,
        db,
        profile: env.profile.clone(),
        t0,
        clock,
        store: Some(store),
        model: None,
        tool: None,
        children: Children::default(),
    };
    for step in STORY {
        step(&mut d)?;
    }
    done(&mut d)?;
    Ok(Output { json: None, human: String::new(), code: 0, stderr: None })
}

/// 1. A fresh home.
fn setup(d: &mut Demo) -> Result<()> {
    let (home, db, t0, store) = (d.home.clone(), d.db.clone(), d.t0, d.store()?);
    session(&store, PARENT, None, None)?;
    let story = &mut d.story;
    story.step(
        "setup",
        "A fresh hermes home",
        &(key_values(&[
            ("home", home.display().to_string()),
            ("database", format!("{} (hermes tables + retinue_* tables)", db.display())),
            ("clock", format!("{} (manual: moves only when the demo says so)", iso8601(t0))),
            ("runtime", "real HTTP to a fake OpenAI-compatible model on 127.0.0.1".to_owned()),
            ("parent", format!("{PARENT} (cli session, live)")),
        ])),
        json!({ "home": home.display().to_string(), "parent_session_id": PARENT }),
    )?;
    Ok(())
}

/// 2. The parent delegates a batch of three tasks.
fn delegate(d: &mut Demo) -> Result<()> {
    let (store, profile) = (d.store()?, d.profile.clone());
    let model = fake_model();
    let (runtime, config) = demo_runtime(&model)?;
    let backend = crate::backend::Backend::from_sqlite(store.clone(), LoadedConfig::default());
    let tool = delegator(&backend, Arc::new(runtime), config, &profile);
    d.model = Some(model);
    let tasks: Vec<Value> = TASKS.iter().map(|t| json!({ "goal": t.0 })).collect();
    let workspace = d.workspace.clone();
    std::fs::create_dir_all(&workspace)
        .and_then(|()| std::fs::write(workspace.join(NOTES_FILE), NOTES))
        .map_err(|e| failed("cannot write the demo's workspace", e))?;
    let parent = ParentContext { workspace: Some(workspace.clone()), ..parent_ctx(PARENT) };
    let (outcome, out) = call_tool("delegate_task", &tool, &json!({ "tasks": tasks }), &parent)?;
    let delegation_id = str_at(&out, &["delegation_id"]).to_owned();
    let results = out.get("results").and_then(Value::as_array).cloned().unwrap_or_default();
    let ids: Vec<(String, String)> = results
        .iter()
        .map(|r| {
            (str_at(r, &["subagent_id"]).to_owned(), str_at(r, &["child_session_id"]).to_owned())
        })
        .collect();
    let [(sa0, sid0), (sa1, _), (sa2, _)] = <[(String, String); 3]>::try_from(ids)
        .map_err(|ids| failed("expected three children", ids.len()))?;
    d.story.step(
        "delegate",
        "The parent delegates a batch of three tasks",
        &format!(
            "{}\n{}",
            para(&format!(
                "{PARENT} calls delegate_task with tasks=[…3 goals…]. One durable unit \
                 ({delegation_id}) and three child sessions were written before any child \
                 started. Each child has the `read` toolset over the workspace {}: the \
                 storage survey called read_file on {NOTES_FILE} before answering (its \
                 transcript keeps the tool call and its result). The results:",
                workspace.display()
            )),
            delegate_human(Some(&outcome))
        ),
        json!({ "delegation_id": delegation_id, "result": out }),
    )?;
    d.children = Children { sa0, sid0, sa1, sa2 };
    d.tool = Some(tool);
    Ok(())
}

/// 3. The children are retained.
fn retained(d: &mut Demo) -> Result<()> {
    let store = d.store()?;
    let story = &mut d.story;
    let listed = store.list_retained_children()?;
    story.step(
        "retained",
        "The three children are retained",
        &format!(
            "{}\n{}",
            para(&format!(
                "The unit completed, so its children stay addressable for a follow-up \
                 (TTL {} h, at most {} retained units). `retinue children list`:",
                store.retention().ttl_hours,
                store.retention().max_retained,
            )),
            children_table(&listed)
        ),
        json!({ "children": entries_json(&listed) }),
    )?;
    Ok(())
}

/// 4. The parent is compressed into a continuation.
fn compress(d: &mut Demo) -> Result<()> {
    let store = d.store()?;
    let story = &mut d.story;
    store.end_session(PARENT, &retinue_core::EndReason::Compression)?;
    session(&store, CONTINUATION, Some(PARENT), None)?;
    let chain = lineage_chain(&*store, CONTINUATION).map_err(|e| failed("lineage", e))?;
    let lineage_root = chain.last().cloned().unwrap_or_default();
    story.step(
        "compress",
        "The parent's context is compressed into a continuation",
        &key_values(&[
            ("ended", format!("{PARENT} (end_reason = compression)")),
            ("continuation", format!("{CONTINUATION} (parent_session_id = {PARENT})")),
            ("lineage", chain.join(" → ")),
            ("root", format!("{lineage_root}: the continuation inherits the parent's children")),
        ]),
        json!({
            "parent_session_id": PARENT,
            "continuation_session_id": CONTINUATION,
            "root": lineage_root,
            "chain": chain,
        }),
    )?;
    Ok(())
}

/// 5. Two days later, the continuation follows up one child.
fn follow_up(d: &mut Demo) -> Result<()> {
    let (store, clock, tool, workspace) =
        (d.store()?, d.clock.clone(), d.tool()?, d.workspace.clone());
    let Children { sa0, sid0, .. } = d.children.clone();
    let story = &mut d.story;
    clock.advance(48.0 * HOUR);
    let (outcome, out) = call_tool(
        "follow-up",
        &tool,
        &json!({ "follow_up": sa0, "goal": FOLLOW_UP }),
        &ParentContext { workspace: Some(workspace.clone()), ..parent_ctx(CONTINUATION) },
    )?;
    let transcript = store.conversation(&sid0)?;
    let mut t = Table::new(&["#", "ROLE", "CONTENT"]);
    for (i, m) in transcript.iter().enumerate() {
        // An assistant turn that called tools shows the calls.
        let calls: Vec<String> = m
            .tool_calls
            .as_deref()
            .and_then(|t| serde_json::from_str::<Value>(t).ok())
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .map(|c| {
                format!(
                    "→ {}({})",
                    c["function"]["name"].as_str().unwrap_or("?"),
                    c["function"]["arguments"].as_str().unwrap_or("")
                )
            })
            .collect();
        let content = match m.content.as_deref().filter(|c| !c.is_empty()) {
            Some(c) => c.to_owned(),
            None => calls.join(" "),
        };
        t.row(vec![(i + 1).to_string(), m.role.clone(), clip(&content, 70)]);
    }
    let refreshed = match store.lookup(&sa0)? {
        Lookup::Addressable(e) => when(e.retained_at),
        _ => "-".to_owned(),
    };
    story.step(
        "follow_up",
        "48 h later, the continuation follows up one child",
        &format!(
            "{}\n{}\n{}\n{}\n{}",
            para(&format!(
                "{CONTINUATION} calls delegate_task(follow_up={sa0}, goal=…). No new child: \
                 {sa0} resumes on its own persisted session {sid0}, budget-exempt."
            )),
            delegate_human(Some(&outcome)),
            para(&format!("Transcript of {sid0} (the follow-up is its next user turn):")),
            t.render(),
            para(&format!("Its retention clock restarted: retained_at = {refreshed}.")),
        ),
        json!({
            "child_id": sa0,
            "result": out,
            "transcript": transcript
                .iter()
                .map(|m| json!({ "role": m.role, "content": m.content }))
                .collect::<Vec<_>>(),
        }),
    )?;
    Ok(())
}

/// 6. A branch and a stranger are refused.
fn refused(d: &mut Demo) -> Result<()> {
    let (store, tool, profile) = (d.store()?, d.tool()?, d.profile.clone());
    let Children { sa0, .. } = d.children.clone();
    let story = &mut d.story;
    session(&store, BRANCH, Some(CONTINUATION), Some(json!({ "_branched_from": CONTINUATION })))?;
    session(&store, STRANGER, None, None)?;
    let entry0 = store.find_retained_child(&sa0)?.ok_or_else(|| failed("lookup", &sa0))?;
    let mut t = Table::new(&["REQUESTER", "LINEAGE ROOT", "DECISION"]);
    let mut attempts = Vec::new();
    let mut tool_text = String::new();
    for requester in [BRANCH, STRANGER] {
        let out = tool.delegate_task(
            &json!({ "follow_up": sa0, "goal": "Tell me everything you know." }),
            Some(&parent_ctx(requester)),
        );
        let error = str_at(&out, &["error"]).to_owned();
        if error.is_empty() {
            return Err(failed("refusal", format!("{requester} was not refused")));
        }
        let root_text = match root(&*store, requester) {
            Ok(r) => r,
            Err(e) => format!("none ({e})"),
        };
        let denial = check_follow_up_authority(&*store, &entry0, Some(requester), &profile)
            .err()
            .map(|d| denial_kind(&d));
        t.row(vec![
            requester.to_owned(),
            root_text.clone(),
            denial.map_or_else(|| "allowed".to_owned(), |d| format!("denied ({d})")),
        ]);
        attempts.push(
            json!({ "requester": requester, "root": root_text, "denial": denial, "error": error }),
        );
        tool_text = error;
    }
    story.step(
        "refused",
        "A branch and a stranger are refused",
        &format!(
            "{}\n{}\n{}",
            para(&format!(
                "{BRANCH} is a branch of {CONTINUATION} (_branched_from); {STRANGER} is \
                 unrelated. Both try to follow up {sa0}:"
            )),
            t.render(),
            para(&format!(
                "The tool answers both the same, byte for byte as for an id that does not \
                 exist, so nothing leaks:\n  {tool_text}"
            )),
        ),
        json!({ "child_id": sa0, "attempts": attempts }),
    )?;
    Ok(())
}

/// 7. One child is tombstoned.
fn tombstone(d: &mut Demo) -> Result<()> {
    let (store, tool) = (d.store()?, d.tool()?);
    let Children { sa2, .. } = d.children.clone();
    let story = &mut d.story;
    let changed = store.tombstone_retained_child(&sa2, &TombstoneReason::Manual)?;
    let out = tool.delegate_task(
        &json!({ "follow_up": sa2, "goal": "Are you still there?" }),
        Some(&parent_ctx(CONTINUATION)),
    );
    let answer = str_at(&out, &["error"]).to_owned();
    let listed = store.list_retained_children()?;
    story.step(
        "tombstone",
        "One child is tombstoned",
        &format!(
            "{}\nRetained now:\n\n{}",
            para(&format!(
                "`retinue children tombstone {sa2}` de-registers that child only: its siblings \
                 stay addressable, its row and transcript are kept. The continuation, which may \
                 address it, is told when and why:\n  {answer}"
            )),
            children_table(&listed)
        ),
        json!({
            "child_id": sa2,
            "tombstoned": changed,
            "reason": TombstoneReason::Manual.as_str(),
            "follow_up_error": answer,
            "children": entries_json(&listed),
        }),
    )?;
    Ok(())
}

/// 8. A TTL prune.
fn prune(d: &mut Demo) -> Result<()> {
    let (store, clock, t0) = (d.store()?, d.clock.clone(), d.t0);
    let Children { sa0, sa1, .. } = d.children.clone();
    let story = &mut d.story;
    clock.advance((STORY_HOURS - 48.0) * HOUR);
    let count = store.prune_retained_children(None, None)?;
    let listed = store.list_retained_children()?;
    let expired = match store.lookup(&sa1)? {
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { at, reason, .. }) => {
            format!("tombstoned at {} (reason: {})", iso8601(at), reason.as_str())
        }
        other => format!("{other:?}"),
    };
    story.step(
        "prune",
        "100 h after the delegation, a TTL prune runs",
        &format!(
            "{}\n{}\n{}",
            key_values(&[
                ("clock", iso8601(clock.now())),
                (
                    "prune",
                    format!(
                        "tombstoned {} unit(s), {} child(ren) (nothing is deleted)",
                        count.units, count.children
                    ),
                ),
            ]),
            para(&format!(
                "{sa1} was retained at {} and never followed up: {expired}. {sa0} was \
                 followed up 48 h in, so its TTL restarted and it stays:",
                iso8601(t0)
            )),
            children_table(&listed)
        ),
        json!({
            "now": iso8601(clock.now()),
            "pruned": { "tombstoned": count.units, "children": count.children },
            "children": entries_json(&listed),
        }),
    )?;
    Ok(())
}

/// 9. A background child, delivered exactly once.
fn background(d: &mut Demo) -> Result<()> {
    let tool = d.tool()?;
    let parent = ParentContext {
        can_receive_detached: true,
        workspace: Some(d.workspace.clone()),
        ..parent_ctx(CONTINUATION)
    };
    let dispatched =
        tool.delegate_task(&json!({ "goal": BACKGROUND_GOAL, "background": true }), Some(&parent));
    if dispatched["status"] != "dispatched" {
        return Err(failed("background dispatch", dispatched));
    }
    let id = str_at(&dispatched, &["delegation_id"]).to_owned();
    let collector = tool.collector();
    let ids = [id.clone()];
    let first = collector
        .wait(&ids, &parent, std::time::Duration::from_secs(60), false, &CancelToken::new())
        .map_err(|e| failed("wait", e))?;
    let again = collector
        .wait(&ids, &parent, std::time::Duration::ZERO, false, &CancelToken::new())
        .map_err(|e| failed("wait", e))?;
    let (first, again) = (first.to_json(), again.to_json());
    let status = |v: &Value| str_at(&v["results"][0], &["status"]).to_owned();
    if status(&first) != "delivered" || status(&again) != "already_delivered" {
        return Err(failed("background delivery", json!([first, again])));
    }
    let summary = str_at(&first["results"][0]["result"]["results"][0], &["summary"]).to_owned();
    d.story.step(
        "background",
        "A background child, delivered exactly once",
        &format!(
            "{}
{}
{}",
            para(&format!(
                "{CONTINUATION} delegates \"{BACKGROUND_GOAL}\" with background=true: the call \
                 returns at once with {id}, and the child works on."
            )),
            key_values(&[
                ("first wait", format!("{} — \"{summary}\"", status(&first))),
                ("second wait", status(&again)),
            ]),
            para(
                "The registry's delivery claim hands each result to exactly one waiter \
                 (`retinue wait`, wait_subagents, or the next tool result), never twice, \
                 across processes and restarts."
            ),
        ),
        json!({ "dispatched": dispatched, "first": first, "again": again }),
    )?;
    Ok(())
}

/// 10. A simulated restart recovers.
fn restart(d: &mut Demo) -> Result<()> {
    let (store, clock, profile) = (d.store()?, d.clock.clone(), d.profile.clone());
    let (pid, fingerprint) = current_owner();
    let inflight = store.insert_unit(&UnitDraft {
        origin_session: CONTINUATION.to_owned(),
        origin_session_id: CONTINUATION.to_owned(),
        parent_session_id: Some(CONTINUATION.to_owned()),
        owner_pid: Some(pid),
        owner_started_at: fingerprint,
        task: json!({ "goal": "Benchmark the registry", "is_batch": false, "mode": "background" }),
        owner_profile: profile.clone(),
        children: vec![ChildManifest {
            subagent_id: INFLIGHT_SUBAGENT.to_owned(),
            session_id: INFLIGHT_SESSION.to_owned(),
            model: Some(MODEL.to_owned()),
            goal: Some("Benchmark the registry".to_owned()),
            ..ChildManifest::default()
        }],
        child_sessions: vec![NewSession {
            id: INFLIGHT_SESSION.to_owned(),
            source: "delegate".to_owned(),
            model: Some(MODEL.to_owned()),
            model_config: Some(json!({ "_delegate_from": CONTINUATION })),
            parent_session_id: Some(CONTINUATION.to_owned()),
            ..NewSession::default()
        }],
        ..UnitDraft::default()
    })?;
    // The process dies: its tool and store close before the store reopens.
    d.tool = None;
    d.model = None;
    d.store = None;
    drop(store);
    let store = demo_store(&d.db, &profile, clock.clone())?;
    d.store = Some(store.clone());
    let story = &mut d.story;
    let report = store.recover_abandoned_delegations(&SimulatedRestart { old_pid: pid });
    if let Some(e) = &report.error {
        return Err(failed("recovery", e));
    }
    let state = match store.lookup(INFLIGHT_SUBAGENT)? {
        Lookup::Addressable(e) | Lookup::NotAddressable(e, _) => e.state.to_string(),
        Lookup::Unknown => "-".to_owned(),
    };
    let filter = DeliveryFilter {
        parent_session_id: Some(CONTINUATION.to_owned()),
        ..DeliveryFilter::default()
    };
    let event = match store.claim_delivery(&filter)? {
        Some(claim) => {
            store.ack_delivery(&claim.delegation_id, &claim.token)?;
            claim.event.raw
        }
        None => Value::Null,
    };
    let listed = store.list_retained_children()?;
    story.step(
        "restart",
        "The process restarts and recovers",
        &format!(
            "{}\n{}\n{}\n{}",
            para(&format!(
                "A background delegation ({inflight}, child {INFLIGHT_SUBAGENT}) was still \
                 running when the process died. The store is reopened and `retinue recover` runs:"
            )),
            key_values(&[
                ("abandoned", format!("{} (now state = {state})", report.abandoned)),
                ("retained", format!("{} addressable child(ren) rehydrated", report.addressable)),
            ]),
            para(&format!(
                "The parent is told once, through the delivery queue: status {}, \"{}\"\n\n\
                 Retained children survive the restart:",
                str_at(&event, &["status"]),
                str_at(&event, &["error"]),
            )),
            children_table(&listed)
        ),
        json!({
            "abandoned": report.abandoned,
            "retained": report.addressable,
            "recovered_delegation_id": inflight,
            "recovered_state": state,
            "event": event,
        }),
    )?;
    Ok(())
}

/// 11. Usage totals for the lineage.
fn usage(d: &mut Demo) -> Result<()> {
    let store = d.store()?;
    let story = &mut d.story;
    let walk = retinue_lineage::CompressionWalk::new(&*store);
    let totals = load_lineage_usage_totals(&*store, &walk, CONTINUATION)?;
    let mut records = Vec::new();
    for s in &totals.sessions {
        records.extend(load_child_usage_attributions(&*store, s)?);
    }
    story.step(
        "usage",
        "Usage totals for the whole lineage",
        &format!(
            "{}\n{}",
            para(&format!(
                "Every child run billed one keyed ledger row to the session that paid for it; \
                 `retinue usage {CONTINUATION} --lineage` sums the compression lineage:"
            )),
            usage_human(&totals.totals, &totals.sessions, &records)
        ),
        json!({
            "session_id": CONTINUATION,
            "sessions": totals.sessions,
            "lineage_resolved": totals.lineage_resolved,
            "totals": {
                "cost_usd": totals.totals.cost_usd,
                "input_tokens": totals.totals.input_tokens,
                "output_tokens": totals.totals.output_tokens,
            },
            "records": records.len(),
        }),
    )?;
    Ok(())
}

/// 11. Done: the home is kept or deleted.
fn done(d: &mut Demo) -> Result<()> {
    d.store = None;
    let kept = d.tmp.is_none();
    let home_text = d.home.display().to_string();
    let body = if kept {
        format!(
            "The database is kept. Try:\n  retinue --home {home_text} children list\n  \
             retinue --home {home_text} lineage {CONTINUATION}\n  \
             retinue --home {home_text} usage {CONTINUATION} --lineage\n"
        )
    } else {
        "The temporary home is deleted; run `retinue demo --home DIR` to keep the database.\n"
            .to_owned()
    };
    d.story.step("done", "Done", &body, json!({ "home": home_text, "kept": kept }))?;
    if let Some(tmp) = d.tmp.take() {
        tmp.close()?;
    }
    Ok(())
}
