//! Shared fixture: a temp home, a manual clock and hermes-style raw inserts.

use std::path::PathBuf;
use std::sync::Arc;

use retinue_config::DelegationConfig;
use retinue_core::{ChildManifest, ManualClock, RegistryRead, UnitLifecycle};
use retinue_store::{Store, StoreOptions};
use serde_json::json;

pub(crate) const T0: f64 = 1_800_000_000.0;

pub(crate) struct Fx {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) clock: Arc<ManualClock>,
    pub(crate) store: Store,
}

impl Fx {
    pub(crate) fn new() -> Fx {
        Fx::with_config(DelegationConfig::default())
    }

    pub(crate) fn with_config(d: DelegationConfig) -> Fx {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(T0));
        let store = open(&dir.path().join("state.db"), &clock, d);
        Fx { dir, clock, store }
    }

    pub(crate) fn db(&self) -> PathBuf {
        self.dir.path().join("state.db")
    }

    pub(crate) fn reopen(&self) -> Store {
        open(&self.db(), &self.clock, delegation_of(&self.store))
    }

    pub(crate) fn raw(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(self.db()).expect("raw open")
    }

    /// hermes's `_insert_delegation`: a running unit written with raw SQL.
    pub(crate) fn insert_delegation(&self, id: &str, parent: &str, state: &str) {
        let now = self.clock_now();
        self.raw()
            .execute(
                "INSERT OR REPLACE INTO async_delegations (delegation_id, origin_session, \
                 origin_ui_session_id, parent_session_id, state, dispatched_at, updated_at, \
                 delivery_state, delivery_attempts, origin_session_id) \
                 VALUES (?1, '', '', ?2, ?3, ?4, ?4, 'pending', 0, '')",
                rusqlite::params![id, parent, state, now],
            )
            .expect("insert delegation");
    }

    pub(crate) fn clock_now(&self) -> f64 {
        use retinue_core::Clock;
        self.clock.now()
    }

    /// The seed's `_dispatch_and_retain`.
    pub(crate) fn dispatch_and_retain(&self, id: &str, parent: &str, children: &[ChildManifest]) {
        self.insert_delegation(id, parent, "running");
        assert!(self.store.record_dispatched_children(id, children).expect("record"));
        assert!(
            self.store
                .retain_completed_delegation(id, Some(&json!({"cost_usd": 0.5})))
                .expect("retain")
        );
    }

    pub(crate) fn seed_unit(&self) -> &'static str {
        self.dispatch_and_retain("deleg_test0001", "parent-1", &[seed_child()]);
        "deleg_test0001"
    }
}

pub(crate) fn open(path: &std::path::Path, clock: &Arc<ManualClock>, d: DelegationConfig) -> Store {
    let opts = StoreOptions::default().with_clock(clock.clone()).with_retention(d.retention());
    Store::open(path, opts).expect("open store")
}

pub(crate) fn seed_child() -> ChildManifest {
    child("sa-0-abc12345", "child-sess-1", Some("test/model"), Some("do the thing"))
}

pub(crate) fn child(sa: &str, sid: &str, model: Option<&str>, goal: Option<&str>) -> ChildManifest {
    ChildManifest {
        subagent_id: sa.to_owned(),
        session_id: sid.to_owned(),
        model: model.map(str::to_owned),
        goal: goal.map(str::to_owned),
        ..ChildManifest::default()
    }
}

pub(crate) fn ids(store: &Store) -> Vec<String> {
    store
        .list_retained_children()
        .expect("list")
        .into_iter()
        .map(|e| e.child_id().to_owned())
        .collect()
}

/// How many migrations this build embeds (the files of `migrations/`): one
/// history row each, and the highest version the store supports.
pub(crate) fn migration_count() -> i64 {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let n = std::fs::read_dir(dir)
        .expect("migrations dir")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".sql"))
        .count();
    i64::try_from(n).expect("count")
}

/// The delegation settings `store` was opened with (its retention policy;
/// the rest at their defaults: the store reads nothing else).
pub(crate) fn delegation_of(store: &Store) -> DelegationConfig {
    let r = store.retention();
    DelegationConfig {
        max_retained: r.max_retained,
        retained_ttl_hours: r.ttl_hours,
        ..DelegationConfig::default()
    }
}
