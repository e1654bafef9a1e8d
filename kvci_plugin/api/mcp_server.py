"""`kvci mcp`: the MCP tool `graph_kv_checkpoint` offered to agents, forwarded to the engine's
control endpoint.

The tool carries the agent's own actions only (`roles.AGENT_ACTIONS`: recommend, checkpoint_now,
explain of its own checkpoints, advisory): no reset, no stats of every tenant, no promote or
forget, whatever token the server holds, so a prompt injection cannot wipe the fleet's cache. Any
other action is refused here (`action_not_offered`) and never forwarded; an explain must name the
agent's tenant or session credential. Its input and output schemas are the REST request and
response schemas of those actions, and every call is one POST to the control endpoint: the MCP
server holds no state and no authority of its own (the caller's session credential travels in the
arguments; the bearer token, by default the tenant token, comes from `--token-file`). Served over
stdio, or streamable HTTP on a loopback address.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import anyio
import mcp_types as types
import uvicorn
from mcp.server import Server
from mcp.server.stdio import stdio_server
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError

import kvci_plugin
from kvci_plugin.api.access import is_loopback
from kvci_plugin.api.client import ControlCallError, ControlClient
from kvci_plugin.api.errors import ErrorCode
from kvci_plugin.api.roles import AGENT_ACTIONS
from kvci_plugin.api.schema import tool_input_schema, tool_output_schema

TOOL_NAME = "graph_kv_checkpoint"
# The tool's own code, beside the server's ErrorCode values: an action the agent is not offered.
ACTION_NOT_OFFERED = "action_not_offered"
TOOL_DESCRIPTION = """KV-checkpoint control for the vLLM engine serving you (kvci).

action=recommend: score this moment (observation_json, evidence_bundle_json, context_bundle_json)
  at the engine's current RAM bar and get the advisory; takes no checkpoint.
action=checkpoint_now: keep the KV of your session's next finished request in RAM (session_id;
  session_token or tenant); persist=true also asks the eligibility gate for a disk copy, with the
  credential that request carries.
action=explain: why one of your checkpoints exists and why it is where it is (checkpoint_id; your
  session_token or tenant).
action=advisory: what your session's latest finished request was told (session_id; session_token
  or tenant) - the kvci reply a streamed response does not carry.
Explicit observation_json fields win over anything derived from a bundle."""

Transport = Literal["stdio", "streamable-http"]


def _refusal(code: str, message: str) -> types.CallToolResult:
    error = {"error": {"code": code, "message": message, "fields": []}}
    return types.CallToolResult(content=[types.TextContent(text=json.dumps(error))], is_error=True)


def _not_offered(arguments: dict[str, Any]) -> types.CallToolResult | None:
    """The refusal of a call the agent tool does not forward; None for one it does."""
    action = arguments.get("action")
    if action not in AGENT_ACTIONS:
        return _refusal(
            ACTION_NOT_OFFERED,
            f"this tool offers the actions {', '.join(AGENT_ACTIONS)}; "
            f"{action!r} is not one of them",
        )
    if (
        action == "explain"
        and arguments.get("tenant") is None
        and arguments.get("session_token") is None
    ):
        return _refusal(ErrorCode.INVALID_REQUEST.value, "explain names your tenant or your "
                        "session_token: this tool explains your own checkpoints")
    return None


def build_mcp_server(client: ControlClient) -> Server[Any]:
    tool = types.Tool(name=TOOL_NAME, description=TOOL_DESCRIPTION,
                      input_schema=tool_input_schema(AGENT_ACTIONS),
                      output_schema=tool_output_schema(AGENT_ACTIONS))

    async def list_tools(
        ctx: Any, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name != TOOL_NAME:
            raise MCPError(
                types.INVALID_PARAMS, f"unknown tool {params.name!r}; this server has {TOOL_NAME!r}"
            )
        arguments = dict(params.arguments or {})
        refused = _not_offered(arguments)
        if refused is not None:
            return refused
        try:
            # The client is synchronous; a worker thread keeps the session's event loop free.
            body = await anyio.to_thread.run_sync(client.call, arguments)
        except ControlCallError as exc:
            error = exc.body or {"error": {"code": exc.code, "message": exc.message, "fields": []}}
            return types.CallToolResult(
                content=[types.TextContent(text=json.dumps(error))], is_error=True
            )
        return types.CallToolResult(content=[types.TextContent(text=json.dumps(body))],
                                    structured_content=body)

    return Server("kvci", version=kvci_plugin.__version__,
                  instructions="graph_kv_checkpoint: score and keep your KV checkpoints, explain "
                               "yours, read your session's advisory.",
                  on_list_tools=list_tools, on_call_tool=call_tool)


def check_mcp_host(transport: Transport, host: str) -> None:
    """Streamable HTTP on loopback only: the tool carries its token's authority (for its
    actions), and the endpoint has no authentication of its own."""
    if transport == "streamable-http" and not is_loopback(host):
        raise ValueError(f"kvci mcp serves streamable HTTP on loopback only, not {host!r}")


def serve_mcp(client: ControlClient, transport: Transport = "stdio", *, host: str = "127.0.0.1",
              port: int = 8478) -> None:
    """Serve until stdin closes (stdio) or the process is interrupted (streamable HTTP)."""
    check_mcp_host(transport, host)
    server = build_mcp_server(client)
    if transport == "stdio":
        anyio.run(_serve_stdio, server)
        return
    # Host and Origin checked on every request (DNS rebinding), for any loopback address.
    names = sorted(
        {"127.0.0.1", "localhost", "[::1]", f"[{host.strip('[]')}]" if ":" in host else host}
    )
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=[f"{n}:*" for n in names],
        allowed_origins=[f"http://{n}:*" for n in names])
    app = server.streamable_http_app(host=host, transport_security=security)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                  lifespan="on", server_header=False)).run()


async def _serve_stdio(server: Server[Any]) -> None:
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())
