//! Worktrees and change sets on real git repositories.

use std::path::{Path, PathBuf};
use std::process::Command;

use retinue_core::run::{ChangeState, Isolation, IsolationError, Owner};
use retinue_worktree::GitWorktrees;

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgSign=false"])
        .args(args)
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

struct Fixture {
    _tmp: tempfile::TempDir,
    repo: PathBuf,
    wt: GitWorktrees,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().expect("tempdir");
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(repo.join("src")).expect("mkdir");
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("src/lib.rs"), "one\ntwo\nthree\n").expect("write");
    std::fs::write(repo.join("README"), "hello\n").expect("write");
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-q", "-m", "init"]);
    let wt = GitWorktrees::new(tmp.path().join("home/retinue/worktrees"));
    Fixture { _tmp: tmp, repo, wt }
}

fn owner(id: &str) -> Owner {
    Owner {
        subagent_id: id.to_owned(),
        delegation_id: "deleg-1".to_owned(),
        parent_session_id: "parent".to_owned(),
        owner_profile: String::new(),
    }
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).expect("read")
}

#[test]
fn outside_a_repository_is_refused_clearly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let wt = GitWorktrees::new(tmp.path().join("wt"));
    let err = wt.prepare(tmp.path(), &owner("sa-0-aaaa")).expect_err("no repo");
    assert!(matches!(err, IsolationError::NotARepository { .. }), "{err}");
    assert!(err.to_string().contains("needs a git repository"), "{err}");
    assert!(!tmp.path().join("wt").exists(), "nothing written");
}

#[test]
fn a_worktree_sees_uncommitted_tracked_changes_but_not_untracked_files() {
    let f = fixture();
    std::fs::write(f.repo.join("README"), "hello, dirty\n").expect("write");
    std::fs::write(f.repo.join("notes.txt"), "untracked\n").expect("write");
    let ws = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("prepare");
    assert!(!ws.starts_with(&f.repo), "never inside the workspace: {}", ws.display());
    assert_eq!(read(&ws.join("README")), "hello, dirty\n");
    assert!(!ws.join("notes.txt").exists());
    let set = f.wt.change_set("sa-0-aaaa", false).expect("read").expect("recorded");
    assert_eq!(set.untracked_not_copied, 1);
    assert_eq!(set.branch, "retinue/sa-0-aaaa");
    // The user's stash list and workspace are untouched.
    assert_eq!(git(&f.repo, &["stash", "list"]), "");
    assert_eq!(read(&f.repo.join("README")), "hello, dirty\n");
}

#[test]
fn parallel_children_are_apart_and_the_second_apply_conflicts() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    let b = f.wt.prepare(&f.repo, &owner("sa-1-bbbb")).expect("b");
    std::fs::write(a.join("src/lib.rs"), "one\nTWO by a\nthree\n").expect("write");
    assert_eq!(read(&b.join("src/lib.rs")), "one\ntwo\nthree\n", "b never sees a's edit");
    std::fs::write(b.join("src/lib.rs"), "one\nTWO by b\nthree\n").expect("write");
    std::fs::write(b.join("src/new.rs"), "fn main() {}\n").expect("write");
    let sa = f.wt.record("sa-0-aaaa").expect("record a");
    let sb = f.wt.record("sa-1-bbbb").expect("record b");
    assert_eq!(sa.state, ChangeState::Pending);
    assert_eq!(sa.files.len(), 1);
    assert_eq!((sa.files[0].added, sa.files[0].removed), (Some(1), Some(1)));
    assert_eq!(
        sb.files.iter().map(|f| (f.status, f.path.as_str())).collect::<Vec<_>>(),
        vec![("modified", "src/lib.rs"), ("added", "src/new.rs")]
    );
    assert_eq!(read(&f.repo.join("src/lib.rs")), "one\ntwo\nthree\n", "unchanged until apply");
    let applied = f.wt.apply("sa-0-aaaa").expect("first applies");
    assert_eq!(applied.state, ChangeState::Applied);
    assert_eq!(read(&f.repo.join("src/lib.rs")), "one\nTWO by a\nthree\n");
    let err = f.wt.apply("sa-1-bbbb").expect_err("second conflicts");
    match &err {
        IsolationError::Conflict { files, .. } => assert_eq!(files, &vec!["src/lib.rs".to_owned()]),
        other => panic!("{other}"),
    }
    assert!(err.to_string().starts_with("conflict:"), "{err}");
    assert_eq!(read(&f.repo.join("src/lib.rs")), "one\nTWO by a\nthree\n", "nothing half-applied");
    assert!(!f.repo.join("src/new.rs").exists(), "nothing half-applied");
    let again = f.wt.apply("sa-0-aaaa").expect_err("twice");
    assert!(again.to_string().contains("already applied"), "{again}");
    let diff = f.wt.change_set("sa-1-bbbb", true).expect("read").expect("set");
    assert!(diff.diff.as_deref().is_some_and(|d| d.contains("+TWO by b")), "{:?}", diff.diff);
}

