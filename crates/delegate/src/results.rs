//! Result entries (spec §6.5) and the transcript sink over the session store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use retinue_store::{Message, SessionStore};
use retinue_usage::{ChildUsage, Tokens};
use serde_json::{Map, Value, json};

use crate::runtime::{ChildOutcome, TranscriptSink};

/// One child's result.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct ChildResult {
    pub(crate) task_index: usize,
    pub(crate) status: String,
    pub(crate) summary: Option<String>,
    pub(crate) api_calls: u64,
    pub(crate) duration_seconds: f64,
    pub(crate) model: Option<String>,
    pub(crate) exit_reason: String,
    pub(crate) child_session_id: String,
    pub(crate) subagent_id: String,
    pub(crate) tokens: Tokens,
    pub(crate) cost_usd: f64,
    pub(crate) error: Option<String>,
    pub(crate) summary_truncated: bool,
    pub(crate) missed_steer: Vec<String>,
}

/// Spec §6.5's status rule.
pub(crate) fn status_of(outcome: &ChildOutcome) -> &'static str {
    let response = outcome.final_response.as_deref().map(str::trim).unwrap_or_default();
    if outcome.interrupted || outcome.exit_reason == "interrupted" {
        "interrupted"
    } else if outcome.exit_reason == "timeout" {
        "timeout"
    } else if !response.is_empty() && response != "(empty)" && outcome.error.is_none() {
        "completed"
    } else if outcome.exit_reason == "error" || outcome.error.is_some() {
        "error"
    } else {
        "failed"
    }
}

impl ChildResult {
    pub(crate) fn usage(&self) -> ChildUsage {
        ChildUsage {
            cost_usd: self.cost_usd,
            tokens: Some(self.tokens),
            api_calls: self.api_calls,
            status: self.status.clone(),
        }
    }

    pub(crate) fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("task_index".into(), json!(self.task_index));
        m.insert("status".into(), json!(self.status));
        m.insert("summary".into(), json!(self.summary));
        m.insert("api_calls".into(), json!(self.api_calls));
        m.insert("duration_seconds".into(), json!((self.duration_seconds * 100.0).round() / 100.0));
        m.insert("model".into(), json!(self.model));
        m.insert("exit_reason".into(), json!(self.exit_reason));
        m.insert("child_session_id".into(), json!(self.child_session_id));
        m.insert("subagent_id".into(), json!(self.subagent_id));
        m.insert(
            "tokens".into(),
            json!({"input": self.tokens.input, "output": self.tokens.output}),
        );
        if let Some(e) = &self.error {
            m.insert("error".into(), json!(e));
        }
        if self.summary_truncated {
            m.insert("summary_truncated".into(), json!(true));
        }
        if !self.missed_steer.is_empty() {
            m.insert("missed_steer".into(), json!(self.missed_steer));
        }
        Value::Object(m)
    }
}

/// Appends a running child's messages to its session, until it is closed
/// (a timed-out child's thread may outlive its run: it must not keep writing
/// to a transcript the next follow-up may already be resuming).
pub(crate) struct SessionSink {
    pub(crate) sessions: Arc<dyn SessionStore>,
    pub(crate) session_id: String,
    pub(crate) closed: Arc<AtomicBool>,
}

impl TranscriptSink for SessionSink {
    fn append(&self, message: &Message) -> Result<(), String> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(format!("transcript of {} is closed (the run timed out)", self.session_id));
        }
        self.sessions
            .append_message(&self.session_id, message)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}
