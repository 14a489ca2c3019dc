//! Plain record types that cross the store's boundary, and the
//! corruption-tolerant readers of hermes's JSON columns (semantics §2.7).

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};

use crate::status::UnitState;

/// Longest goal kept in a manifest, in Unicode scalars.
pub const GOAL_MAX_CHARS: usize = 200;

/// One child of a unit as recorded in the manifest (`children_json` entry).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChildManifest {
    /// `sa-<index>-<8hex>`.
    pub subagent_id: String,
    /// The child's own session id.
    pub session_id: String,
    /// Model the child ran with.
    pub model: Option<String>,
    /// Provider the child ran with.
    pub provider: Option<String>,
    /// Provider base URL.
    pub base_url: Option<String>,
    /// API mode.
    pub api_mode: Option<String>,
    /// Toolsets the child was given.
    pub toolsets: Option<Vec<String>>,
    /// `leaf` or `orchestrator`.
    pub role: Option<String>,
    /// The goal, at most [`GOAL_MAX_CHARS`] scalars.
    pub goal: Option<String>,
    /// The directory the child's tools worked in (Retinue's key; hermes
    /// ignores it). A follow-up works in the same one.
    pub workspace: Option<String>,
}

/// Cuts `s` to at most `max` Unicode scalars.
pub fn truncate_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((at, _)) => s[..at].to_owned(),
        None => s.to_owned(),
    }
}

fn opt_str(obj: &Map<String, Value>, key: &str) -> Option<String> {
    match obj.get(key) {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    }
}

/// The well-typed shape of a manifest object (the fast path of [`ChildManifest::parse`]).
#[derive(serde::Deserialize)]
struct TypedManifest {
    #[serde(default)]
    subagent_id: Option<String>,
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    provider: Option<String>,
    #[serde(default)]
    base_url: Option<String>,
    #[serde(default)]
    api_mode: Option<String>,
    #[serde(default)]
    toolsets: Option<Vec<String>>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    goal: Option<String>,
    #[serde(default)]
    workspace: Option<String>,
}

impl ChildManifest {
    /// Reads one stored manifest object; malformed text or a non-object → `None`.
    /// Well-typed objects take a direct path; anything else the lenient one.
    pub fn parse(text: &str) -> Option<ChildManifest> {
        if let Ok(t) = serde_json::from_str::<TypedManifest>(text) {
            return Some(ChildManifest {
                subagent_id: t.subagent_id.unwrap_or_default(),
                session_id: t.session_id.unwrap_or_default(),
                model: t.model,
                provider: t.provider,
                base_url: t.base_url,
                api_mode: t.api_mode,
                toolsets: t.toolsets,
                role: t.role,
                goal: t.goal.map(|g| truncate_chars(&g, GOAL_MAX_CHARS)),
                workspace: t.workspace,
            });
        }
        serde_json::from_str::<Value>(text).ok().and_then(|v| ChildManifest::from_json(&v))
    }

