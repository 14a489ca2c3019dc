//! The terminal's sandbox, applied by a helper process to itself before it
//! starts `/bin/sh -c COMMAND` (no `unsafe` `pre_exec` hook is needed):
//!
//! 1. resource limits: address space, file size, no core dumps (the
//!    parent's process watch bounds the number of processes);
//! 2. fresh namespaces: user (the caller's ids mapped to themselves), mount,
//!    PID (the shell is PID 1: when it exits, everything it left running is
//!    killed by the kernel, `setsid` or not) and — unless the network is
//!    allowed — network (only a downed loopback: no route anywhere,
//!    127.0.0.1 included; abstract unix sockets are per network namespace);
//! 3. a root of its own (`pivot_root` into a fresh tmpfs): the system
//!    directories read-only (`SYSTEM_READ`), a few devices, a fresh
//!    size-limited tmpfs on `/tmp` (the command's `HOME` and `TMPDIR`) and
//!    the workspace read-write at its own path — nothing else exists in
//!    its mount namespace (`$HOME`, `/root`, `/home`, `/var`, `/run`, and
//!    every unix socket under them, are absent). Inside the workspace the
//!    hidden paths (`--hide`: Retinue's home and database) are covered by
//!    empty read-only mounts, and the read-only ones (`--read-only`: `.git`,
//!    `.envrc`, …) are bound read-only;
//! 4. Landlock (up to ABI 6): reads and execution only under the system
//!    directories, the workspace and `/tmp`; writes only under the
//!    workspace, `/tmp` and `/dev/null`; no TCP bind or connect without the
//!    network; no signals and no abstract unix sockets outside the sandbox.
//!
//! Every step is required: where one cannot be set up (no user namespaces,
//! no Landlock) the helper refuses, and the terminal toolset with it unless
//! the operator sets `delegation.terminal.sandbox: off`.
//!
//! The helper is the `retinue` binary (`retinue __sandbox …`) or the
//! `retinue-sandbox` binary of this crate. Its arguments:
//! `--workspace DIR [--network] [--probe] [--hide PATH]… [--read-only PATH]… -- COMMAND`. `--probe` sets
//! everything up and reports in one JSON line instead of running a command.
//! A setup failure exits [`SETUP_FAILED`] with the reason on stderr,
//! prefixed by [`SETUP_PREFIX`].

use std::ffi::OsString;
use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access, AccessFs, AccessNet, CompatLevel, Compatible, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus, Scope, path_beneath_rules,
};
use nix::sys::resource::{Resource, setrlimit};

/// The exit status of a helper that could not set the sandbox up.
pub const SETUP_FAILED: i32 = 125;
/// The prefix of the helper's setup failure text on stderr.
pub const SETUP_PREFIX: &str = "retinue-sandbox: ";

/// Directories a sandboxed command may read and execute from (those that
/// exist), besides the workspace and its temp dir.
const SYSTEM_READ: &[&str] =
    &["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/nix/store"];
/// Secrets under [`SYSTEM_READ`] a command may never read (a command run
/// by root could otherwise: the user namespace maps it to itself).
const SECRETS: &[&str] = &[
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh",
    "/etc/ssl/private",
    "/etc/security/opasswd",
];
/// Devices a command may read.
const DEVICES_READ: &[&str] =
    &["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/full"];
/// The largest file a command may write.
const MAX_FILE_BYTES: u64 = 1 << 30;
/// The address space of each sandboxed process.
const MAX_ADDRESS_SPACE: u64 = 8 << 30;
/// The size of the private `/tmp`.
const TMP_SIZE: &str = "size=512m,mode=1777";
/// Symbolic links of `/dev` a shell expects.
const DEVICE_LINKS: &[(&str, &str)] = &[
    ("/dev/fd", "/proc/self/fd"),
    ("/dev/stdin", "/proc/self/fd/0"),
    ("/dev/stdout", "/proc/self/fd/1"),
    ("/dev/stderr", "/proc/self/fd/2"),
];

/// What the helper was asked to do.
#[derive(Debug, Default)]
struct Plan {
    workspace: PathBuf,
    network: bool,
    probe: bool,
    hide: Vec<PathBuf>,
    read_only: Vec<PathBuf>,
    command: Option<OsString>,
}

