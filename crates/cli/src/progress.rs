//! `retinue delegate` on a terminal: one live status line per child on
//! stderr (model, elapsed time, output tokens, model calls, last tool), read
//! from the registry as the children write it. Nothing is drawn on a pipe or
//! with `--json`.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use retinue_core::{Clock, Message, SystemClock, UnitChild, UsageSoFar};

/// What one child's line says.
pub(crate) fn status_line(child: &UnitChild, elapsed_secs: f64, turns: &[Message]) -> String {
    let so_far = UsageSoFar::of(turns);
    let mut line = format!(
        "{} {} {:>5.1}s {} tok {} call(s)",
        child.subagent_id,
        child.model.as_deref().unwrap_or("-"),
        elapsed_secs.max(0.0),
        so_far.output_tokens,
        so_far.api_calls
    );
    if let Some(tool) = so_far.last_tool {
        line.push_str(&format!(" · last tool {tool}"));
    }
    // Names come from the model: no escape sequence reaches the terminal.
    line.chars().map(|c| if c.is_control() { '?' } else { c }).collect()
}

/// The live lines of one `retinue delegate` run, stopped on drop.
pub(crate) struct Status {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Status {
    /// Starts drawing the running children of `parent` when stderr is a
    /// terminal and the output is not JSON; `None` otherwise.
    pub(crate) fn start(
        seams: retinue_core::Backend,
        parent: &str,
        env: &crate::env::Env,
        hold: Arc<AtomicBool>,
    ) -> Option<Status> {
        let (profile, json) = (env.profile.as_str(), env.json);
        if json || !std::io::stderr().is_terminal() {
            return None;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, parent, profile) = (stop.clone(), parent.to_owned(), profile.to_owned());
        let thread = std::thread::Builder::new()
            .name("status".to_owned())
            .spawn(move || draw(&seams, &parent, &profile, &flag, &hold))
            .ok()?;
        Some(Status { stop, thread: Some(thread) })
    }
}

impl Drop for Status {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Draws until `stop`; while `hold` is set (an approval prompt is on
/// screen) the lines are cleared and not redrawn.
fn draw(
    seams: &retinue_core::Backend,
    parent: &str,
    profile: &str,
    stop: &AtomicBool,
    hold: &AtomicBool,
) {
    let bars = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template("{spinner} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let mut shown: HashMap<String, ProgressBar> = HashMap::new();
    while !stop.load(Ordering::SeqCst) {
        if hold.load(Ordering::SeqCst) {
            for (_, bar) in shown.drain() {
                bar.finish_and_clear();
            }
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        let now = SystemClock.now();
        let scope = retinue_core::Scope::of(profile);
        let units = seams.controls.running_units(scope.filter()).unwrap_or_default();
        let mut live = Vec::new();
        for u in units.iter().filter(|u| u.parent_session_id.as_deref() == Some(parent)) {
            for c in &u.children {
                let turns = seams.sessions.conversation(&c.child_session_id).unwrap_or_default();
                let line = status_line(c, now - u.dispatched_at, &turns);
                let bar = shown.entry(c.subagent_id.clone()).or_insert_with(|| {
                    let b = bars.add(ProgressBar::new_spinner());
                    b.set_style(style.clone());
                    b
                });
                bar.set_message(line);
                bar.tick();
                live.push(c.subagent_id.clone());
            }
        }
        shown.retain(|id, bar| {
            let keep = live.contains(id);
            if !keep {
                bar.finish_and_clear();
            }
            keep
        });
        std::thread::sleep(Duration::from_millis(250));
    }
    for bar in shown.values() {
        bar.finish_and_clear();
    }
    let _ = bars.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(role: &str, tokens: Option<i64>, tool: Option<&str>) -> Message {
        Message {
            role: role.into(),
            token_count: tokens,
            tool_name: tool.map(str::to_owned),
            ..Message::default()
        }
    }

    #[test]
    fn a_line_names_the_model_time_tokens_calls_and_last_tool() {
        let child = UnitChild {
            subagent_id: "sa-0-1234abcd".into(),
            model: Some("gpt-4.1".into()),
            ..UnitChild::default()
        };
        let turns = [
            turn("system", None, None),
            turn("user", Some(50), None),
            turn("assistant", Some(20), None),
            turn("tool", None, Some("read_file")),
            turn("assistant", Some(12), None),
            turn("assistant", Some(-4), None),
        ];
        assert_eq!(
            status_line(&child, 3.25, &turns),
            "sa-0-1234abcd gpt-4.1   3.2s 32 tok 3 call(s) · last tool read_file"
        );
        assert_eq!(status_line(&child, -1.0, &[]), "sa-0-1234abcd gpt-4.1   0.0s 0 tok 0 call(s)");
        let hostile = [turn("tool", None, Some("x\u{1b}]0;pwned\u{7}"))];
        assert!(!status_line(&child, 0.0, &hostile).chars().any(char::is_control));
    }
}
