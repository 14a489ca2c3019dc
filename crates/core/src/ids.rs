//! The one source of random ids: secure random bytes as lowercase hex.
//! Every id Retinue makes (sessions, subagents, reservations, claims,
//! tokens) draws from here; a failing random source is an error, never a
//! weaker id.

use crate::{Error, Result};

/// `bytes` secure random bytes as lowercase hex (`2 × bytes` characters).
pub fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| Error::Random(e.to_string()))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Draws `deleg_<8 hex>` unit ids until `insert` takes one: `insert`
/// returns `false` when the id is already taken (seen inside its own write
/// transaction, never by reading an error's text). Eight draws in a row
/// taken is an error rather than a loop.
pub fn insert_with_unit_id(mut insert: impl FnMut(&str) -> Result<bool>) -> Result<String> {
    for _ in 0..8 {
        let id = format!("deleg_{}", random_hex(4)?);
        if insert(&id)? {
            return Ok(id);
        }
    }
    Err(Error::Invalid("could not allocate a unique delegation id".to_owned()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_taken_unit_id_is_drawn_again_and_eight_taken_is_an_error() {
        let mut seen = Vec::new();
        let id = super::insert_with_unit_id(|id| {
            seen.push(id.to_owned());
            Ok(seen.len() == 3)
        });
        assert_eq!(seen.len(), 3);
        assert_eq!(id.ok().as_deref(), seen.last().map(String::as_str));
        assert!(seen.iter().all(|id| id.len() == 14 && id.starts_with("deleg_")));
        let mut draws = 0;
        let full = super::insert_with_unit_id(|_| {
            draws += 1;
            Ok(false)
        });
        assert_eq!(draws, 8);
        assert!(
            matches!(full, Err(crate::Error::Invalid(m)) if m.contains("unique delegation id"))
        );
    }

    #[test]
    fn ids_are_hex_of_the_asked_length_and_differ() {
        let a = super::random_hex(8).unwrap_or_default();
        let b = super::random_hex(8).unwrap_or_default();
        assert_eq!(a.len(), 16);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
    }
}
