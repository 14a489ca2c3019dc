//! `retinue-testkit`: test support shared by every Retinue crate's tests.
//!
//! It depends on core, config and the SQLite store (never on a layer above) and offers:
//! * [`TempHome`]: a throw-away `HERMES_HOME` with its `state.db` path and a
//!   [`Store`] opened on it with a [`ManualClock`];
//! * [`SessionGraphBuilder`]: session graphs for the authority rules (roots,
//!   compression continuations, branches, delegate children, tool sessions,
//!   strangers, and — through raw SQL — links the store would refuse: missing
//!   parents, cycles, malformed `model_config` text);
//! * [`dispatch_and_retain`]: the semantics §10.1 fixture unit;
//! * [`conformance`]: the backend conformance suite, written once against the
//!   seam traits and run by every storage backend;
//! * [`scripted`]: a deterministic [`ChildRuntime`](retinue_core::run::ChildRuntime)
//!   and a recording completion sink for the orchestrator's tests (never a
//!   runtime for a user's real home: no shipped crate depends on testkit);
//! * [`fake_model::FakeModel`]: a scripted OpenAI-compatible model server on
//!   127.0.0.1 (text, tool calls, SSE streams, usage, delays, 429/5xx/401,
//!   malformed bodies, dropped connections), recording every request.
//!
//! Helpers panic (with the failing operation in the message) instead of
//! returning errors: they are meant for tests, where a failed fixture is a
//! failed test.
//!
//! ```
//! use retinue_testkit::{SessionGraphBuilder, TempHome, T0};
//! let home = TempHome::new();
//! let store = home.open_store(home.clock(T0));
//! SessionGraphBuilder::new(&store)
//!     .root("A")
//!     .continuation("B", "A")
//!     .branch("BR", "A")
//!     .stranger("S");
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use retinue_core::{ChildManifest, NewSession, SessionStore, UnitDraft, UnitLifecycle};
use retinue_store::{Store, StoreOptions};
use serde_json::Value;

pub mod conformance;
pub mod scripted;
pub use retinue_fake_model as fake_model;
pub mod hermes;
pub mod otlp;
pub mod workload;
pub use fake_model::{FakeModel, FakeToolCall, RecordedRequest, Reply, Usage};
pub use hermes::{HermesDb, HermesFixture, HermesSession, HermesUnit};
pub use retinue_core::{Clock, ManualClock};
/// The raw SQLite driver, for tests that must write what the store refuses.
pub use rusqlite;

/// A fixed, arbitrary start time for manual clocks (2026-05-28T20:26:40Z).
pub const T0: f64 = 1_780_000_000.0;

/// The §10.1 fixture child's subagent id.
pub const FIXTURE_SUBAGENT_ID: &str = "sa-0-abc12345";
/// The §10.1 fixture child's session id.
pub const FIXTURE_CHILD_SESSION: &str = "child-sess-1";
/// The §10.1 fixture child's model.
pub const FIXTURE_MODEL: &str = "test/model";
/// The §10.1 fixture child's goal.
pub const FIXTURE_GOAL: &str = "do the thing";

/// A manual clock stopped at `at`, shareable with a [`Store`].
pub fn manual_clock(at: f64) -> Arc<ManualClock> {
    Arc::new(ManualClock::new(at))
}

/// A temporary `HERMES_HOME`, deleted on drop.
#[derive(Debug)]
pub struct TempHome {
    dir: tempfile::TempDir,
}

impl Default for TempHome {
    fn default() -> Self {
        TempHome::new()
    }
}

impl TempHome {
    /// Creates an empty temporary home.
    ///
    /// # Panics
    /// If the temporary directory cannot be created.
    #[track_caller]
    pub fn new() -> TempHome {
        match tempfile::Builder::new().prefix("retinue-home-").tempdir() {
            Ok(dir) => TempHome { dir },
            Err(e) => panic!("cannot create a temporary home: {e}"),
        }
    }

