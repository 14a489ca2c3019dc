//! The lineage oracle: random session forests (10–200 sessions with random
//! sources, markers, end reasons, missing parents, cycles, long compression
//! chains and injected storage errors) on which `retinue_lineage::root` is
//! compared with [`Oracle::root`], an independent implementation written from
//! the spec's definition (§5.2), not from the lineage crate's code.
//!
//! The oracle does not parse anything: every `source` and `model_config`
//! text comes from a catalogue that states its per-hop verdict, so the
//! comparison also checks the lineage crate's parsing of those texts.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use retinue_core::{SessionGraph, SessionRow};
use retinue_lineage::RootError;
use retinue_store::Store;
use rusqlite::Connection;
use serde_json::{Value, json};

use crate::rng::Rng;
use crate::{Context, Outcome};

/// What the per-hop check says about one row (semantics §5.2), by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hop {
    Pass,
    ForbiddenSource,
    BadModelConfig,
    Branch,
    DelegateChild,
}

/// `source` texts and whether `lowercase(trim(source))` is delegate,
/// subagent or tool.
const SOURCES: &[(&str, bool)] = &[
    ("cli", false),
    ("telegram", false),
    ("", false),
    ("delegate", true),
    (" Delegate ", true),
    ("DELEGATE", true),
    ("subagent", true),
    ("SubAgent\n", true),
    ("tool", true),
    ("\tTool", true),
    ("toolbox", false),
    ("subagents", false),
    ("del egate", false),
    ("\u{ff34}\u{ff2f}\u{ff2f}\u{ff2c}", false),
    ("cli-tool", false),
];

/// `model_config` texts and their verdict (NULL/blank = `{}`; unparsable or
/// not an object = bad; key presence counts, `_branched_from` first).
const MODEL_CONFIGS: &[(Option<&str>, Hop)] = &[
    (None, Hop::Pass),
    (Some(""), Hop::Pass),
    (Some("   "), Hop::Pass),
    (Some("{}"), Hop::Pass),
    (Some(" {} "), Hop::Pass),
    (Some("{\"model\":\"x\",\"temperature\":0.2}"), Hop::Pass),
    (Some("{\"x\":{\"_branched_from\":\"A\"}}"), Hop::Pass),
    (Some("{\"_Branched_From\":\"A\"}"), Hop::Pass),
    (Some("{\"_branched_from \":\"A\"}"), Hop::Pass),
    (Some("{\"note\":\"_delegate_from\"}"), Hop::Pass),
    (Some("{\"_branched_from\":\"A\"}"), Hop::Branch),
    (Some("{\"_branched_from\":null}"), Hop::Branch),
    (Some("{\"_branched_from\":false}"), Hop::Branch),
    (Some("{\"_delegate_from\":\"A\"}"), Hop::DelegateChild),
    (Some("{\"_delegate_from\":null}"), Hop::DelegateChild),
    (Some("{\"_delegate_from\":\"A\",\"_branched_from\":\"B\"}"), Hop::Branch),
    (Some("[1]"), Hop::BadModelConfig),
    (Some("[]"), Hop::BadModelConfig),
    (Some("{bad"), Hop::BadModelConfig),
    (Some("null"), Hop::BadModelConfig),
    (Some("1"), Hop::BadModelConfig),
    (Some("\"{}\""), Hop::BadModelConfig),
    (Some("{}x"), Hop::BadModelConfig),
    (Some("{'_branched_from': 'A'}"), Hop::BadModelConfig),
];

/// End states: (`ended`, `end_reason`).
const ENDS: &[(bool, Option<&str>)] = &[
    (true, Some("compression")),
    (false, None),
    (false, Some("compression")),
    (true, Some("user_exit")),
    (true, Some("Compression")),
    (true, Some(" compression")),
    (true, Some("compression ")),
    (true, None),
    (true, Some("")),
];

