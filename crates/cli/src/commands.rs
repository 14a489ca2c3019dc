//! The operator commands: each opens the [`Backend`] (a `state.db`, or
//! PostgreSQL in team mode), does one thing through the store's traits and
//! the lineage, usage or delegate crates, and returns its JSON and its human
//! rendering.

use std::sync::Arc;

use retinue_config::DelegationConfig;
use retinue_core::{
    Clock, Lookup, NewSession, ProcProbe, Receipts, RetainedChild, Scope, SessionStore,
    SystemClock, TombstoneReason, Unaddressable, UsageAttribution, UsageTotals, iso8601,
};
use retinue_delegate::{
    CancelToken, ChildRuntime, DelegateError, DelegateErrorKind, DelegateOutcome, DelegateRequest,
    Delegator, DelegatorParts, FollowUp, ParentContext, SpawnRequest, TaskSpec,
};
use retinue_lineage::{Authority, Denial, check_follow_up_authority, lineage_chain, list_for};
use retinue_runtime::{ChatRuntime, RuntimeConfig};
use retinue_tools::{Toolbox, ToolboxConfig};
use retinue_usage::{
    budget_json, child_breakdown, fold_usage, load_child_usage_attributions,
    load_child_usage_totals, load_lineage_usage_totals,
};
use serde_json::{Value, json};

use crate::Output;
use crate::backend::Backend;
use crate::cli::DelegateArgs;
use crate::env::{Access, Env};
use crate::error::{CliError, EXIT_DENIED, EXIT_FAILED, EXIT_OK, Result, delegate_error_code};
use crate::table::{Table, clip, key_values};

/// Opens the database read-only (read commands never write, lock or wait
/// on a `state.db`).
fn open_read(env: &Env) -> Result<Backend> {
    Backend::open(env, Arc::new(SystemClock), Access::Read)
}

/// Opens an existing database for writing (a missing `state.db` is not found).
fn open_write(env: &Env) -> Result<Backend> {
    Backend::open(env, Arc::new(SystemClock), Access::WriteExisting)
}

/// An optional epoch time as ISO-8601, or `-`.
pub(crate) fn when(t: Option<f64>) -> String {
    t.map_or_else(|| "-".to_owned(), iso8601)
}

/// The human table of entries (newest unit first, as given).
pub(crate) fn children_table(entries: &[RetainedChild]) -> String {
    if entries.is_empty() {
        return "no addressable retained children\n".to_owned();
    }
    let mut t = Table::new(&[
        "CHILD",
        "CHILD SESSION",
        "DELEGATION",
        "PARENT",
        "STATE",
        "RETAINED AT",
        "MODEL",
        "GOAL",
    ]);
    for e in entries {
        t.row(vec![
            e.child_id().to_owned(),
            e.child_session_id.clone(),
            e.delegation_id.clone(),
            e.parent_session_id.clone(),
            e.state.to_string(),
            when(e.retained_at),
            e.manifest.model.clone().unwrap_or_else(|| "-".to_owned()),
            clip(e.manifest.goal.as_deref().unwrap_or("-"), 48),
        ]);
    }
    t.render()
}

fn entry_block(e: &RetainedChild) -> String {
    key_values(&[
        ("child_id", e.child_id().to_owned()),
        ("child_session_id", e.child_session_id.clone()),
        ("delegation_id", e.delegation_id.clone()),
        ("parent_session_id", e.parent_session_id.clone()),
        ("owner_profile", e.owner_profile.clone()),
        ("state", e.state.to_string()),
        ("retained_at", when(e.retained_at)),
        ("completed_at", when(e.completed_at)),
        ("model", e.manifest.model.clone().unwrap_or_else(|| "-".to_owned())),
        ("goal", e.manifest.goal.clone().unwrap_or_else(|| "-".to_owned())),
    ])
}

/// Why `id` cannot be addressed, as a not-found error naming the status;
/// an id outside `scope` (another tenant's) is answered as a missing one,
/// byte for byte.
fn not_addressable(store: &Backend, scope: &Scope, id: &str) -> Result<CliError> {
    let id = id.trim();
    Ok(CliError::NotFound(match scope.reads(store).lookup(id)? {
        Lookup::Unknown | Lookup::Addressable(_) => {
            format!("no retained child, child session or delegation '{id}'")
        }
        Lookup::NotAddressable(_, Unaddressable::Tombstoned { at, reason, note }) => format!(
            "'{id}' is not addressable: tombstoned at {} (reason: {}{})",
            iso8601(at),
            reason.as_str(),
            note.map(|n| format!(", note: {}", clip(&n, 128))).unwrap_or_default()
        ),
        Lookup::NotAddressable(entry, Unaddressable::NeverRetained) => format!(
            "'{id}' is not addressable: its delegation {} was never retained (state {})",
            entry.delegation_id, entry.state
        ),
    }))
}

