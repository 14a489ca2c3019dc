//! Background delegation on the command line (issue #26): `delegate
//! --background` returns at once and a detached worker runs the children;
//! `wait` delivers each result once (exit 5 on timeout, 4 when nothing is
//! left to deliver); `steer` reaches the running child from another
//! process; `cancel` stops it; a worker killed with SIGKILL is found dead,
//! its unit marked `unknown` and its budget reservation released.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
use retinue_testkit::{HermesDb, HermesFixture, TempHome};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_retinue");

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs_f64()
}

struct Fx {
    home: TempHome,
    fx: HermesFixture,
}

impl Fx {
    fn new(model: &FakeModel, extra: &str) -> Fx {
        let home = TempHome::new();
        let fx = HermesDb::standard(&home.db_path(), now());
        let yaml = format!(
            "delegation:\n  model: test/fake-model\n  base_url: {}\n  api_key: sk-test\n{extra}",
            model.base_url()
        );
        std::fs::write(home.path().join("config.yaml"), yaml).expect("config.yaml");
        Fx { home, fx }
    }

    fn root(&self) -> &str {
        self.fx.root
    }

    fn run(&self, args: &[&str]) -> (i32, Value, String) {
        let out = Command::new(BIN)
            .arg("--home")
            .arg(self.home.path())
            .arg("--json")
            .args(args)
            .env_remove("HERMES_HOME")
            .env_remove("HERMES_PROFILE")
            .output()
            .expect("run retinue");
        let stdout = String::from_utf8(out.stdout).expect("utf8");
        let v = if stdout.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {stdout}"))
        };
        (out.status.code().unwrap_or(-1), v, String::from_utf8(out.stderr).expect("utf8"))
    }

    #[track_caller]
    fn ok(&self, code: i32, args: &[&str]) -> Value {
        let (got, v, err) = self.run(args);
        assert_eq!(got, code, "retinue {args:?}: stdout {v}, stderr {err}");
        v
    }

    /// Starts a background delegation and returns its dispatch.
    fn background(&self, goal: &str) -> Value {
        let started = Instant::now();
        let v = self.ok(0, &["delegate", "--background", "--parent", self.root(), "--goal", goal]);
        assert!(started.elapsed() < Duration::from_secs(30), "--background returns at once");
        assert_eq!(v["status"], "dispatched", "{v}");
        assert!(v["worker"]["pid"].as_u64().is_some(), "{v}");
        v
    }
}

fn id(v: &Value) -> String {
    v["delegation_id"].as_str().expect("delegation id").to_owned()
}

fn subagent(v: &Value) -> String {
    v["children"][0]["subagent_id"].as_str().expect("subagent id").to_owned()
}