/// A generated forest: the rows the lineage crate reads (through
/// [`SessionGraph`]) and the verdicts the oracle knows by construction.
#[derive(Debug, Default)]
pub struct Forest {
    rows: HashMap<String, SessionRow>,
    /// Exact parent text → child ids, in `started_at, id` order.
    kids: HashMap<String, Vec<String>>,
    hop: HashMap<String, Hop>,
    /// `session(id)` fails for these.
    poisoned_rows: HashSet<String>,
    /// `child_sessions(id)` fails for these.
    poisoned_kids: HashSet<String>,
    ids: Vec<String>,
    /// The last sessions of the long chain, if any (walk-limit boundary).
    chain_tail: Vec<String>,
}

fn injected() -> retinue_core::Error {
    retinue_core::Error::Invalid("injected storage failure".to_owned())
}

impl SessionGraph for Forest {
    fn session(&self, id: &str) -> retinue_core::Result<Option<SessionRow>> {
        if self.poisoned_rows.contains(id) {
            return Err(injected());
        }
        Ok(self.rows.get(id).cloned())
    }

    fn child_sessions(&self, parent: &str) -> retinue_core::Result<Vec<SessionRow>> {
        if self.poisoned_kids.contains(parent) {
            return Err(injected());
        }
        Ok(self
            .kids
            .get(parent)
            .map(|ids| ids.iter().filter_map(|id| self.rows.get(id).cloned()).collect())
            .unwrap_or_default())
    }
}

impl Forest {
    /// A random forest of 10–200 sessions, with injected storage errors.
    pub fn generate(rng: &mut Rng) -> Forest {
        Forest::generate_with(rng, true)
    }

    /// A random forest of 10–200 sessions; `poison` injects storage errors
    /// (only an in-memory graph can fail on demand).
    pub fn generate_with(rng: &mut Rng, poison: bool) -> Forest {
        let n = usize::try_from(rng.range(10, 200)).unwrap_or(10);
        let ids: Vec<String> = (0..n)
            .map(|i| match rng.below(25) {
                0 => format!("\u{df}{i}"),
                1 => format!("s {i}"),
                2 => format!("S{i}"),
                _ => format!("s{i}"),
            })
            .collect();
        // Sometimes a long clean compression chain 0 → 1 → … → len-1, to
        // probe the 100-session walk limit from both sides.
        let chain = if rng.chance(20) {
            usize::try_from(rng.range(95, 105)).unwrap_or(0).min(n)
        } else {
            0
        };
        let mut f = Forest { ids: ids.clone(), ..Forest::default() };
        f.chain_tail = ids[chain.saturating_sub(3)..chain].to_vec();
        for (i, id) in ids.iter().enumerate() {
            let in_chain = i < chain;
            let parent: Option<String> = if in_chain {
                (i > 0).then(|| ids[i - 1].clone())
            } else {
                match rng.below(100) {
                    0..45 if i > 0 => Some(ids[i - 1].clone()),
                    45..70 if i > 0 => Some(ids[rng.index(i)].clone()),
                    70..78 => None,
                    78..81 => Some(String::new()),
                    81..83 => Some("  ".to_owned()),
                    83..88 => Some(format!("ghost{}", rng.below(3))),
                    88..91 => Some(ids[i + rng.index(n - i)].clone()),
                    91..93 => Some(format!(" {}", ids[rng.index(n)])),
                    _ => Some(ids[rng.index(n)].clone()),
                }
            };
            let (source, forbidden) = if in_chain || rng.chance(85) {
                SOURCES[0]
            } else {
                SOURCES[rng.index(SOURCES.len())]
            };
            let (model_config, mc) = if in_chain || rng.chance(80) {
                MODEL_CONFIGS[0]
            } else {
                MODEL_CONFIGS[rng.index(MODEL_CONFIGS.len())]
            };
            let (ended, end_reason) = if (in_chain && i + 1 < chain) || rng.chance(55) {
                ENDS[0]
            } else {
                ENDS[rng.index(ENDS.len())]
            };
            let started_at = rng.range(0, 10_000) as f64;
            let hop = if forbidden { Hop::ForbiddenSource } else { mc };
            f.hop.insert(id.clone(), hop);
            if let Some(p) = &parent {
                f.kids.entry(p.clone()).or_default().push(id.clone());
            }
            f.rows.insert(
                id.clone(),
                SessionRow {
                    id: id.clone(),
                    source: source.to_owned(),
                    model_config: model_config.map(str::to_owned),
                    parent_session_id: parent,
                    started_at,
                    ended_at: ended.then_some(started_at + 1.0),
                    end_reason: end_reason.map(str::to_owned),
                    ..SessionRow::default()
                },
            );
            if poison && !in_chain && rng.chance(1) {
                f.poisoned_rows.insert(id.clone());
            }
            if poison && !in_chain && rng.chance(1) {
                f.poisoned_kids.insert(id.clone());
            }
        }
        for list in f.kids.values_mut() {
            list.sort_by(|a, b| {
                let ta = f.rows.get(a).map_or(0.0, |r| r.started_at);
                let tb = f.rows.get(b).map_or(0.0, |r| r.started_at);
                ta.total_cmp(&tb).then(a.cmp(b))
            });
        }
        f
    }

