//! `retinue-worktree`: isolated children over the `git` CLI (issue #38).
//!
//! [`GitWorktrees`] implements core's [`Isolation`] seam. Each isolated
//! child works in a worktree `ROOT/<subagent_id>` (ROOT is
//! `HOME/retinue/worktrees`, never inside the workspace) on a branch
//! `retinue/<subagent_id>`, created from the workspace's `HEAD` plus its
//! uncommitted tracked changes (untracked files are not copied; the record
//! counts them). When the child ends, what it changed is committed on its
//! branch (hooks off, no signing) and recorded in `ROOT/<subagent_id>.json`
//! beside the worktree: the change set is that commit range; the record
//! keeps its state (pending, empty, applied, discarded), its owner (for the
//! authority check, even after the registry pruned the unit) and its
//! files. Every git call names its directories explicitly, so a child that
//! deletes its worktree's `.git` file changes nothing here.

mod apply;
mod git;
mod record;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use retinue_core::run::{ChangeSet, ChangeState, Isolation, IsolationError, Owner};
use retinue_core::{Clock, SystemClock};

use crate::git::Git;
use crate::record::{Record, StoredFile};

/// The longest diff a change set shows (bytes); a longer one is cut.
pub const DIFF_MAX_BYTES: usize = 1 << 20;

/// Worktrees under one root, over the `git` CLI.
#[derive(Clone)]
pub struct GitWorktrees {
    root: PathBuf,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for GitWorktrees {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitWorktrees").field("root", &self.root).finish_non_exhaustive()
    }
}

/// `HOME/retinue/worktrees`.
pub fn root_of(home: &Path) -> PathBuf {
    home.join("retinue").join("worktrees")
}

fn io(operation: String, e: &std::io::Error) -> IsolationError {
    IsolationError::Io { operation, message: e.to_string() }
}

/// The oldest git this crate works with: `merge-tree --write-tree
/// --merge-base` came with 2.40.
pub const GIT_MIN: (u32, u32) = (2, 40);

