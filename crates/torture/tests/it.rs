//! Reliability and security tests: the harnesses at CI size, bad input,
//! hostile files and authority leaks.

mod it {
    mod authority;
    mod bad_input;
    pub(crate) mod common;
    mod harness;
    mod hostile;
    mod pg_contention;
    mod safe_home;
}
