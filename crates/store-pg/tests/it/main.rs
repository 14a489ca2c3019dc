//! The PostgreSQL backend's integration tests, one binary: the shared
//! conformance suite, `retinue migrate`'s import, and read-only opens
//! (against `RETINUE_PG_URL`, a throwaway cluster under `cargo xtask test`).
//! The contention harness is `retinue-torture`'s (`pg_contention`).

mod conformance;
mod migrate;
mod read_only;
