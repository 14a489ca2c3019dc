//! The command-line interface (clap derive): global options, commands and
//! their arguments, exactly as the contract of the `retinue` command says.

use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand};

/// The help heading of the options every command takes.
const GLOBAL: &str = "Global options";

/// `retinue --version`: the package version and the commit it was built
/// from.
pub(crate) const VERSION: &str =
    concat!(env!("CARGO_PKG_VERSION"), " (", env!("RETINUE_COMMIT"), ")");

/// Operate the retained subagents in a hermes-agent `state.db`.
#[derive(Debug, Parser)]
#[command(
    name = "retinue",
    version = VERSION,
    about = "Operate the retained subagents of a hermes-agent state.db",
    long_about = "Operate the retained subagents of a hermes-agent state.db: list, show, \
                  tombstone and prune retained children, check who may follow them up, \
                  resolve compression lineages, read the usage ledger, recover after a \
                  restart, run delegate_task with children on a real model, or watch the \
                  whole lifecycle in a demo.",
    after_help = "Exit codes: 0 ok, 2 bad usage, 3 denied, 4 not found, 5 wait timed out, \
                  1 any other error (message on stderr)."
)]
pub(crate) struct Cli {
    /// hermes home; the database is DIR/state.db [default: $HERMES_HOME, else ~/.hermes]
    #[arg(long, global = true, value_name = "DIR", help_heading = GLOBAL)]
    pub(crate) home: Option<PathBuf>,

    /// Database file (overrides DIR/state.db; config.yaml is still read from the home)
    #[arg(long, global = true, value_name = "FILE", help_heading = GLOBAL)]
    pub(crate) db: Option<PathBuf>,

    /// Profile key of this process [default: $HERMES_PROFILE, else empty]
    #[arg(long, global = true, value_name = "NAME", help_heading = GLOBAL)]
    pub(crate) profile: Option<String>,

    /// Machine output (JSON) on stdout instead of aligned tables
    #[arg(long, global = true, help_heading = GLOBAL)]
    pub(crate) json: bool,

    /// Team mode: list, show and tombstone across every tenant (the operator's view; refused by `mcp`)
    #[arg(long, global = true, help_heading = GLOBAL)]
    pub(crate) all_profiles: bool,

    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Retained children: list, show, tombstone, prune
    #[command(subcommand)]
    Children(ChildrenCommand),

    /// The follow-up authority decision: may SESSION message child ID? (exit 3 when denied)
    Authority {
        /// Subagent id, child session id or delegation id
        #[arg(value_name = "ID", value_parser = non_blank)]
        id: String,
        /// The requesting session
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        caller: String,
    },

    /// The compression-lineage root of a session, and the chain walked to it
    Lineage {
        /// The session to resolve
        #[arg(value_name = "SESSION", value_parser = non_blank)]
        session: String,
    },

    /// Usage-ledger totals and records billed to a session
    Usage {
        /// The paying parent session
        #[arg(value_name = "SESSION", value_parser = non_blank)]
        session: String,
        /// Sum over the session's whole compression lineage
        #[arg(long)]
        lineage: bool,
    },

    /// Restart recovery: abandoned delegations become `unknown`, retained children rehydrate
    Recover,

    /// Run delegate_task: children talk to the configured OpenAI-compatible model
    Delegate(DelegateArgs),

    /// Serve a read-only web view of the subagent tree, its cost and transcripts, live (loopback only unless --allow-remote)
    Serve {
        /// The address to listen on (port 0 picks a free one)
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8787", value_parser = any_addr)]
        http: std::net::SocketAddr,
        /// Allow a non-loopback address; every request must then present a token
        #[arg(long)]
        allow_remote: bool,
        /// The token remote requests present [default: $RETINUE_WEB_TOKEN, else a random one, printed]
        #[arg(long, value_name = "TOKEN", value_parser = non_blank, requires = "allow_remote")]
        token: Option<String>,
        /// A host name remote browsers reach the view by (repeatable; no port or wildcard): requests with any other Host are refused
        #[arg(long = "host-name", value_name = "NAME", requires = "allow_remote", value_parser = host_name)]
        host_name: Vec<String>,
        /// Open the registry read-only: no approve/deny buttons
        #[arg(long)]
        read_only: bool,
    },

