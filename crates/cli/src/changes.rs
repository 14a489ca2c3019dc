//! `retinue changes`, `retinue apply`, `retinue discard` (issue #38): an
//! isolated child's change set, reviewed and applied (or dropped) by its
//! parent lineage (`--parent`, the follow-up rule) or the home's operator.
//! A change set that is missing or not the caller's exits 4; a conflict
//! exits 1 with `code: "conflict"` and the files; a second apply exits 1
//! with `code: "already_decided"` ("already applied").

use std::sync::Arc;

use retinue_core::SystemClock;
use retinue_core::run::{ChangeSet, IsolationError};
use retinue_delegate::{DelegateError, change_set_json};
use serde_json::json;

use crate::backend::Backend;
use crate::env::{Access, Env};
use crate::error::Result;
use crate::table::{Table, clip};
use crate::{Output, approvals, background};

fn files_block(set: &ChangeSet) -> String {
    let mut t = Table::new(&["STATUS", "PATH", "+", "−"]);
    for f in &set.files {
        let path = match &f.old_path {
            Some(old) => format!("{old} → {}", f.path),
            None => f.path.clone(),
        };
        let n = |v: Option<u64>| v.map_or_else(|| "bin".to_owned(), |n| n.to_string());
        t.row(vec![f.status.to_owned(), path, n(f.added), n(f.removed)]);
    }
    if t.is_empty() { String::new() } else { t.render() }
}

fn set_human(set: &ChangeSet) -> String {
    let mut text = format!(
        "{} {} ({}) on {}\nworktree: {}{}\n",
        set.owner.subagent_id,
        set.state.as_str(),
        set.diffstat(),
        set.branch,
        set.worktree.display(),
        if set.worktree_present { "" } else { " (gone: removed by hand; discard cleans it)" }
    );
    if set.untracked_not_copied > 0 {
        text.push_str(&format!(
            "note: {} untracked file(s) of the workspace were not copied into the worktree\n",
            set.untracked_not_copied
        ));
    }
    text.push_str(&files_block(set));
    if let Some(diff) = &set.diff {
        // The child wrote it: no escape sequence reaches the terminal.
        let shown: String = diff
            .chars()
            .map(|c| if c.is_control() && c != '\n' && c != '\t' { '\u{fffd}' } else { c })
            .collect();
        text.push_str(&shown);
        if set.diff_truncated {
            text.push_str("\n(diff cut at 1 MiB)\n");
        }
    }
    text
}

/// The error output, with the conflicting files in the JSON.
fn failed(e: &DelegateError) -> Output {
    let mut out = background::error_output(e);
    if let (DelegateError::Isolation(IsolationError::Conflict { files, .. }), Some(j)) =
        (e, out.json.as_mut())
    {
        j["files"] = json!(files);
    }
    out
}

/// `retinue changes [ID] [--diff] [--pending] [--parent SESSION]`.
pub(crate) fn show(
    env: &Env,
    id: Option<&str>,
    diff: bool,
    pending: bool,
    parent: Option<&str>,
) -> Result<Output> {
    let store = Backend::open(env, Arc::new(SystemClock), Access::Read)?;
    let parent = approvals::decider_parent(env, &store, parent)?;
    let collector = background::collector(&store, env);
    let decider = approvals::decider(parent.as_ref());
    if let Some(id) = id {
        return Ok(match collector.change_set(id, decider, diff) {
            Ok(set) => Output::ok(change_set_json(&set), set_human(&set)),
            Err(e) => failed(&e),
        });
    }
    let sets = match collector.change_sets(decider, pending) {
        Ok(s) => s,
        Err(e) => return Ok(failed(&e)),
    };
    let mut t = Table::new(&["SUBAGENT", "STATE", "CHANGES", "WORKTREE", "PARENT"]);
    for s in &sets {
        t.row(vec![
            s.owner.subagent_id.clone(),
            s.state.as_str().to_owned(),
            s.diffstat(),
            if s.worktree_present {
                clip(&s.worktree.display().to_string(), 50)
            } else {
                "(gone)".to_owned()
            },
            s.owner.parent_session_id.clone(),
        ]);
    }
    let human = if sets.is_empty() {
        if pending { "no pending change sets\n" } else { "no change sets\n" }.to_owned()
    } else {
        t.render()
    };
    Ok(Output::ok(
        json!({ "changes": sets.iter().map(change_set_json).collect::<Vec<_>>() }),
        human,
    ))
}

/// `retinue apply ID` (`discard`: `retinue discard ID`).
pub(crate) fn decide(env: &Env, id: &str, discard: bool, parent: Option<&str>) -> Result<Output> {
    let store = Backend::open(env, Arc::new(SystemClock), Access::Read)?;
    let parent = approvals::decider_parent(env, &store, parent)?;
    let collector = background::collector(&store, env);
    let decider = approvals::decider(parent.as_ref());
    let done = if discard {
        collector.discard_changes(id, decider)
    } else {
        collector.apply_changes(id, decider)
    };
    Ok(match done {
        Ok(set) => {
            let human = if discard {
                format!(
                    "{} discarded; its worktree and branch are removed\n",
                    set.owner.subagent_id
                )
            } else {
                format!(
                    "{} applied to {} ({}); review with `git diff`\n",
                    set.owner.subagent_id,
                    set.repository.display(),
                    set.diffstat()
                )
            };
            Output::ok(change_set_json(&set), human)
        }
        Err(e) => failed(&e),
    })
}