/// The scope of the registry views (`children *`): the process's tenant,
/// or every profile under `--all-profiles`.
fn view_scope(store: &Backend, env: &Env) -> Scope {
    if env.all_profiles { Scope::Operator } else { store.scope.clone() }
}

/// `retinue children list [--owner SESSION] [--running]`: the retained
/// children, then (on a terminal) the units still running; `--running`
/// lists only those (JSON: the running units).
pub(crate) fn children_list(env: &Env, owner: Option<&str>, running: bool) -> Result<Output> {
    let store = open_read(env)?;
    let now = SystemClock.now();
    let live: Vec<Value> = crate::background::running_units(&store, env, owner)?
        .iter()
        .map(|u| crate::background::running_json(&store, u, now))
        .collect();
    if running {
        let human = if live.is_empty() {
            "no running delegations\n".to_owned()
        } else {
            crate::background::running_table(&live)
        };
        return Ok(Output::ok(Value::Array(live), human));
    }
    let scope = view_scope(&store, env);
    let entries = match owner {
        Some(owner) => list_for(&*store.registry, &*store.graph, Some(owner), scope.profile())?,
        None => store.registry.list_retained_children()?,
    };
    let entries: Vec<RetainedChild> =
        entries.into_iter().filter(|e| scope.admits(Some(&e.owner_profile))).collect();
    let json = Value::Array(entries.iter().map(RetainedChild::to_json).collect());
    let mut human = children_table(&entries);
    if !live.is_empty() {
        human.push_str(&crate::background::running_table(&live));
    }
    Ok(Output::ok(json, human))
}

/// `retinue children show ID`: a retained child, or a unit still running
/// (with its elapsed time and usage so far).
pub(crate) fn children_show(env: &Env, id: &str, all: bool) -> Result<Output> {
    let store = open_read(env)?;
    let scope = view_scope(&store, env);
    if all && scope.reads(&store).find_retained_child(id)?.is_none() {
        // Any state, read-only: why it stopped, or that it was tombstoned.
        return match scope.reads(&store).unit_view(id)? {
            Some(u) => {
                let mut v = unit_json(&store, &scope, &u, Some(id));
                let human = units_table(std::slice::from_ref(&v));
                v["approvals"] =
                    crate::approvals::of(&store, &scope, Some(&u.delegation_id), None)?;
                Ok(Output::ok(v, human))
            }
            None => Err(not_addressable(&store, &scope, id)?),
        };
    }
    match scope.reads(&store).find_retained_child(id)? {
        Some(entry) => {
            let mut v = entry.to_json();
            v["approvals"] = crate::approvals::of(&store, &scope, None, Some(&entry.subagent_id))?;
            let mut human = entry_block(&entry);
            // The whole transcript's receipts (every run, follow-ups too).
            match store.sessions.conversation(&entry.child_session_id) {
                Ok(messages) => {
                    let receipts = Receipts::of(&messages);
                    human.push_str(&format!("{}\n", receipts.line()));
                    v["receipts"] = retinue_delegate::receipts_json(&receipts);
                }
                Err(e) => log::warn!("could not read {}'s transcript: {e}", entry.child_session_id),
            }
            Ok(Output::ok(v, human))
        }
        None => {
            let running = scope.reads(&store).unit_view(id)?.filter(|u| !u.is_finished());
            match running {
                Some(u) => {
                    let mut v = crate::background::running_json(&store, &u, SystemClock.now());
                    v["approvals"] =
                        crate::approvals::of(&store, &scope, Some(&u.delegation_id), None)?;
                    let human = crate::background::running_table(std::slice::from_ref(&v));
                    Ok(Output::ok(v, human))
                }
                None => Err(not_addressable(&store, &scope, id)?),
            }
        }
    }
}

/// `retinue children list --all`: every unit inside the scope, any state,
/// newest first (at most [`UNITS_LISTED`]).
pub(crate) fn units_list(env: &Env) -> Result<Output> {
    let store = open_read(env)?;
    let scope = view_scope(&store, env);
    let units = store.controls.list_units(scope.filter(), UNITS_LISTED)?;
    let json: Vec<Value> = units.iter().map(|u| unit_json(&store, &scope, u, None)).collect();
    let human = if json.is_empty() { "no delegations\n".to_owned() } else { units_table(&json) };
    Ok(Output::ok(Value::Array(json), human))
}

/// The most units `children list --all` shows.
const UNITS_LISTED: usize = 1000;

