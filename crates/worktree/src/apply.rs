//! `apply`: a three-way merge of a change set into the parent's workspace.
//!
//! *Ours* is the workspace as it is now (tracked or not, committed or not)
//! at every path the change set touches, hashed into a throwaway index;
//! *theirs* is the change set's head; the base is where the child started.
//! `git merge-tree` merges the three without touching anything; on a
//! conflict nothing is written. A clean result is written file by file
//! into temporary files beside their targets, then renamed into place, so
//! a failure before the renames leaves the workspace as it was.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use retinue_core::run::IsolationError;

use crate::git::Git;

fn io(operation: String, e: &std::io::Error) -> IsolationError {
    IsolationError::Io { operation, message: e.to_string() }
}

/// Refuses a path whose directories in the workspace are symbolic links
/// (writing through one would leave the repository).
fn ensure_plain(top: &Path, rel: &str) -> Result<(), String> {
    let mut at = top.to_path_buf();
    let parts: Vec<&str> = rel.split('/').collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        if part.is_empty() || *part == "." || *part == ".." {
            return Err(rel.to_owned());
        }
        at.push(part);
        if std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(rel.to_owned());
        }
    }
    Ok(())
}

/// The workspace's current state at `paths`, as a tree.
fn ours(top: &Path, paths: &BTreeSet<String>, index: &Path) -> Result<String, IsolationError> {
    Git::at(top).env("GIT_INDEX_FILE", index).args(["read-tree", "HEAD"]).run()?;
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
        return Err(IsolationError::Conflict {
            subagent_id: String::new(),
            files: vec![format!("(the workspace cannot be read: {})", crate::git::clip(&err))],
        });
    }
    Ok(Git::at(top).env("GIT_INDEX_FILE", index).args(["write-tree"]).run()?.text())
}

/// One entry of the merged tree.
struct Entry {
    mode: String,
    oid: String,
    path: String,
}

fn entries(top: &Path, tree: &str, paths: &BTreeSet<String>) -> Result<Vec<Entry>, IsolationError> {
    let out = Git::at(top)
        .args(["--literal-pathspecs", "ls-tree", "-r", "-z", tree, "--"])
        .args(paths)
        .run()?;
    Ok(out
        .stdout
        .split(|b| *b == 0)
        .filter(|l| !l.is_empty())
        .filter_map(|line| {
            let line = String::from_utf8_lossy(line);
            let (meta, path) = line.split_once('\t')?;
            let mut meta = meta.split(' ');
            let (mode, _kind, oid) = (meta.next()?, meta.next()?, meta.next()?);
            Some(Entry { mode: mode.to_owned(), oid: oid.to_owned(), path: path.to_owned() })
        })
        .collect())
}

/// A file ready to be renamed into place.
enum Staged {
    File(tempfile::TempPath, PathBuf),
    Link(PathBuf, PathBuf),
}

fn stage(top: &Path, e: &Entry) -> Result<Staged, IsolationError> {
    let target = top.join(&e.path);
    let dir = target.parent().unwrap_or(top).to_path_buf();
    std::fs::create_dir_all(&dir).map_err(|x| io(format!("creating {}", dir.display()), &x))?;
    let blob = Git::at(top).args(["cat-file", "blob", &e.oid]).run()?.stdout;
    if e.mode == "120000" {
        let salt = retinue_core::random_hex(6).map_err(|x| IsolationError::Io {
            operation: "a temporary name".to_owned(),
            message: x.to_string(),
        })?;
        let tmp = dir.join(format!(".retinue-link-{salt}"));
        let link = String::from_utf8_lossy(&blob).into_owned();
        std::os::unix::fs::symlink(&link, &tmp)
            .map_err(|x| io(format!("linking {}", tmp.display()), &x))?;
        return Ok(Staged::Link(tmp, target));
    }
    let what = || format!("writing {}", target.display());
    let mut tmp = tempfile::Builder::new()
        .prefix(".retinue-apply-")
        .tempfile_in(&dir)
        .map_err(|x| io(what(), &x))?;
    std::io::Write::write_all(&mut tmp, &blob).map_err(|x| io(what(), &x))?;
    let mode = if e.mode == "100755" { 0o755 } else { 0o644 };
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(mode))
        .map_err(|x| io(what(), &x))?;
    Ok(Staged::File(tmp.into_temp_path(), target))
}

/// Merges `base..head` into the workspace of the repository at `top` at
/// `paths`; returns the paths written or removed.
pub(crate) fn three_way(
    top: &Path,
    base: &str,
    head: &str,
    paths: &BTreeSet<String>,
) -> Result<Vec<String>, IsolationError> {
    let refused: Vec<String> = paths.iter().filter_map(|p| ensure_plain(top, p).err()).collect();
    if !refused.is_empty() {
        return Err(IsolationError::Conflict { subagent_id: String::new(), files: refused });
    }
    let scratch = tempfile::tempdir().map_err(|e| io("a scratch index".to_owned(), &e))?;
    let ours = ours(top, paths, &scratch.path().join("index"))?;
    let (out, err) = Git::at(top)
        .args(["merge-tree", "--write-tree", "--name-only", "--no-messages"])
        .args([format!("--merge-base={base}")])
        .args([ours.as_str(), head])
        .run_any()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = text.lines();
    let tree = lines.next().unwrap_or_default().trim().to_owned();
    match out.code {
        Some(0) => {}
        Some(1) => {
            let files: BTreeSet<String> =
                lines.map(str::trim).filter(|l| !l.is_empty()).map(str::to_owned).collect();
            return Err(IsolationError::Conflict {
                subagent_id: String::new(),
                files: files.into_iter().collect(),
            });
        }
        _ => {
            return Err(IsolationError::Git {
                operation: "merge-tree".to_owned(),
                message: crate::git::clip(&err),
            });
        }
    }
    let merged = entries(top, &tree, paths)?;
    let gitlinks: Vec<String> =
        merged.iter().filter(|e| e.mode == "160000").map(|e| e.path.clone()).collect();
    if !gitlinks.is_empty() {
        return Err(IsolationError::Conflict { subagent_id: String::new(), files: gitlinks });
    }
    let mut staged = Vec::with_capacity(merged.len());
    for e in &merged {
        match stage(top, e) {
            Ok(s) => staged.push(s),
            Err(err) => {
                for s in staged {
                    if let Staged::Link(tmp, _) = s {
                        let _ = std::fs::remove_file(tmp);
                    }
                }
                return Err(err);
            }
        }
    }
    // Every file is ready: the renames.
    let mut done = Vec::new();
    for s in staged {
        let (result, target) = match s {
            Staged::File(tmp, target) => (tmp.persist(&target).map_err(|e| e.error), target),
            Staged::Link(tmp, target) => (std::fs::rename(&tmp, &target), target),
        };
        result.map_err(|e| io(format!("writing {}", target.display()), &e))?;
        done.push(target.strip_prefix(top).unwrap_or(&target).to_string_lossy().into_owned());
    }
    let kept: BTreeSet<&str> = merged.iter().map(|e| e.path.as_str()).collect();
    for p in paths.iter().filter(|p| !kept.contains(p.as_str())) {
        let target = top.join(p);
        if std::fs::symlink_metadata(&target).is_ok_and(|m| !m.is_dir()) {
            std::fs::remove_file(&target)
                .map_err(|e| io(format!("removing {}", target.display()), &e))?;
            done.push(p.clone());
        }
    }
    Ok(done)
}
