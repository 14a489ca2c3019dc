//! The web view over a real SQLite registry, fetched over real HTTP: the
//! tree (lineages, continuations, nested orchestrator units, states, cost),
//! a child's transcript with its tool calls, escaping of hostile model
//! output, the security headers, the token, and the change marker.

#![expect(clippy::unwrap_used)]

use std::sync::Arc;

use retinue_core::{
    AttributionDraft, BudgetLimit, ChildManifest, Completion, CompletionEvent, Message, NewSession,
    RetentionPolicy, SessionStore, TotalsUpdate, UnitDraft, UnitLifecycle, UnitState, UsageLedger,
};
use retinue_store::{Store, StoreOptions};
use retinue_testkit::TempHome;
use retinue_web::{CSP, WebParts, WebShutdown};
use serde_json::json;

const XSS: &str = "<script>window.__xss=1</script><img src=x onerror=alert(1)>";
const LINK: &str = "javascript:alert(1)";

struct Served {
    base: String,
    shutdown: WebShutdown,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.shutdown.stop();
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

fn serve(store: &Arc<Store>, profile: &str, token: Option<&str>) -> Served {
    serve_with(store, profile, token, false)
}

fn serve_with(store: &Arc<Store>, profile: &str, token: Option<&str>, writable: bool) -> Served {
    let parts = WebParts {
        backend: retinue_core::Backend::of(store.clone()),
        budget: BudgetLimit { max_cost_usd: Some(1.0), max_tokens: None },
        retention: RetentionPolicy::default(),
        profile: profile.to_owned(),
        all_profiles: false,
        writable,
        approve_key: writable.then(|| "k3y".to_owned()),
        isolation: None,
    };
    start(parts, token)
}

fn start(parts: WebParts, token: Option<&str>) -> Served {
    let bound = retinue_web::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let base = format!("http://{}", bound.addr());
    let shutdown = WebShutdown::new();
    let stop = shutdown.clone();
    let token = token.map(str::to_owned);
    let thread =
        std::thread::spawn(move || retinue_web::serve(bound, parts, token, &stop).unwrap());
    Served { base, shutdown, thread: Some(thread) }
}

fn session(store: &Store, id: &str, parent: Option<&str>, config: Option<serde_json::Value>) {
    store
        .create_session(&NewSession {
            id: id.into(),
            source: if parent.is_some() { "delegate" } else { "cli" }.into(),
            parent_session_id: parent.map(str::to_owned),
            model_config: config,
            ..NewSession::default()
        })
        .unwrap();
}

fn unit(store: &Store, parent: &str, sa: &str, child: &str, goal: &str, profile: &str) -> String {
    store
        .insert_unit(&UnitDraft {
            origin_session: parent.into(),
            parent_session_id: Some(parent.into()),
            owner_profile: profile.into(),
            task: json!({"goal": goal, "mode": "background"}),
            children: vec![ChildManifest {
                subagent_id: sa.into(),
                session_id: child.into(),
                model: Some("m/one".into()),
                goal: Some(goal.into()),
                toolsets: Some(vec!["read".into()]),
                ..ChildManifest::default()
            }],
            child_sessions: vec![NewSession {
                id: child.into(),
                source: "delegate".into(),
                parent_session_id: Some(parent.into()),
                model_config: Some(json!({"_delegate_from": parent})),
                ..NewSession::default()
            }],
            ..UnitDraft::default()
        })
        .unwrap()
}

fn complete(store: &Store, id: &str) {
    store
        .persist_completion(&Completion {
            delegation_id: id.into(),
            status: UnitState::Completed,
            event: CompletionEvent::new(id, None, UnitState::Completed, Vec::new()),
            result: json!({"delegation_id": id, "results": []}),
            usage: None,
            background: false,
        })
        .unwrap();
}

fn bill(store: &Store, parent: &str, child: &str, cost: f64) {
    let usage = json!({"cost_usd": cost, "tokens": {"input": 100, "output": 10}});
    store
        .record_usage(
            &AttributionDraft {
                parent_session_id: parent.into(),
                parent_turn_id: String::new(),
                child_session_id: child.into(),
                usage: usage.clone(),
                aggregate: None,
                key: None,
            },
            &TotalsUpdate { delta: retinue_usage::fold_usage(&usage), catch_up: None },
        )
        .unwrap();
}

fn say(store: &Store, sid: &str, m: Message) {
    store.append_message(sid, &m).unwrap();
}

fn get(url: &str) -> (u16, String, Option<String>) {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).max_redirects(0).build().into();
    let mut r = agent.get(url).call().unwrap();
    let csp = r.headers().get("content-security-policy").map(|v| v.to_str().unwrap().to_owned());
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap(), csp)
}

