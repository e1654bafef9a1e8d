"""The MCP tool offered to agents carries the agent's own actions only (#46 finding 5): recommend,
checkpoint_now, explain of its own checkpoints, advisory. No reset, no stats of every tenant, no
explain of anyone's checkpoint, so a prompt injection cannot wipe the fleet's cache. The real
`kvci mcp` over stdio and the real MCP client, against a real control server on loopback."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters

from kvci_plugin.api.client import ControlClient
from kvci_plugin.api.mcp_server import TOOL_NAME, build_mcp_server
from kvci_plugin.api.server import ControlServer, start_control_server
from kvci_plugin.connector.config import KVCIConfig

REPO = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
}
AGENT_ACTIONS = ["recommend", "checkpoint_now", "explain", "advisory"]


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def served(world: Any, state: Path) -> Iterator[ControlServer]:
    server = start_control_server(world.side, KVCIConfig(control_port=0, state_dir=state))
    yield server
    server.stop()


async def exercise(server: Any, calls: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    async with Client(server, read_timeout_seconds=60) as client:
        (tool,) = (await client.list_tools()).tools
        return tool, [await client.call_tool(TOOL_NAME, args) for args in calls]


def error_of(result: Any) -> dict[str, Any]:
    assert result.is_error, result
    return json.loads(result.content[0].text)["error"]


def check_agent_tool(tool: Any, results: list[Any], world: Any, acme: str, globex: str) -> None:
    assert tool.name == TOOL_NAME
    assert tool.input_schema["properties"]["action"]["enum"] == AGENT_ACTIONS
    assert "reset" not in tool.description and "wait_s" not in tool.input_schema["properties"]
    reset, stats, anyones, own, others, recommend = results
    assert error_of(reset)["code"] == "action_not_offered"
    assert error_of(stats)["code"] == "action_not_offered"
    assert error_of(anyones)["code"] == "invalid_request"  # explain names its own tenant or session
    assert own.structured_content["explanation"]["checkpoint_id"] == acme
    assert error_of(others)["code"] == "checkpoint_not_found"
    assert not recommend.is_error
    assert world.manager.generation == 0  # nothing was reset
    assert world.manager.explain(globex)["tenant"] == "globex"


def agent_calls(acme: str, globex: str) -> list[dict[str, Any]]:
    return [{"action": "reset"}, {"action": "ram_stats"},
            {"action": "explain", "checkpoint_id": globex},
            {"action": "explain", "checkpoint_id": acme, "tenant": "acme"},
            {"action": "explain", "checkpoint_id": globex, "tenant": "acme"},
            {"action": "recommend", "observation_json": {"tool_calls": 3}}]


def test_the_agent_tool_over_stdio_lists_only_agent_actions(
        served: ControlServer, world: Any, state: Path) -> None:
    acme, globex = world.checkpoint(tenant="acme"), world.checkpoint(tenant="globex")
    # `kvci mcp` takes the tenant token of the default place when given a state folder.
    params = StdioServerParameters(command=sys.executable, env=ENV, args=[
        "-m", "kvci_plugin.cli", "mcp", "--control-url", served.url, "--state-dir", str(state)])
    tool, results = anyio.run(exercise, params, agent_calls(acme, globex))
    check_agent_tool(tool, results, world, acme, globex)


def test_the_agent_tool_holds_no_operator_authority_even_with_the_operator_token(
        served: ControlServer, world: Any, state: Path) -> None:
    acme, globex = world.checkpoint(tenant="acme"), world.checkpoint(tenant="globex")
    with ControlClient(served.url, token_file=state / "control-operator.token") as client:
        tool, results = anyio.run(exercise, build_mcp_server(client), agent_calls(acme, globex))
    check_agent_tool(tool, results, world, acme, globex)
