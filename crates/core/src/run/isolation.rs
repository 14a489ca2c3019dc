//! Isolation: a git worktree per child and its change set (issue #38).
//!
//! The seam is [`Isolation`]; `retinue-worktree` implements it over the
//! `git` CLI. The orchestrator prepares a child's worktree before it runs
//! and records its change set when it ends; the parent-side commands
//! (`changes`, `apply`, `discard`) go through the same trait after the
//! delegate crate's authority check.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::receipts::ChangedFile;

/// `delegation.isolation` and the `isolation` argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IsolationMode {
    /// The child works in its parent's workspace (the default).
    #[default]
    None,
    /// The child works in its own git worktree.
    Worktree,
}

impl IsolationMode {
    /// Parses `none` / `worktree` (trimmed, case-insensitive).
    pub fn parse(text: &str) -> Option<IsolationMode> {
        match text.trim().to_ascii_lowercase().as_str() {
            "none" => Some(IsolationMode::None),
            "worktree" => Some(IsolationMode::Worktree),
            _ => None,
        }
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            IsolationMode::None => "none",
            IsolationMode::Worktree => "worktree",
        }
    }
}

/// Where a change set stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChangeState {
    /// Changes not yet applied or discarded.
    Pending,
    /// The child changed nothing (since the last apply).
    Empty,
    /// Applied to the parent's workspace.
    Applied,
    /// Dropped; the worktree is gone.
    Discarded,
}

impl ChangeState {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeState::Pending => "pending",
            ChangeState::Empty => "empty",
            ChangeState::Applied => "applied",
            ChangeState::Discarded => "discarded",
        }
    }
}

/// One file of a change set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileChange {
    /// `added`, `modified`, `deleted`, `renamed` (or `type_changed`).
    pub status: &'static str,
    /// Path relative to the repository.
    pub path: String,
    /// A renamed file's old path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub old_path: Option<String>,
    /// Lines added (`None`: binary).
    pub added: Option<u64>,
    /// Lines removed (`None`: binary).
    pub removed: Option<u64>,
}

impl FileChange {
    /// The receipts' view of this file.
    pub fn changed(&self) -> ChangedFile {
        ChangedFile { path: self.path.clone(), added: self.added, removed: self.removed }
    }
}

/// Who an isolated child belongs to, recorded with its worktree (the
/// authority check of `changes`/`apply`/`discard` reads it even after the
/// registry pruned the unit).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Owner {
    /// The subagent id.
    pub subagent_id: String,
    /// Its unit.
    pub delegation_id: String,
    /// The parent session that spawned it.
    pub parent_session_id: String,
    /// The profile key.
    pub owner_profile: String,
}

/// An isolated child's change set.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChangeSet {
    /// Whose.
    #[serde(flatten)]
    pub owner: Owner,
    /// Its state.
    pub state: ChangeState,
    /// The repository the parent's workspace is in (its top level).
    pub repository: PathBuf,
    /// The parent's workspace (where `apply` writes).
    pub workspace: PathBuf,
    /// The child's worktree.
    pub worktree: PathBuf,
    /// Whether the worktree is still on disk (`false`: removed by hand).
    pub worktree_present: bool,
    /// The branch (`retinue/<subagent_id>`).
    pub branch: String,
    /// The commit the change set starts from.
    pub base: String,
    /// The commit holding the child's changes (`base` when none).
    pub head: String,
    /// The files changed from `base` to `head`.
    pub files: Vec<FileChange>,
    /// Lines added over every text file.
    pub insertions: u64,
    /// Lines removed over every text file.
    pub deletions: u64,
    /// When the change set was last recorded (Unix seconds).
    pub recorded_at: Option<f64>,
    /// Untracked files of the parent's workspace at spawn (never copied).
    pub untracked_not_copied: u64,
    /// The unified diff, when asked for (bounded; see `diff_truncated`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff: Option<String>,
    /// Whether `diff` was cut at the bound.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub diff_truncated: bool,
}

impl ChangeSet {
    /// `3 files changed, +10 −2`.
    pub fn diffstat(&self) -> String {
        let n = self.files.len();
        format!(
            "{n} file{} changed, +{} −{}",
            if n == 1 { "" } else { "s" },
            self.insertions,
            self.deletions
        )
    }
}