fn parse(args: Vec<OsString>) -> Result<Plan, String> {
    let mut plan = Plan::default();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--workspace") => {
                plan.workspace = it.next().map(PathBuf::from).unwrap_or_default()
            }
            Some("--network") => plan.network = true,
            Some("--hide") => plan.hide.extend(it.next().map(PathBuf::from)),
            Some("--read-only") => plan.read_only.extend(it.next().map(PathBuf::from)),
            Some("--probe") => plan.probe = true,
            Some("--") => {
                plan.command = it.next();
                break;
            }
            _ => return Err(format!("unexpected argument {a:?}")),
        }
    }
    if plan.workspace.as_os_str().is_empty() {
        return Err("--workspace is required".to_owned());
    }
    if let Some(why) = crate::workspace::refusal(&plan.workspace) {
        return Err(why);
    }
    if plan.command.is_none() && !plan.probe {
        return Err("no command".to_owned());
    }
    Ok(plan)
}

/// Runs the helper with `args` (those after the program or subcommand
/// name). Returns only on failure, with the exit status to use.
pub fn helper_main(args: Vec<OsString>) -> i32 {
    let fail = |why: String| {
        eprintln!("{SETUP_PREFIX}{why}");
        SETUP_FAILED
    };
    let plan = match parse(args) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    // The process cap is set up first, on the host's cgroup tree.
    let cap = cap_processes();
    if let Err(e) = isolate(&plan) {
        return fail(e);
    }
    if let Err(e) = limits() {
        return fail(e);
    }
    let landlock = match restrict(&plan) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    if plan.probe {
        println!(
            "{{\"landlock\":\"{}\",\"abi\":{},\"network\":{},\"namespaces\":\"user,mount,pid{}\",\"process_cap\":\"{cap}\"}}",
            landlock.status,
            landlock.abi,
            plan.network,
            if plan.network { "" } else { ",net" }
        );
        return 0;
    }
    let Some(command) = plan.command else { return fail("no command".to_owned()) };
    // The shell is PID 1 of the new PID namespace: when it exits, the
    // kernel kills whatever it left behind.
    // The command writes its stdout and stderr to the helper's stdout; the
    // helper's stderr (the setup-failure channel) is never the command's, so
    // a command cannot pass itself off as a failed setup.
    let stderr = match std::io::stdout().as_fd().try_clone_to_owned() {
        Ok(fd) => std::process::Stdio::from(fd),
        Err(e) => return fail(format!("cannot share the output: {e}")),
    };
    let status = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg("--")
        .arg(command)
        .stderr(stderr)
        .status();
    match status {
        Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9)),
        Err(e) => fail(format!("cannot run /bin/sh: {e}")),
    }
}

/// The most processes (threads included) of one sandboxed command.
pub const MAX_PROCESSES: u64 = 256;

/// The pids cgroup a helper puts itself in: `retinue-<pid>` under the
/// cgroup v2 tree of the helper (where delegated) or the v1 `pids`
/// hierarchy. The parent removes it after the helper exits.
pub fn process_cgroups(pid: u32) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(text) = std::fs::read_to_string("/proc/self/cgroup")
        && let Some(rel) = text.lines().find_map(|l| l.strip_prefix("0::"))
        && Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
    {
        out.push(
            Path::new("/sys/fs/cgroup")
                .join(rel.trim_start_matches('/'))
                .join(format!("retinue-{pid}")),
        );
    }
    out.push(PathBuf::from(format!("/sys/fs/cgroup/pids/retinue-{pid}")));
    out
}

