//! A deterministic child runtime and a recording completion sink: test
//! doubles of the orchestrator's seams (`retinue_core::run`), never a
//! runtime for a user's real home (no shipped crate depends on testkit).

use retinue_core::CompletionEvent;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use retinue_core::{ExitReason, Message};
use serde_json::Value;

use retinue_core::run::{
    CallPlan, CallUsage, ChildHandle, ChildOutcome, ChildRuntime, ChildSpec, CompletionSink,
    RunContext, RunInput, RunTokens, RuntimeError, TranscriptSink,
};

/// What the scripted runtime does for goals containing a pattern.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Script {
    /// The reply; `None` = an empty response.
    pub reply: Option<String>,
    /// Prompt tokens reported.
    pub input_tokens: u64,
    /// Completion tokens reported.
    pub output_tokens: u64,
    /// Cost reported.
    pub cost_usd: f64,
    /// Wall-clock delay before replying; a run stopped during it (deadline or
    /// cancel) ends `interrupted` and reports its tokens as spent.
    pub delay: Duration,
    /// Panic inside `run` with this text (tests that a panicking child is
    /// reported, never dropped).
    pub panic: Option<String>,
    /// Fail with this error.
    pub fail: Option<String>,
    /// Whether steering is accepted.
    pub accept_steer: bool,
    /// Report steers accepted during the run as missed (the child "finished
    /// before its next iteration boundary") instead of folding them in.
    pub miss_steers: bool,
}

/// One recorded call to the scripted runtime.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptedRun {
    /// The spec it was built with.
    pub spec: ChildSpec,
    /// The run input.
    pub input: RunInput,
}

/// A deterministic [`ChildRuntime`]: replies `"<reply>"` or `"Done: <goal>"`.
#[derive(Debug, Default)]
pub struct ScriptedRuntime {
    scripts: Vec<(String, Script)>,
    default: Script,
    specs: Mutex<HashMap<String, ChildSpec>>,
    runs: Mutex<Vec<ScriptedRun>>,
    steers: Mutex<Vec<(String, String)>>,
}

impl ScriptedRuntime {
    /// Replies `Done: <goal>`, 100/20 tokens, 0.01 USD, one API call.
    pub fn new() -> Self {
        ScriptedRuntime {
            default: Script {
                reply: None,
                input_tokens: 100,
                output_tokens: 20,
                cost_usd: 0.01,
                accept_steer: true,
                ..Script::default()
            },
            ..ScriptedRuntime::default()
        }
    }

    /// Uses `script` for goals (or follow-up messages) containing `pattern`.
    #[must_use]
    pub fn with_script(mut self, pattern: &str, script: Script) -> Self {
        self.scripts.push((pattern.to_owned(), script));
        self
    }

    /// The runs so far.
    pub fn runs(&self) -> Vec<ScriptedRun> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The steers accepted so far, as (subagent id, message).
    pub fn steers(&self) -> Vec<(String, String)> {
        self.steers.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn script_for(&self, text: &str) -> &Script {
        self.scripts
            .iter()
            .find(|(p, _)| text.contains(p.as_str()))
            .map_or(&self.default, |(_, s)| s)
    }
}

impl ChildRuntime for ScriptedRuntime {
    fn build(&self, spec: &ChildSpec) -> Result<ChildHandle, RuntimeError> {
        if let Some(err) = &self.script_for(&spec.goal).fail
            && err.starts_with("build:")
        {
            return Err(RuntimeError::Build(err.clone()));
        }
        self.specs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(spec.subagent_id.clone(), spec.clone());
        Ok(ChildHandle::of(spec))
    }

