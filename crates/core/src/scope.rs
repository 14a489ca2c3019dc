//! [`Scope`]: the tenant a process acts for, decided once, and the one rule
//! of which rows it may see — written here and nowhere else.
//!
//! A row carries a profile (a unit's `owner_profile`, a session's
//! `profile_name`); an unprofiled row (NULL or empty: hermes's, written
//! before profiles) belongs to every tenant. The home's operator (the
//! empty profile) sees every row. [`Scoped`] applies the rule to the reads
//! a command makes, so a row outside the scope never reaches the caller:
//! it is answered exactly as a missing one.

use crate::{Backend, Lookup, Result, RetainedChild, SessionRow, UnitView, UsageAttribution};

/// The tenant a process acts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// The home's operator (the empty profile): every row.
    Operator,
    /// One tenant: its own rows and the unprofiled ones.
    Tenant(String),
}

impl Scope {
    /// The scope of the process profile `profile` (blank: the operator).
    pub fn of(profile: &str) -> Scope {
        let p = profile.trim();
        if p.is_empty() { Scope::Operator } else { Scope::Tenant(p.to_owned()) }
    }

    /// Whether a row whose profile is `row` is inside this scope.
    pub fn admits(&self, row: Option<&str>) -> bool {
        match self {
            Scope::Operator => true,
            Scope::Tenant(p) => {
                let r = row.map(str::trim).unwrap_or("");
                r.is_empty() || r == p
            }
        }
    }

    /// The profile key (`""` for the operator).
    pub fn profile(&self) -> &str {
        match self {
            Scope::Operator => "",
            Scope::Tenant(p) => p,
        }
    }

    /// The profile a listing filters on (`None`: every row).
    pub fn filter(&self) -> Option<&str> {
        match self {
            Scope::Operator => None,
            Scope::Tenant(p) => Some(p),
        }
    }

    /// Whether this is the home's operator.
    pub fn is_operator(&self) -> bool {
        matches!(self, Scope::Operator)
    }

    /// The reads of `backend` seen through this scope.
    pub fn reads<'a>(&'a self, backend: &'a Backend) -> Scoped<'a> {
        Scoped { scope: self, backend }
    }
}

/// A backend's reads through a [`Scope`]: what lies outside is absent.
#[derive(Debug, Clone, Copy)]
pub struct Scoped<'a> {
    scope: &'a Scope,
    backend: &'a Backend,
}

impl Scoped<'_> {
    /// The session `id`, if it exists inside the scope.
    pub fn session(&self, id: &str) -> Result<Option<SessionRow>> {
        Ok(self
            .backend
            .graph
            .session(id.trim())?
            .filter(|s| self.scope.admits(s.profile_name.as_deref())))
    }

    /// What `id` names, [`Lookup::Unknown`] when it lies outside the scope.
    pub fn lookup(&self, id: &str) -> Result<Lookup> {
        Ok(match self.backend.registry.lookup(id)? {
            Lookup::Addressable(e) | Lookup::NotAddressable(e, _) if !self.admits(&e) => {
                Lookup::Unknown
            }
            other => other,
        })
    }

    /// The retained child `id`, if inside the scope.
    pub fn find_retained_child(&self, id: &str) -> Result<Option<RetainedChild>> {
        Ok(self.backend.registry.find_retained_child(id)?.filter(|e| self.admits(e)))
    }

    /// Every retained child inside the scope.
    pub fn list_retained_children(&self) -> Result<Vec<RetainedChild>> {
        let mut all = self.backend.registry.list_retained_children()?;
        all.retain(|e| self.admits(e));
        Ok(all)
    }

    /// The unit `id` (any state), if inside the scope.
    pub fn unit_view(&self, id: &str) -> Result<Option<UnitView>> {
        Ok(self
            .backend
            .controls
            .unit_view(id)?
            .filter(|u| self.scope.admits(u.owner_profile.as_deref())))
    }

    /// The ledger rows billed to `session` — none when the session is
    /// outside the scope.
    pub fn usage_attributions(&self, session: &str) -> Result<Vec<UsageAttribution>> {
        if self.session(session)?.is_none() {
            return Ok(Vec::new());
        }
        let rows = self.backend.ledger.usage_attributions(session)?;
        if self.scope.is_operator() {
            return Ok(rows);
        }
        // A shared (unprofiled) session may have billed several tenants'
        // children: only this tenant's (and unprofiled ones) are shown.
        let mut admitted = std::collections::HashMap::new();
        let mut keep = Vec::with_capacity(rows.len());
        for r in rows {
            let child = r.child_session_id.clone();
            let ok = match admitted.get(&child) {
                Some(ok) => *ok,
                None => {
                    let ok = child.is_empty()
                        || self
                            .backend
                            .graph
                            .session(&child)?
                            .is_none_or(|s| self.scope.admits(s.profile_name.as_deref()));
                    admitted.insert(child, ok);
                    ok
                }
            };
            if ok {
                keep.push(r);
            }
        }
        Ok(keep)
    }

    fn admits(&self, e: &RetainedChild) -> bool {
        self.scope.admits(Some(&e.owner_profile))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule() {
        let op = Scope::of("  ");
        assert!(op.is_operator());
        assert!(op.admits(Some("a")) && op.admits(None) && op.admits(Some("")));
        let a = Scope::of("a");
        assert!(a.admits(Some("a")) && a.admits(None) && a.admits(Some(" ")));
        assert!(!a.admits(Some("b")) && !a.admits(Some("a'; DROP TABLE x;--")));
        assert_eq!(a.filter(), Some("a"));
        assert_eq!(op.filter(), None);
    }
}
