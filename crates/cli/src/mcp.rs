//! `retinue mcp`: wires the backend (a state.db, or PostgreSQL in team mode), the authority and a delegator on the real
//! runtime into `retinue-mcp`'s server, and serves it (stdio, or streamable
//! HTTP on loopback). rmcp and tokio stay inside `retinue-mcp`.

use std::sync::Arc;

use retinue_core::SystemClock;
use retinue_delegate::ChildRuntime;
use retinue_lineage::Authority;
use retinue_mcp::{McpParts, McpShutdown, RetinueServer, ServerOptions, SessionChoice};

use crate::Output;
use crate::backend::Backend;
use crate::cli::{DelegateArgs, McpArgs};
use crate::commands::{configured_runtime, delegator};
use crate::env::Env;
use crate::error::{CliError, EXIT_OK, Result};

fn mcp_error(e: retinue_mcp::McpError) -> CliError {
    match e {
        retinue_mcp::McpError::NoSession(_) => CliError::NotFound(e.to_string()),
        retinue_mcp::McpError::NotLoopback(_) => CliError::Usage(e.to_string()),
        retinue_mcp::McpError::Store(e) => CliError::Store(e),
        other => {
            let mut text = other.to_string();
            let mut source = std::error::Error::source(&other);
            while let Some(cause) = source {
                text.push_str(": ");
                text.push_str(&cause.to_string());
                source = cause.source();
            }
            CliError::Failed(text)
        }
    }
}

/// `retinue mcp [--http ADDR] [--session ID | --new-session] [--model M] [--base-url URL]`.
pub(crate) fn run(env: &Env, args: &McpArgs) -> Result<Output> {
    let overrides = DelegateArgs {
        model: args.model.clone(),
        base_url: args.base_url.clone(),
        ..DelegateArgs::default()
    };
    // No model configured: the registry tools still work, and delegate_task
    // answers with the message naming the keys to set.
    let runtime = configured_runtime(env, &overrides);
    if env.all_profiles {
        return Err(CliError::Usage(
            "--all-profiles is refused by `retinue mcp`: an agent host acts for one tenant"
                .to_owned(),
        ));
    }
    let store = Backend::open(env, Arc::new(SystemClock), crate::env::Access::WriteOrCreate)?;
    store.keep_alive();
    // A server restarted after a crash: its dead units (and any other dead
    // owner's) are recovered before it serves, never left `running`.
    let report = store.registry.recover_abandoned_delegations(&retinue_core::ProcProbe);
    if report.abandoned > 0 {
        eprintln!(
            "retinue mcp: recovered {} abandoned delegation(s) of processes that are gone",
            report.abandoned
        );
    }
    if let Some(e) = report.error {
        eprintln!("retinue mcp: warning: could not recover abandoned delegations: {e}");
    }
    if let Err(e) = store.budgets.release_abandoned_reservations(&retinue_core::ProcProbe) {
        eprintln!("retinue mcp: warning: could not reconcile abandoned budget reservations: {e}");
    }
    let choice = match (&args.session, args.new_session) {
        (Some(id), _) => SessionChoice::Existing(id.clone()),
        (None, true) => SessionChoice::New,
        (None, false) => match &args.workspace {
            Some(dir) => SessionChoice::Project(
                std::fs::canonicalize(dir)
                    .map_err(|e| CliError::Usage(format!("--workspace {}: {e}", dir.display())))?,
            ),
            None => SessionChoice::Project(std::env::current_dir().map_err(|e| {
                CliError::Usage(format!(
                    "the working directory cannot be read ({e}); it names this project's \
                     session: cd to an existing directory, or pass --workspace DIR, --session \
                     ID or --new-session"
                ))
            })?),
        },
    };
    let parent =
        retinue_mcp::resolve_session(&*store.sessions, &choice, &env.profile).map_err(mcp_error)?;
    let mut parent_toolsets = Vec::new();
    let delegator = match runtime {
        Ok((runtime, config, toolbox)) => {
            parent_toolsets = crate::commands::parent_toolsets(&config, &toolbox);
            let runtime: Arc<dyn ChildRuntime> = Arc::new(runtime);
            Ok(delegator(&store, runtime, config, &env.profile).with_isolation(env.worktrees()))
        }
        Err(e) => {
            eprintln!("retinue mcp: warning: delegate_task is unavailable: {e}");
            Err(Arc::new(e) as retinue_mcp::Unavailable)
        }
    };
    // The children work in the project directory the session is keyed
    // on (or the server's working directory) — never `/`, a system
    // directory or the user's home.
    let mut workspace = args
        .workspace
        .clone()
        .or_else(|| parent.project.clone())
        .or_else(|| std::env::current_dir().ok())
        .and_then(|p| std::fs::canonicalize(p).ok());
    let workspace_refused =
        workspace.as_deref().and_then(|w| crate::commands::workspace_refusal(w, env));
    if let Some(why) = &workspace_refused {
        eprintln!(
            "retinue mcp: warning: {why}; the read, file and terminal toolsets are refused until \
             the host starts `retinue mcp` in a project directory (its `cwd`)"
        );
        workspace = None;
    }
    let parts = McpParts {
        profile: env.profile.clone(),
        backend: store.seams.clone(),
        budget: store.config.delegation.budget,
        authority: Arc::new(Authority::new(
            store.registry.clone(),
            store.graph.clone(),
            env.profile.as_str(),
        )),
        delegator,
        workspace,
        workspace_refused,
        toolsets: parent_toolsets,
    };
    let project = parent.project.as_ref().map(|p| p.display().to_string());
    let server = RetinueServer::new(parts, parent.id.clone(), project, ServerOptions::default());
    let what = if parent.created { "new session" } else { "session" };
    match args.http {
        None => {
            eprintln!("retinue mcp: serving MCP on stdio as {what} {}", parent.id);
            retinue_mcp::serve_stdio(server).map_err(mcp_error)?;
        }
        Some(addr) => {
            let id = parent.id.clone();
            retinue_mcp::serve_http(server, addr, &McpShutdown::new(), |bound| {
                eprintln!("retinue mcp: serving MCP on http://{bound}/ as {what} {id}");
            })
            .map_err(mcp_error)?;
        }
    }
    Ok(Output { json: None, human: String::new(), code: EXIT_OK, stderr: None })
}
