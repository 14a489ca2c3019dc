#!/usr/bin/env python3
"""Drive the published hermes-agent against a state.db that Retinue shares.

Run by ``cargo xtask interop`` with the unpacked hermes-agent wheel on
PYTHONPATH (standard library only; the xtask runs ``python3 -S``).

Phases:

``write DB``
    Uses hermes' own ``hermes_state.SessionDB`` and ``tools.async_delegation``
    to write a realistic state.db (DB must be ``<HERMES_HOME>/state.db``, as
    hermes' delegation module derives the path from HERMES_HOME):

    * ``root``: a CLI session with tool calls and multimodal content, titled;
      then rotated by compression (ended ``compression``) into
    * ``c1``: its continuation, which dispatches a background batch
      (``u1``: children ``k1``, ``k2``, source ``subagent``, marker
      ``_delegate_from``) whose completion is delivered; then rotated into
    * ``c2``: the live tip, which dispatches a single background child
      (``u2``: ``k3``, source ``cli`` + marker, as under HERMES_SESSION_SOURCE)
      whose completion stays pending;
    * ``branch``: a /branch of ``c1`` (marker ``_branched_from``);
    * ``stranger``: an unrelated CLI session.

    Releases before 0.19 keep background delegations in memory only: the
    children then run and persist the same way, with no ``u1``/``u2`` rows;
    lineage queries a release lacks are recorded as null.

    Next to the DB it writes ``hermes-expect.json``: hermes version, ids,
    hermes' own lineage answers (``get_compression_tip``,
    ``get_compression_lineage``, ``get_conversation_root``,
    ``_is_compression_ancestor``), transcripts and per-table row counts.

``verify DB``
    Reopens the DB with hermes after Retinue has used it, reads
    ``retinue-report.json`` (written by the Rust interop tests) and checks that
    hermes still reads every session and every transcript (hermes rows
    unchanged, Retinue's appended turns after them, in order, found by hermes'
    FTS search), that its lineage answers are unchanged, and that its own
    queries on ``async_delegations`` still work, including on the unit and
    child Retinue created (0.19+). Then hermes adopts the database Retinue
    created from scratch (``retinue-fresh.json``).

Exit status 0 when every check passes; otherwise every failed check is
printed and the status is 1.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import sqlite3
import sys
import time
import types
import uuid
from datetime import datetime
from pathlib import Path

EXPECT_FILE = "hermes-expect.json"
REPORT_FILE = "retinue-report.json"
FRESH_REPORT_FILE = "retinue-fresh.json"

MODEL = "anthropic/claude-sonnet-4"
CHILD_MODEL = "anthropic/claude-haiku-4"
INIT_CONFIG = {"max_iterations": 90, "reasoning_config": None, "max_tokens": None}
CHILD_CONFIG = {"max_iterations": 50, "reasoning_config": None, "max_tokens": None}
SYSTEM_PROMPT = "You are Hermes, a helpful agent working in /work/project."
CHILD_PROMPT = (
    "You are a focused subagent. Complete the delegated task and reply with a "
    "concise summary for the parent agent."
)


class Checks:
    """Collects failed checks instead of stopping at the first."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0

    def check(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
        else:
            self.failures.append(what)
            print(f"FAIL: {what}", file=sys.stderr)
        return ok

    def equal(self, got, want, what: str) -> bool:
        return self.check(got == want, f"{what}: got {got!r}, want {want!r}")

    def finish(self, phase: str) -> int:
        if self.failures:
            print(
                f"hermes driver {phase}: {len(self.failures)} check(s) failed, "
                f"{self.passed} passed",
                file=sys.stderr,
            )
            return 1
        print(f"hermes driver {phase}: {self.passed} checks passed")
        return 0


def load_hermes(home: Path):
    """Imports hermes with HERMES_HOME=home.

    ``tools.process_registry`` (the in-memory completion queue) needs PyYAML;
    the driver stays standard-library only by providing the queue itself.
    Everything that touches the database is hermes' own code.
    """
    os.environ["HERMES_HOME"] = str(home)
    completions: "queue.Queue[dict]" = queue.Queue()
    shim = types.ModuleType("tools.process_registry")
    shim.process_registry = types.SimpleNamespace(completion_queue=completions)
    import tools  # noqa: F401  (the package must exist before the shim)

    sys.modules["tools.process_registry"] = shim
    import hermes_state

    try:
        from tools import async_delegation
    except ImportError:  # before 0.17 there is no background delegation module
        async_delegation = None
    return hermes_state, async_delegation, completions


def hermes_version() -> str:
    """The version of the hermes-agent on PYTHONPATH (from its dist-info)."""
    try:
        from importlib import metadata

        return metadata.version("hermes-agent")
    except Exception:  # noqa: BLE001 - fall back to the directory name
        for entry in sys.path:
            for info in Path(entry or ".").glob("hermes_agent-*.dist-info"):
                return info.name[len("hermes_agent-") : -len(".dist-info")]
    return "unknown"


def new_session_id() -> str:
    """A session id the way hermes mints them."""
    time.sleep(0.002)
    return f"{datetime.now().strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}"


def table_counts(db_path: Path) -> dict[str, int]:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        names = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type='table' "
                "AND name NOT LIKE 'sqlite_%' ORDER BY name"
            )
        ]
        return {n: conn.execute(f'SELECT COUNT(*) FROM "{n}"').fetchone()[0] for n in names}
    finally:
        conn.close()


