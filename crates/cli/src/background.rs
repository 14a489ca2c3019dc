//! Background delegation on the command line (issue #26):
//! `retinue delegate --background` starts a detached worker process and
//! exits with the ids at once; `retinue wait`, `retinue steer` and
//! `retinue cancel` reach the unit through the registry (the worker may
//! be any process; a dead one is found by its pid and start time, its units
//! marked `unknown` and its reservation released).

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use retinue_core::{ControlOutcome, SystemClock};
use retinue_delegate::{
    CancelToken, Collector, DelegateError, DelegateRequest, Delegator, ParentContext, WaitReport,
    WaitState,
};
use retinue_lineage::Authority;
use serde_json::{Value, json};

use crate::Output;
use crate::backend::Backend;
use crate::env::{Access, Env};
use crate::error::{CliError, EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_TIMEOUT, Result};
use crate::table::{Table, clip};

/// How long the launcher waits for the worker to report its dispatch.
const DISPATCH_WAIT: Duration = Duration::from_secs(120);

/// The worker's first act: its own session and process group (`setsid`),
/// so the terminal's signals and hang-up never reach it.
pub(crate) fn become_detached() {
    if let Err(e) = rustix::process::setsid() {
        // Only a process-group leader is refused, and the launcher never
        // makes it one.
        log::warn!("the worker could not start its own session: {e}");
    }
}

/// Where the worker logs: `HOME/retinue/workers/worker-<time>-<rand>.log`.
fn log_path(env: &Env) -> Result<PathBuf> {
    let dir = env.home.join("retinue").join("workers");
    std::fs::create_dir_all(&dir).map_err(|e| {
        CliError::Failed(format!("cannot create the worker log directory {}: {e}", dir.display()))
    })?;
    let rand = crate::error::random_hex(4)?;
    // Whole seconds of the wall clock name the log (truncation intended).
    let secs = retinue_core::Clock::now(&SystemClock).max(0.0) as u64;
    Ok(dir.join(format!("worker-{secs}-{rand}.log")))
}

/// `args` without `--db VALUE` / `--db=VALUE`.
fn without_db_flag(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        if a == "--db" {
            it.next();
            continue;
        }
        if a.as_encoded_bytes().starts_with(b"--db=") {
            continue;
        }
        out.push(a);
    }
    out
}

/// `retinue delegate --background`: starts this same command as a detached
/// worker (its own session and process group via `setsid`, stdin closed, stderr to a
/// log under the home), reads the one line it reports once the unit is
/// dispatched, prints the ids and returns at once.
pub(crate) fn launch(env: &Env, parent_id: &str, created: bool) -> Result<Output> {
    let program = std::env::current_exe().map_err(|e| {
        CliError::Failed(format!("cannot find this program to start a worker: {e}"))
    })?;
    let log = log_path(env)?;
    let log_file = std::fs::File::create(&log)
        .map_err(|e| CliError::Failed(format!("cannot create {}: {e}", log.display())))?;
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    // A PostgreSQL URL (its password) never sits in the worker's argv, which
    // every local user can read in /proc: it goes by the environment.
    let db_url = if env.db_is_url { env.pg_url.clone() } else { None };
    if db_url.is_some() {
        args = without_db_flag(args);
    }
    args.push("--detached-worker".into());
    if created {
        args.push("--parent".into());
        args.push(parent_id.into());
    }
    let mut command = Command::new(program);
    command.args(&args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(log_file));
    if std::env::var_os("RETINUE_LOG").is_none() {
        command.env("RETINUE_LOG", "info");
    }
    if let Some(url) = &db_url {
        command.env(crate::env::DB_URL_VAR, url);
    }
    let mut child = command
        .spawn()
        .map_err(|e| CliError::Failed(format!("cannot start the background worker: {e}")))?;
    let pid = child.id();
    let stdout = child.stdout.take();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        if let Some(out) = stdout {
            let _ = std::io::BufReader::new(out).read_line(&mut line);
        }
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(DISPATCH_WAIT).unwrap_or_default();
    let report: Option<Value> = serde_json::from_str(line.trim()).ok();
    let Some(report) = report else {
        // The worker died (or hung) before dispatching: nothing runs.
        let _ = child.kill();
        let _ = child.wait();
        return Err(CliError::Failed(format!(
            "the background worker (pid {pid}) stopped before it dispatched the delegation; \
             see {}",
            log.display()
        )));
    };
    // The worker outlives this process; it is reaped by init.
    drop(child);
    let code = report["exit"].as_u64().and_then(|c| u8::try_from(c).ok()).unwrap_or(EXIT_FAILED);
    let mut out = report["output"].clone();
    if code != EXIT_OK {
        let message = out["error"].as_str().unwrap_or("the worker failed").to_owned();
        return Ok(Output { json: Some(out), human: String::new(), code, stderr: Some(message) });
    }
    out["worker"] = json!({ "pid": pid, "log": log.display().to_string() });
    out["parent_session_id"] = json!(parent_id);
    let id = out["delegation_id"].as_str().unwrap_or("-").to_owned();
    let mut human = String::new();
    if created {
        human.push_str(&format!(
            "parent session {parent_id} (new; follow up later with --parent {parent_id})\n"
        ));
    }
    human.push_str(&format!(
        "delegation {id} dispatched to a background worker (pid {pid}, log {})\n",
        log.display()
    ));
    if out["queued"] == json!(true) {
        human.push_str("queued: background capacity is full; it starts when a slot frees\n");
    }
    let mut t = Table::new(&["SUBAGENT", "CHILD SESSION", "GOAL"]);
    for c in out["children"].as_array().into_iter().flatten() {
        t.row(vec![
            c["subagent_id"].as_str().unwrap_or("-").to_owned(),
            c["session_id"].as_str().unwrap_or("-").to_owned(),
            clip(c["goal"].as_str().unwrap_or("-"), 60),
        ]);
    }
    if !t.is_empty() {
        human.push_str(&t.render());
    }
    human.push_str(&format!("collect the results with: retinue wait {id} --parent {parent_id}\n"));
    Ok(Output::ok(out, human))
}

