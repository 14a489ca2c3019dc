//! `apply`: a three-way merge of a change set into the parent's workspace.
//!
//! *Ours* is the workspace as it is now: `HEAD` plus every uncommitted
//! tracked change (`git stash create`, which touches nothing), and, at the
//! paths the change set touches, the files on disk whether tracked or not —
//! hashed into a throwaway index. *Theirs* is the change set's head, the
//! base where the child started. `git merge-tree` merges the three without
//! touching anything; on a conflict nothing is written. Then exactly the
//! paths where the merge differs from *ours* are written (a rename the user
//! made since is followed), each into a temporary file beside it and
//! renamed into place, through the repository's own filters (LFS smudge,
//! line endings); an existing file keeps its permissions. A new file where
//! the workspace has an untracked one, or a path under a symbolic link, is
//! a conflict: nothing of the user's is ever overwritten unseen.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use retinue_core::run::IsolationError;

use crate::git::Git;

fn io(operation: String, e: &std::io::Error) -> IsolationError {
    IsolationError::Io { operation, message: e.to_string() }
}

fn conflict(files: Vec<String>) -> IsolationError {
    IsolationError::Conflict { subagent_id: String::new(), files }
}

/// Whether a directory of `rel` in the workspace is a symbolic link (or the
/// path is not a plain relative one): writing through it would leave the
/// repository.
fn under_a_link(top: &Path, rel: &str) -> bool {
    let parts: Vec<&str> = rel.split('/').collect();
    let mut at = top.to_path_buf();
    for part in &parts[..parts.len().saturating_sub(1)] {
        if part.is_empty() || *part == "." || *part == ".." {
            return true;
        }
        at.push(part);
        if std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
            return true;
        }
    }
    false
}

/// The workspace's state now as a tree (see the module docs).
fn ours(top: &Path, paths: &BTreeSet<String>, index: &Path) -> Result<String, IsolationError> {
    let stash = Git::at(top).args(["stash", "create"]).run()?.text();
    let start = if stash.is_empty() { "HEAD".to_owned() } else { format!("{stash}^{{tree}}") };
    Git::at(top).env("GIT_INDEX_FILE", index).args(["read-tree", &start]).run()?;
    let mut input = Vec::new();
    for p in paths {
        input.extend_from_slice(p.as_bytes());
        input.push(0);
    }
    let (out, err) = Git::at(top)
        .env("GIT_INDEX_FILE", index)
        .args(["update-index", "--add", "--remove", "-z", "--stdin"])
        .stdin(input)
        .run_any()?;
    if out.code != Some(0) {
        // A directory where the change set has a file, an unreadable file…
        let why = format!("(the workspace cannot be read: {})", crate::git::clip(&err));
        return Err(conflict(vec![why]));
    }
    Ok(Git::at(top).env("GIT_INDEX_FILE", index).args(["write-tree"]).run()?.text())
}

/// `(status, path)` of every path where `to` differs from `from`, renames
/// split into a deletion and an addition.
fn changed(top: &Path, from: &str, to: &str) -> Result<Vec<(char, String)>, IsolationError> {
    let out = Git::at(top)
        .args(["diff-tree", "-r", "-z", "--no-renames", "--name-status", from, to])
        .run()?;
    let mut fields = out.stdout.split(|b| *b == 0).map(|f| String::from_utf8_lossy(f).into_owned());
    let mut list = Vec::new();
    while let Some(code) = fields.next().filter(|c| !c.is_empty()) {
        let Some(path) = fields.next() else { break };
        list.push((code.chars().next().unwrap_or('M'), path));
    }
    Ok(list)
}

/// The mode and blob of `path` in `tree`.
fn entry(top: &Path, tree: &str, path: &str) -> Result<(String, String), IsolationError> {
    let out =
        Git::at(top).args(["--literal-pathspecs", "ls-tree", "-z", tree, "--", path]).run()?;
    let line = String::from_utf8_lossy(&out.stdout).into_owned();
    let meta = line.split('\t').next().unwrap_or_default();
    let mut meta = meta.split(' ');
    match (meta.next(), meta.next(), meta.next()) {
        (Some(mode), Some(_), Some(oid)) => Ok((mode.to_owned(), oid.to_owned())),
        _ => Err(conflict(vec![path.to_owned()])),
    }
}

/// A file ready to be renamed into place.
enum Staged {
    File(tempfile::TempPath, PathBuf),
    Link(PathBuf, PathBuf),
}

