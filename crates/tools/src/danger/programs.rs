//! The programs whose arguments make them risky, by name: what `rm`,
//! `git`, `chmod`, `dd`, `kill`, the package publishers and the database
//! tools are asked to do.

use super::{Danger, DangerKind};

/// The risk of running `name` with `args`, if any.
pub(super) fn kind_of(name: &str, args: &[&str]) -> Option<DangerKind> {
    match name {
        "rm" if flagged(args, &["-r", "-R", "--recursive", "-f", "--force"], "rRf") => {
            Some(DangerKind::Deletion)
        }
        "shred" | "srm" | "wipe" => {
            if args.iter().any(|a| is_device(a)) {
                Some(DangerKind::BlockDevice)
            } else {
                Some(DangerKind::Deletion)
            }
        }
        "git" => git(args),
        "tee" | "cp" | "mv" | "install" | "rsync" | "pv" if args.iter().any(|a| is_device(a)) => {
            Some(DangerKind::BlockDevice)
        }
        "mysqladmin" if args.iter().any(|a| a.eq_ignore_ascii_case("drop")) => {
            Some(DangerKind::DropDatabase)
        }
        "chmod" | "chown" | "chgrp"
            if flagged(args, &["-R", "--recursive"], "R") && args.iter().any(|a| is_broad(a)) =>
        {
            Some(DangerKind::BroadPermissions)
        }
        "dd" if args.iter().any(|a| a.strip_prefix("of=").is_some_and(is_device)) => {
            Some(DangerKind::BlockDevice)
        }
        "mkswap" | "wipefs" | "fdisk" | "sfdisk" | "cfdisk" | "parted" | "gdisk" | "sgdisk"
        | "blkdiscard" | "mke2fs" => Some(DangerKind::BlockDevice),
        n if n.starts_with("mkfs") => Some(DangerKind::BlockDevice),
        "kill" | "pkill" | "killall" | "skill" | "xkill" => {
            if args.iter().all(|a| matches!(*a, "-l" | "-L" | "--list" | "--help"))
                && !args.is_empty()
            {
                None
            } else {
                Some(DangerKind::KillProcess)
            }
        }
        "dropdb" => Some(DangerKind::DropDatabase),
        _ if publish(name, args) => Some(DangerKind::Publish),
        _ => None,
    }
}

/// Whether any argument is one of `long` (or its abbreviation, `--recur`,
/// as GNU tools allow) or a short-option cluster holding one of `short`
/// (`-rf`, `-fR`).
pub(super) fn flagged(args: &[&str], long: &[&str], short: &str) -> bool {
    args.iter().take_while(|a| **a != "--").any(|a| {
        long.contains(a)
            || (a.starts_with("--") && a.len() >= 4 && long.iter().any(|l| l.starts_with(a)))
            || (a.starts_with('-')
                && !a.starts_with("--")
                && a[1..].chars().any(|c| short.contains(c)))
    })
}

fn git(args: &[&str]) -> Option<DangerKind> {
    // Global options before the subcommand (`-C dir`, `-c k=v`, `--no-pager`).
    let mut i = 0;
    while i < args.len() && args[i].starts_with('-') {
        if matches!(args[i], "-C" | "-c" | "--git-dir" | "--work-tree" | "--namespace") {
            i += 1;
        }
        i += 1;
    }
    let sub = *args.get(i)?;
    let rest = &args[i + 1..];
    // A long option may be abbreviated to two letters or more (`--ha`), as git allows.
    let has = |flags: &[&str]| {
        rest.iter().any(|a| {
            flags.iter().any(|f| {
                a == f
                    || a.starts_with(&format!("{f}="))
                    || (f.starts_with("--")
                        && a.starts_with("--")
                        && a.len() >= 4
                        && f.starts_with(a))
            })
        })
    };
    match sub {
        "push" => (has(&[
            "--force",
            "-f",
            "--force-with-lease",
            "--force-if-includes",
            "--mirror",
            "--delete",
            "-d",
            "--prune",
        ]) || flagged(rest, &[], "fd")
            || rest.iter().any(|a| a.starts_with('+') || a.starts_with(':')))
        .then_some(DangerKind::ForcePush),
        "reset" => has(&["--hard", "--merge", "--keep"]).then_some(DangerKind::HistoryRewrite),
        "rebase" | "filter-branch" | "filter-repo" | "replace" => Some(DangerKind::HistoryRewrite),
        "commit" => has(&["--amend"]).then_some(DangerKind::HistoryRewrite),
        "branch" => (has(&["-D", "--delete", "-d", "--force", "-f", "-M"])
            || flagged(rest, &[], "D"))
        .then_some(DangerKind::HistoryRewrite),
        "tag" => has(&["-d", "--delete", "-f", "--force"]).then_some(DangerKind::HistoryRewrite),
        "update-ref" => has(&["-d"]).then_some(DangerKind::HistoryRewrite),
        "reflog" => rest
            .first()
            .is_some_and(|a| matches!(*a, "expire" | "delete"))
            .then_some(DangerKind::HistoryRewrite),
        "gc" => has(&["--prune"]).then_some(DangerKind::HistoryRewrite),
        "clean" => flagged(rest, &["--force"], "f").then_some(DangerKind::Deletion),
        "checkout" | "restore" => (has(&["--force", "-f"])
            || rest.iter().any(|a| matches!(*a, "." | ":/" | "*")))
        .then_some(DangerKind::Deletion),
        "rm" => flagged(rest, &["--force"], "rf").then_some(DangerKind::Deletion),
        _ => None,
    }
}