/// The worker: dispatches the unit, reports one line (`{"exit", "output"}`)
/// on stdout, closes it (the launcher returns), and runs the children to the
/// end. SIGINT/SIGTERM stop the children, which bill what they spent.
pub(crate) fn work(tool: &Delegator, request: &DelegateRequest, parent: &ParentContext) -> Output {
    let cancel = CancelToken::new();
    let interrupts = crate::interrupt::Interrupts::watch(&cancel);
    let outcome = tool.delegate(request, parent, &cancel);
    let (output, code) = match &outcome {
        Ok(o) => (o.to_json(), EXIT_OK),
        Err(e) => (
            json!({ "error": e.to_string(), "code": e.kind().as_str() }),
            crate::error::delegate_error_code(e),
        ),
    };
    let line = json!({ "exit": code, "output": output }).to_string() + "\n";
    if let Err(e) = crate::print_stdout(&line) {
        log::warn!("could not report the dispatch: {e}");
    }
    close_stdout();
    if let Ok(o) = &outcome {
        log::info!("worker {}: {}", std::process::id(), o.to_json());
    }
    tool.wait_background();
    log::info!("worker {}: every unit finished", std::process::id());
    let code = interrupts.exit_code().unwrap_or(code);
    Output { json: None, human: String::new(), code, stderr: None }
}

/// Points stdout at `/dev/null`, so the launcher's read ends.
fn close_stdout() {
    match std::fs::OpenOptions::new().write(true).open("/dev/null") {
        Ok(null) => {
            if let Err(e) = rustix::stdio::dup2_stdout(&null) {
                log::warn!("could not close stdout: {e}");
            }
        }
        Err(e) => log::warn!("could not open /dev/null: {e}"),
    }
}

/// The session `wait`, `steer` and `cancel` act as: `--parent`, else — for
/// the home's operator on a `state.db` only — the units' recorded parent
/// (they must agree). In team mode, or for a profile, `--parent` is
/// required (exit 2).
fn caller(store: &Backend, env: &Env, ids: &[String], parent: Option<&str>) -> Result<String> {
    if let Some(p) = parent {
        return Ok(p.to_owned());
    }
    if env.pg_url.is_some() || !store.scope.is_operator() {
        return Err(CliError::Usage(
            "--parent SESSION is required in team mode and for a profile: name the session the \
             units belong to"
                .to_owned(),
        ));
    }
    let mut found: Option<String> = None;
    for id in ids {
        let Some(p) = store.scoped().unit_view(id)?.and_then(|u| u.parent_session_id) else {
            continue;
        };
        match &found {
            Some(f) if *f != p => {
                return Err(CliError::Usage(
                    "these units have different parent sessions: pass --parent SESSION".to_owned(),
                ));
            }
            _ => found = Some(p),
        }
    }
    // No unit found: answered as missing by the collector.
    Ok(found.unwrap_or_default())
}

/// The collector of this command's backend, acting for its profile.
pub(crate) fn collector(store: &Backend, env: &Env) -> Collector {
    let authority =
        Arc::new(Authority::new(store.registry.clone(), store.graph.clone(), &env.profile));
    Collector::new(store.seams.clone(), authority, &env.profile).with_isolation(env.worktrees())
}

fn parent_of(session: &str) -> ParentContext {
    ParentContext {
        session_id: Some(session.trim().to_owned()),
        can_receive_detached: true,
        ..ParentContext::default()
    }
}