    /// Print a shell completion script (bash, zsh, fish, elvish, powershell)
    Completions {
        /// The shell
        #[arg(value_name = "SHELL")]
        shell: clap_complete::Shell,
    },

    /// Print the man page (roff) of `retinue`
    Man,

    /// Wait for background units and print their results, each delivered once (exit 5 on timeout)
    Wait {
        /// Delegation ids or subagent ids
        #[arg(value_name = "ID", required = true, value_parser = non_blank)]
        ids: Vec<String>,
        /// The parent session the units belong to (authority as for a follow-up) [default on a state.db's operator: the units' recorded parent; required in team mode]
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        parent: Option<String>,
        /// Seconds to wait at most
        #[arg(long, value_name = "S", default_value_t = 600.0, value_parser = finite_seconds)]
        timeout: f64,
        /// Read the results without consuming them (they stay deliverable)
        #[arg(long)]
        peek: bool,
    },

    /// Send a message to a running child (exit 1 with missed_steer when it had finished)
    Steer {
        /// The subagent id (or the delegation id of a one-child unit)
        #[arg(value_name = "ID", value_parser = non_blank)]
        id: String,
        /// The message
        #[arg(long, value_name = "TEXT", value_parser = non_blank)]
        message: String,
        /// The parent session the child belongs to [default on a state.db's operator: its recorded parent; required in team mode]
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        parent: Option<String>,
    },

    /// Cancel a running unit: its children stop (exit reason cancelled) and bill what they spent
    Cancel {
        /// A delegation id or subagent id
        #[arg(value_name = "ID", value_parser = non_blank)]
        id: String,
        /// The parent session the unit belongs to [default on a state.db's operator: its recorded parent; required in team mode]
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        parent: Option<String>,
    },

    /// List the approval requests of children's risky calls (pending ones; --all: decided too)
    Approvals {
        /// Decided and expired requests too
        #[arg(long)]
        all: bool,
        /// Decide as this parent session (the children its lineage spawned) [default on a state.db: the home's operator; required in team mode and for a profile]
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        parent: Option<String>,
    },

    /// Approve a pending request: the child's call runs (exit 4 unknown id, 1 already decided)
    Approve {
        /// The approval id (appr_…)
        #[arg(value_name = "ID", value_parser = non_blank)]
        id: String,
        /// Approve this call and the same call of this child for the rest of its unit and follow-ups
        #[arg(long)]
        always: bool,
        /// Decide as this parent session [default on a state.db: the home's operator; required in team mode and for a profile]
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        parent: Option<String>,
    },

    /// Deny a pending request: the child's model reads the reason (exit 4 unknown id, 1 already decided)
    Deny {
        /// The approval id (appr_…)
        #[arg(value_name = "ID", value_parser = non_blank)]
        id: String,
        /// Why (the model reads it)
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
        /// Decide as this parent session [default on a state.db: the home's operator; required in team mode and for a profile]
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        parent: Option<String>,
    },

    /// An isolated child's change set: its files and diffstat (--diff: the diff); without ID every change set (--pending: those neither applied nor discarded) (exit 4 unknown id)
    Changes {
        /// The subagent id
        #[arg(value_name = "ID", value_parser = non_blank, conflicts_with = "pending")]
        id: Option<String>,
        /// Also the unified diff
        #[arg(long, requires = "id")]
        diff: bool,
        /// Only change sets neither applied nor discarded
        #[arg(long)]
        pending: bool,
        /// Act as this parent session [default on a state.db: the home's operator; required in team mode and for a profile]
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        parent: Option<String>,
    },

