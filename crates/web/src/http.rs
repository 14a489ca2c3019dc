//! Routing and headers. Every response carries a strict
//! Content-Security-Policy (same-origin script and style only, nothing
//! inline, no frames; forms only to the view itself, and only when it is
//! writable), `nosniff` and `no-referrer` (`same-origin` on a writable
//! view, whose form posts must carry their `Origin`). With a token (`--allow-remote`),
//! every request must present it: `Authorization: Bearer TOKEN`, or the
//! cookie a first `?token=TOKEN` visit sets.
//!
//! The view's only state-changing requests are the approval decisions
//! (`POST /approvals/ID`, issue #37): refused on a read-only view (405),
//! without an `Origin` of the view itself (403: another page cannot post
//! here), without a CSRF token this server issued for a page (403), or
//! with a body over [`MAX_FORM_BYTES`] (413).

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::HeaderValue;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;

use crate::site::{CSP_WRITABLE, HTML, JSON, Site, respond, same};
use crate::{model, pages};

const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");
const TOKEN_COOKIE: &str = "retinue_token";

/// Whether the request's `Host` (or its absolute URI's authority) is one
/// the site answers.
fn host_allowed<B>(site: &Site, req: &Request<B>) -> bool {
    let given = req
        .headers()
        .get(hyper::header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_owned()));
    let Some(given) = given else { return false };
    let given = given.trim().to_ascii_lowercase();
    site.hosts.contains(&given)
}

/// The wall clock, through core's [`retinue_core::Clock`].
fn now() -> f64 {
    retinue_core::Clock::now(&retinue_core::SystemClock)
}

fn presented<B>(req: &Request<B>) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(v) = req.headers().get("authorization").and_then(|v| v.to_str().ok())
        && let Some(t) = v.strip_prefix("Bearer ")
    {
        out.push(t.trim().to_owned());
    }
    out.extend(cookies(req, TOKEN_COOKIE));
    out
}

/// The values of the cookies named `name` the request carries.
fn cookies<B>(req: &Request<B>, name: &str) -> Vec<String> {
    let prefix = format!("{name}=");
    let headers = req.headers().get_all("cookie");
    let all = headers.iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';'));
    all.filter_map(|part| part.trim().strip_prefix(prefix.as_str()).map(str::to_owned)).collect()
}

/// A redirect to `path` (on this site) that sets the cookie `name` to
/// `value`: a secret given in the address is remembered, and dropped from
/// the address bar.
fn remember(name: &str, value: &str, path: &str) -> Response<Full<Bytes>> {
    let mut r = respond(StatusCode::SEE_OTHER, "text/plain", "");
    let cookie = format!("{name}={value}; HttpOnly; SameSite=Strict; Path=/");
    // Same origin only: `//host/…` would leave the site.
    let here = format!("/{}", path.trim_start_matches('/'));
    if let (Ok(c), Ok(l)) = (HeaderValue::from_str(&cookie), HeaderValue::from_str(&here)) {
        r.headers_mut().insert("set-cookie", c);
        r.headers_mut().insert("location", l);
    }
    r
}

fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    let prefix = format!("{name}=");
    query?
        .split('&')
        .find_map(|kv| kv.strip_prefix(prefix.as_str()))
        .map(|t| percent_encoding::percent_decode_str(t).decode_utf8_lossy().into_owned())
}

fn query_token(query: Option<&str>) -> Option<String> {
    query_param(query, "token")
}

/// The cookie that carries the approve key (loopback, no token).
const APPROVE_COOKIE: &str = "retinue_approve";

/// Whether the request may decide approvals: under a token every request
/// has presented it; on loopback the approve key must come in its cookie
/// (set by the `?approve=KEY` address `retinue serve` printed), so a local
/// process that merely reads the page cannot post.
fn may_decide<B>(site: &Site, req: &Request<B>) -> bool {
    if site.token.is_some() {
        return true;
    }
    let Some(key) = &site.approve_key else { return false };
    cookies(req, APPROVE_COOKIE).iter().any(|given| same(given, key))
}

/// Answers one request (blocking reads run on tokio's blocking pool).
pub(crate) async fn handle<B>(site: Arc<Site>, req: Request<B>) -> Response<Full<Bytes>>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let writable = site.writable;
    let mut r = route(site, req).await;
    if writable {
        let h = r.headers_mut();
        h.insert("content-security-policy", HeaderValue::from_static(CSP_WRITABLE));
        // `no-referrer` would make a browser send `Origin: null` with the
        // view's own form posts; `same-origin` still tells other sites
        // nothing.
        h.insert("referrer-policy", HeaderValue::from_static("same-origin"));
    }
    r
}

