//! The backend conformance suite against the SQLite backend.

#[test]
fn sqlite_backend_conforms() {
    retinue_testkit::conformance::run_all("sqlite", &retinue_testkit::conformance::sqlite_backend);
}
