//! Child usage records and a unit's `usage_json` (semantics §7.3), built from
//! real results; follow-ups add their run.

use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::fold::number;

/// Token counts of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Tokens {
    /// Prompt tokens.
    pub input: u64,
    /// Completion tokens.
    pub output: u64,
}

/// What one child run used (semantics §7.2 step 2).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChildUsage {
    /// Cost in US dollars (zero counts too).
    pub cost_usd: f64,
    /// Token counts, if the runtime reported them.
    pub tokens: Option<Tokens>,
    /// Model API calls.
    pub api_calls: u64,
    /// The child's status (`completed`, `error`, …).
    pub status: String,
}

impl ChildUsage {
    /// The ledger's usage object: `{cost_usd, tokens or {}, api_calls, status}`.
    pub fn to_json(&self) -> Value {
        let tokens = self.tokens.map_or_else(|| json!({}), |t| json!(t));
        json!({
            "cost_usd": self.cost_usd,
            "tokens": tokens,
            "api_calls": self.api_calls,
            "status": self.status,
        })
    }
}

/// One child run to add to a unit's usage.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChildRun {
    /// The child's subagent id (`sa-<index>-<8hex>`).
    pub subagent_id: String,
    /// The child's session id.
    pub child_session_id: String,
    /// What the run used.
    pub usage: ChildUsage,
}

const MICROS: f64 = 1_000_000.0;

/// Adds two dollar amounts in integer micro-dollars, so repeated follow-ups
/// do not accumulate binary rounding noise.
pub fn add_usd(a: f64, b: f64) -> f64 {
    ((a * MICROS).round() + (b * MICROS).round()) / MICROS
}

fn count(value: Option<&Value>) -> u64 {
    // Counts are whole and non-negative; the cast saturates by design.
    value.and_then(number).map_or(0, |f| f.max(0.0).round() as u64)
}

fn usd(value: Option<&Value>) -> f64 {
    value.and_then(number).unwrap_or(0.0)
}

/// Adds `cost`, `tokens` and `api_calls` into the object `obj`.
fn add_into(obj: &mut Map<String, Value>, cost: f64, tokens: Tokens, api_calls: u64) {
    let old_tokens = obj.get("tokens");
    let input = count(old_tokens.and_then(|t| t.get("input"))) + tokens.input;
    let output = count(old_tokens.and_then(|t| t.get("output"))) + tokens.output;
    let cost = add_usd(usd(obj.get("cost_usd")), cost);
    let calls = count(obj.get("api_calls")) + api_calls;
    obj.insert("cost_usd".into(), json!(cost));
    obj.insert("tokens".into(), json!({"input": input, "output": output}));
    obj.insert("api_calls".into(), json!(calls));
}

fn same_child(entry: &Value, run: &ChildRun) -> bool {
    let key = |k: &str| entry.get(k).and_then(Value::as_str).unwrap_or("");
    if run.subagent_id.is_empty() {
        !run.child_session_id.is_empty() && key("child_session_id") == run.child_session_id
    } else {
        key("subagent_id") == run.subagent_id
    }
}

/// A unit's `usage_json` after adding `runs` to `existing` (semantics §7.3):
/// `{cost_usd, tokens{input,output}, api_calls, children:[{subagent_id,
/// child_session_id, status, cost_usd, tokens, api_calls, runs}]}`.
///
/// A run of a child already listed adds to it (and counts one more run);
/// unknown keys are kept; a malformed or non-object `existing` starts afresh.
pub fn merge_unit_usage(existing: Option<&Value>, runs: &[ChildRun]) -> Value {
    let mut unit = match existing {
        Some(Value::Object(map)) => map.clone(),
        _ => Map::new(),
    };
    let mut children: Vec<Value> = match unit.remove("children") {
        Some(Value::Array(items)) => items.into_iter().filter(Value::is_object).collect(),
        _ => Vec::new(),
    };
    add_into(&mut unit, 0.0, Tokens::default(), 0);
    for run in runs {
        let u = &run.usage;
        let tokens = u.tokens.unwrap_or_default();
        add_into(&mut unit, u.cost_usd, tokens, u.api_calls);
        let idx = match children.iter().position(|c| same_child(c, run)) {
            Some(i) => i,
            None => {
                children.push(json!({
                    "subagent_id": run.subagent_id,
                    "child_session_id": run.child_session_id,
                    "runs": 0,
                }));
                children.len() - 1
            }
        };
        if let Some(Value::Object(child)) = children.get_mut(idx) {
            add_into(child, u.cost_usd, tokens, u.api_calls);
            let runs = count(child.get("runs")) + 1;
            child.insert("runs".into(), json!(runs));
            child.insert("status".into(), json!(u.status));
            if !run.child_session_id.is_empty() {
                child.insert("child_session_id".into(), json!(run.child_session_id));
            }
        }
    }
    unit.insert("children".into(), Value::Array(children));
    Value::Object(unit)
}
