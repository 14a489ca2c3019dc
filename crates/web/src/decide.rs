//! `POST /approvals/ID`: an approval decision from the view's buttons
//! (issue #37), recorded as the view's scope's operator (`decided_by: web`).
//! The checks run before anything is read: the view is writable, the
//! request comes from the view's own origin, the body is small, and it
//! carries a CSRF token the view issued with a page.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::HeaderValue;
use hyper::{Request, Response, StatusCode};
use retinue_core::{ApprovalScope, DecideOutcome, Decision};

use crate::site::{HTML, MAX_FORM_BYTES, Site, respond};
use crate::{model, pages};

/// The fields of a decision form.
#[derive(Debug, Default, PartialEq)]
struct Form {
    csrf: String,
    back: String,
    decision: String,
    reason: String,
}

fn parse(body: &[u8]) -> Form {
    let mut f = Form::default();
    for (k, v) in form_urlencoded::parse(body) {
        match k.as_ref() {
            "csrf" => f.csrf = v.into_owned(),
            "back" => f.back = v.into_owned(),
            "decision" => f.decision = v.into_owned(),
            "reason" => f.reason = v.into_owned(),
            _ => {}
        }
    }
    f
}

/// Where to go after a decision: the form's page when it is one of the
/// view's own paths, else the tree (never another site: no `//host`).
fn back_to(back: &str) -> String {
    let safe = back.starts_with('/')
        && !back.starts_with("//")
        && back.chars().all(|c| c.is_ascii_alphanumeric() || "/%-_.".contains(c));
    if safe { back.to_owned() } else { "/".to_owned() }
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    respond(status, "text/plain; charset=utf-8", format!("{body}\n"))
}

/// Handles one decision post.
pub(crate) async fn post<B>(site: Arc<Site>, req: Request<B>) -> Response<Full<Bytes>>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let Some(id) = req.uri().path().strip_prefix("/approvals/").map(str::to_owned) else {
        return text(StatusCode::NOT_FOUND, "nothing to post here");
    };
    if !site.same_origin(&req) {
        return text(StatusCode::FORBIDDEN, "cross-origin request refused");
    }
    let body = match Limited::new(req.into_body(), MAX_FORM_BYTES).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return text(StatusCode::PAYLOAD_TOO_LARGE, "the form is too large"),
    };
    let form = parse(&body);
    if form.csrf.is_empty() || !site.issued(&form.csrf) {
        return text(StatusCode::FORBIDDEN, "stale or missing form token: reload the page");
    }
    let id = percent_encoding::percent_decode_str(&id).decode_utf8_lossy().into_owned();
    let decision = match form.decision.as_str() {
        "approve" => Decision::approve("web", ApprovalScope::Once),
        "always" => Decision::approve("web", ApprovalScope::Always),
        "deny" => Decision::deny("web", Some(form.reason.clone())),
        _ => return text(StatusCode::BAD_REQUEST, "decision must be approve, always or deny"),
    };
    let back = back_to(&form.back);
    let decided = tokio::task::spawn_blocking(move || {
        let scope = model::scope(&site.parts);
        site.parts.backend.approvals.decide_approval(&id, &scope, &decision)
    })
    .await;
    match decided {
        Ok(Ok(DecideOutcome::Decided(_))) => {
            let mut r = respond(StatusCode::SEE_OTHER, "text/plain", "");
            if let Ok(l) = HeaderValue::from_str(&back) {
                r.headers_mut().insert("location", l);
            }
            r
        }
        Ok(Ok(DecideOutcome::AlreadyDecided(r))) => respond(
            StatusCode::CONFLICT,
            HTML,
            pages::layout("Already decided", None, pages::already_decided(&r, &back)).into_string(),
        ),
        Ok(Ok(DecideOutcome::Missing)) => text(StatusCode::NOT_FOUND, "no such approval request"),
        Ok(Err(e)) => text(StatusCode::SERVICE_UNAVAILABLE, &format!("cannot record it: {e}")),
        Err(e) => {
            log::error!("a decision did not finish: {e}");
            text(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_form_is_read_and_back_never_leaves_the_view() {
        let f = parse(b"csrf=abc&back=%2Fchild%2Fsa-0-1&decision=deny&reason=not+now&x=1");
        assert_eq!(f.reason, "not now");
        assert_eq!((f.csrf.as_str(), f.decision.as_str()), ("abc", "deny"));
        assert_eq!(back_to(&f.back), "/child/sa-0-1");
        for evil in ["//evil.example/", "https://evil.example/", "/\\evil", "javascript:x", ""] {
            assert_eq!(back_to(evil), "/", "{evil}");
        }
    }
}
