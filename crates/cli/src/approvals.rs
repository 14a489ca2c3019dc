//! `retinue approvals`, `retinue approve`, `retinue deny` (issue #37), and
//! the inline prompt of `retinue delegate` on a terminal. Every decision
//! goes through the delegator's [`Collector`](retinue_delegate::Collector): the child's parent lineage
//! (`--parent`, the follow-up rule) or the home's operator decides; an id
//! that is unknown or not the caller's exits 4, one decided first exits 1
//! with `code: "already_decided"`.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};

use retinue_core::{
    ApprovalPrompter, ApprovalRequest, ApprovalScope, ApprovalState, Decision, SystemClock,
};
use retinue_delegate::{Decider, ParentContext, Ruling, approval_json};
use serde_json::{Value, json};

use crate::backend::Backend;
use crate::env::{Access, Env};
use crate::error::{CliError, Result};
use crate::table::{Table, clip};
use crate::{Output, background};

/// Who decides from this command: `--parent SESSION`, else the home's
/// operator (a state.db opened without a profile only).
pub(crate) fn decider_parent(
    env: &Env,
    store: &Backend,
    parent: Option<&str>,
) -> Result<Option<ParentContext>> {
    if let Some(p) = parent {
        return Ok(Some(ParentContext {
            session_id: Some(p.trim().to_owned()),
            ..ParentContext::default()
        }));
    }
    if env.pg_url.is_some() || !store.scope.is_operator() {
        return Err(CliError::Usage(
            "--parent SESSION is required in team mode and for a profile: name the session whose \
             children's requests you decide"
                .to_owned(),
        ));
    }
    Ok(None)
}

pub(crate) fn decider<'a>(parent: Option<&'a ParentContext>) -> Decider<'a> {
    match parent {
        Some(p) => Decider::Parent(p),
        None => Decider::Operator { by: "operator" },
    }
}

/// Printable: no control character from a model reaches the terminal.
fn shown(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

/// The call as one printable line.
fn call_text(r: &ApprovalRequest) -> String {
    shown(&r.call_text())
}

/// `retinue approvals [--all] [--parent SESSION]`.
pub(crate) fn list(env: &Env, all: bool, parent: Option<&str>) -> Result<Output> {
    let store = Backend::open(env, Arc::new(SystemClock), Access::WriteExisting)?;
    let parent = decider_parent(env, &store, parent)?;
    let listed = match background::collector(&store, env).approvals(decider(parent.as_ref()), all) {
        Ok(l) => l,
        Err(e) => return Ok(background::error_output(&e)),
    };
    let mut t = Table::new(&["APPROVAL", "STATE", "SUBAGENT", "TOOL", "CALL", "REASON"]);
    for r in &listed {
        t.row(vec![
            r.approval_id.clone(),
            r.state.as_str().to_owned(),
            r.subagent_id.clone(),
            r.tool.clone(),
            clip(&call_text(r), 50),
            clip(&shown(&r.reason), 40),
        ]);
    }
    let human = if listed.is_empty() {
        if all { "no approval requests\n" } else { "no pending approval requests\n" }.to_owned()
    } else {
        t.render()
    };
    let json = json!({ "approvals": listed.iter().map(approval_json).collect::<Vec<_>>() });
    Ok(Output::ok(json, human))
}

/// `retinue approve ID [--always]` and `retinue deny ID [--reason TEXT]`.
pub(crate) fn decide(
    env: &Env,
    id: &str,
    verdict: &Ruling,
    parent: Option<&str>,
) -> Result<Output> {
    let store = Backend::open(env, Arc::new(SystemClock), Access::WriteExisting)?;
    let parent = decider_parent(env, &store, parent)?;
    match background::collector(&store, env).decide(id, decider(parent.as_ref()), verdict) {
        Ok(r) => {
            let human = format!(
                "{} {} by {}{}\n",
                r.approval_id,
                r.state.as_str(),
                r.decided_by.as_deref().unwrap_or("-"),
                if r.scope == ApprovalScope::Always { " (always)" } else { "" }
            );
            Ok(Output::ok(approval_json(&r), human))
        }
        Err(e) => Ok(background::error_output(&e)),
    }
}

/// The inline prompt of `retinue delegate` with stdin a terminal: one
/// request at a time, answered `y` (approve once), `a` (always) or `n
/// [reason]` (deny); a request decided elsewhere meanwhile is reported and
/// the prompt moves on.
pub(crate) struct TtyPrompter {
    /// The request being asked about.
    current: Mutex<Option<String>>,
    /// Lines read from stdin by a reader thread started on first use.
    lines: Mutex<Option<Receiver<String>>>,
    /// Set while a prompt is on screen (the status lines step aside).
    pub(crate) prompting: Arc<AtomicBool>,
}

impl TtyPrompter {
    /// A prompter when stdin and stderr are terminals, `None` otherwise.
    pub(crate) fn on_terminal() -> Option<TtyPrompter> {
        (std::io::stdin().is_terminal() && std::io::stderr().is_terminal()).then(|| TtyPrompter {
            current: Mutex::new(None),
            lines: Mutex::new(None),
            prompting: Arc::new(AtomicBool::new(false)),
        })
    }

    fn next_line(&self) -> Option<String> {
        let mut slot = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            let (tx, rx) = std::sync::mpsc::channel();
            let started =
                std::thread::Builder::new().name("approval-prompt".to_owned()).spawn(move || {
                    for line in std::io::stdin().lock().lines() {
                        let Ok(line) = line else { break };
                        if tx.send(line).is_err() {
                            break;
                        }
                    }
                });
            if started.is_err() {
                return None;
            }
            *slot = Some(rx);
        }
        match slot.as_ref().map(Receiver::try_recv) {
            Some(Ok(line)) => Some(line),
            Some(Err(TryRecvError::Empty)) | None => None,
            Some(Err(TryRecvError::Disconnected)) => {
                *slot = None;
                None
            }
        }
    }

    fn ask(r: &ApprovalRequest) {
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\napproval {} — {} wants to run {}: {}\n  reason: {}\n  [y] approve once  [a] \
             approve always  [n REASON] deny > ",
            r.approval_id,
            r.subagent_id,
            r.tool,
            call_text(r),
            shown(&r.reason)
        );
        let _ = err.flush();
    }
}

