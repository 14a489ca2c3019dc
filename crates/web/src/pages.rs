//! The pages, rendered with maud: every value is escaped (model output,
//! goals, ids and tool results are untrusted), links are built only from
//! percent-encoded ids under fixed paths, and nothing inline needs the
//! Content-Security-Policy relaxed (no inline script, style or handler).

use maud::{DOCTYPE, Markup, html};
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use retinue_core::{
    ApprovalRequest, ApprovalState, BudgetStatus, Message, UsageSoFar, UsageTotals, iso8601,
};
use serde_json::Value;

use crate::model::{ChildNode, ChildPage, ChildState, LineageNode, Tree, UnitNode};

/// Text longer than this is collapsed (a `<details>` shows its start).
pub(crate) const COLLAPSE_CHARS: usize = 400;

fn child_href(id: &str) -> String {
    format!("/child/{}", utf8_percent_encode(id, NON_ALPHANUMERIC))
}

fn usd(v: f64) -> String {
    format!("${v:.4}")
}

fn tokens(t: &UsageTotals) -> String {
    format!("{:.0} in / {:.0} out", t.input_tokens, t.output_tokens)
}

fn secs(s: f64) -> String {
    if s < 90.0 {
        format!("{s:.1} s")
    } else if s < 5400.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

fn clip(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let head: String = text.chars().take(max).collect();
        format!("{head}…")
    }
}

/// The page around a live fragment: `fragment` is the URL the script
/// reloads into `<main>` when the registry changes.
pub(crate) fn layout(title: &str, fragment: Option<&str>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " — Retinue" }
                link rel="stylesheet" href="/static/app.css";
            }
            body {
                header {
                    a.brand href="/" { "Retinue" }
                    span.sub { "subagents, live" }
                    span #status.status { "live" }
                }
                main #live data-fragment=[fragment] { (body) }
                script src="/static/app.js" {}
            }
        }
    }
}

fn state_badge(state: &ChildState) -> Markup {
    let text = match state {
        ChildState::Running => "running".to_owned(),
        ChildState::Retained { left_secs } => format!("retained, {} left", secs(*left_secs)),
        ChildState::Expired => "retained, TTL passed".to_owned(),
        ChildState::Tombstoned { reason, .. } => format!("tombstoned: {reason}"),
        ChildState::Unknown => "unknown".to_owned(),
        ChildState::Finished(s) => s.as_str().to_owned(),
    };
    html! { span class={ "badge " (state.class()) } data-state=(state.class()) { (text) } }
}

fn budget_bar(b: &BudgetStatus) -> Markup {
    let (left_usd, left_tokens) = b.remaining();
    html! {
        div.budget {
            @if let Some(max) = b.limit.max_cost_usd {
                label {
                    "budget " (usd(max)) ": spent " (usd(b.spent.cost_usd))
                    ", reserved " (usd(b.reserved.cost_usd))
                    ", remaining " (usd(left_usd.unwrap_or(0.0)))
                }
                meter min="0" max=(max) value=(b.spent.cost_usd + b.reserved.cost_usd) {}
            }
            @if let Some(max) = b.limit.max_tokens {
                label {
                    "budget " (max) " tokens: spent " (b.spent.tokens) ", reserved "
                    (b.reserved.tokens) ", remaining " (left_tokens.unwrap_or(0))
                }
                meter min="0" max=(max) value=(b.spent.tokens.saturating_add(b.reserved.tokens)) {}
            }
        }
    }
}

fn so_far(s: &UsageSoFar) -> Markup {
    html! {
        span.sofar {
            "so far: " (s.api_calls) " call(s), " (s.output_tokens) " tok out, " (s.tool_calls) " tool call(s)"
            @if let Some(t) = &s.last_tool { ", last " (t) }
        }
    }
}

fn child_row(c: &ChildNode) -> Markup {
    let ch = &c.child;
    html! {
        li.child data-subagent=(ch.subagent_id) {
            div.line {
                a.id href=(child_href(&ch.subagent_id)) { (ch.subagent_id) }
                " " (state_badge(&c.state))
                @if let Some(m) = &ch.model { span.model { (m) } }
                @if let Some(r) = &ch.role { span.role { (r) } }
                @for t in &ch.toolsets { span.toolset { (t) } }
                span.cost { (usd(c.cost.cost_usd)) " · " (tokens(&c.cost)) }
                @if let Some(s) = &c.so_far { (so_far(s)) }
            }
            @if let Some(goal) = &ch.goal { div.goal { (clip(goal, 240)) } }
            @if !c.nested.is_empty() {
                ul.units.nested { @for u in &c.nested { (unit_block(u)) } }
            }
        }
    }
}

