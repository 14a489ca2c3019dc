//! A change set's record: one JSON file next to the worktree
//! (`ROOT/<subagent_id>.json`), written whole and renamed into place, and
//! a lock file per child so record, apply and discard never interleave.

use std::fs::File;
use std::path::{Path, PathBuf};

use retinue_core::run::{ChangeState, FileChange, IsolationError, Owner};
use serde::{Deserialize, Serialize};

/// What is kept of one isolated child.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Record {
    pub(crate) subagent_id: String,
    pub(crate) delegation_id: String,
    pub(crate) parent_session_id: String,
    pub(crate) owner_profile: String,
    pub(crate) repository: PathBuf,
    /// The parent's workspace relative to the repository (`""`: the top).
    pub(crate) prefix: String,
    pub(crate) workspace: PathBuf,
    pub(crate) worktree: PathBuf,
    /// The worktree's own git directory (inside the repository's `.git`,
    /// outside the worktree: a child cannot reach it).
    pub(crate) gitdir: PathBuf,
    pub(crate) branch: String,
    pub(crate) base: String,
    pub(crate) head: String,
    /// The head last applied (the next change set starts there).
    pub(crate) applied_head: Option<String>,
    pub(crate) state: String,
    pub(crate) files: Vec<StoredFile>,
    pub(crate) insertions: u64,
    pub(crate) deletions: u64,
    pub(crate) created_at: f64,
    pub(crate) recorded_at: Option<f64>,
    pub(crate) untracked_not_copied: u64,
}

/// A [`FileChange`] as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct StoredFile {
    pub(crate) status: String,
    pub(crate) path: String,
    pub(crate) old_path: Option<String>,
    pub(crate) added: Option<u64>,
    pub(crate) removed: Option<u64>,
}

impl StoredFile {
    pub(crate) fn to_change(&self) -> FileChange {
        FileChange {
            status: match self.status.as_str() {
                "added" => "added",
                "deleted" => "deleted",
                "renamed" => "renamed",
                "type_changed" => "type_changed",
                _ => "modified",
            },
            path: self.path.clone(),
            old_path: self.old_path.clone(),
            added: self.added,
            removed: self.removed,
        }
    }
}

impl Record {
    pub(crate) fn owner(&self) -> Owner {
        Owner {
            subagent_id: self.subagent_id.clone(),
            delegation_id: self.delegation_id.clone(),
            parent_session_id: self.parent_session_id.clone(),
            owner_profile: self.owner_profile.clone(),
        }
    }

    pub(crate) fn state(&self) -> ChangeState {
        match self.state.as_str() {
            "applied" => ChangeState::Applied,
            "discarded" => ChangeState::Discarded,
            "empty" => ChangeState::Empty,
            _ => ChangeState::Pending,
        }
    }
}

fn io(operation: String, e: &std::io::Error) -> IsolationError {
    IsolationError::Io { operation, message: e.to_string() }
}

/// Whether `id` may name a record file (ids are `sa-<n>-<hex>`; anything
/// with a separator or a dot is refused before it reaches a path).
pub(crate) fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The record's path.
pub(crate) fn path_of(root: &Path, id: &str) -> PathBuf {
    root.join(format!("{id}.json"))
}

/// Reads `id`'s record (`None`: there is none).
pub(crate) fn load(root: &Path, id: &str) -> Result<Option<Record>, IsolationError> {
    if !valid_id(id) {
        return Ok(None);
    }
    let path = path_of(root, id);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(format!("reading {}", path.display()), &e)),
    };
    let record: Record = serde_json::from_str(&text).map_err(|e| IsolationError::Io {
        operation: format!("reading {}", path.display()),
        message: format!("not a change-set record: {e}"),
    })?;
    // A record names its own worktree and nothing else (a planted or
    // damaged one is never acted on).
    let own = record.subagent_id == id
        && record.worktree == root.join(id)
        && record.repository.is_absolute()
        && record.gitdir.is_absolute();
    if !own {
        return Err(IsolationError::Io {
            operation: format!("reading {}", path.display()),
            message: "the record does not describe this child's worktree; it is left alone"
                .to_owned(),
        });
    }
    Ok(Some(record))
}

/// Writes `record` whole (a temp file renamed over the old one).
pub(crate) fn save(root: &Path, record: &Record) -> Result<(), IsolationError> {
    let path = path_of(root, &record.subagent_id);
    let what = || format!("writing {}", path.display());
    let text = serde_json::to_vec_pretty(record)
        .map_err(|e| IsolationError::Io { operation: what(), message: e.to_string() })?;
    let mut tmp = tempfile::NamedTempFile::new_in(root).map_err(|e| io(what(), &e))?;
    std::io::Write::write_all(&mut tmp, &text).map_err(|e| io(what(), &e))?;
    tmp.as_file().sync_all().map_err(|e| io(what(), &e))?;
    tmp.persist(&path).map_err(|e| io(what(), &e.error))?;
    Ok(())
}

/// Removes the record and its lock.
pub(crate) fn remove(root: &Path, id: &str) -> Result<(), IsolationError> {
    for p in [path_of(root, id), root.join(format!("{id}.lock"))] {
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(format!("removing {}", p.display()), &e)),
        }
    }
    Ok(())
}

/// Every record's id under `root`.
pub(crate) fn ids(root: &Path) -> Result<Vec<String>, IsolationError> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(format!("listing {}", root.display()), &e)),
    };
    let mut ids: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".json").map(str::to_owned))
        .filter(|id| valid_id(id))
        .collect();
    ids.sort();
    Ok(ids)
}

/// An exclusive lock on `id`'s change set, held until dropped.
pub(crate) struct Lock {
    _file: File,
}

/// Takes `id`'s lock, waiting for another holder.
pub(crate) fn lock(root: &Path, id: &str) -> Result<Lock, IsolationError> {
    lock_file(root.join(format!("{id}.lock")))
}

/// Takes the lock of applies into `repository` (two change sets applied at
/// once would both merge against the same workspace state).
pub(crate) fn lock_repository(root: &Path, repository: &Path) -> Result<Lock, IsolationError> {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    repository.hash(&mut h);
    lock_file(root.join(format!("apply-{:016x}.lock", h.finish())))
}

fn lock_file(path: PathBuf) -> Result<Lock, IsolationError> {
    let what = || format!("locking {}", path.display());
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| io(what(), &e))?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| io(what(), &std::io::Error::from(e)))?;
    Ok(Lock { _file: file })
}
