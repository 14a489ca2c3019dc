//! Sessions, transcripts and the compression tip.

use retinue_core::{Message, NewSession, SessionGraph, SessionStore};
use serde_json::json;

use super::fixture::Fx;

fn session(id: &str, source: &str, parent: Option<&str>) -> NewSession {
    NewSession {
        id: id.to_owned(),
        source: source.to_owned(),
        parent_session_id: parent.map(str::to_owned),
        ..NewSession::default()
    }
}

fn say(store: &dyn SessionStore, sid: &str, role: &str, text: &str) {
    let m = Message { role: role.to_owned(), content: Some(text.to_owned()), ..Message::default() };
    store.append_message(sid, &m).expect("append");
}

#[test]
fn end_reason_first_wins_and_reopen_keeps_a_compression_link() {
    let fx = Fx::new();
    fx.store.create_session(&session("A", "cli", None)).expect("create");
    assert!(fx.store.end_session("A", &"compression".into()).expect("end"));
    assert!(!fx.store.end_session("A", &"user_exit".into()).expect("end"));
    assert_eq!(
        fx.store.session("A").expect("s").expect("row").end_reason.as_deref(),
        Some("compression")
    );
    // A follow-up reopening it never erases the compression link (semantics §0, §6.3).
    assert!(fx.store.reopen_session("A").expect("reopen"));
    assert!(!fx.store.end_session("A", &"completed".into()).expect("end"));
    assert_eq!(
        fx.store.session("A").expect("s").expect("row").end_reason.as_deref(),
        Some("compression")
    );
    fx.store.create_session(&session("B", "cli", None)).expect("create");
    assert!(fx.store.end_session("B", &"completed".into()).expect("end"));
    assert!(fx.store.reopen_session("B").expect("reopen"));
    assert_eq!(fx.store.session("B").expect("s").expect("row").end_reason, None);
    assert!(fx.store.session("nope").expect("s").is_none());
}

#[test]
fn transcript_keeps_insertion_order_and_skips_inactive_rows() {
    let fx = Fx::new();
    fx.store.create_session(&session("c", "delegate", None)).expect("create");
    for (role, text) in
        [("system", "sys"), ("user", "goal"), ("assistant", "answer\u{0}json:{}"), ("user", "more")]
    {
        say(&fx.store, "c", role, text);
    }
    fx.raw()
        .execute("UPDATE messages SET active = 0 WHERE content = 'more'", [])
        .expect("deactivate");
    let conv = fx.store.conversation("c").expect("conv");
    assert_eq!(
        conv.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(),
        ["system", "user", "assistant"]
    );
    assert_eq!(conv[2].content.as_deref(), Some("answer\u{0}json:{}"));
    let err = fx.store.append_message("ghost", &Message::default()).expect_err("missing");
    assert!(err.to_string().contains("ghost"));
}

#[test]
fn model_config_must_be_an_object() {
    let fx = Fx::new();
    let mut s = session("x", "cli", None);
    s.model_config = Some(json!([1]));
    assert!(fx.store.create_session(&s).is_err());
    assert!(fx.store.session("x").expect("s").is_none(), "nothing half-written");
}

#[test]
fn compression_tip_follows_unmarked_continuations() {
    let fx = Fx::new();
    let st = &fx.store;
    st.create_session(&session("k", "delegate", None)).expect("c");
    say(st, "k", "user", "goal");
    st.end_session("k", &"compression".into()).expect("end");
    st.create_session(&session("k2", "delegate", Some("k"))).expect("c");
    let mut branch = session("kb", "cli", Some("k"));
    branch.model_config = Some(json!({"_branched_from": null}));
    st.create_session(&branch).expect("c");
    say(st, "kb", "user", "branch text");
    st.create_session(&session("kt", "tool", Some("k"))).expect("c");
    say(st, "k2", "user", "continued");
    assert_eq!(st.compression_tip("k").expect("tip"), "k2");
    // A continuation without messages is not a resume target.
    st.end_session("k2", &"compression".into()).expect("end");
    st.create_session(&session("k3", "delegate", Some("k2"))).expect("c");
    assert_eq!(st.compression_tip("k").expect("tip"), "k2");
    assert_eq!(st.compression_tip("unknown").expect("tip"), "unknown");
    assert_eq!(st.child_sessions("k").expect("children").len(), 3);
}
