//! Typed access to a tool call's arguments (untrusted model output): a
//! missing or mistyped argument is a [`ToolError::InvalidArguments`] that
//! names it.

use serde_json::Value;

use retinue_core::run::ToolError;

/// The most characters a string argument may have (1 MB of text is
/// accepted; anything larger is refused before it is used).
pub const MAX_ARG_CHARS: usize = 4 << 20;

/// A tool call's arguments.
#[derive(Debug, Clone, Copy)]
pub struct Args<'a> {
    tool: &'a str,
    v: &'a Value,
}

impl<'a> Args<'a> {
    /// Wraps the arguments of a call to `tool`.
    pub fn new(tool: &'a str, v: &'a Value) -> Args<'a> {
        Args { tool, v }
    }

    fn bad(&self, key: &str, want: &str) -> ToolError {
        ToolError::InvalidArguments(format!("{}: `{key}` must be {want}", self.tool))
    }

    /// A required string.
    pub fn required_str(&self, key: &str) -> Result<&'a str, ToolError> {
        match self.opt_str(key)? {
            Some(s) => Ok(s),
            None => Err(ToolError::InvalidArguments(format!(
                "{}: missing required argument `{key}`",
                self.tool
            ))),
        }
    }

    /// An optional string (`null` reads as absent).
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>, ToolError> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.len() > MAX_ARG_CHARS => {
                Err(self.bad(key, &format!("at most {MAX_ARG_CHARS} bytes")))
            }
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(_) => Err(self.bad(key, "a string")),
        }
    }

    /// A string with a default.
    pub fn str_or(&self, key: &str, default: &'a str) -> Result<&'a str, ToolError> {
        Ok(self.opt_str(key)?.unwrap_or(default))
    }

    /// A non-negative integer with a default (a whole float or a numeric
    /// string is accepted, as models send them).
    pub fn uint(&self, key: &str, default: u64) -> Result<u64, ToolError> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Number(n)) => n
                .as_u64()
                .or_else(|| {
                    n.as_f64()
                        .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1e15)
                        .map(|f| f as u64)
                })
                .ok_or_else(|| self.bad(key, "a whole number >= 0")),
            Some(Value::String(s)) => {
                s.trim().parse::<u64>().map_err(|_| self.bad(key, "a whole number >= 0"))
            }
            Some(_) => Err(self.bad(key, "a whole number >= 0")),
        }
    }

    /// A boolean with a default.
    pub fn boolean(&self, key: &str, default: bool) -> Result<bool, ToolError> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(Value::String(s)) if s == "true" || s == "false" => Ok(s == "true"),
            Some(_) => Err(self.bad(key, "true or false")),
        }
    }
}
