//! `retinue-delegate`: the `delegate_task` tool.
//!
//! The typed core, [`Delegator::delegate`], takes a [`DelegateRequest`] (a
//! spawn of one or more tasks, or a follow-up) and the calling parent's
//! [`ParentContext`] and returns a [`DelegateOutcome`] or a [`DelegateError`]
//! (never a panic, never a partial write): the orchestration core. The JSON
//! tool, [`tool`] ([`Delegator::delegate_task`] and the schema), is a thin
//! adapter over it: parse, call, render; the core never reads the tool's
//! arguments.
//! Every delegation — sync or background — becomes a durable unit; children
//! that complete are retained and can be followed up, budget-exempt, by the
//! parent's compression lineage. The crate reaches storage only through the
//! store's traits and the lineage and usage crates; models only through the
//! [`ChildRuntime`] trait.

mod approvals;
mod background;
mod budget;
mod decide;
mod error;
mod follow_up;
mod ids;
mod isolated;
mod live;
mod nested;
mod request;
mod results;
mod spawn;
pub mod telemetry;
pub mod texts;
pub mod tool;
pub mod toolsets;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use retinue_config::OrchestratorPolicy;
use retinue_core::Backend;
use retinue_lineage::LineageAuthority;

pub use background::{CancelReport, Collector, SteerReport, WaitEntry, WaitReport, WaitState};
pub use decide::{Decider, Ruling, approval_json, is_pending};
pub use error::{DelegateError, DelegateErrorKind};
pub use request::{
    DelegateOutcome, DelegateRequest, Dispatch, DispatchedChild, FollowUp, FollowUpReport,
    SpawnRequest, TaskSpec, UnitReport,
};
pub use results::{ChildReport, change_set_json, model_text, receipt_lines, receipts_json};
pub use retinue_core::run::{
    BudgetMeter, CallPermit, CallPlan, CallRefusal, CallUsage, CancelReason, CancelToken,
    ChildHandle, ChildOutcome, ChildRuntime, ChildSpec, CompletionSink, Delegate, RunContext,
    RunInput, RunTokens, RuntimeError, SinkError, TranscriptSink,
};
#[cfg(any(test, feature = "mocks"))]
pub use retinue_core::run::{MockChildRuntime, MockCompletionSink, MockTranscriptSink};
pub use tool::{delegate_task_schema, error_json, parse_follow_up, parse_tasks};

/// The calling parent agent.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParentContext {
    /// The parent's session id.
    pub session_id: Option<String>,
    /// Delegation depth of the parent (0 at top level).
    pub depth: u32,
    /// The parent's current turn id.
    pub turn_id: Option<String>,
    /// The parent's model (inherited when the config names none).
    pub model: Option<String>,
    /// The parent's provider.
    pub provider: Option<String>,
    /// The parent's toolsets.
    pub toolsets: Vec<String>,
    /// Whether the parent can receive detached (background) results.
    pub can_receive_detached: bool,
    /// The directory the children's tools work in (`None`: no workspace,
    /// so file and terminal tools refuse).
    pub workspace: Option<std::path::PathBuf>,
    /// The caller's W3C `traceparent` (`TRACEPARENT`, an MCP request's
    /// `_meta`): the delegation's spans are its children.
    pub trace_parent: Option<String>,
}

/// The collaborators a [`Delegator`] works through.
#[derive(Clone)]
pub struct DelegatorParts {
    /// The storage backend: registry, sessions, ledger and budget
    /// reservations.
    pub backend: Backend,
    /// Follow-up authority.
    pub authority: Arc<dyn LineageAuthority>,
    /// The child runtime.
    pub runtime: Arc<dyn ChildRuntime>,
    /// Where background completions go.
    pub completions: Option<Arc<dyn CompletionSink>>,
    /// The orchestrator's part of `delegation:` (no API key: the runtime
    /// holds it).
    pub config: OrchestratorPolicy,
    /// The process profile key.
    pub profile: String,
}

pub(crate) struct Inner {
    pub(crate) parts: DelegatorParts,
    pub(crate) live: live::LiveRegistry,
    pub(crate) paused: AtomicBool,
    pub(crate) background_slots: AtomicUsize,
    /// Signalled when a background slot frees (queued units wait on it).
    pub(crate) slot_freed: (Mutex<()>, std::sync::Condvar),
    pub(crate) finalize_lock: Mutex<()>,
    pub(crate) background_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Draws `n` random bytes as hex for new ids (the OS source, or an
    /// embedder's own).
    pub(crate) ids: IdSource,
    /// Starts a background unit's thread.
    pub(crate) threads: ThreadStarter,
    /// The embedder's inline approval prompter, if any.
    pub(crate) prompter: approvals::PrompterSlot,
    /// Where isolated children's worktrees live (set once, at build).
    pub(crate) isolation: std::sync::OnceLock<Arc<dyn retinue_core::run::Isolation>>,
}

/// Draws the hex of `n` random bytes for a new subagent or session id.
pub type IdSource = Arc<dyn Fn(usize) -> String + Send + Sync>;

/// A background unit's body, run once on its own thread.
pub type UnitBody = Box<dyn FnOnce() + Send>;

/// Starts a named thread running a background unit ([`std::thread::Builder`]
/// by default; an embedder's own policy, or a test's failure, otherwise).
pub type ThreadStarter =
    Arc<dyn Fn(String, UnitBody) -> std::io::Result<std::thread::JoinHandle<()>> + Send + Sync>;

/// Starts `body` on a thread named `name` through the delegator's starter.
pub(crate) fn spawn_thread(
    inner: &Inner,
    name: String,
    body: UnitBody,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    (inner.threads)(name, body)
}

fn std_threads() -> ThreadStarter {
    Arc::new(|name, body| std::thread::Builder::new().name(name).spawn(body))
}

/// The `delegate_task` tool. Cheap to clone; background units run on threads.
#[derive(Clone)]
pub struct Delegator {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Delegator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delegator")
            .field("profile", &self.inner.parts.profile)
            .finish_non_exhaustive()
    }
}

