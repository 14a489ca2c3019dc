//! The retained-subagent registry (semantics §3), split by role into four
//! seam traits, plus the umbrella [`Registry`] for the composition root.
//!
//! The traits are what a storage backend implements: synchronous,
//! object-safe, `Send + Sync`, and free of any engine notion (no connection,
//! row or pragma type). Every method is one transaction. Lookups are
//! unscoped; the lineage crate adds the owner scope on top.

/// Lease of a resume or delivery claim, in seconds.
pub const LEASE_SECS: f64 = 300.0;
/// Attempts after which a completion is dropped.
pub const MAX_DELIVERY_ATTEMPTS: i64 = 8;
/// Delivered rows older than this are deleted by the history pruner (seconds).
pub const DELIVERED_MAX_AGE_SECS: f64 = 7.0 * 86_400.0;
/// Terminal rows the history pruner keeps.
pub const TERMINAL_KEEP: i64 = 50;
/// Pending rows the history pruner keeps.
pub const PENDING_KEEP: i64 = 1000;

use std::sync::Arc;

use serde_json::Value;

use crate::approval::ApprovalQueue;
use crate::budget::Budgets;
use crate::control::Controls;
use crate::error::Result;
use crate::ledger::UsageLedger;
use crate::model::{
    ChildManifest, Completion, DeliveryClaim, DeliveryFilter, Lookup, PruneCount, ResumeClaim,
    RetainedChild, TombstoneReason, UnitDraft, UsageSwap,
};
use crate::probe::OwnerProbe;
use crate::sessions::{SessionGraph, SessionStore};

/// Outcome of restart recovery (semantics §3.8).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RecoveryReport {
    /// Units marked `unknown`.
    pub abandoned: usize,
    /// Addressable children after rehydration.
    pub addressable: usize,
    /// What failed, each step's message in order (`"; "`-separated).
    pub error: Option<String>,
}

impl RecoveryReport {
    /// Runs recovery's two steps, each whatever the other did: `classify`
    /// marks abandoned units `unknown`, then `rehydrate` prunes and counts
    /// the addressable children. Both backends recover through this.
    pub fn run(
        mut self,
        classify: impl FnOnce() -> crate::Result<usize>,
        rehydrate: impl FnOnce() -> crate::Result<usize>,
    ) -> RecoveryReport {
        match classify() {
            Ok(n) => self.abandoned = n,
            Err(e) => self.failed("classification", &e),
        }
        match rehydrate() {
            Ok(n) => self.addressable = n,
            Err(e) => self.failed("rehydration", &e),
        }
        self
    }

    /// Adds `step failed: e` to [`RecoveryReport::error`].
    pub fn failed(&mut self, step: &str, e: &dyn std::fmt::Display) {
        let msg = format!("{step} failed: {e}");
        self.error = Some(match self.error.take() {
            Some(prev) => format!("{prev}; {msg}"),
            None => msg,
        });
    }
}

/// Reading the registry: what lineage (and the tool's listing) needs.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait RegistryRead: Send + Sync {
    /// Every addressable child, newest unit first, then by child index.
    fn list_retained_children(&self) -> Result<Vec<RetainedChild>>;
    /// The addressable child for a subagent, session or delegation id:
    /// [`RegistryRead::lookup`]'s entry when it is addressable.
    fn find_retained_child(&self, id: &str) -> Result<Option<RetainedChild>> {
        Ok(match self.lookup(id)? {
            Lookup::Addressable(entry) => Some(entry),
            _ => None,
        })
    }
    /// The unscoped status of an id.
    fn lookup(&self, id: &str) -> Result<Lookup>;
    /// The unit's `usage_json` (malformed = `None`).
    fn unit_usage(&self, id: &str) -> Result<Option<Value>>;
}

/// A unit's life from dispatch to retention.
pub trait UnitLifecycle: Send + Sync {
    /// Writes a new `running` unit with its manifest and child sessions; returns its id.
    fn insert_unit(&self, draft: &UnitDraft) -> Result<String>;
    /// Records a unit's children manifest; `false` if the unit is missing.
    fn record_dispatched_children(&self, id: &str, children: &[ChildManifest]) -> Result<bool>;
    /// Retains a unit (never a tombstoned one) and prunes; `false` if nothing changed.
    #[expect(clippy::needless_lifetimes)] // mockall needs the named lifetime
    fn retain_completed_delegation<'a>(&self, id: &str, usage: Option<&'a Value>) -> Result<bool>;
    /// Records a terminal result; retains iff the status is exactly `completed`.
    fn persist_completion(&self, completion: &Completion) -> Result<bool>;
}

/// Tombstones, pruning, rehydration, restart recovery and history.
pub trait Retention: Send + Sync {
    /// Tombstones exactly the child that [`RegistryRead::lookup`] resolves `id`
    /// to, if addressable (for a delegation id: that unit's live children
    /// only); `false` if none changed. The stored reason is always `manual`:
    /// `ttl`, `cap` and `external` are the system's. A
    /// [`TombstoneReason::Other`] text (or a reserved reason passed here) is
    /// stored as the tombstone's note. Children already past their TTL keep
    /// `ttl` and their expiry time.
    fn tombstone_retained_child(&self, id: &str, reason: &TombstoneReason) -> Result<bool>;
    /// TTL and cap pruning; explicit limits are floored at 1 and 0.
    fn prune_retained_children(
        &self,
        max_retained: Option<u32>,
        ttl_hours: Option<f64>,
    ) -> Result<PruneCount>;
    /// Prunes with the configured limits and counts addressable children.
    fn rehydrate_retained_children(&self) -> Result<usize>;
    /// Restart recovery (semantics §3.8).
    fn recover_abandoned_delegations(&self, probe: &dyn OwnerProbe) -> RecoveryReport;
    /// Deletes old non-retained history (semantics §3.6); returns the rows deleted.
    fn prune_history(&self) -> Result<usize>;
}