fn fixture() -> (TempHome, Arc<Store>) {
    let home = TempHome::new();
    let store = Arc::new(home.open_store_with(StoreOptions::default()));
    session(&store, "root", None, None);
    // root's context was compressed into root-2 (hermes: the parent ends with
    // `compression`, the continuation names it as its parent).
    store.end_session("root", &retinue_core::EndReason::Compression).unwrap();
    store
        .create_session(&NewSession {
            id: "root-2".into(),
            source: "cli".into(),
            parent_session_id: Some("root".into()),
            ..NewSession::default()
        })
        .unwrap();
    (home, store)
}

#[test]
fn the_tree_shows_lineages_nested_units_states_and_cost() {
    let (_home, store) = fixture();
    let done = unit(&store, "root", "sa-0-aaaaaaaa", "child-a", "Survey", "");
    complete(&store, &done);
    bill(&store, "root", "child-a", 0.25);
    // An orchestrator child spawned a unit of its own, still running.
    let nested = unit(&store, "child-a", "sa-0-bbbbbbbb", "grandchild", "Dig deeper", "");
    say(
        &store,
        "grandchild",
        Message { role: "assistant".into(), token_count: Some(42), ..Message::default() },
    );
    say(
        &store,
        "grandchild",
        Message { role: "tool".into(), tool_name: Some("read_file".into()), ..Message::default() },
    );
    bill(&store, "child-a", "grandchild", 0.125);
    // The continuation's own unit; another profile's is never shown.
    let later = unit(&store, "root-2", "sa-0-cccccccc", "child-c", "Later work", "");
    let _theirs = unit(&store, "root", "sa-0-dddddddd", "child-d", "Not yours", "tenant-b");
    let served = serve(&store, "", None);
    let (status, body, csp) = get(&format!("{}/", served.base));
    assert_eq!(status, 200);
    assert_eq!(csp.as_deref(), Some(CSP));
    for id in [&done, &nested, &later, "sa-0-aaaaaaaa", "sa-0-bbbbbbbb", "sa-0-cccccccc"] {
        assert!(body.contains(id), "{id} missing");
    }
    assert!(!body.contains("sa-0-dddddddd"), "another tenant's unit is shown");
    assert!(body.contains("continuation"), "root-2 is shown as a continuation of root");
    assert_eq!(body.matches("<section class=\"lineage\"").count(), 1, "one lineage: {body}");
    // Nested: the grandchild's unit sits inside child-a's entry.
    let a = body.find("sa-0-aaaaaaaa").unwrap();
    let b = body.find("sa-0-bbbbbbbb").unwrap();
    assert!(a < b && body[a..b].contains("nested"), "the orchestrator's unit is nested");
    assert!(body.contains("data-state=\"retained\""));
    assert!(body.contains("data-state=\"running\""));
    // Cost rolls up: the unit carries its child and the grandchild.
    assert!(body.contains("unit $0.3750"), "{body}");
    assert!(body.contains("<meter"), "the budget bar");
    assert!(body.contains(">2</span> running"), "{body}");
    // The running grandchild's usage so far, from its transcript.
    assert!(
        body.contains("so far: 1 call(s), 42 tok out, 1 tool call(s), last read_file"),
        "{body}"
    );
}