    /// Apply an isolated child's change set to its parent's workspace with a three-way merge (exit 1 conflict: nothing applied, the files listed)
    Apply {
        /// The subagent id
        #[arg(value_name = "ID", value_parser = non_blank)]
        id: String,
        /// Act as this parent session [default on a state.db: the home's operator; required in team mode and for a profile]
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        parent: Option<String>,
    },

    /// Drop an isolated child's change set and remove its worktree and branch
    Discard {
        /// The subagent id
        #[arg(value_name = "ID", value_parser = non_blank)]
        id: String,
        /// Act as this parent session [default on a state.db: the home's operator; required in team mode and for a profile]
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        parent: Option<String>,
    },

    /// Serve MCP (stdio, or --http on loopback): delegate_task and the registry tools for an agent host
    #[command(long_about = "Serve the Model Context Protocol for an agent host (Claude Code, \
                      Codex, goose, …): delegate_task, list_subagents, show_subagent, \
                      tombstone_subagent and subagent_usage. The server acts as one parent \
                      session that outlives it: by default this project's (derived from the \
                      working directory and the profile, created on first use with source \
                      `mcp`), so tomorrow's server here can follow up today's subagents. \
                      stdio by default; logs go to stderr.")]
    Mcp(McpArgs),

    /// Copy the state.db into PostgreSQL (team mode): idempotent, verified
    Migrate {
        /// The PostgreSQL database (postgres://user@host:port/db; password from
        /// PGPASSWORD or ~/.pgpass)
        #[arg(long, value_name = "URL", value_parser = non_blank)]
        to: String,
    },

    /// The whole lifecycle on a fresh home, as a story (or JSON events with --json)
    #[command(long_about = "The whole lifecycle on a fresh home, in a few seconds and with no \
                      network: a parent delegates three tasks, the children are retained, the \
                      parent is compressed into a continuation that follows one child up, a \
                      branch and a stranger are refused, a child is tombstoned, a TTL prune \
                      runs, a simulated restart recovers, and the lineage's usage is totalled.\n\n\
                      Runs in a temporary directory (deleted afterwards) unless --home DIR \
                      names a directory without a state.db; $HERMES_HOME is never used.")]
    Demo,
}

/// `retinue children …`.
#[derive(Debug, Subcommand)]
pub(crate) enum ChildrenCommand {
    /// Addressable retained children, newest first
    List {
        /// Only the children this session's lineage may address
        #[arg(long, value_name = "SESSION", value_parser = non_blank)]
        owner: Option<String>,
        /// Only the delegations still running, with elapsed time and usage so far
        #[arg(long, conflicts_with = "all")]
        running: bool,
        /// Every unit in any state (cancelled, interrupted, failed, unknown, tombstoned too), read-only, with why each child stopped and its usage
        #[arg(long, conflicts_with = "owner")]
        all: bool,
    },

    /// One addressable child by subagent id, child session id or delegation id (exit 4 if none)
    Show {
        /// Subagent id, child session id or delegation id
        #[arg(value_name = "ID", value_parser = non_blank)]
        id: String,
        /// Also a unit or child that is not addressable (never was, or no longer is): its state, exit reason, reason text and usage, read-only
        #[arg(long)]
        all: bool,
    },

    /// Tombstone one child, or every live child of a delegation id (exit 4 if not addressable)
    Tombstone {
        /// Subagent id, child session id or delegation id
        #[arg(value_name = "ID", value_parser = non_blank)]
        id: String,
        /// Why (stored as the tombstone reason) [default: manual]
        #[arg(long, value_name = "TEXT", value_parser = non_blank)]
        reason: Option<String>,
    },