    /// Reads one manifest object; `None` when `v` is not an object.
    pub fn from_json(v: &Value) -> Option<ChildManifest> {
        let obj = v.as_object()?;
        let toolsets = obj
            .get("toolsets")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect::<Vec<_>>());
        Some(ChildManifest {
            subagent_id: opt_str(obj, "subagent_id").unwrap_or_default(),
            session_id: opt_str(obj, "session_id").unwrap_or_default(),
            model: opt_str(obj, "model"),
            provider: opt_str(obj, "provider"),
            base_url: opt_str(obj, "base_url"),
            api_mode: opt_str(obj, "api_mode"),
            toolsets,
            role: opt_str(obj, "role"),
            goal: opt_str(obj, "goal").map(|g| truncate_chars(&g, GOAL_MAX_CHARS)),
            workspace: opt_str(obj, "workspace"),
        })
    }

    /// The hermes-format object (never carries credentials).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("subagent_id".into(), Value::String(self.subagent_id.clone()));
        m.insert("session_id".into(), Value::String(self.session_id.clone()));
        m.insert("model".into(), self.model.clone().map_or(Value::Null, Value::String));
        m.insert(
            "goal".into(),
            self.goal
                .as_deref()
                .map_or(Value::Null, |g| Value::String(truncate_chars(g, GOAL_MAX_CHARS))),
        );
        for (key, val) in [
            ("provider", &self.provider),
            ("base_url", &self.base_url),
            ("api_mode", &self.api_mode),
            ("role", &self.role),
            ("workspace", &self.workspace),
        ] {
            if let Some(v) = val {
                let v = if key == "base_url" { redact_url(v) } else { v.clone() };
                m.insert(key.into(), Value::String(v));
            }
        }
        if let Some(t) = &self.toolsets {
            m.insert("toolsets".into(), Value::from(t.clone()));
        }
        Value::Object(m)
    }
}

/// Parses `children_json` the way semantics §2.7 says: NULL, malformed or
/// non-array → empty; non-objects skipped; an empty list with a unit
/// `child_session_id` synthesizes one child.
pub fn parse_children_json(
    children_json: Option<&str>,
    child_session_id: Option<&str>,
) -> Vec<ChildManifest> {
    let parsed: Vec<ChildManifest> = children_json
        .and_then(|s| serde_json::from_str::<Value>(s).ok())
        .and_then(|v| match v {
            Value::Array(items) => {
                Some(items.iter().filter_map(ChildManifest::from_json).collect())
            }
            _ => None,
        })
        .unwrap_or_default();
    if parsed.is_empty()
        && let Some(sid) = child_session_id.map(str::trim).filter(|s| !s.is_empty())
    {
        return vec![ChildManifest { session_id: sid.to_owned(), ..ChildManifest::default() }];
    }
    parsed
}

/// Serializes a manifest list as hermes's `children_json`.
pub fn children_json(children: &[ChildManifest]) -> String {
    Value::Array(children.iter().map(ChildManifest::to_json).collect()).to_string()
}

/// Parses optional JSON text; malformed = absent.
pub fn parse_json_opt(text: Option<&str>) -> Option<Value> {
    text.and_then(|s| serde_json::from_str(s).ok())
}

/// Why a child was de-registered from follow-ups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TombstoneReason {
    /// An operator or tool tombstoned it.
    Manual,
    /// Its TTL ran out.
    Ttl,
    /// Its unit fell beyond `max_retained`.
    Cap,
    /// Another writer (hermes) tombstoned the unit without a reason.
    External,
    /// An operator-supplied reason.
    Other(String),
}

impl TombstoneReason {
    /// The stored text.
    pub fn as_str(&self) -> &str {
        match self {
            TombstoneReason::Manual => "manual",
            TombstoneReason::Ttl => "ttl",
            TombstoneReason::Cap => "cap",
            TombstoneReason::External => "external",
            TombstoneReason::Other(s) => s,
        }
    }

    /// The tombstone's stored note: none for an operator's `manual`
    /// tombstone, otherwise the reason's text.
    pub fn note(&self) -> Option<String> {
        match self {
            TombstoneReason::Manual => None,
            other => Some(other.as_str().to_owned()),
        }
    }

    /// Reads the stored text (NULL or blank reads as `external`).
    pub fn parse(s: Option<&str>) -> TombstoneReason {
        match s.map(str::trim) {
            Some("manual") => TombstoneReason::Manual,
            Some("ttl") => TombstoneReason::Ttl,
            Some("cap") => TombstoneReason::Cap,
            None | Some("" | "external") => TombstoneReason::External,
            Some(other) => TombstoneReason::Other(other.to_owned()),
        }
    }
}

/// Query parameter names that look like secrets (matched case-insensitively
/// as substrings): such parameters never reach the file.
const SECRET_PARAMS: &[&str] =
    &["key", "token", "secret", "passw", "pwd", "sig", "auth", "credential", "cookie"];