#[test]
fn hostile_output_renders_as_text_everywhere() {
    let (_home, store) = fixture();
    let id = unit(&store, "root", "sa-0-eeeeeeee", "child-x", XSS, "");
    say(
        &store,
        "child-x",
        Message { role: "user".into(), content: Some(XSS.into()), ..Message::default() },
    );
    say(
        &store,
        "child-x",
        Message {
            role: "assistant".into(),
            content: Some(format!("[click]({LINK}) {XSS}")),
            tool_calls: Some(
                json!([{"id": "c1", "type": "function", "function": {"name": XSS, "arguments": XSS}}])
                    .to_string(),
            ),
            ..Message::default()
        },
    );
    say(
        &store,
        "child-x",
        Message {
            role: "tool".into(),
            content: Some(format!("{XSS}{}", "x".repeat(600))),
            tool_name: Some(XSS.into()),
            tool_call_id: Some("c1".into()),
            ..Message::default()
        },
    );
    let served = serve(&store, "", None);
    for url in [format!("{}/", served.base), format!("{}/child/sa-0-eeeeeeee", served.base)] {
        let (status, body, _) = get(&url);
        assert_eq!(status, 200, "{url}");
        assert!(!body.contains("<script>window"), "{url}: a script got through");
        assert!(!body.contains("<img"), "{url}: markup got through");
        assert!(body.contains("&lt;script&gt;window.__xss=1&lt;/script&gt;"), "{url}");
        assert!(!body.contains("href=\"javascript"), "{url}: a javascript: link");
        assert!(body.contains(&id) || url.contains("/child/"));
    }
    let (_, page, _) = get(&format!("{}/child/child-x", served.base));
    assert!(page.contains("tool call"), "the tool call is shown");
    assert!(page.contains("<details class=\"long\">"), "a long tool result is collapsed");
}

#[test]
fn unknown_and_foreign_children_are_not_found_and_writes_are_refused() {
    let (_home, store) = fixture();
    unit(&store, "root", "sa-0-ffffffff", "child-f", "theirs", "tenant-b");
    let served = serve(&store, "", None);
    let (a, _, _) = get(&format!("{}/child/sa-0-ffffffff", served.base));
    let (b, _, _) = get(&format!("{}/child/sa-0-00000000", served.base));
    assert_eq!((a, b), (404, 404));
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let r = agent.post(&format!("{}/", served.base)).send("x").unwrap();
    assert_eq!(r.status().as_u16(), 405);
}

#[test]
fn a_token_guards_every_page_when_set() {
    let (_home, store) = fixture();
    let served = serve(&store, "", Some("s3cret-token"));
    let (status, body, _) = get(&format!("{}/", served.base));
    assert_eq!(status, 401, "{body}");
    let (status, _, _) = get(&format!("{}/api/marker", served.base));
    assert_eq!(status, 401);
    let (status, _, _) = get(&format!("{}/?token=wrong", served.base));
    assert_eq!(status, 401);
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).max_redirects(0).build().into();
    let r = agent.get(&format!("{}/?token=s3cret-token", served.base)).call().unwrap();
    assert_eq!(r.status().as_u16(), 303);
    let cookie = r.headers().get("set-cookie").unwrap().to_str().unwrap().to_owned();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"), "{cookie}");
    let mut ok = agent
        .get(&format!("{}/", served.base))
        .header("authorization", "Bearer s3cret-token")
        .call()
        .unwrap();
    assert_eq!(ok.status().as_u16(), 200);
    assert!(ok.body_mut().read_to_string().unwrap().contains("Retinue"));
}

#[test]
fn the_change_marker_moves_with_the_registry() {
    let (_home, store) = fixture();
    let served = serve(&store, "", None);
    let marker = || {
        let (_, body, _) = get(&format!("{}/api/marker", served.base));
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["marker"].clone()
    };
    let before = marker();
    assert_eq!(before, marker(), "stable while nothing changes");
    let id = unit(&store, "root", "sa-0-12121212", "child-m", "g", "");
    let after_insert = marker();
    assert_ne!(before, after_insert);
    say(
        &store,
        "child-m",
        Message { role: "assistant".into(), content: Some("hi".into()), ..Message::default() },
    );
    let after_turn = marker();
    assert_ne!(after_insert, after_turn, "a new transcript turn moves it");
    complete(&store, &id);
    assert_ne!(after_turn, marker(), "a completion moves it");
}

