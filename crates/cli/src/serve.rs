//! `retinue serve [--http ADDR] [--allow-remote [--token T]] [--read-only]`:
//! the web view (`retinue-web`); its approval buttons decide requests as the
//! home's operator, and `--read-only` opens the registry read-only with no
//! buttons. A non-loopback
//! address is refused (exit 2) unless `--allow-remote` is given, and then
//! every request must present a token. SIGINT/SIGTERM stop it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use retinue_core::SystemClock;
use retinue_delegate::CancelToken;
use serde_json::json;

use crate::Output;
use crate::backend::Backend;
use crate::env::{Access, Env};
use crate::error::{CliError, Result};

fn random_token() -> Result<String> {
    crate::error::random_hex(18)
}

/// The token every request must present under `--allow-remote`: `--token`,
/// else `RETINUE_WEB_TOKEN`, else a random one; `None` on loopback.
fn the_token(allow_remote: bool, token: Option<&str>) -> Result<Option<String>> {
    let usable = |t: &str| {
        !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || "-._~".contains(c))
    };
    if let Some(t) = token
        && !usable(t)
    {
        return Err(CliError::Usage(
            "--token may hold only letters, digits and - . _ ~ (it goes in a URL and a cookie)"
                .to_owned(),
        ));
    }
    Ok(if allow_remote {
        Some(match token {
            Some(t) => t.to_owned(),
            None => match std::env::var("RETINUE_WEB_TOKEN") {
                Ok(t) if usable(t.trim()) => t.trim().to_owned(),
                Ok(t) if !t.trim().is_empty() => {
                    return Err(CliError::Usage(
                        "RETINUE_WEB_TOKEN may hold only letters, digits and - . _ ~".to_owned(),
                    ));
                }
                _ => random_token()?,
            },
        })
    } else {
        None
    })
}

/// Runs the view until interrupted.
pub(crate) fn run(
    env: &Env,
    addr: SocketAddr,
    allow_remote: bool,
    token: Option<&str>,
    host_names: &[String],
    read_only: bool,
) -> Result<Output> {
    if !addr.ip().is_loopback() && !allow_remote {
        return Err(CliError::Usage(format!(
            "{addr} is not a loopback address: the view shows every subagent's transcript; \
             pass --allow-remote (a token is then required) to serve it beyond this machine"
        )));
    }
    if addr.ip().is_unspecified() && host_names.is_empty() {
        return Err(CliError::Usage(format!(
            "{addr} listens on every address: pass --host-name NAME (repeatable) with the host \
             names or IPs browsers use to reach it; requests with any other Host are refused"
        )));
    }
    let token = the_token(allow_remote, token)?;
    // Approving needs a writable open; `--read-only` keeps the view's
    // read-only open and shows no buttons.
    let access = if read_only { Access::Read } else { Access::WriteExisting };
    let store = Backend::open(env, Arc::new(SystemClock), access)?;
    let parts = retinue_web::WebParts {
        backend: store.seams.clone(),
        budget: store.config.delegation.budget,
        retention: store.config.delegation.retention(),
        profile: env.profile.clone(),
        all_profiles: env.all_profiles,
        writable: !read_only,
        // On loopback the printed address carries the key that decides (a
        // local process reading the page cannot); remotely the token does.
        approve_key: if read_only || token.is_some() { None } else { Some(random_token()?) },
        isolation: Some(env.worktrees()),
    };
    let bound = retinue_web::bind(addr).map_err(|e| CliError::Failed(e.to_string()))?;
    let base = match host_names.first() {
        Some(name) => format!("http://{name}:{}/", bound.addr().port()),
        None => format!("http://{}/", bound.addr()),
    };
    let url = match (&token, &parts.approve_key) {
        (Some(t), _) => format!("{base}?token={t}"),
        (None, Some(k)) => format!("{base}?approve={k}"),
        (None, None) => base.clone(),
    };
    // The address goes out first, so a script (or a test) can read it.
    let line = if env.json {
        json!({ "url": url, "addr": bound.addr().to_string() }).to_string() + "\n"
    } else {
        format!("{url}\n")
    };
    crate::print_stdout(&line)?;
    let mode = if read_only { "read-only" } else { "approvals can be decided" };
    eprintln!("retinue: serving the subagent view on {base} ({mode}; Ctrl-C stops)");
    let shutdown = retinue_web::WebShutdown::new();
    let cancel = CancelToken::new();
    let interrupts = crate::interrupt::Interrupts::watch(&cancel);
    let stopper = {
        let (shutdown, cancel) = (shutdown.clone(), cancel.clone());
        std::thread::spawn(move || {
            while !cancel.sleep(Duration::from_millis(200)) {}
            shutdown.stop();
        })
    };
    let served = retinue_web::serve_as(bound, parts, token, host_names, &shutdown);
    cancel.cancel();
    let _ = stopper.join();
    served.map_err(|e| CliError::Failed(e.to_string()))?;
    Ok(Output {
        json: None,
        human: String::new(),
        code: interrupts.exit_code().unwrap_or(0),
        stderr: None,
    })
}
