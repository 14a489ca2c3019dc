//! `retinue-core`: the registry's rulebook, with no storage engine in it.
//!
//! The records ([`RetainedChild`], [`ChildManifest`], [`SessionRow`], …),
//! the status enums ([`UnitState`], [`ChildStatus`], [`Role`],
//! [`ExitReason`]), the seam traits every backend implements
//! ([`RegistryRead`], [`UnitLifecycle`], [`Retention`], [`Claims`],
//! [`SessionGraph`], [`SessionStore`], [`UsageLedger`], [`Budgets`]), the one
//! error type ([`Error`], [`ErrorKind`]), the [`Clock`], and every rule that
//! needs no SQL as a pure function: addressability ([`child_status`]), the
//! retention limits ([`Limits`]), spent and remaining ([`BudgetStatus`]).
//!
//! `retinue-store` (SQLite) and `retinue-store-pg` (PostgreSQL) implement
//! the traits side by side; `retinue-lineage` and `retinue-usage` need only
//! this crate. Nothing here depends on rusqlite, postgres, refinery or YAML.
//! The rules are described in `docs/semantics.md`, whose section numbers the
//! code cites as "semantics §N".
//!
//! ```
//! use retinue_core::{ChildFacts, Limits, RetentionPolicy, Unaddressable, child_status};
//!
//! // A child retained 73 hours ago under the default 72-hour TTL is expired.
//! let now = 1_000_000.0;
//! let limits = Limits::new(now, RetentionPolicy::default());
//! let facts = ChildFacts {
//!     retained_at: Some(now - 73.0 * 3600.0),
//!     unit_retained: true,
//!     ..ChildFacts::default()
//! };
//! assert!(matches!(child_status(&facts, limits), Some(Unaddressable::Tombstoned { .. })));
//! ```

mod approval;
mod budget;
mod clock;
mod control;
mod dump;
mod error;
mod ids;
mod ledger;
mod model;
mod options;
mod probe;
mod receipts;
mod registry;
mod rules;
pub mod run;
mod scope;
pub mod semconv;
mod sessions;
mod spend;
mod status;

pub use approval::{
    ApprovalFilter, ApprovalPrompter, ApprovalQueue, ApprovalRequest, ApprovalScope, ApprovalState,
    DecideOutcome, Decision, EXPIRED_BY, MAX_PENDING_PER_UNIT, NewApproval, REASON_MAX_CHARS,
    REDACTED_MARK, Requested, TIMED_OUT, new_approval_id,
};
pub use budget::Budgets;
pub use clock::{Clock, ManualClock, SystemClock, iso8601};
pub use control::{
    CONTROL_POLL_MS, Control, ControlKind, ControlOutcome, Controls, UnitChild, UnitView,
    UsageSoFar, manifest_facts,
};
pub use dump::{Cell, CellType, StateDump, StateReader, TableSpec};
pub use error::{Error, ErrorKind, Result, Source};
pub use ids::{insert_with_unit_id, random_hex};
pub use ledger::{
    AttributionDraft, PendingUsage, TotalsCatchUp, TotalsSnapshot, TotalsUpdate, UsageAttribution,
    UsageLedger, UsageTotals,
};
pub use model::{
    ABANDONED_ERROR, ChildManifest, Completion, CompletionEvent, CompletionPlan, DeliveryClaim,
    DeliveryFilter, GOAL_MAX_CHARS, Lookup, Message, NewSession, PruneCount, ResumeClaim,
    RetainedChild, SessionCost, SessionRow, TombstoneReason, Unaddressable, UnitDraft, UsageSwap,
    abandoned_event, children_json, parse_children_json, parse_json_opt, redact_endpoint,
    redact_url, strip_userinfo, truncate_chars, userinfo_at,
};
pub use options::{JournalMode, Synchronous, default_profile_key};
pub use probe::{OwnerProbe, ProcProbe, ProcessState, current_owner};
pub use receipts::{
    COMMAND_MAX_CHARS, ChangedFile, CommandReceipt, LIST_MAX, Receipts, RunTokenCount,
};
pub use registry::{
    Backend, Claims, DELIVERED_MAX_AGE_SECS, LEASE_SECS, MAX_DELIVERY_ATTEMPTS, PENDING_KEEP,
    RecoveryReport, Registry, RegistryRead, Retention, TERMINAL_KEEP, UnitLifecycle,
};
pub use rules::{
    ChildFacts, ChildRow, Limits, LookupKey, RetentionPolicy, child_status, covered_status,
    lookup_order,
};
pub use scope::{Scope, Scoped};
pub use sessions::{
    LineageWalk, MAX_HOPS, SessionGraph, SessionStore, compression_tip_walk, has_lineage_marker,
    tool_call_delta,
};
pub use spend::{BudgetLimit, BudgetStatus, Reservation, ReservationDraft, Spend, UsageColumns};
pub use status::{ChildStatus, EndReason, ExitReason, Role, SettleReason, UnitState};

#[cfg(any(test, feature = "mocks"))]
pub use approval::MockApprovalQueue;
#[cfg(any(test, feature = "mocks"))]
pub use budget::MockBudgets;
#[cfg(any(test, feature = "mocks"))]
pub use clock::MockClock;
#[cfg(any(test, feature = "mocks"))]
pub use control::MockControls;
#[cfg(any(test, feature = "mocks"))]
pub use ledger::MockUsageLedger;
#[cfg(any(test, feature = "mocks"))]
pub use probe::MockOwnerProbe;
#[cfg(any(test, feature = "mocks"))]
pub use registry::{MockRegistry, MockRegistryRead};
#[cfg(any(test, feature = "mocks"))]
pub use sessions::{MockLineageWalk, MockSessionGraph, MockSessionStore};