/// #35: the marker is one counter, so a planted non-numeric `updated_at`
/// (another program's row) neither fails it (it was 503 for good) nor
/// stops it moving.
#[test]
fn a_planted_nan_updated_at_does_not_break_the_change_marker() {
    let (home, store) = fixture();
    let served = serve(&store, "", None);
    let marker = || {
        let (status, body, _) = get(&format!("{}/api/marker", served.base));
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["marker"].clone()
    };
    let id = unit(&store, "root", "sa-0-13131313", "child-n", "g", "");
    home.exec("UPDATE async_delegations SET updated_at = 'NaN'");
    let planted = marker();
    home.exec(&format!(
        "UPDATE async_delegations SET updated_at = 'x' WHERE delegation_id = '{id}'"
    ));
    assert_ne!(planted, marker(), "a write still moves it");
    complete(&store, &id);
    let done = marker();
    assert_eq!(done, marker(), "stable while nothing changes");
}

/// #35: DNS rebinding reads nothing — only the view's own Host is answered.
#[test]
fn a_foreign_host_header_is_refused_before_any_read() {
    use std::io::{Read, Write};
    let (_home, store) = fixture();
    let served = serve(&store, "", None);
    let authority = served.base.trim_start_matches("http://").trim_end_matches('/').to_owned();
    let port = authority.rsplit(':').next().expect("port").to_owned();
    let ask = |host: &str| {
        let mut s = std::net::TcpStream::connect(&authority).expect("connect");
        write!(s, "GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out
    };
    for bad in [
        format!("evil.example:{port}"),
        format!("localhost.:{port}"),
        format!("127.0.0.1:{}", port.parse::<u16>().expect("n").wrapping_add(1)),
        "localhost".to_owned(),
        format!("[::2]:{port}"),
    ] {
        let r = ask(&bad);
        assert!(r.starts_with("HTTP/1.1 403"), "{bad}: {r}");
        assert!(!r.contains("sa-0-"), "{bad}: a read happened");
    }
    for good in [format!("127.0.0.1:{port}"), format!("LOCALHOST:{port}")] {
        let r = ask(&good);
        assert!(r.starts_with("HTTP/1.1 200"), "{good}: {r}");
    }
    assert!(retinue_web::host_name("*.example.com").is_err());
    assert!(retinue_web::host_name("box.lan:8080").is_err());
    assert!(retinue_web::host_name("box.lan.").is_err());
    assert_eq!(retinue_web::host_name("Box.LAN").expect("ok"), "box.lan");
}

// ---------------------------------------------------------------- approvals

fn ask(store: &Store, unit: &str, sa: &str, command: &str) -> String {
    use retinue_core::{ApprovalQueue, NewApproval, Requested};
    match store
        .request_approval(&NewApproval {
            delegation_id: unit.into(),
            subagent_id: sa.into(),
            tool: "terminal".into(),
            arguments: json!({"command": command}),
            reason: format!("recursive deletion {XSS}"),
        })
        .unwrap()
    {
        Requested::Pending(r) => r.approval_id,
        other => panic!("{other:?}"),
    }
}

/// The form fields of the first approval form on `page` (csrf, back).
fn form_fields(page: &str) -> (String, String) {
    let field = |name: &str| {
        let at = page.find(&format!("name=\"{name}\" value=\"")).unwrap() + name.len() + 15;
        page[at..].split('"').next().unwrap().to_owned()
    };
    (field("csrf"), field("back"))
}

fn get_redirect(url: &str) -> (u16, Option<String>) {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).max_redirects(0).build().into();
    let r = agent.get(url).call().unwrap();
    (r.status().as_u16(), r.headers().get("location").map(|v| v.to_str().unwrap().to_owned()))
}

/// The approve key's cookie (the test server's key is `k3y`).
const KEY: &str = "retinue_approve=k3y";

fn get_keyed(url: &str) -> (u16, String, Option<String>) {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).max_redirects(0).build().into();
    let mut r = agent.get(url).header("cookie", KEY).call().unwrap();
    let csp = r.headers().get("content-security-policy").map(|v| v.to_str().unwrap().to_owned());
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap(), csp)
}