pub(crate) fn error_output(e: &DelegateError) -> Output {
    Output {
        json: Some(json!({ "error": e.to_string(), "code": e.kind().as_str() })),
        human: String::new(),
        code: crate::error::delegate_error_code(e),
        stderr: Some(e.to_string()),
    }
}

fn wait_human(report: &WaitReport, json: &Value) -> String {
    let mut t = Table::new(&["ID", "STATUS", "STATE", "ELAPSED", "SUMMARY"]);
    for (e, j) in report.entries.iter().zip(json["results"].as_array().into_iter().flatten()) {
        let summary = j["result"]["results"]
            .as_array()
            .map(|rs| {
                rs.iter()
                    .map(|r| {
                        r["summary"].as_str().or(r["error"].as_str()).unwrap_or("-").to_owned()
                    })
                    .collect::<Vec<_>>()
                    .join(" | ")
            })
            .unwrap_or_else(|| "-".to_owned());
        t.row(vec![
            e.id.clone(),
            e.state.as_str().to_owned(),
            j["state"].as_str().unwrap_or("-").to_owned(),
            j["elapsed_seconds"].as_f64().map_or_else(|| "-".to_owned(), |s| format!("{s:.1}s")),
            clip(&summary, 60),
        ]);
    }
    t.render()
}

/// `retinue wait ID… --parent SESSION [--timeout S] [--peek]`: exit 0 when
/// every result was delivered (or peeked), 5 when the timeout passed with a
/// unit still running, 4 when an id is unknown, foreign or already
/// delivered.
pub(crate) fn wait(
    env: &Env,
    ids: &[String],
    parent: Option<&str>,
    timeout: f64,
    peek: bool,
) -> Result<Output> {
    let store = Backend::open(env, Arc::new(SystemClock), Access::WriteExisting)?;
    let parent = &caller(&store, env, ids, parent)?;
    let c = collector(&store, env);
    let cancel = CancelToken::new();
    let _interrupts = crate::interrupt::Interrupts::watch(&cancel);
    let timeout = Duration::try_from_secs_f64(timeout).unwrap_or(Duration::ZERO);
    let report = match c.wait(ids, &parent_of(parent), timeout, peek, &cancel) {
        Ok(r) => r,
        Err(e) => return Ok(error_output(&e)),
    };
    let json = report.to_json();
    let human = wait_human(&report, &json);
    let missing: Vec<&str> = report
        .entries
        .iter()
        .filter(|e| matches!(e.state, WaitState::NotFound | WaitState::AlreadyDelivered))
        .map(|e| e.id.as_str())
        .collect();
    let (code, stderr) = if report.timed_out {
        let running: Vec<&str> = report
            .entries
            .iter()
            .filter(|e| e.state == WaitState::Running)
            .map(|e| e.id.as_str())
            .collect();
        (EXIT_TIMEOUT, Some(format!("timed out; still running: {}", running.join(", "))))
    } else if !missing.is_empty() {
        (
            EXIT_NOT_FOUND,
            Some(format!(
                "nothing to deliver for: {} (unknown, not this parent's, or delivered before)",
                missing.join(", ")
            )),
        )
    } else {
        (EXIT_OK, None)
    };
    Ok(Output { json: Some(json), human, code, stderr })
}

/// `retinue steer ID --message TEXT --parent SESSION`: exit 0 when the
/// running child took the message (or it is queued for it), 1 with
/// `missed_steer` when the child had finished.
pub(crate) fn steer(env: &Env, id: &str, message: &str, parent: Option<&str>) -> Result<Output> {
    let store = Backend::open(env, Arc::new(SystemClock), Access::WriteExisting)?;
    let parent = &caller(&store, env, std::slice::from_ref(&id.to_owned()), parent)?;
    let c = collector(&store, env);
    let report = match c.steer(id, message, &parent_of(parent)) {
        Ok(r) => r,
        Err(e) => return Ok(error_output(&e)),
    };
    let json = report.to_json();
    let human = format!(
        "{} {} (delegation {})\n",
        json["status"].as_str().unwrap_or("-"),
        report.subagent_id,
        report.delegation_id
    );
    Ok(match report.outcome {
        ControlOutcome::Missed => Output {
            json: Some(json),
            human,
            code: EXIT_FAILED,
            stderr: Some(format!(
                "missed_steer: {} had finished; the message was not delivered",
                report.subagent_id
            )),
        },
        _ => Output::ok(json, human),
    })
}

