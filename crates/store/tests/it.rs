//! Integration tests of the store against real SQLite files.

mod it {
    mod budget;
    mod contention;
    pub(crate) mod fixture;
    mod ledger;
    mod legacy;
    mod registry;
    mod schema;
    mod sessions;
    mod workflow;
}
