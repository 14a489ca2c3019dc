//! Which toolsets a child gets: the operator's grant (`delegation.toolsets`),
//! narrowed by the parent's own toolsets and by the call, minus hermes's
//! blocked toolsets. A call can only narrow, never widen.

use serde::Serialize;

use crate::ParentContext;
use retinue_core::Role;

pub use retinue_core::run::toolsets::{DELEGATION, FILE, MCP_PREFIX, READ, TERMINAL};

/// Toolsets a subagent never gets (hermes's `DELEGATE_BLOCKED_TOOLS`, by
/// toolset).
pub const BLOCKED: &[&str] = &["clarify", "memory", "send_message", "cronjob", "kanban"];

/// A toolset a child did not get, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DroppedToolset {
    /// The toolset's name.
    pub toolset: String,
    /// Why it was dropped.
    pub reason: String,
}

/// The toolsets a child gets and those it was refused.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ToolsetGrant {
    /// Granted, in a stable order, without duplicates.
    pub granted: Vec<String>,
    /// Asked for (by the parent or the call) but not granted.
    pub dropped: Vec<DroppedToolset>,
}

fn is_mcp(t: &str) -> bool {
    t.starts_with(MCP_PREFIX) && t.len() > MCP_PREFIX.len()
}

fn known(t: &str) -> bool {
    matches!(t, READ | FILE | TERMINAL | DELEGATION) || is_mcp(t)
}

/// Whether `set` includes `t` (`file` includes `read`).
fn covers(set: &[String], t: &str) -> bool {
    set.iter().any(|s| s == t || (t == READ && s == FILE))
}

