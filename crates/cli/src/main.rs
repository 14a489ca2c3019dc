//! `retinue`: operate the retained subagents of a hermes-agent `state.db`
//! (list, show, tombstone, prune, authority, lineage, usage, recover,
//! delegate), and a demo of the whole lifecycle.
//!
//! The contract (options, commands, JSON keys, exit codes) is stable: scripts
//! call it exactly as `retinue --help` shows. Exit codes: 0 ok, 2 bad usage,
//! 3 denied, 4 not found, 1 any other error (message on stderr). This is the
//! only crate that wires the concrete stores (SQLite, or PostgreSQL in team
//! mode, behind [`backend::Backend`]), the lineage rules, the usage ledger and
//! the delegate tool together.

mod approvals;
mod backend;
mod background;
mod changes;
mod cli;
mod commands;
mod demo;
mod env;
mod error;
mod interrupt;
mod mcp;
mod migrate;
mod progress;
mod serve;
mod table;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

use crate::cli::{ChildrenCommand, Cli, Command};
use crate::env::Env;
use crate::error::{CliError, EXIT_USAGE};

/// What a command produced: JSON for `--json`, text otherwise, an exit code,
/// and an optional message for stderr.
#[derive(Debug)]
pub(crate) struct Output {
    /// The machine output (`None`: the command printed as it went).
    pub(crate) json: Option<serde_json::Value>,
    /// The human output.
    pub(crate) human: String,
    /// The exit code.
    pub(crate) code: u8,
    /// A message for stderr.
    pub(crate) stderr: Option<String>,
}

impl Output {
    /// A successful output.
    pub(crate) fn ok(json: serde_json::Value, human: String) -> Output {
        Output { json: Some(json), human, code: error::EXIT_OK, stderr: None }
    }
}

fn run(cli: &Cli) -> error::Result<Output> {
    let env = Env::from_cli(cli)?;
    match &cli.command {
        Command::Children(sub) => match sub {
            ChildrenCommand::List { owner, running, all: false } => {
                commands::children_list(&env, owner.as_deref(), *running)
            }
            ChildrenCommand::List { all: true, .. } => commands::units_list(&env),
            ChildrenCommand::Show { id, all } => commands::children_show(&env, id, *all),
            ChildrenCommand::Tombstone { id, reason } => {
                commands::children_tombstone(&env, id, reason.as_deref())
            }
            ChildrenCommand::Prune { ttl_hours, max_retained } => {
                commands::children_prune(&env, *ttl_hours, *max_retained)
            }
        },
        Command::Authority { id, caller } => commands::authority(&env, id, caller),
        Command::Lineage { session } => commands::lineage(&env, session),
        Command::Usage { session, lineage } => commands::usage(&env, session, *lineage),
        Command::Recover => commands::recover(&env),
        Command::Delegate(args) => commands::delegate(&env, args),
        Command::Completions { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(
                *shell,
                &mut <Cli as clap::CommandFactory>::command(),
                "retinue",
                &mut out,
            );
            Ok(Output {
                json: None,
                human: String::from_utf8_lossy(&out).into_owned(),
                code: 0,
                stderr: None,
            })
        }
        Command::Man => {
            let mut out = Vec::new();
            clap_mangen::Man::new(<Cli as clap::CommandFactory>::command()).render(&mut out)?;
            Ok(Output {
                json: None,
                human: String::from_utf8_lossy(&out).into_owned(),
                code: 0,
                stderr: None,
            })
        }
        Command::Serve { http, allow_remote, token, host_name, read_only } => {
            serve::run(&env, *http, *allow_remote, token.as_deref(), host_name, *read_only)
        }
        Command::Wait { ids, parent, timeout, peek } => {
            background::wait(&env, ids, parent.as_deref(), *timeout, *peek)
        }
        Command::Steer { id, message, parent } => {
            background::steer(&env, id, message, parent.as_deref())
        }
        Command::Cancel { id, parent } => background::cancel(&env, id, parent.as_deref()),
        Command::Changes { id, diff, pending, parent } => {
            changes::show(&env, id.as_deref(), *diff, *pending, parent.as_deref())
        }
        Command::Apply { id, parent } => changes::decide(&env, id, false, parent.as_deref()),
        Command::Discard { id, parent } => changes::decide(&env, id, true, parent.as_deref()),
        Command::Approvals { all, parent } => approvals::list(&env, *all, parent.as_deref()),
        Command::Approve { id, always, parent } => approvals::decide(
            &env,
            id,
            &retinue_delegate::Ruling::Approve { always: *always },
            parent.as_deref(),
        ),
        Command::Deny { id, reason, parent } => approvals::decide(
            &env,
            id,
            &retinue_delegate::Ruling::Deny { reason: reason.clone() },
            parent.as_deref(),
        ),
        Command::Mcp(args) => mcp::run(&env, args),
        Command::Migrate { to } => migrate::migrate(&env, to),
        Command::Demo => {
            if cli.db.is_some() {
                return Err(CliError::Usage(
                    "demo takes no --db: it creates DIR/state.db in a fresh --home".to_owned(),
                ));
            }
            demo::run(&env, cli.home.as_deref())
        }
    }
}

