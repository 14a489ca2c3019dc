"""End-to-end test of `retinue mcp` with an independent client: the official
Python MCP SDK (`mcp` from PyPI) spawns the server over stdio and runs the
story: tools, delegate (with progress), follow up, list, show, usage, a
restarted server in the same project following up yesterday's child,
another project denied, tombstone. Prints a transcript; exits non-zero on
the first failed check.

Then the children's tools: in project C a child reads and writes files in
its workspace and calls a tool of an MCP server written on the same SDK
(`echo_server.py`, configured under `mcp_servers:`).

Then approvals (#37): a child calls the echo server's `wipe` (annotated
destructiveHint), and its call waits for the host's user: a host with the
elicitation capability is asked with a form (accepted, then declined); a
host without it reads `approval_required` and answers with
`decide_approval` while its `delegate_task` call still runs.

Usage: python mcp_e2e.py RETINUE_BIN HOME PROJECT_A PROJECT_B PROJECT_C
(`cargo xtask mcp-e2e` sets everything up: venv, fake model, home.)
"""

import asyncio
import json
import sys

from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client

RETINUE, HOME, PROJECT_A, PROJECT_B, PROJECT_C = sys.argv[1:6]


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", flush=True)
        sys.exit(1)


def say(text=""):
    print(text, flush=True)


def payload(result):
    """The tool result's JSON (structured content, else the text)."""
    if result.structured_content is not None:
        return result.structured_content
    return json.loads(result.content[0].text)


def text(result):
    return result.content[0].text


async def call(session, tool, args, **kw):
    say(f"> {tool} {json.dumps(args)}")
    result = await session.call_tool(tool, args, **kw)
    if result.is_error:
        say(f"< error: {text(result)}")
    else:
        body = json.dumps(payload(result), indent=2)
        lines = body.splitlines()
        if len(lines) > 40:
            lines = lines[:40] + ["  …"]
        say("< " + "\n  ".join(lines))
    return result


async def server(cwd, story, **session_options):
    params = StdioServerParameters(
        command=RETINUE, args=["--home", HOME, "mcp"], cwd=cwd, env={"RETINUE_LOG": "warn"}
    )
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write, **session_options) as session:
            init = await session.initialize()
            return await story(session, init)


async def day_one(session, init):
    say(f"# server: {init.server_info.name} {init.server_info.version}")
    say(f"# instructions: {init.instructions}")
    check("mcp_" in init.instructions, "the instructions name the session")
    tools = await session.list_tools()
    names = [t.name for t in tools.tools]
    say(f"# tools: {', '.join(names)}")
    check(
        names
        == [
            "delegate_task",
            "list_subagents",
            "show_subagent",
            "tombstone_subagent",
            "subagent_usage",
            "wait_subagents",
            "steer_subagent",
            "cancel_subagent",
            "list_approvals",
            "decide_approval",
            "subagent_changes",
            "apply_changes",
            "discard_changes",
        ],
        "thirteen tools",
    )
    check("follow_up" in tools.tools[0].input_schema["properties"], "delegate_task schema")

    progress = []

    async def on_progress(value, total, message):
        progress.append(message)

    r = await call(
        session, "delegate_task", {"goal": "Survey the storage layer"}, progress_callback=on_progress
    )
    check(not r.is_error, "delegate_task succeeds")
    out = payload(r)
    child = out["results"][0]["subagent_id"]
    check(out["results"][0]["status"] == "completed", "the child completed")
    check(out["results"][0]["summary"] == "Done: Survey the storage layer", "its summary")
    check(
        len(r.content) == 2 and r.content[1].text == "receipts: no tool calls",
        "the receipts line is the result's second text block",
    )
    r = await call(session, "subagent_changes", {"pending": True})
    check(not r.is_error and payload(r)["changes"] == [], "no change sets (not isolated)")
    say(f"# progress notifications: {progress}")

    r = await call(session, "delegate_task", {"follow_up": child, "goal": "Which index answers a lookup?"})
    check(payload(r)["results"][0]["summary"] == "Done: Which index answers a lookup?", "follow-up")

    r = await call(session, "list_subagents", {})
    check([e["subagent_id"] for e in payload(r)["subagents"]] == [child], "listed")

    r = await call(session, "show_subagent", {"id": child})
    shown = payload(r)
    check(shown["retained"] is True, "retained")
    check(shown["last_answer"] == "Done: Which index answers a lookup?", "last answer")
    check(shown["usage"]["runs"] == 2, "two runs")

    r = await call(session, "subagent_usage", {})
    check(abs(payload(r)["totals"]["cost_usd"] - 0.008) < 1e-9, "lineage cost")
    return init.instructions, child


