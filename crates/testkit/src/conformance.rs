//! The backend conformance suite: the store's core behaviours, written once
//! against the seam traits only, run by every storage backend (SQLite in
//! `retinue-testkit`'s own tests, PostgreSQL in `retinue-store-pg`'s).
//!
//! A backend hands the suite a factory: given the delegation settings
//! (retention limits), it returns a fresh, empty [`SuiteBackend`]. A backend's
//! test file makes each case its own test with
//! [`conformance_suite!`](crate::conformance_suite) (so `cargo nextest run
//! ttl_prune` runs one case on every backend). The cases are listed once,
//! in `conformance_cases!`.
//!
//! ```ignore
//! // tests/conformance_sqlite.rs
//! retinue_testkit::conformance_suite!(Some(retinue_testkit::conformance::sqlite_backend));
//! ```

use retinue_core::EndReason;
use retinue_core::SettleReason;
use retinue_core::UnitState;
use std::any::Any;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use retinue_config::{DelegationConfig, LoadedConfig};
use retinue_core::{
    AttributionDraft, BudgetLimit, ChildManifest, Completion, DeliveryFilter, LEASE_SECS, Lookup,
    ManualClock, Message, NewSession, OwnerProbe, ProcessState, Registry, Reservation,
    ReservationDraft, ResumeClaim, Spend, TombstoneReason, TotalsUpdate, Unaddressable, UnitDraft,
    UsageSwap, UsageTotals,
};
use retinue_store::StoreOptions;
use serde_json::json;

use crate::{T0, TempHome};

/// One storage backend under test: every seam on the same storage, plus the
/// controls the suite needs (time, owner death, a second process).
pub struct SuiteBackend {
    /// Every seam of the backend under test (`b.registry` and the like
    /// read through `Deref`).
    pub seams: retinue_core::Backend,
    /// The clock every handle of this backend reads.
    pub clock: Arc<ManualClock>,
    /// The liveness probe to pass to recovery.
    pub probe: Arc<dyn OwnerProbe>,
    /// The `owner_pid` the suite writes into drafts.
    pub owner_pid: Option<i64>,
    /// Makes the owner of the units and budget reservations written so far
    /// through this backend dead (SQLite: its pid stops answering;
    /// PostgreSQL: its worker lease lapses).
    pub owner_died: Box<dyn Fn() + Send + Sync>,
    /// Makes every delivery and resume claim taken so far older than its
    /// lease (SQLite, one host: its clock moves past the lease; PostgreSQL:
    /// the claims move into the past on the server's clock, the only one
    /// claims are judged by).
    pub claims_expire: Box<dyn Fn() + Send + Sync>,
    /// A second handle on the same storage, as another process (or host) opens it.
    pub reopen: Box<dyn Fn() -> Arc<dyn Registry> + Send + Sync>,
    /// A handle on the same storage for another tenant: that profile, with
    /// its own delegation settings (limits), on this backend's clock.
    pub open_as: TenantOpener,
    /// Keeps the storage alive (temp dir, scratch schema) until the backend drops.
    pub guard: Box<dyn Any + Send + Sync>,
}

impl std::ops::Deref for SuiteBackend {
    type Target = retinue_core::Backend;

    fn deref(&self) -> &retinue_core::Backend {
        &self.seams
    }
}

/// Opens a handle on a backend's storage as another tenant: its profile
/// and its delegation settings.
pub type TenantOpener = Box<dyn Fn(&str, DelegationConfig) -> Arc<dyn Registry> + Send + Sync>;

/// A factory of fresh, empty backends with the given delegation settings.
pub type Factory<'a> = &'a dyn Fn(DelegationConfig) -> SuiteBackend;

/// A probe that reports every pid alive except those marked dead.
#[derive(Debug, Default)]
pub struct DeadPids(Mutex<HashSet<i64>>);

impl DeadPids {
    /// Marks `pid` dead.
    pub fn kill(&self, pid: i64) {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(pid);
    }
}

impl OwnerProbe for DeadPids {
    fn probe(&self, pid: i64) -> Option<ProcessState> {
        let dead = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(&pid);
        Some(if dead { ProcessState::Dead } else { ProcessState::Alive { started_at: None } })
    }
}

/// The SQLite backend: a `state.db` in a temporary home.
///
/// # Panics
/// If the store cannot be opened.
pub fn sqlite_backend(d: DelegationConfig) -> SuiteBackend {
    const OWNER: i64 = 3_999_999;
    let home = Arc::new(TempHome::new());
    let clock = Arc::new(ManualClock::new(T0));
    let opts =
        || StoreOptions::default().with_clock(clock.clone()).with_retention(d.clone().retention());
    let store = Arc::new(home.open_store_with(opts()));
    let probe = Arc::new(DeadPids::default());
    let reopen_home = home.clone();
    let reopen_opts = opts();
    let tenant_home = home.clone();
    let tenant_clock = clock.clone();
    let dead = probe.clone();
    let lease_clock = clock.clone();
    SuiteBackend {
        seams: retinue_core::Backend::of(store),
        clock: clock.clone(),
        probe,
        owner_pid: Some(OWNER),
        // Reservations are owned by this process (their writer).
        owner_died: Box::new(move || {
            dead.kill(OWNER);
            dead.kill(i64::from(std::process::id()));
        }),
        claims_expire: Box::new(move || lease_clock.advance(LEASE_SECS + 1.0)),
        reopen: Box::new(move || Arc::new(reopen_home.open_store_with(reopen_opts.clone()))),
        open_as: Box::new(move |profile, d| {
            let opts = StoreOptions::default()
                .with_clock(tenant_clock.clone())
                .with_retention(d.retention())
                .with_profile(profile);
            Arc::new(tenant_home.open_store_with(opts))
        }),
        guard: Box::new(home),
    }
}

/// The one list of the cases: calls `$callback!($($args)*; case, case, …)`
/// (what [`conformance_suite!`](crate::conformance_suite) expands through).
#[macro_export]
#[doc(hidden)]
macro_rules! conformance_cases {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback!($($args)*;
            insert_retain_list,
            lookup_by_each_id_kind,
            tombstones,
            tombstone_hits_the_shown_child,
            ttl_prune,
            cap_prune,
            retention_per_profile,
            completion_and_delivery,
            delivery_exactly_once_concurrently,
            resume_claims_single_use,
            resume_claims_concurrently,
            finish_follow_up_swaps_usage,
            ledger_keys_and_totals,
            sessions_and_transcripts,
            compression_tip_and_graph,
            recovery_marks_dead_owners_unknown,
            budget_reserve_refuse_settle,
            budget_concurrent_reserves_never_overspend,
            budget_release_abandoned,
            budget_grow_hold_and_keep,
            prune_only_own_tenant,
            budget_tree_members,
            budget_absurd_rows_saturate,
            unit_views_and_controls,
            controls_taken_exactly_once_concurrently,
            unit_listing_and_change_marker,
            tenant_scope_sessions,
            tenant_scope_usage,
            tenant_scope_lookup,
            tenant_scope_children,
            tenant_scope_units,
            approvals_queue,
            approvals_end_with_their_unit,
            approvals_decided_once_concurrently,
        );
    };
}

/// Makes each conformance case its own `#[test]` (filterable with nextest:
/// `cargo nextest run ttl_prune`), run against a fresh backend from
/// `$factory`: an expression giving `Option<impl Fn(DelegationConfig) ->
/// SuiteBackend>`; `None` skips (the factory has already said why, or failed
/// under CI). The cases are [`conformance_cases!`](crate::conformance_cases)'s.
#[macro_export]
macro_rules! conformance_suite {
    ($factory:expr) => {
        $crate::conformance_cases!(conformance_suite!(@each $factory));
    };
    (@each $f:expr; $($name:ident),+ $(,)?) => {
        $(
            #[test]
            fn $name() {
                if let Some(make) = $f {
                    $crate::conformance::$name(&make);
                }
            }
        )+
    };
}

fn config(max_retained: u32, ttl_hours: f64) -> DelegationConfig {
    DelegationConfig {
        max_retained,
        retained_ttl_hours: ttl_hours,
        ..LoadedConfig::default().delegation
    }
}