    /// The home directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `<home>/state.db`.
    pub fn db_path(&self) -> PathBuf {
        self.dir.path().join("state.db")
    }

    /// A manual clock stopped at `at` (convenience for [`manual_clock`]).
    pub fn clock(&self, at: f64) -> Arc<ManualClock> {
        manual_clock(at)
    }

    /// Opens the store on `state.db` with `clock` and no profile (`''`).
    ///
    /// # Panics
    /// If the store cannot be opened.
    #[track_caller]
    pub fn open_store(&self, clock: Arc<ManualClock>) -> Store {
        self.open_store_with(StoreOptions::default().with_clock(clock))
    }

    /// Opens the store on `state.db` with `clock` and the profile key `profile`.
    ///
    /// # Panics
    /// If the store cannot be opened.
    #[track_caller]
    pub fn open_store_as(&self, clock: Arc<ManualClock>, profile: &str) -> Store {
        self.open_store_with(StoreOptions::default().with_clock(clock).with_profile(profile))
    }

    /// Opens the store on `state.db` with explicit options.
    ///
    /// # Panics
    /// If the store cannot be opened.
    #[track_caller]
    pub fn open_store_with(&self, opts: StoreOptions) -> Store {
        match Store::open(self.db_path(), opts) {
            Ok(store) => store,
            Err(e) => panic!("cannot open the store in {}: {e}", self.path().display()),
        }
    }

    /// A raw connection to `state.db` with foreign keys OFF (to write rows the
    /// store refuses) and a 10 s busy timeout.
    ///
    /// # Panics
    /// If the file cannot be opened.
    #[track_caller]
    pub fn raw_connection(&self) -> rusqlite::Connection {
        raw_connection(&self.db_path())
    }

    /// Runs a batch of raw SQL on `state.db` (foreign keys OFF).
    ///
    /// # Panics
    /// If the SQL fails.
    #[track_caller]
    pub fn exec(&self, sql: &str) {
        if let Err(e) = self.raw_connection().execute_batch(sql) {
            panic!("raw SQL failed: {e}\n{sql}");
        }
    }
}

#[track_caller]
fn raw_connection(path: &Path) -> rusqlite::Connection {
    let conn = match rusqlite::Connection::open(path) {
        Ok(conn) => conn,
        Err(e) => panic!("cannot open {}: {e}", path.display()),
    };
    if let Err(e) = conn.execute_batch("PRAGMA busy_timeout = 10000; PRAGMA foreign_keys = OFF;") {
        panic!("cannot configure the raw connection to {}: {e}", path.display());
    }
    conn
}

/// Builds session graphs in a [`Store`]'s `sessions` table.
///
/// Ordinary sessions go through [`SessionStore`]; what the store would refuse
/// (a parent that has no row, cycles, unparsable `model_config`) is written
/// with raw SQL. Every method returns `&Self` for chaining and panics on
/// failure. Sessions are started at the store clock's time.
#[derive(Debug)]
pub struct SessionGraphBuilder<'a> {
    store: &'a Store,
}

impl<'a> SessionGraphBuilder<'a> {
    /// A builder writing into `store`.
    pub fn new(store: &'a Store) -> SessionGraphBuilder<'a> {
        SessionGraphBuilder { store }
    }

    /// The store written into.
    pub fn store(&self) -> &'a Store {
        self.store
    }

    /// Creates a session through the store (a parent without a row is stored unlinked).
    ///
    /// # Panics
    /// If the store refuses it.
    #[track_caller]
    pub fn session(&self, session: &NewSession) -> &Self {
        if let Err(e) = self.store.create_session(session) {
            panic!("create_session({}) failed: {e}", session.id);
        }
        self
    }

    #[track_caller]
    fn simple(
        &self,
        id: &str,
        source: &str,
        parent: Option<&str>,
        model_config: Option<Value>,
    ) -> &Self {
        self.session(&NewSession {
            id: id.to_owned(),
            source: source.to_owned(),
            model: Some("test/model".to_owned()),
            model_config,
            parent_session_id: parent.map(str::to_owned),
            profile_name: None,
            started_at: None,
        })
    }