/// Every approval request (any state) of a unit or a child, as `children
/// show` reports them: the decisions next to the child's story.
pub(crate) fn of(
    store: &Backend,
    scope: &retinue_core::Scope,
    unit: Option<&str>,
    subagent: Option<&str>,
) -> Result<Value> {
    let filter = retinue_core::ApprovalFilter {
        profile: scope.filter().map(str::to_owned),
        pending_only: false,
        delegation_id: unit.map(str::to_owned),
        subagent_id: subagent.map(str::to_owned),
        limit: 100,
    };
    let listed = store.approvals.list_approvals(&filter)?;
    Ok(Value::Array(
        listed
            .iter()
            .filter(|r| scope.admits(r.owner_profile.as_deref()))
            .map(retinue_delegate::approval_json)
            .collect(),
    ))
}

/// On a terminal (not `--json`), `tool`'s children's risky calls are asked
/// about inline too (the request is in the queue for every other surface
/// meanwhile); returns the flag the status lines step aside on.
pub(crate) fn prompt_inline(env: &Env, tool: &retinue_delegate::Delegator) -> Arc<AtomicBool> {
    match TtyPrompter::on_terminal().filter(|_| !env.json) {
        Some(prompter) => {
            let hold = prompter.prompting.clone();
            tool.set_approval_prompter(Arc::new(prompter));
            hold
        }
        None => Arc::new(AtomicBool::new(false)),
    }
}

/// A typed answer as a decision (`None`: not an answer; asked again).
pub(crate) fn parse_answer(line: &str) -> Option<Decision> {
    let line = line.trim();
    let (word, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
    let by = "operator (terminal)";
    match word.to_ascii_lowercase().as_str() {
        "y" | "yes" => Some(Decision::approve(by, ApprovalScope::Once)),
        "a" | "always" => Some(Decision::approve(by, ApprovalScope::Always)),
        "n" | "no" | "deny" => {
            Some(Decision::deny(by, Some(rest.trim().to_owned()).filter(|r| !r.is_empty())))
        }
        _ => None,
    }
}

impl ApprovalPrompter for TtyPrompter {
    fn poll(&self, request: &ApprovalRequest) -> Option<Decision> {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        match current.as_deref() {
            None => {
                *current = Some(request.approval_id.clone());
                self.prompting.store(true, Ordering::SeqCst);
                // A line typed for an earlier prompt never answers this one.
                while self.next_line().is_some() {}
                TtyPrompter::ask(request);
                return None;
            }
            Some(id) if id != request.approval_id => return None,
            Some(_) => {}
        }
        let line = self.next_line()?;
        let decision = parse_answer(&line);
        if decision.is_none() {
            TtyPrompter::ask(request);
        }
        decision
    }

    fn settled(&self, request: &ApprovalRequest) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if current.as_deref() == Some(request.approval_id.as_str()) {
            *current = None;
            self.prompting.store(false, Ordering::SeqCst);
            let by = request.decided_by.as_deref().unwrap_or("-");
            let what = match request.state {
                ApprovalState::Expired => format!(
                    "expired ({})",
                    request.decision_reason.as_deref().unwrap_or("no decision in time")
                ),
                s => format!("{} by {by}", s.as_str()),
            };
            eprintln!("approval {}: {what}", request.approval_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_answers_become_decisions_and_anything_else_asks_again() {
        let once = parse_answer(" y ").expect("y");
        assert_eq!((once.state, once.scope), (ApprovalState::Approved, ApprovalScope::Once));
        assert_eq!(parse_answer("always").map(|d| d.scope), Some(ApprovalScope::Always));
        let no = parse_answer("n  not on main").expect("n");
        assert_eq!((no.state, no.reason.as_deref()), (ApprovalState::Denied, Some("not on main")));
        assert_eq!(parse_answer("no").map(|d| d.reason), Some(None));
        assert!(parse_answer("").is_none());
        assert!(parse_answer("maybe").is_none());
    }
}