    fn run(
        &self,
        child: &ChildHandle,
        input: &RunInput,
        sink: &dyn TranscriptSink,
        ctx: &RunContext,
    ) -> ChildOutcome {
        let spec = self
            .specs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&child.subagent_id)
            .cloned()
            .unwrap_or_default();
        self.runs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(ScriptedRun { spec: spec.clone(), input: input.clone() });
        let script = self.script_for(&input.user_message).clone();
        let steers_before = self.steers.lock().unwrap_or_else(PoisonError::into_inner).len();
        let mut tokens = RunTokens {
            input: script.input_tokens,
            output: script.output_tokens,
            ..RunTokens::default()
        };
        if !script.delay.is_zero() && ctx.cancel.sleep(script.delay) {
            return ChildOutcome {
                exit_reason: ExitReason::Interrupted,
                api_calls: 1,
                tokens,
                cost_usd: script.cost_usd,
                ..ChildOutcome::default()
            };
        }
        if let Some(text) = &script.panic {
            panic!("{text}");
        }
        // The scripted "model" asks the core for leave like a real runtime
        // (its whole price counted as the prompt's); it honours the
        // completion bound it is given, as a well-behaved provider does.
        let plan = CallPlan {
            prompt_tokens: tokens.input,
            prompt_cost_usd: script.cost_usd,
            max_completion_tokens: Some(tokens.output),
            usd_per_completion_token: None,
        };
        let permit = match ctx.cancel.begin_call(plan) {
            Ok(p) => p,
            Err(why) => {
                return ChildOutcome::failed(
                    ExitReason::Budget,
                    format!("the next model call would cross the budget: {why}"),
                );
            }
        };
        if let Some(bound) = permit.max_completion_tokens() {
            tokens.output = tokens.output.min(bound);
        }
        let missed_steers: Vec<String> = if script.miss_steers {
            self.steers.lock().unwrap_or_else(PoisonError::into_inner)[steers_before..]
                .iter()
                .filter(|(sa, _)| *sa == child.subagent_id)
                .map(|(_, m)| m.clone())
                .collect()
        } else {
            Vec::new()
        };
        if let Some(err) = script.fail {
            // A provider error: the call was refused, nothing was spent.
            permit.finish(CallUsage::default());
            return ChildOutcome {
                exit_reason: ExitReason::Error,
                api_calls: 1,
                error: Some(err),
                ..ChildOutcome::default()
            };
        }
        let reply = script.reply.unwrap_or_else(|| {
            format!("Done: {}", input.user_message.lines().next().unwrap_or_default())
        });
        let message = Message {
            role: "assistant".to_owned(),
            content: Some(reply.clone()),
            finish_reason: Some("stop".to_owned()),
            ..Message::default()
        };
        if let Err(e) = sink.append(&message) {
            permit.finish(CallUsage {
                tokens: tokens.input.saturating_add(tokens.output),
                cost_usd: script.cost_usd,
            });
            return ChildOutcome::failed(
                ExitReason::Error,
                format!("transcript write failed: {e}"),
            );
        }
        permit.finish(CallUsage {
            tokens: tokens.input.saturating_add(tokens.output),
            cost_usd: script.cost_usd,
        });
        ChildOutcome {
            final_response: Some(reply),
            exit_reason: ExitReason::Completed,
            api_calls: 1,
            tokens,
            cost_usd: script.cost_usd,
            error: None,
            missed_steers,
            ..ChildOutcome::default()
        }
    }

    fn steer(&self, child: &ChildHandle, message: &str) -> bool {
        if !self.script_for(message).accept_steer {
            return false;
        }
        self.steers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((child.subagent_id.clone(), message.to_owned()));
        true
    }
}

/// A [`CompletionSink`] that records events and ignores repeats of a `delegation_id`.
#[derive(Debug, Default)]
pub struct RecordingSink {
    seen: Mutex<BTreeSet<String>>,
    events: Mutex<Vec<Value>>,
}

impl RecordingSink {
    /// The accepted events, in order.
    pub fn events(&self) -> Vec<Value> {
        self.events.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

impl CompletionSink for RecordingSink {
    fn deliver(&self, event: &CompletionEvent) -> bool {
        let id = event.delegation_id.clone();
        let fresh = self.seen.lock().unwrap_or_else(PoisonError::into_inner).insert(id);
        if fresh {
            self.events.lock().unwrap_or_else(PoisonError::into_inner).push(event.raw.clone());
        }
        true
    }
}
