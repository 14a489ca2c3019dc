//! The plain records of budgets: limits, amounts of spend, a lineage's
//! budget status and reservation requests (the [`crate::Budgets`] seam's
//! vocabulary; no IO here).

/// A spending limit; `None` = no limit on that measure.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BudgetLimit {
    /// Most US dollars.
    pub max_cost_usd: Option<f64>,
    /// Most tokens (input + output).
    pub max_tokens: Option<u64>,
}

impl BudgetLimit {
    /// Checks the limit can be enforced: a dollar limit must be a finite
    /// number `>= 0`. The error names the key and the value.
    pub fn check(&self) -> crate::Result<()> {
        match self.max_cost_usd {
            Some(c) if !c.is_finite() || c < 0.0 => Err(crate::Error::Invalid(format!(
                "budget.max_cost_usd must be a finite number >= 0, not {c}"
            ))),
            _ => Ok(()),
        }
    }

    /// Whether neither measure is limited.
    pub fn is_unlimited(&self) -> bool {
        self.max_cost_usd.is_none() && self.max_tokens.is_none()
    }

    /// The narrower of two limits, measure by measure (a limit can only narrow).
    #[must_use]
    pub fn narrowed_by(self, other: BudgetLimit) -> BudgetLimit {
        fn min_opt<T: PartialOrd + Copy>(a: Option<T>, b: Option<T>) -> Option<T> {
            match (a, b) {
                (Some(x), Some(y)) => Some(if y < x { y } else { x }),
                (x, y) => x.or(y),
            }
        }
        BudgetLimit {
            max_cost_usd: min_opt(self.max_cost_usd, other.max_cost_usd),
            max_tokens: min_opt(self.max_tokens, other.max_tokens),
        }
    }
}

/// An amount of spend: dollars and tokens.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Spend {
    /// US dollars.
    pub cost_usd: f64,
    /// Tokens (input + output).
    pub tokens: u64,
}

impl Spend {
    /// A spend as stored columns (or their sums) read it: a negative or
    /// non-finite amount is 0, tokens beyond `u64` saturate. Both backends
    /// read every stored amount through here, so an absurd row can neither
    /// lower a budget's spend nor break every later reservation.
    pub fn from_stored(cost_usd: f64, tokens: f64) -> Spend {
        let cost_usd = if cost_usd.is_finite() && cost_usd > 0.0 { cost_usd } else { 0.0 };
        // `as` saturates a float beyond the range (and NaN is excluded above).
        let tokens = if tokens.is_finite() && tokens > 0.0 { tokens as u64 } else { 0 };
        Spend { cost_usd, tokens }
    }

    /// `self` and `other` together (tokens saturating).
    #[must_use]
    pub fn plus(self, other: Spend) -> Spend {
        Spend {
            cost_usd: self.cost_usd + other.cost_usd,
            tokens: self.tokens.saturating_add(other.tokens),
        }
    }

    /// The cost as a column stores it (negative or non-finite is 0).
    pub fn stored_cost(&self) -> f64 {
        Spend::from_stored(self.cost_usd, 0.0).cost_usd
    }

    /// The tokens as a column stores them (saturating at `i64::MAX`).
    pub fn stored_tokens(&self) -> i64 {
        i64::try_from(self.tokens).unwrap_or(i64::MAX)
    }
}

/// A lineage's budget at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BudgetStatus {
    /// The limit.
    pub limit: BudgetLimit,
    /// What the lineage's ledger rows add up to.
    pub spent: Spend,
    /// What open reservations hold.
    pub reserved: Spend,
}

impl BudgetStatus {
    /// What is left: `limit - spent - reserved`, floored at zero (`None`
    /// where the measure is unlimited).
    pub fn remaining(&self) -> (Option<f64>, Option<u64>) {
        let cost = self
            .limit
            .max_cost_usd
            .map(|m| (m - self.spent.cost_usd - self.reserved.cost_usd).max(0.0));
        let tokens = self
            .limit
            .max_tokens
            .map(|m| m.saturating_sub(self.spent.tokens).saturating_sub(self.reserved.tokens));
        (cost, tokens)
    }

    /// What a reservation between `minimum` and `maximum` gets now: all
    /// that is left of each limited measure, at most `maximum`, at least
    /// `minimum` (the caller checks [`BudgetStatus::fits`] first); an
    /// unlimited measure holds only the minimum.
    pub fn grant(&self, minimum: Spend, maximum: Option<Spend>) -> Spend {
        let (cost, tokens) = self.remaining();
        let cost = match (cost, maximum) {
            (Some(left), Some(m)) => left.min(m.cost_usd),
            (Some(left), None) => left,
            // An unlimited measure holds nothing.
            (None, _) => 0.0,
        };
        let tokens = match (tokens, maximum) {
            (Some(left), Some(m)) => left.min(m.tokens),
            (Some(left), None) => left,
            (None, _) => 0,
        };
        Spend { cost_usd: cost.max(minimum.cost_usd), tokens: tokens.max(minimum.tokens) }
    }

    /// Whether `want` more would cross the limit on what is *spent* alone
    /// (the budget is exceeded), as opposed to only while the open
    /// reservations of running delegations hold the rest.
    pub fn exceeded_by(&self, want: Spend) -> bool {
        let cost =
            self.limit.max_cost_usd.is_some_and(|m| self.spent.cost_usd + want.cost_usd > m + 1e-9);
        let tokens = self
            .limit
            .max_tokens
            .is_some_and(|m| self.spent.tokens.saturating_add(want.tokens) > m);
        cost || tokens
    }

