//! The command-line conventions of issue #27: `serve`'s address rules, the
//! shell completions, the man page and `--version`.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_retinue");

fn run(args: &[&str]) -> (i32, String, String) {
    let home = tempfile::tempdir().expect("tempdir");
    let out = Command::new(BIN)
        .arg("--home")
        .arg(home.path())
        .args(args)
        .env_remove("HERMES_HOME")
        .env_remove("RETINUE_WEB_TOKEN")
        .output()
        .expect("run retinue");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn serve_refuses_a_non_loopback_address_without_allow_remote() {
    let (code, _, err) = run(&["serve", "--http", "0.0.0.0:0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is not a loopback address") && err.contains("--allow-remote"), "{err}");
    let (code, _, err) = run(&["serve", "--http", "127.0.0.1:0", "--token", "t"]);
    assert_eq!(code, 2, "--token needs --allow-remote: {err}");
    let (code, _, err) = run(&["serve", "--http", "nowhere"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) =
        run(&["serve", "--http", "127.0.0.1:0", "--allow-remote", "--token", "a;b c"]);
    assert_eq!(code, 2, "a token that cannot go in a URL or a cookie: {err}");
    // Nothing to show yet: a home without a database is not found (exit 4).
    let (code, _, err) = run(&["serve", "--http", "127.0.0.1:0"]);
    assert_eq!(code, 4, "{err}");
}

#[test]
fn completions_man_page_and_version() {
    for (shell, marker) in
        [("bash", "_retinue()"), ("zsh", "#compdef retinue"), ("fish", "complete -c retinue")]
    {
        let (code, out, err) = run(&["completions", shell]);
        assert_eq!(code, 0, "{shell}: {err}");
        assert!(out.contains(marker), "{shell}: {out}");
        assert!(out.contains("serve") && out.contains("wait"), "{shell} completes the commands");
    }
    let (code, _, _) = run(&["completions", "tcsh"]);
    assert_eq!(code, 2, "an unknown shell is a usage error");
    let (code, man, _) = run(&["man"]);
    assert_eq!(code, 0);
    assert!(man.contains(".TH retinue 1") && man.contains("delegate"), "{man}");
    let (code, version, _) = run(&["--version"]);
    assert_eq!(code, 0);
    let version = version.trim();
    assert!(version.starts_with(&format!("retinue {} (", env!("CARGO_PKG_VERSION"))), "{version}");
    assert!(version.ends_with(')'), "{version}");
}