    /// The session ids, in generation order.
    pub fn ids(&self) -> &[String] {
        &self.ids
    }

    /// Replaces the `sessions` rows of the database behind `conn` with this
    /// forest (raw SQL: missing parents and cycles included).
    pub fn write_to(&self, conn: &mut Connection) -> Outcome<()> {
        let tx = conn.transaction().ctx("begin")?;
        tx.execute("DELETE FROM sessions", []).ctx("clear sessions")?;
        {
            let mut insert = tx
                .prepare(
                    "INSERT INTO sessions (id, source, model_config, parent_session_id, \
                     started_at, ended_at, end_reason) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                )
                .ctx("prepare insert")?;
            for id in &self.ids {
                let Some(r) = self.rows.get(id) else { continue };
                insert
                    .execute(rusqlite::params![
                        r.id,
                        r.source,
                        r.model_config,
                        r.parent_session_id,
                        r.started_at,
                        r.ended_at,
                        r.end_reason
                    ])
                    .ctx("insert session")?;
            }
        }
        tx.commit().ctx("commit")
    }
}

/// The oracle's verdict: a root, or why there is none (semantics §5.2's names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The lineage root.
    Root(String),
    /// No root, for this reason.
    NoRoot(&'static str),
}

fn verdict_of(r: Result<String, RootError>) -> Verdict {
    match r {
        Ok(root) => Verdict::Root(root),
        Err(e) => Verdict::NoRoot(match e {
            RootError::NoSession => "NoSession",
            RootError::Cycle => "Cycle",
            RootError::MissingSession => "MissingSession",
            RootError::ForbiddenSource => "ForbiddenSource",
            RootError::BadModelConfig => "BadModelConfig",
            RootError::Branch => "Branch",
            RootError::DelegateChild => "DelegateChild",
            RootError::MissingParent => "MissingParent",
            RootError::ParentNotEnded => "ParentNotEnded",
            RootError::ParentNotCompression => "ParentNotCompression",
            RootError::AmbiguousContinuation => "AmbiguousContinuation",
            RootError::HopLimit => "HopLimit",
            RootError::Storage(_) => "Storage",
        }),
    }
}

/// The oracle's view of a forest: its own index of each parent's children
/// that pass the per-hop check, built by one scan of the rows.
#[derive(Debug)]
pub struct Oracle<'a> {
    forest: &'a Forest,
    eligible: HashMap<&'a str, Vec<&'a str>>,
}

