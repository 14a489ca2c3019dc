//! A throwaway PostgreSQL cluster for the tests (`cargo xtask test`, and so
//! `ci`) and for local use (`cargo xtask pg-start` / `pg-stop`).
//!
//! When `RETINUE_PG_URL` is set, it is used as is and nothing is started.
//! Otherwise `initdb` creates a cluster in `target/pg-test-cluster` (tests;
//! `pg-start` uses `target/pg-cluster`, which a test run never touches) (as the
//! `postgres` user when running as root, the data directory chowned to it),
//! the server listens on 127.0.0.1 only, on a free port, with its unix socket
//! inside the data directory, and a `retinue` database is created. The
//! [`Cluster`] guard stops the server when dropped (on success, on error and
//! on panic); a watchdog process also stops it if this process dies without
//! unwinding (SIGKILL), so the server always stops by itself.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The environment variable the PostgreSQL tests read.
pub(crate) const URL_VAR: &str = "RETINUE_PG_URL";

const INSTALL_HINT: &str = "PostgreSQL is not installed (no `initdb` found). Install it \
     (Debian/Ubuntu: `apt-get install postgresql`; the server need not run: the tests start \
     their own cluster), or point the tests at a server with RETINUE_PG_URL=postgres://…";

/// A running throwaway cluster; stopped on drop.
pub(crate) struct Cluster {
    bin: PathBuf,
    data: PathBuf,
    url: String,
    as_postgres: bool,
    stopped: bool,
}

impl Cluster {
    /// The connection URL (no password: the cluster trusts 127.0.0.1).
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Stops the server now (also done on drop).
    pub(crate) fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let _ = pg_ctl_stop(&self.bin, &self.data, self.as_postgres);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The cluster `pg-start` runs for people (`target/pg-cluster`).
const SHARED: &str = "pg-cluster";
/// The tests' own cluster (`target/pg-test-cluster`): a test run never
/// replaces the cluster someone started with `pg-start` (and the data they
/// migrated into it).
const TESTS: &str = "pg-test-cluster";

/// The data directory of the throwaway cluster `name`: `target/<name>`,
/// unless the `postgres` user (when we are root) cannot reach the checkout
/// (a clone under a 0700 home): then a directory under the system temp dir,
/// named after the checkout.
pub(crate) fn cluster_dir(root: &Path, as_postgres: bool, name: &str) -> PathBuf {
    let preferred = root.join("target").join(name);
    if !as_postgres || postgres_can_reach(root) {
        return preferred;
    }
    let tag: String = root
        .display()
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    std::env::temp_dir().join(format!("retinue-{name}{tag}"))
}

/// Whether the `postgres` user can traverse every directory down to `dir`.
fn postgres_can_reach(dir: &Path) -> bool {
    Command::new("runuser")
        .args(["-u", "postgres", "--", "test", "-x"])
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The directory holding `initdb` and `pg_ctl`: `PG_BIN`, else the newest
/// `/usr/lib/postgresql/<v>/bin` (Debian), else `pg_config --bindir`.
fn find_bin() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("PG_BIN").map(PathBuf::from) {
        if dir.join("initdb").is_file() {
            return Ok(dir);
        }
        return Err(format!("PG_BIN={} has no initdb. {INSTALL_HINT}", dir.display()));
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Ok(bin);
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").is_file() {
            return Ok(dir);
        }
    }
    Err(INSTALL_HINT.to_owned())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A command for a PostgreSQL binary, run as `postgres` when we are root
/// (the server refuses to run as root).
fn pg_command(bin: &Path, tool: &str, as_postgres: bool) -> Command {
    let exe = bin.join(tool);
    if as_postgres {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(exe);
        cmd
    } else {
        Command::new(exe)
    }
}

fn run_quiet(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd.stdin(Stdio::null()).output().map_err(|e| format!("cannot run {what}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn pg_ctl_stop(bin: &Path, data: &Path, as_postgres: bool) -> Result<(), String> {
    if !data.join("postmaster.pid").exists() {
        return Ok(());
    }
    run_quiet(
        pg_command(bin, "pg_ctl", as_postgres)
            .arg("-D")
            .arg(data)
            .args(["-m", "fast", "-w", "stop"]),
        "pg_ctl stop",
    )
}

fn free_port() -> Result<u16, String> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|e| format!("cannot find a free port: {e}"))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| format!("cannot find a free port: {e}"))
}

/// Makes `dir` traversable by the `postgres` user (root's directories may be 0700).
fn open_up(dir: &Path) {
    let _ = Command::new("chmod").arg("o+x").arg(dir).status();
}