/// Writes `text` to stdout; a closed pipe (`retinue … | head`) is not an error.
pub(crate) fn print_stdout(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Library warnings (e.g. the WAL → DELETE fallback) go to stderr; the level
/// comes from `RETINUE_LOG` (`error`, `warn` — the default —, `info`, `debug`).
fn init_logging() {
    let env = env_logger::Env::new().filter_or("RETINUE_LOG", "warn");
    let _ = env_logger::Builder::from_env(env)
        .target(env_logger::Target::Stderr)
        .format_timestamp(None)
        .format_target(false)
        .try_init();
}

/// With `--json`, an error is one JSON object on stdout: `{"error", "code"}`.
fn json_error(message: &str, code: &str) -> String {
    let v = serde_json::json!({ "error": message, "code": code });
    serde_json::to_string_pretty(&v).map_or_else(|_| String::new(), |s| s + "\n")
}

/// The hidden first argument that turns `retinue` into the terminal's
/// sandbox helper (`retinue __sandbox --workspace DIR [--network] -- CMD`).
pub(crate) const SANDBOX_SUBCOMMAND: &str = "__sandbox";

fn main() -> ExitCode {
    let mut argv = std::env::args_os().skip(1);
    if argv.next().is_some_and(|a| a == SANDBOX_SUBCOMMAND) {
        let code = retinue_tools::sandbox::helper_main(argv.collect());
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    init_logging();
    // OpenTelemetry export, when OTEL_EXPORTER_OTLP_ENDPOINT is set (flushed
    // when main returns; never blocking or failing a command).
    let _tracing = retinue_trace::init_from_env();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout with code 0; errors to stderr with code 2
            // (and, with --json, as a JSON object on stdout too).
            let code = if e.use_stderr() { EXIT_USAGE } else { error::EXIT_OK };
            if e.use_stderr() && std::env::args_os().any(|a| a == "--json") {
                let text = e.kind().to_string();
                let message = e.to_string();
                let first = message.lines().next().unwrap_or(&text);
                let first = first.trim_start_matches("error: ");
                let _ = print_stdout(&json_error(first, "usage"));
            }
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let result = run(&cli).and_then(|out| {
        let text = match &out.json {
            Some(v) if cli.json => {
                let mut s = serde_json::to_string_pretty(v)
                    .map_err(|e| CliError::Failed(format!("cannot encode the output: {e}")))?;
                s.push('\n');
                s
            }
            _ => out.human.clone(),
        };
        print_stdout(&text)?;
        Ok(out)
    });
    match result {
        Ok(out) => {
            if let Some(msg) = &out.stderr {
                eprintln!("retinue: {msg}");
            }
            ExitCode::from(out.code)
        }
        Err(e) => {
            if cli.json {
                let _ = print_stdout(&json_error(&e.report(), e.kind()));
            }
            eprintln!("retinue: {}", e.report());
            ExitCode::from(e.exit_code())
        }
    }
}