    /// A live `cli` session with no parent (a lineage root).
    #[track_caller]
    pub fn root(&self, id: &str) -> &Self {
        self.simple(id, "cli", None, None)
    }

    /// A live `cli` session with no parent, unrelated to anything else.
    #[track_caller]
    pub fn stranger(&self, id: &str) -> &Self {
        self.root(id)
    }

    /// A live `cli` child of `parent` with no marker, after ending `parent`
    /// with `compression` (a no-op when `parent` has already ended).
    #[track_caller]
    pub fn continuation(&self, id: &str, parent: &str) -> &Self {
        self.end(parent, "compression");
        self.plain_child(id, parent)
    }

    /// A live `cli` child of `parent` with no marker; `parent` is left as it is.
    #[track_caller]
    pub fn plain_child(&self, id: &str, parent: &str) -> &Self {
        self.simple(id, "cli", Some(parent), None)
    }

    /// A `cli` branch of `parent`: `model_config` `{"_branched_from": parent}`.
    #[track_caller]
    pub fn branch(&self, id: &str, parent: &str) -> &Self {
        let mc = serde_json::json!({ "_branched_from": parent });
        self.simple(id, "cli", Some(parent), Some(mc))
    }

    /// A `delegate` child of `parent`: `model_config` `{"_delegate_from": parent}`.
    #[track_caller]
    pub fn delegate_child(&self, id: &str, parent: &str) -> &Self {
        let mc = serde_json::json!({ "_delegate_from": parent });
        self.simple(id, "delegate", Some(parent), Some(mc))
    }

    /// A `tool` session, optionally a child of `parent`.
    #[track_caller]
    pub fn tool_session(&self, id: &str, parent: Option<&str>) -> &Self {
        self.simple(id, "tool", parent, None)
    }

    /// A session with any `source`, parent and raw `model_config` text
    /// (`"[1]"`, `"{bad"`, `{"_branched_from":null}`, …), written with raw
    /// SQL: the parent is linked even when it has no row.
    ///
    /// # Panics
    /// If the insert fails.
    #[track_caller]
    pub fn raw_session(
        &self,
        id: &str,
        source: &str,
        parent: Option<&str>,
        model_config: Option<&str>,
    ) -> &Self {
        let now = self.store.clock().now();
        let conn = raw_connection(&self.store.path());
        if let Err(e) = conn.execute(
            "INSERT INTO sessions (id, source, model, model_config, parent_session_id, started_at) \
             VALUES (?1, ?2, 'test/model', ?3, ?4, ?5)",
            rusqlite::params![id, source, model_config, parent, now],
        ) {
            panic!("raw insert of session {id} failed: {e}");
        }
        self
    }

    /// Sets `id`'s parent to `parent` (or NULL) with raw SQL, bypassing the
    /// foreign key: missing parents and cycles.
    ///
    /// # Panics
    /// If the update fails or `id` has no row.
    #[track_caller]
    pub fn link(&self, id: &str, parent: Option<&str>) -> &Self {
        let conn = raw_connection(&self.store.path());
        match conn.execute(
            "UPDATE sessions SET parent_session_id = ?1 WHERE id = ?2",
            rusqlite::params![parent, id],
        ) {
            Ok(1) => self,
            Ok(n) => panic!("link({id}): {n} rows updated"),
            Err(e) => panic!("link({id}) failed: {e}"),
        }
    }

    /// Ends `id` with `reason` (the first reason wins).
    ///
    /// # Panics
    /// If the store fails.
    #[track_caller]
    pub fn end(&self, id: &str, reason: &str) -> &Self {
        if let Err(e) = self.store.end_session(id, &retinue_core::EndReason::parse(reason)) {
            panic!("end_session({id}) failed: {e}");
        }
        self
    }

    /// Ends `id` with `compression`.
    #[track_caller]
    pub fn compress(&self, id: &str) -> &Self {
        self.end(id, "compression")
    }

