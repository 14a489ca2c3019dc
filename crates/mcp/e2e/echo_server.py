"""A small MCP server on the official Python SDK (mcp 2.x `MCPServer`, the
former FastMCP), over stdio: the children's `mcp-pyecho` toolset in
`cargo xtask mcp-e2e`."""

from mcp import types
from mcp.server.mcpserver import MCPServer

app = MCPServer("pyecho")


@app.tool()
def shout(text: str) -> str:
    """Return the text in capitals."""
    return text.upper()


@app.tool(annotations=types.ToolAnnotations(destructive_hint=True))
def wipe(target: str) -> str:
    """Pretend to delete `target` (annotated destructiveHint: a child's call
    waits for approval)."""
    return f"wiped {target}"


if __name__ == "__main__":
    app.run()