fn unit_block(u: &UnitNode) -> Markup {
    let v = &u.unit;
    html! {
        li.unit data-delegation=(v.delegation_id) {
            div.line {
                span.id { (v.delegation_id) }
                span class={ "badge unit-" (v.state.as_str()) } { (v.state.as_str()) }
                @if let Some(mode) = &v.mode { span.mode { (mode) } }
                span.elapsed { (secs(u.elapsed_secs)) }
                span.cost { "unit " (usd(u.cost.cost_usd)) " · " (tokens(&u.cost)) }
            }
            ul.children { @for c in &u.children { (child_row(c)) } }
        }
    }
}

fn lineage_block(l: &LineageNode) -> Markup {
    let root = if l.root.is_empty() { "(no parent session)" } else { l.root.as_str() };
    html! {
        section.lineage data-root=(l.root) {
            h2 { "lineage " span.id { (root) } }
            div.totals { "lineage " (usd(l.cost.cost_usd)) " · " (tokens(&l.cost)) }
            @if let Some(b) = &l.budget { (budget_bar(b)) }
            @for s in &l.sessions {
                div.session data-session=(s.id) {
                    h3 {
                        span.id { (s.id) }
                        @if s.continuation { " " span.badge.continuation { "continuation" } }
                        " " span.cost { (usd(s.cost.cost_usd)) }
                    }
                    ul.units { @for u in &s.units { (unit_block(u)) } }
                }
            }
        }
    }
}

/// What a page's decision forms carry: a CSRF token issued for this
/// render, and the page to return to. `None`: the view is read-only.
#[derive(Debug, Clone)]
pub(crate) struct Forms {
    /// The per-page token every POST must present.
    pub(crate) csrf: String,
    /// The page the decision returns to (a fixed path, or a child's).
    pub(crate) back: String,
}

fn approval_href(id: &str) -> String {
    format!("/approvals/{}", utf8_percent_encode(id, NON_ALPHANUMERIC))
}