/// A unit in any state as `children show --all` and `list --all` show it:
/// its state and, per child, its status, exit reason, reason text (the
/// error, or the tombstone's reason), tombstone and usage. `only`: the
/// child named by that id alone (a delegation id keeps every child).
fn unit_json(
    store: &Backend,
    scope: &Scope,
    u: &retinue_core::UnitView,
    only: Option<&str>,
) -> Value {
    let results: Vec<Value> = u
        .result
        .as_ref()
        .and_then(|r| r.get("results"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let usage = store.registry.unit_usage(&u.delegation_id).ok().flatten();
    let usage_of = |sa: &str| {
        usage
            .as_ref()
            .and_then(|v| v.get("children"))
            .and_then(Value::as_array)
            .and_then(|cs| cs.iter().find(|c| c["subagent_id"] == sa).cloned())
            .unwrap_or(Value::Null)
    };
    let whole_unit = only.is_none_or(|id| id.trim() == u.delegation_id);
    let children: Vec<Value> = u
        .children
        .iter()
        .filter(|c| {
            whole_unit || only.is_some_and(|id| id == c.subagent_id || id == c.child_session_id)
        })
        .map(|c| {
            let r = results
                .iter()
                .find(|r| r["subagent_id"] == c.subagent_id.as_str())
                .or_else(|| results.get(c.child_index as usize))
                .cloned()
                .unwrap_or(Value::Null);
            let reason = r["error"]
                .as_str()
                .map(str::to_owned)
                .or_else(|| c.tombstone_reason.as_ref().map(|t| format!("tombstoned ({t})")));
            let addressable = !c.subagent_id.is_empty()
                && matches!(scope.reads(store).lookup(&c.subagent_id), Ok(Lookup::Addressable(_)));
            json!({
                "subagent_id": c.subagent_id,
                "child_session_id": c.child_session_id,
                "goal": c.goal,
                "addressable": addressable,
                "status": r["status"],
                "exit_reason": r["exit_reason"],
                "reason": reason,
                "tombstoned_at": c.tombstoned_at,
                "tombstone_reason": c.tombstone_reason,
                "usage": usage_of(&c.subagent_id),
            })
        })
        .collect();
    json!({
        "delegation_id": u.delegation_id,
        "state": u.state.as_str(),
        "parent_session_id": u.parent_session_id,
        "dispatched_at": u.dispatched_at,
        "completed_at": u.completed_at,
        "tombstoned_at": u.tombstoned_at,
        "children": children,
        "usage": usage.as_ref().map(|v| json!({
            "cost_usd": v["cost_usd"], "tokens": v["tokens"], "api_calls": v["api_calls"],
        })),
    })
}

/// `children list --all`'s table: a row per child.
fn units_table(units: &[Value]) -> String {
    let mut t = Table::new(&[
        "DELEGATION",
        "STATE",
        "SUBAGENT",
        "STATUS",
        "EXIT REASON",
        "COST USD",
        "REASON",
    ]);
    let text = |v: &Value| v.as_str().unwrap_or("-").to_owned();
    for u in units {
        for c in u["children"].as_array().into_iter().flatten() {
            t.row(vec![
                text(&u["delegation_id"]),
                text(&u["state"]),
                text(&c["subagent_id"]),
                text(&c["status"]),
                text(&c["exit_reason"]),
                c["usage"]["cost_usd"]
                    .as_f64()
                    .map_or_else(|| "-".to_owned(), |x| format!("{x:.4}")),
                clip(c["reason"].as_str().unwrap_or("-"), 60),
            ]);
        }
    }
    t.render()
}

/// `retinue children tombstone ID [--reason TEXT]`.
pub(crate) fn children_tombstone(env: &Env, id: &str, reason: Option<&str>) -> Result<Output> {
    let store = open_write(env)?;
    let scope = view_scope(&store, env);
    let entry = match scope.reads(&store).lookup(id)? {
        Lookup::Addressable(entry) => entry,
        _ => return Err(not_addressable(&store, &scope, id)?),
    };
    // The reason is `manual`; `--reason` is the tombstone's note.
    let note = reason.map(str::trim).filter(|r| !r.is_empty());
    let reason = note.map_or(TombstoneReason::Manual, |r| TombstoneReason::Other(r.to_owned()));
    if !store.registry.tombstone_retained_child(id, &reason)? {
        return Err(not_addressable(&store, &scope, id)?);
    }
    let what = if id.trim() == entry.delegation_id {
        format!("every live child of {}", entry.delegation_id)
    } else {
        format!("{} (delegation {})", entry.child_id(), entry.delegation_id)
    };
    let human = match note {
        Some(note) => format!("tombstoned {what}, reason: manual, note: {}\n", clip(note, 128)),
        None => format!("tombstoned {what}, reason: manual\n"),
    };
    Ok(Output::ok(json!({ "tombstoned": true }), human))
}

/// `retinue children prune [--ttl-hours H] [--max-retained N]`.
pub(crate) fn children_prune(
    env: &Env,
    ttl_hours: Option<f64>,
    max_retained: Option<u32>,
) -> Result<Output> {
    let store = open_write(env)?;
    let count = store.registry.prune_retained_children(max_retained, ttl_hours)?;
    let d = &store.config.delegation;
    let human = format!(
        "pruned with ttl {} h and max {} retained units: tombstoned {} unit(s), {} child(ren)\n",
        ttl_hours.map_or(d.retained_ttl_hours, |h| h.max(0.0)),
        max_retained.map_or(d.max_retained, |m| m.max(1)),
        count.units,
        count.children
    );
    Ok(Output::ok(json!({ "tombstoned": count.units, "children": count.children }), human))
}

/// The contract's name of a denial.
pub(crate) fn denial_kind(d: &Denial) -> &'static str {
    match d {
        Denial::Profile { .. } => "profile",
        Denial::SelfFollowUp => "itself",
        Denial::Lineage { .. } => "lineage",
    }
}

/// `retinue authority ID --caller SESSION`.
pub(crate) fn authority(env: &Env, id: &str, caller: &str) -> Result<Output> {
    let store = open_read(env)?;
    // Another tenant's id is missing (exit 4), never "denied (profile)".
    let entry = match store.scoped().lookup(id)? {
        Lookup::Addressable(entry) => entry,
        _ => return Err(not_addressable(&store, &store.scope, id)?),
    };
    let decision = check_follow_up_authority(&*store.graph, &entry, Some(caller), &env.profile);
    Ok(match decision {
        Ok(()) => {
            let message = format!(
                "follow_up allowed: '{}' is in the session lineage that spawned {} (spawner '{}').",
                caller.trim(),
                entry.child_id(),
                entry.parent_session_id
            );
            let human = format!("allowed\n{message}\n");
            Output::ok(json!({ "allowed": true, "denial": null, "message": message }), human)
        }
        Err(denial) => {
            let kind = denial_kind(&denial);
            let message = denial.message();
            Output {
                json: Some(json!({ "allowed": false, "denial": kind, "message": message })),
                human: format!("denied ({kind})\n{message}\n"),
                code: EXIT_DENIED,
                stderr: None,
            }
        }
    })
}

/// `retinue lineage SESSION`.
pub(crate) fn lineage(env: &Env, session: &str) -> Result<Output> {
    let store = open_read(env)?;
    let session = session.trim();
    if session.is_empty() || store.scoped().session(session)?.is_none() {
        return Err(CliError::NotFound(format!("no session '{}'", clip(session, 128))));
    }
    let (root, chain, why) = match lineage_chain(&*store.graph, session) {
        Ok(chain) => (chain.last().cloned(), chain, None),
        Err(e) => (None, Vec::new(), Some(e.to_string())),
    };
    let human = key_values(&[
        ("session", session.to_owned()),
        (
            "root",
            match (&root, &why) {
                (Some(r), _) => r.clone(),
                (None, Some(why)) => format!("none ({why})"),
                (None, None) => "none".to_owned(),
            },
        ),
        ("chain", if chain.is_empty() { "-".to_owned() } else { chain.join(" → ") }),
    ]);
    let mut json = json!({ "session_id": session, "root": root, "chain": chain });
    if let Some(why) = why {
        json["reason"] = json!(why);
    }
    Ok(Output::ok(json, human))
}

fn totals_json(t: &UsageTotals) -> Value {
    json!({
        "cost_usd": t.cost_usd,
        "input_tokens": t.input_tokens,
        "output_tokens": t.output_tokens,
    })
}

/// The human rendering of totals and ledger records.
pub(crate) fn usage_human(
    totals: &UsageTotals,
    sessions: &[String],
    records: &[UsageAttribution],
) -> String {
    let mut out = key_values(&[
        ("sessions", sessions.join(" → ")),
        ("cost_usd", format!("{:.4}", totals.cost_usd)),
        ("input_tokens", format!("{:.0}", totals.input_tokens)),
        ("output_tokens", format!("{:.0}", totals.output_tokens)),
    ]);
    out.push('\n');
    if records.is_empty() {
        out.push_str("no ledger records\n");
        return out;
    }
    let mut t =
        Table::new(&["PARENT", "TURN", "CHILD SESSION", "STATUS", "COST USD", "IN", "OUT", "AT"]);
    for r in records {
        let u = fold_usage(&r.usage);
        let status = r.usage.get("status").and_then(Value::as_str).unwrap_or("-");
        t.row(vec![
            r.parent_session_id.clone(),
            if r.parent_turn_id.is_empty() { "-".to_owned() } else { r.parent_turn_id.clone() },
            r.child_session_id.clone(),
            status.to_owned(),
            format!("{:.4}", u.cost_usd),
            format!("{:.0}", u.input_tokens),
            format!("{:.0}", u.output_tokens),
            iso8601(r.created_at),
        ]);
    }
    out.push_str(&t.render());
    out
}

/// `retinue usage SESSION [--lineage]`.
pub(crate) fn usage(env: &Env, session: &str, lineage: bool) -> Result<Output> {
    let store = open_read(env)?;
    let session = session.trim();
    // Another tenant's session is missing, before its ledger is read; so
    // is, for a tenant, a session with no row (its tenant is unknown:
    // fail closed).
    let row = store.scoped().session(session)?;
    let no_row =
        row.is_none() && (!store.scope.is_operator() || store.sessions.session(session)?.is_some());
    if session.is_empty() || no_row {
        return Err(CliError::NotFound(format!("no session '{}'", clip(session, 128))));
    }
    let (mut totals, sessions, resolved) = if lineage {
        let walk = retinue_lineage::CompressionWalk::new(&*store.graph);
        let lt = load_lineage_usage_totals(&*store.ledger, &walk, session)?;
        (lt.totals, lt.sessions, Some(lt.lineage_resolved))
    } else {
        (load_child_usage_totals(&*store.ledger, session)?, vec![session.to_owned()], None)
    };
    let mut records = Vec::new();
    let mut filtered = false;
    for s in &sessions {
        let all = load_child_usage_attributions(&*store.ledger, s)?;
        if store.scope.is_operator() {
            records.extend(all);
        } else {
            // A shared session's rows of another tenant's children are left out.
            let kept = store.scoped().usage_attributions(s)?;
            filtered |= kept.len() != all.len();
            records.extend(kept);
        }
    }
    if filtered {
        totals =
            records.iter().fold(UsageTotals::default(), |acc, r| acc.plus(fold_usage(&r.usage)));
    }
    // A session that exists nowhere (no session row, no ledger row) is not found.
    if records.is_empty() && store.sessions.session(session)?.is_none() {
        return Err(CliError::NotFound(format!("no session '{}'", clip(session, 128))));
    }
    if ![totals.cost_usd, totals.input_tokens, totals.output_tokens].iter().all(|v| v.is_finite()) {
        return Err(CliError::Failed(format!(
            "the usage totals of '{session}' are too large to report (not finite)"
        )));
    }
    let mut json = json!({
        "totals": totals_json(&totals),
        "records": serde_json::to_value(&records)
            .map_err(|e| CliError::Failed(format!("cannot encode the records: {e}")))?,
    });
    let mut human = usage_human(&totals, &sessions, &records);
    if let Some(resolved) = resolved {
        json["sessions"] = json!(sessions);
        json["lineage_resolved"] = json!(resolved);
        // The per-child breakdown: each child's spawn and follow-ups.
        let children = child_breakdown(&records);
        json["children"] = serde_json::to_value(&children)
            .map_err(|e| CliError::Failed(format!("cannot encode the breakdown: {e}")))?;
        if !children.is_empty() {
            let mut t = Table::new(&["CHILD SESSION", "RUNS", "COST USD", "IN", "OUT"]);
            for c in &children {
                t.row(vec![
                    c.child_session_id.clone(),
                    c.runs.to_string(),
                    format!("{:.4}", c.totals.cost_usd),
                    format!("{:.0}", c.totals.input_tokens),
                    format!("{:.0}", c.totals.output_tokens),
                ]);
            }
            human.push('\n');
            human.push_str(&t.render());
        }
        // The lineage's budget, when delegation.budget sets one.
        let limit = store.config.delegation.budget;
        if !limit.is_unlimited() {
            let root = sessions.first().cloned().unwrap_or_else(|| session.to_owned());
            let status = store.budgets.budget_status(&root, &sessions, limit)?;
            let (cost_left, tokens_left) = status.remaining();
            let show = |cost: Option<f64>, tokens: Option<u64>| match (cost, tokens) {
                (Some(c), Some(t)) => format!("${c:.4} / {t} tokens"),
                (Some(c), None) => format!("${c:.4}"),
                (None, Some(t)) => format!("{t} tokens"),
                (None, None) => "-".to_owned(),
            };
            let limited = |cost: f64, tokens: u64| {
                show(limit.max_cost_usd.map(|_| cost), limit.max_tokens.map(|_| tokens))
            };
            human.push('\n');
            human.push_str(&key_values(&[
                ("budget limit", show(limit.max_cost_usd, limit.max_tokens)),
                ("spent", limited(status.spent.cost_usd, status.spent.tokens)),
                ("reserved", limited(status.reserved.cost_usd, status.reserved.tokens)),
                ("remaining", show(cost_left, tokens_left)),
            ]));
            json["budget"] = budget_json(&status);
        }
    }
    Ok(Output::ok(json, human))
}

/// `retinue recover`. On PostgreSQL an owner's liveness is its worker
/// lease, so this works from any host.
pub(crate) fn recover(env: &Env) -> Result<Output> {
    let store = open_write(env)?;
    let report = store.registry.recover_abandoned_delegations(&ProcProbe);
    let mut json = json!({ "abandoned": report.abandoned, "retained": report.addressable });
    // Budget reservations held by processes (workers) that are gone are
    // kept as spent (what they hold is the best known spend; never free).
    let kept = store.budgets.release_abandoned_reservations(&ProcProbe)?;
    if kept > 0 {
        json["kept_reservations"] = json!(kept);
    }
    let human = format!(
        "{} abandoned delegation(s) marked unknown; {} retained child(ren) addressable\n",
        report.abandoned, report.addressable
    );
    Ok(match report.error {
        None => Output::ok(json, human),
        Some(e) => Output {
            json: Some(json),
            human,
            code: EXIT_FAILED,
            stderr: Some(format!("could not classify abandoned delegations: {e}")),
        },
    })
}

/// The `--json` error code of a `delegate_task` error.
fn delegate_error_kind(e: &DelegateError) -> &'static str {
    match e.kind() {
        DelegateErrorKind::Usage => "usage",
        DelegateErrorKind::Denied => "denied",
        DelegateErrorKind::NotFound => "not_found",
        DelegateErrorKind::Busy => "busy",
        _ => match e {
            DelegateError::Storage(_) => "io",
            _ => "internal",
        },
    }
}

