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

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_hex_of_the_asked_length_and_differ() {
        let a = super::random_hex(8).unwrap_or_default();
        let b = super::random_hex(8).unwrap_or_default();
        assert_eq!(a.len(), 16);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
    }
}