/// Approval requests: each with its call and reason and, while it waits on
/// a writable view, the approve / always / deny buttons (a POST form with
/// the page's CSRF token).
pub(crate) fn approvals_section(list: &[ApprovalRequest], forms: Option<&Forms>) -> Markup {
    html! {
        @if !list.is_empty() {
            section.approvals {
                h2 { "Approvals" }
                @for r in list {
                    div class={ "approval " (r.state.as_str()) } data-approval=(r.approval_id) {
                        div.meta {
                            span.id { (r.approval_id) }
                            " · " a href=(child_href(&r.subagent_id)) { (r.subagent_id) }
                            " · " span.tool { (r.tool) }
                            " · " span.state { (r.state.as_str()) }
                            @if let Some(by) = &r.decided_by { " by " (by) }
                        }
                        pre.call { (clip(&r.call_text(), 2000)) }
                        p.reason { (r.reason) }
                        @if let Some(why) = &r.decision_reason { p.decision { (clip(why, 500)) } }
                        @if let (ApprovalState::Pending, Some(f)) = (r.state, forms) {
                            form method="post" action=(approval_href(&r.approval_id)) {
                                input type="hidden" name="csrf" value=(f.csrf);
                                input type="hidden" name="back" value=(f.back);
                                button type="submit" name="decision" value="approve" { "Approve once" }
                                button type="submit" name="decision" value="always" { "Approve always" }
                                input type="text" name="reason" maxlength="2000" placeholder="reason (for a denial)";
                                button type="submit" name="decision" value="deny" { "Deny" }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The tree (the fragment the live script reloads).
pub(crate) fn tree_fragment(tree: &Tree, forms: Option<&Forms>) -> Markup {
    html! {
        (approvals_section(&tree.approvals, forms))
        p.summary {
            (tree.units) " delegation unit(s), " span #running { (tree.running) } " running"
        }
        @if tree.lineages.is_empty() { p.empty { "No delegations yet." } }
        @for l in &tree.lineages { (lineage_block(l)) }
    }
}

fn collapsible(text: &str) -> Markup {
    html! {
        @if text.chars().count() > COLLAPSE_CHARS {
            details.long {
                summary { (clip(text, 160)) }
                pre { (text) }
            }
        } @else {
            pre { (text) }
        }
    }
}

fn tool_calls(raw: &str) -> Markup {
    let calls: Vec<Value> = serde_json::from_str(raw).unwrap_or_default();
    html! {
        @for call in &calls {
            div.toolcall {
                span.tool { "tool call " (call["function"]["name"].as_str().unwrap_or("?")) }
                @if let Some(id) = call["id"].as_str() { span.callid { (id) } }
                (collapsible(call["function"]["arguments"].as_str().unwrap_or_default()))
            }
        }
    }
}

fn message_block(m: &Message, first_user: bool) -> Markup {
    let label = match m.role.as_str() {
        "user" if !first_user => "user (steer or follow-up)".to_owned(),
        "tool" => format!("tool result {}", m.tool_name.as_deref().unwrap_or("")),
        other => other.to_owned(),
    };
    html! {
        article class={ "msg " (m.role) } {
            div.meta { span.role { (label) } span.when { (iso8601(m.timestamp)) } }
            @if let Some(text) = &m.content { (collapsible(text)) }
            @if let Some(calls) = &m.tool_calls { (tool_calls(calls)) }
        }
    }
}

/// What the child did, from its transcript (every run): the line a parent
/// model reads, then the files and commands.
fn receipts_section(r: &retinue_core::Receipts) -> Markup {
    html! {
        section.receipts {
            h3 { "receipts" }
            p.line { (r.line()) }
            @if !r.files_written.is_empty() {
                p { "wrote: " @for f in &r.files_written { code { (f) } " " } }
            }
            @if !r.files_read.is_empty() {
                p { "read: " @for f in &r.files_read { code { (f) } " " } }
            }
            @if !r.commands.is_empty() {
                ul.commands {
                    @for c in &r.commands {
                        li {
                            code { (clip(&c.command, 200)) } " "
                            @match c.exit_code {
                                Some(code) => { "exit " (code) }
                                None => { "not run" }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// An isolated child's change set: state, files and the diff, each line
/// classed (`add`, `del`, `hunk`) for the stylesheet.
fn changes_section(set: &retinue_core::run::ChangeSet) -> Markup {
    let class = |line: &str| {
        if line.starts_with("+++") || line.starts_with("---") {
            "file"
        } else if line.starts_with('+') {
            "add"
        } else if line.starts_with('-') {
            "del"
        } else if line.starts_with("@@") {
            "hunk"
        } else {
            "ctx"
        }
    };
    html! {
        section.changes {
            h3 { "changes (" (set.state.as_str()) ", " (set.diffstat()) ")" }
            p { "branch " code { (set.branch) } " · worktree " code { (set.worktree.display()) }
                @if !set.worktree_present { " (gone)" } }
            @if set.untracked_not_copied > 0 {
                p.note { (set.untracked_not_copied) " untracked file(s) of the workspace were not copied" }
            }
            ul.files {
                @for f in &set.files {
                    li { (f.status) " " code { (f.path) }
                        @if let (Some(a), Some(r)) = (f.added, f.removed) { " +" (a) " −" (r) } }
                }
            }
            @if let Some(diff) = &set.diff {
                pre.diff {
                    @for line in diff.lines() { span class=(class(line)) { (line) } "\n" }
                }
                @if set.diff_truncated { p.note { "(diff cut at 1 MiB)" } }
            }
        }
    }
}

/// A child's page: where it sits, its cost, its transcript.
pub(crate) fn child_fragment(page: &ChildPage, forms: Option<&Forms>) -> Markup {
    let c = &page.child;
    // The first user turn is the task; later ones were steers or follow-ups.
    let mut seen_user = false;
    let plain: Vec<bool> = page
        .transcript
        .iter()
        .map(|m| {
            if m.role != "user" {
                return true;
            }
            let first = !seen_user;
            seen_user = true;
            first
        })
        .collect();
    html! {
        section.childpage {
            h2 { "subagent " span.id { (c.child.subagent_id) } " " (state_badge(&c.state)) }
            dl {
                dt { "delegation" } dd { (page.unit.delegation_id) }
                dt { "session" } dd { (c.child.child_session_id) }
                @if let Some(p) = &page.unit.parent_session_id { dt { "parent" } dd { (p) } }
                @if let Some(m) = &c.child.model { dt { "model" } dd { (m) } }
                dt { "toolsets" } dd { (c.child.toolsets.join(", ")) }
                dt { "cost" } dd { (usd(c.cost.cost_usd)) " · " (tokens(&c.cost)) }
                @if let Some(s) = &c.so_far { dt { "running" } dd { (so_far(s)) } }
                @if let ChildState::Tombstoned { at, reason } = &c.state {
                    dt { "tombstoned" } dd { (iso8601(*at)) " (" (reason) ")" }
                }
            }
            (approvals_section(&page.approvals, forms))
            (receipts_section(&retinue_core::Receipts::of(&page.transcript)))
            @if let Some(set) = &page.changes { (changes_section(set)) }
            @if let Some(goal) = &c.child.goal { h3 { "goal" } (collapsible(goal)) }
            h3 { "transcript (" (page.transcript.len()) " turns)" }
            div.transcript {
                @for (m, plain) in page.transcript.iter().zip(&plain) {
                    (message_block(m, *plain))
                }
            }
        }
    }
}

/// The answer to a decision someone else made first.
pub(crate) fn already_decided(r: &ApprovalRequest, back: &str) -> Markup {
    html! {
        section {
            h2 { "Already decided" }
            p {
                code { (r.approval_id) } " is " (r.state.as_str())
                @if let Some(by) = &r.decided_by { " by " (by) }
                "."
            }
            p { a href=(back) { "Back" } }
        }
    }
}

/// The page for an unknown (or foreign) child id.
pub(crate) fn not_found(id: &str) -> Markup {
    html! { section { h2 { "No such subagent" } p { "Nothing here is called " code { (id) } "." } } }
}