/// The human rendering of a `delegate_task` result.
pub(crate) fn delegate_human(outcome: Option<&DelegateOutcome>) -> String {
    let mut text = match outcome {
        Some(DelegateOutcome::FollowedUp(f)) => format!(
            "follow-up on {} (session {}, delegation {})\n",
            f.child_id, f.child_session_id, f.delegation_id
        ),
        Some(DelegateOutcome::Steered { child_id }) => {
            format!("follow-up on {child_id} (session -, delegation -)\n")
        }
        Some(DelegateOutcome::Completed(u)) => format!("delegation {}\n", u.delegation_id),
        Some(DelegateOutcome::Dispatched(d)) => format!("delegation {}\n", d.delegation_id),
        // An outcome this binary does not know yet, or none.
        Some(_) | None => "delegation -\n".to_owned(),
    };
    let mut t = Table::new(&["TASK", "STATUS", "SUBAGENT", "CHILD SESSION", "TOKENS", "SUMMARY"]);
    for r in outcome.map(DelegateOutcome::results).unwrap_or_default() {
        let summary = r.summary.as_deref().or(r.error.as_deref()).unwrap_or("-");
        t.row(vec![
            r.task_index.to_string(),
            r.status.to_string(),
            r.subagent_id.clone(),
            r.child_session_id.clone(),
            format!("{}/{}", r.tokens.input, r.tokens.output),
            clip(summary, 60),
        ]);
    }
    if !t.is_empty() {
        text.push_str(&t.render());
    }
    for r in outcome.map(DelegateOutcome::results).unwrap_or_default() {
        if let Some(receipts) = &r.receipts {
            text.push_str(&format!("{}: {}\n", r.subagent_id, receipts.line()));
        }
    }
    if let Some(note) = outcome.and_then(DelegateOutcome::note) {
        text.push_str(&format!("note: {note}\n"));
    }
    text
}

