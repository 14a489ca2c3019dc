//! New children's ids: drawn from the delegator's id source, never one a
//! stored row or a sibling planned in the same call already uses.

use retinue_core::Lookup;

use crate::{DelegateError, Inner};

/// The default id source: [`retinue_core::random_hex`]. A failing random
/// source draws the empty string, which `fresh_ids` never takes for an id:
/// the spawn is refused.
pub(crate) fn random_hex(bytes: usize) -> String {
    retinue_core::random_hex(bytes).unwrap_or_default()
}

/// How many draws a new id gets before the spawn gives up.
const ID_DRAWS: usize = 16;

/// A subagent id (32 random bits) and a session id for task `i` that no
/// stored row and no sibling planned so far uses: a drawn id already in use
/// is drawn again (a lookup by id must never find two children).
pub(crate) fn fresh_ids(
    inner: &Inner,
    i: usize,
    taken: impl Fn(&str, &str) -> bool,
) -> Result<(String, String), DelegateError> {
    let parts = &inner.parts;
    for _ in 0..ID_DRAWS {
        let (sa_hex, sess_hex) = ((inner.ids)(4), (inner.ids)(8));
        if sa_hex.len() < 8 || sess_hex.len() < 16 {
            // A short draw (a failing random source) is never an id.
            continue;
        }
        let (sa, sess) = (format!("sa-{i}-{sa_hex}"), format!("sess_{sess_hex}"));
        if taken(&sa, &sess) {
            continue;
        }
        let sa_free = matches!(
            parts.backend.registry.lookup(&sa).map_err(DelegateError::Storage)?,
            Lookup::Unknown
        );
        let sess_free =
            parts.backend.sessions.session(&sess).map_err(DelegateError::Storage)?.is_none()
                && matches!(
                    parts.backend.registry.lookup(&sess).map_err(DelegateError::Storage)?,
                    Lookup::Unknown
                );
        if sa_free && sess_free {
            return Ok((sa, sess));
        }
        log::warn!("a drawn child id collided with a stored one ({sa} / {sess}); drawing again");
    }
    Err(DelegateError::Runtime(format!(
        "could not draw an unused child id in {ID_DRAWS} tries; no child was started"
    )))
}