fn default_config() -> DelegationConfig {
    config(10, 72.0)
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A fresh unit with `n` children (unique ids) spawned by `parent`, not retained.
fn insert(b: &SuiteBackend, parent: &str, profile: &str, n: usize) -> (String, Vec<ChildManifest>) {
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let children: Vec<ChildManifest> = (0..n)
        .map(|i| ChildManifest {
            subagent_id: format!("sa-{i}-{seq:08x}"),
            session_id: format!("child-{seq}-{i}"),
            model: Some("test/model".into()),
            goal: Some(format!("goal {i}")),
            ..ChildManifest::default()
        })
        .collect();
    let draft = UnitDraft {
        origin_session: format!("origin-{parent}"),
        parent_session_id: Some(parent.to_owned()),
        owner_pid: b.owner_pid,
        task: json!({"goal": "g"}),
        owner_profile: profile.to_owned(),
        child_sessions: children
            .iter()
            .map(|c| NewSession {
                id: c.session_id.clone(),
                source: "delegate".into(),
                parent_session_id: Some(parent.to_owned()),
                ..NewSession::default()
            })
            .collect(),
        children: children.clone(),
        ..UnitDraft::default()
    };
    let id = b.registry.insert_unit(&draft).expect("insert_unit");
    (id, children)
}

fn retained(b: &SuiteBackend, parent: &str, n: usize) -> (String, Vec<ChildManifest>) {
    let (id, children) = insert(b, parent, "", n);
    assert!(
        b.registry
            .retain_completed_delegation(&id, Some(&json!({"cost_usd": 0.5})))
            .expect("retain")
    );
    (id, children)
}

fn root(b: &SuiteBackend, id: &str) {
    b.sessions
        .create_session(&NewSession {
            id: id.into(),
            source: "cli".into(),
            ..NewSession::default()
        })
        .expect("create root session");
}

/// Insert, retain, list: children in index order with their manifest.
pub fn insert_retain_list(make: Factory<'_>) {
    let b = make(default_config());
    root(&b, "P");
    let (id, children) = insert(&b, "P", "", 2);
    assert!(b.registry.list_retained_children().expect("list").is_empty());
    assert!(matches!(
        b.registry.lookup(&children[0].subagent_id).expect("lookup"),
        Lookup::NotAddressable(_, Unaddressable::NeverRetained)
    ));
    assert!(
        b.registry
            .retain_completed_delegation(&id, Some(&json!({"cost_usd": 0.5})))
            .expect("retain")
    );
    let list = b.registry.list_retained_children().expect("list");
    assert_eq!(list.len(), 2);
    for (i, e) in list.iter().enumerate() {
        assert_eq!(e.delegation_id, id);
        assert_eq!(e.child_index as usize, i);
        assert_eq!(e.child_id(), children[i].subagent_id);
        assert_eq!(e.child_session_id, children[i].session_id);
        assert_eq!(e.parent_session_id, "P");
        assert_eq!(e.manifest.goal.as_deref(), Some(format!("goal {i}").as_str()));
        assert_eq!(e.retained_at, Some(T0));
    }
    assert_eq!(b.registry.unit_usage(&id).expect("usage"), Some(json!({"cost_usd": 0.5})));
    assert_eq!(b.registry.unit_usage("nope").expect("usage"), None);
    // The child sessions exist, linked to the spawner.
    let kids = b.graph.child_sessions("P").expect("children");
    assert_eq!(kids.len(), 2);
}

/// Lookup by subagent id, child session id and delegation id; misses are unknown.
pub fn lookup_by_each_id_kind(make: Factory<'_>) {
    let b = make(default_config());
    let (id, children) = retained(&b, "P", 2);
    let c1 = &children[1];
    for key in [c1.subagent_id.clone(), c1.session_id.clone(), format!("  {}\n", c1.session_id)] {
        let found = b.registry.find_retained_child(&key).expect("find");
        assert_eq!(found.map(|e| e.child_index), Some(1), "{key}");
    }
    // A delegation id finds the first child.
    let by_unit = b.registry.find_retained_child(&id).expect("find");
    assert_eq!(by_unit.map(|e| e.child_index), Some(0));
    for miss in ["nope", "", "   ", "' OR 1=1 --", "sa-%", &c1.subagent_id.to_uppercase()] {
        assert!(b.registry.find_retained_child(miss).expect("find").is_none(), "{miss}");
        assert_eq!(b.registry.lookup(miss).expect("lookup"), Lookup::Unknown, "{miss}");
    }
}

/// Tombstones are per child, reasoned, final; the last live child takes the unit.
pub fn tombstones(make: Factory<'_>) {
    let b = make(default_config());
    let (id, children) = retained(&b, "P", 2);
    let r = &b.registry;
    assert!(
        r.tombstone_retained_child(&children[0].subagent_id, &TombstoneReason::Manual).expect("t")
    );
    assert!(
        !r.tombstone_retained_child(&children[0].subagent_id, &TombstoneReason::Manual).expect("t")
    );
    match r.lookup(&children[0].subagent_id).expect("lookup") {
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason, .. }) => {
            assert_eq!(reason, TombstoneReason::Manual);
        }
        other => panic!("expected a manual tombstone, got {other:?}"),
    }
    assert!(r.find_retained_child(&children[1].subagent_id).expect("find").is_some());
    assert_eq!(r.list_retained_children().expect("list").len(), 1);
    assert!(r.tombstone_retained_child(&id, &TombstoneReason::Other("op".into())).expect("t"));
    assert!(r.list_retained_children().expect("list").is_empty());
    // An operator's text is a note; the reason stays `manual` (issue #12).
    match r.lookup(&children[1].subagent_id).expect("lookup") {
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason, note, .. }) => {
            assert_eq!(reason, TombstoneReason::Manual);
            assert_eq!(note.as_deref(), Some("op"));
        }
        other => panic!("expected a manual tombstone with a note, got {other:?}"),
    }
    assert!(!r.retain_completed_delegation(&id, None).expect("retain"), "never re-retained");
    assert!(!r.tombstone_retained_child("", &TombstoneReason::Manual).expect("t"));
}

/// A tombstone hits exactly the child a lookup shows: a child session id
/// two units share resolves to the newer unit's child, and only that one
/// is tombstoned (issue #12).
pub fn tombstone_hits_the_shown_child(make: Factory<'_>) {
    let b = make(default_config());
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let shared = format!("shared-{seq}");
    let unit = |sa: &str| {
        let child = ChildManifest {
            subagent_id: format!("{sa}-{seq}"),
            session_id: shared.clone(),
            ..ChildManifest::default()
        };
        crate::retain_unit(b.registry.as_ref(), "P", "", vec![child])
    };
    let old = unit("sa-old");
    b.clock.advance(10.0);
    let new = unit("sa-new");
    match b.registry.lookup(&shared).expect("lookup") {
        Lookup::Addressable(e) => assert_eq!(e.delegation_id, new),
        other => panic!("expected the newer unit's child, got {other:?}"),
    }
    assert!(b.registry.tombstone_retained_child(&shared, &TombstoneReason::Manual).expect("t"));
    assert!(b.registry.find_retained_child(&format!("sa-new-{seq}")).expect("find").is_none());
    let kept = b.registry.find_retained_child(&format!("sa-old-{seq}")).expect("find");
    assert_eq!(kept.map(|e| e.delegation_id), Some(old.clone()), "the older unit's child stays");
    // Now the shared id shows the older child: the next tombstone takes it.
    assert!(b.registry.tombstone_retained_child(&shared, &TombstoneReason::Manual).expect("t"));
    assert!(b.registry.list_retained_children().expect("list").is_empty());
    assert!(!b.registry.tombstone_retained_child(&shared, &TombstoneReason::Manual).expect("t"));
}

/// Past the TTL a child is hidden at once and the prune writes `ttl`.
pub fn ttl_prune(make: Factory<'_>) {
    let b = make(config(10, 1.0));
    let (old, oc) = retained(&b, "P", 1);
    b.clock.advance(1800.0);
    let (_new, nc) = retained(&b, "P", 1);
    b.clock.advance(1801.0);
    assert!(b.registry.find_retained_child(&oc[0].subagent_id).expect("find").is_none());
    assert!(matches!(
        b.registry.lookup(&old).expect("lookup"),
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason: TombstoneReason::Ttl, .. })
    ));
    assert!(b.registry.find_retained_child(&nc[0].subagent_id).expect("find").is_some());
    let expired = b.registry.lookup(&oc[0].session_id).expect("lookup");
    let n = b.registry.prune_retained_children(None, None).expect("prune");
    assert_eq!((n.units, n.children), (1, 1));
    assert_eq!(b.registry.prune_retained_children(None, None).expect("prune").units, 0);
    // The prune writes down what lookups already said: `ttl` at the expiry.
    assert!(matches!(
        b.registry.lookup(&oc[0].session_id).expect("lookup"),
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason: TombstoneReason::Ttl, at, .. })
            if at == T0 + 3600.0
    ));
    assert_eq!(b.registry.lookup(&oc[0].session_id).expect("lookup"), expired);
    assert_eq!(b.registry.rehydrate_retained_children().expect("rehydrate"), 1);
    assert!(b.registry.prune_retained_children(None, Some(f64::NAN)).is_err());
}

/// Beyond `max_retained` the oldest unit is hidden before the prune and capped by it.
pub fn cap_prune(make: Factory<'_>) {
    let b = make(config(2, 72.0));
    let mut units = Vec::new();
    for _ in 0..3 {
        units.push(retained(&b, "P", 1));
        b.clock.advance(10.0);
    }
    // Retaining the third pruned the first (retain prunes).
    assert!(matches!(
        b.registry.lookup(&units[0].0).expect("lookup"),
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { reason: TombstoneReason::Cap, .. })
    ));
    let list = b.registry.list_retained_children().expect("list");
    assert_eq!(
        list.iter().map(|e| e.delegation_id.clone()).collect::<Vec<_>>(),
        vec![units[2].0.clone(), units[1].0.clone()],
        "newest first"
    );
    let n = b.registry.prune_retained_children(Some(1), None).expect("prune");
    assert_eq!((n.units, n.children), (1, 1));
    assert_eq!(b.registry.list_retained_children().expect("list").len(), 1);
    assert_eq!(b.registry.prune_retained_children(Some(1), None).expect("prune").units, 0);
}

/// A retained unit of `profile` with one child; returns its unit id.
/// A unit of `profile`, retained by that tenant's own process (limits `d`).
fn retained_by(b: &SuiteBackend, profile: &str, d: &DelegationConfig) -> String {
    let (id, _) = insert(b, "P", profile, 1);
    let tenant = (b.open_as)(profile, d.clone());
    assert!(tenant.retain_completed_delegation(&id, None).expect("retain"));
    id
}