/// A [`Delegator`] over `store` with `runtime` and the `delegation:` settings `config`.
pub(crate) fn delegator(
    store: &Backend,
    runtime: Arc<dyn ChildRuntime>,
    config: DelegationConfig,
    profile: &str,
) -> Delegator {
    Delegator::new(DelegatorParts {
        backend: store.seams.clone(),
        authority: Arc::new(Authority::new(store.registry.clone(), store.graph.clone(), profile)),
        runtime,
        completions: None,
        // The orchestrator's policy carries no key: the runtime alone holds it.
        config: (&config).into(),
        profile: profile.to_owned(),
    })
}

/// The real child runtime for the home's `delegation:` settings (with the
/// command's overrides), or a usage error saying which keys to set. Nothing
/// is opened or written before this succeeds.
pub(crate) fn configured_runtime(
    env: &Env,
    args: &DelegateArgs,
) -> Result<(ChatRuntime, DelegationConfig, Arc<Toolbox>)> {
    let loaded = env.config().clone();
    if !loaded.errors.is_empty() {
        // Fail closed: an invalid budget is never "no limit" (no model call).
        return Err(CliError::Usage(format!(
            "refusing to delegate with an invalid configuration: {}",
            loaded.errors.join("; ")
        )));
    }
    let mut config = loaded.delegation;
    if let Some(model) = &args.model {
        config.model.clone_from(model);
    }
    if let Some(url) = &args.base_url {
        config.base_url.clone_from(url);
    }
    let mut runtime_config =
        RuntimeConfig::from_delegation(&config).map_err(|e| CliError::Usage(e.to_string()))?;
    // `--model` overrides every child's model, a follow-up's stored one too.
    runtime_config.model_override = args.model.clone().filter(|m| !m.trim().is_empty());
    if runtime_config.model.trim().is_empty() || runtime_config.base_url.trim().is_empty() {
        return Err(CliError::Usage(format!(
            "no model is configured for children: set delegation.model and delegation.base_url \
             (or delegation.provider: openai, openrouter or ollama) in {}, or pass --model and \
             --base-url; the API key comes from delegation.api_key, delegation.api_key_env or \
             OPENAI_API_KEY",
            env.home.join("config.yaml").display()
        )));
    }
    let toolbox = Arc::new(Toolbox::new(ToolboxConfig {
        terminal: config.terminal.clone(),
        sandbox_helper: crate::env::sandbox_helper(),
        protected: crate::env::protected(env, &loaded.mcp_servers),
        mcp_servers: loaded.mcp_servers,
        approvals: config.approvals.clone(),
    }));
    let tools: Arc<dyn retinue_runtime::ToolExecutor> = toolbox.clone();
    let runtime =
        ChatRuntime::new(runtime_config, tools).map_err(|e| CliError::Usage(e.to_string()))?;
    Ok((runtime, config, toolbox))
}

