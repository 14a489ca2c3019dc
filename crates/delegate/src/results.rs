//! Result entries (semantics §6.5) and the transcript sink over the session store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use retinue_core::{ChildStatus, ExitReason, Message, Receipts, SessionStore};
use retinue_usage::{ChildUsage, Tokens};
use serde_json::{Map, Value, json};

use retinue_core::run::{ChildOutcome, SinkError, TranscriptSink};

/// One child's result: an entry of the tool's `results` array.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct ChildReport {
    /// Task index in its unit.
    pub task_index: usize,
    /// The child's status (semantics §6.5).
    pub status: ChildStatus,
    /// The final answer, clipped to `max_summary_chars`.
    pub summary: Option<String>,
    /// Model API calls.
    pub api_calls: u64,
    /// Wall time of the run.
    pub duration_seconds: f64,
    /// The child's model.
    pub model: Option<String>,
    /// Why the run stopped.
    pub exit_reason: ExitReason,
    /// The session the child wrote to.
    pub child_session_id: String,
    /// The subagent id.
    pub subagent_id: String,
    /// Prompt and completion tokens.
    pub tokens: Tokens,
    /// Cost in US dollars (finite, never negative).
    pub cost_usd: f64,
    /// Error text, if the run failed.
    pub error: Option<String>,
    /// Whether `summary` was clipped.
    pub summary_truncated: bool,
    /// Steering messages accepted but never folded in.
    pub missed_steer: Vec<String>,
    /// The endpoint the run called (redacted), when the runtime reports it.
    pub endpoint: Option<String>,
    /// The toolsets the child had.
    pub toolsets: Vec<String>,
    /// Toolsets asked for but not given, and why.
    pub toolsets_dropped: Vec<crate::toolsets::DroppedToolset>,
    /// What the run did, read from its transcript (`None`: it never ran).
    pub receipts: Option<Receipts>,
    /// An isolated child's change set after the run.
    pub changes: Option<retinue_core::run::ChangeSet>,
    /// Why an isolated child's change set could not be recorded.
    pub changes_error: Option<String>,
}

/// A change set as every surface shows it (with `diffstat`).
pub fn change_set_json(set: &retinue_core::run::ChangeSet) -> Value {
    let mut v = json!(set);
    v["diffstat"] = json!(set.diffstat());
    v
}

/// Receipts as every surface writes them: the counts, lists and the line
/// a parent model reads.
pub fn receipts_json(r: &Receipts) -> Value {
    let mut v = json!(r);
    v["line"] = json!(r.line());
    v
}

/// Every child result's receipts line in `value` (a `delegate_task`
/// result, a follow-up's, a wait's entries), prefixed with the child's id
/// when there are several.
pub fn receipt_lines(value: &Value) -> Vec<String> {
    fn walk(v: &Value, depth: usize, out: &mut Vec<(String, String)>) {
        if depth > 4 {
            return;
        }
        match v {
            Value::Object(m) => {
                if let Some(line) =
                    m.get("receipts").and_then(|r| r.get("line")).and_then(Value::as_str)
                {
                    let id = m.get("subagent_id").and_then(Value::as_str).unwrap_or_default();
                    out.push((id.to_owned(), line.to_owned()));
                    return;
                }
                m.values().for_each(|x| walk(x, depth + 1, out));
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, depth + 1, out)),
            _ => {}
        }
    }
    let mut found = Vec::new();
    walk(value, 0, &mut found);
    let several = found.len() > 1;
    found
        .into_iter()
        .map(|(id, line)| if several && !id.is_empty() { format!("{id}: {line}") } else { line })
        .collect()
}

/// The text a parent *model* reads for a `delegate_task` result: the JSON,
/// then one receipts line per child, so a performed action is told from a
/// reported one.
pub fn model_text(result: &Value) -> String {
    let mut text = result.to_string();
    for line in receipt_lines(result) {
        text.push('\n');
        text.push_str(&line);
    }
    text
}

