//! Reading one section's keys: typed, each bad value a warning naming the
//! file and key, never a failure.

use std::path::Path;

use serde_yaml_ng::Value;

pub(crate) struct Reader<'a> {
    pub(crate) v: &'a Value,
    pub(crate) origin: &'a Path,
    pub(crate) warnings: Vec<String>,
    pub(crate) errors: Vec<String>,
}

impl Reader<'_> {
    pub(crate) fn bad(&mut self, key: &str) {
        self.warnings.push(format!(
            "{}: delegation.{key} has the wrong type or value; using its default",
            self.origin.display()
        ));
    }

    pub(crate) fn string(&mut self, key: &str, out: &mut String) {
        match self.v.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => *out = s.trim().to_owned(),
            Some(Value::Number(n)) => *out = n.to_string(),
            Some(_) => self.bad(key),
        }
    }

    pub(crate) fn boolean(&mut self, key: &str, out: &mut bool) {
        match self.v.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => *out = *b,
            Some(_) => self.bad(key),
        }
    }

    pub(crate) fn float(&mut self, key: &str, out: &mut f64) {
        match self.v.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) => match n.as_f64() {
                Some(f) if f.is_finite() => *out = f,
                _ => self.bad(key),
            },
            Some(_) => self.bad(key),
        }
    }

    pub(crate) fn u64(&mut self, key: &str) -> Option<u64> {
        match self.v.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) => {
                if let Some(u) = n.as_u64() {
                    Some(u)
                } else if n.as_i64().is_some() {
                    // Negative: floored by the caller.
                    Some(0)
                } else {
                    self.bad(key);
                    None
                }
            }
            Some(_) => {
                self.bad(key);
                None
            }
        }
    }

    pub(crate) fn invalid(&mut self, key: &str, v: &Value, want: &str) {
        self.errors.push(format!(
            "{}: delegation.{key} = {} is invalid: it must be {want}",
            self.origin.display(),
            shown(v)
        ));
    }

    pub(crate) fn uint(&mut self, key: &str, out: &mut u32) {
        if let Some(u) = self.u64(key) {
            *out = u32::try_from(u).unwrap_or(u32::MAX);
        }
    }

    pub(crate) fn usize(&mut self, key: &str, out: &mut usize) {
        if let Some(u) = self.u64(key) {
            *out = usize::try_from(u).unwrap_or(usize::MAX);
        }
    }
}

/// A YAML value as an error text shows it (`"5"` for a string, `.nan`).
pub(crate) fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Null => "null".to_owned(),
        other => serde_yaml_ng::to_string(other)
            .map(|t| t.trim().replace('\n', " "))
            .unwrap_or_else(|_| "(unprintable)".to_owned()),
    }
}