/// `(major, minor)` of a `git version X.Y.Z…` line.
fn parse_version(text: &str) -> Option<(u32, u32)> {
    let version = text.split_whitespace().nth(2)?;
    let mut parts = version.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Refuses a missing or too old `git`, once per process.
fn git_usable() -> Result<(), IsolationError> {
    static CHECKED: std::sync::OnceLock<Result<(), IsolationError>> = std::sync::OnceLock::new();
    CHECKED
        .get_or_init(|| {
            let refuse = |found: String| IsolationError::Git {
                operation: "--version".to_owned(),
                message: format!(
                    "isolation `worktree` needs git {}.{} or newer; found {found}",
                    GIT_MIN.0, GIT_MIN.1
                ),
            };
            let out = Git::at(Path::new("."))
                .args(["--version"])
                .run()
                .map_err(|e| refuse(e.to_string()))?;
            match parse_version(&out.text()) {
                Some(v) if v >= GIT_MIN => Ok(()),
                _ => Err(refuse(out.text())),
            }
        })
        .clone()
}

/// The repository's top level and the workspace's path inside it.
fn locate(workspace: &Path) -> Result<(PathBuf, String), IsolationError> {
    let not_repo = || IsolationError::NotARepository { workspace: workspace.display().to_string() };
    let (out, _) = Git::at(workspace).args(["rev-parse", "--show-toplevel"]).run_any()?;
    if out.code != Some(0) || out.text().is_empty() {
        return Err(not_repo());
    }
    let top = PathBuf::from(out.text());
    let prefix = Git::at(workspace).args(["rev-parse", "--show-prefix"]).run()?.text();
    let (head, _) =
        Git::at(&top).args(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"]).run_any()?;
    if head.code != Some(0) {
        return Err(IsolationError::NoCommit { repository: top.display().to_string() });
    }
    Ok((top, prefix.trim_end_matches('/').to_owned()))
}

/// Refuses a worktree holding a git repository of the child's making (a
/// `.git` below its top): `git add` would read that repository's config,
/// whose hooks and filters the child wrote. Links are not followed.
fn planted_repositories(worktree: &Path) -> Result<(), IsolationError> {
    let mut stack = vec![worktree.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries =
            std::fs::read_dir(&dir).map_err(|e| io(format!("reading {}", dir.display()), &e))?;
        for entry in entries {
            let entry = entry.map_err(|e| io(format!("reading {}", dir.display()), &e))?;
            let path = entry.path();
            if entry.file_name() == ".git" {
                if dir != worktree {
                    return Err(IsolationError::Io {
                        operation: "recording the change set".to_owned(),
                        message: format!(
                            "the child left a git repository at {}; its change set is not \
                             recorded (remove it, or discard the change set)",
                            path.display()
                        ),
                    });
                }
                continue;
            }
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(path);
            }
        }
    }
    Ok(())
}

/// `(status, old path, path)` of every file from `base` to `head`, with
/// line counts.
fn diff_files(top: &Path, base: &str, head: &str) -> Result<Vec<StoredFile>, IsolationError> {
    let common = ["diff", "--no-ext-diff", "--no-textconv", "-M", "-z"];
    let names = Git::at(top).args(common).args(["--name-status", base, head]).run()?;
    let counts = Git::at(top).args(common).args(["--numstat", base, head]).run()?;
    let mut files = Vec::new();
    let mut fields =
        names.stdout.split(|b| *b == 0).map(|f| String::from_utf8_lossy(f).into_owned());
    while let Some(code) = fields.next().filter(|c| !c.is_empty()) {
        let (status, old_path) = match code.chars().next() {
            Some('A') => ("added", None),
            Some('D') => ("deleted", None),
            Some('R') => ("renamed", fields.next()),
            Some('C') => {
                let _source = fields.next();
                ("added", None)
            }
            Some('T') => ("type_changed", None),
            _ => ("modified", None),
        };
        let Some(path) = fields.next() else { break };
        files.push(StoredFile {
            status: status.to_owned(),
            path,
            old_path,
            added: None,
            removed: None,
        });
    }
    // numstat -z: "a\tr\tpath\0", or for a rename "a\tr\t\0old\0new\0".
    let mut parts =
        counts.stdout.split(|b| *b == 0).map(|f| String::from_utf8_lossy(f).into_owned());
    while let Some(entry) = parts.next().filter(|e| !e.is_empty()) {
        let mut cols = entry.splitn(3, '\t');
        let (a, r, p) = (cols.next(), cols.next(), cols.next().unwrap_or_default());
        let path = if p.is_empty() {
            let _old = parts.next();
            parts.next().unwrap_or_default()
        } else {
            p.to_owned()
        };
        if let Some(f) = files.iter_mut().find(|f| f.path == path) {
            f.added = a.and_then(|n| n.parse().ok());
            f.removed = r.and_then(|n| n.parse().ok());
        }
    }
    Ok(files)
}

impl GitWorktrees {
    /// Worktrees under `root` (see [`root_of`]).
    pub fn new(root: PathBuf) -> GitWorktrees {
        GitWorktrees { root, clock: Arc::new(SystemClock) }
    }

    /// The same, with `clock` for the records' times.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> GitWorktrees {
        self.clock = clock;
        self
    }

    /// `id`'s record under its lock (an unknown id takes no lock and
    /// creates nothing).
    fn locked(&self, id: &str) -> Result<(record::Lock, Record), IsolationError> {
        let unknown = || IsolationError::Unknown { subagent_id: id.trim().to_owned() };
        record::load(&self.root, id)?.ok_or_else(unknown)?;
        let lock = record::lock(&self.root, id)?;
        Ok((lock, record::load(&self.root, id)?.ok_or_else(unknown)?))
    }

    fn view(&self, r: &Record, diff: bool) -> Result<ChangeSet, IsolationError> {
        let mut set = ChangeSet {
            owner: r.owner(),
            state: r.state(),
            repository: r.repository.clone(),
            workspace: r.workspace.clone(),
            worktree: r.worktree.clone(),
            worktree_present: r.worktree.is_dir(),
            branch: r.branch.clone(),
            base: r.base.clone(),
            head: r.head.clone(),
            files: r.files.iter().map(StoredFile::to_change).collect(),
            insertions: r.insertions,
            deletions: r.deletions,
            recorded_at: r.recorded_at,
            untracked_not_copied: r.untracked_not_copied,
            diff: None,
            diff_truncated: false,
        };
        if diff && r.state() != ChangeState::Discarded && !r.files.is_empty() {
            let out = Git::at(&r.repository)
                .args(["diff", "--no-ext-diff", "--no-textconv", "-M", &r.base, &r.head])
                .run()?;
            let mut bytes = out.stdout;
            set.diff_truncated = bytes.len() > DIFF_MAX_BYTES;
            bytes.truncate(DIFF_MAX_BYTES);
            set.diff = Some(String::from_utf8_lossy(&bytes).into_owned());
        }
        Ok(set)
    }

    /// Removes the worktree (by hand-removed or not) and its branch.
    fn remove_worktree(&self, r: &Record) -> Result<(), IsolationError> {
        let dir = r.worktree.display().to_string();
        if r.worktree.exists() {
            let (out, err) = Git::at(&r.repository)
                .args(["worktree", "remove", "--force", "--force", &dir])
                .run_any()?;
            if out.code != Some(0) {
                log::warn!("git worktree remove {dir}: {err}");
            }
        } else {
            let _ = Git::at(&r.repository).args(["worktree", "unlock", &dir]).run_any();
        }
        let _ = Git::at(&r.repository).args(["worktree", "prune"]).run_any();
        if r.worktree.exists() {
            std::fs::remove_dir_all(&r.worktree).map_err(|e| io(format!("removing {dir}"), &e))?;
        }
        let _ = Git::at(&r.repository).args(["branch", "-D", &r.branch]).run_any();
        Ok(())
    }

    /// The commit that starts a worktree: `HEAD`, or `HEAD` plus the
    /// uncommitted tracked changes (`git stash create` writes nothing to the
    /// workspace or the stash list).
    fn base_of(top: &Path) -> Result<String, IsolationError> {
        let head = Git::at(top).args(["rev-parse", "HEAD^{commit}"]).run()?.text();
        let stash = Git::at(top).args(["stash", "create"]).run()?.text();
        if stash.is_empty() {
            return Ok(head);
        }
        let tree = Git::at(top).args(["rev-parse", &format!("{stash}^{{tree}}")]).run()?.text();
        let message = "retinue: the workspace's uncommitted tracked changes at spawn";
        Ok(Git::at(top).args(["commit-tree", &tree, "-p", &head, "-m", message]).run()?.text())
    }
}