/// `url` without credentials: the userinfo (`user:pass@`) and every
/// secret-looking query parameter (`key`, `api_key`, `token`, `secret`,
/// `password`, `sig`, …) are removed. Anything else is kept as written.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let rest = userinfo_at(rest).map_or(rest, |at| &rest[at + 1..]);
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (host, tail) = rest.split_at(authority_end);
    let (before_fragment, fragment) = match tail.find('#') {
        Some(i) => tail.split_at(i),
        None => (tail, ""),
    };
    let (path, query) = match before_fragment.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (before_fragment, None),
    };
    let mut out = format!("{scheme}{host}{path}");
    if let Some(q) = query {
        let kept: Vec<&str> = q
            .split('&')
            .filter(|pair| {
                let name = pair.split('=').next().unwrap_or_default().to_ascii_lowercase();
                !name.is_empty() && !SECRET_PARAMS.iter().any(|s| name.contains(s))
            })
            .collect();
        if !kept.is_empty() {
            out.push('?');
            out.push_str(&kept.join("&"));
        }
    }
    out.push_str(fragment);
    out
}

/// The byte index of the `@` that ends the userinfo of `rest` (a URL after
/// its `scheme://`), if it has one. The userinfo runs to the last `@` before
/// the query or fragment, so a password holding `/` or `@` (which clients
/// accept unencoded) is never read as a host and path and kept; an `@`
/// inside a path stays the path's when what precedes its first `/` is a
/// plain host or `host:port` (no password can be there).
pub fn userinfo_at(rest: &str) -> Option<usize> {
    let end = rest.find(['?', '#']).unwrap_or(rest.len());
    let at = rest[..end].rfind('@')?;
    let info = &rest[..at];
    match info.find('/') {
        None => Some(at),
        Some(slash) => match info[..slash].split_once(':') {
            Some((_, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => None,
            Some(_) => Some(at),
            None => None,
        },
    }
}

/// `url` as any message, log or stored column may show it: the userinfo
/// (`user:password@`) becomes `***@` and every query value `***`
/// (`?api_key=K` → `?api_key=***`); scheme, host, port and path stay.
pub fn redact_endpoint(url: &str) -> String {
    let url = url.trim();
    let (head, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), url),
    };
    let rest = match userinfo_at(rest) {
        Some(at) => format!("***@{}", &rest[at + 1..]),
        None => rest.to_owned(),
    };
    let (rest, fragment) = match rest.split_once('#') {
        Some((r, _)) => (r.to_owned(), "#***"),
        None => (rest, ""),
    };
    let rest = match rest.split_once('?') {
        Some((path, query)) => {
            let params: Vec<String> = query
                .split('&')
                .map(|kv| match kv.split_once('=') {
                    Some((k, _)) => format!("{k}=***"),
                    None if kv.is_empty() => String::new(),
                    None => "***".to_owned(),
                })
                .collect();
            format!("{path}?{}", params.join("&"))
        }
        None => rest,
    };
    format!("{head}{rest}{fragment}")
}

/// `url` without its userinfo (never sent: a key goes only in the
/// `Authorization` header the operator configured), and whether it had one.
pub fn strip_userinfo(url: &str) -> (String, bool) {
    let url = url.trim();
    let (head, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), url),
    };
    match userinfo_at(rest) {
        Some(at) => (format!("{head}{}", &rest[at + 1..]), true),
        None => (url.to_owned(), false),
    }
}

#[cfg(test)]
mod endpoint_tests {
    use super::{redact_endpoint, strip_userinfo};

