//! Which parent session the server acts as: the project's (derived stably
//! from the canonical working directory and the profile), a named one, or a
//! fresh one. The session is a durable row with source `mcp`, so it outlives
//! the server and tomorrow's server in the same project finds it again.

use std::path::{Path, PathBuf};

use retinue_core::{NewSession, SessionStore};

use crate::error::McpError;

/// The `sessions.source` of a session the server creates.
pub const SESSION_SOURCE: &str = "mcp";

/// Which session the server acts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionChoice {
    /// The project's session: derived from this directory (canonicalised)
    /// and the profile, created on first use.
    Project(PathBuf),
    /// An existing session, by id (`--session ID`).
    Existing(String),
    /// A fresh session (`--new-session`).
    New,
}

/// The parent session the server acts as, once resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentSession {
    /// The session id.
    pub id: String,
    /// The project directory it belongs to, for the project's session.
    pub project: Option<PathBuf>,
    /// Whether this start created it.
    pub created: bool,
}

/// FNV-1a, 64 bits: stable across Rust releases and platforms (std's
/// `DefaultHasher` promises neither).
fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            // A 0 separator byte, which no path or profile contains (xor
            // with 0 is the identity, so only the multiplication remains).
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        for b in *part {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

/// The project session id for an already canonical directory and a profile:
/// `mcp_` and 16 hex digits. The same directory and profile always give the
/// same id; another directory or profile gives another.
pub fn project_session_id(canonical_dir: &Path, profile: &str) -> String {
    let dir = canonical_dir.as_os_str().as_encoded_bytes();
    format!("{SESSION_SOURCE}_{:016x}", fnv1a64(&[dir, profile.as_bytes()]))
}

fn random_session_id() -> Result<String, McpError> {
    let hex = retinue_core::random_hex(8).map_err(|e| McpError::Random(e.to_string()))?;
    Ok(format!("{SESSION_SOURCE}_new_{hex}"))
}

fn create(sessions: &dyn SessionStore, id: &str, profile: &str) -> Result<(), McpError> {
    sessions.create_session(&NewSession {
        id: id.to_owned(),
        source: SESSION_SOURCE.to_owned(),
        profile_name: (!profile.is_empty()).then(|| profile.to_owned()),
        ..NewSession::default()
    })?;
    Ok(())
}

/// Resolves `choice` to a session row, creating the project's session on
/// first use (and a fresh one for [`SessionChoice::New`]).
pub fn resolve_session(
    sessions: &dyn SessionStore,
    choice: &SessionChoice,
    profile: &str,
) -> Result<ParentSession, McpError> {
    match choice {
        SessionChoice::Existing(id) => {
            let id = id.trim();
            // Another tenant's session is answered as a missing one (#35).
            let scope = retinue_core::Scope::of(profile);
            let row = if id.is_empty() { None } else { sessions.session(id)? };
            if !row.is_some_and(|r| scope.admits(r.profile_name.as_deref())) {
                return Err(McpError::NoSession(id.to_owned()));
            }
            Ok(ParentSession { id: id.to_owned(), project: None, created: false })
        }
        SessionChoice::New => {
            let id = random_session_id()?;
            create(sessions, &id, profile)?;
            Ok(ParentSession { id, project: None, created: true })
        }
        SessionChoice::Project(dir) => {
            let dir = dir.canonicalize().map_err(McpError::WorkingDir)?;
            let id = project_session_id(&dir, profile);
            // A project session is this profile's own: a row of that id of
            // any other profile (a hash collision, a planted row) is never
            // adopted, not even by the operator.
            let own = |row: &retinue_core::SessionRow| {
                row.profile_name.as_deref().unwrap_or("").trim() == profile.trim()
            };
            if let Some(row) = sessions.session(&id)?
                && !own(&row)
            {
                return Err(McpError::NoSession(id));
            }
            let created = if sessions.session(&id)?.is_none() {
                match create(sessions, &id, profile) {
                    Ok(()) => true,
                    // Another server in the same project created it first.
                    Err(_) if sessions.session(&id)?.is_some_and(|r| own(&r)) => false,
                    Err(e) => return Err(e),
                }
            } else {
                false
            };
            Ok(ParentSession { id, project: Some(dir), created })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn project_ids_are_stable_and_distinct() {
        let a = project_session_id(Path::new("/work/a"), "");
        assert_eq!(a, project_session_id(Path::new("/work/a"), ""));
        assert!(a.starts_with("mcp_") && a.len() == 4 + 16);
        assert_ne!(a, project_session_id(Path::new("/work/b"), ""));
        assert_ne!(a, project_session_id(Path::new("/work/a"), "coder"));
        // The separator keeps (dir, profile) pairs apart.
        assert_ne!(
            project_session_id(Path::new("/work/ab"), "c"),
            project_session_id(Path::new("/work/a"), "bc")
        );
        // Pinned: the id must never change between releases.
        assert_eq!(project_session_id(Path::new("/"), ""), "mcp_07d6c607b49d7a9a");
    }
}