async fn route<B>(site: Arc<Site>, req: Request<B>) -> Response<Full<Bytes>>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    if !host_allowed(&site, &req) {
        return respond(StatusCode::FORBIDDEN, "text/plain", "unknown Host\n");
    }
    let post = req.method() == Method::POST;
    if !post && req.method() != Method::GET && req.method() != Method::HEAD {
        return respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "method not allowed\n");
    }
    if post && !site.writable {
        return respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "read-only view\n");
    }
    let path = req.uri().path().to_owned();
    if let Some(token) = &site.token {
        if let Some(given) = query_token(req.uri().query()) {
            if !same(&given, token) {
                return respond(StatusCode::UNAUTHORIZED, "text/plain", "bad token\n");
            }
            return remember(TOKEN_COOKIE, token, &path);
        }
        if !presented(&req).iter().any(|t| same(t, token)) {
            return respond(
                StatusCode::UNAUTHORIZED,
                "text/plain",
                "this view needs its token: open the address `retinue serve` printed\n",
            );
        }
    }
    if let (Some(key), Some(given)) = (&site.approve_key, query_param(req.uri().query(), "approve"))
    {
        if !same(&given, key) {
            return respond(StatusCode::UNAUTHORIZED, "text/plain", "bad approve key\n");
        }
        return remember(APPROVE_COOKIE, key, &path);
    }
    let decides = may_decide(&site, &req);
    if post {
        if !decides {
            return respond(
                StatusCode::FORBIDDEN,
                "text/plain",
                "deciding needs the view's key: open the address `retinue serve` printed\n",
            );
        }
        return crate::decide::post(site, req).await;
    }
    match path.as_str() {
        "/static/app.js" => respond(StatusCode::OK, "text/javascript; charset=utf-8", APP_JS),
        "/static/app.css" => respond(StatusCode::OK, "text/css; charset=utf-8", APP_CSS),
        "/favicon.ico" => respond(StatusCode::NOT_FOUND, "text/plain", ""),
        _ => {
            let site = site.clone();
            let joined = tokio::task::spawn_blocking(move || render(&site, &path, decides)).await;
            joined.unwrap_or_else(|e| {
                log::error!("a page did not render: {e}");
                respond(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "internal error\n")
            })
        }
    }
}

fn render(site: &Site, path: &str, decides: bool) -> Response<Full<Bytes>> {
    let forms = |back: &str| {
        site.issue().filter(|_| decides).map(|csrf| pages::Forms { csrf, back: back.to_owned() })
    };
    let parts = &site.parts;
    let failed = |e: crate::WebError| {
        log::warn!("{path}: {e}");
        respond(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            format!("cannot read the registry: {e}\n"),
        )
    };
    match path {
        "/" | "/fragment/tree" => match model::tree(parts, now()) {
            Ok(tree) => {
                let body = pages::tree_fragment(&tree, forms("/").as_ref());
                let markup = if path == "/" {
                    pages::layout("Subagent tree", Some("/fragment/tree"), body)
                } else {
                    body
                };
                respond(StatusCode::OK, HTML, markup.into_string())
            }
            Err(e) => failed(e),
        },
        "/api/marker" => match parts.backend.controls.change_marker() {
            Ok(m) => respond(StatusCode::OK, JSON, json!({ "marker": m }).to_string()),
            Err(e) => failed(crate::WebError::Read(e.to_string())),
        },
        _ => {
            let (fragment, id) = match path.strip_prefix("/fragment/child/") {
                Some(id) => (true, id),
                None => match path.strip_prefix("/child/") {
                    Some(id) => (false, id),
                    None => {
                        return respond(
                            StatusCode::NOT_FOUND,
                            HTML,
                            pages::layout("Not found", None, pages::not_found(path)).into_string(),
                        );
                    }
                },
            };
            let id = percent_encoding::percent_decode_str(id).decode_utf8_lossy().into_owned();
            match model::child_page(parts, &id, now()) {
                Ok(Some(page)) => {
                    let back = format!(
                        "/child/{}",
                        percent_encoding::utf8_percent_encode(
                            &id,
                            percent_encoding::NON_ALPHANUMERIC
                        )
                    );
                    let body = pages::child_fragment(&page, forms(&back).as_ref());
                    let markup = if fragment {
                        body
                    } else {
                        let live = format!(
                            "/fragment/child/{}",
                            percent_encoding::utf8_percent_encode(
                                &id,
                                percent_encoding::NON_ALPHANUMERIC
                            )
                        );
                        pages::layout(&format!("subagent {id}"), Some(&live), body)
                    };
                    respond(StatusCode::OK, HTML, markup.into_string())
                }
                Ok(None) => respond(
                    StatusCode::NOT_FOUND,
                    HTML,
                    pages::layout("Not found", None, pages::not_found(&id)).into_string(),
                ),
                Err(e) => failed(e),
            }
        }
    }
}