impl Isolation for GitWorktrees {
    fn check(&self, workspace: &Path) -> Result<(), IsolationError> {
        git_usable()?;
        locate(workspace).map(|_| ())
    }

    fn workspace_of(&self, workspace: &Path, subagent_id: &str) -> Result<PathBuf, IsolationError> {
        if !record::valid_id(subagent_id) {
            return Err(IsolationError::Unknown { subagent_id: subagent_id.to_owned() });
        }
        let (_, prefix) = locate(workspace)?;
        let dir = self.root.join(subagent_id);
        Ok(if prefix.is_empty() { dir } else { dir.join(prefix) })
    }

    fn prepare(&self, workspace: &Path, owner: &Owner) -> Result<PathBuf, IsolationError> {
        let id = owner.subagent_id.as_str();
        if !record::valid_id(id) {
            return Err(IsolationError::Unknown { subagent_id: id.to_owned() });
        }
        git_usable()?;
        let (top, prefix) = locate(workspace)?;
        std::fs::create_dir_all(&self.root)
            .map_err(|e| io(format!("creating {}", self.root.display()), &e))?;
        let _lock = record::lock(&self.root, id)?;
        let base = Self::base_of(&top)?;
        let untracked = Git::at(&top)
            .args(["ls-files", "--others", "--exclude-standard", "-z"])
            .run()?
            .stdout
            .split(|b| *b == 0)
            .filter(|p| !p.is_empty())
            .count() as u64;
        let dir = self.root.join(id);
        let branch = format!("retinue/{id}");
        let reason = format!("retinue child {id}");
        let dir_text = dir.display().to_string();
        Git::at(&top)
            .args(["worktree", "add", "--quiet", "--lock", "--reason", &reason, "-b", &branch])
            .args([dir_text.as_str(), base.as_str()])
            .run()?;
        let gitdir = Git::at(&dir).args(["rev-parse", "--absolute-git-dir"]).run()?.text();
        let record = Record {
            subagent_id: id.to_owned(),
            delegation_id: owner.delegation_id.clone(),
            parent_session_id: owner.parent_session_id.clone(),
            owner_profile: owner.owner_profile.clone(),
            repository: top,
            prefix: prefix.clone(),
            workspace: workspace.to_path_buf(),
            worktree: dir.clone(),
            gitdir: PathBuf::from(gitdir),
            branch,
            base: base.clone(),
            head: base,
            applied_head: None,
            state: ChangeState::Empty.as_str().to_owned(),
            files: Vec::new(),
            insertions: 0,
            deletions: 0,
            created_at: self.clock.now(),
            recorded_at: None,
            untracked_not_copied: untracked,
        };
        record::save(&self.root, &record)?;
        Ok(if prefix.is_empty() { dir } else { dir.join(prefix) })
    }

