"""`kvci mcp`: the MCP tool `graph_kv_checkpoint`, forwarded to the engine's control endpoint.

The tool's input and output schemas are the REST request and response schemas, and every call
is one POST to the control endpoint: the MCP server holds no state and no authority of its own
(the caller's session credential travels in the arguments, the control bearer token, if any,
comes from `--token-file`). Served over stdio, or streamable HTTP on a loopback address.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import anyio
import mcp_types as types
import uvicorn
from mcp.server import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

import kvci_plugin
from kvci_plugin.api.access import is_loopback
from kvci_plugin.api.client import ControlCallError, ControlClient
from kvci_plugin.api.schema import tool_input_schema, tool_output_schema

TOOL_NAME = "graph_kv_checkpoint"
TOOL_DESCRIPTION = """KV-checkpoint control for the vLLM engine serving you (kvci).

action=recommend: score this moment (observation_json, evidence_bundle_json, context_bundle_json)
  at the engine's current RAM bar and get the advisory; takes no checkpoint.
action=checkpoint_now: keep the KV of your session's next finished request in RAM (session_id;
  session_token or tenant); persist=true also asks the eligibility gate for a disk copy.
action=promote: RAM -> disk through the gate, with authority derived from your session_token now.
action=explain: why a checkpoint exists and why it is where it is (checkpoint_id).
action=ram_stats: RAM-tier occupancy, the RAM admission bar, the gate in force and the
  registered scorers.
action=advisory: what your session's latest finished request was told (session_id; session_token
  or tenant) - the kvci reply a streamed response does not carry.
action=reset: operator action (no tenant credential: reaching the endpoint is the authority) -
  fence every checkpoint kvci holds, RAM and disk, so no KV from before it is loaded after it (after
  an in-place weight update); waits up to wait_s seconds for the engine: status done, or pending
  (applied before the engine's next lookup). Resets kvci's tiers only, not vLLM's prefix cache.
action=forget: crypto-erase a tenant's KV for every node (tenant, session_token with the
  kv:forget scope): its keys are destroyed, its checkpoints never load again.
Explicit observation_json fields win over anything derived from a bundle."""

Transport = Literal["stdio", "streamable-http"]


def build_mcp_server(client: ControlClient) -> Server[Any]:
    tool = types.Tool(name=TOOL_NAME, description=TOOL_DESCRIPTION,
                      input_schema=tool_input_schema(), output_schema=tool_output_schema())

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name != TOOL_NAME:
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}; this server has {TOOL_NAME!r}")
        try:
            # The client is synchronous; a worker thread keeps the session's event loop free.
            body = await anyio.to_thread.run_sync(client.call, params.arguments or {})
        except ControlCallError as exc:
            error = exc.body or {"error": {"code": exc.code, "message": exc.message, "fields": []}}
            return types.CallToolResult(content=[types.TextContent(text=json.dumps(error))], is_error=True)
        return types.CallToolResult(content=[types.TextContent(text=json.dumps(body))],
                                    structured_content=body)

    return Server("kvci", version=kvci_plugin.__version__,
                  instructions="graph_kv_checkpoint: score, keep, promote and explain KV checkpoints; "
                               "reset kvci's tiers.",
                  on_list_tools=list_tools, on_call_tool=call_tool)


def serve_mcp(client: ControlClient, transport: Transport = "stdio", *, host: str = "127.0.0.1",
              port: int = 8478) -> None:
    """Serve until stdin closes (stdio) or the process is interrupted (streamable HTTP)."""
    server = build_mcp_server(client)
    if transport == "stdio":
        anyio.run(_serve_stdio, server)
        return
    if not is_loopback(host):
        # The tool carries the control endpoint's authority: it is served to this host only.
        raise ValueError(f"kvci mcp serves streamable HTTP on loopback only, not {host!r}")
    app = server.streamable_http_app(host=host)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                  lifespan="on", server_header=False)).run()


async def _serve_stdio(server: Server[Any]) -> None:
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())