    #[test]
    fn endpoints_are_redacted_and_stripped() {
        assert_eq!(
            redact_endpoint("http://alice:PW@host:8080/v1?api_key=K&x=1#frag"),
            "http://***@host:8080/v1?api_key=***&x=***#***"
        );
        assert_eq!(redact_endpoint("https://api.openai.com/v1"), "https://api.openai.com/v1");
        assert_eq!(redact_endpoint("http://u:p/w@d@h/v1"), "http://***@h/v1");
        assert_eq!(strip_userinfo("http://a:b@h/v1"), ("http://h/v1".to_owned(), true));
        assert_eq!(strip_userinfo("http://h/v1"), ("http://h/v1".to_owned(), false));
    }
}

/// One retained child: the registry's entry.
///
/// Serializes to exactly the spec's keys: `delegation_id`,
/// `parent_session_id`, `owner_profile`, `state`, `retained_at`,
/// `completed_at`, `child_id`, `child_session_id`, `model`, `goal`.
#[derive(Debug, Clone, PartialEq)]
pub struct RetainedChild {
    /// The unit's id.
    pub delegation_id: String,
    /// The spawner's session id (`''` if none).
    pub parent_session_id: String,
    /// The unit's profile (`''` for NULL).
    pub owner_profile: String,
    /// The unit's state.
    pub state: UnitState,
    /// The child's retention time.
    pub retained_at: Option<f64>,
    /// The unit's completion time.
    pub completed_at: Option<f64>,
    /// The child's index in its unit.
    pub child_index: u32,
    /// The subagent id (`''` if unknown).
    pub subagent_id: String,
    /// The child's session id (`''` if none).
    pub child_session_id: String,
    /// The full manifest entry.
    pub manifest: ChildManifest,
}

impl RetainedChild {
    /// `subagent_id`, else `session_id`, else `''`.
    pub fn child_id(&self) -> &str {
        if !self.subagent_id.is_empty() { &self.subagent_id } else { &self.child_session_id }
    }

    /// The serialized entry as a JSON value.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

impl Serialize for RetainedChild {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(10))?;
        m.serialize_entry("delegation_id", &self.delegation_id)?;
        m.serialize_entry("parent_session_id", &self.parent_session_id)?;
        m.serialize_entry("owner_profile", &self.owner_profile)?;
        m.serialize_entry("state", &self.state)?;
        m.serialize_entry("retained_at", &self.retained_at)?;
        m.serialize_entry("completed_at", &self.completed_at)?;
        m.serialize_entry("child_id", self.child_id())?;
        m.serialize_entry("child_session_id", &self.child_session_id)?;
        m.serialize_entry("model", &self.manifest.model)?;
        m.serialize_entry("goal", &self.manifest.goal)?;
        m.end()
    }
}

/// Why a known child cannot be addressed (first match of semantics §3.1).
#[derive(Debug, Clone, PartialEq)]
pub enum Unaddressable {
    /// Tombstoned (or due to be: `ttl`/`cap` before the prune writes it).
    Tombstoned {
        /// When.
        at: f64,
        /// Why.
        reason: TombstoneReason,
        /// The operator's free-text note of a manual tombstone
        /// (`children tombstone --reason TEXT`); `None` otherwise.
        note: Option<String>,
    },
    /// Its unit was never retained.
    NeverRetained,
}

/// The unscoped answer of [`crate::RegistryRead::lookup`].
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// The child may be addressed (subject to authority).
    Addressable(RetainedChild),
    /// The child is known but not addressable.
    NotAddressable(RetainedChild, Unaddressable),
    /// No such id.
    Unknown,
}

/// Counts of one prune.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct PruneCount {
    /// Units newly tombstoned (hermes's count).
    pub units: usize,
    /// Children newly tombstoned.
    pub children: usize,
}

/// A child session to create with a unit.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NewSession {
    /// Session id.
    pub id: String,
    /// `cli`, `delegate`, …
    pub source: String,
    /// Model name.
    pub model: Option<String>,
    /// JSON object of lineage markers, or `None`.
    pub model_config: Option<Value>,
    /// Parent session id.
    pub parent_session_id: Option<String>,
    /// Profile name.
    pub profile_name: Option<String>,
    /// Creation time; `None` = now.
    pub started_at: Option<f64>,
}

