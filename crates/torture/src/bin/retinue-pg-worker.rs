//! `retinue-pg-worker`: one "host" of the PostgreSQL contention harness
//! (see `retinue_torture::pg_worker`); started by the `pg_contention` test.

use std::process::ExitCode;

fn main() -> ExitCode {
    if retinue_torture::pg_worker::run_from_env() {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "retinue-pg-worker: set RETINUE_PG_WORKER, RETINUE_PG_SCHEMA, RETINUE_PG_OUT and \
             RETINUE_PG_URL (it is started by the pg_contention test)"
        );
        ExitCode::from(2)
    }
}
