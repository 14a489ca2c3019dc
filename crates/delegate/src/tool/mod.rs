//! The `delegate_task` JSON tool over the orchestration core: its schema,
//! its arguments parsed into a [`DelegateRequest`] (in hermes's check order,
//! with hermes's texts), the [`DelegateOutcome`](crate::DelegateOutcome) rendered as its result, and
//! `{"error": …}` for a refusal. Nothing here decides anything: every rule
//! is [`Delegator::delegate`]'s.

mod args;
mod render;
mod schema;

use serde_json::{Value, json};

pub use args::{parse_follow_up, parse_tasks};
pub use schema::delegate_task_schema;

use crate::{CancelToken, DelegateError, DelegateRequest, Delegator, ParentContext};

/// The tool's JSON form of an error: `{"error": TEXT}`.
pub fn error_json(e: &DelegateError) -> Value {
    json!({ "error": e.to_string() })
}

impl Delegator {
    /// The tool schema with this delegator's limits.
    pub fn schema(&self) -> Value {
        delegate_task_schema(self.config())
    }

    /// The tool entry point (semantics §6.2): JSON arguments in, JSON result out
    /// (`{"error": …}` on failure).
    pub fn delegate_task(&self, args: &Value, parent: Option<&ParentContext>) -> Value {
        let Some(parent) = parent else { return error_json(&DelegateError::NoParent) };
        match DelegateRequest::from_json(args) {
            Ok(request) => match self.delegate(&request, parent, &CancelToken::new()) {
                Ok(outcome) => outcome.to_json(),
                Err(e) => error_json(&e),
            },
            Err(e) => {
                // A spawn that would be refused anyway reports the refusal
                // first, whatever is wrong with its tasks.
                let is_spawn = parse_follow_up(args).is_none();
                let first = if is_spawn { self.spawn_refusal(parent) } else { None };
                error_json(&first.unwrap_or(e))
            }
        }
    }
}
