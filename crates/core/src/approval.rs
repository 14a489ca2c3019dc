//! Approval requests (issue #37): a child's risky call, held until a human
//! decides it. The request is a row of the registry (`retinue_approvals`),
//! so it is shared by every surface — the CLI, the MCP server, the web view
//! — survives a restart, and goes with its unit.
//!
//! The rules written here and nowhere else:
//! - a request moves once: `pending` → `approved` | `denied` | `expired`;
//!   a second decision is told [`DecideOutcome::AlreadyDecided`], whoever
//!   races;
//! - a unit holds at most [`MAX_PENDING_PER_UNIT`] pending requests (a
//!   model that floods requests is denied the rest);
//! - a request outside the decider's [`Scope`] is answered exactly as a
//!   missing one;
//! - a request whose unit ends is expired by the backend in the same
//!   statement that ends the unit (`worker gone` for a unit found
//!   `unknown`);
//! - every stored text is bounded ([`REASON_MAX_CHARS`]).

use serde::Serialize;
use serde_json::Value;

use crate::error::Result;
use crate::{Scope, random_hex, truncate_chars};

/// At most this many requests of one unit wait at once.
pub const MAX_PENDING_PER_UNIT: u32 = 8;

/// A stored reason (why it needs approval, why it was denied) is cut to
/// this many characters.
pub const REASON_MAX_CHARS: usize = 2_000;

/// What a redacted secret reads as in stored arguments.
pub const REDACTED_MARK: &str = "[redacted]";

/// What the backend records as the decider of a request it expired.
pub const EXPIRED_BY: &str = "retinue";

/// Where a request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalState {
    /// Waiting for a decision.
    Pending,
    /// Approved: the call runs.
    Approved,
    /// Denied: the model reads why.
    Denied,
    /// Nobody decided in time, or the unit ended first.
    Expired,
}

impl ApprovalState {
    /// The stored word.
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalState::Pending => "pending",
            ApprovalState::Approved => "approved",
            ApprovalState::Denied => "denied",
            ApprovalState::Expired => "expired",
        }
    }

    /// The state of a stored word (`None`: not one of ours).
    pub fn parse(s: &str) -> Option<ApprovalState> {
        Some(match s {
            "pending" => ApprovalState::Pending,
            "approved" => ApprovalState::Approved,
            "denied" => ApprovalState::Denied,
            "expired" => ApprovalState::Expired,
            _ => return None,
        })
    }
}

/// How far an approval reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalScope {
    /// This call only.
    #[default]
    Once,
    /// This call and every call like it for the rest of the child's unit
    /// and its follow-ups ([`ApprovalRequest::covers`]).
    Always,
}

impl ApprovalScope {
    /// The stored word.
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalScope::Once => "once",
            ApprovalScope::Always => "always",
        }
    }

    /// The scope of a stored word (anything else reads as once).
    pub fn parse(s: Option<&str>) -> ApprovalScope {
        if s == Some("always") { ApprovalScope::Always } else { ApprovalScope::Once }
    }
}

/// One request, as stored.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ApprovalRequest {
    /// `appr_<12 hex>`.
    pub approval_id: String,
    /// The unit the call belongs to.
    pub delegation_id: String,
    /// The child that made the call.
    pub subagent_id: String,
    /// The tool it called.
    pub tool: String,
    /// Its arguments, secrets redacted.
    pub arguments: Value,
    /// Why it needs approval.
    pub reason: String,
    /// Where it stands.
    pub state: ApprovalState,
    /// `once` or `always` (meaningful once approved).
    pub scope: ApprovalScope,
    /// When it was asked (epoch seconds).
    pub requested_at: f64,
    /// When it was decided.
    pub decided_at: Option<f64>,
    /// Who decided (`operator`, `session:<id>`, `web`, `mcp:<client>`,
    /// `retinue` for an expiry).
    pub decided_by: Option<String>,
    /// The decider's reason (a denial's text, an expiry's cause).
    pub decision_reason: Option<String>,
    /// The unit's owning profile (the request's tenant).
    pub owner_profile: Option<String>,
    /// The unit's parent session (who may decide, with its lineage).
    pub parent_session_id: Option<String>,
}