/// Why an isolation operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IsolationError {
    /// The workspace is not inside a git repository.
    #[error(
        "isolation `worktree` needs a git repository: {workspace} is not inside one (use \
         isolation `none`, or run `git init` and commit)"
    )]
    NotARepository {
        /// The workspace.
        workspace: String,
    },
    /// The repository has no commit to branch from.
    #[error("isolation `worktree` needs a commit: the repository at {repository} has none yet")]
    NoCommit {
        /// The repository.
        repository: String,
    },
    /// No worktree was ever recorded for this child.
    #[error("no change set for '{subagent_id}' (it was not spawned with isolation `worktree`)")]
    Unknown {
        /// The id asked for.
        subagent_id: String,
    },
    /// The worktree is gone (removed by hand, or discarded).
    #[error(
        "the worktree of '{subagent_id}' is gone ({worktree}); `retinue discard` cleans its record"
    )]
    Gone {
        /// The child.
        subagent_id: String,
        /// Where it was.
        worktree: String,
    },
    /// The change set was applied before.
    #[error("the change set of '{subagent_id}' is already applied")]
    AlreadyApplied {
        /// The child.
        subagent_id: String,
    },
    /// The change set was discarded before.
    #[error("the change set of '{subagent_id}' was discarded")]
    Discarded {
        /// The child.
        subagent_id: String,
    },
    /// The change set is empty: nothing to apply.
    #[error("the change set of '{subagent_id}' is empty: nothing to apply")]
    NothingToApply {
        /// The child.
        subagent_id: String,
    },
    /// A three-way merge into the parent's workspace conflicts; nothing
    /// was applied.
    #[error("conflict: applying the change set of '{subagent_id}' conflicts in {}; nothing was applied", files.join(", "))]
    Conflict {
        /// The child.
        subagent_id: String,
        /// The conflicting paths (relative to the repository).
        files: Vec<String>,
    },
    /// A git command failed.
    #[error("git {operation} failed: {message}")]
    Git {
        /// What was run.
        operation: String,
        /// What git said (clipped).
        message: String,
    },
    /// A file system operation failed.
    #[error("{operation} failed: {message}")]
    Io {
        /// What was done.
        operation: String,
        /// The error.
        message: String,
    },
}

/// Worktrees and change sets. Object-safe and synchronous (mockall).
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait Isolation: Send + Sync {
    /// Checks that `workspace` can be isolated (inside a repository with a
    /// commit) without writing anything.
    fn check(&self, workspace: &Path) -> Result<(), IsolationError>;
    /// Where `subagent_id`'s workspace will be once [`Isolation::prepare`]d
    /// (recorded in its manifest: a follow-up whose worktree record is
    /// gone is then refused, never run in the shared workspace).
    fn workspace_of(&self, workspace: &Path, subagent_id: &str) -> Result<PathBuf, IsolationError>;
    /// Creates `owner`'s worktree from the workspace's `HEAD` plus its
    /// uncommitted tracked changes; returns the child's workspace inside it.
    fn prepare(&self, workspace: &Path, owner: &Owner) -> Result<PathBuf, IsolationError>;
    /// The workspace of an isolated child that resumes (`None`: the child
    /// was not isolated).
    fn reopen(&self, subagent_id: &str) -> Result<Option<PathBuf>, IsolationError>;
    /// Commits what the child changed on its branch and records the
    /// change set.
    fn record(&self, subagent_id: &str) -> Result<ChangeSet, IsolationError>;
    /// The change set of `subagent_id` (with its diff when `diff`).
    fn change_set(
        &self,
        subagent_id: &str,
        diff: bool,
    ) -> Result<Option<ChangeSet>, IsolationError>;
    /// Every recorded change set.
    fn list(&self) -> Result<Vec<ChangeSet>, IsolationError>;
    /// Applies the change set to the parent's workspace (three-way); on a
    /// conflict nothing is written.
    fn apply(&self, subagent_id: &str) -> Result<ChangeSet, IsolationError>;
    /// Drops the change set and removes the worktree and its branch.
    fn discard(&self, subagent_id: &str) -> Result<ChangeSet, IsolationError>;
    /// Forgets a child no longer retained: removes its worktree, branch and
    /// record when its changes were applied, discarded or empty (`true`);
    /// a pending change set is kept (`false`).
    fn forget(&self, subagent_id: &str) -> Result<bool, IsolationError>;
}
