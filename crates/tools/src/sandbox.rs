//! The terminal's sandbox, applied by a helper process to itself before it
//! becomes `/bin/sh -c COMMAND` (no `unsafe` `pre_exec` hook is needed):
//!
//! 1. resource limits: processes (a fork bomb ends at the cap), file size,
//!    no core dumps;
//! 2. unless the network is allowed: a fresh user + network namespace (only
//!    a downed loopback: no route anywhere, 127.0.0.1 included);
//! 3. Landlock (ABI up to 6): reads and execution only under the system
//!    directories, the workspace and the private temp dir; writes only
//!    under the workspace, the temp dir and `/dev/null`; no TCP bind or
//!    connect without the network; no signals to processes outside;
//! 4. `exec /bin/sh -c COMMAND` in the working directory it was started in.
//!
//! The helper is the `retinue` binary (`retinue __sandbox …`) or the
//! `retinue-sandbox` binary of this crate. Its arguments:
//! `--workspace DIR --tmp DIR [--network] [--probe] -- COMMAND`.
//! `--probe` sets everything up and reports in one JSON line instead of
//! running a command. A failure exits [`SETUP_FAILED`] with the reason on
//! stderr, prefixed by [`SETUP_PREFIX`].

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
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
/// Devices a command may read.
const DEVICES_READ: &[&str] =
    &["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/full"];
/// Processes one sandboxed command may have beyond its owner's count.
const EXTRA_PROCESSES: u64 = 256;
/// The largest file a command may write.
const MAX_FILE_BYTES: u64 = 1 << 30;

/// What the helper was asked to do.
#[derive(Debug, Default)]
struct Plan {
    workspace: PathBuf,
    tmp: PathBuf,
    network: bool,
    probe: bool,
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
            Some("--tmp") => plan.tmp = it.next().map(PathBuf::from).unwrap_or_default(),
            Some("--network") => plan.network = true,
            Some("--probe") => plan.probe = true,
            Some("--") => {
                plan.command = it.next();
                break;
            }
            _ => return Err(format!("unexpected argument {a:?}")),
        }
    }
    if plan.workspace.as_os_str().is_empty() || plan.tmp.as_os_str().is_empty() {
        return Err("--workspace and --tmp are required".to_owned());
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
    if let Err(e) = limits() {
        return fail(e);
    }
    let isolated = if plan.network {
        "allowed".to_owned()
    } else {
        match isolate_network() {
            Ok(()) => "namespace".to_owned(),
            Err(e) => format!("landlock-tcp-only ({e})"),
        }
    };
    let landlock = match restrict(&plan) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    if !plan.network && isolated != "namespace" && !landlock.tcp {
        return fail(format!(
            "the network cannot be cut off here ({isolated}; Landlock has no TCP rules on this \
             kernel)"
        ));
    }
    if plan.probe {
        println!(
            "{{\"landlock\":\"{}\",\"abi\":{},\"network\":\"{}\"}}",
            landlock.status,
            landlock.abi,
            isolated.replace('"', "'")
        );
        return 0;
    }
    let Some(command) = plan.command else { return fail("no command".to_owned()) };
    let err = std::process::Command::new("/bin/sh").arg("-c").arg(command).exec();
    fail(format!("cannot run /bin/sh: {err}"))
}

fn limits() -> Result<(), String> {
    let uid = nix::unistd::getuid().as_raw();
    let mine = count_processes(uid);
    let nproc = mine.saturating_add(EXTRA_PROCESSES);
    setrlimit(Resource::RLIMIT_NPROC, nproc, nproc).map_err(|e| format!("RLIMIT_NPROC: {e}"))?;
    setrlimit(Resource::RLIMIT_FSIZE, MAX_FILE_BYTES, MAX_FILE_BYTES)
        .map_err(|e| format!("RLIMIT_FSIZE: {e}"))?;
    setrlimit(Resource::RLIMIT_CORE, 0, 0).map_err(|e| format!("RLIMIT_CORE: {e}"))?;
    Ok(())
}

/// Processes (threads count against RLIMIT_NPROC too) owned by `uid`.
fn count_processes(uid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 1024 };
    let mut n: u64 = 0;
    for e in dir.flatten() {
        if !e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else { continue };
        let owner = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|u| u.parse::<u32>().ok());
        if owner == Some(uid) {
            let threads = status
                .lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|r| r.trim().parse::<u64>().ok())
                .unwrap_or(1);
            n = n.saturating_add(threads);
        }
    }
    n
}

/// A fresh user and network namespace: the command sees only a loopback
/// that is down.
fn isolate_network() -> Result<(), String> {
    use nix::sched::{CloneFlags, unshare};
    let uid = nix::unistd::getuid().as_raw();
    let gid = nix::unistd::getgid().as_raw();
    unshare(CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWNET)
        .map_err(|e| format!("unshare(user, net): {e}"))?;
    // Keep the caller's ids inside (so files stay owned as before).
    let _ = std::fs::write("/proc/self/setgroups", "deny");
    std::fs::write("/proc/self/uid_map", format!("{uid} {uid} 1"))
        .map_err(|e| format!("uid_map: {e}"))?;
    std::fs::write("/proc/self/gid_map", format!("{gid} {gid} 1"))
        .map_err(|e| format!("gid_map: {e}"))?;
    Ok(())
}

struct Landlocked {
    status: &'static str,
    abi: i32,
    tcp: bool,
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
    let system: Vec<&Path> = existing(SYSTEM_READ.iter().map(Path::new));
    let devices: Vec<&Path> = existing(DEVICES_READ.iter().map(Path::new));
    let own = [plan.workspace.as_path(), plan.tmp.as_path()];
    let created = ruleset
        .create()
        .map_err(err)?
        .add_rules(path_beneath_rules(&system, read))
        .map_err(err)?
        .add_rules(path_beneath_rules(&devices, read))
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
    Ok(Landlocked { status: name, abi: abi_in_use, tcp: cut_tcp && abi_in_use >= 4 })
}