    /// TTL and cap pruning (limits default to config.yaml's delegation section)
    Prune {
        /// Hours a retained child stays addressable (0 or more)
        #[arg(long, value_name = "H", value_parser = finite_hours, allow_negative_numbers = true)]
        ttl_hours: Option<f64>,
        /// Retained units kept addressable (1 or more)
        #[arg(long, value_name = "N", value_parser = max_retained, allow_negative_numbers = true)]
        max_retained: Option<u32>,
    },
}

/// `retinue delegate …`.
#[derive(Debug, Default, Args)]
#[command(group(ArgGroup::new("work").required(true).args(["goal", "tasks"])))]
pub(crate) struct DelegateArgs {
    /// The calling parent session [default: a new top-level `cli` session, whose id is printed]
    #[arg(long, value_name = "SESSION", value_parser = non_blank)]
    pub(crate) parent: Option<String>,

    /// The children's model (overrides delegation.model)
    #[arg(long, value_name = "MODEL", value_parser = non_blank)]
    pub(crate) model: Option<String>,

    /// The OpenAI-compatible endpoint, e.g. http://127.0.0.1:11434/v1 (overrides delegation.base_url)
    #[arg(long, value_name = "URL", value_parser = non_blank)]
    pub(crate) base_url: Option<String>,

    /// One task's goal (with --follow-up: the message for the child)
    #[arg(long, value_name = "TEXT")]
    pub(crate) goal: Option<String>,

    /// A batch: a JSON array of {"goal", "context"?, "role"?} objects
    #[arg(long, value_name = "JSON", value_parser = json_value)]
    pub(crate) tasks: Option<serde_json::Value>,

    /// Follow up a retained (or running) child instead of spawning
    #[arg(long, value_name = "ID", requires = "goal", conflicts_with = "tasks")]
    pub(crate) follow_up: Option<String>,

    /// The directory the children's tools work in [default: the current directory]
    #[arg(long, value_name = "DIR")]
    pub(crate) workspace: Option<std::path::PathBuf>,

    /// Narrow the children's toolsets (comma-separated: read, file, terminal, mcp-SERVER); only narrows delegation.toolsets
    #[arg(long, value_name = "LIST", value_delimiter = ',', conflicts_with = "follow_up")]
    pub(crate) toolsets: Option<Vec<String>>,

    /// worktree: a git worktree per child, its edits a change set (see `retinue changes`); none: one shared workspace
    #[arg(
        long,
        value_name = "MODE",
        value_enum,
        hide_possible_values = true,
        conflicts_with = "follow_up"
    )]
    pub(crate) isolation: Option<IsolationArg>,

    /// Run the children in a detached worker process: print the delegation and subagent ids and exit at once (collect with `retinue wait`)
    #[arg(long, conflicts_with = "follow_up")]
    pub(crate) background: bool,

    /// Internal: this process is the detached worker of `--background`
    #[arg(long, hide = true, requires = "background")]
    pub(crate) detached_worker: bool,
}

/// `--isolation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum IsolationArg {
    /// The children share the workspace.
    None,
    /// A git worktree per child.
    Worktree,
}

/// `retinue mcp …`.
#[derive(Debug, Args)]
pub(crate) struct McpArgs {
    /// Serve streamable HTTP on this loopback address (e.g. 127.0.0.1:8765 or localhost:8765) instead of stdio
    #[arg(long, value_name = "ADDR", value_parser = loopback_addr)]
    pub(crate) http: Option<std::net::SocketAddr>,

    /// Act as this existing session instead of the project's
    #[arg(long, value_name = "ID", value_parser = non_blank, conflicts_with = "new_session")]
    pub(crate) session: Option<String>,

    /// Act as a fresh session (its id is in the server's instructions and on stderr)
    #[arg(long)]
    pub(crate) new_session: bool,

    /// The children's model (overrides delegation.model)
    #[arg(long, value_name = "MODEL", value_parser = non_blank)]
    pub(crate) model: Option<String>,