impl Delegator {
    /// The orchestrator policy it runs under.
    pub fn config(&self) -> &OrchestratorPolicy {
        &self.inner.parts.config
    }

    /// A tool over these collaborators.
    pub fn new(parts: DelegatorParts) -> Delegator {
        Delegator::new_with_ids(parts, Arc::new(ids::random_hex))
    }

    /// A tool whose new ids draw their random hex from `ids` (an
    /// embedder's own source; tests force collisions with it). A drawn id
    /// that is already in use is drawn again, never reused.
    pub fn new_with_ids(parts: DelegatorParts, ids: IdSource) -> Delegator {
        Delegator::build(parts, ids, std_threads())
    }

    /// The same delegator with worktrees for isolated children
    /// (`isolation: worktree`); without them such a spawn is refused. A
    /// second call changes nothing.
    pub fn with_isolation(self, isolation: Arc<dyn retinue_core::run::Isolation>) -> Delegator {
        if self.inner.isolation.set(isolation).is_err() {
            log::warn!("the delegator's isolation was set already; kept the first");
        }
        self
    }

    fn build(parts: DelegatorParts, ids: IdSource, threads: ThreadStarter) -> Delegator {
        Delegator {
            inner: Arc::new(Inner {
                parts,
                live: live::LiveRegistry::default(),
                paused: AtomicBool::new(false),
                background_slots: AtomicUsize::new(0),
                slot_freed: (Mutex::new(()), std::sync::Condvar::new()),
                finalize_lock: Mutex::new(()),
                background_threads: Mutex::new(Vec::new()),
                ids,
                threads,
                prompter: approvals::PrompterSlot::new(),
                isolation: std::sync::OnceLock::new(),
            }),
        }
    }

    /// A tool whose background units start their threads through
    /// `threads` (an embedder's own thread policy; tests make it fail). A
    /// unit whose thread cannot start is finalised as failed at once, its
    /// slot and budget reservation given back.
    pub fn new_with_threads(parts: DelegatorParts, threads: ThreadStarter) -> Delegator {
        Delegator::build(parts, Arc::new(ids::random_hex), threads)
    }

    /// Asks `prompter` too about every approval request of this
    /// delegator's children (the CLI's inline prompt on a terminal); the
    /// first one set stays.
    pub fn set_approval_prompter(&self, prompter: Arc<dyn retinue_core::ApprovalPrompter>) {
        let _ = self.inner.prompter.set(prompter);
    }

    /// Pauses or resumes spawning (follow-ups are never paused).
    pub fn set_spawn_paused(&self, paused: bool) {
        self.inner.paused.store(paused, Ordering::SeqCst);
    }

    /// Waits for background units started so far.
    pub fn wait_background(&self) {
        let handles: Vec<_> = std::mem::take(
            &mut *self
                .inner
                .background_threads
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for h in handles {
            if h.join().is_err() {
                log::error!("a background delegation thread panicked");
            }
        }
    }

    /// Registers a running child so follow-ups can steer it (for runtimes
    /// whose children are started elsewhere).
    pub fn register_live(&self, child: live::LiveChild) {
        self.inner.live.insert(child);
    }

    /// Removes a running child from the live registry.
    pub fn unregister_live(&self, subagent_id: &str) {
        self.inner.live.remove(subagent_id);
    }

    /// Why a spawn by `parent` would be refused before its tasks are read
    /// (hermes's check order: paused, then depth).
    pub(crate) fn spawn_refusal(&self, parent: &ParentContext) -> Option<DelegateError> {
        let max = self.inner.parts.config.max_spawn_depth;
        if self.inner.paused.load(Ordering::SeqCst) {
            Some(DelegateError::Paused)
        } else if parent.depth >= max {
            Some(DelegateError::DepthExceeded { depth: parent.depth, max })
        } else {
            None
        }
    }

    /// The typed core: runs one call for `parent`. `cancel` stops the
    /// call's children (each also gets `child_timeout_seconds`); a stopped
    /// child reports what it did and is billed for it.
    pub fn delegate(
        &self,
        request: &DelegateRequest,
        parent: &ParentContext,
        cancel: &CancelToken,
    ) -> Result<DelegateOutcome, DelegateError> {
        match request {
            DelegateRequest::FollowUp(fu) => follow_up::run(&self.inner, fu, parent, cancel),
            DelegateRequest::Spawn(spawn) => {
                if let Some(refusal) = self.spawn_refusal(parent) {
                    return Err(refusal);
                }
                let max = self.inner.parts.config.max_concurrent_children;
                if spawn.tasks.is_empty() {
                    return Err(DelegateError::InvalidArguments(texts::NO_GOAL_OR_TASKS.into()));
                }
                if spawn.tasks.len() > max {
                    return Err(DelegateError::InvalidArguments(texts::too_many_tasks(
                        spawn.tasks.len(),
                        max,
                    )));
                }
                spawn::run(&self.inner, spawn, parent, cancel)
            }
        }
    }
}

pub use live::LiveChild;