#[test]
fn uncommitted_edits_of_the_parent_are_never_lost() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    std::fs::write(a.join("src/lib.rs"), "one\ntwo by child\nthree\n").expect("write");
    std::fs::write(a.join("README"), "hello\nmore\n").expect("write");
    f.wt.record("sa-0-aaaa").expect("record");
    // The user edits the same line meanwhile (not committed).
    std::fs::write(f.repo.join("src/lib.rs"), "one\ntwo by user\nthree\n").expect("write");
    let err = f.wt.apply("sa-0-aaaa").expect_err("conflict");
    assert!(matches!(err, IsolationError::Conflict { .. }), "{err}");
    assert_eq!(read(&f.repo.join("src/lib.rs")), "one\ntwo by user\nthree\n");
    assert_eq!(read(&f.repo.join("README")), "hello\n", "not half-applied");
    // Edits elsewhere in the file merge.
    std::fs::write(f.repo.join("src/lib.rs"), "zero\none\ntwo\nthree\n").expect("write");
    f.wt.apply("sa-0-aaaa").expect("clean three-way merge");
    assert_eq!(read(&f.repo.join("src/lib.rs")), "zero\none\ntwo by child\nthree\n");
}

#[test]
fn a_follow_up_after_an_apply_starts_a_new_change_set() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    assert_eq!(f.wt.reopen("sa-0-aaaa").expect("reopen"), Some(a.clone()));
    std::fs::write(a.join("README"), "hello\nfirst\n").expect("write");
    f.wt.record("sa-0-aaaa").expect("record");
    f.wt.apply("sa-0-aaaa").expect("apply");
    let same = f.wt.record("sa-0-aaaa").expect("nothing new");
    assert_eq!(same.state, ChangeState::Applied);
    std::fs::write(a.join("README"), "hello\nfirst\nsecond\n").expect("write");
    let next = f.wt.record("sa-0-aaaa").expect("record");
    assert_eq!(next.state, ChangeState::Pending);
    assert_eq!((next.insertions, next.deletions), (1, 0), "only the follow-up's line");
    f.wt.apply("sa-0-aaaa").expect("apply again");
    assert_eq!(read(&f.repo.join("README")), "hello\nfirst\nsecond\n");
}

#[test]
fn discard_removes_the_worktree_and_a_hand_removed_one_is_reported() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    std::fs::write(a.join("README"), "x\n").expect("write");
    f.wt.record("sa-0-aaaa").expect("record");
    let gone = f.wt.discard("sa-0-aaaa").expect("discard");
    assert_eq!(gone.state, ChangeState::Discarded);
    assert!(!a.exists());
    assert_eq!(git(&f.repo, &["branch", "--list", "retinue/*"]), "");
    assert!(f.wt.apply("sa-0-aaaa").expect_err("discarded").to_string().contains("discarded"));

    let b = f.wt.prepare(&f.repo, &owner("sa-1-bbbb")).expect("b");
    std::fs::remove_dir_all(&b).expect("by hand");
    let set = f.wt.change_set("sa-1-bbbb", false).expect("read").expect("set");
    assert!(!set.worktree_present);
    let err = f.wt.record("sa-1-bbbb").expect_err("gone");
    assert!(matches!(err, IsolationError::Gone { .. }), "{err}");
    f.wt.discard("sa-1-bbbb").expect("discard cleans");
    assert_eq!(git(&f.repo, &["worktree", "list", "--porcelain"]).matches("worktree ").count(), 1);
}

#[test]
fn a_child_that_deletes_its_git_file_is_still_recorded() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    std::fs::remove_file(a.join(".git")).expect("the child deletes .git");
    std::fs::write(a.join("README"), "changed\n").expect("write");
    let set = f.wt.record("sa-0-aaaa").expect("record");
    assert_eq!(set.files.len(), 1, "{:?}", set.files);
    assert_eq!(set.files[0].path, "README");
}

#[test]
fn forget_keeps_pending_change_sets() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    std::fs::write(a.join("README"), "x\n").expect("write");
    f.wt.record("sa-0-aaaa").expect("record");
    assert!(!f.wt.forget("sa-0-aaaa").expect("forget"), "pending is kept");
    assert!(a.exists());
    let b = f.wt.prepare(&f.repo, &owner("sa-1-bbbb")).expect("b");
    f.wt.record("sa-1-bbbb").expect("record (empty)");
    assert!(f.wt.forget("sa-1-bbbb").expect("forget"));
    assert!(!b.exists());
    assert_eq!(f.wt.list().expect("list").len(), 1);
}

#[test]
fn a_workspace_in_a_subdirectory_maps_into_the_worktree() {
    let f = fixture();
    let ws = f.wt.prepare(&f.repo.join("src"), &owner("sa-0-aaaa")).expect("a");
    assert!(ws.ends_with("sa-0-aaaa/src"), "{}", ws.display());
    std::fs::write(ws.join("lib.rs"), "changed\n").expect("write");
    let set = f.wt.record("sa-0-aaaa").expect("record");
    assert_eq!(set.files[0].path, "src/lib.rs");
}

