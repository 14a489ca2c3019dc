//! Rebuilds the crate when a migration file changes (refinery embeds them).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
