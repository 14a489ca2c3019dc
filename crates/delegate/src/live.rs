//! The in-process registry of running children (steerable or not).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use retinue_core::run::ChildHandle;

/// A running child.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LiveChild {
    /// The runtime's handle.
    pub handle: ChildHandle,
    /// The spawner's session id; an ownerless record is never steered.
    pub owner_session_id: Option<String>,
    /// The owning profile.
    pub owner_profile: String,
    /// Whether steering is open.
    pub accepting_steer: bool,
}

#[derive(Debug, Default)]
pub(crate) struct LiveRegistry {
    children: Mutex<HashMap<String, LiveChild>>,
}

impl LiveRegistry {
    pub(crate) fn insert(&self, child: LiveChild) {
        self.children
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(child.handle.subagent_id.clone(), child);
    }

    pub(crate) fn remove(&self, subagent_id: &str) {
        self.children.lock().unwrap_or_else(PoisonError::into_inner).remove(subagent_id);
    }

    pub(crate) fn close_steering(&self, subagent_id: &str) {
        if let Some(c) =
            self.children.lock().unwrap_or_else(PoisonError::into_inner).get_mut(subagent_id)
        {
            c.accepting_steer = false;
        }
    }

    /// By subagent id, else by live session id.
    pub(crate) fn find(&self, id: &str) -> Option<LiveChild> {
        let children = self.children.lock().unwrap_or_else(PoisonError::into_inner);
        children.get(id).or_else(|| children.values().find(|c| c.handle.session_id == id)).cloned()
    }
}
