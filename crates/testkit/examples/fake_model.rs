//! A fake OpenAI-compatible model server for trying Retinue offline:
//! `cargo run -p retinue-testkit --example fake_model` prints its base URL
//! (127.0.0.1, an ephemeral port) and answers every chat request with
//! `Done: <first line of the last user turn>`, 1,000/200 tokens and a
//! reported cost of $0.004, until it is stopped (Ctrl-C) or 10 minutes pass.
//!
//! A goal that contains `[tool NAME {JSON arguments}]` makes the model call
//! that tool first; once the result is back it answers `Done: <first line>`
//! followed by `Tool said: <the result>`.

use std::time::Duration;

use retinue_testkit::fake_model::{FakeModel, Reply, Usage};

fn main() {
    let model = FakeModel::start();
    model.set_handler(|request| {
        let messages = request.messages();
        let last = messages.iter().rev().find(|m| m["role"] == "user")?;
        let text = last["content"].as_str().unwrap_or_default();
        let first = text.lines().next().unwrap_or_default();
        let tail = messages.last()?;
        if tail["role"] == "tool" {
            let said = tail["content"].as_str().unwrap_or_default();
            return Some(
                Reply::text(&format!("Done: {first}\nTool said: {said}"))
                    .with_usage(Usage::new(1000, 200).cost(0.004)),
            );
        }
        if let Some((name, args)) = tool_directive(text) {
            return Some(
                Reply::tool_call("call_e2e_1", &name, args)
                    .with_usage(Usage::new(500, 50).cost(0.001)),
            );
        }
        Some(Reply::text(&format!("Done: {first}")).with_usage(Usage::new(1000, 200).cost(0.004)))
    });
    println!("{}", model.base_url());
    // The parent may have closed our stdout; keep serving regardless.
    std::thread::sleep(Duration::from_secs(600));
}

/// `[tool NAME {JSON}]` in `text`: the tool and its arguments.
fn tool_directive(text: &str) -> Option<(String, serde_json::Value)> {
    let start = text.find("[tool ")? + "[tool ".len();
    let rest = &text[start..];
    let end = rest.rfind(']')?;
    let (name, args) = rest[..end].split_once(' ')?;
    let args = serde_json::from_str(args.trim()).ok()?;
    Some((name.trim().to_owned(), args))
}