fn wait_for_requests(model: &FakeModel, n: usize) {
    let started = Instant::now();
    while model.request_count() < n {
        assert!(started.elapsed() < Duration::from_secs(30), "the model got no request {n}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn worker_alive(pid: u64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
}

#[test]
fn background_wait_steer_and_cancel_from_other_processes() {
    let model = FakeModel::start();
    // The first call asks for a tool (none is granted: the error goes back)
    // slowly, so a steer arrives while the child runs; the second answers.
    model.push(
        Reply::tool_call("call_1", "lookup", json!({"q": "x"})).delayed(Duration::from_secs(2)),
    );
    model.set_default(Reply::text("Done, steered").with_usage(Usage::new(10, 5)));
    let fx = Fx::new(&model, "");
    let d = fx.background("A slow job");
    let (unit, sa) = (id(&d), subagent(&d));
    let root = fx.root().to_owned();
    assert!(d["worker"]["log"].as_str().is_some_and(|l| l.contains("retinue/workers/")));

    // The worker is its own session: not this test's process group.
    let pid = d["worker"]["pid"].as_u64().expect("pid");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(") ").next().unwrap_or_default().split(' ').collect();
    assert_eq!(fields.get(3).copied(), Some(pid.to_string().as_str()), "own session: {stat}");

    let timed_out = fx.ok(5, &["wait", &unit, "--parent", &root, "--timeout", "0.2"]);
    assert_eq!(timed_out["timed_out"], true);
    assert_eq!(timed_out["still_running"], json!([unit]));
    assert_eq!(timed_out["results"][0]["status"], "running");

    // Only the parent's lineage may steer or cancel; others get "denied".
    wait_for_requests(&model, 1);
    let (code, v, _) = fx.run(&["steer", &sa, "--message", "x", "--parent", "stranger"]);
    assert_eq!((code, v["code"].as_str()), (3, Some("denied")), "{v}");
    let steered = fx.ok(0, &["steer", &sa, "--message", "Mind the edge case", "--parent", &root]);
    assert_eq!(steered["status"], "delivered", "{steered}");

    let got = fx.ok(0, &["wait", &unit, "--parent", &root, "--timeout", "60"]);
    assert_eq!(got["results"][0]["status"], "delivered", "{got}");
    let child = &got["results"][0]["result"]["results"][0];
    assert_eq!(child["summary"], "Done, steered", "{got}");
    let second = &model.requests()[1];
    assert!(
        second
            .messages()
            .iter()
            .any(|m| m["role"] == "user" && m["content"] == "Mind the edge case"),
        "the steer reached the child's next model call"
    );

    // Once only: a second wait has nothing left; a peek still reads it.
    let again = fx.ok(4, &["wait", &unit, "--parent", &root, "--timeout", "1"]);
    assert_eq!(again["results"][0]["status"], "already_delivered");
    assert!(again["results"][0].get("result").is_none());
    let peek = fx.ok(0, &["wait", &unit, "--parent", &root, "--peek"]);
    assert_eq!(peek["results"][0]["result"]["results"][0]["summary"], "Done, steered");
    // Foreign, missing: the same answer.
    let foreign = fx.ok(4, &["wait", &unit, "--parent", "stranger", "--timeout", "0"]);
    assert_eq!(foreign["results"][0]["status"], "not_found");
    let missing = fx.ok(4, &["wait", "deleg_nope", "--parent", &root, "--timeout", "0"]);
    assert_eq!(missing["results"][0], json!({"id": "deleg_nope", "status": "not_found"}));

    // Finished: cancel refuses, a late steer is reported missed.
    let (code, v, err) = fx.run(&["cancel", &unit, "--parent", &root]);
    assert_eq!(code, 1, "{v} {err}");
    assert!(err.contains("already finished (completed)"), "{err}");
    let (code, v, err) = fx.run(&["steer", &sa, "--message", "late", "--parent", &root]);
    assert_eq!((code, v["status"].as_str()), (1, Some("missed_steer")), "{err}");
    // The worker exits once its unit is done.
    let started = Instant::now();
    while worker_alive(pid) && started.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!worker_alive(pid), "the worker exits after its unit");
}

#[test]
fn cancel_stops_a_running_background_child_which_bills_what_it_spent() {
    let model = FakeModel::start();
    model.set_default(
        Reply::text("never").with_usage(Usage::new(1, 1)).delayed(Duration::from_secs(60)),
    );
    let fx = Fx::new(&model, "");
    let d = fx.background("Never finishes");
    let (unit, root) = (id(&d), fx.root().to_owned());
    wait_for_requests(&model, 1);
    // Listed as running, with its elapsed time and usage so far.
    let running = fx.ok(0, &["children", "list", "--running"]);
    let listed =
        running.as_array().expect("array").iter().find(|u| u["delegation_id"] == unit.as_str());
    let listed = listed.unwrap_or_else(|| panic!("not listed: {running}"));
    assert_eq!(listed["state"], "running");
    assert_eq!(listed["mode"], "background");
    assert!(listed["elapsed_seconds"].as_f64().is_some());
    assert_eq!(
        listed["children"][0]["usage_so_far"]["api_calls"], 0,
        "the first call is in flight"
    );
    let shown = fx.ok(0, &["children", "show", &subagent(&d)]);
    assert_eq!(shown["delegation_id"], unit.as_str());
    let mine = fx.ok(0, &["children", "list", "--running", "--owner", &root]);
    assert!(mine.as_array().expect("array").iter().any(|u| u["delegation_id"] == unit.as_str()));
    let theirs = fx.ok(0, &["children", "list", "--running", "--owner", "stranger"]);
    assert_eq!(theirs, json!([]));
    let c = fx.ok(0, &["cancel", &subagent(&d), "--parent", &root]);
    assert_eq!(c["status"], "cancelled", "{c}");
    assert_eq!(c["state"], "interrupted", "{c}");
    let got = fx.ok(0, &["wait", &unit, "--parent", &root, "--timeout", "30"]);
    let child = &got["results"][0]["result"]["results"][0];
    assert_eq!(child["exit_reason"], "cancelled", "{got}");
    assert_eq!(child["status"], "interrupted");
    // The child's transcript is closed with the reason.
    let sessions = HermesDb::table_rows_of(&fx.home.db_path(), "sessions", &["id", "end_reason"]);
    let session =
        sessions.iter().find(|s| s["id"] == d["children"][0]["session_id"]).expect("child session");
    assert_eq!(session["end_reason"], "cancelled", "{session}");
    let after = fx.ok(0, &["children", "list", "--running"]);
    assert!(after.as_array().expect("array").iter().all(|u| u["delegation_id"] != unit.as_str()));
}

#[test]
fn a_worker_killed_mid_run_is_found_dead_and_its_reservation_released() {
    let model = FakeModel::start();
    model.set_default(
        Reply::text("never").with_usage(Usage::new(1, 1)).delayed(Duration::from_secs(60)),
    );
    let fx = Fx::new(&model, "  budget:\n    max_cost_usd: 5.0\n");
    let d = fx.background("Killed mid-run");
    let (unit, root) = (id(&d), fx.root().to_owned());
    wait_for_requests(&model, 1);
    let pid = d["worker"]["pid"].as_u64().expect("pid");
    let open = |db: &Path| {
        HermesDb::table_rows_of(db, "retinue_budget_reservations", &["delegation_id", "settled_at"])
    };
    assert!(
        open(&fx.home.db_path()).iter().any(|r| r["settled_at"].is_null()),
        "a reservation is held"
    );
    let killed = Command::new("kill").args(["-9", &pid.to_string()]).status().expect("kill");
    assert!(killed.success());
    let started = Instant::now();
    while worker_alive(pid) && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    // The next command that looks (wait) finds the worker dead.
    let got = fx.ok(0, &["wait", &unit, "--parent", &root, "--timeout", "30"]);
    assert_eq!(got["results"][0]["state"], "unknown", "{got}");
    assert!(
        open(&fx.home.db_path()).iter().all(|r| !r["settled_at"].is_null()),
        "the dead worker's reservation is released"
    );
}

#[test]
fn a_worker_whose_home_is_deleted_under_it_still_finishes_and_exits() {
    let model = FakeModel::start();
    model.set_default(
        Reply::text("done anyway").with_usage(Usage::new(1, 1)).delayed(Duration::from_secs(2)),
    );
    let fx = Fx::new(&model, "");
    let d = fx.background("Outlive the home");
    let pid = d["worker"]["pid"].as_u64().expect("pid");
    wait_for_requests(&model, 1);
    std::fs::remove_dir_all(fx.home.path()).expect("delete the home");
    let started = Instant::now();
    while worker_alive(pid) && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!worker_alive(pid), "the worker neither hangs nor waits forever without its home");
    // Commands on the missing home say so (exit 4), never panic.
    let (code, v, err) = fx.run(&["wait", "x", "--parent", "p", "--timeout", "0"]);
    assert_eq!(code, 4, "{v} {err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `script` gives the command a terminal: the live status lines appear on a
/// terminal and never on a pipe or with `--json`.
#[test]
fn delegate_draws_live_status_lines_only_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` (util-linux) to provide a terminal");
        return;
    }
    let model = FakeModel::start();
    model.set_default(
        Reply::text("Done").with_usage(Usage::new(10, 5)).delayed(Duration::from_millis(1500)),
    );
    let fx = Fx::new(&model, "");
    let run = |json: bool| {
        let cmd = format!(
            "{BIN} --home {} {}delegate --parent {} --goal 'Status please'",
            fx.home.path().display(),
            if json { "--json " } else { "" },
            fx.root()
        );
        let out = Command::new("script")
            .args(["-qec", &cmd, "/dev/null"])
            .env_remove("HERMES_HOME")
            .output()
            .expect("script");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let tty = run(false);
    assert!(tty.contains("test/fake-model") && tty.contains("call(s)"), "no status line: {tty}");
    let json = run(true);
    assert!(!json.contains("call(s)"), "a status line with --json: {json}");
    // On a pipe (the other tests' way), stderr stays free of it.
    let (code, _, err) = fx.run(&["delegate", "--parent", fx.root(), "--goal", "Piped"]);
    assert_eq!(code, 0);
    assert!(!err.contains("call(s)"), "{err}");
}

/// #35: `retinue delegate --background` then `retinue wait ID` works on a
/// single-user home (the caller is the unit's recorded parent); a profile
/// (and team mode) still names `--parent`.
#[test]
fn wait_steer_and_cancel_without_parent_act_as_the_recorded_parent_for_the_operator() {
    let model = FakeModel::start();
    model.set_default(Reply::text("Done").with_usage(Usage::new(10, 5)));
    let fx = Fx::new(&model, "");
    let d = fx.background("Quick job");
    let unit = id(&d);
    let got = fx.ok(0, &["wait", &unit, "--timeout", "60"]);
    assert_eq!(got["results"][0]["status"], "delivered", "{got}");
    let (code, _, err) = fx.run(&["cancel", &unit]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("already finished"), "{err}");
    let missing = fx.ok(4, &["wait", "deleg_nope", "--timeout", "0"]);
    assert_eq!(missing["results"][0]["status"], "not_found");
    let (code, _, err) = fx.run(&["--profile", "p", "wait", &unit, "--timeout", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--parent"), "{err}");
}

/// #35: a cancelled unit is not addressable (`children show` exit 4, naming
/// why), yet `children show --all` and `children list --all` show it,
/// read-only: its state, each child's exit reason, reason text and usage.
#[test]
fn children_show_all_shows_a_cancelled_unit_with_why_and_what_it_spent() {
    let model = FakeModel::start();
    model.set_default(
        Reply::text("never").with_usage(Usage::new(1, 1)).delayed(Duration::from_secs(60)),
    );
    let fx = Fx::new(&model, "");
    let d = fx.background("Never finishes");
    let (unit, sa) = (id(&d), subagent(&d));
    wait_for_requests(&model, 1);
    let c = fx.ok(0, &["cancel", &unit]);
    assert_eq!(c["status"], "cancelled", "{c}");
    fx.ok(0, &["wait", &unit, "--timeout", "30"]);
    let (code, v, err) = fx.run(&["children", "show", &sa]);
    assert_eq!(code, 4, "{v} {err}");
    assert!(err.contains("not addressable"), "{err}");
    let shown = fx.ok(0, &["children", "show", &sa, "--all"]);
    assert_eq!(shown["delegation_id"], unit.as_str(), "{shown}");
    assert_eq!(shown["state"], "interrupted", "{shown}");
    let child = &shown["children"][0];
    assert_eq!(child["subagent_id"], sa.as_str());
    assert_eq!(child["exit_reason"], "cancelled", "{shown}");
    assert_eq!(child["addressable"], false);
    assert!(child["usage"].is_object(), "{shown}");
    let all = fx.ok(0, &["children", "list", "--all"]);
    let listed =
        all.as_array().expect("array").iter().find(|u| u["delegation_id"] == unit.as_str());
    assert_eq!(listed.expect("listed")["children"][0]["exit_reason"], "cancelled", "{all}");
    // Nothing was written by the reads; a missing id is still exit 4.
    let (code, _, _) = fx.run(&["children", "show", "sa-nope", "--all"]);
    assert_eq!(code, 4);
}
