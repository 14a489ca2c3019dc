//! `retinue-delegate`: the `delegate_task` tool.
//!
//! One entry point, [`Delegator::delegate_task`], takes the tool's JSON
//! arguments and the calling parent's [`ParentContext`] and returns the JSON
//! result (`{"error": …}` on failure, never a panic, never a partial write).
//! Every delegation — sync or background — becomes a durable unit; children
//! that complete are retained and can be followed up, budget-exempt, by the
//! parent's compression lineage. The crate reaches storage only through the
//! store's traits and the lineage and usage crates.

mod args;
mod follow_up;
mod live;
mod results;
mod runtime;
mod schema;
pub mod scripted;
mod spawn;
pub mod texts;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use retinue_lineage::LineageAuthority;
use retinue_store::{Clock, DelegationConfig, Registry, SessionStore, UsageLedger};
use serde_json::{Value, json};

pub use args::{FollowUp, TaskSpec, parse_follow_up, parse_tasks};
pub use runtime::{
    ChildHandle, ChildOutcome, ChildRuntime, ChildSpec, CompletionSink, RunInput, TranscriptSink,
};
#[cfg(any(test, feature = "mocks"))]
pub use runtime::{MockChildRuntime, MockCompletionSink, MockTranscriptSink};
pub use schema::delegate_task_schema;

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
}

/// The collaborators a [`Delegator`] works through.
#[derive(Clone)]
pub struct DelegatorParts {
    /// Units and retention.
    pub registry: Arc<dyn Registry>,
    /// Sessions and transcripts.
    pub sessions: Arc<dyn SessionStore>,
    /// The usage ledger.
    pub ledger: Arc<dyn UsageLedger>,
    /// Follow-up authority.
    pub authority: Arc<dyn LineageAuthority>,
    /// The child runtime.
    pub runtime: Arc<dyn ChildRuntime>,
    /// Where background completions go.
    pub completions: Option<Arc<dyn CompletionSink>>,
    /// Time.
    pub clock: Arc<dyn Clock>,
    /// The `delegation:` configuration.
    pub config: DelegationConfig,
    /// The process profile key.
    pub profile: String,
}

pub(crate) struct Inner {
    pub(crate) parts: DelegatorParts,
    pub(crate) live: live::LiveRegistry,
    pub(crate) paused: AtomicBool,
    pub(crate) background_slots: AtomicUsize,
    pub(crate) finalize_lock: Mutex<()>,
    pub(crate) background_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
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

pub(crate) fn error(text: impl Into<String>) -> Value {
    json!({ "error": text.into() })
}

impl Delegator {
    /// A tool over these collaborators.
    pub fn new(parts: DelegatorParts) -> Delegator {
        Delegator {
            inner: Arc::new(Inner {
                parts,
                live: live::LiveRegistry::default(),
                paused: AtomicBool::new(false),
                background_slots: AtomicUsize::new(0),
                finalize_lock: Mutex::new(()),
                background_threads: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The tool schema with this delegator's limits.
    pub fn schema(&self) -> Value {
        delegate_task_schema(&self.inner.parts.config)
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

    /// The tool entry point (spec §6.2): JSON arguments in, JSON result out.
    pub fn delegate_task(&self, args: &Value, parent: Option<&ParentContext>) -> Value {
        let Some(parent) = parent else { return error(texts::NO_PARENT) };
        let args = if args.is_object() { args.clone() } else { json!({}) };
        if let Some(fu) = parse_follow_up(&args) {
            return match fu {
                Ok(fu) => follow_up::run(&self.inner, &fu, parent),
                Err(e) => error(e),
            };
        }
        if self.inner.paused.load(Ordering::SeqCst) {
            return error(texts::PAUSED);
        }
        let config = &self.inner.parts.config;
        if parent.depth >= config.max_spawn_depth {
            return error(texts::depth_limit(parent.depth, config.max_spawn_depth));
        }
        let tasks = match parse_tasks(&args, config.max_concurrent_children) {
            Ok(t) => t,
            Err(e) => return error(e),
        };
        spawn::run(&self.inner, &args, tasks, parent)
    }
}

pub use live::LiveChild;
