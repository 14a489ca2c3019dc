//! Creates (or upgrades in place) a hermes-compatible `state.db` and prints what it holds.
//!
//! `cargo run -p retinue-store --example upgrade -- [HERMES_HOME]`

use std::sync::Arc;

use retinue_config::hermes_home;
use retinue_core::{RegistryRead, SystemClock, default_profile_key};
use retinue_store::{Store, StoreOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let home = std::env::args_os().nth(1).map_or_else(hermes_home, std::path::PathBuf::from);
    let opts = StoreOptions::default()
        .with_clock(Arc::new(SystemClock))
        .with_profile(default_profile_key(&home));
    let store = Store::open(home.join("state.db"), opts)?;
    println!("opened {}", store.path().display());
    println!("integrity: {}", store.integrity_check()?);
    let children = store.list_retained_children()?;
    println!("{} addressable retained children", children.len());
    for child in children {
        println!("  {}  {}  {}", child.delegation_id, child.child_id(), child.child_session_id);
    }
    Ok(())
}
