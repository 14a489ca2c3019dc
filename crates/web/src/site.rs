//! The view's shared state ([`Site`]): what it reads, which `Host`s it
//! answers, whether it is writable and the CSRF tokens it issued; and the
//! headers every response carries.

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Request, Response, StatusCode};

use crate::WebParts;

/// The Content-Security-Policy of every response.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// The Content-Security-Policy of a writable view: forms may post to the
/// view itself.
pub const CSP_WRITABLE: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'self'; \
     frame-ancestors 'none'";

/// The largest decision form accepted.
pub const MAX_FORM_BYTES: usize = 16 * 1024;

/// CSRF tokens remembered (the oldest are forgotten first).
const MAX_CSRF_TOKENS: usize = 4096;

/// The server's shared state.
pub(crate) struct Site {
    pub(crate) parts: WebParts,
    pub(crate) token: Option<String>,
    /// The `Host` values answered (lowercase `name:port`): anything else is
    /// 403 before any read, so a rebound DNS name reads nothing.
    pub(crate) hosts: Vec<String>,
    /// Whether approval decisions may be posted (`serve` without
    /// `--read-only`).
    pub(crate) writable: bool,
    /// On a writable view without a token: the key a browser must carry (in
    /// a cookie) to decide.
    pub(crate) approve_key: Option<String>,
    /// The CSRF tokens issued with the pages rendered so far.
    pub(crate) csrf: std::sync::Mutex<std::collections::VecDeque<String>>,
}

impl Site {
    /// A fresh CSRF token for one rendered page (`None`: read-only, or no
    /// secure random source — then no form is shown).
    pub(crate) fn issue(&self) -> Option<String> {
        if !self.writable {
            return None;
        }
        let token = retinue_core::random_hex(16).ok()?;
        let mut issued = self.csrf.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if issued.len() >= MAX_CSRF_TOKENS {
            issued.pop_front();
        }
        issued.push_back(token.clone());
        Some(token)
    }

    /// Whether `given` is a token this server issued.
    pub(crate) fn issued(&self, given: &str) -> bool {
        let issued = self.csrf.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        issued.iter().fold(false, |found, t| found | same(t, given))
    }

    /// Whether the request's `Origin` is this view (`http://` or
    /// `https://` and a `Host` the view answers).
    pub(crate) fn same_origin<B>(&self, req: &Request<B>) -> bool {
        let Some(origin) = req.headers().get("origin").and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let origin = origin.trim().to_ascii_lowercase();
        let host = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://"));
        host.is_some_and(|h| self.hosts.iter().any(|known| known == h))
    }
}

pub(crate) fn respond(
    status: StatusCode,
    kind: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert("content-security-policy", HeaderValue::from_static(CSP));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    r
}

pub(crate) const HTML: &str = "text/html; charset=utf-8";
pub(crate) const JSON: &str = "application/json";

/// Constant-time equality of two secrets.
pub(crate) fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
