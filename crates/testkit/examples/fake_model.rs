//! A fake OpenAI-compatible model server for trying Retinue offline:
//! `cargo run -p retinue-testkit --example fake_model` prints its base URL
//! (127.0.0.1, an ephemeral port) and answers every chat request with
//! `Done: <first line of the last user turn>`, 1,000/200 tokens and a
//! reported cost of $0.004, until it is stopped (Ctrl-C) or 10 minutes pass.

use std::time::Duration;

use retinue_testkit::fake_model::{FakeModel, Reply, Usage};

fn main() {
    let model = FakeModel::start();
    model.set_handler(|request| {
        let messages = request.messages();
        let last = messages.iter().rev().find(|m| m["role"] == "user")?;
        let text = last["content"].as_str().unwrap_or_default();
        let first = text.lines().next().unwrap_or_default();
        Some(Reply::text(&format!("Done: {first}")).with_usage(Usage::new(1000, 200).cost(0.004)))
    });
    println!("{}", model.base_url());
    std::thread::sleep(Duration::from_secs(600));
}
