//! `retinue serve` in a real browser: Debian's headless Chromium driven
//! over WebDriver (chromedriver) with fantoccini. The demo's database
//! renders its tree; a running background child's status changes live while
//! the fake model delays; a transcript shows a tool call; hostile output
//! stays inert; the page fits a phone's width. Screenshots go to
//! `target/web/` (and, with `RETINUE_UPDATE_SCREENSHOT=1`, to `docs/`).
//!
//! Without Chromium the test says so and passes, unless
//! `RETINUE_REQUIRE_BROWSER=1` (CI installs it and sets that).

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use retinue_testkit::TempHome;
use retinue_testkit::fake_model::{FakeModel, Reply, Usage};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_retinue");
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const XSS: &str = "<script>window.__xss=1</script><img src=x onerror=\"window.__xss=2\">";

/// Kills a child process when dropped.
pub(super) struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(super) fn browser_available() -> bool {
    let there = Path::new(CHROMIUM).exists() && Path::new(CHROMEDRIVER).exists();
    if !there {
        assert!(
            std::env::var_os("RETINUE_REQUIRE_BROWSER").is_none(),
            "RETINUE_REQUIRE_BROWSER is set but {CHROMIUM} or {CHROMEDRIVER} is missing \
             (apt-get install chromium chromium-driver)"
        );
        eprintln!("skipped: no Chromium (apt-get install chromium chromium-driver)");
    }
    there
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

fn retinue(home: &Path, args: &[&str]) -> Value {
    let out = Command::new(BIN)
        .arg("--home")
        .arg(home)
        .arg("--json")
        .args(args)
        .env_remove("HERMES_HOME")
        .env_remove("HERMES_PROFILE")
        .output()
        .expect("run retinue");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

pub(super) fn chromedriver() -> (Killed, String) {
    let port = free_port();
    let child = Command::new(CHROMEDRIVER)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromedriver");
    let url = format!("http://127.0.0.1:{port}");
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(started.elapsed() < Duration::from_secs(20), "chromedriver did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    (Killed(child), url)
}

/// `retinue serve` on a free port: the process, its base URL and the
/// address it printed (with the key that decides approvals).
pub(super) fn serve(home: &Path) -> (Killed, String, String) {
    let mut child = Command::new(BIN)
        .arg("--home")
        .arg(home)
        .args(["serve", "--http", "127.0.0.1:0"])
        .env_remove("HERMES_HOME")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start retinue serve");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the address");
    let printed = line.trim().to_owned();
    let base = printed.split('?').next().unwrap_or_default().trim_end_matches('/').to_owned();
    (Killed(child), base, printed)
}

pub(super) async fn browser(webdriver: &str) -> Client {
    // WebDriver runs over plain HTTP on loopback, but the client's TLS stack
    // wants a process-wide crypto provider chosen.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".to_owned(),
        json!({
            "binary": CHROMIUM,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1000"],
        }),
    );
    ClientBuilder::rustls()
        .expect("tls")
        .capabilities(caps)
        .connect(webdriver)
        .await
        .expect("connect to chromedriver")
}

async fn text_of(c: &Client, css: &str) -> Option<String> {
    match c.find(Locator::Css(css)).await {
        Ok(e) => e.text().await.ok(),
        Err(_) => None,
    }
}

pub(super) async fn until(
    c: &Client,
    what: &str,
    css: &str,
    want: impl Fn(&str) -> bool,
) -> String {
    let started = Instant::now();
    loop {
        if let Some(t) = text_of(c, css).await
            && want(&t)
        {
            return t;
        }
        assert!(started.elapsed() < Duration::from_secs(40), "{what}: {css} never matched");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub(super) fn target_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/web");
    std::fs::create_dir_all(&dir).expect("target/web");
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tree_transcripts_and_live_status_in_chromium() {
    if !browser_available() {
        return;
    }
    let home = TempHome::new();
    let dir = home.path().join("h");
    retinue(&dir, &["demo"]);
    // A hostile goal and answer, recorded as a child would write them.
    let hostile = {
        let store = retinue_store::Store::open(
            dir.join("state.db"),
            retinue_store::StoreOptions::default(),
        )
        .expect("open");
        use retinue_core::{SessionStore, UnitLifecycle};
        let unit = store
            .insert_unit(&retinue_core::UnitDraft {
                origin_session: "demo-parent-2".into(),
                parent_session_id: Some("demo-parent-2".into()),
                task: json!({"goal": XSS, "mode": "sync"}),
                children: vec![retinue_core::ChildManifest {
                    subagent_id: "sa-0-0bad0bad".into(),
                    session_id: "hostile-child".into(),
                    goal: Some(XSS.into()),
                    ..Default::default()
                }],
                child_sessions: vec![retinue_core::NewSession {
                    id: "hostile-child".into(),
                    source: "delegate".into(),
                    parent_session_id: Some("demo-parent-2".into()),
                    ..Default::default()
                }],
                ..Default::default()
            })
            .expect("unit");
        store
            .append_message(
                "hostile-child",
                &retinue_core::Message {
                    role: "assistant".into(),
                    content: Some(format!("[open](javascript:window.__xss=3) {XSS}")),
                    ..Default::default()
                },
            )
            .expect("message");
        unit
    };
    // A live child: the fake model answers after 4 s.
    let model = FakeModel::start();
    model.set_default(
        Reply::text("Live answer").with_usage(Usage::new(10, 5)).delayed(Duration::from_secs(4)),
    );
    std::fs::write(
        dir.join("config.yaml"),
        format!(
            "delegation:\n  model: fake/live\n  base_url: {}\n  api_key: sk-x\n",
            model.base_url()
        ),
    )
    .expect("config");

    let (_server, base, _) = serve(&dir);
    let (_driver, webdriver) = chromedriver();
    let c = browser(&webdriver).await;

    c.goto(&format!("{base}/")).await.expect("open the tree");
    let summary = until(&c, "the tree", "p.summary", |t| t.contains("delegation unit")).await;
    // The hostile unit never finished: it is the one running so far.
    assert!(summary.contains("1 running"), "{summary}");
    let lineage = text_of(&c, "section.lineage h2").await.expect("a lineage");
    assert!(lineage.contains("demo-parent"), "{lineage}");
    assert!(text_of(&c, ".badge.continuation").await.is_some(), "the continuation is shown");
    let shot = c.screenshot().await.expect("screenshot");
    std::fs::write(target_dir().join("tree.png"), &shot).expect("write");
    if std::env::var_os("RETINUE_UPDATE_SCREENSHOT").is_some() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/web-tree.png");
        std::fs::write(docs, &shot).expect("docs screenshot");
    }

    // Hostile output is text: no script ran, no markup rendered.
    let xss: Value = c.execute("return window.__xss === undefined;", vec![]).await.expect("js");
    assert_eq!(xss, json!(true), "a script from the registry ran");
    let goal = until(&c, "the hostile goal", "li[data-subagent='sa-0-0bad0bad'] .goal", |t| {
        t.contains("<script>")
    })
    .await;
    assert!(goal.contains("window.__xss=1"), "{goal}");

    // A background child starts: the open page shows it running, then
    // retained, without a reload.
    let d = retinue(
        &dir,
        &["delegate", "--background", "--parent", "demo-parent-2", "--goal", "Live job"],
    );
    let sa = d["children"][0]["subagent_id"].as_str().expect("subagent").to_owned();
    let badge = format!("li[data-subagent='{sa}'] .badge");
    until(&c, "the running child appears", &badge, |t| t == "running").await;
    let running = text_of(&c, "#running").await.expect("count");
    assert_eq!(running, "2");
    until(&c, "the child finishes live", &badge, |t| t.starts_with("retained")).await;
    let url = c.current_url().await.expect("url");
    assert_eq!(url.as_str().trim_end_matches('/'), base, "no navigation happened");

    // A transcript with a tool call (the demo's storage survey).
    let survey = c
        .find(Locator::XPath("//li[contains(@class,'child')][.//div[@class='goal' and text()='Survey the storage layer']]//a[contains(@class,'id')]"))
        .await
        .expect("the survey child");
    survey.click().await.expect("open its transcript");
    let call = until(&c, "the tool call", ".toolcall .tool", |t| t.contains("read_file")).await;
    assert!(call.contains("tool call read_file"), "{call}");
    let turns = c.find_all(Locator::Css("article.msg")).await.expect("turns").len();
    assert!(turns >= 5, "{turns} turns");

    // The hostile child's transcript: its link is text, nothing ran.
    c.goto(&format!("{base}/child/sa-0-0bad0bad")).await.expect("open");
    until(&c, "the hostile turn", "article.msg.assistant pre", |t| t.contains("javascript:")).await;
    assert!(c.find(Locator::Css("article a")).await.is_err(), "no link was made of it");
    let xss: Value = c.execute("return window.__xss === undefined;", vec![]).await.expect("js");
    assert_eq!(xss, json!(true), "a script from the transcript ran");
    assert!(!hostile.is_empty());

    // A phone's width: nothing overflows sideways.
    c.set_window_size(390, 844).await.expect("resize");
    c.goto(&format!("{base}/")).await.expect("open the tree");
    until(&c, "the tree", "p.summary", |t| t.contains("delegation unit")).await;
    let fits: Value = c
        .execute("return document.documentElement.scrollWidth <= window.innerWidth + 1;", vec![])
        .await
        .expect("js");
    assert_eq!(fits, json!(true), "the tree overflows a phone's width");
    std::fs::write(target_dir().join("tree-phone.png"), c.screenshot().await.expect("shot"))
        .expect("write");
    c.close().await.expect("close");
}