/// Leases: delivery claims, single-use resume claims, finishing a follow-up.
pub trait Claims: Send + Sync {
    /// Claims the oldest deliverable completion.
    fn claim_delivery(&self, filter: &DeliveryFilter) -> Result<Option<DeliveryClaim>>;
    /// Acknowledges a claimed delivery; `false` if the lease was lost.
    fn ack_delivery(&self, id: &str, token: &str) -> Result<bool>;
    /// Takes the single-use resume claim of one child.
    fn claim_resume(&self, id: &str, child_index: u32) -> Result<ResumeClaim>;
    /// Renews a held resume claim; `false` if it is no longer ours.
    fn renew_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool>;
    /// Releases a held resume claim; `false` if it is no longer ours.
    fn release_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool>;
    /// After a follow-up: refresh `retained_at` (never un-tombstoning), swap
    /// the unit's `usage_json` if given, and release the claim — one
    /// transaction. A swap whose `expected` no longer matches fails with
    /// [`crate::Error::Stale`] and changes nothing (re-read, re-merge, retry).
    #[expect(clippy::needless_lifetimes)]
    fn finish_follow_up<'a>(
        &self,
        id: &str,
        child_index: u32,
        token: &str,
        usage: Option<&'a UsageSwap>,
    ) -> Result<bool>;
}

/// The whole registry, for the composition root: every role at once.
/// Implemented for every type that implements the four roles.
pub trait Registry: RegistryRead + UnitLifecycle + Retention + Claims {}

impl<T: RegistryRead + UnitLifecycle + Retention + Claims + ?Sized> Registry for T {}

// Mocks: `RegistryRead` (what lineage takes) has its own; the write roles are
// consumed together (by the delegate crate, through the umbrella), so one mock
// of the whole registry serves their failure-injection tests.
#[cfg(any(test, feature = "mocks"))]
mockall::mock! {
    /// A mock of the whole [`Registry`] (all four roles on one object).
    pub Registry {}
    impl RegistryRead for Registry {
        fn list_retained_children(&self) -> Result<Vec<RetainedChild>>;
        fn find_retained_child(&self, id: &str) -> Result<Option<RetainedChild>>;
        fn lookup(&self, id: &str) -> Result<Lookup>;
        fn unit_usage(&self, id: &str) -> Result<Option<Value>>;
    }
    impl UnitLifecycle for Registry {
        fn insert_unit(&self, draft: &UnitDraft) -> Result<String>;
        fn record_dispatched_children(&self, id: &str, children: &[ChildManifest]) -> Result<bool>;
        fn retain_completed_delegation<'a>(&self, id: &str, usage: Option<&'a Value>) -> Result<bool>;
        fn persist_completion(&self, completion: &Completion) -> Result<bool>;
    }
    impl Retention for Registry {
        fn tombstone_retained_child(&self, id: &str, reason: &TombstoneReason) -> Result<bool>;
        fn prune_retained_children(
            &self,
            max_retained: Option<u32>,
            ttl_hours: Option<f64>,
        ) -> Result<PruneCount>;
        fn rehydrate_retained_children(&self) -> Result<usize>;
        fn recover_abandoned_delegations(&self, probe: &dyn OwnerProbe) -> RecoveryReport;
        fn prune_history(&self) -> Result<usize>;
    }
    impl Claims for Registry {
        fn claim_delivery(&self, filter: &DeliveryFilter) -> Result<Option<DeliveryClaim>>;
        fn ack_delivery(&self, id: &str, token: &str) -> Result<bool>;
        fn claim_resume(&self, id: &str, child_index: u32) -> Result<ResumeClaim>;
        fn renew_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool>;
        fn release_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool>;
        fn finish_follow_up<'a>(
            &self,
            id: &str,
            child_index: u32,
            token: &str,
            usage: Option<&'a UsageSwap>,
        ) -> Result<bool>;
    }
}

/// One storage backend as the layers above see it: every seam, as a trait
/// object. Defined once; the CLI, the MCP server, the delegate crate and
/// the test kit all carry this one bundle. Usually every field is the same
/// store ([`Backend::of`]); a test may mix in fakes.
#[derive(Clone)]
pub struct Backend {
    /// Units, retention, recovery, claims.
    pub registry: Arc<dyn Registry>,
    /// Sessions and transcripts.
    pub sessions: Arc<dyn SessionStore>,
    /// The session graph lineage reads.
    pub graph: Arc<dyn SessionGraph>,
    /// The usage ledger.
    pub ledger: Arc<dyn UsageLedger>,
    /// Budget reservations.
    pub budgets: Arc<dyn Budgets>,
    /// Background units from outside their worker: views and controls.
    pub controls: Arc<dyn Controls>,
    /// Approval requests of children's risky calls.
    pub approvals: Arc<dyn ApprovalQueue>,
}

impl Backend {
    /// Every seam served by one store.
    pub fn of<T>(store: Arc<T>) -> Backend
    where
        T: Registry + SessionStore + UsageLedger + Budgets + Controls + ApprovalQueue + 'static,
    {
        Backend {
            registry: store.clone(),
            sessions: store.clone(),
            graph: store.clone(),
            ledger: store.clone(),
            budgets: store.clone(),
            controls: store.clone(),
            approvals: store,
        }
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend").finish_non_exhaustive()
    }
}