/// The toolsets a parent run by this process grants its children: the
/// configured ones, and each MCP server's.
pub(crate) fn parent_toolsets(config: &DelegationConfig, toolbox: &Toolbox) -> Vec<String> {
    let mut t = config.toolsets.clone();
    for m in toolbox.mcp_toolsets() {
        if !t.contains(&m) {
            t.push(m);
        }
    }
    t
}

/// Why `dir` (canonical) cannot be a child's workspace: `/`, a system
/// directory, the user's home ([`retinue_tools::workspace::refusal`]), or
/// Retinue's own home.
pub(crate) fn workspace_refusal(dir: &std::path::Path, env: &Env) -> Option<String> {
    let db_dir = (env.pg_url.is_none())
        .then(|| std::path::absolute(&env.db).ok()?.parent()?.canonicalize().ok())
        .flatten();
    retinue_tools::workspace::refusal(dir).or_else(|| {
        let home = std::fs::canonicalize(&env.home).ok();
        (home.as_deref() == Some(dir) || db_dir.as_deref() == Some(dir)).then(|| {
            format!(
                "{} is refused as a workspace: it is Retinue's home or holds its database",
                dir.display()
            )
        })
    })
}

/// The `--workspace` directory (default: the current one), canonical.
fn workspace_of(env: &Env, args: &DelegateArgs) -> Result<std::path::PathBuf> {
    let dir = match &args.workspace {
        Some(d) => d.clone(),
        None => std::env::current_dir().map_err(|e| {
            CliError::Usage(format!(
                "the working directory cannot be read ({e}); pass --workspace DIR"
            ))
        })?,
    };
    let real = std::fs::canonicalize(&dir)
        .map_err(|e| CliError::Usage(format!("--workspace {}: {e}", dir.display())))?;
    if !real.is_dir() {
        return Err(CliError::Usage(format!("--workspace {} is not a directory", dir.display())));
    }
    if let Some(why) = workspace_refusal(&real, env) {
        let given = if args.workspace.is_some() { "" } else { " (the current directory)" };
        return Err(CliError::Usage(format!(
            "--workspace{given}: {why}; pass --workspace DIR naming a project directory"
        )));
    }
    Ok(real)
}