/// Removes the pids cgroups of helper `pid` (its processes are leaving:
/// the removal is retried for a moment), and any left by helpers that are
/// gone (a Retinue process killed mid-command).
pub fn remove_process_cgroups(pid: u32) {
    for dir in process_cgroups(pid) {
        if !dir.exists() {
            continue;
        }
        for _ in 0..50 {
            if std::fs::remove_dir(&dir).is_ok() || !dir.exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    for dir in process_cgroups(0) {
        let Some(parent) = dir.parent() else { continue };
        let Ok(entries) = std::fs::read_dir(parent) else { continue };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(owner) = name.to_str().and_then(|n| n.strip_prefix("retinue-")) else {
                continue;
            };
            if owner.parse::<u32>().is_ok() && !Path::new("/proc").join(owner).exists() {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
}

/// Kills every process left in the pids cgroups of helper `pid` (a
/// command's processes, `setsid` or not: cgroup membership is inherited and
/// the sandbox cannot leave it) and waits a moment for them to go.
pub fn kill_process_cgroups(pid: u32) {
    for dir in process_cgroups(pid) {
        if !dir.exists() {
            continue;
        }
        // cgroup v2 kills the whole cgroup at once.
        let _ = std::fs::write(dir.join("cgroup.kill"), "1");
        for _ in 0..100 {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            let pids: Vec<i32> = procs.lines().filter_map(|l| l.trim().parse().ok()).collect();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

/// A hard cap of [`MAX_PROCESSES`] on this process and what it starts: a
/// pids cgroup of its own where the host lets it make one, else (not root)
/// RLIMIT_NPROC over the user's count; else only the parent's process
/// watch. Returns which.
fn cap_processes() -> &'static str {
    for dir in process_cgroups(std::process::id()) {
        let made = std::fs::create_dir(&dir)
            .and_then(|()| std::fs::write(dir.join("pids.max"), MAX_PROCESSES.to_string()))
            .and_then(|()| {
                std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
            });
        match made {
            Ok(()) => return "cgroup",
            Err(_) => {
                let _ = std::fs::remove_dir(&dir);
            }
        }
    }
    let uid = nix::unistd::getuid().as_raw();
    if uid != 0 {
        // RLIMIT_NPROC counts every process of the user: the cap is above
        // what the user runs now.
        let n = count_processes(uid).saturating_add(MAX_PROCESSES);
        if setrlimit(Resource::RLIMIT_NPROC, n, n).is_ok() {
            return "rlimit";
        }
    }
    "watch"
}

/// Processes (threads count against RLIMIT_NPROC too) owned by `uid`.
fn count_processes(uid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    let mut n: u64 = 0;
    for e in dir.flatten() {
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else { continue };
        let field = |name: &str| {
            status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim).map(str::to_owned)
        };
        let owner = field("Uid:")
            .and_then(|r| r.split_whitespace().next().and_then(|u| u.parse::<u32>().ok()));
        if owner == Some(uid) {
            n = n.saturating_add(field("Threads:").and_then(|t| t.parse().ok()).unwrap_or(1));
        }
    }
    n
}

fn limits() -> Result<(), String> {
    // No RLIMIT_NPROC: it counts every process of the user on the host
    // (a busy host would make the shell itself fail to start) and does not
    // bind root at all; the terminal's process watch bounds a command's
    // processes instead.
    setrlimit(Resource::RLIMIT_FSIZE, MAX_FILE_BYTES, MAX_FILE_BYTES)
        .map_err(|e| format!("RLIMIT_FSIZE: {e}"))?;
    setrlimit(Resource::RLIMIT_CORE, 0, 0).map_err(|e| format!("RLIMIT_CORE: {e}"))?;
    setrlimit(Resource::RLIMIT_AS, MAX_ADDRESS_SPACE, MAX_ADDRESS_SPACE)
        .map_err(|e| format!("RLIMIT_AS: {e}"))?;
    Ok(())
}

/// Fresh user, mount, PID and (without the network) network namespaces,
/// then a root of the sandbox's own.
fn isolate(plan: &Plan) -> Result<(), String> {
    use nix::mount::MsFlags;
    use nix::sched::{CloneFlags, unshare};

    let uid = nix::unistd::getuid().as_raw();
    let gid = nix::unistd::getgid().as_raw();
    let mut flags = CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWPID;
    if !plan.network {
        flags |= CloneFlags::CLONE_NEWNET;
    }
    unshare(flags).map_err(|e| {
        format!("cannot create user, mount, PID and network namespaces ({e}): user namespaces are unavailable here")
    })?;
    // Keep the caller's ids inside (so files stay owned as before).
    let _ = std::fs::write("/proc/self/setgroups", "deny");
    std::fs::write("/proc/self/uid_map", format!("{uid} {uid} 1"))
        .map_err(|e| format!("uid_map: {e}"))?;
    std::fs::write("/proc/self/gid_map", format!("{gid} {gid} 1"))
        .map_err(|e| format!("gid_map: {e}"))?;
    mount(None, Path::new("/"), None, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None)
        .map_err(|e| format!("making mounts private: {e}"))?;
    // The command's directory, at the same path inside.
    let cwd = std::env::current_dir().map_err(|e| format!("the working directory: {e}"))?;
    // Held open across the mounts: a workspace under `/tmp` is bound from it.
    let held = std::fs::File::open(&plan.workspace)
        .map_err(|e| format!("the workspace {}: {e}", plan.workspace.display()))?;
    let held_path =
        PathBuf::from(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&held)));
    // A staging tmpfs on the host's `/tmp` (private to this namespace),
    // holding the new root, itself a tmpfs.
    tmpfs(Path::new("/tmp"), "size=1m,mode=700", MsFlags::empty())?;
    let root = Path::new("/tmp/root");
    mkdir(root)?;
    tmpfs(root, "size=1m,mode=755", MsFlags::empty())?;
    let empty_file = Path::new("/tmp/empty");
    std::fs::write(empty_file, b"").map_err(|e| format!("staging: {e}"))?;
    let inner = |p: &Path| root.join(p.strip_prefix("/").unwrap_or(p));
    for dir in SYSTEM_READ {
        let host = Path::new(dir);
        let Ok(meta) = std::fs::symlink_metadata(host) else { continue };
        let at = inner(host);
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(host).map_err(|e| format!("{dir}: {e}"))?;
            if let Some(parent) = at.parent() {
                mkdir(parent)?;
            }
            std::os::unix::fs::symlink(&target, &at).map_err(|e| format!("{dir}: {e}"))?;
        } else if meta.is_dir() {
            mkdir(&at)?;
            bind_read_only(host, &at)?;
        }
    }
    mkdir(&inner(Path::new("/dev")))?;
    for dev in DEVICES_READ {
        let host = Path::new(dev);
        if host.exists() {
            let at = inner(host);
            std::fs::write(&at, b"").map_err(|e| format!("{dev}: {e}"))?;
            mount(Some(host), &at, None, MsFlags::MS_BIND, None)
                .map_err(|e| format!("binding {dev}: {e}"))?;
        }
    }
    for (link, target) in DEVICE_LINKS {
        let _ = std::os::unix::fs::symlink(target, inner(Path::new(link)));
    }
    let tmp = inner(Path::new("/tmp"));
    mkdir(&tmp)?;
    tmpfs(&tmp, TMP_SIZE, MsFlags::empty())?;
    // The workspace, read-write, at its own path.
    let ws = inner(&plan.workspace);
    std::fs::create_dir_all(&ws)
        .map_err(|e| format!("the workspace path {}: {e}", plan.workspace.display()))?;
    mount(Some(&held_path), &ws, None, MsFlags::MS_BIND | MsFlags::MS_REC, None)
        .map_err(|e| format!("binding the workspace at {}: {e}", plan.workspace.display()))?;
    drop(held);
    for path in &plan.hide {
        if !path.starts_with(&plan.workspace) {
            continue;
        }
        let at = inner(path);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => tmpfs(&at, "size=4k,mode=000", MsFlags::MS_RDONLY)?,
            Ok(_) => {
                mount(Some(empty_file), &at, None, MsFlags::MS_BIND, None)
                    .map_err(|e| format!("hiding {}: {e}", path.display()))?;
                remount_read_only(&at)?;
            }
            Err(_) => {}
        }
    }
    for path in &plan.read_only {
        if !path.starts_with(&plan.workspace) {
            continue;
        }
        let at = inner(path);
        if std::fs::symlink_metadata(&at).is_ok_and(|m| !m.file_type().is_symlink()) {
            bind_read_only(&at, &at)?;
        }
    }
    // Nothing more is made at the new root's top (best effort: Landlock
    // allows writes only to the workspace and /tmp anyway).
    let _ = mount(
        None,
        root,
        None,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        None,
    );
    std::env::set_current_dir(root).map_err(|e| format!("entering the new root: {e}"))?;
    nix::unistd::pivot_root(".", ".").map_err(|e| format!("pivot_root: {e}"))?;
    nix::mount::umount2(".", nix::mount::MntFlags::MNT_DETACH)
        .map_err(|e| format!("detaching the host's root: {e}"))?;
    std::env::set_current_dir("/").map_err(|e| format!("entering /: {e}"))?;
    // The command's directory when it is in the workspace, else the workspace.
    let dir = if cwd.starts_with(&plan.workspace) { cwd } else { plan.workspace.clone() };
    std::env::set_current_dir(&dir)
        .map_err(|e| format!("the working directory {}: {e}", dir.display()))?;
    Ok(())
}

fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: nix::mount::MsFlags,
    data: Option<&str>,
) -> nix::Result<()> {
    nix::mount::mount(source, target, fstype, flags, data)
}

