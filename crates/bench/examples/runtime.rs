//! The runtime benchmark: `cargo run --release -p retinue-bench --example
//! runtime [-- --quick]`.
//!
//! * Overhead per model call: one `ChatRuntime` run (one call, a final
//!   answer) against the testkit fake model server, compared with the limit —
//!   a bare `ureq` POST of the same body to the same server, reading the
//!   answer as text; and against its floor, that POST made interruptible as
//!   the runtime's must be (on a pooled thread, the answer handed back
//!   through a channel the caller waits on).
//! * 32 children at once: 32 threads each run one child whose model call the
//!   server delays by 200 ms; the total wall time is reported next to that one
//!   delay (≈ equal means no child waited for another's HTTP call), with the
//!   process's peak RSS. Nothing is asserted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use retinue_core::Message;
use retinue_core::run::{ChildRuntime, ChildSpec, RunContext, RunInput, SinkError, TranscriptSink};
use retinue_runtime::{ChatRuntime, NoTools, RuntimeConfig};
use retinue_testkit::fake_model::{FakeModel, Reply, Usage};

struct Discard;

impl TranscriptSink for Discard {
    fn append(&self, _message: &Message) -> Result<(), SinkError> {
        Ok(())
    }
}

fn median_p90(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let pick = |q: f64| {
        samples.get(((samples.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0)
    };
    (pick(0.5), pick(0.9))
}

fn rss_peak_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn spec(i: usize) -> ChildSpec {
    ChildSpec {
        subagent_id: format!("sa-{i}-bench"),
        session_id: format!("s-{i}"),
        ..ChildSpec::default()
    }
}

fn input() -> RunInput {
    RunInput {
        user_message: "Summarise the benchmark.".into(),
        history: Vec::new(),
        system_prompt: Some("You are a benchmark child.".into()),
    }
}

fn main() -> std::process::ExitCode {
    let quick = std::env::args().any(|a| a == "--quick");
    let iters = if quick { 200 } else { 2_000 };
    let server = FakeModel::start();
    server.set_default(Reply::text("done").with_usage(Usage::new(20, 5)));
    let config = RuntimeConfig::new(server.base_url(), "bench/model").with_api_key("sk-bench");
    let runtime = match ChatRuntime::new(config, Arc::new(NoTools)) {
        Ok(r) => Arc::new(r),
        Err(e) => {
            eprintln!("runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    println!(
        "{:<52} {:>11} {:>11} {:>11} {:>7}",
        "operation", "median µs", "p90 µs", "limit µs", "ratio"
    );

    // Overhead per model call.
    let child = match runtime.build(&spec(0)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("build: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
    let url = server.chat_url();
    let body = r#"{"model":"bench/model","messages":[{"role":"system","content":"You are a benchmark child."},{"role":"user","content":"Summarise the benchmark."}]}"#;
    let run_ours = || {
        let start = Instant::now();
        let _ = runtime.run(&child, &input(), &Discard, &RunContext::default());
        start.elapsed().as_secs_f64() * 1e6
    };
    let run_limit = || {
        let start = Instant::now();
        if let Ok(r) = agent
            .post(&url)
            .header("content-type", "application/json")
            .header("authorization", "Bearer sk-bench")
            .send(body)
        {
            let _ = r.into_body().read_to_string();
        }
        start.elapsed().as_secs_f64() * 1e6
    };
    // The floor of an interruptible call: the same bare POST on a pooled
    // thread, its answer handed back through a channel the caller waits on
    // (as the runtime must, so that a cancel returns while a socket blocks).
    let floor_agent = agent.clone();
    let (floor_url, floor_body) = (url.clone(), body.to_owned());
    let run_floor = || {
        let start = Instant::now();
        let (tx, rx) = std::sync::mpsc::channel();
        let (a, u, b) = (floor_agent.clone(), floor_url.clone(), floor_body.clone());
        blocking::unblock(move || {
            let text = a
                .post(&u)
                .header("content-type", "application/json")
                .header("authorization", "Bearer sk-bench")
                .send(&b)
                .ok()
                .and_then(|r| r.into_body().read_to_string().ok());
            let _ = tx.send(text);
        })
        .detach();
        let _ = rx.recv_timeout(Duration::from_secs(10));
        start.elapsed().as_secs_f64() * 1e6
    };
    // All warmed up (connections pooled, allocator and caches settled),
    // then measured in turn, so none pays for going first.
    for _ in 0..iters / 10 {
        run_ours();
        run_limit();
        run_floor();
    }
    let (mut ours, mut limit, mut floor) =
        (Vec::with_capacity(iters), Vec::with_capacity(iters), Vec::with_capacity(iters));
    for _ in 0..iters {
        ours.push(run_ours());
        limit.push(run_limit());
        floor.push(run_floor());
    }
    let (om, op) = median_p90(ours);
    let (lm, _) = median_p90(limit);
    let (fm, _) = median_p90(floor);
    println!(
        "{:<52} {:>11.1} {:>11.1} {:>11.1} {:>7.2}",
        "one run, one model call (fake server)",
        om,
        op,
        lm,
        if lm > 0.0 { om / lm } else { 0.0 }
    );
    println!(
        "{:<52} {:>11.1} {:>11.1} {:>11.1} {:>7.2}",
        "  same, limit = that POST on a pooled thread, by channel",
        om,
        op,
        fm,
        if fm > 0.0 { om / fm } else { 0.0 }
    );

    // The same run with tracing on and the collector down: its spans go to
    // the bounded queue and the exports fail off the run's path.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").ok();
        let port = l.as_ref().and_then(|l| l.local_addr().ok()).map_or(9, |a| a.port());
        format!("http://127.0.0.1:{port}")
    };
    let tracing = retinue_trace::init(&format!("{dead}/v1/traces"), "retinue-bench");
    let traced: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            let _ = runtime.run(&child, &input(), &Discard, &RunContext::default());
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    let (tm, tp) = median_p90(traced);
    println!(
        "{:<52} {:>11.1} {:>11.1} {:>11.1} {:>7.2}",
        "same run, tracing on, collector down (limit: off)",
        tm,
        tp,
        om,
        if om > 0.0 { tm / om } else { 0.0 }
    );
    if let Some(t) = &tracing {
        let s = t.stats();
        println!("{:<52} exported {}, failed {} (so far)", "spans", s.exported, s.failed);
    }

    // 32 children at once, each call delayed 200 ms.
    let delay = Duration::from_millis(200);
    let children = 32;
    server.set_default(Reply::text("done").with_usage(Usage::new(20, 5)).delayed(delay));
    let before = server.request_count();
    let start = Instant::now();
    let threads: Vec<_> = (0..children)
        .map(|i| {
            let rt = Arc::clone(&runtime);
            std::thread::spawn(move || {
                let child = rt.build(&spec(1000 + i)).ok()?;
                let out = rt.run(&child, &input(), &Discard, &RunContext::default());
                Some(out.final_response.is_some())
            })
        })
        .collect();
    let ok = threads
        .into_iter()
        .map(|t| t.join().ok().flatten())
        .filter(|done| *done == Some(true))
        .count();
    let wall = start.elapsed();
    println!(
        "{:<52} {:>11.1} {:>11} {:>11.1} {:>7.2}",
        format!("{children} children at once ({ok} completed), wall time"),
        wall.as_secs_f64() * 1e6,
        "-",
        delay.as_secs_f64() * 1e6,
        wall.as_secs_f64() / delay.as_secs_f64()
    );
    println!(
        "{:<52} peak RSS {} KiB, {} requests",
        "memory",
        rss_peak_kib(),
        server.request_count() - before
    );
    std::process::ExitCode::SUCCESS
}
