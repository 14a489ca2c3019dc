//! `retinue-torture`: runs Retinue's reliability harnesses.
//!
//! ```text
//! retinue-torture crash --kills N [--db-dir D] [--seed S] [--min-ms A] [--max-ms B]
//! retinue-torture contention [--procs 4] [--threads 8] --ops N [--db-dir D] [--seed S]
//! retinue-torture oracle --cases N [--db-cases M] [--seed S] [--threads T]
//! retinue-torture hostile [--db-dir D]
//! retinue-torture worker --db F --log F [--seed S] [--max-ops N]     (spawned by crash)
//! retinue-torture contention-proc --db F --out F --threads T --ops N --procs P --seed S
//! ```
//!
//! Each harness prints its figures as one JSON line on stdout and exits
//! non-zero on the first violation.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use retinue_torture::rng::Rng;
use retinue_torture::{Outcome, contention, crash, hostile, oracle, worker};

const USAGE: &str = "\
usage: retinue-torture <harness> [options]

  crash --kills N [--db-dir D] [--seed S] [--min-ms A] [--max-ms B]
  contention [--procs 4] [--threads 8] --ops N [--db-dir D] [--seed S]
  oracle --cases N [--db-cases M] [--seed S] [--threads T]
  hostile [--db-dir D]
  worker --db F --log F [--seed S] [--max-ops N]
  contention-proc --db F --out F --threads T --ops N --procs P --seed S
";

struct Args {
    flags: HashMap<String, String>,
}

impl Args {
    fn parse(raw: &[String]) -> Outcome<Args> {
        let mut flags = HashMap::new();
        let mut it = raw.iter();
        while let Some(flag) = it.next() {
            let Some(name) = flag.strip_prefix("--") else {
                return Err(format!("unexpected argument `{flag}`"));
            };
            let Some(value) = it.next() else { return Err(format!("`{flag}` needs a value")) };
            flags.insert(name.to_owned(), value.clone());
        }
        Ok(Args { flags })
    }

    fn string(&self, name: &str) -> Option<&str> {
        self.flags.get(name).map(String::as_str)
    }

    fn path(&self, name: &str) -> Outcome<PathBuf> {
        self.string(name).map(PathBuf::from).ok_or_else(|| format!("--{name} is required"))
    }

    fn num(&self, name: &str, default: Option<u64>) -> Outcome<u64> {
        match self.string(name) {
            Some(v) => v.parse().map_err(|e| format!("--{name} {v}: {e}")),
            None => default.ok_or_else(|| format!("--{name} is required")),
        }
    }

    fn seed(&self) -> Outcome<u64> {
        self.num("seed", Some(Rng::os_seed()))
    }

    /// `--db-dir`, or a fresh temporary directory kept after the run.
    fn dir(&self) -> Outcome<PathBuf> {
        match self.string("db-dir") {
            Some(d) => Ok(PathBuf::from(d)),
            None => tempfile::Builder::new()
                .prefix("retinue-torture-")
                .tempdir()
                .map(tempfile::TempDir::keep)
                .map_err(|e| format!("temporary directory: {e}")),
        }
    }
}

fn small(n: u64, name: &str) -> Outcome<u32> {
    u32::try_from(n).map_err(|_| format!("--{name} {n} is too large"))
}

fn exe() -> Outcome<PathBuf> {
    std::env::current_exe().map_err(|e| format!("cannot locate this binary: {e}"))
}

fn run(cmd: &str, a: &Args) -> Outcome<Option<serde_json::Value>> {
    Ok(match cmd {
        "crash" => {
            let opts = crash::CrashOptions {
                exe: exe()?,
                dir: a.dir()?,
                kills: small(a.num("kills", None)?, "kills")?,
                seed: a.seed()?,
                min_delay: Duration::from_millis(a.num("min-ms", Some(5))?),
                max_delay: Duration::from_millis(a.num("max-ms", Some(250))?),
            };
            eprintln!("crash: {} kills in {} (seed {})", opts.kills, opts.dir.display(), opts.seed);
            Some(crash::run(&opts)?.to_json())
        }
        "contention" => {
            let opts = contention::ContentionOptions {
                exe: exe()?,
                dir: a.dir()?,
                procs: small(a.num("procs", Some(4))?, "procs")?,
                threads: small(a.num("threads", Some(8))?, "threads")?,
                ops: a.num("ops", None)?,
                seed: a.seed()?,
            };
            eprintln!(
                "contention: {} procs x {} threads, {} ops each, in {} (seed {})",
                opts.procs,
                opts.threads,
                opts.ops,
                opts.dir.display(),
                opts.seed
            );
            Some(contention::run(&opts)?.to_json())
        }
        "oracle" => {
            let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
            let threads = usize::try_from(a.num("threads", Some(threads as u64))?).unwrap_or(1);
            let cases = a.num("cases", None)?;
            let db_cases = a.num("db-cases", Some(cases / 50))?;
            let report = oracle::run(cases, db_cases, a.seed()?, threads)?;
            if report.disagreements > 0 {
                return Err(format!(
                    "{} disagreement(s) between lineage and the oracle: {}",
                    report.disagreements,
                    report.to_json()
                ));
            }
            Some(report.to_json())
        }
        "hostile" => {
            let dir = a.dir()?;
            eprintln!("hostile: files and homes in {}", dir.display());
            Some(hostile::run(&dir)?.to_json())
        }
        "worker" => {
            let max =
                a.string("max-ops").map(str::parse).transpose().map_err(|e| format!("{e}"))?;
            worker::run(&a.path("db")?, &a.path("log")?, a.seed()?, max)?;
            None
        }
        "contention-proc" => {
            contention::run_proc(&contention::ProcOptions {
                db: a.path("db")?,
                out: a.path("out")?,
                threads: small(a.num("threads", Some(8))?, "threads")?,
                ops: a.num("ops", None)?,
                procs: small(a.num("procs", Some(4))?, "procs")?,
                seed: a.seed()?,
            })?;
            None
        }
        other => return Err(format!("unknown harness `{other}`\n\n{USAGE}")),
    })
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = raw.split_first() else {
        eprint!("{USAGE}");
        return ExitCode::from(2);
    };
    if matches!(cmd.as_str(), "-h" | "--help" | "help") {
        print!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let result = Args::parse(rest).and_then(|a| run(cmd, &a));
    match result {
        Ok(Some(figures)) => {
            println!("{figures}");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("retinue-torture {cmd}: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
