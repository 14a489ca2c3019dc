//! Nested delegation: the [`Delegate`] capability each run carries in its
//! [`retinue_core::run::RunContext`], so an orchestrator child's
//! `delegate_task` calls reach this delegator without any runtime or
//! toolbox holding a reference back to it.

use std::sync::Arc;

use retinue_core::run::toolsets::DELEGATION;
use retinue_core::run::{CancelToken, ChildHandle, Delegate, RunContext};
use serde_json::Value;

use crate::{DelegateRequest, Delegator, Inner, ParentContext, error_json};

/// The context of one child run under `cancel`: for an orchestrator child
/// (one granted the `delegation` toolset) this delegator is the capability
/// its `delegate_task` calls go through; any other child gets none.
pub(crate) fn run_context(
    inner: &Arc<Inner>,
    child: &ChildHandle,
    cancel: &CancelToken,
) -> RunContext {
    let gate = crate::approvals::Gate { inner: Arc::clone(inner) };
    let ctx = RunContext::new(cancel.clone()).with_approvals(Arc::new(gate));
    if !child.toolsets.iter().any(|t| t == DELEGATION) {
        return ctx;
    }
    ctx.with_delegate(Arc::new(Nested(Delegator { inner: Arc::clone(inner) })))
}

/// The capability handed to a run: the delegator that runs the child.
pub(crate) struct Nested(pub(crate) Delegator);

impl Delegate for Nested {
    fn schema(&self) -> Value {
        let mut schema = self.0.schema();
        if let Some(p) = schema
            .get_mut("parameters")
            .and_then(|p| p.get_mut("properties"))
            .and_then(Value::as_object_mut)
        {
            // A grandchild's result comes back to this child now.
            p.remove("background");
        }
        schema
    }

    /// `delegate_task` for an orchestrator child: the grandchildren run
    /// under the child's own `cancel` (its deadline, budget meter and stop).
    fn delegate_task(
        &self,
        child: &ChildHandle,
        arguments: &Value,
        cancel: &CancelToken,
    ) -> String {
        let parent = ParentContext {
            session_id: Some(child.session_id.clone()),
            depth: child.depth,
            // The child's own toolsets, `delegation` included: a grandchild
            // gets at most these (never the operator's whole grant, even
            // when the child has nothing but `delegation`).
            toolsets: child.toolsets.clone(),
            workspace: child.workspace.clone(),
            can_receive_detached: false,
            ..ParentContext::default()
        };
        let result = match DelegateRequest::from_json(arguments) {
            Ok(request) => match self.0.delegate(&request, &parent, cancel) {
                Ok(outcome) => outcome.to_json(),
                Err(e) => error_json(&e),
            },
            Err(e) => error_json(&e),
        };
        crate::results::model_text(&result)
    }
}
