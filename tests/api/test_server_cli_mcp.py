"""The control server on its uvicorn thread, the `kvci` command line and the MCP server, against
a real checkpoint manager (no engine): real sockets, real subprocesses, the real MCP client. The
servers generate their tokens in a state folder; the command line reads the operator's from it
(`--state-dir`), `kvci mcp` the tenants'."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
from control_support import operator_token, serve
from mcp import Client, StdioServerParameters

from kvci_plugin.api.client import ControlCallError, ControlClient
from kvci_plugin.api.mcp_server import TOOL_NAME
from kvci_plugin.api.roles import AGENT_ACTIONS
from kvci_plugin.api.schema import (
    REQUEST_ADAPTER,
    AdvisoryRequest,
    CheckpointNowRequest,
    ExplainRequest,
    ForgetRequest,
    PromoteRequest,
    RamStatsRequest,
    RecommendRequest,
    ResetRequest,
    tool_input_schema,
)
from kvci_plugin.api.server import ControlServer, ControlSettings, serve_control_plane
from kvci_plugin.cli import main
from kvci_plugin.worthiness import CheckpointObservation, render_advisory

REPO = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
}


@pytest.fixture(scope="module")
def served(module_world: Any) -> Iterator[ControlServer]:
    server = serve(module_world.plane, module_world.root / "state")
    yield server
    server.stop()


@pytest.fixture
def served_own(world: Any) -> Iterator[ControlServer]:
    """A control server over the test's own world, for a test that resets the tiers: a reset of
    the module's world would fence the other tests' checkpoints and move its keys under them."""
    server = serve(world.plane, world.root / "state")
    yield server
    server.stop()


def at(server: ControlServer, world: Any) -> list[str]:
    """The command-line options that reach `server` with the operator token of `world`'s state."""
    return ["--control-url", server.url, "--state-dir", str(world.root / "state")]


def token_file(
    path: Path, token: str = "s3cret-control-token-0123456789", mode: int = 0o600
) -> Path:
    path.write_text(token + "\n")
    path.chmod(mode)
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


# ---- the server thread ---------------------------------------------------------------------------

def test_served_from_a_thread_on_loopback(served: ControlServer, module_world: Any) -> None:
    assert served.url.startswith("http://127.0.0.1:") and served.port > 0
    with ControlClient(
        served.url, token_file=operator_token(module_world.root / "state")
    ) as client:
        stats = client.call({"action": "ram_stats"})["stats"]
    assert stats["gate_in_force"] == "derived_authority"


