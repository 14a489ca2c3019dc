//! Creates (or upgrades in place) a hermes-compatible `state.db` and prints what it holds.
//!
//! `cargo run -p retinue-store --example upgrade -- [HERMES_HOME]`

use std::sync::Arc;

use retinue_store::{RegistryRead, Store, SystemClock, hermes_home};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let home = std::env::args_os().nth(1).map_or_else(hermes_home, std::path::PathBuf::from);
    let store = Store::open_home(&home, Arc::new(SystemClock))?;
    println!("opened {}", store.path().display());
    println!("integrity: {}", store.integrity_check()?);
    let children = store.list_retained_children()?;
    println!("{} addressable retained children", children.len());
    for child in children {
        println!("  {}  {}  {}", child.delegation_id, child.child_id(), child.child_session_id);
    }
    Ok(())
}