/// A process prunes only its own tenant, with its own limits (issue #22):
/// another tenant's cap, TTL and explicit prunes never tombstone its units.
pub fn prune_only_own_tenant(make: Factory<'_>) {
    let b = make(config(4, 1000.0));
    let roomy = config(4, 1000.0);
    let acme: Vec<String> = (0..4)
        .map(|_| {
            let id = retained_by(&b, "acme", &roomy);
            b.clock.advance(10.0);
            id
        })
        .collect();
    let acme_view = (b.open_as)("acme", roomy.clone());
    let live = |id: &str| matches!(acme_view.lookup(id).expect("lookup"), Lookup::Addressable(_));
    // tenantb's process has a cap of 1 and a TTL of 1 hour.
    let tight = config(1, 1.0);
    let mine = retained_by(&b, "tenantb", &tight);
    let tenantb = (b.open_as)("tenantb", tight);
    assert_eq!(tenantb.prune_retained_children(Some(1), None).expect("prune").units, 0);
    for id in &acme {
        assert!(live(id), "{id}: acme's unit evicted by tenantb's cap");
    }
    // Two hours later tenantb's TTL prunes its own unit, and only it.
    b.clock.advance(7_200.0);
    let n = tenantb.prune_retained_children(None, None).expect("prune");
    assert_eq!(n.units, 1, "{n:?}");
    assert!(!matches!(tenantb.lookup(&mine).expect("lookup"), Lookup::Addressable(_)));
    assert_eq!(tenantb.rehydrate_retained_children().map(|_| ()).ok(), Some(()));
    for id in &acme {
        assert!(live(id), "{id}: acme's unit evicted by tenantb's TTL");
    }
    // acme's own process, with its own cap of 3, prunes its oldest.
    let acme_tight = (b.open_as)("acme", config(3, 1000.0));
    let n = acme_tight.prune_retained_children(None, None).expect("prune");
    assert_eq!(n.units, 1, "{n:?}");
    assert!(!live(&acme[0]) && live(&acme[1]));
    // The operator (the empty profile of a single-user home) prunes every
    // profile, each ranked among its own.
    let operator = (b.open_as)("", config(2, 1000.0));
    assert_eq!(operator.prune_retained_children(None, None).expect("prune").units, 1);
    assert!(!live(&acme[1]) && live(&acme[2]) && live(&acme[3]));
}

/// The cap applies per profile: one tenant's delegations never evict
/// another's retained children, and the empty profile is a tenant too.
pub fn retention_per_profile(make: Factory<'_>) {
    let d = config(2, 72.0);
    let b = make(d.clone());
    let addressable =
        |id: &str| matches!(b.registry.lookup(id).expect("lookup"), Lookup::Addressable(_));
    let quiet = retained_by(&b, "tenant-b", &d);
    b.clock.advance(10.0);
    let empty = retained_by(&b, "", &d);
    b.clock.advance(10.0);
    let mut a = Vec::new();
    for _ in 0..4 {
        a.push(retained_by(&b, "tenant-a", &d));
        b.clock.advance(10.0);
    }
    // tenant-a's two oldest are capped (by its own retains); the others stay.
    for old in &a[..2] {
        assert!(matches!(
            b.registry.lookup(old).expect("lookup"),
            Lookup::NotAddressable(
                _,
                Unaddressable::Tombstoned { reason: TombstoneReason::Cap, .. }
            )
        ));
    }
    for id in [&quiet, &empty, &a[2], &a[3]] {
        assert!(addressable(id), "{id} evicted by another profile's retains");
    }
    // Listed newest first across profiles.
    let listed: Vec<String> = b
        .registry
        .list_retained_children()
        .expect("list")
        .into_iter()
        .map(|e| e.delegation_id)
        .collect();
    assert_eq!(listed, vec![a[3].clone(), a[2].clone(), empty.clone(), quiet.clone()]);
    // A tighter cap, by each tenant's own process, prunes it to its newest.
    for profile in ["tenant-b", "tenant-a", ""] {
        let tenant = (b.open_as)(profile, d.clone());
        let n = tenant.prune_retained_children(Some(1), None).expect("prune");
        let want = if profile == "tenant-a" { (1, 1) } else { (0, 0) };
        assert_eq!((n.units, n.children), want, "{profile:?} over a cap of 1");
    }
    for id in [&quiet, &empty, &a[3]] {
        assert!(addressable(id), "{id}");
    }
    assert!(!addressable(&a[2]));
    assert_eq!(b.registry.prune_retained_children(Some(1), None).expect("prune").units, 0);
    assert_eq!(b.registry.rehydrate_retained_children().expect("rehydrate"), 3);
}

fn complete(b: &SuiteBackend, id: &str, status: &str, background: bool) -> bool {
    b.registry
        .persist_completion(&Completion {
            delegation_id: id.to_owned(),
            status: UnitState::parse(status),
            event: retinue_core::CompletionEvent::from_stored(
                id,
                json!({"type": "async_delegation", "delegation_id": id}),
            ),
            result: json!({"status": status}),
            usage: Some(json!({"cost_usd": 1.0})),
            background,
        })
        .expect("persist")
}

/// Only `completed` retains; background completions are claimed exactly once.
pub fn completion_and_delivery(make: Factory<'_>) {
    let b = make(default_config());
    let (failed, fc) = insert(&b, "P", "", 1);
    assert!(complete(&b, &failed, "failed", true));
    assert!(b.registry.find_retained_child(&fc[0].subagent_id).expect("find").is_none());
    b.clock.advance(1.0);
    let (done, dc) = insert(&b, "P", "", 1);
    assert!(complete(&b, &done, "completed", true));
    assert!(b.registry.find_retained_child(&dc[0].subagent_id).expect("find").is_some());
    assert!(!complete(&b, "deleg_missing", "completed", true));
    let (sync, _) = insert(&b, "P", "", 1);
    assert!(complete(&b, &sync, "completed", false));

    let r = &b.registry;
    let first = r.claim_delivery(&DeliveryFilter::default()).expect("claim").expect("one");
    assert_eq!(first.delegation_id, failed, "oldest first");
    assert_eq!(first.attempt, 1);
    assert_eq!(first.event.raw["delegation_id"], json!(failed));
    let second = r.claim_delivery(&DeliveryFilter::default()).expect("claim").expect("two");
    assert_eq!(second.delegation_id, done);
    assert!(
        r.claim_delivery(&DeliveryFilter::default()).expect("claim").is_none(),
        "sync is delivered"
    );
    assert!(!r.ack_delivery(&first.delegation_id, "wrong-token").expect("ack"));
    assert!(r.ack_delivery(&first.delegation_id, &first.token).expect("ack"));
    assert!(!r.ack_delivery(&first.delegation_id, &first.token).expect("ack twice"));
    // An unacknowledged claim comes back after its lease, as attempt 2.
    (b.claims_expire)();
    let again = r.claim_delivery(&DeliveryFilter::default()).expect("claim").expect("again");
    assert_eq!((again.delegation_id.as_str(), again.attempt), (done.as_str(), 2));
    assert!(!r.ack_delivery(&done, &second.token).expect("stale token"));
    assert!(r.ack_delivery(&done, &again.token).expect("ack"));
    let filtered =
        DeliveryFilter { parent_session_id: Some("other".into()), ..DeliveryFilter::default() };
    assert!(r.claim_delivery(&filtered).expect("claim").is_none());
}

/// Concurrent claimers (two handles, several threads) take each completion once.
pub fn delivery_exactly_once_concurrently(make: Factory<'_>) {
    let b = make(default_config());
    let mut ids = HashSet::new();
    for _ in 0..12 {
        let (id, _) = insert(&b, "P", "", 1);
        assert!(complete(&b, &id, "failed", true));
        ids.insert(id);
    }
    let other = (b.reopen)();
    let claimed = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..6 {
            let reg: Arc<dyn Registry> =
                if t % 2 == 0 { b.registry.clone() } else { other.clone() };
            let claimed = &claimed;
            s.spawn(move || {
                while let Some(c) = reg.claim_delivery(&DeliveryFilter::default()).expect("claim") {
                    assert!(reg.ack_delivery(&c.delegation_id, &c.token).expect("ack"));
                    claimed.lock().expect("lock").push(c.delegation_id);
                }
            });
        }
    });
    let claimed = claimed.into_inner().expect("lock");
    assert_eq!(claimed.len(), ids.len(), "each exactly once: {claimed:?}");
    assert_eq!(claimed.into_iter().collect::<HashSet<_>>(), ids);
}

/// A resume claim is single-use until released or its lease expires.
pub fn resume_claims_single_use(make: Factory<'_>) {
    let b = make(default_config());
    let (id, children) = retained(&b, "P", 2);
    let r = &b.registry;
    let ResumeClaim::Claimed { token } = r.claim_resume(&id, 0).expect("claim") else {
        panic!("first claim must succeed")
    };
    assert!(matches!(r.claim_resume(&id, 0).expect("claim"), ResumeClaim::Busy { .. }));
    assert!(matches!(r.claim_resume(&id, 1).expect("claim"), ResumeClaim::Claimed { .. }));
    assert!(r.renew_resume(&id, 0, &token).expect("renew"));
    assert!(!r.renew_resume(&id, 0, "not-mine").expect("renew"));
    assert!(r.release_resume(&id, 0, &token).expect("release"));
    assert!(!r.release_resume(&id, 0, &token).expect("release twice"));
    let ResumeClaim::Claimed { token: t2 } = r.claim_resume(&id, 0).expect("claim") else {
        panic!("released claim must be claimable")
    };
    (b.claims_expire)();
    let ResumeClaim::Claimed { token: t3 } = r.claim_resume(&id, 0).expect("claim") else {
        panic!("an expired lease passes on")
    };
    assert_ne!(t2, t3);
    assert!(!r.renew_resume(&id, 0, &t2).expect("old holder lost it"));
    assert_eq!(r.claim_resume(&id, 9).expect("claim"), ResumeClaim::Unavailable);
    assert_eq!(r.claim_resume("deleg_none", 0).expect("claim"), ResumeClaim::Unavailable);
    assert!(
        r.tombstone_retained_child(&children[1].subagent_id, &TombstoneReason::Manual).expect("t")
    );
    assert_eq!(r.claim_resume(&id, 1).expect("claim"), ResumeClaim::Unavailable);
}

