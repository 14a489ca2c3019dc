//! Background units seen from outside the process that runs them
//! (semantics §11): a unit's state and result by id, the running units, and
//! the control mailbox through which another process (`retinue steer`,
//! `retinue cancel`, an MCP `tasks/cancel`) reaches the worker that runs a
//! unit. The worker takes its controls in one statement, so each is taken
//! exactly once; a steer nobody took before the unit finished is settled
//! `missed`, never dropped silently.

use serde::Serialize;
use serde_json::Value;

use crate::error::Result;
use crate::status::UnitState;

/// How often a worker polls its mailbox, and a waiter the registry, in
/// milliseconds.
pub const CONTROL_POLL_MS: u64 = 200;

/// One child of a [`UnitView`].
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct UnitChild {
    /// Position in the batch.
    pub child_index: u32,
    /// The subagent id.
    pub subagent_id: String,
    /// The child's session.
    pub child_session_id: String,
    /// Its goal, as stored.
    pub goal: Option<String>,
    /// Its model, as stored.
    pub model: Option<String>,
    /// When it was retained (its TTL clock), if it is.
    pub retained_at: Option<f64>,
    /// When it was tombstoned, if it was.
    pub tombstoned_at: Option<f64>,
    /// Why it was tombstoned.
    pub tombstone_reason: Option<String>,
    /// The toolsets it was granted (from its manifest).
    pub toolsets: Vec<String>,
    /// Its role (from its manifest).
    pub role: Option<String>,
}

/// A unit (`async_delegations` row) with its children, as a waiter,
/// a task poller or a listing sees it.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct UnitView {
    /// The delegation id (also the MCP task id).
    pub delegation_id: String,
    /// The spawner's session.
    pub parent_session_id: Option<String>,
    /// The owning profile (`None` on hermes rows that have none).
    pub owner_profile: Option<String>,
    /// Lifecycle state.
    pub state: UnitState,
    /// `sync` or `background`, from the stored task.
    pub mode: Option<String>,
    /// When it was dispatched (epoch seconds).
    pub dispatched_at: f64,
    /// When it finished, if it has.
    pub completed_at: Option<f64>,
    /// `pending`, `delivered` or `dropped` (hermes's vocabulary; a claim in
    /// flight is still `pending`).
    pub delivery_state: String,
    /// The stored result (`{"delegation_id", "results": […]}`), once
    /// finished.
    pub result: Option<Value>,
    /// The process that runs it.
    pub owner_pid: Option<i64>,
    /// Its children, by index.
    pub children: Vec<UnitChild>,
    /// When the whole unit was tombstoned, if it was.
    pub tombstoned_at: Option<f64>,
    /// The W3C `traceparent` of the call that spawned it (`task_json`).
    pub traceparent: Option<String>,
}

impl UnitView {
    /// Whether the unit has finished (any state but pending, running and
    /// finalizing).
    pub fn is_finished(&self) -> bool {
        !matches!(self.state, UnitState::Pending | UnitState::Running | UnitState::Finalizing)
    }

    /// Whether its completion was already handed to the parent.
    pub fn is_delivered(&self) -> bool {
        self.delivery_state == "delivered"
    }
}

/// What a control asks of the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlKind {
    /// A message for one running child.
    Steer,
    /// Stop the unit's children.
    Cancel,
}

impl ControlKind {
    /// The stored word.
    pub fn as_str(self) -> &'static str {
        match self {
            ControlKind::Steer => "steer",
            ControlKind::Cancel => "cancel",
        }
    }

    /// The kind of a stored word (`None`: not one of ours).
    pub fn parse(s: &str) -> Option<ControlKind> {
        match s {
            "steer" => Some(ControlKind::Steer),
            "cancel" => Some(ControlKind::Cancel),
            _ => None,
        }
    }
}

/// Where a control stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlOutcome {
    /// Posted, not taken yet.
    Pending,
    /// Taken by the worker, not settled yet.
    Taken,
    /// Handed to the running child (a steer) or acted on (a cancel).
    Delivered,
    /// The child had finished: reported as `missed_steer`.
    Missed,
}