fn publish(name: &str, args: &[&str]) -> bool {
    // Options may come first (`npm --registry X publish`, `cargo +nightly
    // publish`, `docker image push`): the verb anywhere among the words.
    let verb = |v: &str| args.contains(&v);
    match name {
        "npm" | "pnpm" | "yarn" | "bun" | "cargo" | "poetry" | "uv" | "flit" | "hatch" | "vsce"
        | "ovsx" | "gradle" | "gradlew" | "lerna" | "jsr" | "deno" => verb("publish"),
        "twine" => verb("upload"),
        "gem" | "docker" | "podman" | "helm" | "buildah" => verb("push"),
        "mvn" | "mvnw" => verb("deploy"),
        "dotnet" => args.windows(2).any(|w| w == ["nuget", "push"]),
        _ => false,
    }
}

/// A path naming a device other than the harmless character devices.
pub(super) fn is_device(path: &str) -> bool {
    // `//dev/sda`, `/./dev/sda`: the path as the kernel resolves it.
    let mut clean = String::new();
    for part in path.split('/').filter(|p| !p.is_empty() && *p != ".") {
        clean.push('/');
        clean.push_str(part);
    }
    let path = if path.starts_with('/') { clean.as_str() } else { path };
    const HARMLESS: &[&str] = &[
        "/dev/null",
        "/dev/zero",
        "/dev/stdout",
        "/dev/stderr",
        "/dev/stdin",
        "/dev/tty",
        "/dev/random",
        "/dev/urandom",
        "/dev/full",
    ];
    path.starts_with("/dev/")
        && !HARMLESS.contains(&path)
        && !path.starts_with("/dev/fd/")
        && !path.starts_with("/dev/shm/")
        && !path.starts_with("/dev/pts/")
        // bash's network pseudo-files: a connection, not a device (the
        // sandbox has no network anyway).
        && !path.starts_with("/dev/tcp/")
        && !path.starts_with("/dev/udp/")
}

/// `/`, the home, the workspace root, everything in it, or a system directory.
fn is_broad(path: &str) -> bool {
    let p = path.trim_end_matches('/');
    matches!(p, "" | "~" | "." | ".." | "*" | "./*" | "/*" | "~/*" | "$HOME" | "${HOME}")
        || [
            "/etc", "/usr", "/var", "/home", "/bin", "/sbin", "/lib", "/lib64", "/root", "/opt",
            "/srv", "/boot", "/dev", "/proc", "/sys",
        ]
        .contains(&p)
}

/// SQL that destroys data, anywhere in the text (a `psql -c`, a heredoc).
pub(super) fn sql_drop(command: &str) -> Option<Danger> {
    let words: Vec<String> = command
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    let hit =
        words.windows(2).any(|w| {
            (w[0] == "drop" && matches!(w[1].as_str(), "database" | "schema" | "table"))
                || (w[0] == "truncate" && w[1] == "table")
        }) || words.iter().any(|w| matches!(w.as_str(), "flushall" | "flushdb" | "dropdatabase"));
    hit.then(|| Danger { kind: DangerKind::DropDatabase, command: command.trim().to_owned() })
}