fn post(url: &str, origin: Option<&str>, body: &str) -> (u16, Option<String>) {
    post_as(url, origin, body, Some(KEY))
}

fn post_as(
    url: &str,
    origin: Option<&str>,
    body: &str,
    cookie: Option<&str>,
) -> (u16, Option<String>) {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).max_redirects(0).build().into();
    let mut req = agent.post(url).header("content-type", "application/x-www-form-urlencoded");
    if let Some(c) = cookie {
        req = req.header("cookie", c);
    }
    if let Some(o) = origin {
        req = req.header("origin", o);
    }
    let r = req.send(body).unwrap();
    let location = r.headers().get("location").map(|v| v.to_str().unwrap().to_owned());
    (r.status().as_u16(), location)
}

#[test]
fn a_writable_view_decides_approvals_only_from_its_own_pages() {
    use retinue_core::{ApprovalQueue, ApprovalState, Scope};
    let (_home, store) = fixture();
    let u = unit(&store, "root-2", "sa-0-0000a001", "child-a1", "clean up", "");
    let theirs = unit(&store, "root", "sa-0-0000b001", "child-b1", "theirs", "tenant-b");
    let id = ask(&store, &u, "sa-0-0000a001", "rm -rf build");
    let foreign = ask(&store, &theirs, "sa-0-0000b001", "rm -rf build");

    // Read-only: the request is shown, with no form, and a post is refused.
    let ro = serve(&store, "", None);
    let (status, page, csp) = get(&format!("{}/", ro.base));
    assert_eq!(status, 200);
    assert!(page.contains(&id) && page.contains("rm -rf build"), "listed");
    assert!(!page.contains(&foreign), "another tenant's request is not shown");
    assert!(!page.contains("<form"), "no buttons on a read-only view");
    assert!(!page.contains("<script>window"), "the reason is escaped");
    assert_eq!(csp.as_deref(), Some(CSP));
    let origin = ro.base.clone();
    assert_eq!(
        post(&format!("{}/approvals/{id}", ro.base), Some(&origin), "decision=approve").0,
        405
    );
    drop(ro);

    let served = serve_with(&store, "", None, true);
    let base = served.base.clone();
    // A process that reads the page without the printed key sees no form
    // and cannot post, even with a token it scraped.
    let (_, page, _) = get(&format!("{base}/child/sa-0-0000a001"));
    assert!(!page.contains("<form"), "no key, no buttons");
    let (status, location) = get_redirect(&format!("{base}/?approve=k3y"));
    assert_eq!((status, location.as_deref()), (303, Some("/")));
    assert_eq!(get_redirect(&format!("{base}/?approve=wrong")).0, 401);
    let (_, page, csp) = get_keyed(&format!("{base}/child/sa-0-0000a001"));
    assert_eq!(csp.as_deref(), Some(retinue_web::CSP_WRITABLE));
    assert!(page.contains("<form method=\"post\""), "{page}");
    let (csrf, back) = form_fields(&page);
    assert_eq!(back, "/child/sa%2D0%2D0000a001");
    let url = format!("{base}/approvals/{id}");
    let body =
        |decision: &str, token: &str| format!("csrf={token}&back={back}&decision={decision}");

    assert_eq!(post_as(&url, Some(&base), &body("approve", &csrf), None).0, 403, "no key cookie");
    // Another page (another origin, or none) cannot post; nor a made-up token.
    assert_eq!(post(&url, Some("http://evil.example"), &body("approve", &csrf)).0, 403);
    assert_eq!(post(&url, None, &body("approve", &csrf)).0, 403);
    assert_eq!(post(&url, Some(&base), &body("approve", "0123456789abcdef")).0, 403);
    assert_eq!(
        post(&url, Some(&base), &format!("{}&reason={}", body("deny", &csrf), "x".repeat(40_000)))
            .0,
        413
    );
    assert_eq!(post(&url, Some(&base), &body("maybe", &csrf)).0, 400);
    let pending = |i: &str| store.approval(i, &Scope::Operator).unwrap().unwrap().state;
    assert_eq!(pending(&id), ApprovalState::Pending, "nothing was decided yet");
    // Another tenant's request: missing to this view.
    assert_eq!(
        post(&format!("{base}/approvals/{foreign}"), Some(&base), &body("approve", &csrf)).0,
        404
    );
    assert_eq!(pending(&foreign), ApprovalState::Pending);

    // The real thing: denied with a reason, back to the child's page.
    let deny = format!("{}&reason=not+today", body("deny", &csrf));
    let (status, location) = post(&url, Some(&base), &deny);
    assert_eq!((status, location.as_deref()), (303, Some("/child/sa-0-0000a001")));
    let r = store.approval(&id, &Scope::Operator).unwrap().unwrap();
    assert_eq!((r.state, r.decided_by.as_deref()), (ApprovalState::Denied, Some("web")));
    assert_eq!(r.decision_reason.as_deref(), Some("not today"));
    // Decided once: a second click is told so.
    assert_eq!(post(&url, Some(&base), &body("approve", &csrf)).0, 409);
    // The decided request stays on the child's page, without buttons.
    let (_, page, _) = get_keyed(&format!("{base}/child/sa-0-0000a001"));
    assert!(page.contains("denied") && page.contains("not today"), "{page}");
    assert!(!page.contains("<form"), "no buttons for a decided request");
}