    fn reopen(&self, subagent_id: &str) -> Result<Option<PathBuf>, IsolationError> {
        let Some(r) = record::load(&self.root, subagent_id)? else { return Ok(None) };
        if r.state() == ChangeState::Discarded {
            return Err(IsolationError::Discarded { subagent_id: r.subagent_id });
        }
        if !r.worktree.is_dir() {
            return Err(IsolationError::Gone {
                subagent_id: r.subagent_id,
                worktree: r.worktree.display().to_string(),
            });
        }
        Ok(Some(if r.prefix.is_empty() { r.worktree } else { r.worktree.join(&r.prefix) }))
    }

    fn record(&self, subagent_id: &str) -> Result<ChangeSet, IsolationError> {
        let (_lock, mut r) = self.locked(subagent_id)?;
        match r.state() {
            ChangeState::Discarded => {
                return Err(IsolationError::Discarded { subagent_id: r.subagent_id });
            }
            _ if !r.worktree.is_dir() => {
                return Err(IsolationError::Gone {
                    subagent_id: r.subagent_id.clone(),
                    worktree: r.worktree.display().to_string(),
                });
            }
            _ => {}
        }
        planted_repositories(&r.worktree)?;
        let git_dir = format!("--git-dir={}", r.gitdir.display());
        let work_tree = format!("--work-tree={}", r.worktree.display());
        let in_tree = || Git::at(&r.worktree).args([git_dir.as_str(), work_tree.as_str()]);
        in_tree().args(["add", "-A"]).run()?;
        let tree = in_tree().args(["write-tree"]).run()?.text();
        let old_tree = Git::at(&r.repository)
            .args(["rev-parse", &format!("{}^{{tree}}", r.head)])
            .run()?
            .text();
        if tree != old_tree {
            let message = format!("retinue: changes of {}", r.subagent_id);
            let commit = Git::at(&r.repository)
                .args(["commit-tree", &tree, "-p", &r.head, "-m", &message])
                .run()?
                .text();
            let reference = format!("refs/heads/{}", r.branch);
            Git::at(&r.repository).args(["update-ref", &reference, &commit, &r.head]).run()?;
            r.head = commit;
        }
        if r.state() == ChangeState::Applied {
            if r.applied_head.as_deref() == Some(r.head.as_str()) {
                r.recorded_at = Some(self.clock.now());
                record::save(&self.root, &r)?;
                return self.view(&r, false);
            }
            // A follow-up after an apply: its change set starts there.
            r.base = r.applied_head.clone().unwrap_or_else(|| r.head.clone());
        }
        r.files = diff_files(&r.repository, &r.base, &r.head)?;
        r.insertions = r.files.iter().filter_map(|f| f.added).sum();
        r.deletions = r.files.iter().filter_map(|f| f.removed).sum();
        let state = if r.files.is_empty() { ChangeState::Empty } else { ChangeState::Pending };
        r.state = state.as_str().to_owned();
        r.recorded_at = Some(self.clock.now());
        record::save(&self.root, &r)?;
        self.view(&r, false)
    }