/// What a finished run did: the receipts of the messages its session got
/// after `after_id` (a follow-up's history is not its own), with the run's
/// tokens and duration; `None` when the transcript cannot be read.
pub(crate) fn receipts_of_run(
    sessions: &dyn SessionStore,
    report: &ChildReport,
    after_id: i64,
) -> Option<Receipts> {
    let session = &report.child_session_id;
    match sessions.conversation(session) {
        Ok(messages) => {
            let ran: Vec<Message> = messages.into_iter().filter(|m| m.id > after_id).collect();
            let (tokens, secs) = (report.tokens, report.duration_seconds);
            Some(Receipts::of(&ran).with_run(tokens.input, tokens.output, secs))
        }
        Err(e) => {
            log::warn!("could not read {session}'s transcript for its receipts: {e}");
            None
        }
    }
}

/// A duration in seconds as the wire writes it (two decimals).
pub(crate) fn seconds(s: f64) -> Value {
    json!((s * 100.0).round() / 100.0)
}

/// Spec §6.5's status rule.
pub(crate) fn status_of(outcome: &ChildOutcome) -> ChildStatus {
    let response = outcome.final_response.as_deref().map(str::trim).unwrap_or_default();
    match &outcome.exit_reason {
        ExitReason::Interrupted | ExitReason::Cancelled => ChildStatus::Interrupted,
        ExitReason::Timeout => ChildStatus::Timeout,
        reason => {
            if !response.is_empty() && response != "(empty)" && outcome.error.is_none() {
                ChildStatus::Completed
            } else if *reason == ExitReason::Error || outcome.error.is_some() {
                ChildStatus::Error
            } else {
                ChildStatus::Failed
            }
        }
    }
}

impl ChildReport {
    /// The ledger's view of this run.
    pub fn usage(&self) -> ChildUsage {
        ChildUsage {
            cost_usd: self.cost_usd,
            tokens: Some(self.tokens),
            api_calls: self.api_calls,
            status: self.status.as_str().to_owned(),
        }
    }

    /// The wire entry (semantics §6.5).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("task_index".into(), json!(self.task_index));
        m.insert("status".into(), json!(self.status));
        m.insert("summary".into(), json!(self.summary));
        m.insert("api_calls".into(), json!(self.api_calls));
        m.insert("duration_seconds".into(), seconds(self.duration_seconds));
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
        if let Some(e) = &self.endpoint {
            m.insert("endpoint".into(), json!(e));
        }
        if !self.toolsets.is_empty() {
            m.insert("toolsets".into(), json!(self.toolsets));
        }
        if !self.toolsets_dropped.is_empty() {
            m.insert("toolsets_dropped".into(), json!(self.toolsets_dropped));
        }
        if let Some(r) = &self.receipts {
            m.insert("receipts".into(), receipts_json(r));
        }
        if let Some(c) = &self.changes {
            m.insert("changes".into(), change_set_json(c));
        }
        if let Some(e) = &self.changes_error {
            m.insert("changes_error".into(), json!(e));
        }
        Value::Object(m)
    }
}

/// Appends a running child's messages to its session, until it is closed
/// (a stopped child's thread may outlive its run: it must not keep writing
/// to a transcript the next follow-up may already be resuming).
pub(crate) struct SessionSink {
    pub(crate) sessions: Arc<dyn SessionStore>,
    pub(crate) session_id: String,
    pub(crate) closed: Arc<AtomicBool>,
}

impl TranscriptSink for SessionSink {
    fn append(&self, message: &Message) -> Result<(), SinkError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(SinkError::Closed { session_id: self.session_id.clone() });
        }
        self.sessions.append_message(&self.session_id, message).map(|_| ()).map_err(|e| {
            SinkError::Storage { session_id: self.session_id.clone(), message: e.to_string() }
        })
    }
}