/// Many threads on two handles race for one resume claim: exactly one wins.
pub fn resume_claims_concurrently(make: Factory<'_>) {
    let b = make(default_config());
    let (id, _) = retained(&b, "P", 1);
    let other = (b.reopen)();
    let wins = AtomicU32::new(0);
    std::thread::scope(|s| {
        for t in 0..8 {
            let reg: Arc<dyn Registry> =
                if t % 2 == 0 { b.registry.clone() } else { other.clone() };
            let (id, wins) = (&id, &wins);
            s.spawn(move || {
                if let ResumeClaim::Claimed { .. } = reg.claim_resume(id, 0).expect("claim") {
                    wins.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    assert_eq!(wins.into_inner(), 1);
}

/// Finishing a follow-up refreshes retention, swaps usage by compare-and-swap, releases.
pub fn finish_follow_up_swaps_usage(make: Factory<'_>) {
    let b = make(config(10, 1.0));
    let (id, children) = retained(&b, "P", 1);
    let r = &b.registry;
    let ResumeClaim::Claimed { token } = r.claim_resume(&id, 0).expect("claim") else {
        panic!("claim")
    };
    let stale =
        UsageSwap { expected: Some(json!({"cost_usd": 9.0})), new: json!({"cost_usd": 2.0}) };
    let err = r.finish_follow_up(&id, 0, &token, Some(&stale)).expect_err("stale swap");
    assert_eq!(err.kind(), retinue_core::ErrorKind::Stale);
    assert_eq!(r.unit_usage(&id).expect("usage"), Some(json!({"cost_usd": 0.5})));
    b.clock.advance(3000.0);
    let swap =
        UsageSwap { expected: Some(json!({"cost_usd": 0.5})), new: json!({"cost_usd": 2.0}) };
    assert!(r.finish_follow_up(&id, 0, &token, Some(&swap)).expect("finish"));
    assert_eq!(r.unit_usage(&id).expect("usage"), Some(json!({"cost_usd": 2.0})));
    assert!(!r.finish_follow_up(&id, 0, &token, None).expect("released"));
    // The TTL clock restarted: still addressable 3000 s later (past the original hour).
    b.clock.advance(3000.0);
    let e = r.find_retained_child(&children[0].subagent_id).expect("find").expect("alive");
    assert_eq!(e.retained_at, Some(T0 + 3000.0));
}

fn delta(cost: f64, input: f64) -> TotalsUpdate {
    TotalsUpdate {
        delta: UsageTotals { cost_usd: cost, input_tokens: input, output_tokens: 0.0 },
        catch_up: None,
    }
}

/// Idempotency keys write once; totals add up; empty parents write nothing.
pub fn ledger_keys_and_totals(make: Factory<'_>) {
    let b = make(default_config());
    let l = &b.ledger;
    let draft = |key: Option<&str>, cost: f64| AttributionDraft {
        parent_session_id: "PARENT".into(),
        parent_turn_id: "turn".into(),
        child_session_id: "kid".into(),
        usage: json!({"cost_usd": cost}),
        aggregate: None,
        key: key.map(str::to_owned),
    };
    assert!(l.record_usage(&draft(Some("k1"), 0.25), &delta(0.25, 100.0)).expect("record"));
    assert!(!l.record_usage(&draft(Some("k1"), 0.25), &delta(0.25, 100.0)).expect("same key"));
    assert!(l.record_usage(&draft(Some("k2"), 0.5), &delta(0.5, 10.0)).expect("record"));
    assert!(l.record_usage(&draft(None, 1.0), &delta(1.0, 1.0)).expect("record"));
    let empty = AttributionDraft { parent_session_id: String::new(), ..draft(None, 1.0) };
    assert!(!l.record_usage(&empty, &delta(1.0, 1.0)).expect("empty parent"));
    let rows = l.usage_attributions("PARENT").expect("rows");
    assert_eq!(rows.len(), 3);
    assert!(rows.windows(2).all(|w| w[0].id < w[1].id));
    assert_eq!(rows[0].usage, json!({"cost_usd": 0.25}));
    assert_eq!(rows[0].aggregate, None);
    let snap = l.usage_totals_snapshot("PARENT").expect("snapshot");
    assert!((snap.maintained.cost_usd - 1.75).abs() < 1e-9);
    assert!((snap.maintained.input_tokens - 111.0).abs() < 1e-9);
    assert!(snap.pending.is_empty());
    assert_eq!(snap.covered_id, rows[2].id);
    assert!(l.usage_attributions("").expect("rows").is_empty());
    assert_eq!(l.usage_totals_snapshot("nobody").expect("snapshot").covered_id, 0);
    // Concurrent writers with distinct keys: no lost row, no lost total.
    std::thread::scope(|s| {
        for t in 0..4 {
            let l = l.clone();
            s.spawn(move || {
                for i in 0..5 {
                    let d = AttributionDraft {
                        parent_session_id: "PAR".into(),
                        usage: json!({"cost_usd": 1.0}),
                        key: Some(format!("c-{t}-{i}")),
                        ..AttributionDraft::default()
                    };
                    assert!(l.record_usage(&d, &delta(1.0, 0.0)).expect("record"));
                }
            });
        }
    });
    let snap = l.usage_totals_snapshot("PAR").expect("snapshot");
    let folded: f64 = snap.maintained.cost_usd + snap.pending.len() as f64;
    assert_eq!(l.usage_attributions("PAR").expect("rows").len(), 20);
    assert!((folded - 20.0).abs() < 1e-9, "{snap:?}");
    // Session cost fields.
    root(&b, "S");
    assert_eq!(l.session_cost("nope").expect("cost"), None);
    let cost = retinue_core::SessionCost {
        estimated_cost_usd: Some(1.5),
        cost_status: Some("estimated".into()),
        cost_source: None,
    };
    assert!(l.write_session_cost("S", &cost).expect("write"));
    assert!(!l.write_session_cost("nope", &cost).expect("write"));
    assert_eq!(l.session_cost("S").expect("cost"), Some(cost));
}

/// Sessions, messages (NUL-prefixed content too), ending and reopening.
pub fn sessions_and_transcripts(make: Factory<'_>) {
    let b = make(default_config());
    let s = &b.sessions;
    root(&b, "A");
    assert!(s.create_session(&NewSession { id: " ".into(), ..NewSession::default() }).is_err());
    let bad =
        NewSession { id: "X".into(), model_config: Some(json!([1])), ..NewSession::default() };
    assert!(s.create_session(&bad).is_err());
    assert!(
        s.create_session(&NewSession { id: "A".into(), ..NewSession::default() }).is_err(),
        "duplicate id"
    );
    let orphan = NewSession {
        id: "O".into(),
        parent_session_id: Some("missing".into()),
        ..NewSession::default()
    };
    s.create_session(&orphan).expect("unlinked parent");
    assert_eq!(b.graph.session("O").expect("row").and_then(|r| r.parent_session_id), None);
    let structured = "\u{0}json:[{\"type\":\"text\"}]".to_owned();
    let msgs =
        [("user", Some("hi".to_owned())), ("assistant", Some(structured.clone())), ("tool", None)];
    let mut ids = Vec::new();
    for (role, content) in &msgs {
        let m = Message { role: (*role).into(), content: content.clone(), ..Message::default() };
        ids.push(s.append_message("A", &m).expect("append"));
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    assert!(
        s.append_message("nope", &Message { role: "user".into(), ..Message::default() }).is_err()
    );
    let conv = s.conversation("A").expect("conversation");
    assert_eq!(conv.len(), 3);
    assert_eq!(conv[1].content.as_deref(), Some(structured.as_str()));
    assert_eq!(conv[0].timestamp, T0);
    assert!(s.end_session("A", &EndReason::parse("done")).expect("end"));
    assert!(!s.end_session("A", &EndReason::parse("again")).expect("end twice"));
    assert_eq!(b.graph.session("A").expect("row").and_then(|r| r.end_reason), Some("done".into()));
    assert!(s.reopen_session("A").expect("reopen"));
    assert_eq!(b.graph.session("A").expect("row").and_then(|r| r.ended_at), None);
    assert!(!s.reopen_session("nope").expect("reopen"));
    assert!(b.graph.session("nope").expect("row").is_none());
}

/// The compression tip follows continuations to the deepest one with messages;
/// the neighbourhood holds every ancestor.
pub fn compression_tip_and_graph(make: Factory<'_>) {
    let b = make(default_config());
    let s = &b.sessions;
    let new = |id: &str, parent: Option<&str>, at: f64| NewSession {
        id: id.into(),
        source: "cli".into(),
        parent_session_id: parent.map(str::to_owned),
        started_at: Some(at),
        ..NewSession::default()
    };
    s.create_session(&new("R", None, T0)).expect("R");
    s.end_session("R", &EndReason::parse("compression")).expect("end R");
    s.create_session(&new("C1", Some("R"), T0 + 1.0)).expect("C1");
    let branch = NewSession {
        model_config: Some(json!({"_branched_from": "R"})),
        ..new("BR", Some("R"), T0 + 2.0)
    };
    s.create_session(&branch).expect("BR");
    s.append_message(
        "C1",
        &Message { role: "user".into(), content: Some("x".into()), ..Message::default() },
    )
    .expect("msg");
    s.end_session("C1", &EndReason::parse("compression")).expect("end C1");
    s.create_session(&new("C2", Some("C1"), T0 + 3.0)).expect("C2");
    // C2 has no messages yet: the tip stays at C1.
    assert_eq!(s.compression_tip("R").expect("tip"), "C1");
    s.append_message(
        "C2",
        &Message { role: "user".into(), content: Some("y".into()), ..Message::default() },
    )
    .expect("msg");
    assert_eq!(s.compression_tip("R").expect("tip"), "C2");
    assert_eq!(s.compression_tip("unknown").expect("tip"), "unknown");
    let kids: Vec<String> =
        b.graph.child_sessions("R").expect("kids").into_iter().map(|r| r.id).collect();
    assert_eq!(kids, vec!["C1".to_owned(), "BR".to_owned()]);
    if let Some(rows) = b.graph.neighbourhood("C2", 100).expect("neighbourhood") {
        let ids: HashSet<String> = rows.into_iter().map(|r| r.id).collect();
        for must in ["C2", "C1", "R", "BR"] {
            assert!(ids.contains(must), "{must} missing from {ids:?}");
        }
    }
}

/// Units of a dead owner become `unknown` (from another process), retained
/// units and units of live owners are untouched.
pub fn recovery_marks_dead_owners_unknown(make: Factory<'_>) {
    let b = make(default_config());
    let (live, _) = insert(&b, "P", "", 1);
    let (kept, _) = retained(&b, "P", 1);
    let other = (b.reopen)();
    let report = other.recover_abandoned_delegations(b.probe.as_ref());
    assert_eq!((report.abandoned, report.error.as_deref()), (0, None), "owner alive");
    (b.owner_died)();
    let other = (b.reopen)();
    let report = other.recover_abandoned_delegations(b.probe.as_ref());
    assert_eq!(report.error, None);
    assert_eq!(report.abandoned, 1);
    assert_eq!(report.addressable, 1);
    let c = other
        .claim_delivery(&DeliveryFilter {
            delegation_id: Some(live.clone()),
            ..DeliveryFilter::default()
        })
        .expect("claim")
        .expect("the unknown unit is delivered");
    assert_eq!(c.event.raw["status"], json!("unknown"));
    assert!(other.find_retained_child(&kept).expect("find").is_some());
    let again = other.recover_abandoned_delegations(b.probe.as_ref());
    assert_eq!(again.abandoned, 0);
}

// ------------------------------------------------------------------ budgets

/// A ledger row billed to `parent`: `cost` dollars, `input`/`output` tokens.
fn bill(b: &SuiteBackend, parent: &str, cost: f64, input: u64, output: u64) {
    let draft = AttributionDraft {
        parent_session_id: parent.into(),
        parent_turn_id: String::new(),
        child_session_id: "kid".into(),
        usage: json!({"cost_usd": cost, "tokens": {"input": input, "output": output}}),
        aggregate: None,
        key: None,
    };
    let update = TotalsUpdate {
        delta: UsageTotals {
            cost_usd: cost,
            input_tokens: input as f64,
            output_tokens: output as f64,
        },
        catch_up: None,
    };
    assert!(b.ledger.record_usage(&draft, &update).expect("record usage"));
}

fn reservation(root: &str, sessions: &[&str], limit: BudgetLimit, min: Spend) -> ReservationDraft {
    ReservationDraft {
        lineage_root: root.into(),
        sessions: sessions.iter().map(|s| (*s).to_owned()).collect(),
        limit,
        minimum: min,
        maximum: None,
        delegation_id: None,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// The lineage's ledger rows (every session of it) and open reservations
/// count; the grant is all that is left; a refusal writes nothing; settling
/// is single-use and gives the allowance back.
pub fn budget_reserve_refuse_settle(make: Factory<'_>) {
    let b = make(default_config());
    let limit = BudgetLimit { max_cost_usd: Some(1.0), max_tokens: Some(1000) };
    bill(&b, "ROOT", 0.25, 100, 50);
    bill(&b, "TIP", 0.15, 30, 20);
    // Another lineage's spend does not count.
    bill(&b, "ELSEWHERE", 5.0, 5000, 0);
    let lineage = ["ROOT", "TIP"];
    let status =
        b.budgets.budget_status("ROOT", &lineage.map(str::to_owned), limit).expect("status");
    assert!(close(status.spent.cost_usd, 0.4), "{status:?}");
    assert_eq!(status.spent.tokens, 200);
    assert_eq!(status.reserved, Spend::default());
    let min = Spend { cost_usd: 0.1, tokens: 10 };
    let held = b.budgets.reserve(&reservation("ROOT", &lineage, limit, min)).expect("reserve");
    let Reservation::Held { id, granted, before } = held else {
        panic!("expected a reservation, got {held:?}");
    };
    assert!(close(granted.cost_usd, 0.6), "{granted:?}");
    assert_eq!(granted.tokens, 800);
    assert!(close(before.spent.cost_usd, 0.4));
    // Everything is held now: the next one is refused and nothing is written.
    let refused = b.budgets.reserve(&reservation("ROOT", &lineage, limit, min)).expect("reserve");
    let Reservation::Refused(status) = refused else {
        panic!("expected a refusal, got {refused:?}");
    };
    assert!(close(status.reserved.cost_usd, 0.6), "{status:?}");
    assert_eq!(status.reserved.tokens, 800);
    let now = b.budgets.budget_status("ROOT", &lineage.map(str::to_owned), limit).expect("status");
    assert_eq!(now, status, "a refusal writes nothing");
    // A bounded reservation holds at most its maximum; an unlimited measure only the minimum.
    let other = BudgetLimit { max_cost_usd: Some(10.0), max_tokens: None };
    let bounded = ReservationDraft {
        maximum: Some(Spend { cost_usd: 2.0, tokens: 0 }),
        ..reservation("OTHER", &["OTHER"], other, min)
    };
    match b.budgets.reserve(&bounded).expect("reserve") {
        Reservation::Held { granted, .. } => {
            assert!(close(granted.cost_usd, 2.0), "{granted:?}");
            assert_eq!(granted.tokens, 10);
        }
        r @ Reservation::Refused(_) => panic!("expected a reservation, got {r:?}"),
    }
    assert!(b.budgets.settle(&id, &SettleReason::Settled).expect("settle"));
    assert!(!b.budgets.settle(&id, &SettleReason::Settled).expect("settle twice"), "single-use");
    assert!(
        !b.budgets.settle("rsv_nonexistent", &SettleReason::Other("x".into())).expect("unknown id")
    );
    let after =
        b.budgets.budget_status("ROOT", &lineage.map(str::to_owned), limit).expect("status");
    assert_eq!(after.reserved, Spend::default());
    assert!(matches!(
        b.budgets.reserve(&reservation("ROOT", &lineage, limit, min)).expect("reserve"),
        Reservation::Held { .. }
    ));
    // A minimum above what is left is refused even with nothing reserved.
    let big = Spend { cost_usd: 0.7, tokens: 0 };
    let fresh = make(default_config());
    bill(&fresh, "R", 0.4, 0, 0);
    assert!(matches!(
        fresh.budgets.reserve(&reservation("R", &["R"], limit, big)).expect("reserve"),
        Reservation::Refused(_)
    ));
}

/// Eight threads (and handles) reserving at once never hold more than the limit.
pub fn budget_concurrent_reserves_never_overspend(make: Factory<'_>) {
    let b = make(default_config());
    let limit = BudgetLimit { max_cost_usd: Some(0.5), max_tokens: None };
    bill(&b, "ROOT", 0.1, 0, 0);
    let each = Spend { cost_usd: 0.1, tokens: 0 };
    let held = AtomicU32::new(0);
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                let draft = ReservationDraft {
                    maximum: Some(each),
                    ..reservation("ROOT", &["ROOT"], limit, each)
                };
                if let Reservation::Held { .. } = b.budgets.reserve(&draft).expect("reserve") {
                    held.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    assert_eq!(held.load(Ordering::Relaxed), 4, "0.1 spent + 4 × 0.1 held = the 0.5 limit");
    let status = b.budgets.budget_status("ROOT", &["ROOT".to_owned()], limit).expect("status");
    assert!(close(status.reserved.cost_usd, 0.4), "{status:?}");
}

/// Recovery gives back the reservations of an owner that is gone, once.
pub fn budget_release_abandoned(make: Factory<'_>) {
    let b = make(default_config());
    let limit = BudgetLimit { max_cost_usd: Some(1.0), max_tokens: None };
    let min = Spend { cost_usd: 0.5, tokens: 0 };
    let held = b.budgets.reserve(&reservation("ROOT", &["ROOT"], limit, min)).expect("reserve");
    assert!(matches!(held, Reservation::Held { .. }));
    assert_eq!(b.budgets.release_abandoned_reservations(b.probe.as_ref()).expect("release"), 0);
    (b.owner_died)();
    assert_eq!(b.budgets.release_abandoned_reservations(b.probe.as_ref()).expect("release"), 1);
    assert_eq!(b.budgets.release_abandoned_reservations(b.probe.as_ref()).expect("again"), 0);
    let status = b.budgets.budget_status("ROOT", &["ROOT".to_owned()], limit).expect("status");
    assert_eq!(status.reserved, Spend::default());
    // Kept as spent — all it held (no maximum: all that was left) — never
    // given back as free (issue #23).
    assert!(close(status.spent.cost_usd, 1.0), "{status:?}");
}

/// A run's reservation grows call by call within what is left, shrinks to
/// what was spent, and a reservation kept as spent counts as spent.
pub fn budget_grow_hold_and_keep(make: Factory<'_>) {
    let b = make(default_config());
    let limit = BudgetLimit { max_cost_usd: Some(1.0), max_tokens: Some(1000) };
    let lineage = ["ROOT"].map(str::to_owned);
    let status = || b.budgets.budget_status("ROOT", &lineage, limit).expect("status");
    let first = Spend { cost_usd: 0.1, tokens: 100 };
    let Reservation::Held { id, granted, .. } =
        b.budgets.reserve(&reservation("ROOT", &["ROOT"], limit, first)).expect("reserve")
    else {
        panic!("the first reservation fits");
    };
    assert!(granted.tokens >= 100);
    b.budgets.set_hold(&id, first).expect("set");
    // Grow by at least 100 tokens, at most 500: all 500 fit.
    let grow = ReservationDraft {
        minimum: Spend { cost_usd: 0.0, tokens: 100 },
        maximum: Some(Spend { cost_usd: 0.5, tokens: 500 }),
        ..reservation("ROOT", &["ROOT"], limit, Spend::default())
    };
    match b.budgets.grow(&id, &grow).expect("grow") {
        Reservation::Held { granted, .. } => assert_eq!(granted.tokens, 500),
        other => panic!("grow refused: {other:?}"),
    }
    assert_eq!(status().reserved.tokens, 600);
    // Another run needing 500 does not fit while the first holds 600: the
    // rest is held, not spent.
    let other = b
        .budgets
        .reserve(&reservation("ROOT", &["ROOT"], limit, Spend { cost_usd: 0.0, tokens: 500 }))
        .expect("reserve");
    let Reservation::Refused(st) = other else { panic!("fits past the limit: {other:?}") };
    assert!(!st.exceeded_by(Spend { cost_usd: 0.0, tokens: 500 }), "{st:?}");
    // A grow past what is left is refused; a partial one gets what is left.
    let too_much =
        ReservationDraft { minimum: Spend { cost_usd: 0.0, tokens: 401 }, ..grow.clone() };
    assert!(matches!(b.budgets.grow(&id, &too_much).expect("grow"), Reservation::Refused(_)));
    // The call ends having spent 150 tokens: the hold shrinks, others fit.
    assert!(b.budgets.set_hold(&id, Spend { cost_usd: 0.2, tokens: 150 }).expect("set"));
    assert_eq!(status().reserved.tokens, 150);
    // The ledger write failed: kept as spent.
    assert!(
        b.budgets
            .keep_as_spent(&id, &SettleReason::Other("kept as spent: test".into()))
            .expect("keep")
    );
    let st = status();
    assert_eq!((st.spent.tokens, st.reserved.tokens), (150, 0), "{st:?}");
    assert!(close(st.spent.cost_usd, 0.2), "{st:?}");
    assert!(
        !b.budgets.keep_as_spent(&id, &SettleReason::Other("again".into())).expect("keep"),
        "single use"
    );
    assert!(!b.budgets.set_hold(&id, Spend::default()).expect("set"), "no longer open");
    assert!(matches!(b.budgets.grow(&id, &grow).expect("grow"), Reservation::Refused(_)));
    assert_eq!(status().spent.tokens, 150, "a kept reservation never changes");
}

/// Child sessions join their tree's budget once; ledger rows billed to a
/// member count as the budget's spend.
pub fn budget_tree_members(make: Factory<'_>) {
    let b = make(default_config());
    let limit = BudgetLimit { max_cost_usd: Some(1.0), max_tokens: None };
    assert_eq!(b.budgets.budget_root_of("kid-1").expect("root"), None);
    b.budgets.join_budget("ROOT", &["kid-1".to_owned(), "kid-2".to_owned()]).expect("join");
    b.budgets.join_budget("OTHER", &["kid-1".to_owned()]).expect("join again");
    assert_eq!(b.budgets.budget_root_of("kid-1").expect("root").as_deref(), Some("ROOT"));
    assert_eq!(b.budgets.budget_root_of("kid-2").expect("root").as_deref(), Some("ROOT"));
    bill(&b, "ROOT", 0.1, 10, 0);
    bill(&b, "kid-1", 0.2, 20, 0);
    bill(&b, "unrelated", 0.4, 40, 0);
    let st = b.budgets.budget_status("ROOT", &["ROOT".to_owned()], limit).expect("status");
    assert!(close(st.spent.cost_usd, 0.3), "{st:?}");
    assert_eq!(st.spent.tokens, 30);
    // A member listed among the lineage sessions too is counted once.
    let both = ["ROOT".to_owned(), "kid-1".to_owned()];
    let st = b.budgets.budget_status("ROOT", &both, limit).expect("status");
    assert!(close(st.spent.cost_usd, 0.3), "{st:?}");
}

/// Absurd ledger rows (another writer's, or before #23) saturate instead of
/// breaking every later reservation of the lineage.
pub fn budget_absurd_rows_saturate(make: Factory<'_>) {
    let b = make(default_config());
    let limit = BudgetLimit { max_cost_usd: None, max_tokens: Some(1000) };
    let huge = u64::try_from(i64::MAX).unwrap_or(u64::MAX);
    bill(&b, "ROOT", 0.0, huge, huge);
    bill(&b, "ROOT", 0.0, huge, 0);
    let st = b.budgets.budget_status("ROOT", &["ROOT".to_owned()], limit).expect("status");
    assert!(st.spent.tokens >= huge, "{st:?}");
    let refused = b
        .budgets
        .reserve(&reservation("ROOT", &["ROOT"], limit, Spend { cost_usd: 0.0, tokens: 1 }))
        .expect("a reservation is answered, not an error");
    assert!(matches!(refused, Reservation::Refused(_)));
}

/// A unit's view by each of its ids; running units per profile; the
/// mailbox: post, take once, settle forward only, rows go with the unit.
pub fn unit_views_and_controls(make: Factory<'_>) {
    use retinue_core::{ControlKind, ControlOutcome};
    let b = make(default_config());
    let (id, children) = insert(&b, "P", "", 2);
    let (other, _) = insert(&b, "Q", "tenant-b", 1);
    for key in [id.as_str(), &children[1].subagent_id, &children[0].session_id] {
        let v = b.controls.unit_view(key).expect("view").expect("found");
        assert_eq!(v.delegation_id, id, "by {key}");
        assert_eq!(v.parent_session_id.as_deref(), Some("P"));
        assert_eq!(v.state, UnitState::Running);
        assert!(!v.is_finished());
        assert_eq!(v.children.len(), 2);
        assert_eq!(v.children[1].subagent_id, children[1].subagent_id);
        assert_eq!(v.children[0].goal.as_deref(), Some("goal 0"));
    }
    assert!(b.controls.unit_view("deleg_missing").expect("view").is_none());
    assert!(b.controls.unit_view("").expect("view").is_none(), "an empty id names nothing");
    let mine: Vec<String> = b
        .controls
        .running_units(Some(""))
        .expect("running")
        .into_iter()
        .map(|u| u.delegation_id)
        .collect();
    assert_eq!(mine, vec![id.clone()]);
    let all = b.controls.running_units(None).expect("running");
    assert_eq!(all.len(), 2);
    assert!(all.iter().any(|u| u.delegation_id == other));

    let c = &b.controls;
    let steer = c
        .post_control(&id, Some(&children[0].subagent_id), ControlKind::Steer, Some("look left"))
        .expect("post");
    let cancel = c.post_control(&id, None, ControlKind::Cancel, None).expect("post");
    assert_eq!(c.control_outcome(steer).expect("read"), Some(ControlOutcome::Pending));
    assert!(c.take_controls(&other).expect("take").is_empty(), "another unit's mailbox is empty");
    let taken = c.take_controls(&id).expect("take");
    assert_eq!(taken.iter().map(|t| t.id).collect::<Vec<_>>(), vec![steer, cancel], "oldest first");
    assert_eq!(taken[0].kind, ControlKind::Steer);
    assert_eq!(taken[0].message.as_deref(), Some("look left"));
    assert_eq!(taken[0].subagent_id.as_deref(), Some(children[0].subagent_id.as_str()));
    assert_eq!(taken[1].kind, ControlKind::Cancel);
    assert!(c.take_controls(&id).expect("take").is_empty(), "taken once");
    assert_eq!(c.control_outcome(steer).expect("read"), Some(ControlOutcome::Taken));
    assert!(c.settle_control(steer, ControlOutcome::Delivered).expect("settle"));
    assert!(!c.settle_control(steer, ControlOutcome::Missed).expect("settle"), "forward only");
    assert!(!c.settle_control(steer, ControlOutcome::Pending).expect("settle"), "never back");
    let back = c.post_control(&id, None, ControlKind::Cancel, None).expect("post");
    assert_eq!(c.take_controls(&id).expect("take").len(), 1);
    assert!(!c.settle_control(back, ControlOutcome::Pending).expect("settle"), "taken stays taken");
    assert!(!c.settle_control(back, ControlOutcome::Taken).expect("settle"));
    assert!(c.settle_control(back, ControlOutcome::Missed).expect("settle"));
    assert_eq!(c.control_outcome(steer).expect("read"), Some(ControlOutcome::Delivered));
    // A pending control is settled missed by whoever finds its unit done.
    let late = c.post_control(&id, None, ControlKind::Steer, Some("too late")).expect("post");
    assert!(c.settle_control(late, ControlOutcome::Missed).expect("settle"));
    assert!(c.take_controls(&id).expect("take").is_empty(), "a settled control is never taken");
    assert_eq!(c.control_outcome(late).expect("read"), Some(ControlOutcome::Missed));
    assert_eq!(c.control_outcome(999_999).expect("read"), None);

    // Finished: the view carries the result and the delivery state.
    assert!(complete(&b, &id, "completed", true));
    let v = c.unit_view(&id).expect("view").expect("found");
    assert!(v.is_finished() && !v.is_delivered());
    assert_eq!(v.result, Some(json!({"status": "completed"})));
    assert_eq!(v.state, UnitState::Completed);
    let claim = b
        .registry
        .claim_delivery(&DeliveryFilter {
            delegation_id: Some(id.clone()),
            ..DeliveryFilter::default()
        })
        .expect("claim")
        .expect("pending");
    assert!(b.registry.ack_delivery(&id, &claim.token).expect("ack"));
    assert!(c.unit_view(&id).expect("view").expect("found").is_delivered());
    assert_eq!(c.running_units(None).expect("running").len(), 1, "a finished unit is not running");
}

/// Eight takers on one mailbox: every control is taken by exactly one.
pub fn controls_taken_exactly_once_concurrently(make: Factory<'_>) {
    use retinue_core::ControlKind;
    let b = make(default_config());
    let (id, _) = insert(&b, "P", "", 1);
    let mut posted = HashSet::new();
    for i in 0..40 {
        let message = format!("m{i}");
        posted.insert(
            b.controls.post_control(&id, None, ControlKind::Steer, Some(&message)).expect("post"),
        );
    }
    let taken = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..8 {
            let (controls, taken, id) = (b.controls.clone(), &taken, &id);
            s.spawn(move || {
                for _ in 0..10 {
                    let got = controls.take_controls(id).expect("take");
                    taken.lock().expect("lock").extend(got.into_iter().map(|c| c.id));
                }
            });
        }
    });
    let taken = taken.into_inner().expect("lock");
    assert_eq!(taken.len(), posted.len(), "each exactly once: {taken:?}");
    assert_eq!(taken.into_iter().collect::<HashSet<_>>(), posted);
}

/// The web view's reads: every unit newest first (any state, per profile,
/// bounded), with each child's retention, tombstone, toolsets and role; a
/// change marker that moves with units, transcripts and tombstones.
pub fn unit_listing_and_change_marker(make: Factory<'_>) {
    let b = make(default_config());
    let marker = || b.controls.change_marker().expect("marker");
    let m0 = marker();
    assert_eq!(m0, marker(), "stable while nothing changes");
    let (first, fc) = retained(&b, "P", 2);
    b.clock.advance(1.0);
    let (second, _) = insert(&b, "P", "", 1);
    b.clock.advance(1.0);
    let (theirs, _) = insert(&b, "Q", "tenant-b", 1);
    let m1 = marker();
    assert_ne!(m0, m1, "new units move it");
    let mine: Vec<String> = b
        .controls
        .list_units(Some(""), 10)
        .expect("list")
        .into_iter()
        .map(|u| u.delegation_id)
        .collect();
    assert_eq!(mine, vec![second.clone(), first.clone()], "newest first, this profile only");
    let all = b.controls.list_units(None, 10).expect("list");
    assert_eq!(all.len(), 3);
    assert_eq!(all[0].delegation_id, theirs);
    assert_eq!(b.controls.list_units(None, 1).expect("list").len(), 1, "bounded");
    let f = all.iter().find(|u| u.delegation_id == first).expect("first");
    assert_eq!(f.children.len(), 2);
    assert!(f.children.iter().all(|c| c.retained_at.is_some() && c.tombstoned_at.is_none()));
    assert!(
        b.registry
            .tombstone_retained_child(&fc[1].subagent_id, &TombstoneReason::Manual)
            .expect("tombstone")
    );
    let m2 = marker();
    assert_ne!(m1, m2, "a tombstone moves it");
    let f = b.controls.unit_view(&first).expect("view").expect("found");
    assert_eq!(f.children[1].tombstone_reason.as_deref(), Some("manual"));
    assert!(f.children[1].tombstoned_at.is_some());
    b.sessions
        .append_message(
            &fc[0].session_id,
            &Message { role: "assistant".into(), content: Some("hi".into()), ..Message::default() },
        )
        .expect("append");
    assert_ne!(m2, marker(), "a transcript turn moves it");
}

// ------------------------------------------------------------ the tenant scope (#35)

/// Tenant a's rows: its session (profile `tenant-a`), a retained unit it
/// owns with one child (whose session is a's too), a ledger row on its
/// session. Returns (session, unit, subagent id, child session).
fn tenant_rows(b: &SuiteBackend) -> (String, String, String, String) {
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let session = format!("TA-{seq}");
    b.sessions
        .create_session(&NewSession {
            id: session.clone(),
            source: "cli".into(),
            profile_name: Some("tenant-a".into()),
            ..NewSession::default()
        })
        .expect("a's session");
    let child = ChildManifest {
        subagent_id: format!("sa-0-a{seq:07x}"),
        session_id: format!("child-a-{seq}"),
        model: Some("test/model".into()),
        goal: Some("a's goal".into()),
        ..ChildManifest::default()
    };
    let draft = UnitDraft {
        origin_session: session.clone(),
        parent_session_id: Some(session.clone()),
        owner_pid: b.owner_pid,
        task: json!({"goal": "g"}),
        owner_profile: "tenant-a".into(),
        child_sessions: vec![NewSession {
            id: child.session_id.clone(),
            source: "delegate".into(),
            parent_session_id: Some(session.clone()),
            profile_name: Some("tenant-a".into()),
            ..NewSession::default()
        }],
        children: vec![child.clone()],
        ..UnitDraft::default()
    };
    let unit = b.registry.insert_unit(&draft).expect("insert");
    let tenant = (b.open_as)("tenant-a", default_config());
    assert!(tenant.retain_completed_delegation(&unit, None).expect("retain"));
    let row = AttributionDraft {
        parent_session_id: session.clone(),
        parent_turn_id: "turn".into(),
        child_session_id: child.session_id.clone(),
        usage: json!({"cost_usd": 0.25}),
        aggregate: None,
        key: Some(format!("k-{seq}")),
    };
    assert!(b.ledger.record_usage(&row, &delta(0.25, 10.0)).expect("bill a"));
    (session, unit, child.subagent_id, child.session_id)
}

fn tenant(p: &str) -> retinue_core::Scope {
    retinue_core::Scope::of(p)
}

/// `delegate --parent` and `lineage`: another tenant's session (and its
/// children's sessions) read as missing; its own tenant and the operator
/// see them.
pub fn tenant_scope_sessions(make: Factory<'_>) {
    let b = make(default_config());
    let (session, _, _, child_session) = tenant_rows(&b);
    let (a, other, op) = (tenant("tenant-a"), tenant("tenant-b"), tenant(""));
    for id in [&session, &child_session] {
        assert!(other.reads(&b.seams).session(id).expect("read").is_none(), "{id}");
        assert!(a.reads(&b.seams).session(id).expect("read").is_some(), "{id}");
        assert!(op.reads(&b.seams).session(id).expect("read").is_some(), "{id}");
    }
    let hostile = tenant("tenant-a' OR '1'='1");
    assert!(hostile.reads(&b.seams).session(&session).expect("read").is_none());
}

/// `usage`: another tenant's ledger reads as empty.
pub fn tenant_scope_usage(make: Factory<'_>) {
    let b = make(default_config());
    let (session, _, _, _) = tenant_rows(&b);
    assert!(tenant("tenant-b").reads(&b.seams).usage_attributions(&session).expect("r").is_empty());
    assert_eq!(
        tenant("tenant-a").reads(&b.seams).usage_attributions(&session).expect("r").len(),
        1
    );
    // A shared (unprofiled) session billed by both tenants' children: each
    // tenant sees its own child's row only; the operator both.
    let shared = format!("SHARED-{}", SEQ.fetch_add(1, Ordering::Relaxed));
    root(&b, &shared);
    for t in ["tenant-a", "tenant-b"] {
        let child = format!("{shared}-{t}");
        b.sessions
            .create_session(&NewSession {
                id: child.clone(),
                source: "delegate".into(),
                parent_session_id: Some(shared.clone()),
                profile_name: Some(t.into()),
                ..NewSession::default()
            })
            .expect("child session");
        let row = AttributionDraft {
            parent_session_id: shared.clone(),
            parent_turn_id: "turn".into(),
            child_session_id: child.clone(),
            usage: json!({"cost_usd": 0.5}),
            aggregate: None,
            key: Some(child),
        };
        assert!(b.ledger.record_usage(&row, &delta(0.5, 1.0)).expect("bill"));
    }
    let seen = |p: &str| -> Vec<String> {
        tenant(p)
            .reads(&b.seams)
            .usage_attributions(&shared)
            .expect("rows")
            .into_iter()
            .map(|r| r.child_session_id)
            .collect()
    };
    assert_eq!(seen("tenant-b"), vec![format!("{shared}-tenant-b")]);
    assert_eq!(seen("tenant-a"), vec![format!("{shared}-tenant-a")]);
    assert_eq!(seen("").len(), 2);
}

/// `authority`, `delegate --follow-up`, `children tombstone`: another
/// tenant's ids look up exactly as ids that do not exist.
pub fn tenant_scope_lookup(make: Factory<'_>) {
    let b = make(default_config());
    let (_, unit, sa, child_session) = tenant_rows(&b);
    let other = tenant("tenant-b");
    for id in [&unit, &sa, &child_session] {
        assert!(
            matches!(other.reads(&b.seams).lookup(id).expect("lookup"), Lookup::Unknown),
            "{id}"
        );
        assert!(
            matches!(
                tenant("tenant-a").reads(&b.seams).lookup(id).expect("lookup"),
                Lookup::Addressable(_)
            ),
            "{id}"
        );
    }
    assert!(matches!(other.reads(&b.seams).lookup("sa-nope").expect("lookup"), Lookup::Unknown));
    // A tombstoned child of another tenant: still unknown (no tombstone text leaks).
    assert!(b.registry.tombstone_retained_child(&sa, &TombstoneReason::Manual).expect("tomb"));
    assert!(matches!(other.reads(&b.seams).lookup(&sa).expect("lookup"), Lookup::Unknown));
    assert!(matches!(
        tenant("tenant-a").reads(&b.seams).lookup(&sa).expect("lookup"),
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { .. })
    ));
}

/// `children list` and `children show`: another tenant's children are not
/// listed and not found.
pub fn tenant_scope_children(make: Factory<'_>) {
    let b = make(default_config());
    let (_, unit, sa, _) = tenant_rows(&b);
    let (mine, _) = retained(&b, "P", 1);
    let other = tenant("tenant-b");
    let listed = other.reads(&b.seams).list_retained_children().expect("list");
    assert!(listed.iter().all(|e| e.delegation_id != unit), "a's child listed for b");
    assert!(listed.iter().any(|e| e.delegation_id == mine), "unprofiled rows are every tenant's");
    assert!(other.reads(&b.seams).find_retained_child(&sa).expect("find").is_none());
    assert!(tenant("tenant-a").reads(&b.seams).find_retained_child(&sa).expect("find").is_some());
}

/// `wait`, `steer`, `cancel`, `children show --all`: another tenant's unit
/// has no view; the listings `children list --running|--all` and `serve`
/// read filter it out in SQL.
pub fn tenant_scope_units(make: Factory<'_>) {
    let b = make(default_config());
    let (_, unit, sa, _) = tenant_rows(&b);
    let (running, _) = insert(&b, "P2", "tenant-a", 1);
    let (unprofiled, _) = insert(&b, "P3", "", 1);
    let other = tenant("tenant-b");
    for id in [&unit, &sa, &running] {
        assert!(other.reads(&b.seams).unit_view(id).expect("view").is_none(), "{id}");
        assert!(tenant("tenant-a").reads(&b.seams).unit_view(id).expect("view").is_some(), "{id}");
    }
    let ids = |units: Vec<retinue_core::UnitView>| -> Vec<String> {
        units.into_iter().map(|u| u.delegation_id).collect()
    };
    for p in ["tenant-b", "tenant-b' OR '1'='1", "%"] {
        let listed = ids(b.controls.list_units(Some(p), 100).expect("list"));
        assert!(!listed.contains(&unit) && !listed.contains(&running), "{p}: {listed:?}");
        assert!(listed.contains(&unprofiled), "{p}");
        let live = ids(b.controls.running_units(Some(p)).expect("running"));
        assert!(!live.contains(&running) && live.contains(&unprofiled), "{p}: {live:?}");
    }
    let theirs = ids(b.controls.list_units(Some("tenant-a"), 100).expect("list"));
    assert!(theirs.contains(&unit) && theirs.contains(&running) && theirs.contains(&unprofiled));
}

// ---------------------------------------------------------------- approvals

fn ask(b: &SuiteBackend, unit: &str, child: &str, command: &str) -> retinue_core::Requested {
    b.approvals
        .request_approval(&retinue_core::NewApproval {
            delegation_id: unit.to_owned(),
            subagent_id: child.to_owned(),
            tool: "terminal".into(),
            arguments: json!({"command": command}),
            reason: "recursive deletion".into(),
        })
        .expect("request")
}

fn pending_id(r: retinue_core::Requested) -> String {
    match r {
        retinue_core::Requested::Pending(r) => r.approval_id,
        other => panic!("not pending: {other:?}"),
    }
}

/// The queue's rules: a request is stored pending, listed per tenant, decided
/// once; an `always` approval covers the same command of the same child
/// (and nothing else); a unit holds at most `MAX_PENDING_PER_UNIT` pending;
/// another tenant's request is missing to a decider; a decided request says
/// so; stored texts are bounded.
pub fn approvals_queue(make: Factory<'_>) {
    use retinue_core::{
        ApprovalFilter, ApprovalScope, ApprovalState, DecideOutcome, Decision,
        MAX_PENDING_PER_UNIT, REASON_MAX_CHARS, Requested, Scope,
    };
    let b = make(default_config());
    let (unit, children) = insert(&b, "P", "tenant-a", 2);
    let (other, others) = insert(&b, "Q", "tenant-b", 1);
    let child = &children[0].subagent_id;
    let first = pending_id(ask(&b, &unit, child, "rm -rf build"));
    assert!(first.starts_with("appr_"), "{first}");
    let theirs = pending_id(ask(&b, &other, &others[0].subagent_id, "git push --force"));

    let a = b.approvals.approval(&first, &Scope::Operator).expect("read").expect("found");
    assert_eq!((a.state, a.tool.as_str()), (ApprovalState::Pending, "terminal"));
    assert_eq!(a.arguments, json!({"command": "rm -rf build"}));
    assert_eq!((a.delegation_id.as_str(), a.subagent_id.as_str()), (unit.as_str(), child.as_str()));
    assert_eq!(a.owner_profile.as_deref(), Some("tenant-a"));
    assert_eq!(a.parent_session_id.as_deref(), Some("P"));
    assert_eq!(a.requested_at, T0);

    // Tenants see their own; the operator sees both.
    let tenant_b = Scope::Tenant("tenant-b".into());
    assert!(b.approvals.approval(&first, &tenant_b).expect("read").is_none(), "foreign = missing");
    let listed = |scope: &Scope, pending_only: bool| -> Vec<String> {
        let filter = ApprovalFilter { pending_only, ..ApprovalFilter::pending(scope) };
        b.approvals
            .list_approvals(&filter)
            .expect("list")
            .into_iter()
            .map(|r| r.approval_id)
            .collect()
    };
    assert_eq!(listed(&tenant_b, true), vec![theirs.clone()]);
    assert_eq!(listed(&Scope::Operator, true).len(), 2);
    assert_eq!(
        b.approvals
            .decide_approval(
                &first,
                &tenant_b,
                &Decision::approve("session:Q", ApprovalScope::Once)
            )
            .expect("decide"),
        DecideOutcome::Missing,
        "another tenant's decision is refused as a missing id"
    );
    assert_eq!(
        b.approvals
            .decide_approval("appr_000000000000", &Scope::Operator, &Decision::deny("x", None))
            .expect("decide"),
        DecideOutcome::Missing
    );
    assert!(
        b.approvals
            .decide_approval(
                &first,
                &Scope::Operator,
                &retinue_core::Decision {
                    state: ApprovalState::Pending,
                    ..Decision::deny("x", None)
                }
            )
            .is_err(),
        "pending is not a decision"
    );

    // Decided once: approve always, then a late denial is told.
    b.clock.advance(5.0);
    let tenant_a = Scope::Tenant("tenant-a".into());
    let DecideOutcome::Decided(done) = b
        .approvals
        .decide_approval(&first, &tenant_a, &Decision::approve("operator", ApprovalScope::Always))
        .expect("decide")
    else {
        panic!("the first decision wins")
    };
    assert_eq!((done.state, done.scope), (ApprovalState::Approved, ApprovalScope::Always));
    assert_eq!((done.decided_at, done.decided_by.as_deref()), (Some(T0 + 5.0), Some("operator")));
    let late = b
        .approvals
        .decide_approval(&first, &Scope::Operator, &Decision::deny("web", Some("no".into())))
        .expect("decide");
    assert!(
        matches!(&late, DecideOutcome::AlreadyDecided(r) if r.state == ApprovalState::Approved),
        "{late:?}"
    );
    assert_eq!(listed(&tenant_a, true), Vec::<String>::new());
    assert_eq!(listed(&tenant_a, false), vec![first.clone()], "--all shows decided ones");
    let of_child = |sa: &str| {
        let filter = ApprovalFilter {
            pending_only: false,
            subagent_id: Some(sa.to_owned()),
            ..ApprovalFilter::pending(&Scope::Operator)
        };
        b.approvals.list_approvals(&filter).expect("list").len()
    };
    assert_eq!((of_child(child), of_child(&others[0].subagent_id), of_child("sa-x")), (1, 1, 0));

    // Always covers the same command of the same child, nothing else.
    assert!(
        matches!(ask(&b, &unit, child, "rm -rf build"), Requested::Covered(r) if r.approval_id == first)
    );
    let _ = pending_id(ask(&b, &unit, child, "rm -rf /"));
    let _ = pending_id(ask(&b, &unit, &children[1].subagent_id, "rm -rf build"));

    // The per-unit cap (two are pending now).
    for i in 2..MAX_PENDING_PER_UNIT {
        let _ = pending_id(ask(&b, &unit, child, &format!("rm -rf d{i}")));
    }
    assert_eq!(ask(&b, &unit, child, "rm -rf more"), Requested::TooMany);

    // A 1 MB reason is stored bounded.
    let DecideOutcome::Decided(denied) = b
        .approvals
        .decide_approval(
            &theirs,
            &tenant_b,
            &Decision::deny("session:Q", Some("x".repeat(1 << 20))),
        )
        .expect("decide")
    else {
        panic!("decided")
    };
    assert_eq!(denied.state, ApprovalState::Denied);
    assert_eq!(denied.decision_reason.map(|r| r.chars().count()), Some(REASON_MAX_CHARS));
    assert_eq!(ask(&b, "deleg_missing", child, "rm -rf x"), Requested::UnitEnded);
}

/// A pending request ends with its unit: `the unit ended (…)` when the
/// unit completes, `worker gone` when recovery finds its worker dead, and a
/// unit that ended takes no new request.
pub fn approvals_end_with_their_unit(make: Factory<'_>) {
    use retinue_core::{ApprovalState, Requested, Scope};
    let b = make(default_config());
    let (done, c1) = insert(&b, "P", "", 1);
    let (dead, c2) = insert(&b, "P", "", 1);
    let a = pending_id(ask(&b, &done, &c1[0].subagent_id, "rm -rf build"));
    let z = pending_id(ask(&b, &dead, &c2[0].subagent_id, "rm -rf build"));
    assert!(complete(&b, &done, "completed", true));
    let read = |id: &str| b.approvals.approval(id, &Scope::Operator).expect("read").expect("found");
    let ended = read(&a);
    assert_eq!(ended.state, ApprovalState::Expired);
    assert_eq!(ended.decision_reason.as_deref(), Some("the unit ended (completed)"));
    assert_eq!(ended.decided_by.as_deref(), Some(retinue_core::EXPIRED_BY));
    assert_eq!(ask(&b, &done, &c1[0].subagent_id, "rm -rf x"), Requested::UnitEnded);
    assert_eq!(read(&z).state, ApprovalState::Pending, "a restart keeps it pending");
    (b.owner_died)();
    let report = (b.reopen)().recover_abandoned_delegations(b.probe.as_ref());
    assert_eq!(report.abandoned, 1);
    let gone = read(&z);
    assert_eq!(gone.state, ApprovalState::Expired);
    assert_eq!(gone.decision_reason.as_deref(), Some("worker gone"));
}

/// Eight deciders race on one request: exactly one decision is recorded,
/// the others are told it was already decided.
pub fn approvals_decided_once_concurrently(make: Factory<'_>) {
    use retinue_core::{ApprovalScope, DecideOutcome, Decision, Scope};
    let b = make(default_config());
    let (unit, children) = insert(&b, "P", "", 1);
    let id = pending_id(ask(&b, &unit, &children[0].subagent_id, "rm -rf build"));
    let outcomes = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for i in 0..8 {
            let (approvals, outcomes, id) = (b.approvals.clone(), &outcomes, &id);
            s.spawn(move || {
                let d = if i % 2 == 0 {
                    Decision::approve(format!("decider-{i}"), ApprovalScope::Once)
                } else {
                    Decision::deny(format!("decider-{i}"), Some("no".into()))
                };
                let got = approvals.decide_approval(id, &Scope::Operator, &d).expect("decide");
                outcomes.lock().expect("lock").push(got);
            });
        }
    });
    let outcomes = outcomes.into_inner().expect("lock");
    let winners: Vec<_> =
        outcomes.iter().filter(|o| matches!(o, DecideOutcome::Decided(_))).collect();
    assert_eq!(winners.len(), 1, "{outcomes:?}");
    let DecideOutcome::Decided(won) = winners[0] else { unreachable!() };
    for o in &outcomes {
        if let DecideOutcome::AlreadyDecided(r) = o {
            assert_eq!((r.state, &r.decided_by), (won.state, &won.decided_by), "one decision");
        }
    }
}