def has_durable_delegations(ad) -> bool:
    """hermes 0.19 persists background delegations in ``async_delegations``;
    earlier releases keep them in memory only (and create no such table)."""
    return ad is not None and hasattr(ad, "get_durable_delegation")


def create_session(db, sid: str, source: str, **kwargs) -> None:
    """``SessionDB.create_session`` with the keyword arguments this release knows."""
    accepted = inspect.signature(db._insert_session_row).parameters  # noqa: SLF001
    db.create_session(sid, source, **{k: v for k, v in kwargs.items() if k in accepted})


def optional(db, method: str, *args, **kwargs):
    """``db.method(...)``, or None on releases without it."""
    fn = getattr(db, method, None)
    return fn(*args, **kwargs) if fn is not None else None


def wait_terminal(ad, delegation_id: str, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        row = ad.get_durable_delegation(delegation_id)
        if row and row["state"] not in ("running", "finalizing"):
            # The worker persists before it publishes; let it finish publishing.
            time.sleep(0.05)
            return row
        time.sleep(0.02)
    raise SystemExit(f"delegation {delegation_id} did not finish within {timeout}s")


def child_transcript(db, sid: str, goal: str, tag: str) -> None:
    """A delegate child's run: goal, a tool call and its result, the summary."""
    db.append_message(sid, "user", goal)
    db.append_message(
        sid,
        "assistant",
        None,
        tool_calls=[
            {
                "id": f"call_{tag}",
                "type": "function",
                "function": {"name": "search_files", "arguments": json.dumps({"query": tag})},
            }
        ],
        finish_reason="tool_calls",
    )
    db.append_message(
        sid, "tool", f"3 matches for {tag}", tool_name="search_files", tool_call_id=f"call_{tag}"
    )
    db.append_message(
        sid, "assistant", f"Summary for {tag}: all three call sites updated.", finish_reason="stop"
    )


def run_child(db, parent: str, source: str, goal: str, tag: str, index: int) -> dict:
    """What ``delegate_tool`` does for one child, minus the model."""
    sid = new_session_id()
    cfg = dict(CHILD_CONFIG)
    cfg["_delegate_from"] = parent
    create_session(
        db,
        sid,
        source,
        model=CHILD_MODEL,
        model_config=cfg,
        system_prompt=CHILD_PROMPT,
        parent_session_id=parent,
        cwd="/work/project",
    )
    child_transcript(db, sid, goal, tag)
    db.end_session(sid, "agent_close")
    return {
        "task_index": index,
        "status": "completed",
        "summary": f"Summary for {tag}: all three call sites updated.",
        "api_calls": 2,
        "duration_seconds": 0.4,
        "model": CHILD_MODEL,
        "exit_reason": "completed",
        "tokens": {"input": 1200, "output": 90},
        # Not part of hermes' result; the driver keeps it for the expectations.
        "_session_id": sid,
        "_subagent_id": f"sa-{index}-{uuid.uuid4().hex[:8]}",
        "_goal": goal,
    }


def public(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


def messages_of(db, sid: str) -> list[dict]:
    """hermes' transcript (structured content decoded, as get_messages returns it)."""
    return [
        {"id": m["id"], "role": m["role"], "content": m["content"]} for m in db.get_messages(sid)
    ]


def lineage_facts(db, ids: dict[str, str]) -> dict:
    """hermes' own lineage answers per session; None where a release lacks the query."""
    ancestors = None
    if hasattr(db, "_is_compression_ancestor"):
        with db._lock:  # noqa: SLF001 - hermes' own ancestry query needs its connection
            conn = db._conn  # noqa: SLF001
            ancestors = {
                name: sorted(
                    other
                    for other in ids
                    if other != name
                    and db._is_compression_ancestor(  # noqa: SLF001
                        conn, ancestor_id=ids[other], descendant_id=sid
                    )
                )
                for name, sid in ids.items()
            }
    return {
        name: {
            "compression_tip": optional(db, "get_compression_tip", sid),
            "compression_lineage": optional(db, "get_compression_lineage", sid),
            "conversation_root": optional(db, "get_conversation_root", sid),
            "compression_ancestors": ancestors[name] if ancestors is not None else None,
        }
        for name, sid in ids.items()
    }


def phase_write(db_path: Path) -> int:
    home = db_path.parent
    home.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
    hermes_state, ad, completions = load_hermes(home)
    db = hermes_state.SessionDB(db_path)
    ids: dict[str, str] = {}

    # The root conversation, with a tool call and multimodal content.
    root = ids["root"] = new_session_id()
    create_session(
        db,
        root,
        "cli",
        model=MODEL,
        model_config=INIT_CONFIG,
        system_prompt=SYSTEM_PROMPT,
        cwd="/work/project",
    )
    db.set_session_title(root, "Q3 migration")
    db.append_message(root, "user", "Plan the Q3 database migration.")
    db.append_message(
        root,
        "assistant",
        "Let me read the current plan.",
        tool_calls=[
            {
                "id": "call_plan",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "plan.md"}'},
            }
        ],
        finish_reason="tool_calls",
    )
    db.append_message(
        root, "tool", "# Plan\n1. freeze schema", tool_name="read_file", tool_call_id="call_plan"
    )
    db.append_message(
        root,
        "user",
        [
            {"type": "text", "text": "Also consider this diagram."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ],
    )
    db.append_message(root, "assistant", "Noted: the diagram shows two shards.", finish_reason="stop")

    # Compression rotation, as agent/conversation_compression.py does it.
    title = db.get_session_title(root)
    db.end_session(root, "compression")
    c1 = ids["c1"] = new_session_id()
    create_session(db, c1, "cli", model=MODEL, model_config=INIT_CONFIG, parent_session_id=root)
    db.set_session_title(c1, db.get_next_title_in_lineage(title))
    db.append_message(c1, "user", "[CONTEXT COMPACTION] Earlier: planned the Q3 migration.")
    db.append_message(c1, "assistant", "Continuing: I will delegate the call-site audit.")

    # A background batch from c1 through hermes' own durable registry.
    u1_children: list[dict] = []

    def u1_runner() -> dict:
        for i, (goal, tag) in enumerate(
            [("Audit call sites of db.connect", "connect"), ("Audit call sites of db.close", "close")]
        ):
            u1_children.append(run_child(db, c1, "subagent", goal, tag, i))
        return {
            "results": [public(r) for r in u1_children],
            "total_duration_seconds": 0.8,
        }

    durable = has_durable_delegations(ad)
    units: dict[str, tuple[str, str, list[dict]]] = {}
    if durable:
        handle = ad.dispatch_async_delegation_batch(
            goals=["Audit call sites of db.connect", "Audit call sites of db.close"],
            context="Repository at /work/project",
            toolsets=["terminal", "file"],
            role="leaf",
            model=CHILD_MODEL,
            session_key="",
            parent_session_id=c1,
            runner=u1_runner,
        )
        if handle.get("status") != "dispatched":
            raise SystemExit(f"hermes refused the batch: {handle}")
        u1 = handle["delegation_id"]
        wait_terminal(ad, u1)
        # Deliver it the way the CLI drain does: claim, inject, complete.
        evt = completions.get(timeout=10)
        claim = ad.claim_event_delivery(evt, "cli")
        if not claim:
            raise SystemExit(f"could not claim delivery of {u1}")
        ad.complete_event_delivery(evt, claim)
        units["u1"] = (u1, c1, u1_children)
    else:
        # No durable registry in this release: the children still run and
        # persist their sessions exactly as delegate_tool makes them.
        u1_runner()
    db.append_message(c1, "user", "[Background delegation completed] 2 subagents finished.")
    db.append_message(c1, "assistant", "Both audits are done.")

    # A /branch of c1 (its end_session is a no-op: first reason wins).
    branch = ids["branch"] = new_session_id()
    db.end_session(c1, "compression")
    db.end_session(c1, "branched")
    branch_cfg = dict(INIT_CONFIG)
    branch_cfg["_branched_from"] = c1
    create_session(
        db,
        branch, "cli", model=MODEL, model_config=branch_cfg, parent_session_id=c1
    )
    for m in db.get_messages(c1):
        db.append_message(branch, m["role"], m["content"], tool_name=m.get("tool_name"))
    db.set_session_title(branch, "Q3 migration (branch)")
    db.append_message(branch, "user", "What if we skip the freeze?")

    # The second rotation: c2 is the live tip.
    c2 = ids["c2"] = new_session_id()
    create_session(db, c2, "cli", model=MODEL, model_config=INIT_CONFIG, parent_session_id=c1)
    db.set_session_title(c2, db.get_next_title_in_lineage(title))
    db.append_message(c2, "user", "[CONTEXT COMPACTION] Earlier: audits done.")
    db.append_message(c2, "assistant", "Next I will check the rollback script.")

    # A single background child from c2; its completion stays pending.
    u2_children: list[dict] = []

    def u2_runner() -> dict:
        u2_children.append(
            run_child(db, c2, "cli", "Review the rollback script", "rollback", 0)
        )
        return public(u2_children[0])

    if durable:
        handle = ad.dispatch_async_delegation(
            goal="Review the rollback script",
            context=None,
            toolsets=["file"],
            role="leaf",
            model=CHILD_MODEL,
            session_key="",
            parent_session_id=c2,
            runner=u2_runner,
        )
        if handle.get("status") != "dispatched":
            raise SystemExit(f"hermes refused the dispatch: {handle}")
        u2 = handle["delegation_id"]
        wait_terminal(ad, u2)
        units["u2"] = (u2, c2, u2_children)
    else:
        u2_runner()

    # An unrelated conversation.
    stranger = ids["stranger"] = new_session_id()
    create_session(db, stranger, "cli", model=MODEL, model_config=INIT_CONFIG)
    db.append_message(stranger, "user", "Unrelated question.")
    db.append_message(stranger, "assistant", "Unrelated answer.")
    db.end_session(stranger, "cli_close")

    for name, child in (("k1", u1_children[0]), ("k2", u1_children[1]), ("k3", u2_children[0])):
        ids[name] = child["_session_id"]

    def unit(delegation_id: str, parent: str, children: list[dict]) -> dict:
        row = ad.get_durable_delegation(delegation_id)
        return {
            "delegation_id": delegation_id,
            "parent_session_id": parent,
            "state": row["state"],
            "delivery_state": row["delivery_state"],
            "children": [
                {
                    "subagent_id": c["_subagent_id"],
                    "session_id": c["_session_id"],
                    "goal": c["_goal"],
                    "model": CHILD_MODEL,
                }
                for c in children
            ],
        }

    expect = {
        "hermes_version": hermes_version(),
        "schema_version": hermes_state.SCHEMA_VERSION,
        "sqlite_version": sqlite3.sqlite_version,
        "sessions": ids,
        "units": {name: unit(*u) for name, u in units.items()},
        "lineage": lineage_facts(db, ids),
        "transcripts": {name: messages_of(db, sid) for name, sid in ids.items()},
        "message_counts": {name: db.get_session(sid)["message_count"] for name, sid in ids.items()},
    }
    db.close()
    expect["row_counts"] = table_counts(db_path)
    (home / EXPECT_FILE).write_text(json.dumps(expect, indent=2, ensure_ascii=False) + "\n")
    print(
        f"hermes {expect['hermes_version']} wrote {db_path}: "
        f"{len(ids)} sessions, units {sorted(u[0] for u in units.values()) or 'none'}, "
        f"{expect['row_counts'].get('messages', 0)} messages"
    )
    return 0


def verify_sessiondb_reads(ck: Checks, db, expect: dict, report: dict) -> None:
    ids = expect["sessions"]
    appended = {r["session_id"]: r for r in report.get("appended", [])}
    for name, sid in ids.items():
        row = db.get_session(sid)
        if not ck.check(row is not None, f"hermes lost session {name} ({sid})"):
            continue
        now = messages_of(db, sid)
        before = expect["transcripts"][name]
        ck.equal(now[: len(before)], before, f"hermes rows of {name} after Retinue")
        extra = appended.get(sid)
        if extra is None:
            ck.equal(len(now), len(before), f"message count of untouched {name}")
            continue
        tail = [(m["role"], m["content"]) for m in now[len(before) :]]
        want = [(m["role"], m["content"]) for m in extra["messages"]]
        ck.equal(tail, want, f"turns Retinue appended to {name}, in order")
        ids_now = [m["id"] for m in now]
        ck.check(ids_now == sorted(ids_now), f"{name}: ids not increasing: {ids_now}")
        ck.equal(row["message_count"], len(now), f"{name}: sessions.message_count")
        ck.equal(row["end_reason"], extra.get("end_reason"), f"{name}: end_reason after follow-up")
        # hermes' FTS triggers indexed Retinue's inserts.
        token = extra.get("search_token")
        if token:
            hits = db.search_messages(token)
            ck.check(
                any(h.get("session_id") == sid for h in hits),
                f"hermes search for {token!r} does not find {name}'s appended turn: {hits!r}",
            )
    # Lineage answers are unchanged by Retinue's writes.
    now = lineage_facts(db, ids)
    for name in ids:
        ck.equal(now[name], expect["lineage"][name], f"hermes lineage facts of {name}")
    # Sessions Retinue created (children of its own units) read back in hermes.
    for created in report.get("created_sessions", []):
        sid = created["session_id"]
        row = db.get_session(sid)
        if not ck.check(row is not None, f"hermes cannot read Retinue session {sid}"):
            continue
        msgs = db.get_messages(sid)
        ck.equal(
            [(m["role"], m["content"]) for m in msgs],
            [(m["role"], m["content"]) for m in created["messages"]],
            f"transcript of Retinue session {sid}",
        )
        ck.equal(row["parent_session_id"], created.get("parent_session_id"), f"{sid}: parent")
        tip = optional(db, "get_compression_tip", sid)
        ck.check(tip in (None, sid), f"{sid}: hermes continues Retinue's child to {tip}")


def verify_delegations(ck: Checks, ad, db_path: Path, expect: dict, report: dict) -> None:
    before = {r[0] for r in sqlite3.connect(db_path).execute("SELECT delegation_id FROM async_delegations")}
    units = dict(expect["units"])
    for unit in report.get("units", []):
        units[unit["delegation_id"]] = unit
    for name, unit in units.items():
        row = ad.get_durable_delegation(unit["delegation_id"])
        if not ck.check(row is not None, f"hermes lost delegation {name}"):
            continue
        want_state = report.get("unit_states", {}).get(unit["delegation_id"], unit.get("state"))
        ck.equal(row["state"], want_state, f"{name}: state")
        want_delivery = report.get("unit_delivery", {}).get(
            unit["delegation_id"], unit.get("delivery_state")
        )
        ck.equal(row["delivery_state"], want_delivery, f"{name}: delivery_state")
        ck.check(isinstance(row["result"], (dict, type(None))), f"{name}: result_json unreadable")
    # hermes' restart path and its pruner run on the upgraded table.
    restored: "queue.Queue[dict]" = queue.Queue()
    n = ad.restore_undelivered_completions(restored)
    want_pending = sorted(
        u["delegation_id"]
        for u in units.values()
        if report.get("unit_delivery", {}).get(u["delegation_id"], u.get("delivery_state"))
        == "pending"
    )
    known = {u["delegation_id"] for u in units.values()}
    got = sorted(
        d for d in (restored.get_nowait()["delegation_id"] for _ in range(n)) if d in known
    )
    ck.equal(got, want_pending, "hermes restore_undelivered_completions")
    ad._prune_durable_records()  # noqa: SLF001 - hermes' own history pruner
    after = {r[0] for r in sqlite3.connect(db_path).execute("SELECT delegation_id FROM async_delegations")}
    ck.equal(after, before, "hermes' pruner kept every unit (few terminal rows)")
    # A fresh hermes dispatch still works on the table Retinue upgraded.
    handle = ad.dispatch_async_delegation(
        goal="post-interop smoke",
        context=None,
        toolsets=None,
        role="leaf",
        model=None,
        session_key="",
        parent_session_id=expect["sessions"]["c2"],
        runner=lambda: {"status": "completed", "summary": "ok", "api_calls": 0},
    )
    if ck.equal(handle.get("status"), "dispatched", "hermes dispatch after Retinue"):
        row = wait_terminal(ad, handle["delegation_id"])
        ck.equal(row["state"], "completed", "hermes post-interop unit state")


def verify_integrity(ck: Checks, db_path: Path, expect: dict) -> None:
    conn = sqlite3.connect(db_path)
    try:
        ck.equal(conn.execute("PRAGMA integrity_check").fetchone()[0], "ok", "integrity_check")
        ck.equal(
            conn.execute("SELECT version FROM schema_version").fetchone()[0],
            expect["schema_version"],
            "hermes schema_version",
        )
        fts = conn.execute("SELECT COUNT(*) FROM messages_fts").fetchone()[0]
        msgs = conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        ck.equal(fts, msgs, "messages_fts rows = messages rows")
    finally:
        conn.close()


def verify_tool_turns(ck: Checks, db, s: dict) -> None:
    """hermes reads a Retinue child's transcript with tool turns as it writes
    its own: the assistant row carries `tool_calls`, each result is a `tool`
    row with `tool_call_id` and `tool_name`, right after its call, and the
    conversation hermes would replay keeps that adjacency."""
    sid = s["session_id"]
    want = [m for m in s["messages"]]
    msgs = db.get_messages(sid)
    ck.equal(
        [(m["role"], m["content"], m.get("tool_call_id"), m.get("tool_name")) for m in msgs],
        [(m["role"], m["content"], m["tool_call_id"], m["tool_name"]) for m in want],
        f"tool turns: rows of {sid}",
    )
    conv = db.get_messages_as_conversation(sid)
    calls = [m for m in conv if m.get("tool_calls")]
    if not ck.check(len(calls) == 1, f"tool turns: one assistant row with tool_calls in {sid}"):
        return
    at = conv.index(calls[0])
    call = calls[0]["tool_calls"][0]
    want_call = next(m for m in want if m["tool_calls"])["tool_calls"][0]
    ck.equal(call["id"], want_call["id"], "tool turns: call id")
    ck.equal(call["function"]["name"], "read_file", "tool turns: tool name")
    ck.equal(call["function"]["arguments"], want_call["function"]["arguments"], "tool turns: arguments")
    nxt = conv[at + 1] if at + 1 < len(conv) else {}
    ck.equal(nxt.get("role"), "tool", "tool turns: the result follows its call")
    ck.equal(nxt.get("tool_call_id"), call["id"], "tool turns: result tool_call_id")
    ck.equal(nxt.get("tool_name"), "read_file", "tool turns: result tool_name")
    ck.check("wombat count: 42" in (nxt.get("content") or ""), "tool turns: result content")


def verify_fresh(ck: Checks, hermes_state, ad, fresh: dict) -> None:
    """hermes adopts a database Retinue created from scratch."""
    path = Path(fresh["db"])
    os.environ["HERMES_HOME"] = str(path.parent)
    db = hermes_state.SessionDB(path)
    try:
        for s in fresh["sessions"]:
            row = db.get_session(s["session_id"])
            if not ck.check(row is not None, f"fresh db: hermes cannot read {s['session_id']}"):
                continue
            msgs = db.get_messages(s["session_id"])
            ck.equal(
                [(m["role"], m["content"]) for m in msgs],
                [(m["role"], m["content"]) for m in s["messages"]],
                f"fresh db: transcript of {s['session_id']}",
            )
        for s in fresh.get("tool_sessions", []):
            verify_tool_turns(ck, db, s)
        for sid, tip in fresh.get("compression_tips", {}).items():
            got = optional(db, "get_compression_tip", sid)
            ck.check(got in (None, tip), f"fresh db: compression tip of {sid}: {got}, want {tip}")
        # hermes (0.16+) builds its FTS index over Retinue's rows when it adopts
        # the file; older releases index only messages written after that.
        token = fresh.get("search_token")
        if token and hasattr(db, "_rebuild_fts_indexes"):
            ck.check(bool(db.search_messages(token)), f"fresh db: hermes search for {token!r}")
        elif token:
            print("note: this hermes does not index messages written before it adopted a file")
    finally:
        db.close()
    if not has_durable_delegations(ad):
        return
    for unit in fresh.get("units", []):
        row = ad.get_durable_delegation(unit["delegation_id"])
        if ck.check(row is not None, f"fresh db: hermes cannot read unit {unit['delegation_id']}"):
            ck.equal(row["state"], unit["state"], "fresh db: unit state")


def phase_verify(db_path: Path) -> int:
    home = db_path.parent
    expect = json.loads((home / EXPECT_FILE).read_text())
    report_path = home / REPORT_FILE
    ck = Checks()
    if not ck.check(report_path.exists(), f"{report_path} missing: did the Rust side run?"):
        return ck.finish("verify")
    report = json.loads(report_path.read_text())
    hermes_state, ad, _ = load_hermes(home)
    # hermes opens the file Retinue has upgraded and written: full schema init.
    db = hermes_state.SessionDB(db_path)
    try:
        verify_sessiondb_reads(ck, db, expect, report)
    finally:
        db.close()
    if "read_only" in inspect.signature(hermes_state.SessionDB).parameters:
        ro = hermes_state.SessionDB(db_path, read_only=True)
        try:
            ck.check(
                ro.get_session(expect["sessions"]["k1"]) is not None,
                "read-only SessionDB reads k1",
            )
        finally:
            ro.close()
    if has_durable_delegations(ad):
        verify_delegations(ck, ad, db_path, expect, report)
    else:
        print(f"note: hermes {expect['hermes_version']} keeps no durable delegations")
    verify_integrity(ck, db_path, expect)
    fresh_path = home / FRESH_REPORT_FILE
    if ck.check(fresh_path.exists(), f"{fresh_path} missing: did the Rust side run?"):
        verify_fresh(ck, hermes_state, ad, json.loads(fresh_path.read_text()))
        os.environ["HERMES_HOME"] = str(home)
    return ck.finish("verify")


def phase_early_write(db_path: Path) -> int:
    """hermes's ``async_delegation`` module on a home without any
    ``SessionDB``: it creates ``async_delegations`` alone (issue #22)."""
    home = db_path.parent
    home.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
    _, ad, _ = load_hermes(home)
    ck = Checks()
    if ad is None or not hasattr(ad, "_persist_dispatch"):
        print("hermes driver early-write: this release has no durable delegations; skipped")
        return 0
    ad._persist_dispatch(  # noqa: SLF001 - hermes's own write path
        {"delegation_id": "deleg_early0001", "session_key": "early-parent",
         "dispatched_at": time.time(), "goal": "written before any SessionDB"}
    )
    tables = set(table_counts(db_path))
    ck.check("sessions" not in tables, "no sessions table yet")
    ck.check("async_delegations" in tables, "hermes created async_delegations")
    return ck.finish("early-write")


def phase_early_verify(db_path: Path) -> int:
    """hermes still reads and writes the file after Retinue adopted it."""
    _, ad, _ = load_hermes(db_path.parent)
    ck = Checks()
    if ad is None or not hasattr(ad, "_persist_dispatch"):
        return 0
    row = ad.get_durable_delegation("deleg_early0001")
    ck.check(row is not None and row["origin_session"] == "early-parent", "hermes reads its unit")
    ad._persist_dispatch(  # noqa: SLF001
        {"delegation_id": "deleg_early0002", "session_key": "early-parent",
         "dispatched_at": time.time(), "goal": "after the adoption"}
    )
    ck.check(ad.get_durable_delegation("deleg_early0002") is not None, "hermes writes another")
    ck.check("sessions" in table_counts(db_path), "Retinue added the sessions table")
    return ck.finish("early-verify")


def main(argv: list[str]) -> int:
    phases = ("write", "verify", "early-write", "early-verify")
    if len(argv) != 3 or argv[1] not in phases:
        print(f"usage: {argv[0]} {'|'.join(phases)} <HERMES_HOME>/state.db", file=sys.stderr)
        return 2
    db_path = Path(argv[2]).resolve()
    if db_path.name != "state.db":
        print("the database must be named state.db (hermes derives it from HERMES_HOME)", file=sys.stderr)
        return 2
    if argv[1] == "write":
        return phase_write(db_path)
    if argv[1] == "early-write":
        return phase_early_write(db_path)
    if argv[1] == "early-verify":
        return phase_early_verify(db_path)
    return phase_verify(db_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