    /// The OpenAI-compatible endpoint (overrides delegation.base_url)
    #[arg(long, value_name = "URL", value_parser = non_blank)]
    pub(crate) base_url: Option<String>,

    /// The project directory the children work in (default: the working directory; it also keys the project's session)
    #[arg(long, value_name = "DIR")]
    pub(crate) workspace: Option<std::path::PathBuf>,
}

fn finite_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=31_536_000.0).contains(&v) => Ok(v),
        _ => Err("must be a number of seconds from 0 to 31536000".to_owned()),
    }
}

fn host_name(s: &str) -> Result<String, String> {
    retinue_web::host_name(s).map_err(|e| e.to_string())
}

fn non_blank(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.is_empty() { Err("must not be blank".to_owned()) } else { Ok(t.to_owned()) }
}

fn finite_hours(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(h) if h.is_finite() && h >= 0.0 => Ok(h),
        Ok(_) => Err("must be a number of hours, 0 or more".to_owned()),
        Err(e) => Err(format!("{e} (expected a number of hours, 0 or more)")),
    }
}

fn max_retained(s: &str) -> Result<u32, String> {
    match s.trim().parse::<i64>() {
        Ok(n) if (1..=i64::from(u32::MAX)).contains(&n) => {
            u32::try_from(n).map_err(|e| e.to_string())
        }
        Ok(_) => Err(format!("must be a whole number from 1 to {}", u32::MAX)),
        Err(e) => Err(format!("{e} (expected a whole number from 1 to {})", u32::MAX)),
    }
}

fn json_value(s: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| format!("not valid JSON: {e}"))
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        super::Cli::command().debug_assert();
    }

    #[test]
    fn ranges_are_stated() {
        assert_eq!(super::finite_hours(" 1.5 "), Ok(1.5));
        assert_eq!(super::finite_hours("-5"), Err("must be a number of hours, 0 or more".into()));
        assert_eq!(super::max_retained("3"), Ok(3));
        assert!(super::max_retained("-1").is_err_and(|e| e.contains("from 1 to")));
        assert!(super::max_retained("0").is_err_and(|e| e.contains("from 1 to")));
        assert_eq!(super::non_blank("  x "), Ok("x".into()));
        assert!(super::non_blank("  ").is_err());
    }
}

/// `serve --http ADDR`: any IP socket address, or `localhost:PORT`
/// (127.0.0.1); the command decides what it accepts.
fn any_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    parse_addr(text, "an address: use IP:PORT or localhost:PORT")
}

/// `mcp --http ADDR`: an IP socket address, or `localhost:PORT` (127.0.0.1).
fn loopback_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    parse_addr(text, "a loopback address: use 127.0.0.1:PORT, [::1]:PORT or localhost:PORT")
}

fn parse_addr(text: &str, what: &str) -> Result<std::net::SocketAddr, String> {
    let text = text.trim();
    if let Ok(addr) = text.parse::<std::net::SocketAddr>() {
        return Ok(addr);
    }
    match text.rsplit_once(':') {
        Some((host, port)) if host.eq_ignore_ascii_case("localhost") => port
            .parse::<u16>()
            .map(|p| std::net::SocketAddr::from(([127, 0, 0, 1], p)))
            .map_err(|_| format!("`{port}` is not a port number")),
        _ => Err(format!("`{text}` is not {what}")),
    }
}

#[cfg(test)]
mod addr_tests {
    use super::loopback_addr;

    #[test]
    fn localhost_is_a_loopback_address() {
        assert_eq!(loopback_addr("localhost:8765").ok(), "127.0.0.1:8765".parse().ok());
        assert_eq!(loopback_addr("127.0.0.1:9").ok(), "127.0.0.1:9".parse().ok());
        assert_eq!(loopback_addr("[::1]:9").ok(), "[::1]:9".parse().ok());
        assert!(loopback_addr("localhost:http").is_err());
        assert!(loopback_addr("example.com:80").is_err());
    }
}
