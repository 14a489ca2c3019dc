//! The `delegate_task` tool schema (semantics §6.1), with live limits in its texts.

use retinue_config::OrchestratorPolicy;
use serde_json::{Value, json};

/// The tool's JSON schema.
pub fn delegate_task_schema(config: &OrchestratorPolicy) -> Value {
    let follow_up = format!(
        "Pass a subagent_id or child session id from an earlier result, with `goal` as the \
         message. A running child is steered (queued); a completed retained child resumes with \
         it as its next turn and returns a new summary. No depth or concurrency budget is used, \
         and tasks/role/background/toolsets are ignored (a resumed child keeps its own toolsets). Retained children stay addressable for {} hours \
         (the {} most recent delegations).",
        config.retained_ttl_hours, config.max_retained
    );
    json!({
        "name": "delegate_task",
        "description": format!(
            "Delegate work to subagents that run on their own sessions. Up to {} tasks run in \
             parallel; nesting is limited to depth {}.",
            config.max_concurrent_children, config.max_spawn_depth
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "goal": {"type": "string", "description": "The task for a single subagent (or the follow-up message)."},
                "context": {"type": "string", "description": "Background the subagent needs."},
                "tasks": {
                    "type": "array",
                    "description": "A batch of tasks run in parallel.",
                    "items": {
                        "type": "object",
                        "properties": {
                            "goal": {"type": "string"},
                            "context": {"type": "string"},
                            "role": {"type": "string", "enum": ["leaf", "orchestrator"]},
                            "isolation": {"type": "string", "enum": ["none", "worktree"]}
                        },
                        "required": ["goal"]
                    }
                },
                "role": {"type": "string", "enum": ["leaf", "orchestrator"], "description": "leaf (default) or orchestrator (may delegate further)."},
                "background": {"type": "boolean", "description": "Return at once; results are delivered when the children finish."},
                "toolsets": {"type": "array", "items": {"type": "string"}, "description": "Narrow the children's toolsets (read, file, terminal, mcp-<server>); a call can only narrow what delegation.toolsets grants."},
                "isolation": {"type": "string", "enum": ["none", "worktree"], "description": format!("worktree: each child works in its own git worktree and its edits come back as a change set the parent reviews and applies (retinue changes/apply/discard); none: the children share the workspace. Default: {}.", config.isolation.as_str())},
                "follow_up": {"type": "string", "description": follow_up}
            },
            "required": []
        }
    })
}
