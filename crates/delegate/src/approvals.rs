//! The approval gate handed to each child run (issue #37): a call the
//! toolbox says needs approval becomes a pending request of the child's
//! unit (`retinue_approvals`), announced, and the child's thread waits for
//! the decision — from any surface: `retinue approve`, the MCP host, the
//! web view, the inline prompt. While it waits no model call is in flight
//! and no budget is held, and the run's deadline is paused
//! ([`CancelToken::pause`]); `delegation.approvals.timeout_s` bounds the
//! wait on the monotonic clock (a wall-clock jump changes nothing). A
//! cancelled run expires its request.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use opentelemetry::trace::TraceContextExt;
use opentelemetry::{Context, KeyValue};
use retinue_core::run::{ApprovalGate, CancelToken, ChildHandle, GateAnswer, GatedCall};
use retinue_core::{
    ApprovalPrompter, ApprovalRequest, ApprovalState, CONTROL_POLL_MS, DecideOutcome, Decision,
    NewApproval, Requested, Scope, TIMED_OUT,
};

use crate::{Inner, texts};

/// The gate of one run.
pub(crate) struct Gate {
    pub(crate) inner: Arc<Inner>,
}

/// An embedder's inline prompter (set once per delegator).
pub(crate) type PrompterSlot = OnceLock<Arc<dyn ApprovalPrompter>>;

/// How often a waiting child looks at its request.
const POLL: Duration = Duration::from_millis(CONTROL_POLL_MS);

fn event(name: &'static str, request: &ApprovalRequest) {
    let cx = Context::current();
    let span = cx.span();
    let mut attrs = vec![
        KeyValue::new("retinue.approval.id", request.approval_id.clone()),
        KeyValue::new("retinue.approval.state", request.state.as_str()),
        KeyValue::new("gen_ai.tool.name", request.tool.clone()),
    ];
    if let Some(by) = &request.decided_by {
        attrs.push(KeyValue::new("retinue.approval.decided_by", by.clone()));
    }
    span.add_event(name, attrs);
}

/// The answer a decided request gives the call.
fn answer(request: &ApprovalRequest, timeout_s: u64) -> GateAnswer {
    match request.refusal_text(timeout_s) {
        None => GateAnswer::Run(format!(
            "approved by {} ({})",
            request.decided_by.as_deref().unwrap_or("a reviewer"),
            request.approval_id
        )),
        Some(text) => GateAnswer::Refuse(text),
    }
}

impl Gate {
    /// Records `decision` and answers with the request as it then stands
    /// (someone else's decision when they were first).
    fn settle(&self, id: &str, decision: &Decision, fallback: &ApprovalRequest) -> ApprovalRequest {
        match self.inner.parts.backend.approvals.decide_approval(id, &Scope::Operator, decision) {
            Ok(DecideOutcome::Decided(r) | DecideOutcome::AlreadyDecided(r)) => r,
            // An unrecorded decision never runs the call (fail closed).
            Ok(DecideOutcome::Missing) | Err(_) => ApprovalRequest {
                state: ApprovalState::Expired,
                decided_by: Some(retinue_core::EXPIRED_BY.to_owned()),
                decision_reason: Some("the decision could not be recorded".to_owned()),
                ..fallback.clone()
            },
        }
    }

    fn wait(&self, request: &ApprovalRequest, cancel: &CancelToken) -> ApprovalRequest {
        let parts = &self.inner.parts;
        let timeout = Duration::from_secs(parts.config.approval_timeout_s);
        let prompter = self.inner.prompter.get();
        let started = Instant::now();
        let _paused = cancel.pause();
        let id = &request.approval_id;
        let decided = loop {
            if let Some(decision) = prompter.and_then(|p| p.poll(request)) {
                break self.settle(id, &decision, request);
            }
            match parts.backend.approvals.approval(id, &Scope::Operator) {
                Ok(Some(r)) if r.state != ApprovalState::Pending => break r,
                Ok(Some(_)) => {}
                // Its unit was deleted under it: nobody can decide now.
                Ok(None) => break self.settle(id, &Decision::expire("the unit is gone"), request),
                Err(e) => log::warn!("could not read approval {id}: {e}"),
            }
            if cancel.is_cancelled() {
                break self.settle(id, &Decision::expire("the run was stopped"), request);
            }
            if started.elapsed() >= timeout {
                break self.settle(id, &Decision::expire(TIMED_OUT), request);
            }
            let left = timeout.saturating_sub(started.elapsed());
            cancel.sleep(POLL.min(left).max(Duration::from_millis(1)));
        };
        if let Some(p) = prompter {
            p.settled(&decided);
        }
        decided
    }
}

impl ApprovalGate for Gate {
    fn ask(&self, child: &ChildHandle, call: &GatedCall, cancel: &CancelToken) -> GateAnswer {
        let backend = &self.inner.parts.backend;
        let timeout_s = self.inner.parts.config.approval_timeout_s;
        let unit = match backend.controls.unit_view(&child.subagent_id) {
            Ok(Some(u)) => u,
            Ok(None) => return GateAnswer::Refuse(texts::APPROVAL_NO_UNIT.to_owned()),
            Err(e) => return GateAnswer::Refuse(texts::approval_unrecorded(&e.to_string())),
        };
        let new = NewApproval {
            delegation_id: unit.delegation_id,
            subagent_id: child.subagent_id.clone(),
            tool: call.tool.clone(),
            arguments: call.arguments.clone(),
            reason: call.reason.clone(),
        };
        let request = match backend.approvals.request_approval(&new) {
            Ok(Requested::Pending(r)) => r,
            Ok(Requested::Covered(r)) => {
                event("retinue.approval.covered", &r);
                return GateAnswer::Run(format!(
                    "approved always by {} ({})",
                    r.decided_by.as_deref().unwrap_or("a reviewer"),
                    r.approval_id
                ));
            }
            Ok(Requested::TooMany) => {
                return GateAnswer::Refuse(texts::TOO_MANY_APPROVALS.to_owned());
            }
            Ok(Requested::UnitEnded) => {
                return GateAnswer::Refuse(texts::APPROVAL_NO_UNIT.to_owned());
            }
            Err(e) => return GateAnswer::Refuse(texts::approval_unrecorded(&e.to_string())),
        };
        event("retinue.approval.requested", &request);
        log::warn!(
            "{} of {} needs approval ({}): `retinue approve {id}` or `retinue deny {id}`",
            request.tool,
            request.subagent_id,
            request.reason,
            id = request.approval_id
        );
        let decided = self.wait(&request, cancel);
        event("retinue.approval.decided", &decided);
        answer(&decided, timeout_s)
    }
}