fn mkdir(p: &Path) -> Result<(), String> {
    std::fs::create_dir_all(p).map_err(|e| format!("mkdir {}: {e}", p.display()))
}

fn tmpfs(target: &Path, data: &str, extra: nix::mount::MsFlags) -> Result<(), String> {
    use nix::mount::MsFlags;
    mount(
        Some(Path::new("tmpfs")),
        target,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | extra,
        Some(data),
    )
    .map_err(|e| format!("tmpfs on {}: {e}", target.display()))
}

/// Binds `source` (recursively) at `target`, read-only.
fn bind_read_only(source: &Path, target: &Path) -> Result<(), String> {
    use nix::mount::MsFlags;
    mount(Some(source), target, None, MsFlags::MS_BIND | MsFlags::MS_REC, None)
        .map_err(|e| format!("binding {}: {e}", source.display()))?;
    remount_read_only(target)
}

/// Makes the bind mount at `target` read-only, keeping the flags the host
/// locked on it (a user namespace may add flags, never drop them).
fn remount_read_only(target: &Path) -> Result<(), String> {
    use nix::mount::MsFlags;
    use rustix::fs::StatVfsMountFlags as F;
    let have = rustix::fs::statvfs(target).map(|s| s.f_flag).unwrap_or(F::empty());
    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
    for (f, m) in [
        (F::NOSUID, MsFlags::MS_NOSUID),
        (F::NODEV, MsFlags::MS_NODEV),
        (F::NOEXEC, MsFlags::MS_NOEXEC),
        (F::NOATIME, MsFlags::MS_NOATIME),
        (F::NODIRATIME, MsFlags::MS_NODIRATIME),
        (F::RELATIME, MsFlags::MS_RELATIME),
    ] {
        if have.contains(f) {
            flags |= m;
        }
    }
    mount(None, target, None, flags, None)
        .map_err(|e| format!("read-only {}: {e}", target.display()))
}

