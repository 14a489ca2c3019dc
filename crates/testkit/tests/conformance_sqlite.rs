//! The backend conformance suite against the SQLite backend: each case its
//! own test (`cargo nextest run -p retinue-testkit ttl_prune`).

retinue_testkit::conformance_suite!(Some(retinue_testkit::conformance::sqlite_backend));