impl ControlOutcome {
    /// The stored word.
    pub fn as_str(self) -> &'static str {
        match self {
            ControlOutcome::Pending => "pending",
            ControlOutcome::Taken => "taken",
            ControlOutcome::Delivered => "delivered",
            ControlOutcome::Missed => "missed",
        }
    }

    /// The outcome of a stored word (anything unknown reads as pending).
    pub fn parse(s: Option<&str>) -> ControlOutcome {
        match s {
            Some("taken") => ControlOutcome::Taken,
            Some("delivered") => ControlOutcome::Delivered,
            Some("missed") => ControlOutcome::Missed,
            _ => ControlOutcome::Pending,
        }
    }
}

/// One control taken from the mailbox.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Control {
    /// Its id (for [`Controls::settle_control`]).
    pub id: i64,
    /// The unit.
    pub delegation_id: String,
    /// The child it is for (`None`: the whole unit).
    pub subagent_id: Option<String>,
    /// What it asks.
    pub kind: ControlKind,
    /// A steer's message.
    pub message: Option<String>,
}

/// The background-unit surface of a backend. Every method is one statement
/// or one transaction.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait Controls: Send + Sync {
    /// The unit `delegation_id`, or the unit of the child whose subagent id
    /// or child session id is `id`.
    fn unit_view(&self, id: &str) -> Result<Option<UnitView>>;
    /// Units not finished yet (pending, running, finalizing), newest first;
    /// only `profile`'s (and the unprofiled ones: [`crate::Scope`]'s rule) when given.
    #[expect(clippy::needless_lifetimes)] // mockall needs the named lifetime
    fn running_units<'a>(&self, profile: Option<&'a str>) -> Result<Vec<UnitView>>;
    /// Posts a control for the unit's worker; returns its id.
    fn post_control<'a>(
        &self,
        delegation_id: &str,
        subagent_id: Option<&'a str>,
        kind: ControlKind,
        message: Option<&'a str>,
    ) -> Result<i64>;
    /// Takes every pending control of the unit (each exactly once, across
    /// processes), oldest first.
    fn take_controls(&self, delegation_id: &str) -> Result<Vec<Control>>;
    /// Settles a control as delivered or missed. A pending control may be
    /// settled `missed` by whoever finds its unit finished; returns whether
    /// it changed.
    fn settle_control(&self, id: i64, outcome: ControlOutcome) -> Result<bool>;
    /// Where a control stands (`None`: no such control).
    fn control_outcome(&self, id: i64) -> Result<Option<ControlOutcome>>;
    /// Every unit (any state), newest first, at most `limit`; only
    /// `profile`'s (and the unprofiled ones) when given (the web view's tree).
    #[expect(clippy::needless_lifetimes)] // mockall needs the named lifetime
    fn list_units<'a>(&self, profile: Option<&'a str>, limit: usize) -> Result<Vec<UnitView>>;
    /// A cheap marker that changes whenever a unit, a child or a
    /// transcript changes (a live view polls it).
    fn change_marker(&self) -> Result<String>;
}

/// The toolsets and role a child's stored manifest (`manifest_json`) names;
/// anything unreadable reads as none.
pub fn manifest_facts(manifest_json: Option<&str>) -> (Vec<String>, Option<String>) {
    let Some(Value::Object(m)) = crate::model::parse_json_opt(manifest_json) else {
        return (Vec::new(), None);
    };
    let toolsets = m
        .get("toolsets")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        .unwrap_or_default();
    let role = m.get("role").and_then(Value::as_str).map(str::to_owned);
    (toolsets, role)
}

/// A running child's usage so far, read from its transcript (its ledger
/// rows are written only when it ends): what `children list --running`,
/// `retinue delegate`'s status lines and the web view show.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct UsageSoFar {
    /// Model calls answered (assistant turns).
    pub api_calls: usize,
    /// Completion tokens of those answers (their `token_count`).
    pub output_tokens: i64,
    /// Tool results recorded.
    pub tool_calls: usize,
    /// The last tool it ran.
    pub last_tool: Option<String>,
}

impl UsageSoFar {
    /// The usage a transcript shows.
    pub fn of(turns: &[crate::model::Message]) -> UsageSoFar {
        let answers = turns.iter().filter(|m| m.role == "assistant");
        UsageSoFar {
            api_calls: answers.clone().count(),
            output_tokens: answers.filter_map(|m| m.token_count).filter(|n| *n > 0).sum(),
            tool_calls: turns.iter().filter(|m| m.role == "tool").count(),
            last_tool: turns.iter().rev().find_map(|m| m.tool_name.clone()),
        }
    }
}