impl<'a> Oracle<'a> {
    /// Indexes `forest`.
    pub fn new(forest: &'a Forest) -> Oracle<'a> {
        let mut eligible: HashMap<&str, Vec<&str>> = HashMap::new();
        for row in forest.rows.values() {
            if let Some(p) = row.parent_session_id.as_deref()
                && forest.hop.get(&row.id) == Some(&Hop::Pass)
            {
                eligible.entry(p).or_default().push(row.id.as_str());
            }
        }
        Oracle { forest, eligible }
    }

    /// The spec's walk (§5.2), step by step, over the forest's own data.
    /// Returns the verdict and the number of links walked.
    pub fn root(&self, start: &str) -> (Verdict, usize) {
        let f = self.forest;
        let no = |why: &'static str, links: usize| (Verdict::NoRoot(why), links);
        // 1. Trim; empty → no session.
        let first = start.trim();
        if first.is_empty() {
            return no("NoSession", 0);
        }
        let mut current = first.to_owned();
        let mut visited: Vec<String> = Vec::new();
        let mut checked = 0usize;
        loop {
            // 2. Seen before → cycle.
            if visited.contains(&current) {
                return no("Cycle", checked);
            }
            visited.push(current.clone());
            // 3. The row, then the per-hop check.
            if f.poisoned_rows.contains(&current) {
                return no("Storage", checked);
            }
            let Some(row) = f.rows.get(&current) else { return no("MissingSession", checked) };
            match f.hop.get(&current).copied().unwrap_or(Hop::Pass) {
                Hop::Pass => {}
                Hop::ForbiddenSource => return no("ForbiddenSource", checked),
                Hop::BadModelConfig => return no("BadModelConfig", checked),
                Hop::Branch => return no("Branch", checked),
                Hop::DelegateChild => return no("DelegateChild", checked),
            }
            // 4. No parent (NULL or blank) → this is the root.
            let parent = match &row.parent_session_id {
                None => return (Verdict::Root(current), checked),
                Some(p) if p.trim().is_empty() => return (Verdict::Root(current), checked),
                Some(p) => p.clone(),
            };
            // 5. The parent: present, ended, ended with exactly `compression`.
            if f.poisoned_rows.contains(&parent) {
                return no("Storage", checked);
            }
            let Some(prow) = f.rows.get(&parent) else { return no("MissingParent", checked) };
            if prow.ended_at.is_none() {
                return no("ParentNotEnded", checked);
            }
            if prow.end_reason.as_deref() != Some("compression") {
                return no("ParentNotCompression", checked);
            }
            // 6. Its children that pass the per-hop check are exactly {current}.
            if f.poisoned_kids.contains(&parent) {
                return no("Storage", checked);
            }
            match self.eligible.get(parent.as_str()).map(Vec::as_slice) {
                Some([only]) if *only == current => {}
                _ => return no("AmbiguousContinuation", checked),
            }
            // 7. Count it; 100 checked without a root → hop limit.
            checked += 1;
            if checked >= 100 {
                return no("HopLimit", checked);
            }
            current = parent;
        }
    }
}

/// What an oracle run did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OracleReport {
    /// Forests generated (cases).
    pub cases: u64,
    /// Root queries compared.
    pub queries: u64,
    /// Of the cases, forests written to a real `state.db` and walked
    /// through the store (its one-round-trip `neighbourhood` read).
    pub db_cases: u64,
    /// Of the queries, those answered through the store.
    pub db_queries: u64,
    /// Disagreements (must be 0).
    pub disagreements: u64,
    /// Verdicts by kind.
    pub verdicts: BTreeMap<String, u64>,
    /// Longest chain of links that resolved to a root.
    pub max_links_resolved: usize,
    /// First disagreements, described.
    pub examples: Vec<String>,
    /// Wall time in seconds.
    pub secs: f64,
    /// The seed.
    pub seed: u64,
}

impl OracleReport {
    /// The figures as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "harness": "oracle", "cases": self.cases, "queries": self.queries,
            "db_cases": self.db_cases, "db_queries": self.db_queries,
            "disagreements": self.disagreements, "verdicts": self.verdicts,
            "max_links_resolved": self.max_links_resolved, "examples": self.examples,
            "secs": self.secs, "seed": self.seed,
        })
    }

    fn merge(&mut self, o: OracleReport) {
        self.cases += o.cases;
        self.queries += o.queries;
        self.db_cases += o.db_cases;
        self.db_queries += o.db_queries;
        self.disagreements += o.disagreements;
        for (k, v) in o.verdicts {
            *self.verdicts.entry(k).or_default() += v;
        }
        self.max_links_resolved = self.max_links_resolved.max(o.max_links_resolved);
        self.examples
            .extend(o.examples.into_iter().take(5usize.saturating_sub(self.examples.len())));
    }
}