impl ApprovalRequest {
    /// Whether this request, approved `always`, lets `tool` with
    /// `arguments` (redacted as stored) run without asking: the same tool
    /// and, for a terminal command, the same arguments (command text and
    /// working directory: an approved `rm -rf build` never approves
    /// `rm -rf /`); any other tool is covered by name. A call with a
    /// redacted value is never covered (two different secrets, or a secret
    /// and code, would read alike).
    pub fn covers(&self, tool: &str, arguments: &Value) -> bool {
        if self.state != ApprovalState::Approved
            || self.scope != ApprovalScope::Always
            || self.tool != tool
            || arguments.to_string().contains(REDACTED_MARK)
            || self.arguments.to_string().contains(REDACTED_MARK)
        {
            return false;
        }
        match tool {
            "terminal" => {
                let command = |v: &Value| {
                    v.get("command").and_then(Value::as_str).map(str::trim).map(str::to_owned)
                };
                let workdir = |v: &Value| v.get("workdir").cloned();
                command(&self.arguments).is_some()
                    && command(&self.arguments) == command(arguments)
                    && workdir(&self.arguments) == workdir(arguments)
            }
            _ => true,
        }
    }

    /// The call as a human reads it: a terminal call's command, else the
    /// tool's arguments as JSON.
    pub fn call_text(&self) -> String {
        match self.arguments.get("command").and_then(Value::as_str) {
            Some(c) if self.tool == "terminal" => c.to_owned(),
            _ => self.arguments.to_string(),
        }
    }

    /// The text a model reads for a request that ended without running its
    /// call (`None`: approved).
    pub fn refusal_text(&self, timeout_s: u64) -> Option<String> {
        match self.state {
            ApprovalState::Approved | ApprovalState::Pending => None,
            ApprovalState::Denied => Some(format!(
                "denied by {}: {}",
                self.decided_by.as_deref().unwrap_or("a reviewer"),
                self.decision_reason
                    .as_deref()
                    .filter(|r| !r.is_empty())
                    .unwrap_or("no reason given")
            )),
            ApprovalState::Expired => Some(match self.decision_reason.as_deref() {
                Some(r) if r != TIMED_OUT => format!("approval expired: {r}"),
                _ => format!("approval expired after {timeout_s} s"),
            }),
        }
    }
}

/// The `decision_reason` of a request nobody decided in time.
pub const TIMED_OUT: &str = "timed out";

/// A request to store.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NewApproval {
    /// The unit.
    pub delegation_id: String,
    /// The child.
    pub subagent_id: String,
    /// The tool.
    pub tool: String,
    /// Its arguments, secrets already redacted.
    pub arguments: Value,
    /// Why it needs approval.
    pub reason: String,
}

/// A decision to record.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// `Approved`, `Denied` or `Expired` (`Pending` is refused).
    pub state: ApprovalState,
    /// `always` adds a standing rule (approvals only).
    pub scope: ApprovalScope,
    /// Who decides.
    pub decided_by: String,
    /// Why (bounded to [`REASON_MAX_CHARS`] when stored).
    pub reason: Option<String>,
}

impl Decision {
    /// An approval by `by`.
    pub fn approve(by: impl Into<String>, scope: ApprovalScope) -> Decision {
        Decision { state: ApprovalState::Approved, scope, decided_by: by.into(), reason: None }
    }

    /// A denial by `by`.
    pub fn deny(by: impl Into<String>, reason: Option<String>) -> Decision {
        Decision {
            state: ApprovalState::Denied,
            scope: ApprovalScope::Once,
            decided_by: by.into(),
            reason,
        }
    }