    /// Whether `want` more fits under the limit.
    pub fn fits(&self, want: Spend) -> bool {
        let (cost, tokens) = self.remaining();
        // A tiny epsilon so 0.1 + 0.2 style sums do not refuse an exact fit.
        cost.is_none_or(|c| want.cost_usd <= c + 1e-9) && tokens.is_none_or(|t| want.tokens <= t)
    }
}

/// A reservation to make.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReservationDraft {
    /// The lineage root: the budget's key.
    pub lineage_root: String,
    /// Every session of the lineage (root first): whose ledger rows count as spent.
    pub sessions: Vec<String>,
    /// The limit in force.
    pub limit: BudgetLimit,
    /// The least the run needs: refused when less than this is left.
    pub minimum: Spend,
    /// The most to hold (`None`: all that is left of each limited measure).
    pub maximum: Option<Spend>,
    /// The unit it is for, if known.
    pub delegation_id: Option<String>,
}

/// What `reserve` did.
#[derive(Debug, Clone, PartialEq)]
pub enum Reservation {
    /// Held; settle it with this id when the run's usage is recorded.
    Held {
        /// The reservation id.
        id: String,
        /// What it holds: the run's allowance.
        granted: Spend,
        /// The budget just before this reservation.
        before: BudgetStatus,
    },
    /// It does not fit; nothing was written.
    Refused(BudgetStatus),
}

/// What one ledger row counts toward a budget (semantics §8), typed from
/// its `usage_json` once, when it is written: `cost_usd`, and the tokens
/// under `tokens` (`input`, `output`, `cache_read`, `cache_write`,
/// `reasoning`). Each value reads as SQLite's `CAST(json_extract(…) AS
/// REAL)` reads it (a number, a numeric string, `true` = 1; other text 0),
/// negative or non-finite as 0, so a hostile row never lowers what a
/// lineage spent. Malformed JSON counts nothing. Spent is then the sum of
/// `cost_usd` and of `input_tokens + output_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct UsageColumns {
    /// US dollars.
    pub cost_usd: f64,
    /// Prompt tokens.
    pub input_tokens: f64,
    /// Completion tokens.
    pub output_tokens: f64,
    /// Prompt tokens served from the provider's cache.
    pub cache_read_tokens: f64,
    /// Prompt tokens written to the provider's cache.
    pub cache_write_tokens: f64,
    /// Reasoning tokens (part of the completion).
    pub reasoning_tokens: f64,
}

impl UsageColumns {
    /// The columns of a stored `usage_json` text (absent or malformed: zeros).
    pub fn of_json_text(text: Option<&str>) -> UsageColumns {
        text.and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok())
            .map_or_else(UsageColumns::default, |v| UsageColumns::of(&v))
    }

    /// The columns of a usage object.
    pub fn of(usage: &serde_json::Value) -> UsageColumns {
        let tokens = usage.get("tokens");
        let part = |k: &str| counted(tokens.and_then(|t| t.get(k)));
        UsageColumns {
            cost_usd: counted(usage.get("cost_usd")),
            input_tokens: part("input"),
            output_tokens: part("output"),
            cache_read_tokens: part("cache_read"),
            cache_write_tokens: part("cache_write"),
            reasoning_tokens: part("reasoning"),
        }
    }
}

/// A JSON value as SQLite's `max(0, ifnull(CAST(json_extract(…) AS REAL), 0))`
/// reads it, non-finite as 0.
fn counted(v: Option<&serde_json::Value>) -> f64 {
    use serde_json::Value;
    let f = match v {
        None | Some(Value::Null) => 0.0,
        Some(Value::Number(n)) => n.as_f64().unwrap_or(0.0),
        Some(Value::String(s)) => leading_real(s),
        Some(Value::Bool(b)) => f64::from(u8::from(*b)),
        Some(_) => 0.0,
    };
    if f.is_finite() && f > 0.0 { f } else { 0.0 }
}

/// SQLite's `CAST(text AS REAL)`: the longest numeric prefix (after leading
/// spaces), else 0.
fn leading_real(s: &str) -> f64 {
    let t = s.trim_start();
    let mut best = 0.0;
    for (i, c) in t.char_indices() {
        if !(c.is_ascii_digit() || matches!(c, '+' | '-' | '.' | 'e' | 'E')) {
            break;
        }
        if let Ok(f) = t[..i + c.len_utf8()].parse::<f64>() {
            best = f;
        }
    }
    best
}

#[cfg(test)]
mod usage_columns_tests {
    use super::UsageColumns;
    use serde_json::json;

    #[test]
    fn values_read_as_sqlite_casts_them() {
        let c = UsageColumns::of(&json!({
            "cost_usd": "0.5",
            "tokens": {"input": 100.9, "output": "20", "cache_read": true, "reasoning": -5}
        }));
        assert_eq!(c.cost_usd, 0.5);
        assert_eq!((c.input_tokens, c.output_tokens), (100.9, 20.0));
        assert_eq!((c.cache_read_tokens, c.reasoning_tokens), (1.0, 0.0));
        assert_eq!(UsageColumns::of_json_text(Some("{not json")), UsageColumns::default());
        assert_eq!(UsageColumns::of_json_text(None), UsageColumns::default());
        let odd = UsageColumns::of(&json!({"cost_usd": " 12abc", "tokens": {"input": {"x": 1}}}));
        assert_eq!((odd.cost_usd, odd.input_tokens), (12.0, 0.0));
    }
}