/// A new `running` unit with its manifest and child sessions (one transaction).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct UnitDraft {
    /// Routing key of the origin (`''` if none).
    pub origin_session: String,
    /// UI session id of the origin.
    pub origin_ui_session_id: String,
    /// Origin session id.
    pub origin_session_id: String,
    /// The spawner.
    pub parent_session_id: Option<String>,
    /// The owning process id.
    pub owner_pid: Option<i64>,
    /// The owner's start-time fingerprint.
    pub owner_started_at: Option<i64>,
    /// Goal(s), context, toolsets, role, model, `is_batch`, mode.
    pub task: Value,
    /// Profile key.
    pub owner_profile: String,
    /// The manifest, by child index.
    pub children: Vec<ChildManifest>,
    /// Child sessions to create.
    pub child_sessions: Vec<NewSession>,
}

/// A completion event (semantics §3.7): what a parent is told when a unit
/// ends, stored as the unit's `event_json` in hermes's shape
/// (`{"type": "async_delegation", "delegation_id", "parent_session_id",
/// "status", "results": [...]}`) and handed to a completion sink once.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionEvent {
    /// The unit.
    pub delegation_id: String,
    /// The parent that is told (absent in some hermes rows).
    pub parent_session_id: Option<String>,
    /// The unit's state.
    pub status: UnitState,
    /// The per-child result entries, as stored (hermes's JSON shape).
    pub results: Vec<Value>,
    /// The whole event as stored; a hermes row may carry more keys
    /// (`summary`, …), forwarded unchanged.
    pub raw: Value,
}

impl CompletionEvent {
    /// A new event for `delegation_id`.
    pub fn new(
        delegation_id: &str,
        parent_session_id: Option<&str>,
        status: UnitState,
        results: Vec<Value>,
    ) -> CompletionEvent {
        let raw = serde_json::json!({
            "type": "async_delegation",
            "delegation_id": delegation_id,
            "parent_session_id": parent_session_id,
            "status": status,
            "results": results,
        });
        CompletionEvent {
            delegation_id: delegation_id.to_owned(),
            parent_session_id: parent_session_id.map(str::to_owned),
            status,
            results,
            raw,
        }
    }

    /// Reads a stored event of unit `delegation_id` (untrusted: a missing or
    /// mistyped key reads as absent, the unit's id wins over the event's).
    pub fn from_stored(delegation_id: &str, raw: Value) -> CompletionEvent {
        let text = |k: &str| raw.get(k).and_then(Value::as_str).map(str::to_owned);
        CompletionEvent {
            delegation_id: delegation_id.to_owned(),
            parent_session_id: text("parent_session_id"),
            status: text("status")
                .map_or(UnitState::Other(String::new()), |s| UnitState::parse(&s)),
            results: raw.get("results").and_then(Value::as_array).cloned().unwrap_or_default(),
            raw,
        }
    }

    /// The event as stored and delivered.
    pub fn to_json(&self) -> &Value {
        &self.raw
    }
}

/// The error text of a unit recovery found abandoned (semantics §3.8).
pub const ABANDONED_ERROR: &str =
    "Delegation owner exited before recording a terminal result; outcome unknown.";

