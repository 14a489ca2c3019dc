//! Issue #22: a read-only PostgreSQL role can read when the schema is
//! current, and is told clearly when it is behind; nothing is migrated or
//! registered by a read-only open.

use std::sync::atomic::{AtomicU32, Ordering};

use retinue_core::{ChildManifest, RegistryRead, UnitDraft, UnitLifecycle};
use retinue_store_pg::{PgOptions, PgStore};

static SEQ: AtomicU32 = AtomicU32::new(0);

fn name(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{prefix}_{}_{}_{nanos}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed))
}

/// `url` with `user` as its user name (the test cluster trusts loopback).
fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let rest = rest.split_once('@').map_or(rest, |(_, r)| r);
    format!("{scheme}://{user}@{rest}")
}

#[test]
fn a_read_only_role_reads_a_current_schema() {
    let Some(url) = retinue_testkit::pg_url("PostgreSQL read-only tests") else { return };
    let (schema, role) = (name("ro"), name("reader"));
    let owner = PgStore::open(&url, PgOptions::default().with_schema(&schema)).expect("migrate");
    let id = owner
        .insert_unit(&UnitDraft {
            children: vec![ChildManifest::default()],
            ..UnitDraft::default()
        })
        .expect("unit");
    assert!(owner.retain_completed_delegation(&id, None).expect("retain"));
    let mut admin = postgres::Client::connect(&url, postgres::NoTls).expect("admin");
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA {schema} TO {role}; \
             GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role};"
        ))
        .expect("role");
    let reader_url = as_user(&url, &role);
    // A write open migrates: the role may not.
    assert!(PgStore::open(&reader_url, PgOptions::default().with_schema(&schema)).is_err());
    let reader = PgStore::open(&reader_url, PgOptions::default().with_schema(&schema).read_only())
        .expect("a read-only open of a current schema");
    let listed = reader.list_retained_children().expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].delegation_id, id);
    drop(reader);
    // A schema that is behind (here: never created) is named, not a permission error.
    let empty = name("empty");
    admin
        .batch_execute(&format!("CREATE SCHEMA {empty}; GRANT USAGE ON SCHEMA {empty} TO {role};"))
        .expect("empty schema");
    let e = PgStore::open(&reader_url, PgOptions::default().with_schema(&empty).read_only())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("needs version") && e.contains("write command"), "{e}");
    drop(owner);
    admin
        .batch_execute(&format!(
            "DROP SCHEMA {schema} CASCADE; DROP SCHEMA {empty} CASCADE; DROP OWNED BY {role}; \
             DROP ROLE {role};"
        ))
        .expect("cleanup");
}

/// Issue #22: recovery touches only the caller's tenant's units (and
/// unprofiled ones): another tenant's dead worker is that tenant's to recover.
#[test]
fn recovery_is_scoped_to_the_tenant() {
    use std::sync::Arc;

    use retinue_core::{OwnerProbe, ProcessState, Retention};
    struct AllAlive;
    impl OwnerProbe for AllAlive {
        fn probe(&self, _: i64) -> Option<ProcessState> {
            Some(ProcessState::Alive { started_at: None })
        }
    }
    let Some(url) = retinue_testkit::pg_url("PostgreSQL read-only tests") else { return };
    let schema = name("rec");
    let clock = retinue_testkit::manual_clock(retinue_testkit::T0);
    let open = |profile: &str| {
        PgStore::open(
            &url,
            PgOptions::default()
                .with_schema(&schema)
                .with_clock(clock.clone())
                .with_profile(profile),
        )
        .expect("open")
    };
    let acme = open("acme");
    let draft = |profile: &str| UnitDraft {
        owner_profile: profile.to_owned(),
        children: vec![ChildManifest::default()],
        ..UnitDraft::default()
    };
    let acme_unit = acme.insert_unit(&draft("acme")).expect("unit");
    // acme's worker is gone: it gives its lease up (as a lapse would).
    acme.retire().expect("retire");
    drop(acme);
    let other = Arc::new(open("other"));
    let report = other.recover_abandoned_delegations(&AllAlive);
    assert_eq!(report.abandoned, 0, "another tenant's unit was recovered: {report:?}");
    let acme_again = open("acme");
    let report = acme_again.recover_abandoned_delegations(&AllAlive);
    assert_eq!(report.abandoned, 1, "{report:?}");
    let _ = acme_unit;
    drop((other, acme_again));
    PgStore::drop_schema(&url, &schema).expect("drop");
}