/// `retinue cancel ID --parent SESSION`: the unit's children stop (exit
/// reason `cancelled`); a finished unit exits 1.
pub(crate) fn cancel(env: &Env, id: &str, parent: Option<&str>) -> Result<Output> {
    let store = Backend::open(env, Arc::new(SystemClock), Access::WriteExisting)?;
    let parent = &caller(&store, env, std::slice::from_ref(&id.to_owned()), parent)?;
    let c = collector(&store, env);
    let report = match c.cancel_unit(id, &parent_of(parent)) {
        Ok(r) => r,
        Err(e) => return Ok(error_output(&e)),
    };
    let json = report.to_json();
    let human = format!(
        "{} {} (state {})\n",
        json["status"].as_str().unwrap_or("-"),
        report.delegation_id,
        report.state.as_str()
    );
    Ok(match report.outcome {
        ControlOutcome::Delivered => Output::ok(json, human),
        _ => Output {
            json: Some(json),
            human,
            code: EXIT_FAILED,
            stderr: Some(format!(
                "no worker took the cancel of {} within 10 s (is its worker alive? \
                 `retinue recover` marks a dead one's units unknown)",
                report.delegation_id
            )),
        },
    })
}

/// A running unit as `children list`/`show` print it: elapsed time, and per
/// child the usage so far read from its transcript (model calls, completion
/// tokens, tool calls).
pub(crate) fn running_json(store: &Backend, unit: &retinue_core::UnitView, now: f64) -> Value {
    let children: Vec<Value> = unit
        .children
        .iter()
        .map(|c| {
            let turns = store.sessions.conversation(&c.child_session_id).unwrap_or_default();
            let so_far = retinue_core::UsageSoFar::of(&turns);
            json!({
                "subagent_id": c.subagent_id,
                "child_session_id": c.child_session_id,
                "goal": c.goal,
                "model": c.model,
                "usage_so_far": {
                    "api_calls": so_far.api_calls,
                    "output_tokens": so_far.output_tokens,
                    "tool_calls": so_far.tool_calls,
                },
                "last_tool": so_far.last_tool,
            })
        })
        .collect();
    json!({
        "delegation_id": unit.delegation_id,
        "state": unit.state.as_str(),
        "mode": unit.mode,
        "parent_session_id": unit.parent_session_id,
        "owner_pid": unit.owner_pid,
        "dispatched_at": unit.dispatched_at,
        "elapsed_seconds": ((now - unit.dispatched_at).max(0.0) * 10.0).round() / 10.0,
        "children": children,
    })
}

/// The running units `owner` may address (every one of this profile's
/// without an owner, or all tenants' with `--all-profiles`).
pub(crate) fn running_units(
    store: &Backend,
    env: &Env,
    owner: Option<&str>,
) -> Result<Vec<retinue_core::UnitView>> {
    let profile = if env.all_profiles { None } else { store.scope.filter() };
    let units = store.controls.running_units(profile)?;
    Ok(match owner {
        None => units,
        Some(owner) => {
            let c = collector(store, env);
            let parent = parent_of(owner);
            units.into_iter().filter(|u| c.unit(&u.delegation_id, &parent).is_ok()).collect()
        }
    })
}

/// The running section of `children list`.
pub(crate) fn running_table(rows: &[Value]) -> String {
    let mut t = Table::new(&[
        "DELEGATION",
        "STATE",
        "ELAPSED",
        "SUBAGENT",
        "MODEL",
        "CALLS",
        "OUT TOKENS",
        "TOOLS",
    ]);
    for u in rows {
        for c in u["children"].as_array().into_iter().flatten() {
            t.row(vec![
                u["delegation_id"].as_str().unwrap_or("-").to_owned(),
                u["state"].as_str().unwrap_or("-").to_owned(),
                format!("{:.1}s", u["elapsed_seconds"].as_f64().unwrap_or(0.0)),
                c["subagent_id"].as_str().unwrap_or("-").to_owned(),
                c["model"].as_str().unwrap_or("-").to_owned(),
                c["usage_so_far"]["api_calls"].to_string(),
                c["usage_so_far"]["output_tokens"].to_string(),
                c["usage_so_far"]["tool_calls"].to_string(),
            ]);
        }
    }
    format!("running\n{}", t.render())
}

#[cfg(test)]
mod argv_tests {
    use super::without_db_flag;

    #[test]
    fn the_database_url_leaves_the_workers_argv() {
        let args: Vec<std::ffi::OsString> = [
            "--db",
            "postgres://u:PASSWORD@h/db",
            "--profile",
            "a",
            "delegate",
            "--db=postgres://u:PASSWORD@h/db",
            "--goal",
            "g",
        ]
        .iter()
        .map(Into::into)
        .collect();
        let kept = without_db_flag(args);
        let joined = kept.iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>();
        assert_eq!(joined, ["--profile", "a", "delegate", "--goal", "g"]);
    }
}
