//! Approvals over MCP (issue #37). A request of one of this server's
//! subagents is put to the host's user with `elicitation/create` (a form:
//! approve yes/no, always, reason) when the host declared the
//! `elicitation` capability; otherwise it is announced once
//! (`notifications/message`), attached to every tool result while it waits
//! (`approval_required`), and decided with the `decide_approval` tool. The
//! request stays in the registry's queue meanwhile, so the CLI or the web
//! view may decide it first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use retinue_core::{ApprovalPrompter, ApprovalRequest, ApprovalScope, Decision};
use retinue_delegate::{Collector, ParentContext};
use rmcp::model::{ElicitRequestParams, ElicitationAction, ElicitationSchema};
#[expect(deprecated)] // logging: see `RetinueServer::announce_when_done`
use rmcp::model::{LoggingLevel, LoggingMessageNotificationParam};
use rmcp::service::ElicitationMode;
use rmcp::{Peer, RoleServer};
use serde_json::{Value, json};

/// How long the host's user has to answer a form (the request's own
/// `timeout_s` still bounds the child's wait).
const ASK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);

#[derive(Debug, Clone)]
enum Asked {
    /// The form is out.
    Waiting,
    /// The user answered.
    Answered(Decision),
    /// Announced only (no elicitation), or the user dismissed the form: the
    /// request waits for another surface.
    Elsewhere,
}

/// The MCP server's [`ApprovalPrompter`]: asks the host of the latest call.
#[derive(Default)]
pub(crate) struct McpPrompter {
    /// The latest call's host, and the runtime its protocol task runs on.
    peer: Mutex<Option<(Peer<RoleServer>, tokio::runtime::Handle)>>,
    asked: Arc<Mutex<HashMap<String, Asked>>>,
}

impl McpPrompter {
    /// The host to ask from now on (the latest call's); called on the
    /// server's runtime.
    pub(crate) fn set_peer(&self, peer: Peer<RoleServer>) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            *self.peer.lock().unwrap_or_else(PoisonError::into_inner) = Some((peer, runtime));
        }
    }
}

/// The form a host shows.
fn form() -> Option<ElicitationSchema> {
    ElicitationSchema::builder()
        .required_bool_property("approve", |b| {
            b.title("Approve this call?").description("Yes runs it; no refuses it.")
        })
        .bool_property("always", |b| {
            b.title("Always")
                .description("Also approve the same call of this subagent from now on.")
        })
        .optional_string("reason")
        .build()
        .ok()
}

/// What the host's user sees.
fn message(r: &ApprovalRequest) -> String {
    let call = r.call_text();
    format!(
        "Subagent {} wants to run {}: {}\nWhy it needs approval: {}\n(approval {})",
        r.subagent_id, r.tool, call, r.reason, r.approval_id
    )
}

/// The decision an accepted form gives (`None`: no usable answer).
pub(crate) fn decision_of(content: Option<&Value>, by: &str) -> Option<Decision> {
    let content = content?;
    let approve = content.get("approve").and_then(Value::as_bool)?;
    let reason = content
        .get("reason")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .filter(|r| !r.trim().is_empty());
    Some(if approve {
        let always = content.get("always").and_then(Value::as_bool).unwrap_or(false);
        Decision::approve(by, if always { ApprovalScope::Always } else { ApprovalScope::Once })
    } else {
        Decision::deny(by, reason)
    })
}

impl ApprovalPrompter for McpPrompter {
    fn poll(&self, request: &ApprovalRequest) -> Option<Decision> {
        let mut asked = self.asked.lock().unwrap_or_else(PoisonError::into_inner);
        match asked.get(&request.approval_id) {
            Some(Asked::Answered(d)) => return Some(d.clone()),
            Some(_) => return None,
            None => {}
        }
        let peer = self.peer.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let Some((peer, runtime)) = peer else {
            asked.insert(request.approval_id.clone(), Asked::Elsewhere);
            return None;
        };
        let id = request.approval_id.clone();
        let text = message(request);
        let elicits = peer.supported_elicitation_modes().contains(&ElicitationMode::Form);
        match form().filter(|_| elicits) {
            Some(schema) => {
                asked.insert(id.clone(), Asked::Waiting);
                let slot = Arc::clone(&self.asked);
                let by = format!(
                    "mcp:{}",
                    peer.peer_info().map_or("host".to_owned(), |i| i.client_info.name.clone())
                );
                runtime.spawn(async move {
                    let params = ElicitRequestParams::FormElicitationParams {
                        meta: None,
                        message: text,
                        requested_schema: schema,
                    };
                    let answer =
                        peer.create_elicitation_with_timeout(params, Some(ASK_TIMEOUT)).await;
                    let next = match answer {
                        Ok(r) if r.action == ElicitationAction::Accept => {
                            decision_of(r.content.as_ref(), &by)
                                .map_or(Asked::Elsewhere, Asked::Answered)
                        }
                        Ok(r) if r.action == ElicitationAction::Decline => Asked::Answered(
                            Decision::deny(by, Some("declined by the host's user".to_owned())),
                        ),
                        Ok(_) => Asked::Elsewhere,
                        Err(e) => {
                            log::warn!("elicitation for approval {id} failed: {e}");
                            Asked::Elsewhere
                        }
                    };
                    let mut asked = slot.lock().unwrap_or_else(PoisonError::into_inner);
                    if asked.contains_key(&id) {
                        asked.insert(id, next);
                    }
                });
            }
            None => {
                asked.insert(id, Asked::Elsewhere);
                let data = json!({
                    "approval_required": retinue_delegate::approval_json(request),
                    "message": format!("{text}\nDecide with decide_approval."),
                });
                #[expect(deprecated)] // logging: see `RetinueServer::announce_when_done`
                let note = {
                    let mut note =
                        LoggingMessageNotificationParam::new(LoggingLevel::Warning, data);
                    note.logger = Some("retinue".to_owned());
                    note
                };
                runtime.spawn(async move {
                    #[expect(deprecated)]
                    let sent = peer.notify_logging_message(note).await;
                    if let Err(e) = sent {
                        log::warn!("could not announce an approval request: {e}");
                    }
                });
            }
        }
        None
    }

    fn settled(&self, request: &ApprovalRequest) {
        self.asked.lock().unwrap_or_else(PoisonError::into_inner).remove(&request.approval_id);
    }
}

/// The approval requests of `parent`'s subagents that wait (on tokio's
/// blocking pool).
pub(crate) async fn pending(collector: &Collector, parent: ParentContext) -> Vec<Value> {
    let collector = collector.clone();
    tokio::task::spawn_blocking(move || {
        crate::tasks::pending_approvals(&collector, &parent).unwrap_or_default()
    })
    .await
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use retinue_core::ApprovalState;

    #[test]
    fn a_form_answer_becomes_a_decision() {
        let yes =
            decision_of(Some(&json!({"approve": true, "always": true})), "mcp:x").expect("yes");
        assert_eq!((yes.state, yes.scope), (ApprovalState::Approved, ApprovalScope::Always));
        let no =
            decision_of(Some(&json!({"approve": false, "reason": "no"})), "mcp:x").expect("no");
        assert_eq!((no.state, no.reason.as_deref()), (ApprovalState::Denied, Some("no")));
        assert!(decision_of(Some(&json!({"always": true})), "mcp:x").is_none());
        assert!(decision_of(None, "mcp:x").is_none());
        assert!(form().is_some(), "the form builds");
    }
}