/// Starts a fresh cluster in `target/<name>`. `watch_pid`: stop the
/// server when that process is gone; `max_secs`: stop it after that long.
pub(crate) fn start(
    root: &Path,
    name: &str,
    watch_pid: Option<u32>,
    max_secs: Option<u64>,
) -> Result<Cluster, String> {
    let bin = find_bin()?;
    let as_postgres = is_root();
    let data = cluster_dir(root, as_postgres, name);
    // A cluster left by an earlier run that could not clean up: stop and remove it.
    let _ = pg_ctl_stop(&bin, &data, as_postgres);
    if data.exists() {
        fs::remove_dir_all(&data).map_err(|e| format!("cannot remove {}: {e}", data.display()))?;
    }
    fs::create_dir_all(&data).map_err(|e| format!("cannot create {}: {e}", data.display()))?;
    if as_postgres {
        // target/ (created by root, maybe 0700) must be traversable.
        let mut dir = data.parent();
        while let Some(d) = dir {
            if d == root || !d.starts_with(root) {
                break;
            }
            open_up(d);
            dir = d.parent();
        }
        run_quiet(
            Command::new("chown").args(["-R", "postgres:postgres"]).arg(&data),
            "chown of the cluster directory",
        )?;
    }
    run_quiet(
        pg_command(&bin, "initdb", as_postgres)
            .arg("-D")
            .arg(&data)
            .args(["-U", "retinue", "-E", "UTF8", "--locale=C", "--no-sync"])
            .args(["--auth-local=trust", "--auth-host=trust"]),
        "initdb",
    )?;
    let port = free_port()?;
    let opts = format!(
        "-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={} \
         -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
         -c max_connections=300 -c shared_buffers=64MB",
        data.display()
    );
    run_quiet(
        pg_command(&bin, "pg_ctl", as_postgres)
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(data.join("server.log"))
            .args(["-o", &opts, "-w", "-t", "60", "start"]),
        "pg_ctl start",
    )?;
    let mut cluster = Cluster {
        bin: bin.clone(),
        data: data.clone(),
        url: format!("postgres://retinue@127.0.0.1:{port}/retinue"),
        as_postgres,
        stopped: false,
    };
    // From here on the guard stops the server on any error.
    run_quiet(
        Command::new(bin.join("createdb")).args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            "retinue",
            "retinue",
        ]),
        "createdb",
    )?;
    spawn_watchdog(&cluster, watch_pid, max_secs);
    fs::write(data.join("url"), cluster.url()).map_err(|e| format!("cannot write the url: {e}"))?;
    eprintln!("xtask: PostgreSQL cluster at {} (data {})", cluster.url(), data.display());
    if watch_pid.is_none() {
        // Local use: the caller stops it (pg-stop) or the timer does.
        cluster.stopped = true;
    }
    Ok(cluster)
}

/// A detached shell that stops the server when `pid` is gone or after `max_secs`.
fn spawn_watchdog(cluster: &Cluster, pid: Option<u32>, max_secs: Option<u64>) {
    let mut stop = pg_command(&cluster.bin, "pg_ctl", cluster.as_postgres);
    stop.arg("-D").arg(&cluster.data).args(["-m", "fast", "stop"]);
    let stop_line = std::iter::once(stop.get_program())
        .chain(stop.get_args())
        .map(|a| format!("'{}'", a.to_string_lossy().replace('\'', "'\\''")))
        .collect::<Vec<_>>()
        .join(" ");
    let wait = match (pid, max_secs) {
        (Some(pid), Some(secs)) => {
            format!(
                "n=0; while kill -0 {pid} 2>/dev/null && [ $n -lt {secs} ]; do sleep 1; n=$((n+1)); done"
            )
        }
        (Some(pid), None) => format!("while kill -0 {pid} 2>/dev/null; do sleep 1; done"),
        (None, Some(secs)) => format!("sleep {secs}"),
        (None, None) => return,
    };
    let script = format!("{wait}; {stop_line} >/dev/null 2>&1");
    let _ = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
}

/// `cargo xtask pg-start [--minutes N]`: starts the cluster for local use and
/// prints the `export` line; it stops after N minutes (default 120) or at `pg-stop`.
pub(crate) fn pg_start(root: &Path, args: &[String]) -> Result<(), String> {
    let minutes = match args {
        [] => 120,
        [flag, n] if flag == "--minutes" => {
            n.parse::<u64>().map_err(|_| format!("--minutes takes a number, got `{n}`"))?
        }
        _ => return Err("usage: cargo xtask pg-start [--minutes N]".to_owned()),
    };
    let cluster = start(root, SHARED, None, Some(minutes * 60))?;
    println!("export {URL_VAR}={}", cluster.url());
    eprintln!("xtask: it stops by itself after {minutes} minutes, or run `cargo xtask pg-stop`");
    Ok(())
}

/// `cargo xtask pg-stop`: stops the cluster `pg-start` started.
pub(crate) fn pg_stop(root: &Path) -> Result<(), String> {
    let bin = find_bin()?;
    let as_postgres = is_root();
    let data = cluster_dir(root, as_postgres, SHARED);
    pg_ctl_stop(&bin, &data, as_postgres)?;
    eprintln!("xtask: PostgreSQL cluster in {} stopped", data.display());
    Ok(())
}

/// The URL for the tests: `RETINUE_PG_URL` when set (nothing started), else a
/// fresh cluster that lives as long as the returned guard.
/// The pid of a cluster of this checkout (`target/pg-cluster` or
/// `target/pg-test-cluster`) that serves `url`, read from its
/// `postmaster.pid` (pid on the first line, port on the fourth).
pub(crate) fn local_postmaster(root: &Path, url: &str) -> Option<u32> {
    [SHARED, TESTS].iter().find_map(|dir| {
        let text =
            std::fs::read_to_string(root.join("target").join(dir).join("postmaster.pid")).ok()?;
        let lines: Vec<&str> = text.lines().collect();
        let pid: u32 = lines.first()?.trim().parse().ok()?;
        let port = lines.get(3)?.trim();
        url.contains(&format!(":{port}/")).then_some(pid)
    })
}

pub(crate) fn for_tests(root: &Path) -> Result<(String, Option<Cluster>), String> {
    if let Ok(url) = std::env::var(URL_VAR)
        && !url.trim().is_empty()
    {
        eprintln!("xtask: PostgreSQL tests use {URL_VAR} (set by the caller)");
        return Ok((url, None));
    }
    let cluster = start(root, TESTS, Some(std::process::id()), None)?;
    Ok((cluster.url().to_owned(), Some(cluster)))
}
