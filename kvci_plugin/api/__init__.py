"""The control surfaces: REST `POST /api/graph/kv_checkpoint` served from the engine process,
the MCP tool `graph_kv_checkpoint` that forwards to it, and the client both the command line
and the MCP server use (fastapi, uvicorn, mcp, httpx; never vLLM).

Modules: `schema` (requests and responses, one per action), `errors` (stable error codes),
`roles` (the operator, the tenant and the agent, and what each is offered), `control` (the
actions over the checkpoint manager, per role), `app` (the FastAPI app), `guards` (the ASGI
layers in front of it: Host and Origin allow-lists, bearer tokens, body cap), `access` (where it
may be served, the allow-lists), `tokens` (the bearer token files), `server` (uvicorn on a daemon
thread inside EngineCore, TLS off loopback), `client`, `mcp_server` (the agent's tool).
"""
