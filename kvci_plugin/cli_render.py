"""How the `kvci` command line shows a response or a doctor's report to a person: rich tables.

`RENDER[action](body, console)` prints one `graph_kv_checkpoint` response; `render_doctor` prints
`kvci doctor`'s report. (`--json` prints bodies as they come, without this module.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text


def _kv_table(title: str, rows: Sequence[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, Text("-" if value is None else str(value)))
    return table


def _render_recommendation(rec: dict[str, Any], console: Console) -> None:
    score = rec.get("score")
    console.print(
        f"score [bold]{'-' if score is None else f'{score:.2f}'}[/], recommended tier "
        f"[bold]{rec['tier']}[/] (ram >= {rec['ram_threshold']}, disk >= {rec['disk_threshold']})",
        highlight=False,
    )
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
        console.print(
            Text(f"session {body['session_id']}: kvci refused the request: {kvci['error']}")
        )
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
    console.print(
        _kv_table(
            escape(f"checkpoint {e['checkpoint_id']}"),
            [
                ("tier", e["tier"]),
                ("tenant", e["tenant"]),
                ("trigger", e["trigger"]),
                ("pages", e["pages"]),
                ("bytes", e["bytes"]),
                ("pending", e["pending"]),
                ("persisting", e.get("persisting")),
                ("sources", ", ".join(e.get("source_ids", [])) or None),
                ("gate in force", e["gate_in_force"]),
                ("refusal", e.get("refusal")),
                ("persist error", e.get("persist_error")),
                ("retention expiry", e.get("retention_expiry")),
                ("tool call", _tool_call_text(e.get("tool_call"))),
                ("retained", _retention_text(e.get("retention"))),
            ],
        )
    )
    if e.get("recommendation"):
        _render_recommendation(e["recommendation"], console)
    _render_decision(e.get("eligibility_decision"), console)


def _tool_call_text(word: dict[str, Any] | None) -> str | None:
    """Whether its turn ended on a tool call: the engine's word and the one in force."""
    if not word:
        return None
    return f"detected {word.get('detected')}, in force {word.get('pending')}"


def _retention_text(given: dict[str, Any] | None) -> str | None:
    """The retention asked for the checkpoint, by whose word, and what became of it."""
    if not given:
        return None
    text = f"{given.get('status')}: {given.get('ttl_s')} s, by {given.get('by')}"
    if given.get("asked_ttl_s") is not None:
        text += f" (asked {given['asked_ttl_s']} s)"
    return text + (f", priority {given['priority']}" if given.get("priority") is not None else "")


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
    console.print(
        _kv_table(
            f"RAM tier policy ({policy['policy']})",
            [
                ("admitted", f"{policy['admitted']} ({policy['admitted_explicit']} explicit)"),
                ("displaced", policy["displaced"]),
                ("refused under pressure", policy["refused_under_pressure"]),
                ("evicted before any hit", policy["evicted_before_hit"]),
                ("contexts remembered", policy["tracked_anchors"]),
            ],
        )
    )
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


RENDER = {
    "recommend": _render_recommend,
    "checkpoint_now": _render_checkpoint_now,
    "promote": _render_promote,
    "explain": _render_explain,
    "ram_stats": _render_stats,
    "advisory": _render_advisory,
    "reset": _render_reset,
    "forget": _render_forget,
}


def render_doctor(report: dict[str, Any], console: Console) -> None:
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
        (
            "kvci",
            f"{kvci['version']} at {kvci['location']}"
            + (" (editable)" if kvci["editable"] else ""),
        ),
        ("python", report["python"]["version"]),
        (
            "vLLM",
            "not installed"
            if vllm is None
            else f"{vllm['distribution']} {vllm['version']}"
            + (f" (pins {vllm['torch_requirement']})" if vllm.get("torch_requirement") else ""),
        ),
        ("torch", torch_text),
        (
            "extension",
            "no build recorded" if ext.get("kind") is None else f"built for {ext['described']}",
        ),
        ("extension loads", loads),
        ("connector", conn["entry_point"] or "no entry point"),
        ("VLLM_PLUGINS", conn["VLLM_PLUGINS"] or "unset (every plugin loads)"),
        (
            "vLLM resolves KVCheckpointConnector",
            "-"
            if conn.get("resolves") is None
            else f"yes: {conn['class']}"
            if conn["resolves"]
            else f"no: {conn.get('error')}",
        ),
        (
            "state folder",
            state["path"]
            + (
                f" (mode {state['mode']}"
                + ("" if state.get("owned_by_me") else ", not owned by this user")
                + ")"
                if state.get("exists")
                else f": absent, {state.get('detail', '')}"
            ),
        ),
        (
            "secret",
            "-"
            if not state.get("exists")
            else f"mode {secret['mode']}, {secret.get('bytes', '?')} bytes"
            if secret.get("exists")
            else secret.get("detail", "-"),
        ),
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