/// A new top-level session (source `cli`) to act as the parent.
fn new_parent(store: &dyn SessionStore, profile: &str) -> Result<String> {
    let id = format!("cli_{}", crate::error::random_hex(6)?);
    store.create_session(&NewSession {
        id: id.clone(),
        source: "cli".to_owned(),
        started_at: Some(SystemClock.now()),
        // The tenant's own: another tenant never sees it.
        profile_name: Some(profile.trim().to_owned()).filter(|p| !p.is_empty()),
        ..NewSession::default()
    })?;
    Ok(id)
}

/// The typed request of `retinue delegate`'s flags (hermes's checks and
/// texts: a follow-up needs a target and a goal; a spawn takes `--tasks`
/// when it lists any, else `--goal`).
fn delegate_request(args: &DelegateArgs) -> std::result::Result<DelegateRequest, DelegateError> {
    if let Some(target) = &args.follow_up {
        return FollowUp::new(target, args.goal.as_deref(), None).map(DelegateRequest::FollowUp);
    }
    let items = match &args.tasks {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => Some(items.as_slice()),
        Some(_) => {
            return Err(DelegateError::InvalidArguments(
                retinue_delegate::texts::TASKS_NOT_ARRAY.to_owned(),
            ));
        }
    };
    let tasks = TaskSpec::list(items, args.goal.as_deref(), None, usize::MAX)?;
    Ok(DelegateRequest::Spawn(SpawnRequest {
        tasks,
        role: retinue_core::Role::Leaf,
        background: args.background,
        budget: retinue_core::BudgetLimit::default(),
        toolsets: args
            .toolsets
            .as_ref()
            .map(|t| t.iter().map(|name| name.trim().to_owned()).collect()),
        isolation: args.isolation.map(|i| match i {
            crate::cli::IsolationArg::Worktree => retinue_core::run::IsolationMode::Worktree,
            crate::cli::IsolationArg::None => retinue_core::run::IsolationMode::None,
        }),
    }))
}