    /// The expiry of an unanswered request (`why`: [`TIMED_OUT`], `worker
    /// gone`, the unit's end).
    pub fn expire(why: &str) -> Decision {
        Decision {
            state: ApprovalState::Expired,
            scope: ApprovalScope::Once,
            decided_by: EXPIRED_BY.to_owned(),
            reason: Some(why.to_owned()),
        }
    }

    /// Refuses a "decision" that leaves the request pending.
    pub fn check(&self) -> Result<()> {
        if self.state == ApprovalState::Pending {
            return Err(crate::Error::Invalid("a decision approves, denies or expires".to_owned()));
        }
        Ok(())
    }

    /// The scope as stored: `always` only on an approval.
    pub fn stored_scope(&self) -> ApprovalScope {
        if self.state == ApprovalState::Approved { self.scope } else { ApprovalScope::Once }
    }

    /// The decider as stored: trimmed, at most 200 characters.
    pub fn stored_by(&self) -> String {
        truncate_chars(self.decided_by.trim(), 200)
    }

    /// The reason as stored: trimmed, bounded, `None` when blank.
    pub fn stored_reason(&self) -> Option<String> {
        self.reason
            .as_deref()
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(|r| truncate_chars(r, REASON_MAX_CHARS))
    }
}

/// What became of a decision.
#[derive(Debug, Clone, PartialEq)]
pub enum DecideOutcome {
    /// Recorded: the request as it is now.
    Decided(ApprovalRequest),
    /// Someone decided first (or it expired): the request as it stands.
    AlreadyDecided(ApprovalRequest),
    /// No such request inside the decider's scope.
    Missing,
}

/// What becomes of a new request.
#[derive(Debug, Clone, PartialEq)]
pub enum Requested {
    /// Stored, pending.
    Pending(ApprovalRequest),
    /// A standing `always` approval of the child covers the call: it runs.
    Covered(ApprovalRequest),
    /// The unit already holds [`MAX_PENDING_PER_UNIT`] pending requests.
    TooMany,
    /// The unit has ended (or never existed): nothing can wait for it.
    UnitEnded,
}

/// Which requests a listing returns.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ApprovalFilter {
    /// Whose (the decider's scope: another tenant's rows are absent).
    pub profile: Option<String>,
    /// Pending ones only (`false`: decided ones too).
    pub pending_only: bool,
    /// One unit's only.
    pub delegation_id: Option<String>,
    /// One child's only.
    pub subagent_id: Option<String>,
    /// The newest this many (0: no bound).
    pub limit: usize,
}

impl ApprovalFilter {
    /// Pending requests inside `scope`.
    pub fn pending(scope: &Scope) -> ApprovalFilter {
        ApprovalFilter {
            profile: scope.filter().map(str::to_owned),
            pending_only: true,
            ..ApprovalFilter::default()
        }
    }
}

/// A human at the orchestrator's own terminal (`retinue delegate` with
/// stdin a TTY): asked about each request while it waits, alongside every
/// other surface.
pub trait ApprovalPrompter: Send + Sync {
    /// Called on each poll while `request` waits; the human's decision once
    /// given (`None`: not yet).
    fn poll(&self, request: &ApprovalRequest) -> Option<Decision>;
    /// `request` was decided (by anyone) or expired: stop asking about it.
    fn settled(&self, request: &ApprovalRequest);
}

/// A fresh approval id.
pub fn new_approval_id() -> Result<String> {
    Ok(format!("appr_{}", random_hex(6)?))
}

