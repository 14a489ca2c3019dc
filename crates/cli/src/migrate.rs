//! `retinue migrate --to postgres://…`: copies the `state.db` (the `--db`
//! file, else `<home>/state.db`) into PostgreSQL for team mode. hermes keeps
//! its SQLite file; a rerun copies what is new and carries later changes
//! (tombstones included); ids never collide; "verified" is printed only
//! after every row, tombstone and the ledger sums were checked. The
//! connection string is never printed.

use std::sync::Arc;

use retinue_core::SystemClock;
use retinue_store_pg::{PgOptions, PgStore, is_postgres_url};
use serde_json::json;

use crate::Output;
use crate::env::{Access, Env};
use crate::error::{CliError, Result};

/// Runs the migration of `env`'s database into the PostgreSQL database `to`.
pub(crate) fn migrate(env: &Env, to: &str) -> Result<Output> {
    if !is_postgres_url(to) {
        return Err(CliError::Usage(
            "--to takes a PostgreSQL connection string (postgres://user@host:port/db)".to_owned(),
        ));
    }
    if env.db_is_url {
        return Err(CliError::Usage(
            "migrate copies a state.db into PostgreSQL: --db names the state.db file (not a \
             URL), --to the PostgreSQL database"
                .to_owned(),
        ));
    }
    if !env.db.is_file() {
        return Err(CliError::NotFound(format!("no state.db at {}", env.db.display())));
    }
    // The source is checked as every read command checks it (header, a
    // hermes or Retinue schema, readable), read-only: a foreign or damaged
    // file gets the same clear refusal, and nothing is written to it.
    drop(env.open(Arc::new(SystemClock), Access::Read)?);
    let opts = PgOptions {
        retention: env.config().delegation.retention(),
        clock: Arc::new(SystemClock),
        profile: env.profile.clone(),
        ..PgOptions::default()
    };
    let store = PgStore::open(to, opts)?;
    let report = store.import_state_db(&env.db, &retinue_store::StateDbReader)?;
    // A one-shot migration is not a worker: give the lease up at once.
    store.retire()?;
    let mut human = format!("copied {} into PostgreSQL (verified):\n", env.db.display());
    let mut tables = serde_json::Map::new();
    for (name, (rows, copied)) in &report.tables {
        let updated = report.updated.get(name).copied().unwrap_or(0);
        human.push_str(&format!(
            "  {name:<24} {rows:>8} rows, {copied:>8} new, {updated:>8} updated\n"
        ));
        tables.insert(name.clone(), json!({ "rows": rows, "copied": copied, "updated": updated }));
    }
    if report.remapped > 0 {
        human.push_str(&format!(
            "  {} transcript/ledger row(s) got a fresh id (theirs was taken by a team-mode write)\n",
            report.remapped
        ));
    }
    if report.dangling_parents > 0 {
        human.push_str(&format!(
            "  {} session parent link(s) to missing sessions were left unlinked\n",
            report.dangling_parents
        ));
    }
    human.push_str(&format!(
        "  ledger: {:.6} USD (the source rows and their copies add up the same)\n",
        report.ledger_cost_usd
    ));
    match &report.rekeyed {
        Some((from, n)) => human.push_str(&format!(
            "  {n} unit(s) of the home's profile {} now belong to profile {}\n",
            crate::table::clip(from, 128),
            crate::table::clip(&env.profile, 128)
        )),
        None => human.push_str(
            "  profiles kept as stored (pass --profile NAME to give the home's units to a tenant)\n",
        ),
    }
    let json = json!({
        "source": env.db.display().to_string(),
        "tables": tables,
        "dangling_parents": report.dangling_parents,
        "ledger_cost_usd": report.ledger_cost_usd,
        "remapped": report.remapped,
        "profile": report.rekeyed.as_ref().map(|(from, n)| json!({
            "from": from, "to": env.profile, "units": n,
        })),
        "verified": true,
    });
    Ok(Output::ok(json, human))
}