/// `retinue delegate [--parent SESSION] (--goal TEXT | --tasks JSON) [--follow-up ID]
/// [--model M] [--base-url URL]`.
pub(crate) fn delegate(env: &Env, args: &DelegateArgs) -> Result<Output> {
    if args.detached_worker {
        crate::background::become_detached();
    }
    let (runtime, config, toolbox) = configured_runtime(env, args)?;
    let workspace = workspace_of(env, args)?;
    // The arguments are checked before anything is written.
    let request = match delegate_request(args) {
        Ok(r) => r,
        Err(e) => {
            return Ok(Output {
                json: Some(json!({ "error": e.to_string(), "code": delegate_error_kind(&e) })),
                human: String::new(),
                code: delegate_error_code(&e),
                stderr: Some(e.to_string()),
            });
        }
    };
    // An unknown parent would own unreachable children (read-only: nothing created).
    if let Some(p) = &args.parent {
        let p = p.trim();
        let unknown = || {
            CliError::NotFound(format!(
                "no session '{p}': --parent names an existing session (omit it to start a new one)"
            ))
        };
        let known = match Backend::open(env, Arc::new(SystemClock), Access::Read) {
            // Another tenant's session is unknown: no spawn, no billing under it.
            Ok(reader) => reader.scoped().session(p)?.is_some(),
            Err(CliError::NotFound(_)) => false,
            Err(e) => return Err(e),
        };
        if !known {
            return Err(unknown());
        }
    }
    let store = Backend::open(env, Arc::new(SystemClock), Access::WriteOrCreate)?;
    store.keep_alive();
    let (parent_id, created) = match &args.parent {
        Some(p) => (p.trim().to_owned(), false),
        None => (new_parent(&*store.sessions, &env.profile)?, true),
    };
    if args.background && !args.detached_worker {
        // The children run in a detached worker; this process only starts it.
        drop(store);
        return crate::background::launch(env, &parent_id, created);
    }
    let toolsets = parent_toolsets(&config, &toolbox);
    let tool =
        delegator(&store, Arc::new(runtime), config, &env.profile).with_isolation(env.worktrees());
    let parent_row = store.sessions.session(&parent_id)?;
    let parent = ParentContext {
        session_id: Some(parent_id.clone()),
        model: parent_row.as_ref().and_then(|r| r.model.clone()),
        toolsets,
        workspace: Some(workspace),
        can_receive_detached: args.detached_worker,
        // The caller's trace (W3C Trace Context, as `TRACEPARENT`).
        trace_parent: std::env::var("TRACEPARENT").ok().filter(|t| !t.trim().is_empty()),
        ..ParentContext::default()
    };
    if args.detached_worker {
        return Ok(crate::background::work(&tool, &request, &parent));
    }
    // SIGINT/SIGTERM cancel the children: each bills what it spent, the unit
    // is finalised (`interrupted`), and the command exits 130/143.
    let cancel = CancelToken::new();
    let interrupts = crate::interrupt::Interrupts::watch(&cancel);
    let hold = crate::approvals::prompt_inline(env, &tool);
    let status = crate::progress::Status::start(store.seams.clone(), &parent_id, env, hold);
    let outcome = tool.delegate(&request, &parent, &cancel);
    tool.wait_background();
    drop(status);
    if let Some(code) = interrupts.exit_code() {
        let mut out = match &outcome {
            Ok(o) => o.to_json(),
            Err(e) => json!({ "error": e.to_string() }),
        };
        out["interrupted"] = json!(true);
        let human = delegate_human(outcome.as_ref().ok());
        return Ok(Output {
            human,
            json: Some(out),
            code,
            stderr: Some("interrupted: the children were stopped and the unit recorded".to_owned()),
        });
    }
    Ok(match outcome {
        Ok(outcome) => {
            let mut out = outcome.to_json();
            let mut human = delegate_human(Some(&outcome));
            if created {
                out["parent_session_id"] = json!(parent_id);
                human = format!(
                    "parent session {parent_id} (new; follow up later with --parent {parent_id})\n{human}"
                );
            }
            let results = outcome.results();
            let all_failed = !results.is_empty()
                && results.iter().all(|r| r.status != retinue_core::ChildStatus::Completed);
            match outcome.ledger_error() {
                // The spend is kept in the budget; the command still fails.
                Some(e) => {
                    Output { human, json: Some(out), code: EXIT_FAILED, stderr: Some(e.to_owned()) }
                }
                // Every child failed: the results are printed, the command fails.
                None if all_failed => Output {
                    human,
                    json: Some(out),
                    code: EXIT_FAILED,
                    stderr: Some(format!(
                        "every child failed ({} of {})",
                        results.len(),
                        results.len()
                    )),
                },
                None => Output { human, json: Some(out), code: EXIT_OK, stderr: None },
            }
        }
        Err(e) => Output {
            json: Some(json!({ "error": e.to_string(), "code": delegate_error_kind(&e) })),
            human: String::new(),
            code: delegate_error_code(&e),
            stderr: Some(e.to_string()),
        },
    })
}
