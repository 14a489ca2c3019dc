//! How an agent framework embeds Retinue: open the store on the agent's
//! hermes home, give the `delegate_task` tool the framework's own child
//! runtime, route the model's tool calls to it, and scope operator-style
//! lookups to a session's lineage with `Authority`.
//!
//! Run it with `cargo run -p retinue-cli --example embed`.

use std::sync::Arc;

use retinue_config::LoadedConfig;
use retinue_core::{
    ExitReason, Message, NewSession, SessionStore, SystemClock, default_profile_key,
};
use retinue_delegate::{
    CallPlan, CallUsage, CancelToken, ChildHandle, ChildOutcome, ChildRuntime, ChildSpec,
    DelegateOutcome, DelegateRequest, Delegator, DelegatorParts, ParentContext, RunContext,
    RunInput, RunTokens, RuntimeError, SpawnRequest, TaskSpec, TranscriptSink,
};
use retinue_lineage::{Authority, LineageAuthority};
use retinue_store::{Store, StoreOptions};
use serde_json::json;

/// The framework's own child runtime: here an echo, in real life an LLM client
/// that runs a child agent loop on `input.history` + `input.user_message`.
struct MyRuntime;

impl ChildRuntime for MyRuntime {
    fn build(&self, spec: &ChildSpec) -> Result<ChildHandle, RuntimeError> {
        // A follow-up resumes an existing session; a spawn starts a new one.
        let session_id = spec.resume_session_id.clone().unwrap_or_else(|| spec.session_id.clone());
        Ok(ChildHandle { session_id, ..ChildHandle::of(spec) })
    }

    fn run(
        &self,
        _child: &ChildHandle,
        input: &RunInput,
        sink: &dyn TranscriptSink,
        ctx: &RunContext,
    ) -> ChildOutcome {
        // A real runtime checks `ctx.cancel` between model calls (and bounds each
        // call by its `remaining()`), returning the usage spent so far.
        let cancel = &ctx.cancel;
        if cancel.is_cancelled() {
            return ChildOutcome {
                exit_reason: ExitReason::Interrupted,
                ..ChildOutcome::default()
            };
        }
        // Before each model call, ask the core for leave: under a budget it
        // reserves the call's prompt and bounded completion and says the
        // bound to send (`max_completion_tokens`); refused when it does not fit.
        let prompt_tokens = u64::try_from(input.user_message.len() / 4).unwrap_or(u64::MAX);
        let permit = match cancel.begin_call(CallPlan { prompt_tokens, ..CallPlan::default() }) {
            Ok(p) => p,
            Err(why) => return ChildOutcome::failed(ExitReason::Budget, why.to_string()),
        };
        let reply = format!("({} earlier turns) {}", input.history.len(), input.user_message);
        // ... the model call, with `permit.max_completion_tokens()` ...
        // Then charge what the call used (a permit dropped unfinished is
        // charged all it held; the core also charges whatever the outcome
        // reports beyond what permits charged).
        permit.finish(CallUsage { tokens: prompt_tokens, cost_usd: 0.0 });
        // Everything the child says goes through the sink, into its own session.
        let message = Message {
            role: "assistant".into(),
            content: Some(reply.clone()),
            ..Message::default()
        };
        if let Err(e) = sink.append(&message) {
            return ChildOutcome::failed(ExitReason::Error, e.to_string());
        }
        ChildOutcome {
            final_response: Some(reply),
            exit_reason: ExitReason::Completed,
            api_calls: 1,
            tokens: RunTokens { input: 120, output: 30, ..RunTokens::default() },
            cost_usd: 0.002,
            ..ChildOutcome::default()
        }
    }

    fn steer(&self, _child: &ChildHandle, _message: &str) -> bool {
        false // this runtime cannot fold messages into a running child
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // In an agent: `retinue_config::hermes_home()`; here a throw-away home.
    let home = tempfile::tempdir()?;
    let config = LoadedConfig::load(home.path());
    let opts = StoreOptions::default()
        .with_clock(Arc::new(SystemClock))
        .with_profile(default_profile_key(home.path()))
        .with_retention(config.delegation.retention());
    let store = Arc::new(Store::open(home.path().join("state.db"), opts)?);
    let profile = store.profile().to_owned();
    let authority = Arc::new(Authority::new(store.clone(), store.clone(), profile.clone()));
    let tool = Delegator::new(DelegatorParts {
        backend: retinue_core::Backend::of(store.clone()),
        authority: authority.clone(),
        runtime: Arc::new(MyRuntime),
        completions: None, // background results: pass your CompletionSink
        config: (&config.delegation).into(),
        profile,
    });
    // Advertise the tool to the model with this schema.
    println!("tool: {}", tool.schema()["name"]);

    // The agent's own session, and a tool call from its model.
    store.create_session(&NewSession {
        id: "agent-1".into(),
        source: "cli".into(),
        ..NewSession::default()
    })?;
    let me = ParentContext { session_id: Some("agent-1".into()), ..ParentContext::default() };
    // The typed core, for a framework that calls it directly …
    let request = DelegateRequest::Spawn(SpawnRequest {
        tasks: vec![TaskSpec { goal: "Summarise the README".into(), ..TaskSpec::default() }],
        ..SpawnRequest::default()
    });
    match tool.delegate(&request, &me, &CancelToken::new()) {
        Ok(DelegateOutcome::Completed(unit)) => println!("typed: {}", unit.delegation_id),
        Ok(other) => println!("typed: {:?}", other.to_json()),
        Err(e) => println!("refused ({:?}): {e}", e.kind()),
    }
    // … and the JSON tool a model calls (parse → call → render).
    let spawned = tool.delegate_task(&json!({ "goal": "Read the changelog" }), Some(&me));
    let child = spawned["results"][0]["subagent_id"].as_str().unwrap_or_default().to_owned();
    println!("spawned {child}: {}", spawned["results"][0]["summary"]);

    // Later — even after a restart — the model follows the child up by id.
    let again = tool.delegate_task(
        &json!({ "follow_up": child, "goal": "And the breaking changes?" }),
        Some(&me),
    );
    println!("follow-up: {}", again["results"][0]["summary"]);

    // What this session's lineage may still address (a stranger would get []).
    for entry in authority.list_for(Some("agent-1"))? {
        println!("retained: {} ({})", entry.child_id(), entry.child_session_id);
    }
    Ok(())
}