fn stage(top: &Path, path: &str, mode: &str, oid: &str) -> Result<Staged, IsolationError> {
    let target = top.join(path);
    let dir = target.parent().unwrap_or(top).to_path_buf();
    std::fs::create_dir_all(&dir).map_err(|x| io(format!("creating {}", dir.display()), &x))?;
    if mode == "120000" {
        let blob = Git::at(top).args(["cat-file", "blob", oid]).run()?.stdout;
        let salt = retinue_core::random_hex(6).map_err(|x| IsolationError::Io {
            operation: "a temporary name".to_owned(),
            message: x.to_string(),
        })?;
        let tmp = dir.join(format!(".retinue-link-{salt}"));
        std::os::unix::fs::symlink(String::from_utf8_lossy(&blob).as_ref(), &tmp)
            .map_err(|x| io(format!("linking {}", tmp.display()), &x))?;
        return Ok(Staged::Link(tmp, target));
    }
    // The repository's own filters: LFS smudge, `eol`, `ident`.
    let content =
        Git::at(top).args(["cat-file", "--filters", &format!("--path={path}"), oid]).run()?;
    let what = || format!("writing {}", target.display());
    let mut tmp = tempfile::Builder::new()
        .prefix(".retinue-apply-")
        .tempfile_in(&dir)
        .map_err(|x| io(what(), &x))?;
    std::io::Write::write_all(&mut tmp, &content.stdout).map_err(|x| io(what(), &x))?;
    let existing = std::fs::metadata(&target).ok().map(|m| m.permissions().mode() & 0o7777);
    let executable = mode == "100755";
    let perms = match existing {
        Some(m) if executable => m | 0o111,
        Some(m) => m & !0o111,
        None if executable => 0o755,
        None => 0o644,
    };
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(perms))
        .map_err(|x| io(what(), &x))?;
    Ok(Staged::File(tmp.into_temp_path(), target))
}

/// Merges `base..head` into the workspace of the repository at `top`
/// (`paths`: the files the change set touches); returns the paths written
/// or removed.
pub(crate) fn three_way(
    top: &Path,
    base: &str,
    head: &str,
    paths: &BTreeSet<String>,
) -> Result<Vec<String>, IsolationError> {
    let scratch = tempfile::tempdir().map_err(|e| io("a scratch index".to_owned(), &e))?;
    let ours = ours(top, paths, &scratch.path().join("index"))?;
    let (out, err) = Git::at(top)
        .args(["merge-tree", "--write-tree", "--name-only", "--no-messages", "-z"])
        .args([format!("--merge-base={base}")])
        .args([ours.as_str(), head])
        .run_any()?;
    let mut fields = out.stdout.split(|b| *b == 0).map(|f| String::from_utf8_lossy(f).into_owned());
    let tree = fields.next().unwrap_or_default().trim().to_owned();
    match out.code {
        Some(0) => {}
        Some(1) => {
            let files: BTreeSet<String> = fields.filter(|l| !l.is_empty()).collect();
            return Err(conflict(files.into_iter().collect()));
        }
        _ => {
            let message = crate::git::clip(&err);
            return Err(IsolationError::Git { operation: "merge-tree".to_owned(), message });
        }
    }
    let changes = changed(top, &ours, &tree)?;
    let refused: Vec<String> = changes
        .iter()
        .filter(|(status, p)| {
            under_a_link(top, p)
                || (*status == 'A' && std::fs::symlink_metadata(top.join(p)).is_ok())
        })
        .map(|(_, p)| p.clone())
        .collect();
    if !refused.is_empty() {
        return Err(conflict(refused));
    }
    let mut staged = Vec::with_capacity(changes.len());
    let mut removed = Vec::new();
    let discard = |staged: Vec<Staged>| {
        for s in staged {
            if let Staged::Link(tmp, _) = s {
                let _ = std::fs::remove_file(tmp);
            }
        }
    };
    for (status, path) in &changes {
        if *status == 'D' {
            removed.push(path.clone());
            continue;
        }
        let step = entry(top, &tree, path).and_then(|(mode, oid)| {
            if mode == "160000" {
                return Err(conflict(vec![path.clone()]));
            }
            stage(top, path, &mode, &oid)
        });
        match step {
            Ok(s) => staged.push(s),
            Err(e) => {
                discard(staged);
                return Err(e);
            }
        }
    }
    // Every file is ready: the renames, then the removals.
    let mut done = Vec::new();
    for s in staged {
        let (result, target) = match s {
            Staged::File(tmp, target) => (tmp.persist(&target).map_err(|e| e.error), target),
            Staged::Link(tmp, target) => (std::fs::rename(&tmp, &target), target),
        };
        result.map_err(|e| io(format!("writing {}", target.display()), &e))?;
        done.push(target.strip_prefix(top).unwrap_or(&target).to_string_lossy().into_owned());
    }
    for p in removed {
        let target = top.join(&p);
        if std::fs::symlink_metadata(&target).is_ok_and(|m| !m.is_dir()) {
            std::fs::remove_file(&target)
                .map_err(|e| io(format!("removing {}", target.display()), &e))?;
            done.push(p);
        }
    }
    Ok(done)
}