/// The seed of case `i` of a run seeded `seed` (to replay one case).
pub fn case_seed(seed: u64, i: u64) -> u64 {
    Rng::new(seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64()
}

/// The start ids of a case: every session (or a sample of `sample`), a
/// padded id, blanks and ids with no row.
fn starts_of(f: &Forest, rng: &mut Rng, sample: Option<usize>) -> Vec<String> {
    let mut starts: Vec<String> = match sample {
        Some(n) if n < f.ids().len() => (0..n).filter_map(|_| rng.pick(f.ids()).cloned()).collect(),
        _ => f.ids().to_vec(),
    };
    starts.extend(f.chain_tail.iter().cloned());
    if let Some(id) = rng.pick(f.ids()) {
        starts.push(format!(" {id}\t"));
    }
    starts.extend(["".to_owned(), "  ".to_owned(), "nope".to_owned(), "ghost0".to_owned()]);
    starts
}

fn compare(
    r: &mut OracleReport,
    f: &Forest,
    graph: &dyn SessionGraph,
    starts: &[String],
    seed: u64,
) {
    let oracle = Oracle::new(f);
    for start in starts {
        let (want, links) = oracle.root(start);
        let got = verdict_of(retinue_lineage::root(graph, start));
        r.queries += 1;
        let label = match &want {
            Verdict::Root(_) => "Root",
            Verdict::NoRoot(why) => why,
        };
        *r.verdicts.entry(label.to_owned()).or_default() += 1;
        if matches!(want, Verdict::Root(_)) {
            r.max_links_resolved = r.max_links_resolved.max(links);
        }
        if got != want {
            r.disagreements += 1;
            if r.examples.len() < 5 {
                r.examples.push(format!(
                    "case seed {seed}: start {start:?}: lineage {got:?}, oracle {want:?}"
                ));
            }
        }
    }
}

/// Compares lineage and oracle on one in-memory forest (48 sampled starts,
/// the end of the long chain, a padded id, blanks and ids with no row).
pub fn run_case(seed: u64) -> OracleReport {
    let mut rng = Rng::new(seed);
    let f = Forest::generate(&mut rng);
    let starts = starts_of(&f, &mut rng, Some(48));
    let mut r = OracleReport { cases: 1, ..OracleReport::default() };
    compare(&mut r, &f, &f, &starts, seed);
    r
}

/// Compares lineage over a real store with the oracle on one forest written
/// to `conn`'s database (24 sampled starts).
pub fn run_db_case(store: &Store, conn: &mut Connection, seed: u64) -> Outcome<OracleReport> {
    let mut rng = Rng::new(seed);
    let f = Forest::generate_with(&mut rng, false);
    f.write_to(conn)?;
    let starts = starts_of(&f, &mut rng, Some(24));
    let mut r = OracleReport { cases: 1, db_cases: 1, ..OracleReport::default() };
    compare(&mut r, &f, store, &starts, seed);
    r.db_queries = r.queries;
    Ok(r)
}

fn db_worker(seed: u64, cases: impl Iterator<Item = u64>) -> Outcome<OracleReport> {
    let dir = tempfile::tempdir().ctx("oracle db dir")?;
    let path = dir.path().join("state.db");
    let store = crate::open_store(&path, 10)?;
    let mut conn = Connection::open(&path).ctx("raw open")?;
    conn.execute_batch("PRAGMA foreign_keys = OFF; PRAGMA synchronous = OFF;").ctx("pragmas")?;
    let mut r = OracleReport::default();
    for i in cases {
        r.merge(run_db_case(&store, &mut conn, case_seed(seed ^ 0xdb, i))?);
    }
    Ok(r)
}

/// Runs `cases` forests on `threads` threads; `db_cases` of them go through
/// a real store.
pub fn run(cases: u64, db_cases: u64, seed: u64, threads: usize) -> Outcome<OracleReport> {
    let start = Instant::now();
    let threads = threads.max(1) as u64;
    let db_cases = db_cases.min(cases);
    let memory = cases - db_cases;
    let mut total = OracleReport { seed, ..OracleReport::default() };
    let parts: Vec<Outcome<OracleReport>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let mut r = OracleReport::default();
                    let mut i = t;
                    while i < memory {
                        r.merge(run_case(case_seed(seed, i)));
                        i += threads;
                    }
                    r.merge(db_worker(seed, (t..db_cases).step_by(threads as usize))?);
                    Ok(r)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("oracle thread panicked".to_owned())))
            .collect()
    });
    for p in parts {
        total.merge(p?);
    }
    total.secs = crate::secs_since(start);
    Ok(total)
}