/// The approval queue of a backend. Every method is one statement or one
/// transaction; the state machine is enforced by the statement (`WHERE
/// state = 'pending'`), never by a read before a write.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait ApprovalQueue: Send + Sync {
    /// Stores `new` as pending — unless an `always` approval of the same
    /// child covers it ([`Requested::Covered`], nothing stored) or the unit
    /// holds [`MAX_PENDING_PER_UNIT`] pending ones ([`Requested::TooMany`]).
    fn request_approval(&self, new: &NewApproval) -> Result<Requested>;
    /// The request `id`, when it is inside `scope`.
    fn approval(&self, id: &str, scope: &Scope) -> Result<Option<ApprovalRequest>>;
    /// Requests matching `filter`, newest first.
    fn list_approvals(&self, filter: &ApprovalFilter) -> Result<Vec<ApprovalRequest>>;
    /// Records `decision` on the pending request `id` inside `scope`:
    /// exactly one decision wins.
    fn decide_approval(
        &self,
        id: &str,
        scope: &Scope,
        decision: &Decision,
    ) -> Result<DecideOutcome>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn approved_always(tool: &str, arguments: Value) -> ApprovalRequest {
        ApprovalRequest {
            approval_id: "appr_1".into(),
            delegation_id: "deleg_1".into(),
            subagent_id: "sa-0-1".into(),
            tool: tool.into(),
            arguments,
            reason: "r".into(),
            state: ApprovalState::Approved,
            scope: ApprovalScope::Always,
            requested_at: 0.0,
            decided_at: Some(1.0),
            decided_by: Some("operator".into()),
            decision_reason: None,
            owner_profile: None,
            parent_session_id: None,
        }
    }

    #[test]
    fn always_covers_the_same_command_only() {
        let r = approved_always("terminal", json!({"command": "rm -rf build"}));
        assert!(r.covers("terminal", &json!({"command": " rm -rf build "})));
        assert!(!r.covers("terminal", &json!({"command": "rm -rf /"})));
        assert!(!r.covers("write_file", &json!({"command": "rm -rf build"})));
        let once = ApprovalRequest { scope: ApprovalScope::Once, ..r.clone() };
        assert!(!once.covers("terminal", &json!({"command": "rm -rf build"})));
        let mcp = approved_always("mcp__gh__delete_repo", json!({"repo": "a"}));
        assert!(mcp.covers("mcp__gh__delete_repo", &json!({"repo": "b"})));
        let no_command = approved_always("terminal", json!({}));
        assert!(!no_command.covers("terminal", &json!({})));
        let secret = approved_always("terminal", json!({"command": "T=[redacted] npm publish"}));
        assert!(!secret.covers("terminal", &json!({"command": "T=[redacted] npm publish"})));
        let here = approved_always("terminal", json!({"command": "rm -rf b", "workdir": "x"}));
        assert!(!here.covers("terminal", &json!({"command": "rm -rf b", "workdir": "/"})));
    }

    #[test]
    fn the_model_reads_who_denied_and_why_or_how_long_it_waited() {
        let mut r = approved_always("terminal", json!({}));
        assert_eq!(r.refusal_text(600), None);
        r.state = ApprovalState::Denied;
        r.decision_reason = Some("not today".into());
        assert_eq!(r.refusal_text(600).as_deref(), Some("denied by operator: not today"));
        r.state = ApprovalState::Expired;
        r.decision_reason = Some(TIMED_OUT.into());
        assert_eq!(r.refusal_text(2).as_deref(), Some("approval expired after 2 s"));
        r.decision_reason = Some("worker gone".into());
        assert_eq!(r.refusal_text(2).as_deref(), Some("approval expired: worker gone"));
    }

    #[test]
    fn a_stored_reason_is_bounded_and_blank_is_none() {
        let huge = Decision::deny("operator", Some("x".repeat(1 << 20)));
        assert_eq!(huge.stored_reason().map(|r| r.chars().count()), Some(REASON_MAX_CHARS));
        assert_eq!(Decision::deny("operator", Some("  ".into())).stored_reason(), None);
        assert_eq!(ApprovalState::parse("approved"), Some(ApprovalState::Approved));
        assert_eq!(ApprovalState::parse("maybe"), None);
    }
}