#[test]
fn an_unknown_child_is_unknown_and_nothing_is_created() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("never-made");
    let wt = GitWorktrees::new(root.clone());
    for err in [
        wt.record("sa-0-none").expect_err("record"),
        wt.apply("sa-0-none").expect_err("apply"),
        wt.discard("sa-0-none").expect_err("discard"),
    ] {
        assert!(matches!(err, IsolationError::Unknown { .. }), "{err}");
    }
    assert!(!wt.forget("sa-0-none").expect("forget"));
    assert_eq!(wt.reopen("sa-0-none").expect("reopen"), None);
    assert_eq!(wt.change_set("../../etc/passwd", true).expect("a hostile id"), None);
    assert!(wt.list().expect("list").is_empty());
    assert!(!root.exists(), "nothing created");
}

#[test]
fn a_detached_head_and_a_staged_change_are_isolated_too() {
    let f = fixture();
    git(&f.repo, &["checkout", "-q", "--detach"]);
    std::fs::write(f.repo.join("README"), "staged\n").expect("write");
    git(&f.repo, &["add", "README"]);
    let ws = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("prepare on a detached HEAD");
    assert_eq!(read(&ws.join("README")), "staged\n", "the child sees the staged change");
    std::fs::write(ws.join("src/lib.rs"), "one\n").expect("write");
    let set = f.wt.record("sa-0-aaaa").expect("record");
    assert_eq!(
        set.files.len(),
        1,
        "the staged change is the base, not the child's: {:?}",
        set.files
    );
    f.wt.apply("sa-0-aaaa").expect("apply");
    assert_eq!(read(&f.repo.join("src/lib.rs")), "one\n");
    assert_eq!(read(&f.repo.join("README")), "staged\n", "the user's staged edit is kept");
}

#[test]
fn a_symlinked_directory_in_the_workspace_is_never_written_through() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    std::fs::create_dir_all(a.join("out")).expect("mkdir");
    std::fs::write(a.join("out/x.txt"), "from the child\n").expect("write");
    f.wt.record("sa-0-aaaa").expect("record");
    // Meanwhile `out` in the user's workspace is a link to somewhere else.
    let elsewhere = tempfile::tempdir().expect("elsewhere");
    std::os::unix::fs::symlink(elsewhere.path(), f.repo.join("out")).expect("symlink");
    let err = f.wt.apply("sa-0-aaaa").expect_err("refused");
    assert!(matches!(err, IsolationError::Conflict { .. }), "{err}");
    assert!(!elsewhere.path().join("x.txt").exists(), "nothing written through the link");
}

#[test]
fn a_rename_the_user_made_since_is_followed() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    std::fs::write(a.join("src/lib.rs"), "one\ntwo by child\nthree\n").expect("write");
    f.wt.record("sa-0-aaaa").expect("record");
    git(&f.repo, &["mv", "src/lib.rs", "src/core.rs"]);
    let applied = f.wt.apply("sa-0-aaaa").expect("clean: the rename is followed");
    assert_eq!(applied.state, ChangeState::Applied);
    assert_eq!(read(&f.repo.join("src/core.rs")), "one\ntwo by child\nthree\n");
    assert!(!f.repo.join("src/lib.rs").exists(), "the user's rename stands");
}

#[test]
fn an_untracked_file_where_the_change_set_adds_one_is_a_conflict() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    std::fs::write(a.join("notes.md"), "the child's\n").expect("write");
    f.wt.record("sa-0-aaaa").expect("record");
    std::fs::write(f.repo.join("notes.md"), "the user's\n").expect("write");
    let err = f.wt.apply("sa-0-aaaa").expect_err("conflict");
    assert!(matches!(err, IsolationError::Conflict { .. }), "{err}");
    assert_eq!(read(&f.repo.join("notes.md")), "the user's\n");
}

#[test]
fn a_repository_planted_in_the_worktree_is_never_run() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    let planted = a.join("sub/.git");
    std::fs::create_dir_all(&planted).expect("mkdir");
    std::fs::write(planted.join("config"), "[core]\n\tfsmonitor = /bin/false\n").expect("write");
    let err = f.wt.record("sa-0-aaaa").expect_err("refused");
    assert!(err.to_string().contains("left a git repository"), "{err}");
}

#[test]
fn a_planted_record_is_left_alone() {
    let f = fixture();
    let a = f.wt.prepare(&f.repo, &owner("sa-0-aaaa")).expect("a");
    let root = a.parent().expect("root").to_path_buf();
    let text = std::fs::read_to_string(root.join("sa-0-aaaa.json")).expect("record");
    let elsewhere = text.replace(&a.display().to_string(), "/tmp/somewhere-else");
    std::fs::write(root.join("sa-0-aaaa.json"), elsewhere).expect("plant");
    let err = f.wt.discard("sa-0-aaaa").expect_err("refused");
    assert!(err.to_string().contains("left alone"), "{err}");
    assert!(a.exists());
}