/// What recovery records for an abandoned unit (semantics §3.8): its
/// `unknown` completion event — the unit's origin and parent, the stored
/// task's keys (untrusted: they never override these) — and its result.
pub fn abandoned_event(
    delegation_id: &str,
    origins: [Option<String>; 3],
    parent_session_id: Option<String>,
    task_json: Option<&str>,
) -> (Value, Value) {
    let mut ev = Map::new();
    ev.insert("type".into(), serde_json::json!("async_delegation"));
    ev.insert("delegation_id".into(), serde_json::json!(delegation_id));
    for (key, value) in
        ["origin_session", "origin_ui_session_id", "origin_session_id"].into_iter().zip(origins)
    {
        ev.insert(key.into(), serde_json::json!(value.unwrap_or_default()));
    }
    ev.insert("parent_session_id".into(), serde_json::json!(parent_session_id));
    if let Some(Value::Object(task)) = parse_json_opt(task_json) {
        for (k, v) in task {
            ev.entry(k).or_insert(v);
        }
    }
    ev.insert("status".into(), serde_json::json!("unknown"));
    ev.insert("error".into(), serde_json::json!(ABANDONED_ERROR));
    let result = serde_json::json!({"status": "unknown", "error": ABANDONED_ERROR});
    (Value::Object(ev), result)
}

/// What a completion records (semantics §3.2 `persist_completion`).
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The unit.
    pub delegation_id: String,
    /// Unit status; `completed` retains.
    pub status: UnitState,
    /// The event delivered to the parent.
    pub event: CompletionEvent,
    /// The result object.
    pub result: Value,
    /// Usage built from real results.
    pub usage: Option<Value>,
    /// Background units stay `pending` for delivery; sync ones are `delivered`.
    pub background: bool,
}

/// What a backend writes for a [`Completion`] (semantics §3.2): the one
/// completion rule both backends apply.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct CompletionPlan {
    /// The unit's new state (a blank status reads as `completed`).
    pub state: UnitState,
    /// `pending` (a background unit, delivered later) or `delivered`.
    pub delivery_state: &'static str,
    /// When it was delivered (`now` for a synchronous unit).
    pub delivered_at: Option<f64>,
    /// Whether the unit is retained: exactly when its state is `completed`.
    pub retains: bool,
}

impl Completion {
    /// The completion rule at `now`.
    pub fn plan(&self, now: f64) -> CompletionPlan {
        let state = match &self.status {
            UnitState::Other(s) if s.trim().is_empty() => UnitState::Completed,
            other => other.clone(),
        };
        let (delivery_state, delivered_at) =
            if self.background { ("pending", None) } else { ("delivered", Some(now)) };
        let retains = state == UnitState::Completed;
        CompletionPlan { state, delivery_state, delivered_at, retains }
    }
}

/// A claimed completion hand-off (semantics §3.7).
#[derive(Debug, Clone, PartialEq)]
pub struct DeliveryClaim {
    /// The unit.
    pub delegation_id: String,
    /// The lease token.
    pub token: String,
    /// 1-based attempt number.
    pub attempt: u32,
    /// The stored event.
    pub event: CompletionEvent,
}

/// Which rows [`crate::Claims::claim_delivery`] may take.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeliveryFilter {
    /// Only units of this origin routing key.
    pub origin_session: Option<String>,
    /// Only units of this spawner.
    pub parent_session_id: Option<String>,
    /// Only this unit.
    pub delegation_id: Option<String>,
}

/// Result of a resume-claim attempt (semantics §3.9).
#[derive(Debug, Clone, PartialEq)]
pub enum ResumeClaim {
    /// The claim is ours.
    Claimed {
        /// Lease token.
        token: String,
    },
    /// Someone else holds it.
    Busy {
        /// When they claimed it.
        claimed_at: f64,
        /// When their lease expires.
        expires_at: f64,
    },
    /// The child is tombstoned or unknown.
    Unavailable,
}

/// A compare-and-swap of a unit's `usage_json` (see
/// [`crate::Claims::finish_follow_up`]): applied only if the stored value
/// still equals `expected` (`None` = absent or malformed).
#[derive(Debug, Clone, PartialEq)]
pub struct UsageSwap {
    /// The value the new one was computed from.
    pub expected: Option<Value>,
    /// The new value.
    pub new: Value,
}