def test_every_call_needs_a_bearer_token(world: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a loopback address"):
        serve(world.plane, tmp_path / "state", host="0.0.0.0")  # no TLS

    server = serve(
        world.plane, tmp_path / "state", operator_token_file=token_file(tmp_path / "token")
    )
    url = server.url
    try:
        with ControlClient(url) as anonymous, pytest.raises(ControlCallError) as refused:
            anonymous.call({"action": "ram_stats"})
        assert (refused.value.status, refused.value.code) == (401, "unauthorized")
        with ControlClient(url, token_file=tmp_path / "token") as client:
            assert client.call({"action": "ram_stats"})["action"] == "ram_stats"
    finally:
        server.stop()
    with ControlClient(url, token_file=tmp_path / "token", timeout_s=2) as client, \
            pytest.raises(ControlCallError) as gone:
        client.call({"action": "ram_stats"})
    assert gone.value.code == "unreachable" and gone.value.status is None


@pytest.mark.parametrize(("token", "mode", "problem"), [
    ("s3cret-control-token-0123456789", 0o644, "group or others"),
    ("short", 0o600, "fewer than 16 bytes"),
    ("has spaces in the middle of it", 0o600, "printable ASCII"),
])
def test_token_file_rules(world: Any, tmp_path: Path, token: str, mode: int, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        serve(
            world.plane,
            tmp_path / "state",
            operator_token_file=token_file(tmp_path / "token", token, mode),
        )


def test_a_taken_port_fails_at_construction(served: ControlServer, world: Any) -> None:
    with pytest.raises(OSError, match="cannot bind"):
        serve_control_plane(
            world.plane, ControlSettings(port=served.port, state_dir=world.root / "state")
        )


# ---- the command line ----------------------------------------------------------------------------

def test_cli_actions_as_json(served: ControlServer, module_world: Any, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    url = [*at(served, module_world), "--json"]
    cid = module_world.checkpoint()
    code, out = run_cli(capsys, "explain", cid, *url)
    assert code == 0 and json.loads(out)["explanation"]["checkpoint_id"] == cid

    code, out = run_cli(
        capsys, "recommend", *url, "--observation", '{"evidence_spans": 2, "claims": 2}'
    )
    signals = {s["name"]: s["value"] for s in json.loads(out)["recommendation"]["signals"]}
    assert code == 0 and signals["grounding_density"] == 1.0

    (tmp_path / "bundle.json").write_text(json.dumps({"claims": [{"id": "c", "evidence": []}]}))
    code, out = run_cli(
        capsys, "recommend", *url, "--evidence-bundle", f"@{tmp_path / 'bundle.json'}"
    )
    signals = {s["name"]: s["value"] for s in json.loads(out)["recommendation"]["signals"]}
    assert code == 0 and signals["grounding_density"] == 0.0

    code, out = run_cli(capsys, "checkpoint-now", *url, "--session-id", "cli-1", "--tenant", "beta")
    assert code == 0 and json.loads(out)["armed"] is True
    assert ("beta", "cli-1") in module_world.side.armed

    code, out = run_cli(capsys, "explain", "f" * 32, *url)
    assert code == 1 and json.loads(out)["error"]["code"] == "checkpoint_not_found"

    code, out = run_cli(capsys, "advisory", *url, "--session-id", "cli-2", "--tenant", "beta")
    assert code == 1 and json.loads(out)["error"]["code"] == "no_advisory"
    rec = module_world.manager.advisor.recommend(CheckpointObservation(tool_calls=8, retrievals=6))
    module_world.side.verdicts.publish(
        "beta",
        "cli-2",
        {
            "recommendation": rec.model_dump(mode="json"),
            "advisory": render_advisory(rec),
            "trigger": None,
            "tier": "none",
            "checkpoint_id": None,
            "hit_tokens": 0,
            "not_kept": "opted out",
        },
        verified=False,
    )
    code, out = run_cli(capsys, "advisory", *url, "--session-id", "cli-2", "--tenant", "beta")
    assert code == 0 and json.loads(out)["kvci"]["not_kept"] == "opted out"
    code, out = run_cli(capsys, "advisory", *url[:-1], "--session-id", "cli-2", "--tenant", "beta")
    assert code == 0 and "session cli-2 (tenant beta)" in out and "opted out" in out
    assert "rebuild_cost" in out  # the recommendation's signals table


def test_cli_promote_exit_status_and_tables(
    served: ControlServer, module_world: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = at(served, module_world)
    cid = module_world.checkpoint()
    code, out = run_cli(capsys, "promote", cid, *url, "--tenant", "acme")
    assert code == 3
    assert "refused" in out and "verified_authority" in out

    (tmp_path / "session").write_text(module_world.session())
    code, out = run_cli(
        capsys, "promote", cid, *url, "--session-token-file", str(tmp_path / "session")
    )
    assert code == 0 and "persisted" in out

    code, out = run_cli(capsys, "explain", cid, *url)
    assert code == 0 and "ram+disk" in out and "labels_present" in out
    code, out = run_cli(capsys, "stats", *url)
    assert code == 0 and "RAM tier" in out and "rebuild_cost" in out and "disk tier" in out


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["recommend", "--control-url", "http://127.0.0.1:1", "--observation", "[1]"]) == 2
    assert main(["promote", "abc", "--session-token-file", str(tmp_path / "missing")]) == 2
    assert main(["serve", "m", "--control-host", "0.0.0.0", "--dry-run"]) == 2
    assert main(["serve", "m", "--kv-transfer-config", "{}", "--dry-run"]) == 2
    assert main(["stats", "--control-url", "http://127.0.0.1:1", "--state-dir", str(tmp_path)]) == 2
    assert main(["serve", "m", "--control-allowed-host", "evil.example:80", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--observation: must be a JSON object" in err and "not a loopback address" in err
    assert "needs TLS" in err and "--token-file not given" in err and "not a host name" in err


def test_cli_serve_passes_the_control_surface_settings(capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    code, out = run_cli(
        capsys, "serve", "m", "--control-host", "0.0.0.0", "--control-tls-cert-file", "c.pem",
        "--control-tls-key-file", "k.pem", "--control-allowed-host", "kvci.internal",
        "--control-tenant-token-file", str(tmp_path / "t"), "--dry-run")
    assert code == 0
    extra = json.loads(shlex.split(out)[-1])["kv_connector_extra_config"]
    assert extra == {
        "control_host": "0.0.0.0",
        "control_port": 8477,
        "control_tls_cert_file": "c.pem",
        "control_tls_key_file": "k.pem",
        "control_allowed_hosts": ["kvci.internal"],
        "control_tenant_token_file": str(tmp_path / "t"),
    }


def test_cli_serve_builds_the_vllm_command(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out = run_cli(
        capsys,
        "serve",
        "/models/tiny",
        "--ram-bytes",
        "2GiB",
        "--disk-root",
        str(tmp_path),
        "--credentials-key-file",
        str(tmp_path / "k"),
        "--credentials-algorithm",
        "HS256",
        "--no-system-trigger",
        "--kvci-config",
        '{"cache_gate": {"hit_rate_floor": 0.5}, "ram_bytes": "1GiB"}',
        "--port",
        "8001",
        "--block-size",
        "32",
        "--dry-run",
    )
    assert code == 0
    argv = shlex.split(out)
    assert argv[:5] == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/tiny",
    ]
    assert argv[5:9] == ["--port", "8001", "--block-size", "32"]
    assert argv[9] == "--kv-transfer-config"
    transfer = json.loads(argv[10])
    assert transfer["kv_connector_module_path"] == "kvci_plugin.connector"
    assert transfer["kv_connector_extra_config"] == {
        "cache_gate": {"hit_rate_floor": 0.5},
        "ram_bytes": "2GiB",
        "disk_root": str(tmp_path),
        "system_trigger": False,
        "credentials": {"algorithm": "HS256", "key_file": str(tmp_path / "k")},
        "control_host": "127.0.0.1",
        "control_port": 8477,
    }


def test_cli_stats_shows_the_admission_bar(world: Any, capsys: pytest.CaptureFixture[str]) -> None:
    bar = world.moving_bar()
    for anchor in (b"a", b"b", b"c"):  # three system checkpoints evicted unused: the bar rises 0.03
        bar.admitted(anchor)
        bar.evicted([anchor])
    server = serve(world.plane, world.root / "state")
    try:
        code, out = run_cli(capsys, "stats", *at(server, world), "--json")
        assert code == 0
        assert json.loads(out)["stats"]["admission"] == {
            "mode": "pressure", "threshold": bar.threshold, "wasted_writes": 3, "missed_reuses": 0,
            "paid_writes": 0}
        code, out = run_cli(capsys, "stats", *at(server, world))
    finally:
        server.stop()
    assert code == 0
    cells = [[c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines()]
    rows = {row[0]: row[1] for row in cells if len(row) == 2}
    assert "RAM admission bar" in out
    assert (rows["mode"], rows["threshold"]) == ("pressure", "0.58")
    assert (rows["wasted writes"], rows["missed reuses"], rows["paid writes"]) == ("3", "0", "0")


def test_cli_stats_shows_what_the_tier_policy_did(
    world: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    world.checkpoint()
    server = serve(world.plane, world.root / "state")
    try:
        code, out = run_cli(capsys, "stats", *at(server, world), "--json")
        assert code == 0
        policy = json.loads(out)["stats"]["policy"]
        assert (policy["policy"], policy["admitted"], policy["displaced"]) == ("lru", 1, 0)
        code, out = run_cli(capsys, "stats", *at(server, world))
    finally:
        server.stop()
    cells = [[c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines()]
    rows = {row[0]: row[1] for row in cells if len(row) == 2}
    assert "RAM tier policy (lru)" in out
    assert (rows["admitted"], rows["refused under pressure"]) == ("1 (1 explicit)", "0")


def test_cli_reset(world: Any, capsys: pytest.CaptureFixture[str]) -> None:
    cid = world.checkpoint()
    server = serve(world.plane, world.root / "state")
    url = at(server, world)
    try:
        code, out = run_cli(capsys, "reset", *url, "--json")
        assert code == 0
        body = json.loads(out)
        assert (
            body["status"],
            body["generation"],
            body["ram_checkpoints"],
            body["disk_checkpoints"],
        ) == ("done", 1, 1, 0)
        code, out = run_cli(capsys, "explain", cid, *url, "--json")
        assert code == 1 and json.loads(out)["error"]["code"] == "checkpoint_fenced"

        world.checkpoint()
        code, out = run_cli(capsys, "reset", *url)
        assert code == 0
        cells = [
            [c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines()
        ]
        rows = {row[0]: row[1] for row in cells if len(row) == 2}
        assert "kvci cache reset: done" in out
        assert (
            rows["generation"],
            rows["RAM checkpoints fenced"],
            rows["disk checkpoints fenced"],
        ) == ("2", "1", "0")
        assert "not reset" in " ".join(out.split())  # vLLM's prefix cache is not

        world.side.idle = True  # no request arrives: the engine applies it at its next hook
        code, out = run_cli(capsys, "reset", *url, "--wait-s", "0.1")
        assert code == 0 and "kvci cache reset: pending" in out
        assert "before its next lookup" in " ".join(out.split())
        code, out = run_cli(capsys, "reset", *url, "--wait-s", "61", "--json")
        assert code == 1 and json.loads(out)["error"]["code"] == "invalid_request"
    finally:
        server.stop()
    world.side.step()
    assert world.manager.generation == 3


def test_cli_forget(world: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvci_plugin.governance import FORGET_SCOPE

    cid = world.checkpoint()
    server = serve(world.plane, world.root / "state")
    url = at(server, world)
    weak = token_file(tmp_path / "weak.jwt", world.session())
    strong = token_file(tmp_path / "strong.jwt", world.session(scopes=[FORGET_SCOPE]))
    try:
        code, out = run_cli(capsys, "forget", "--tenant", "acme", "--session-token-file", str(weak),
                            *url, "--json")
        assert code == 1 and json.loads(out)["error"]["code"] == "credential_refused"
        code, out = run_cli(capsys, "forget", "--tenant", "acme", "--session-token-file",
                            str(strong), *url)
        assert code == 0 and "kvci forget: acme" in out
        rows = {
            row[0]: row[1]
            for row in (
                [c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines()
            )
            if len(row) == 2
        }
        assert rows["RAM checkpoints forgotten"] == "1" and rows["key material"] == "none existed"
        code, out = run_cli(capsys, "explain", cid, *url, "--json")
        assert code == 1 and json.loads(out)["error"]["code"] == "checkpoint_forgotten"
    finally:
        server.stop()
    with pytest.raises(SystemExit):
        main(["forget", "--tenant", "acme"])  # a credential file is required


def test_cli_serve_passes_the_ram_bar_choices(capsys: pytest.CaptureFixture[str]) -> None:
    def extra(*flags: str) -> dict[str, Any]:
        code, out = run_cli(capsys, "serve", "m", "--no-control", *flags, "--dry-run")
        assert code == 0
        config: dict[str, Any] = json.loads(shlex.split(out)[-1])["kv_connector_extra_config"]
        return config

    assert extra() == {}  # unset: no choice, the connector's defaults stand
    assert extra("--ram-admission", "fixed") == {"ram_admission": "fixed"}
    assert extra(
        "--ram-threshold",
        "0.5",
        "--ram-admission",
        "pressure",
        "--ram-threshold-min",
        "0.35",
        "--kvci-config",
        '{"ram_admission": "fixed"}',
    ) == {"ram_threshold": 0.5, "ram_admission": "pressure", "ram_threshold_min": 0.35}
    with pytest.raises(SystemExit) as bad:
        main(["serve", "m", "--ram-admission", "moving", "--dry-run"])
    assert bad.value.code == 2 and "invalid choice: 'moving'" in capsys.readouterr().err


# ---- MCP -----------------------------------------------------------------------------------------

def test_mcp_tool_schema_is_one_flat_object() -> None:
    schema = tool_input_schema()
    assert schema["type"] == "object" and "oneOf" not in schema and schema["required"] == ["action"]
    assert schema["properties"]["action"]["enum"] == [
        "recommend", "checkpoint_now", "promote", "explain", "ram_stats", "advisory", "reset",
        "forget"]
    models = (
        RecommendRequest,
        CheckpointNowRequest,
        PromoteRequest,
        ExplainRequest,
        RamStatsRequest,
        AdvisoryRequest,
        ResetRequest,
        ForgetRequest,
    )
    assert set(schema["properties"]) == set().union(*(m.model_fields for m in models))
    validator = jsonschema.Draft202012Validator(schema)
    for request in ({"action": "recommend", "evidence_bundle_json": {"claims": []}},
                    {"action": "checkpoint_now", "session_id": "s", "persist": True},
                    {"action": "promote", "checkpoint_id": "ab12", "delegation_tokens": ["t"]},
                    {"action": "explain", "checkpoint_id": "ab12", "tenant": "acme"},
                    {"action": "ram_stats"},
                    {"action": "advisory", "session_id": "s", "tenant": "acme"},
                    {"action": "reset"},
                    {"action": "reset", "wait_s": 2.5},
                    {"action": "forget", "tenant": "acme", "session_token": "t"}):
        assert not list(validator.iter_errors(request)), request
        REQUEST_ADAPTER.validate_python(request)
    assert list(validator.iter_errors({"action": "recommend", "surprise": 1}))
    wait_s = schema["properties"]["wait_s"]
    assert (wait_s["type"], wait_s["minimum"], wait_s["maximum"]) == ("number", 0, 60)
    assert wait_s["description"].endswith("; action reset")
    for bad in ({"action": "reset", "wait_s": 61}, {"action": "reset", "wait_s": "5"}):
        assert list(validator.iter_errors(bad)), bad


async def _exercise_mcp(server: Any, checkpoint_id: str) -> dict[str, Any]:
    async with Client(server, read_timeout_seconds=60) as client:
        tools = (await client.list_tools()).tools
        results = {"tools": tools}
        for args in (
            {"action": "recommend", "observation_json": {"evidence_spans": 1, "claims": 2}},
            {"action": "explain", "checkpoint_id": checkpoint_id, "tenant": "acme"},
            {"action": "ram_stats"},
            {"action": "explain", "checkpoint_id": "0" * 32, "tenant": "acme"},
            {"action": "reset", "wait_s": 5},
            {"action": "explain", "checkpoint_id": checkpoint_id, "tenant": "acme"},
        ):
            key = f"{args['action']}:{args.get('checkpoint_id', '')}"
            results[key if key not in results else f"{key}:after-reset"] = await client.call_tool(
                TOOL_NAME, args
            )
        return results


def check_mcp_results(results: dict[str, Any], checkpoint_id: str) -> None:
    """The agent tool: its own actions answered, the operator's (ram_stats, reset) refused."""
    (tool,) = results["tools"]
    assert tool.name == TOOL_NAME and tool.input_schema == tool_input_schema(AGENT_ACTIONS)
    rec = results["recommend:"]
    assert not rec.is_error
    signals = {s["name"]: s["value"] for s in rec.structured_content["recommendation"]["signals"]}
    assert signals["grounding_density"] == 0.5
    explained = results[f"explain:{checkpoint_id}"]
    assert explained.structured_content["explanation"]["checkpoint_id"] == checkpoint_id
    assert json.loads(explained.content[0].text) == explained.structured_content
    missing = results[f"explain:{'0' * 32}"]
    assert (
        missing.is_error
        and json.loads(missing.content[0].text)["error"]["code"] == "checkpoint_not_found"
    )
    for refused in (results["ram_stats:"], results["reset:"]):
        assert (
            refused.is_error
            and json.loads(refused.content[0].text)["error"]["code"] == "action_not_offered"
        )
    after = results[f"explain:{checkpoint_id}:after-reset"]  # the refused reset fenced nothing
    assert after.structured_content["explanation"]["checkpoint_id"] == checkpoint_id


def test_mcp_over_stdio(served_own: ControlServer, world: Any) -> None:
    cid = world.checkpoint()
    params = StdioServerParameters(command=sys.executable, env=ENV,
                                   args=["-m", "kvci_plugin.cli", "mcp", *at(served_own, world)])
    check_mcp_results(anyio.run(_exercise_mcp, params, cid), cid)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_mcp_over_streamable_http(served_own: ControlServer, world: Any) -> None:
    cid = world.checkpoint()
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvci_plugin.cli", "mcp", *at(served_own, world),
         "--transport", "streamable-http", "--port", str(port)], env=ENV)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "kvci mcp exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "kvci mcp did not listen"
                time.sleep(0.2)
        check_mcp_results(anyio.run(_exercise_mcp, f"http://127.0.0.1:{port}/mcp", cid), cid)
    finally:
        process.terminate()
        process.wait(30)


def test_mcp_streamable_http_stays_on_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mcp", "--transport", "streamable-http", "--host", "0.0.0.0"]) == 2
    assert "loopback only" in capsys.readouterr().err
