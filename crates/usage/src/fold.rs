//! The fold of usage JSON into [`UsageTotals`] (semantics §7.1): numbers and
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

/// A lineage budget as results and `usage --lineage --json` report it:
/// `{limit: {max_cost_usd, max_tokens}, spent: {cost_usd, tokens},
/// reserved: {cost_usd, tokens}, remaining: {cost_usd, tokens}}` (`null` for
/// an unlimited measure).
pub fn budget_json(status: &retinue_core::BudgetStatus) -> Value {
    let (cost, tokens) = status.remaining();
    serde_json::json!({
        "limit": {"max_cost_usd": status.limit.max_cost_usd, "max_tokens": status.limit.max_tokens},
        "spent": {"cost_usd": status.spent.cost_usd, "tokens": status.spent.tokens},
        "reserved": {"cost_usd": status.reserved.cost_usd, "tokens": status.reserved.tokens},
        "remaining": {"cost_usd": cost, "tokens": tokens},
    })
}

/// What one child cost a lineage: its runs (spawn and follow-ups) summed.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct ChildSpend {
    /// The child's session.
    pub child_session_id: String,
    /// Ledger rows (one per run).
    pub runs: u64,
    /// The summed totals.
    #[serde(flatten)]
    pub totals: UsageTotals,
}

/// The per-child breakdown of ledger records, in first-billed order.
pub fn child_breakdown(records: &[crate::UsageAttribution]) -> Vec<ChildSpend> {
    let mut out: Vec<ChildSpend> = Vec::new();
    for r in records {
        let add = fold_usage(&r.usage);
        match out.iter_mut().find(|c| c.child_session_id == r.child_session_id) {
            Some(c) => {
                c.runs += 1;
                c.totals = c.totals.plus(add);
            }
            None => out.push(ChildSpend {
                child_session_id: r.child_session_id.clone(),
                runs: 1,
                totals: add,
            }),
        }
    }
    out
}

#[cfg(test)]
mod breakdown_tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn runs_of_one_child_are_summed() {
        let rec = |child: &str, cost: f64| crate::UsageAttribution {
            id: 0,
            parent_session_id: "P".into(),
            parent_turn_id: String::new(),
            child_session_id: child.into(),
            usage: json!({"cost_usd": cost, "tokens": {"input": 10, "output": 1}}),
            aggregate: None,
            created_at: 0.0,
        };
        let b = child_breakdown(&[rec("a", 0.5), rec("b", 0.25), rec("a", 0.25)]);
        assert_eq!(b.len(), 2);
        assert_eq!((b[0].child_session_id.as_str(), b[0].runs), ("a", 2));
        assert_eq!(b[0].totals.cost_usd, 0.75);
        assert_eq!(b[0].totals.input_tokens, 20.0);
        assert_eq!(b[1].runs, 1);
    }
}
