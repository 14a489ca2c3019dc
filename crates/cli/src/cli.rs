//! The command-line interface (clap derive): global options, commands and
//! their arguments, exactly as the contract of the `retinue` command says.

use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand};

/// The help heading of the options every command takes.
const GLOBAL: &str = "Global options";

/// Operate the retained subagents in a hermes-agent `state.db`.
#[derive(Debug, Parser)]
#[command(
    name = "retinue",
    version,
    about = "Operate the retained subagents of a hermes-agent state.db",
    long_about = "Operate the retained subagents of a hermes-agent state.db: list, show, \
                  tombstone and prune retained children, check who may follow them up, \
                  resolve compression lineages, read the usage ledger, recover after a \
                  restart, run delegate_task with a scripted runtime, or watch the whole \
                  lifecycle in a demo.",
    after_help = "Exit codes: 0 ok, 2 bad usage, 3 denied, 4 not found, 1 any other error \
                  (message on stderr)."
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
        #[arg(value_name = "ID")]
        id: String,
        /// The requesting session
        #[arg(long, value_name = "SESSION")]
        caller: String,
    },

    /// The compression-lineage root of a session, and the chain walked to it
    Lineage {
        /// The session to resolve
        #[arg(value_name = "SESSION")]
        session: String,
    },

    /// Usage-ledger totals and records billed to a session
    Usage {
        /// The paying parent session
        #[arg(value_name = "SESSION")]
        session: String,
        /// Sum over the session's whole compression lineage
        #[arg(long)]
        lineage: bool,
    },

    /// Restart recovery: abandoned delegations become `unknown`, retained children rehydrate
    Recover,

    /// Run delegate_task as SESSION with the scripted (offline) child runtime
    Delegate(DelegateArgs),

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
        #[arg(long, value_name = "SESSION")]
        owner: Option<String>,
    },

    /// One addressable child by subagent id, child session id or delegation id (exit 4 if none)
    Show {
        /// Subagent id, child session id or delegation id
        #[arg(value_name = "ID")]
        id: String,
    },

    /// Tombstone one child, or every live child of a delegation id (exit 4 if not addressable)
    Tombstone {
        /// Subagent id, child session id or delegation id
        #[arg(value_name = "ID")]
        id: String,
        /// Why (stored as the tombstone reason) [default: manual]
        #[arg(long, value_name = "TEXT", value_parser = non_blank)]
        reason: Option<String>,
    },

    /// TTL and cap pruning (limits default to config.yaml's delegation section)
    Prune {
        /// Hours a retained child stays addressable (floored at 0)
        #[arg(long, value_name = "H", value_parser = finite_hours, allow_negative_numbers = true)]
        ttl_hours: Option<f64>,
        /// Retained units kept addressable (floored at 1)
        #[arg(long, value_name = "N")]
        max_retained: Option<u32>,
    },
}

/// `retinue delegate …`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("work").required(true).args(["goal", "tasks"])))]
pub(crate) struct DelegateArgs {
    /// The calling parent session
    #[arg(long, value_name = "SESSION")]
    pub(crate) parent: String,

    /// One task's goal (with --follow-up: the message for the child)
    #[arg(long, value_name = "TEXT")]
    pub(crate) goal: Option<String>,

    /// A batch: a JSON array of {"goal", "context"?, "role"?} objects
    #[arg(long, value_name = "JSON", value_parser = json_value)]
    pub(crate) tasks: Option<serde_json::Value>,

    /// Follow up a retained (or running) child instead of spawning
    #[arg(long, value_name = "ID", requires = "goal", conflicts_with = "tasks")]
    pub(crate) follow_up: Option<String>,
}

fn non_blank(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.is_empty() { Err("must not be blank".to_owned()) } else { Ok(t.to_owned()) }
}

fn finite_hours(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(h) if h.is_finite() => Ok(h),
        Ok(_) => Err("must be a finite number".to_owned()),
        Err(e) => Err(e.to_string()),
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
}