async def main():
    say("## Day 1, project A")
    instructions, child = await server(PROJECT_A, day_one)

    say()
    say("## Day 2, project A: a new server, the same session")

    async def day_two(session, init):
        check(init.instructions == instructions, "the same session as yesterday")
        r = await call(session, "delegate_task", {"follow_up": child, "goal": "And the busy timeout?"})
        check(not r.is_error, "yesterday's child answers")
        check(payload(r)["results"][0]["summary"] == "Done: And the busy timeout?", "its answer")
        r = await call(session, "delegate_task", {"tasks": [{"goal": "Draft the notes"}, {"goal": "List the changes"}]})
        gone = payload(r)["results"][0]["subagent_id"]
        r = await call(session, "tombstone_subagent", {"id": gone, "reason": "superseded"})
        check(payload(r)["tombstoned"] is True, "tombstoned")
        check(payload(r)["tombstone_note"] == "superseded", "the why is kept as a note")
        r = await call(session, "delegate_task", {"follow_up": gone, "goal": "more"})
        check(r.is_error and "was tombstoned" in text(r), "a tombstoned child refuses follow-ups")
        r = await call(session, "show_subagent", {"id": gone})
        check(payload(r)["tombstoned"]["reason"] == "manual", "show says it was a manual tombstone")

    await server(PROJECT_A, day_two)

    say()
    say("## Project B: another session, foreign ≡ missing")

    async def other_project(session, init):
        check(init.instructions != instructions, "another session")
        r = await call(session, "delegate_task", {"follow_up": child, "goal": "hi"})
        check(r.is_error and "is not a running subagent" in text(r), "denied")
        r2 = await call(session, "show_subagent", {"id": "sa-0-00000000"})
        check(text(r2) == text(r).replace(child, "sa-0-00000000"), "foreign reads like missing")
        r = await call(session, "list_subagents", {})
        check(payload(r)["subagents"] == [], "nothing listed")

    await server(PROJECT_B, other_project)

    say()
    say("## Project C: the children's tools")

    async def tools_story(session, init):
        with open(f"{PROJECT_C}/notes.txt", "w") as f:
            f.write("the busy timeout is ten seconds\n")
        tools = await session.list_tools()
        schema = tools.tools[0].input_schema["properties"]
        check("toolsets" in schema, "delegate_task takes toolsets")
        r = await call(
            session,
            "delegate_task",
            {"goal": 'Read the notes [tool read_file {"path": "notes.txt"}]'},
        )
        res = payload(r)["results"][0]
        check(res["status"] == "completed", "the reading child completed")
        check("1|the busy timeout is ten seconds" in res["summary"], "it read the file in its workspace")
        check(res["toolsets"] == ["file", "mcp-pyecho"], f"its toolsets: {res['toolsets']}")
        r = await call(
            session,
            "delegate_task",
            {"goal": 'Write it [tool write_file {"path": "out/made.txt", "content": "made"}]', "toolsets": ["read"]},
        )
        res = payload(r)["results"][0]
        check(res["toolsets"] == ["read", "mcp-pyecho"], "narrowed to read (MCP kept)")
        check("unknown tool" in res["summary"], "write_file is refused under read")
        r = await call(
            session,
            "delegate_task",
            {"goal": 'Shout [tool mcp__pyecho__shout {"text": "quiet please"}]'},
        )
        res = payload(r)["results"][0]
        check("QUIET PLEASE" in res["summary"], "the Python MCP server's tool answered")
        import os
        check(not os.path.exists(f"{PROJECT_C}/out/made.txt"), "nothing was written")

    await server(PROJECT_C, tools_story)

    say()
    say("## Project A again: background delegation for hosts without Tasks")

    async def background_story(session, init):
        r = await call(session, "delegate_task", {"goal": "Index the docs", "background": True})
        check(not r.is_error and payload(r)["status"] == "dispatched", "dispatched at once")
        unit = payload(r)["delegation_id"]
        r = await call(session, "wait_subagents", {"ids": [unit], "timeout_seconds": 30})
        got = payload(r)["results"][0]
        check(got["status"] == "delivered", "the result is delivered to the wait")
        check(got["result"]["results"][0]["summary"] == "Done: Index the docs", "its summary")
        r = await call(session, "wait_subagents", {"ids": [unit], "timeout_seconds": 0})
        again = payload(r)["results"][0]
        check(again["status"] == "already_delivered" and "result" not in again, "never twice")
        r = await call(session, "delegate_task", {"goal": "Count the files", "background": True})
        second = payload(r)["delegation_id"]
        delivered = []
        for _ in range(100):
            r = await call(session, "list_subagents", {})
            delivered = payload(r).get("delivered", [])
            if delivered:
                break
            await asyncio.sleep(0.1)
        check([d["delegation_id"] for d in delivered] == [second], "attached to a later tool result")
        r = await call(session, "list_subagents", {})
        check("delivered" not in payload(r), "and only once")

    await server(PROJECT_A, background_story)

    say()
    say("## Project C again: approvals, asked through elicitation")
    asked = []
    answers = [
        types.ElicitResult(action="accept", content={"approve": True, "always": False}),
        types.ElicitResult(action="decline"),
    ]

    async def elicit(context, params):
        asked.append(params.message)
        say(f"< elicitation/create: {params.message.splitlines()[0]}")
        return answers[len(asked) - 1]

    async def elicited_story(session, init):
        wipe = 'Clean up [tool mcp__pyecho__wipe {"target": "build"}]'
        r = await call(session, "delegate_task", {"goal": wipe})
        res = payload(r)["results"][0]
        check(len(asked) == 1 and "mcp__pyecho__wipe" in asked[0], "the host's user was asked")
        check("wiped build" in res["summary"], "approved: the destructive tool ran")
        check("approved by mcp:" in res["summary"], "the decision sits next to the call")
        r = await call(session, "delegate_task", {"goal": wipe})
        res = payload(r)["results"][0]
        check(len(asked) == 2, "asked again for the second call")
        check("wiped build" not in res["summary"], "declined: it never ran")
        check("declined by the host's user" in res["summary"], "the model read the refusal")
        r = await call(session, "list_approvals", {"all": True})
        states = sorted(a["state"] for a in payload(r)["approvals"])
        check(states == ["approved", "denied"], f"both decisions recorded: {states}")

    await server(PROJECT_C, elicited_story, elicitation_callback=elicit)

    say()
    say("## Project C again: a host without elicitation decides with decide_approval")

    async def tool_story(session, init):
        wipe = 'Clean up [tool mcp__pyecho__wipe {"target": "dist"}]'
        running = asyncio.create_task(session.call_tool("delegate_task", {"goal": wipe}))
        pending = []
        for _ in range(200):
            r = await call(session, "list_approvals", {})
            pending = payload(r)["approvals"]
            if pending:
                break
            await asyncio.sleep(0.1)
        check(len(pending) == 1 and pending[0]["tool"] == "mcp__pyecho__wipe", "one request waits")
        r = await call(session, "subagent_usage", {})
        attached = payload(r).get("approval_required", [])
        check([a["approval_id"] for a in attached] == [pending[0]["approval_id"]], "attached to a tool result")
        r = await call(session, "decide_approval", {"approval_id": pending[0]["approval_id"], "approve": True})
        check(payload(r)["state"] == "approved", "recorded")
        r = await call(session, "decide_approval", {"approval_id": pending[0]["approval_id"], "approve": False})
        check(r.is_error and payload(r)["code"] == "already_decided", "decided once")
        r = await running
        check("wiped dist" in payload(r)["results"][0]["summary"], "the waiting call ran")

    await server(PROJECT_C, tool_story)
    say()
    say("mcp-e2e: ok")


asyncio.run(main())