#[test]
fn an_isolated_childs_page_shows_its_receipts_and_its_diff_as_text() {
    use retinue_core::run::{ChangeSet, ChangeState, FileChange, MockIsolation, Owner};
    let (_home, store) = fixture();
    unit(&store, "root", "sa-0-dddddddd", "child-d", "isolated", "");
    say(
        &store,
        "child-d",
        Message {
            role: "assistant".into(),
            tool_calls: Some(
                json!([{"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": "{\"path\":\"src/lib.rs\"}"}}])
                    .to_string(),
            ),
            ..Message::default()
        },
    );
    say(
        &store,
        "child-d",
        Message {
            role: "tool".into(),
            content: Some("{\"bytes_written\":3}".into()),
            tool_call_id: Some("c1".into()),
            ..Message::default()
        },
    );
    let mut isolation = MockIsolation::new();
    isolation.expect_change_set().returning(|id, diff| {
        assert!(diff, "the page shows the diff");
        Ok((id == "sa-0-dddddddd").then(|| ChangeSet {
            owner: Owner { subagent_id: id.to_owned(), ..Owner::default() },
            state: ChangeState::Pending,
            repository: "/repo".into(),
            workspace: "/repo".into(),
            worktree: "/home/retinue/worktrees/sa-0-dddddddd".into(),
            worktree_present: true,
            branch: "retinue/sa-0-dddddddd".into(),
            base: "b".into(),
            head: "h".into(),
            files: vec![FileChange {
                status: "modified",
                path: "src/lib.rs".into(),
                old_path: None,
                added: Some(1),
                removed: Some(1),
            }],
            insertions: 1,
            deletions: 1,
            recorded_at: None,
            untracked_not_copied: 0,
            diff: Some(format!("--- a/src/lib.rs\n+++ b/src/lib.rs\n@@ -1 +1 @@\n-old\n+{XSS}\n")),
            diff_truncated: false,
        }))
    });
    let mut parts = WebParts {
        backend: retinue_core::Backend::of(store.clone()),
        budget: BudgetLimit::default(),
        retention: RetentionPolicy::default(),
        profile: String::new(),
        all_profiles: false,
        writable: false,
        approve_key: None,
        isolation: None,
    };
    parts.isolation = Some(Arc::new(isolation));
    let served = start(parts, None);
    let (status, page, _) = get(&format!("{}/child/sa-0-dddddddd", served.base));
    assert_eq!(status, 200);
    assert!(page.contains("receipts: 1 tool call (write_file ×1); wrote: src/lib.rs"), "{page}");
    assert!(page.contains("changes (pending, 1 file changed, +1 −1)"), "{page}");
    assert!(page.contains("<span class=\"add\">+&lt;script&gt;"), "the diff is text: {page}");
    assert!(!page.contains("<script>window"), "a script got through");
}