    /// Two sessions that are each other's parent, both ended `compression`.
    #[track_caller]
    pub fn cycle(&self, a: &str, b: &str) -> &Self {
        self.root(a).root(b).compress(a).compress(b).link(a, Some(b)).link(b, Some(a))
    }

    /// A compression chain `<prefix>0 → <prefix>1 → … → <prefix><last>`:
    /// every session but the last ended `compression`, the last live.
    #[track_caller]
    pub fn chain(&self, prefix: &str, last: usize) -> &Self {
        self.root(&format!("{prefix}0"));
        for i in 1..=last {
            self.continuation(&format!("{prefix}{i}"), &format!("{prefix}{}", i - 1));
        }
        self
    }
}

/// Inserts a unit spawned by `parent_session_id` with the §10.1 fixture child
/// (`sa-0-abc12345`, `child-sess-1`, `test/model`, "do the thing"), retains it
/// with usage `{"cost_usd": 0.5}`, and returns its delegation id.
///
/// # Panics
/// If the store fails.
#[track_caller]
pub fn dispatch_and_retain(registry: &dyn UnitLifecycle, parent_session_id: &str) -> String {
    retain_unit(
        registry,
        parent_session_id,
        "",
        vec![ChildManifest {
            subagent_id: FIXTURE_SUBAGENT_ID.to_owned(),
            session_id: FIXTURE_CHILD_SESSION.to_owned(),
            model: Some(FIXTURE_MODEL.to_owned()),
            goal: Some(FIXTURE_GOAL.to_owned()),
            ..ChildManifest::default()
        }],
    )
}

/// Inserts a unit spawned by `parent_session_id` with `owner_profile` and
/// `children`, retains it with usage `{"cost_usd": 0.5}`, and returns its id.
///
/// # Panics
/// If the store fails.
#[track_caller]
pub fn retain_unit(
    registry: &dyn UnitLifecycle,
    parent_session_id: &str,
    owner_profile: &str,
    children: Vec<ChildManifest>,
) -> String {
    let draft = UnitDraft {
        parent_session_id: Some(parent_session_id.to_owned()),
        owner_profile: owner_profile.to_owned(),
        children,
        ..UnitDraft::default()
    };
    let id = match registry.insert_unit(&draft) {
        Ok(id) => id,
        Err(e) => panic!("insert_unit failed: {e}"),
    };
    let usage = serde_json::json!({ "cost_usd": 0.5 });
    match registry.retain_completed_delegation(&id, Some(&usage)) {
        Ok(true) => id,
        Ok(false) => panic!("retain_completed_delegation({id}) changed nothing"),
        Err(e) => panic!("retain_completed_delegation({id}) failed: {e}"),
    }
}

/// The PostgreSQL server the team-mode tests use (`RETINUE_PG_URL`), or
/// `None` — after a loud message naming `suite` — when they may skip.
///
/// # Panics
/// When the URL is unset but `CI` or `RETINUE_REQUIRE_PG` is set: in CI the
/// PostgreSQL tests must run, never skip silently (`cargo xtask test` starts
/// a throwaway cluster and sets the URL).
pub fn pg_url(suite: &str) -> Option<String> {
    match std::env::var("RETINUE_PG_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            let required = ["CI", "RETINUE_REQUIRE_PG"]
                .iter()
                .any(|v| std::env::var(v).is_ok_and(|x| !x.is_empty() && x != "0" && x != "false"));
            assert!(
                !required,
                "RETINUE_PG_URL is unset but CI/RETINUE_REQUIRE_PG is set: the {suite} must run \
                 (use `cargo xtask test`, which starts a throwaway cluster)"
            );
            eprintln!(
                "\n!!! SKIPPING the {suite}: RETINUE_PG_URL is unset. Run `cargo xtask test`, or \
                 `cargo xtask pg-start` and export the line it prints. !!!\n"
            );
            None
        }
    }
}