/// One stored session row.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct SessionRow {
    /// Id.
    pub id: String,
    /// Source.
    pub source: String,
    /// Model.
    pub model: Option<String>,
    /// Raw `model_config` text.
    pub model_config: Option<String>,
    /// Parent id.
    pub parent_session_id: Option<String>,
    /// Start time.
    pub started_at: f64,
    /// End time.
    pub ended_at: Option<f64>,
    /// End reason.
    pub end_reason: Option<String>,
    /// Profile.
    pub profile_name: Option<String>,
    /// Own estimated cost.
    pub estimated_cost_usd: Option<f64>,
    /// Cost status.
    pub cost_status: Option<String>,
    /// Cost source.
    pub cost_source: Option<String>,
    /// hermes's `system_prompt` column, when the file has one.
    pub system_prompt: Option<String>,
}

/// One transcript message.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Message {
    /// Row id (0 before insert).
    pub id: i64,
    /// `system`, `user`, `assistant`, `tool`.
    pub role: String,
    /// Content (structured content keeps hermes's NUL+`json:` prefix).
    pub content: Option<String>,
    /// Time.
    pub timestamp: f64,
    /// Tool call id.
    pub tool_call_id: Option<String>,
    /// Tool calls JSON.
    pub tool_calls: Option<String>,
    /// Tool name.
    pub tool_name: Option<String>,
    /// Token count.
    pub token_count: Option<i64>,
    /// Finish reason.
    pub finish_reason: Option<String>,
}

/// A session's cost fields.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SessionCost {
    /// `estimated_cost_usd`.
    pub estimated_cost_usd: Option<f64>,
    /// `cost_status`.
    pub cost_status: Option<String>,
    /// `cost_source`.
    pub cost_source: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_and_lenient_manifest_parses_agree() {
        let typed = r#"{"subagent_id":"sa-0-a","session_id":"s","model":"m","toolsets":["web"],"goal":"g"}"#;
        let m = ChildManifest::parse(typed).expect("typed");
        assert_eq!(m.toolsets, Some(vec!["web".to_owned()]));
        assert_eq!(
            Some(m.clone()),
            serde_json::from_str::<Value>(typed).ok().and_then(|v| ChildManifest::from_json(&v))
        );
        // A number where a string belongs falls back to the lenient reader.
        let odd = ChildManifest::parse(r#"{"subagent_id": 7, "model": null}"#).expect("lenient");
        assert_eq!(odd.subagent_id, "7");
        assert_eq!(ChildManifest::parse("[1]"), None);
        assert_eq!(ChildManifest::parse("{bad"), None);
        let long = format!(r#"{{"goal":"{}"}}"#, "é".repeat(300));
        assert_eq!(
            ChildManifest::parse(&long).and_then(|m| m.goal).map(|g| g.chars().count()),
            Some(200)
        );
    }
}

#[cfg(test)]
mod redact_tests {
    use super::redact_url;

    #[test]
    fn credentials_never_survive() {
        for (raw, clean) in [
            ("https://api.example.com/v1", "https://api.example.com/v1"),
            ("https://u:p@h.example/v1?x=1&api_key=S&Token=T", "https://h.example/v1?x=1"),
            ("http://user@127.0.0.1:8080/v1#frag", "http://127.0.0.1:8080/v1#frag"),
            ("https://h/v1?sig=abc&se=2&key=k&password=p&secret=s", "https://h/v1?se=2"),
            ("https://h/p@q?a=1", "https://h/p@q?a=1"),
            ("https://h:8080/v1/m@x", "https://h:8080/v1/m@x"),
            ("https://u:pa/ss@h.example/v1", "https://h.example/v1"),
            ("https://u:p@ss/w@h.example/v1?q=1", "https://h.example/v1?q=1"),
            ("https://u:p@h?key=a/b@c", "https://h"),
        ] {
            assert_eq!(redact_url(raw), clean, "{raw}");
        }
    }
}
