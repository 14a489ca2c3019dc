//! `retinue-store`: the SQLite backend of `retinue-core`'s seam traits, and
//! the only crate of Retinue that knows rusqlite.
//!
//! It owns one SQLite file, `<HERMES_HOME>/state.db`, shared with the Python
//! hermes-agent: the schema and its in-place upgrade of hermes files, and
//! [`Store`], which implements every core trait (the registry roles,
//! sessions and transcripts, the usage ledger, budgets). The records, the
//! traits, the error type and the rules all come from `retinue-core`; no
//! rusqlite type crosses this boundary.
//!
//! ```no_run
//! use retinue_core::RegistryRead;
//! use retinue_store::{Store, StoreOptions};
//! let store = Store::open("/tmp/demo/state.db", StoreOptions::default())?;
//! for child in store.list_retained_children()? {
//!     println!("{} {}", child.child_id(), child.child_session_id);
//! }
//! # Ok::<(), retinue_core::Error>(())
//! ```

mod approvals;
mod budget;
mod conn;
mod db;
mod error;
mod export;
mod gate;
mod ledger;
#[cfg(target_os = "linux")]
mod queue;
mod read_view;
mod registry;
mod rows;
mod sessions;
mod store;

pub use db::StoreOptions;
pub use export::StateDbReader;
pub use store::Store;