    fn change_set(
        &self,
        subagent_id: &str,
        diff: bool,
    ) -> Result<Option<ChangeSet>, IsolationError> {
        match record::load(&self.root, subagent_id)? {
            Some(r) => self.view(&r, diff).map(Some),
            None => Ok(None),
        }
    }

    fn list(&self) -> Result<Vec<ChangeSet>, IsolationError> {
        let mut out = Vec::new();
        for id in record::ids(&self.root)? {
            match record::load(&self.root, &id) {
                Ok(Some(r)) => out.push(self.view(&r, false)?),
                Ok(None) => {}
                Err(e) => log::warn!("change set {id} not read: {e}"),
            }
        }
        Ok(out)
    }

    fn apply(&self, subagent_id: &str) -> Result<ChangeSet, IsolationError> {
        git_usable()?;
        let (_lock, mut r) = self.locked(subagent_id)?;
        let id = r.subagent_id.clone();
        match r.state() {
            ChangeState::Applied => return Err(IsolationError::AlreadyApplied { subagent_id: id }),
            ChangeState::Discarded => return Err(IsolationError::Discarded { subagent_id: id }),
            ChangeState::Empty => return Err(IsolationError::NothingToApply { subagent_id: id }),
            ChangeState::Pending => {}
        }
        let paths: BTreeSet<String> = r
            .files
            .iter()
            .flat_map(|f| std::iter::once(f.path.clone()).chain(f.old_path.clone()))
            .collect();
        let _applying = record::lock_repository(&self.root, &r.repository)?;
        apply::three_way(&r.repository, &r.base, &r.head, &paths).map_err(|e| match e {
            IsolationError::Conflict { files, .. } => {
                IsolationError::Conflict { subagent_id: id.clone(), files }
            }
            other => other,
        })?;
        r.state = ChangeState::Applied.as_str().to_owned();
        r.applied_head = Some(r.head.clone());
        r.recorded_at = Some(self.clock.now());
        record::save(&self.root, &r)?;
        self.view(&r, false)
    }

    fn discard(&self, subagent_id: &str) -> Result<ChangeSet, IsolationError> {
        let (_lock, mut r) = self.locked(subagent_id)?;
        if r.state() == ChangeState::Discarded {
            return Err(IsolationError::Discarded { subagent_id: r.subagent_id });
        }
        self.remove_worktree(&r)?;
        r.state = ChangeState::Discarded.as_str().to_owned();
        r.recorded_at = Some(self.clock.now());
        record::save(&self.root, &r)?;
        self.view(&r, false)
    }

    fn forget(&self, subagent_id: &str) -> Result<bool, IsolationError> {
        let (lock, r) = match self.locked(subagent_id) {
            Ok(found) => found,
            Err(IsolationError::Unknown { .. }) => return Ok(false),
            Err(e) => return Err(e),
        };
        if r.state() == ChangeState::Pending {
            return Ok(false);
        }
        if r.state() != ChangeState::Discarded {
            self.remove_worktree(&r)?;
        }
        drop(lock);
        record::remove(&self.root, subagent_id)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn git_versions_parse() {
        assert_eq!(parse_version("git version 2.47.3"), Some((2, 47)));
        assert_eq!(parse_version("git version 2.39.5 (Apple Git-154)"), Some((2, 39)));
        assert_eq!(parse_version("git version 3.0"), Some((3, 0)));
        assert_eq!(parse_version("nonsense"), None);
        assert!(parse_version("git version 2.39.1").is_some_and(|v| v < GIT_MIN));
    }
}