/// The paths that cover `roots` (those that exist) minus `secrets`: a root
/// holding a secret is replaced by its entries, recursively along the way
/// to the secret, so the secret itself is never under a read rule. Also
/// returns the directories so opened up (listable: names are not secret).
fn readable(roots: &[&str], secrets: &[&str]) -> (Vec<PathBuf>, Vec<PathBuf>) {
    fn expand(dir: &Path, secrets: &[&Path], out: &mut Vec<PathBuf>, listed: &mut Vec<PathBuf>) {
        if secrets.contains(&dir) {
            return;
        }
        if !secrets.iter().any(|s| s.starts_with(dir)) {
            out.push(dir.to_path_buf());
            return;
        }
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        listed.push(dir.to_path_buf());
        for e in entries.flatten() {
            expand(&e.path(), secrets, out, listed);
        }
    }
    let secrets: Vec<&Path> = secrets.iter().map(Path::new).collect();
    let (mut out, mut listed) = (Vec::new(), Vec::new());
    for root in existing(roots.iter().map(Path::new)) {
        expand(root, &secrets, &mut out, &mut listed);
    }
    (out, listed)
}

struct Landlocked {
    status: &'static str,
    abi: i32,
}

fn existing<'a>(paths: impl IntoIterator<Item = &'a Path>) -> Vec<&'a Path> {
    paths.into_iter().filter(|p| p.exists()).collect()
}

fn restrict(plan: &Plan) -> Result<Landlocked, String> {
    let abi = ABI::V6;
    let err = |e: landlock::RulesetError| format!("Landlock: {e}");
    let read = AccessFs::from_read(abi);
    let all = AccessFs::from_all(abi);
    let mut ruleset = landlock::Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(all)
        .map_err(err)?;
    let cut_tcp = !plan.network;
    if cut_tcp {
        ruleset = ruleset.handle_access(AccessNet::from_all(abi)).map_err(err)?;
    }
    ruleset = ruleset.scope(Scope::Signal).map_err(err)?;
    ruleset = ruleset.scope(Scope::AbstractUnixSocket).map_err(err)?;
    let (system, listed) = readable(SYSTEM_READ, SECRETS);
    let devices: Vec<&Path> = existing(DEVICES_READ.iter().map(Path::new));
    let own = [plan.workspace.as_path(), Path::new("/tmp")];
    let created = ruleset
        .create()
        .map_err(err)?
        .add_rules(path_beneath_rules(&system, read))
        .map_err(err)?
        .add_rules(path_beneath_rules(&devices, read))
        .map_err(err)?
        .add_rules(path_beneath_rules(&listed, AccessFs::ReadDir))
        .map_err(err)?
        .add_rules(path_beneath_rules(
            existing([Path::new("/dev/null")]),
            read | AccessFs::WriteFile,
        ))
        .map_err(err)?
        .add_rules(path_beneath_rules(own, all))
        .map_err(err)?;
    let status = created.restrict_self().map_err(err)?;
    let abi_in_use = match status.landlock {
        landlock::LandlockStatus::Available { effective_abi, .. } => effective_abi as i32,
        _ => 0,
    };
    let (name, ok) = match status.ruleset {
        RulesetStatus::FullyEnforced => ("full", true),
        RulesetStatus::PartiallyEnforced => ("partial", true),
        RulesetStatus::NotEnforced => ("none", false),
    };
    if !ok {
        return Err(
            "Landlock is not available on this kernel (writes could not be confined)".to_owned()
        );
    }
    Ok(Landlocked { status: name, abi: abi_in_use })
}