/// Decides one child's toolsets.
///
/// - The candidates are the parent's toolsets when it states any, else the
///   operator's `configured` grant.
/// - A candidate stays when `configured` grants it (`file` grants `read`);
///   an MCP toolset also stays when `inherit_mcp` is set.
/// - `call` (the call's `toolsets` argument) narrows further: only what it
///   names stays (asking for `read` under a `file` grant gives `read`); MCP
///   toolsets are kept regardless when `inherit_mcp` (hermes keeps the
///   parent's MCP toolsets on a narrowed child).
/// - Blocked toolsets are dropped; `delegation` is given to an orchestrator
///   (and only to one).
pub fn grant(
    configured: &[String],
    parent: &ParentContext,
    call: Option<&[String]>,
    role: &Role,
    inherit_mcp: bool,
) -> ToolsetGrant {
    let mut out = ToolsetGrant::default();
    let drop = |out: &mut ToolsetGrant, t: &str, reason: &str| {
        if !out.dropped.iter().any(|d| d.toolset == t) && !out.granted.iter().any(|g| g == t) {
            out.dropped.push(DroppedToolset { toolset: t.to_owned(), reason: reason.to_owned() });
        }
    };
    let candidates: Vec<String> =
        if parent.toolsets.is_empty() { configured.to_vec() } else { parent.toolsets.clone() };
    let mut base: Vec<String> = Vec::new();
    for t in candidates.iter().map(|t| t.trim()).filter(|t| !t.is_empty()) {
        if BLOCKED.contains(&t) {
            drop(&mut out, t, "blocked for subagents");
        } else if t == DELEGATION {
            // Decided by the role below.
        } else if !known(t) {
            drop(&mut out, t, "not a toolset Retinue provides");
        } else if covers(configured, t) || (is_mcp(t) && inherit_mcp) {
            if !base.iter().any(|b| b == t) {
                base.push(t.to_owned());
            }
        } else if t == FILE && covers(configured, READ) {
            // A `file` parent under a `read` grant: the read subset.
            if !base.iter().any(|b| b == READ) {
                base.push(READ.to_owned());
            }
            drop(&mut out, t, "not granted by delegation.toolsets (read only)");
        } else {
            drop(&mut out, t, "not granted by delegation.toolsets");
        }
    }
    let mut granted: Vec<String> = match call {
        None => base,
        Some(asked) => {
            let asked: Vec<&str> =
                asked.iter().map(|t| t.trim()).filter(|t| !t.is_empty()).collect();
            let mut kept = Vec::new();
            for t in &base {
                let named = asked.contains(&t.as_str());
                if named || (is_mcp(t) && inherit_mcp) {
                    kept.push(t.clone());
                } else if t == FILE && asked.contains(&READ) {
                    kept.push(READ.to_owned());
                }
            }
            for t in asked {
                if t == DELEGATION {
                    continue;
                }
                if BLOCKED.contains(&t) {
                    drop(&mut out, t, "blocked for subagents");
                } else if !known(t) {
                    drop(&mut out, t, "not a toolset Retinue provides");
                } else if !covers(&kept, t) {
                    drop(&mut out, t, "not granted to the parent (a call can only narrow)");
                }
            }
            kept
        }
    };
    let wants_delegation = candidates.iter().any(|t| t == DELEGATION)
        || call.is_some_and(|c| c.iter().any(|t| t == DELEGATION));
    if *role == Role::Orchestrator {
        granted.push(DELEGATION.to_owned());
    } else if wants_delegation {
        drop(&mut out, DELEGATION, "only orchestrator children may delegate");
    }
    // `file` includes `read`: keep one name for one set of tools.
    if granted.iter().any(|t| t == FILE) {
        granted.retain(|t| t != READ);
    }
    let mut seen = Vec::new();
    granted.retain(|t| {
        let fresh = !seen.contains(t);
        seen.push(t.clone());
        fresh
    });
    out.granted = granted;
    out.dropped.retain(|d| !out.granted.contains(&d.toolset));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|t| (*t).to_owned()).collect()
    }

    fn parent(t: &[&str]) -> ParentContext {
        ParentContext { toolsets: s(t), ..ParentContext::default() }
    }

    #[test]
    fn the_default_grant_is_read() {
        let g = grant(&s(&["read"]), &parent(&[]), None, &Role::Leaf, true);
        assert_eq!(g.granted, s(&["read"]));
        assert!(g.dropped.is_empty());
    }

    #[test]
    fn a_call_only_narrows() {
        let g =
            grant(&s(&["read"]), &parent(&[]), Some(&s(&["file", "terminal"])), &Role::Leaf, true);
        assert!(g.granted.is_empty(), "{g:?}");
        let names: Vec<_> = g.dropped.iter().map(|d| d.toolset.as_str()).collect();
        assert_eq!(names, ["file", "terminal"]);
        assert!(g.dropped[0].reason.contains("only narrow"));
        let g =
            grant(&s(&["file", "terminal"]), &parent(&[]), Some(&s(&["read"])), &Role::Leaf, true);
        assert_eq!(g.granted, s(&["read"]));
    }

    #[test]
    fn blocked_unknown_and_delegation_are_dropped_with_reasons() {
        let g = grant(
            &s(&["file"]),
            &parent(&["file", "memory", "web", "delegation"]),
            None,
            &Role::Leaf,
            true,
        );
        assert_eq!(g.granted, s(&["file"]));
        let why = |t: &str| g.dropped.iter().find(|d| d.toolset == t).map(|d| d.reason.clone());
        assert_eq!(why("memory").as_deref(), Some("blocked for subagents"));
        assert_eq!(why("web").as_deref(), Some("not a toolset Retinue provides"));
        assert_eq!(why("delegation").as_deref(), Some("only orchestrator children may delegate"));
    }

    #[test]
    fn orchestrators_get_delegation_and_mcp_follows_inherit() {
        let p = parent(&["read", "mcp-docs"]);
        let g = grant(&s(&["read"]), &p, Some(&s(&["read"])), &Role::Orchestrator, true);
        assert_eq!(g.granted, s(&["read", "mcp-docs", "delegation"]));
        let g = grant(&s(&["read"]), &p, None, &Role::Leaf, false);
        assert_eq!(g.granted, s(&["read"]));
        assert_eq!(g.dropped[0].toolset, "mcp-docs");
    }

    #[test]
    fn a_delegation_only_parent_grants_nothing_more() {
        // An orchestrator child with only `delegation`: its grandchildren
        // never get the operator's whole grant.
        let g = grant(&s(&["file", "terminal"]), &parent(&["delegation"]), None, &Role::Leaf, true);
        assert!(g.granted.is_empty(), "{g:?}");
        // A stored manifest (passed as the call) only narrows.
        let g = grant(
            &s(&["read"]),
            &parent(&["read"]),
            Some(&s(&["terminal", "file"])),
            &Role::Leaf,
            true,
        );
        assert!(g.granted.is_empty(), "{g:?}");
        let g = grant(&s(&["read"]), &parent(&["read"]), Some(&s(&[])), &Role::Leaf, true);
        assert!(g.granted.is_empty(), "{g:?}");
    }

    #[test]
    fn a_file_parent_under_a_read_grant_gets_read() {
        let g = grant(&s(&["read"]), &parent(&["file"]), None, &Role::Leaf, true);
        assert_eq!(g.granted, s(&["read"]));
        assert_eq!(g.dropped[0].toolset, "file");
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn name() -> impl Strategy<Value = String> {
            prop_oneof![
                Just("read".to_owned()),
                Just("file".to_owned()),
                Just("terminal".to_owned()),
                Just("delegation".to_owned()),
                Just("mcp-a".to_owned()),
                Just("mcp-b".to_owned()),
                Just("memory".to_owned()),
                Just("web".to_owned()),
            ]
        }

        fn names() -> impl Strategy<Value = Vec<String>> {
            proptest::collection::vec(name(), 0..5)
        }

        /// `file` grants `read`.
        fn allowed(set: &[String], t: &str) -> bool {
            set.iter().any(|s| s == t || (t == READ && s == FILE))
        }

        proptest! {
            /// A grant never holds more than the operator allows, the parent
            /// holds (when it states any) and the call asks for (MCP toolsets
            /// inherited aside); `delegation` only for orchestrators; nothing
            /// blocked; no duplicates.
            #[test]
            fn a_grant_only_narrows(
                configured in names(),
                parent_sets in names(),
                call in proptest::option::of(names()),
                orchestrator in any::<bool>(),
                inherit in any::<bool>(),
            ) {
                let role = if orchestrator { Role::Orchestrator } else { Role::Leaf };
                let parent = ParentContext { toolsets: parent_sets.clone(), ..ParentContext::default() };
                let g = grant(&configured, &parent, call.as_deref(), &role, inherit);
                for t in &g.granted {
                    prop_assert!(!BLOCKED.contains(&t.as_str()));
                    prop_assert_eq!(g.granted.iter().filter(|x| *x == t).count(), 1);
                    if t == DELEGATION {
                        prop_assert!(orchestrator);
                        continue;
                    }
                    let candidates = if parent_sets.is_empty() { &configured } else { &parent_sets };
                    prop_assert!(allowed(candidates, t), "{t} not held by the parent");
                    if t.starts_with(MCP_PREFIX) {
                        prop_assert!(inherit || allowed(&configured, t));
                        prop_assert!(inherit || call.as_ref().is_none_or(|c| allowed(c, t)));
                        continue;
                    }
                    prop_assert!(allowed(&configured, t), "{t} not granted by the operator");
                    if let Some(c) = &call {
                        prop_assert!(allowed(c, t), "{t} not asked for by the call");
                    }
                }
            }
        }
    }
}
