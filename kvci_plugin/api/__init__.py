"""The control surfaces: REST `POST /api/graph/kv_checkpoint` served from the engine process,
the MCP tool `graph_kv_checkpoint` that forwards to it, and the client both the command line
and the MCP server use (fastapi, uvicorn, mcp, httpx; never vLLM).

Modules: `schema` (requests and responses, one per action), `errors` (stable error codes),
`control` (the actions over the checkpoint manager), `app` (the FastAPI app, bearer check and
body cap), `access` (loopback and bearer rules), `server` (uvicorn on a daemon thread inside
EngineCore), `client`, `mcp_server`.
"""
