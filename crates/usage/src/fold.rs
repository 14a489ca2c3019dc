//! The fold of usage JSON into [`UsageTotals`] (spec §7.1): numbers and
//! numeric strings count, anything else is skipped per field.

use serde_json::Value;

use crate::UsageTotals;

/// A finite number from a JSON number or a numeric string; anything else → `None`.
pub fn number(value: &Value) -> Option<f64> {
    let n = match value {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    n.filter(|f| f.is_finite())
}

fn field(value: Option<&Value>) -> f64 {
    value.and_then(number).unwrap_or(0.0)
}

/// Folds one usage object: `cost_usd`, `tokens.input`, `tokens.output`.
/// Never fails: a non-object or a bad field contributes zero.
pub fn fold_usage(usage: &Value) -> UsageTotals {
    let tokens = usage.get("tokens");
    UsageTotals {
        cost_usd: field(usage.get("cost_usd")),
        input_tokens: field(tokens.and_then(|t| t.get("input"))),
        output_tokens: field(tokens.and_then(|t| t.get("output"))),
    }
}

/// Folds raw `usage_json` text; malformed text contributes zero.
pub fn fold_usage_text(text: &str) -> UsageTotals {
    serde_json::from_str::<Value>(text).map(|v| fold_usage(&v)).unwrap_or_default()
}
